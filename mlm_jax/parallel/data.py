"""Data parallelism's hand-placed pieces, shared by the plain step (`mlm_jax/step.py`) and the
pipeline (`mlm_jax/pipeline/runtime.py`): ZeRO's parameter gather once per step, the per-rank
body that accumulates each rank's own gradients, and the one gradient reduction over the ranks:
after the backward (`reduce_over_ranks`), or with --overlap-grad-reduce inside the last
microbatch's backward, layer by layer as each layer's gradient is complete (`ReduceInBackward`).

Everything else of data parallelism (the batch split over `data`, ZeRO's storage) is a rules
choice the compiler derives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from mlm_jax.config import Config
from mlm_jax.models import fp8
from mlm_jax.models.layers import compute_dtype, used_in_compute_dtype
from mlm_jax.sharding import trace
from mlm_jax.sharding.mesh import DATA, EXPERT, REPLICA, psum
from mlm_jax.sharding.rules import active_rules
from mlm_jax.sharding.specs import entry_axes, pick_axes


def reduces_once(mesh: Mesh, aux_names=()) -> bool:
    """Whether a step accumulates per-rank gradients and reduces them once after its microbatches
    (the plain step's `reduce_once_loss_and_grads`, the pipeline's per-rank schedule): on a mesh
    with data parallelism (expert parallelism is carved out of it), and when every aux scalar the
    model reports (`aux_names`) is a rank share ("moe_..." and multi-token prediction's "mtp_...":
    summed over the ranks it gives the whole microbatch's); other aux are batch-wide statistics
    a per-rank body would change.

    Dropout masks are a function of each element's global index (`models.layers.dropout`, the
    trace's `row_offset`), so a rank running its own rows draws the masks one device draws for
    them. Context parallelism's ring attention is a shard_map over every axis not yet manual, so
    it nests in the per-rank body as it nests in the pipeline's. A MoE router keeps its
    whole-microbatch statistics and decisions there (the trace's `rank_split`: the counts are
    summed over the ranks, a few scalars per layer; capacity is each rank's own, as Megatron's). With expert parallelism the per-rank body is manual
    over `expert` too: each rank holds its own experts and rows, and the dispatch's all-to-all
    (tokens, not gradients) runs in it (`parallel/experts.py`).
    """
    sizes = dict(mesh.shape)
    return sizes[REPLICA] * sizes[DATA] * sizes[EXPERT] > 1 and all(name.startswith(("moe_", "mtp_")) for name in aux_names)


def rank_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes the per-rank body is manual over: `replica` and `data` (hybrid sharding's
    instances and their ranks; `replica` also at size 1, as the batch rule names it: a nested
    shard_map's manual axes then stay in mesh order, which jax 0.12 checks), and `expert` where the
    mesh has expert parallelism (the batch rows are split over all of them)."""
    sizes = dict(mesh.shape)
    return (REPLICA, DATA) + ((EXPERT,) if sizes[EXPERT] > 1 else ())


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
    with trace.using(rules=inner, row_offset=first_row, rank_split=(ranks, num_ranks), route_groups=1):
        yield


def gather_once(params, storage, compute, dtype, fp8_weights=None):
    """Storage -> compute sharding (ZeRO's all-gather), the leaves the model reads in the compute
    dtype anyway sent and kept in `dtype` (bf16 under --bf16, as Megatron's distributed optimizer
    gathers its bf16 parameter copy): the model's cast is then a no-op, and their gradients, which
    the cast's transpose would only widen, come in `dtype` (the same values; the callers
    accumulate them in fp32). Widened back to fp32 after the gather, they would be an fp32 copy of
    the weights wherever a loop boundary keeps XLA from folding the widening into the model's
    cast (a pipeline stage's tick loops). `dtype` None: everything in fp32. The cast is pinned to
    the storage sharding, or propagation would replicate the fp32 input and gather that.
    `fp8_weights` (--fp8-param-gather; `fp8_param_gather`): path -> a projection weight's own
    dims, or None; those weights travel in e4m3 (`models.fp8.gather_in_fp8`)."""
    if dtype is None:
        return jax.lax.with_sharding_constraint(params, compute)
    low = jax.tree_util.tree_map_with_path(
        lambda path, x: x.astype(dtype) if used_in_compute_dtype(path) else x, params)
    low = jax.lax.with_sharding_constraint(low, storage)  # cast on the shards...
    gathered = jax.lax.with_sharding_constraint(low, compute)  # ...then gathered
    if fp8_weights is None:
        return gathered
    return jax.tree_util.tree_map_with_path(
        lambda path, x, lo, st, co: lo if fp8_weights(path) is None else fp8.gather_in_fp8(x, fp8_weights(path), st, co, dtype),
        params, gathered, storage, compute)


def fp8_param_gather(cfg: Config):
    """--fp8-param-gather: ZeRO gathers the projections' weights in fp8 (`gather_once`'s
    `fp8_weights`); None without it."""
    m = cfg.model
    if m.fp8_param_gather and m.fp8_format is not None and cfg.parallel.use_distributed_optimizer:
        return fp8.weight_dims(m)
    return None


def zero_gather_dtype(cfg: Config):
    """The dtype ZeRO's parameter all-gather sends the compute-dtype leaves in (see
    `gather_once`): the compute dtype under ZeRO, else None (no gather to shrink)."""
    return compute_dtype(cfg.model) if cfg.parallel.use_distributed_optimizer else None


def reduce_over_ranks(grads_r, storage, bf16: bool, reduced=None):
    """The one data-parallel reduction: sum the stacked per-rank gradients [dp/data, ...] and
    place the sum in storage sharding (an all-reduce, or a reduce-scatter under ZeRO).

    bf16 (--grad-reduce-in-bf16, Megatron's bf16 gradient buffers): each rank's accumulated
    fp32 gradient is rounded to bf16, reduced in bf16 (lax.reduce: jnp.sum would accumulate
    bf16 in fp32 and so reduce in fp32) and widened to fp32 only after the collective.
    Delayed fp8 scaling's amax records are combined by a max (`models.fp8.sum_over`).
    `reduced` (path -> bool; None: none): the leaves reduced already, passed as they are (FSDP's
    layers, reduce-scattered in their backward: `parallel.fsdp`).
    """
    if reduced is not None:  # the others reduced (None: an empty subtree), then put back beside them
        prune = lambda tree: jax.tree_util.tree_map_with_path(lambda p, x: None if reduced(p) else x, tree)  # noqa: E731
        rest = reduce_over_ranks(prune(grads_r), prune(storage), bf16)
        return jax.tree_util.tree_map_with_path(
            lambda p, g, r, st: jax.lax.with_sharding_constraint(g, st) if reduced(p) else r, grads_r, rest, storage,
            is_leaf=lambda x: x is None)
    def summed(grads, axis=0):
        if not bf16:
            return fp8.sum_over(grads, axis)
        return fp8.sum_over(grads, axis, lambda g: jax.lax.reduce(g.astype(jnp.bfloat16), jnp.zeros((), jnp.bfloat16),
                                                                  jax.lax.add, (axis,)))

    storage_leaves = jax.tree.leaves(storage)
    replicas = dict(storage_leaves[0].mesh.shape).get(REPLICA, 1) if storage_leaves else 1
    if replicas > 1:
        # Hybrid sharding: first within each instance (the rows' ranks [replica, the rest]: a
        # reduce-scatter over `data` into each instance's storage), then the shares across the
        # instances (an all-reduce over `replica` of a share, not of the whole gradient).
        def within(g, st):
            return g.reshape(replicas, g.shape[0] // replicas, *g.shape[1:])

        def per_instance(st):
            return jax.sharding.NamedSharding(st.mesh, P(REPLICA, *st.spec))

        grads_r = jax.lax.with_sharding_constraint(summed(jax.tree.map(within, grads_r, storage), axis=1),
                                                   jax.tree.map(per_instance, storage))
    out = jax.lax.with_sharding_constraint(summed(grads_r), storage)  # in bf16 with `bf16`
    return out if not bf16 else jax.tree.map(lambda g: g.astype(jnp.float32), out)


def bf16_grad_reduce_note(cfg: Config, mesh: Mesh) -> str | None:
    """Where --grad-reduce-in-bf16 cannot apply, why (the run logs it); None when it applies or
    was not asked for. It applies to the once-per-step reduction (`reduces_once`), which every
    data- or expert-parallel step runs."""
    if not cfg.parallel.grad_reduce_in_bf16:
        return None
    if not reduces_once(mesh):
        return "no effect: the data-parallel size is 1, there is no gradient reduction"
    return None


# ----------------------------------------------------------------- --overlap-grad-reduce

def overlaps_grad_reduce(cfg: Config, mesh: Mesh) -> bool:
    """Whether the step reduces the gradients in the last microbatch's backward, layer by layer
    (--overlap-grad-reduce, Megatron's bucketed reduction that overlaps the backward): where the
    per-rank body runs over `data` alone and the layers are one stack. The pipeline (whose
    reduction follows the schedule), expert parallelism (a per-rank body over `expert` too) and
    mixed dense/MoE stacks keep the one reduction after the backward."""
    m = cfg.model
    return (cfg.parallel.overlap_grad_reduce and cfg.parallel.pipeline_model_parallel_size == 1
            and reduces_once(mesh) and dict(mesh.shape)[EXPERT] == dict(mesh.shape)[REPLICA] == 1
            and len({m.is_moe_layer(i) for i in range(m.num_layers)}) == 1
            and not fp8.delayed(m)  # amax histories, whose records a max combines (the per-layer reduction sums)
            and cfg.parallel.sharding_strategy not in ("optim_grads", "optim_grads_params"))  # FSDP does it already


def overlap_grad_reduce_note(cfg: Config, mesh: Mesh) -> str | None:
    """Where --overlap-grad-reduce asks for what `overlaps_grad_reduce` cannot do, what happens
    instead (the run logs it); None when it applies or was not asked for."""
    p = cfg.parallel
    if not p.overlap_grad_reduce or overlaps_grad_reduce(cfg, mesh):
        return None
    if not reduces_once(mesh):
        return "no effect: the data-parallel size is 1, there is no gradient reduction"
    if p.sharding_strategy in ("optim_grads", "optim_grads_params"):
        return (f"--data-parallel-sharding-strategy {p.sharding_strategy} reduce-scatters each layer's gradient in "
                "its backward already")
    why = ("the pipeline reduces after its schedule" if p.pipeline_model_parallel_size > 1 else
           "expert parallelism" if dict(mesh.shape)[EXPERT] > 1 else
           "hybrid sharding: the reduction over the instances follows the backward" if dict(mesh.shape)[REPLICA] > 1
           else
           "delayed fp8 scaling's amax histories" if fp8.delayed(cfg.model) else "mixed dense/MoE layers")
    return f"the gradients are reduced once after the backward ({why}), not inside it"


@dataclasses.dataclass(frozen=True)
class LeafReduction:
    """How one gradient (a whole leaf, or one layer's slice of a stacked leaf) is reduced over
    `data` inside the per-rank body: summed whole on every rank (`dim` None: an all-reduce) or
    reduce-scattered on `dim`, the dim ZeRO's storage splits over `data`. Storage may split that
    dim over other axes first, (t, data): then the dim is seen as [groups = t, n / t] and
    scattered on the second, so that each rank's block is the one storage puts there."""
    dim: int | None
    groups: int = 1
    bf16: bool = False  # --grad-reduce-in-bf16: the collective runs in bf16
    compute: P = P()  # the gradient's sharding over the axes left to the compiler (tensor)
    also_over: tuple = ()  # manual axes summed over too, whole (FSDP's layers under expert parallelism)

    def __call__(self, total: jax.Array) -> jax.Array:
        """The per-rank fp32 gradient `total` reduced over `data`: this rank's share, fp32.

        The collective runs on each device's block (a shard_map over the axes the gradient is
        split over besides `data`): a collective over `data` on a value the compiler splits
        over tensor would otherwise be given the whole value, gathered first."""
        split = tuple(dict.fromkeys(a for e in self.compute for a in entry_axes(e)))

        def block(x):  # this device's block of the gradient
            out = psum(x.astype(jnp.bfloat16) if self.bf16 else x, DATA, self.dim)
            if self.also_over:
                out = psum(out, self.also_over)
            if self.dim is not None and self.groups > 1:  # [.., n / t / dp, ..] -> [.., 1, n / t / dp, ..]
                out = jnp.expand_dims(out, self.dim)
            return out.astype(jnp.float32)

        out_spec = self.compute
        if self.dim is not None and self.groups > 1:
            # Blocks of the (t, data) storage: [.., t, n / t / dp, ..] here, [.., t, n / t] once
            # the shares of the data ranks are put side by side on the second (`out_spec`).
            d, parts = self.dim, tuple(self.compute) + (None,) * (self.dim + 1 - len(self.compute))
            out_spec = P(*parts[:d], parts[d], None, *parts[d + 1:])
        if not split:
            return block(total)
        return jax.shard_map(block, in_specs=self.compute, out_specs=out_spec, axis_names=set(split),
                             check_vma=False)(total)

    def gather(self, share: jax.Array) -> jax.Array:
        """The inverse: this rank's `share` all-gathered over `data` on `dim` (the whole leaf), on
        each device's block as `__call__` reduces (FSDP's layer gather: `parallel.fsdp`)."""
        assert self.groups == 1, "a gather of a dim split over other axes first"
        if self.dim is None:
            return share
        split = tuple(dict.fromkeys(a for e in self.compute for a in entry_axes(e)))

        def block(x):
            return jax.lax.all_gather(x, DATA, axis=self.dim, tiled=True)

        if not split:
            return block(share)
        return jax.shard_map(block, in_specs=self.compute, out_specs=self.compute, axis_names=set(split),
                             check_vma=False)(share)

    def share_shape(self, shape, num_ranks: int) -> tuple[int, ...]:
        """A rank's share of the reduced gradient of a `shape` leaf (or layer slice), as `__call__`
        returns it (with `groups`, the dim seen as [groups, n / groups])."""
        shape = tuple(shape)
        if self.dim is None:
            return shape
        d = self.dim
        if self.groups > 1:
            shape = (*shape[:d], self.groups, shape[d] // self.groups, *shape[d + 1:])
            d += 1
        return (*shape[:d], shape[d] // num_ranks, *shape[d + 1:])

    def out_spec(self, stacked: bool) -> P:
        """The per-rank body's out spec of the shares (`stacked`: [layers, ...] of a stacked leaf)."""
        if self.dim is None:
            return P()
        d = self.dim + (self.groups > 1) + stacked
        return P(*([None] * d), DATA)

    def unpiece(self, g: jax.Array, shape) -> jax.Array:
        """The shares assembled outside the per-rank body, back to the leaf's `shape`."""
        return g.reshape(shape) if self.groups > 1 else g


def leaf_reduction(storage_spec: P, compute_spec: P, mesh_sizes: dict[str, int], stacked: bool,
                   bf16: bool) -> LeafReduction:
    """The `LeafReduction` of a leaf stored as `storage_spec` and computed with as `compute_spec`
    (for one layer's slice of it when `stacked`: the layers dim is then never the one split over
    `data`, see `zero_spec`'s `skip`)."""
    compute = P(*tuple(compute_spec)[stacked:])
    for dim, entry in enumerate(storage_spec):
        axes = entry_axes(entry)
        if DATA in axes:
            assert axes[-1] == DATA and not (stacked and dim == 0), storage_spec
            return LeafReduction(dim - stacked, math.prod(mesh_sizes[a] for a in axes[:-1]), bf16, compute)
    return LeafReduction(None, 1, bf16, compute)


def _reduced_in_backward(reduction: LeafReduction):
    """w -> w, whose backward sums the earlier microbatches' gradient `acc` and this one's, reduces
    that over `data` (`reduction`) and hands the rank's share back as the cotangent of `share`:
    the reduced gradient comes out as the gradient of the zeros passed as `share`."""

    @jax.custom_vjp
    def hook(w, acc, share):
        return w

    def forward(w, acc, share):
        return w, acc

    def backward(acc, g):
        return jnp.zeros_like(g), jnp.zeros_like(acc), reduction(acc + g.astype(jnp.float32))

    hook.defvjp(forward, backward)
    return hook


@dataclasses.dataclass(frozen=True)
class ReduceInBackward:
    """--overlap-grad-reduce inside the per-rank body (`overlaps_grad_reduce`): the last
    microbatch is differentiated with respect to `shares` (zeros shaped like each rank's share of
    the reduced gradients), every weight passing through `_reduced_in_backward` with its
    accumulated gradient `acc`: the backward reduces each gradient as soon as it is complete, the
    layers' one layer at a time inside the layer scan's backward (the model calls `layer_inputs`
    and `at_layer` through the trace's `layer_grad_hook`), where XLA's scheduler overlaps it with
    the backward of the layers below. Each parameter is still reduced once per step."""
    reductions: Any  # a tree like the parameters: LeafReduction of each leaf
    acc: Any  # per-rank fp32 gradients of the earlier microbatches, like the parameters
    shares: Any  # zeros like each rank's share of the reduced gradients

    STACKED = "layers"  # the parameters' key of the stacked layers
    per_stack = False  # one stack only (`at_layer` knows no other; mixed dense/MoE layers refuse it)

    @classmethod
    def stacked(cls, path) -> bool:
        """Is the leaf at `path` (in the parameters) one of the stacked layers'?"""
        first = path[0]
        return str(getattr(first, "key", getattr(first, "name", first))) == cls.STACKED

    @classmethod
    def zero_shares(cls, params, reductions, num_ranks: int):
        """The `shares` of `params`: zeros shaped like each rank's share of every gradient."""
        def zeros(path, p, r):
            stacked = cls.stacked(path)
            shape = p.shape[1:] if stacked else p.shape
            piece = r.share_shape(shape, num_ranks)
            return jnp.zeros((p.shape[0], *piece) if stacked else piece, jnp.float32)

        return jax.tree_util.tree_map_with_path(zeros, params, reductions)

    def hooked(self, params):
        """`params` with every leaf but the stacked layers' passed through its hook (the layers'
        are hooked one layer at a time, inside the scan)."""
        def hook(path, w, r, a, s):
            if self.stacked(path):
                return w
            return _reduced_in_backward(r)(w, a, s)

        return jax.tree_util.tree_map_with_path(hook, params, self.reductions, self.acc, self.shares)

    def layer_inputs(self, layer_state):
        """The scan inputs the layer scan adds for its `layer_state` ([layers, ...] leaves): the
        stacked layers' accumulated gradients and shares, in `layer_state`'s structure."""
        leaves = jax.tree.leaves(layer_state)
        acc, shares = (jax.tree.leaves(t[self.STACKED]) for t in (self.acc, self.shares))
        assert [a.shape for a in acc] == [w.shape for w in leaves], "layer_inputs: another stack"
        treedef = jax.tree.structure(layer_state)
        return jax.tree.unflatten(treedef, acc), jax.tree.unflatten(treedef, shares)

    def wrap(self, body):
        """A layer scan's body where no recompute policy covers it: as it is."""
        return body

    @staticmethod
    def keeps(prim, params) -> bool:
        """Nothing kept beside the recompute policy's own."""
        return False

    def at_layer(self, state_l, inputs_l):
        """One layer's weights `state_l`, each passed through its hook with its slice of the scan
        inputs `inputs_l` (`layer_inputs`)."""
        acc_l, shares_l = inputs_l
        reductions = jax.tree.unflatten(jax.tree.structure(state_l),
                                        jax.tree.leaves(self.reductions[self.STACKED]))
        return jax.tree.map(lambda w, r, a, s: _reduced_in_backward(r)(w, a, s),
                            state_l, reductions, acc_l, shares_l)
