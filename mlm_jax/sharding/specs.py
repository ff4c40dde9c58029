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


def entry_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one spec entry (None, a name or a tuple of names), in order."""
    return tuple(a for a in (entry if isinstance(entry, tuple) else (entry,)) if a)


def holds(spec: P, axis: str) -> bool:
    """Whether `spec` splits some dim over mesh axis `axis`."""
    return any(axis in entry_axes(e) for e in spec)


def blocks_over_pipe(spec: P, shape, dim: int, mesh_sizes: dict[str, int]) -> P:
    """`spec` with dim `dim` split over `pipe` first, then over the axes `spec` splits it over:
    each stage holds a contiguous block of it, split further inside as before (the untied LM
    head's vocab, see `Pipeline.stored_specs`); `spec` itself when the dim does not divide
    evenly or `pipe` has size 1."""
    parts = list(spec) + [None] * (len(shape) - len(spec))
    axes = entry_axes(parts[dim])
    if mesh_sizes[PIPE] == 1 or shape[dim] % (mesh_sizes[PIPE] * math.prod(mesh_sizes[a] for a in axes)):
        return spec
    parts[dim] = (PIPE, *axes)
    return P(*parts)


def pipe_scatter_dim(compute: P, storage: P, mesh_sizes: dict[str, int]) -> tuple[int] | tuple[()]:
    """(dim,): where the gradient of a leaf every pipeline stage computes with (as `compute`;
    stored as `storage`) is reduce-scattered over `pipe`: the dim on which storage puts `pipe`
    right after the leaf's compute axes, so that each device's block of the sum lies in its own
    compute shard. (): summed whole (a leaf storage does not split so)."""
    def axes(entry):  # the axes of a spec entry that split it (size > 1)
        return tuple(a for a in entry_axes(entry) if mesh_sizes[a] > 1)

    for dim, entry in enumerate(storage):
        computed = axes(compute[dim]) if dim < len(compute) else ()
        if axes(entry)[:len(computed) + 1] == (*computed, PIPE):
            return (dim,)
    return ()


def with_pipe(spec: P, split: tuple[int] | tuple[()]) -> P:
    """`spec` with `pipe` added after the axes on dim `split` (`pipe_scatter_dim`): the layout of
    a gradient reduce-scattered over `pipe` there; `spec` itself when `split` is ()."""
    if not split:
        return spec
    parts = list(spec) + [None] * (split[0] + 1 - len(spec))
    entry = parts[split[0]]
    parts[split[0]] = (*entry_axes(entry), PIPE)
    return P(*parts)


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
    held = {a for entry in spec for a in entry_axes(entry)}
    return P(pick_axes(ranks, lambda a: a not in held), *spec)
