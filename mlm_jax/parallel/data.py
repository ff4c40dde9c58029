"""Data parallelism's hand-placed pieces, shared by the plain step (`mlm_jax/step.py`) and the
pipeline (`mlm_jax/pipeline/runtime.py`): ZeRO's parameter gather once per step, the per-rank
body that accumulates each rank's own gradients, and the one gradient reduction over the ranks.

Everything else of data parallelism (the batch split over `data`, ZeRO's storage) is a rules
choice the compiler derives.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from mlm_jax.config import Config
from mlm_jax.models.layers import compute_dtype, used_in_compute_dtype
from mlm_jax.sharding import trace
from mlm_jax.sharding.mesh import DATA, EXPERT
from mlm_jax.sharding.rules import active_rules
from mlm_jax.sharding.specs import pick_axes


def reduces_once(mesh: Mesh, aux_names=()) -> bool:
    """Whether a step accumulates per-rank gradients and reduces them once after its microbatches
    (the plain step's `reduce_once_loss_and_grads`, the pipeline's per-rank schedule): on a mesh
    with data parallelism (expert parallelism is carved out of it), and when every aux scalar the
    model reports (`aux_names`) is a MoE rank share ("moe_...": summed over the ranks it gives
    the whole microbatch's); other aux are batch-wide statistics a per-rank body would change.

    Dropout masks are a function of each element's global index (`models.layers.dropout`, the
    trace's `row_offset`), so a rank running its own rows draws the masks one device draws for
    them. Context parallelism's ring attention is a shard_map over every axis not yet manual, so
    it nests in the per-rank body as it nests in the pipeline's. A MoE router keeps its
    whole-microbatch statistics and decisions there (the trace's `rank_split`: the counts are
    summed over the ranks, a few scalars per layer; capacity dropping counts the earlier ranks'
    tokens or ranks every rank's scores). With expert parallelism the per-rank body is manual
    over `expert` too: each rank holds its own experts and rows, and the dispatch's all-to-all
    (tokens, not gradients) runs in it (`parallel/experts.py`).
    """
    sizes = dict(mesh.shape)
    return sizes[DATA] * sizes[EXPERT] > 1 and all(name.startswith("moe_") for name in aux_names)


def rank_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the per-rank body is manual over: `data`, and `expert` where the mesh has
    expert parallelism (the batch rows are split over both)."""
    return (DATA, EXPERT) if dict(mesh.shape)[EXPERT] > 1 else (DATA,)


def without_manual(axes, manual=(DATA,)):
    """A rule's mesh axes without those manual inside a per-rank shard_map (`data`, and
    `expert` with expert parallelism)."""
    return pick_axes(axes, lambda a: a not in manual)


@contextlib.contextmanager
def per_rank_trace(mesh: Mesh, ranks: tuple[str, ...], rows_here: int):
    """Trace a per-rank body (manual over `ranks`, holding `rows_here` rows of each microbatch):
    the activation rules without the manual axes, dropout masks of this rank's global rows,
    and the MoE router's statistics summed over the ranks (see `reduces_once`)."""
    inner = tuple((name, without_manual(axes, ranks)) for name, axes in active_rules())
    num_ranks = math.prod(dict(mesh.shape)[a] for a in ranks)
    first_row = jax.lax.axis_index(ranks) * rows_here
    with trace.using(rules=inner, row_offset=first_row, rank_split=(ranks, num_ranks)):
        yield


def gather_once(params, storage, compute, dtype, widen: bool = True):
    """Storage -> compute sharding (ZeRO's all-gather), the leaves the model reads in the compute
    dtype anyway sent in `dtype` (bf16 under --bf16, as Megatron's distributed optimizer gathers its
    bf16 parameter copy) and, with `widen`, widened back to fp32 after the gather, which is exact:
    the model re-casts them, so a gradient taken at the result is an fp32 gradient of the same
    step. Without `widen` those leaves stay in `dtype` (the model's cast is then a no-op, and
    their gradients, which the cast's transpose would only widen, come in `dtype`: the caller
    accumulates them in fp32). `dtype` None: everything in fp32. The cast is pinned to the
    storage sharding, or propagation would replicate the fp32 input and gather that."""
    if dtype is None:
        return jax.lax.with_sharding_constraint(params, compute)
    low = jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(dtype) if used_in_compute_dtype(path) else x, params)
    low = jax.lax.with_sharding_constraint(low, storage)  # cast on the shards...
    gathered = jax.lax.with_sharding_constraint(low, compute)  # ...then gathered
    if not widen:
        return gathered
    return jax.tree.map(lambda x, p: x.astype(p.dtype), gathered, params)


def zero_gather_dtype(cfg: Config):
    """The dtype ZeRO's parameter all-gather sends the compute-dtype leaves in (see
    `gather_once`): the compute dtype under ZeRO, else None (no gather to shrink)."""
    return compute_dtype(cfg.model) if cfg.parallel.use_distributed_optimizer else None


def reduce_over_ranks(grads_r, storage, bf16: bool):
    """The one data-parallel reduction: sum the stacked per-rank gradients [dp/data, ...] and
    place the sum in storage sharding (an all-reduce, or a reduce-scatter under ZeRO).

    bf16 (--grad-reduce-in-bf16, Megatron's bf16 gradient buffers): each rank's accumulated
    fp32 gradient is rounded to bf16, reduced in bf16 (lax.reduce: jnp.sum would accumulate
    bf16 in fp32 and so reduce in fp32) and widened to fp32 only after the collective.
    """
    if not bf16:
        return jax.lax.with_sharding_constraint(jax.tree.map(lambda g: jnp.sum(g, axis=0), grads_r), storage)
    summed = jax.tree.map(
        lambda g: jax.lax.reduce(g.astype(jnp.bfloat16), jnp.zeros((), jnp.bfloat16), jax.lax.add, (0,)),
        grads_r)
    summed = jax.lax.with_sharding_constraint(summed, storage)  # the collective runs in bf16
    return jax.tree.map(lambda g: g.astype(jnp.float32), summed)


def bf16_grad_reduce_note(cfg: Config, mesh: Mesh) -> str | None:
    """Where --grad-reduce-in-bf16 cannot apply, why (the run logs it); None when it applies or
    was not asked for. It applies to the once-per-step reduction (`reduces_once`), which every
    data- or expert-parallel step runs."""
    if not cfg.parallel.grad_reduce_in_bf16:
        return None
    if not reduces_once(mesh):
        return "no effect: the data-parallel size is 1, there is no gradient reduction"
    return None
