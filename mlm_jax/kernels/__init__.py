"""Hand-written kernels (Pallas) where XLA's own code for an op does more work than it needs."""

from mlm_jax.kernels.grouped_matmul import Tiles, grouped_matmul

__all__ = ["Tiles", "grouped_matmul"]
