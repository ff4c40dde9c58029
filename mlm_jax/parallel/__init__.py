"""Hand-written shard_map pieces that the compiler cannot derive, and what installs them:
context-parallel attention (ring p2p, all-gather, all-to-all over the `context` mesh axis) and
its causal load balance, the expert-parallel token dispatch, the data-parallel per-rank pieces,
and `tracing` (the mesh and trace context a step is traced in)."""

from mlm_jax.parallel.chunks import local_order, permute_seq, seq_order, unpermute_seq
from mlm_jax.parallel.context import COMM_TYPES, context_attention
from mlm_jax.parallel.tracing import tracing

__all__ = ["COMM_TYPES", "context_attention", "local_order", "permute_seq", "seq_order", "tracing",
           "unpermute_seq"]
