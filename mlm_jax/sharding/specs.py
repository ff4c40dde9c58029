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

from mlm_jax.sharding.mesh import PIPE
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


def pipe_scatter_dim(compute: P, storage: P, mesh_sizes: dict[str, int]) -> tuple[int] | tuple[()]:
    """(dim,): the dim a pipeline-shared leaf (computed with as `compute`, stored as `storage`)
    has its gradient reduce-scattered over `pipe` on, inside the pipeline's shard_map; () for a
    plain sum over `pipe`: a leaf not stored split over `pipe`, or one a non-manual axis shards
    while it computes (tensor parallelism: there XLA would first gather the operand over that
    axis, more bytes than the sum)."""
    if any(mesh_sizes[a] > 1 for entry in compute if entry is not None
           for a in (entry if isinstance(entry, tuple) else (entry,))):
        return ()
    for dim, entry in enumerate(storage):
        axes = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a and mesh_sizes[a] > 1)
        if axes[:1] == (PIPE,):
            return (dim,)
    return ()


def pipe_scattered(split: tuple[int] | tuple[()]) -> P:
    """A shard_map out spec for a leaf's gradient reduce-scattered over `pipe` on dim `split`
    (`pipe_scatter_dim`; replicated when `split` is ())."""
    return P(*([None] * split[0]), PIPE) if split else P()


def pipe_blocks() -> P:
    """A shard_map in/out spec: dim 0 split over `pipe` (each stage its own block)."""
    return P(PIPE)


def stage_chunks(spec: P) -> P:
    """A stage's layer leaf seen as [V, Lmax, ...] inside the pipeline (dim 0 of `spec` is the
    stacked layers dim, here split into the two leading, unsharded dims)."""
    return P(None, None, *tuple(spec)[1:])


def pick_axes(axes, keep):
    """A rule's or spec entry's mesh axes (None, a name or a tuple) cut to those `keep` accepts."""
    kept = tuple(a for a in (axes if isinstance(axes, tuple) else (axes,)) if a is not None and keep(a))
    return kept[0] if len(kept) == 1 else (kept or None)


def manual_part(spec: P, axes) -> P:
    """`spec` cut to the mesh axes `axes` (the in spec of a shard_map manual over `axes`)."""
    return P(*(pick_axes(entry, lambda a: a in axes) for entry in spec))


def auto_part(spec: P, manual) -> P:
    """`spec` without the mesh axes `manual` (a sharding constraint inside a shard_map manual
    over them)."""
    return P(*(pick_axes(entry, lambda a: a not in manual) for entry in spec))


def rows_over(ranks) -> P:
    """A shard_map in spec for a batch [microbatch, batch, seq]: rows split over the mesh axes
    `ranks` (a per-rank body's own rows)."""
    return P(None, ranks)


def stacked_per_rank(spec: P, ranks) -> P:
    """A shard_map out spec for one per-rank partial sum of a leaf held as `spec` (manual axes
    only): a new leading dim over the rank axes that hold partial sums of it (`data` alone for
    an expert's weights, which only their own `expert` rank holds; every rank axis for the
    rest), summed once outside."""
    held = {a for entry in spec for a in (entry if isinstance(entry, tuple) else (entry,))}
    return P(pick_axes(ranks, lambda a: a not in held), *spec)
