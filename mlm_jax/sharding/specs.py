"""The PartitionSpecs the step, the pipeline and loading need beyond the logical rules, each
behind a function so that none is written by hand elsewhere.

Batches: a training batch is [microbatch, batch, seq] with batch split like the activations'
`batch` dim; a loading batch is [batch, seq]. Pipelined layer parameters are stored
[P*V*Lmax, ...] with dim 0 over `pipe` (mlm_jax/pipeline/layout.py); inside the pipeline's
shard_map a stage sees its own [V, Lmax, ...] block of them.
"""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec as P

from mlm_jax.sharding.mesh import DATA, PIPE
from mlm_jax.sharding.rules import activation_rules, logical_to_spec

MICROBATCHED = (None, "batch", "context_seq")  # [microbatch, batch, seq]
TOKENS = ("batch", None)  # [batch, seq]


def replicated() -> P:
    """Whole on every device."""
    return P()


def batch_spec() -> P:
    """A training batch [microbatch, batch/(data, expert), seq/context]; the sequence is stored
    in the load-balanced chunk order (mlm_jax/parallel/chunks.py), so each context rank's
    slice is its two chunks."""
    return logical_to_spec(MICROBATCHED, activation_rules(False))


def batch_axes() -> tuple[str, ...]:
    """The mesh axes a batch's rows are split over."""
    part = batch_spec()[1]
    return () if part is None else (part if isinstance(part, tuple) else (part,))


def tokens_spec(rows: int, mesh_sizes: dict[str, int]) -> P:
    """[batch, seq] rows split like a training batch when they divide evenly, else replicated."""
    split = math.prod(mesh_sizes[a] for a in batch_axes())
    return logical_to_spec(TOKENS, activation_rules(False)) if rows % split == 0 else P()


def pipe_stored(spec: P) -> P:
    """A stacked layer leaf in the pipelined storage: dim 0 over `pipe`, the rest as `spec`."""
    return P(PIPE, *tuple(spec)[1:])


def pipe_blocks() -> P:
    """A shard_map in/out spec: dim 0 split over `pipe` (each stage its own block)."""
    return P(PIPE)


def stage_chunks(spec: P) -> P:
    """A stage's layer leaf seen as [V, Lmax, ...] inside the pipeline (dim 0 of `spec` is the
    stacked layers dim, here split into the two leading, unsharded dims)."""
    return P(None, None, *tuple(spec)[1:])


def data_rows() -> P:
    """A shard_map in spec for a batch [microbatch, batch, seq]: rows split over `data` (the
    pipeline's per-rank schedule; context and expert are 1 there)."""
    return P(None, DATA)


def per_rank(spec: P) -> P:
    """A shard_map out spec: a new leading dim over `data` (one entry per data-parallel rank,
    summed once outside), then `spec`."""
    return P(DATA, *spec)
