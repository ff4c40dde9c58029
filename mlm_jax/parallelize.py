"""Turn (config, mesh) into sharded train state and compiled steps: parallelism in one place.

The order, once (after refusing host offload where the mesh's devices have no host memory space):
  1. mesh       given (mlm_jax/sharding/mesh.py), axes pipe, data, expert, context, tensor;
  2. rules      parameter storage rules, compute rules, activation rules (sequence parallel);
  3. params     the abstract model's logical dim names -> compute shardings -> storage
                shardings (the distributed optimizer adds `data` to storage: ZeRO);
  4. optimizer  AdamW state sharded exactly like the stored parameters;
  5. remat      the model applies `--recompute-granularity/-method/-num-layers` itself
                (mlm_jax/models/recompute.py: jax.checkpoint policies in the layer scan);
  6. pipeline   with pipeline size > 1 (mlm_jax/pipeline/runtime.py): the stacked layers are
                stored [P*V*Lmax, ...] sharded over `pipe` (their spec's first dim becomes
                `pipe`; ZeRO still adds `data`), and loss_and_grads / eval_step run the schedule
                in one shard_map over `pipe`;
  7. jit        init with out_shardings (values independent of layout: threefry is
                partitionable), train/eval steps with explicit in/out shardings and donation.

The train step takes a global batch shaped [microbatches, micro * dp, seq] (any microbatch
count: jit compiles one step per batch size, as a batch-size ramp-up needs), accumulates
gradients over the microbatches with `lax.scan` (per data-parallel rank, reduced once after the
loop, where `_reduces_once` allows), and averages the loss over every unmasked
token of the global batch, so the result does not depend on how the batch is split. Both it and
the pipeline run the model's stage API (`GPT.loss` = embed_tokens, run_layers, head); the
head's `aux` scalars are summed over microbatches into the metrics (`metrics["aux"]`).

Loss scaling (--fp16, or a static --loss-scale; mlm_jax/loss_scale.py): every gradient path takes
the scale and differentiates loss x scale; the step unscales in fp32, skips the update when any
gradient overflowed (the whole state but the scaler kept) and moves the scaler, which lives in
the state under "loss_scale". Without it the step's program is exactly as before.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mlm_jax import loss_scale as ls
from mlm_jax.config import Config, num_microbatches
from mlm_jax.models.gpt import GPT
from mlm_jax.models.layers import compute_dtype, rows_from, used_in_compute_dtype
from mlm_jax.models.moe import rows_split
from mlm_jax.models.recompute import check_offload_platform
from mlm_jax.platform import mesh_platform, use_platform
from mlm_jax.optim import apply_lr, decoupled_lr_for, lr_for, make_optimizer
from mlm_jax.parallel.context import use_comm_type
from mlm_jax.sharding.mesh import DATA, EXPERT
from mlm_jax.sharding.rules import (activation_rules, active_rules, logical_to_spec, param_rules, use_rules,
                                    zero_spec)
from mlm_jax.sharding.specs import batch_spec, manual_part, pick_axes, replicated, rows_over, stacked_per_rank

BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")  # + segment_ids with reset mask


def abstract_model(cfg: Config, model_class=GPT) -> tuple[nnx.GraphDef, dict, dict]:
    """(graphdef, pure dict of ShapeDtypeStruct, pure dict of logical names): no memory used."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: model_class(cfg.model, nnx.Rngs(0)))
        graphdef, state = nnx.split(model)
    shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))
    names = jax.tree.map(
        lambda v: tuple(v.get_metadata()["out_sharding"]),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return graphdef, shapes, nnx.to_pure_dict(names) if isinstance(names, nnx.State) else names


def init_params(cfg: Config, seed: int, model_class=GPT) -> dict:
    """Unsharded fp32 parameters as a pure dict (the reference the parallel layouts must match)."""
    with nnx.use_eager_sharding(False):
        return nnx.to_pure_dict(nnx.state(model_class(cfg.model, nnx.Rngs(seed))))


def count_params(shapes: dict) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(shapes))


def batch_keys(cfg: Config) -> tuple[str, ...]:
    """The arrays of a training batch (segment_ids only with --reset-attention-mask)."""
    return BATCH_KEYS + (("segment_ids",) if cfg.data.reset_attention_mask else ())


@dataclasses.dataclass
class Parallel:
    """Everything `parallelize` derives: shardings, compiled steps, and the state they run on."""

    cfg: Config
    mesh: Mesh
    graphdef: nnx.GraphDef
    shapes: dict
    param_sharding: dict  # storage (ZeRO adds `data`)
    compute_sharding: dict  # where parameters live while the step computes
    opt_sharding: Any
    tx: optax.GradientTransformation
    num_microbatches: int
    init: Callable  # seed -> state (sharded)
    train_step: Callable  # (state, batch, key) -> (state, metrics); metrics["aux"]: the head's aux
    eval_step: Callable  # (params, batch) -> (loss_sum, token_count)
    rules: tuple
    loss_and_grads: Callable  # (params, batch, key) -> (loss, grads); compiled on first use
    pipeline: Any = None  # mlm_jax.pipeline.runtime.Pipeline when pipeline size > 1
    abstract_state: Callable | None = None  # () -> the state as ShapeDtypeStructs with shardings

    def abstract_batch(self, global_batch_size: int | None = None) -> dict:
        """A training batch as ShapeDtypeStructs laid out for the step (the loader's dtypes)."""
        shape, sharding = self.batch_shape(global_batch_size), self.batch_sharding()
        return {k: jax.ShapeDtypeStruct(shape, jnp.float32 if k == "loss_mask" else jnp.int32, sharding=sharding)
                for k in batch_keys(self.cfg)}

    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, batch_spec())

    def batch_shape(self, global_batch_size: int | None = None) -> tuple[int, int, int]:
        """[microbatches, micro * dp, seq] of a global batch (default: --global-batch-size)."""
        t = self.cfg.train
        rows = t.global_batch_size // self.num_microbatches  # micro * dp
        size = t.global_batch_size if global_batch_size is None else global_batch_size
        if size % rows:
            raise ValueError(f"global batch {size} is not a multiple of micro batch x data-parallel size {rows}")
        return (size // rows, rows, t.seq_length)

    def model(self, params: dict) -> GPT:
        return nnx.merge(self.graphdef, self.plain(params))

    def plain(self, tree):
        """A params-like tree (params, grads, optimizer state) in the unpipelined layout."""
        return tree if self.pipeline is None else self.pipeline.to_plain(tree)


@contextlib.contextmanager
def tracing(mesh: Mesh, rules: tuple, cp_comm_type: str | None = None):
    """The mesh and activation rules in force while a step is traced. `cp_comm_type` (the train
    and eval steps, whose batches are in the load-balanced chunk order) turns on context-parallel
    attention where the mesh has a `context` axis; without it attention runs unsplit."""
    with jax.set_mesh(mesh), use_rules(rules), use_platform(mesh_platform(mesh)):
        if cp_comm_type is None:
            yield
        else:
            with use_comm_type(cp_comm_type):
                yield


def _sum_aux(acc: dict, aux: dict) -> dict:
    return jax.tree.map(jnp.add, acc, aux)


@dataclasses.dataclass
class _Shardings:
    shapes: dict
    compute: dict
    storage: dict
    opt: Any
    tx: optax.GradientTransformation
    pipeline: Any


def _shardings(cfg: Config, mesh: Mesh, graphdef, shapes, names) -> _Shardings:
    """Steps 3, 4 and 6's storage: compute and storage shardings of params and optimizer."""
    sizes = dict(mesh.shape)
    p = cfg.parallel
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    compute_spec = jax.tree.map(lambda n: logical_to_spec(n, param_rules()), names,
                                is_leaf=lambda x: isinstance(x, tuple))
    pipeline = None
    if p.pipeline_model_parallel_size > 1:  # 6. pipeline: stored layout of the stacked layers
        from mlm_jax.pipeline.runtime import Pipeline

        pipeline = Pipeline(cfg, mesh, graphdef)
        shapes, compute_spec = pipeline.stored_shapes(shapes), pipeline.stored_specs(compute_spec, shapes)
    storage_spec = compute_spec
    if p.use_distributed_optimizer:
        storage_spec = jax.tree.map(lambda s, a: zero_spec(s, a.shape, sizes), compute_spec, shapes,
                                    is_leaf=is_spec)
    if pipeline is not None:  # the parameters every stage computes with whole, stored split over pipe
        storage_spec = pipeline.shared_storage_specs(storage_spec, shapes)
    to_sharding = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    compute = jax.tree.map(to_sharding, compute_spec, is_leaf=is_spec)
    storage = jax.tree.map(to_sharding, storage_spec, is_leaf=is_spec)
    # 4. optimizer: moments follow the stored parameters; counters are replicated.
    tx = make_optimizer(cfg.optim)
    opt = optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, shapes), storage,
        transform_non_params=lambda _: NamedSharding(mesh, replicated()),
    )
    return _Shardings(shapes, compute, storage, opt, tx, pipeline)


def _scaled(loss, loss_scale):
    """The loss to differentiate: times the fp16 loss scale, or itself (no scaling: the step's
    program stays exactly as without --fp16)."""
    return loss if loss_scale is None else loss * loss_scale


def _plain_loss_and_grads(graphdef, sh: _Shardings):
    """(params, batch, key, loss_scale=None) -> (token-mean loss, grads in storage sharding,
    summed aux), the microbatches accumulated with lax.scan; with a loss scale the loss and
    grads are those of loss x scale (`_train_step` unscales them)."""

    def gathered(params):
        # Storage -> compute mapping: under ZeRO this is the all-gather of the parameters.
        return jax.lax.with_sharding_constraint(params, sh.compute)

    def run(params, batch, key, loss_scale=None):
        total_tokens = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)

        def loss_fn(prm, mb, mb_key):
            loss_sum, aux = nnx.merge(graphdef, gathered(prm)).loss(mb, mb_key)
            return _scaled(loss_sum / total_tokens, loss_scale), aux

        def micro(carry, xs):
            grads_acc, loss_acc, aux_acc = carry
            mb, index = xs
            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, mb, jax.random.fold_in(key, index))
            # Back to storage: under ZeRO the gradient reduce-scatters over data.
            grads = jax.lax.with_sharding_constraint(grads, sh.storage)
            return (jax.tree.map(jnp.add, grads_acc, grads), loss_acc + loss, _sum_aux(aux_acc, aux)), None

        first = jax.tree.map(lambda x: x[0], batch)
        aux0 = jax.tree.map(jnp.zeros_like, jax.eval_shape(loss_fn, params, first, key)[1])
        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), sh.storage)
        num_micro = batch["tokens"].shape[0]  # [microbatches, micro * dp, seq]
        (grads, loss, aux), _ = jax.lax.scan(
            micro, (zeros, jnp.zeros((), jnp.float32), aux0), (batch, jnp.arange(num_micro)))
        return loss, grads, aux

    def eval_sum(params, batch):
        def micro(acc, mb):
            return acc + nnx.merge(graphdef, gathered(params)).loss(mb, None)[0], None

        return jax.lax.scan(micro, jnp.zeros((), jnp.float32), batch)[0]

    return run, eval_sum


def _reduces_once(cfg: Config, mesh: Mesh) -> bool:
    """Whether the step accumulates per-rank gradients and reduces them once (see
    `_reduce_once_loss_and_grads`): data parallel (expert parallelism is carved out of it).

    Dropout masks are a function of each element's global index (`models.layers.dropout`), so a
    rank running its own rows draws the masks one device draws for them. Context parallelism's
    ring attention is a shard_map over every axis not yet manual, so it nests in the per-rank
    body as it nests in the pipeline's. A MoE router keeps its whole-microbatch statistics and
    decisions there (`moe.rows_split`: the counts are summed over the ranks, a few scalars per
    layer; capacity dropping counts the earlier ranks' tokens or ranks every rank's scores).
    With expert parallelism the per-rank body is manual over `expert` too: each rank holds its
    own experts and rows, and the dispatch's all-to-all (tokens, not gradients) runs in it
    (`moe_dispatch.dispatch_and_combine`).
    """
    sizes = dict(mesh.shape)
    return sizes[DATA] * sizes[EXPERT] > 1


def _gather_once(params, storage, compute, dtype, widen: bool = True):
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
    `_gather_once`): the compute dtype under ZeRO, else None (no gather to shrink)."""
    return compute_dtype(cfg.model) if cfg.parallel.use_distributed_optimizer else None


def bf16_grad_reduce_note(cfg: Config, mesh: Mesh) -> str | None:
    """Where --grad-reduce-in-bf16 cannot apply, why (the run logs it); None when it applies or
    was not asked for. It applies to the once-per-step reduction (`_reduces_once`), which every
    data- or expert-parallel step now runs."""
    if not cfg.parallel.grad_reduce_in_bf16:
        return None
    if not _reduces_once(cfg, mesh):
        return "no effect: the data-parallel size is 1, there is no gradient reduction"
    return None


def _reduce_over_ranks(grads_r, storage, bf16: bool):
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


def _reduce_once_loss_and_grads(graphdef, sh: _Shardings, fallback, gather_dtype=None, bf16: bool = False):
    """Like `_plain_loss_and_grads`' run, with data-parallel gradients reduced once per step.

    The microbatch loop runs in a shard_map that is manual over `data` only (tensor parallelism
    stays GSPMD's), so every rank accumulates the gradient of its own rows and nothing ties the
    ranks together inside the loop: the accumulator is one unreduced gradient per rank
    (Megatron's local gradient buffer), stacked [dp/data, ...] on the way out and summed over dp
    once after the loop (an all-reduce, or a reduce-scatter into ZeRO's storage sharding; in
    bf16 with `bf16`, see `_reduce_over_ranks`).
    Parameters are gathered to the compute sharding once, before the loop (ZeRO's all-gather
    once per step, the compute-dtype leaves cast to `gather_dtype` first: see `_gather_once`), and
    each rank differentiates that copy, accumulating its gradients in fp32. A model whose head reports aux scalars (batch-wide,
    not a sum over rows) takes `fallback`.
    """
    def run(params, batch, key, loss_scale=None):
        total_tokens = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
        # Gathered once, the weights kept in the compute dtype: no fp32 copy of them lives
        # through the loop, and each microbatch's weight gradients come in the compute dtype
        # (the same values the fp32 copy's cast would widen), accumulated in fp32.
        compute = _gather_once(params, sh.storage, sh.compute, gather_dtype, widen=False)

        def loss_fn(prm, mb, mb_key, norm):
            tokens, scale = norm
            loss_sum, aux = nnx.merge(graphdef, prm).loss(mb, mb_key)
            return _scaled(loss_sum / tokens, scale), aux

        first = jax.tree.map(lambda x: x[0], batch)
        norm = (total_tokens, loss_scale)  # one replicated argument of the shard_map (scale may be None)
        aux0 = jax.tree.map(jnp.zeros_like, jax.eval_shape(loss_fn, compute, first, key, norm)[1])
        if any(not name.startswith("moe_") for name in aux0):  # MoE metrics are rank shares
            return fallback(params, batch, key, loss_scale)
        ranks = _rank_axes(jax.tree.leaves(sh.compute)[0].mesh)
        inner = tuple((n, _without_manual(a, ranks)) for n, a in active_rules())
        rows_total = batch["tokens"].shape[1]

        def per_rank(prm, mbs, key, norm):
            # Manual over `data` (and `expert`; tensor still GSPMD's): mbs [m, b, s] holds this
            # rank's rows, prm this rank's experts.
            def micro(carry, xs):
                grads_acc, loss_acc, aux_acc = carry
                mb, index = xs
                (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                    prm, mb, jax.random.fold_in(key, index), norm)
                return (jax.tree.map(lambda a, g: a + g.astype(a.dtype), grads_acc, grads), loss_acc + loss,
                        _sum_aux(aux_acc, aux)), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), prm)  # fp32 accumulators
            num_micro, rows_here = mbs["tokens"].shape[:2]
            rows = jax.lax.axis_index(ranks) * rows_here  # this rank's first row
            with use_rules(inner), rows_from(rows), rows_split(ranks, rows_total // rows_here):
                (grads, loss, aux), _ = jax.lax.scan(micro, (zeros, jnp.zeros((), jnp.float32), aux0),
                                                     (mbs, jnp.arange(num_micro)))
            # [1, ...] per rank: stacked over the ranks outside, summed there once.
            return jax.tree.map(lambda g: g[None], (grads, loss, aux))

        held = jax.tree.map(lambda sharding: manual_part(sharding.spec, ranks), sh.compute)  # the experts
        stacked = jax.shard_map(
            per_rank, in_specs=(held, rows_over(ranks), P(), P()),
            out_specs=(jax.tree.map(lambda spec: stacked_per_rank(spec, ranks), held), P(ranks), P(ranks)),
            axis_names=set(ranks), check_vma=False)
        grads, loss, aux = stacked(compute, batch, key, norm)
        aux = jax.tree.map(lambda a: jnp.sum(a, axis=0), aux)  # each rank holds its share
        return jnp.sum(loss), _reduce_over_ranks(grads, sh.storage, bf16), aux  # the one dp reduction

    return run


def _without_manual(axes, manual=(DATA,)):
    """A rule's mesh axes without those manual inside a per-rank shard_map (`data`, and
    `expert` with expert parallelism)."""
    return pick_axes(axes, lambda a: a not in manual)


def _rank_axes(mesh) -> tuple[str, ...]:
    """The mesh axes the per-rank body is manual over: `data`, and `expert` where the mesh has
    expert parallelism (the batch rows are split over both)."""
    return (DATA, EXPERT) if dict(mesh.shape)[EXPERT] > 1 else (DATA,)


def _train_step(cfg: Config, tx, loss_grads_aux):
    """(state, batch, key) -> (state, metrics): gradients, one AdamW update, the metrics
    (the head's aux scalars, summed over the microbatches, under "aux").

    The learning rate follows Megatron's scheduler, driven by the samples of the completed
    updates: `state["schedule_samples"]`, advanced here by this batch's size (so a step that
    keeps the old state, e.g. an fp16 overflow, keeps the schedule where it was).

    With loss scaling (--fp16, --loss-scale; mlm_jax/loss_scale.py) the gradients are those of
    loss x scale, unscaled in fp32; an overflow keeps the whole state but the scaler as it was
    (a skipped iteration: metrics["skipped"]) and the scaler moves by Megatron's rules."""
    scaler = ls.Scaler.of(cfg)

    def train_step(state, batch, key):
        params = state["params"]
        if scaler is None:
            loss, grads, aux = loss_grads_aux(params, batch, key)
        else:
            loss, grads, aux = loss_grads_aux(params, batch, key, state[ls.KEY]["scale"])
            loss, grads, found_inf = ls.unscale(loss, grads, state[ls.KEY]["scale"])
        grad_norm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        lr = lr_for(cfg, state["schedule_samples"])
        updates = apply_lr(updates, lr, decoupled_lr_for(cfg, state["schedule_samples"]))
        samples = batch["loss_mask"].shape[0] * batch["loss_mask"].shape[1]  # microbatches x rows
        metrics = {
            "lm_loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm),
            "tokens": jnp.sum(batch["loss_mask"]),
            "aux": aux,
        }
        new_state = {"params": optax.apply_updates(params, updates), "opt_state": opt_state,
                     "step": state["step"] + 1, "schedule_samples": state["schedule_samples"] + samples}
        if scaler is not None:
            new_state, metrics = _skip_on_overflow(scaler, state, new_state, metrics, found_inf)
        return new_state, metrics

    return train_step


def _skip_on_overflow(scaler: ls.Scaler, old: dict, new: dict, metrics: dict, found_inf):
    """The state and metrics of a loss-scaled step: `old` (but the scaler) on an overflow; the
    scaler after this step's update ("loss_scale", as Megatron logs it) and the skip in the
    metrics. An overflow is no NaN stop: "finite" looks at the loss only."""
    new = ls.keep_on_overflow({**old, **new}, old, found_inf)
    new[ls.KEY] = scaler.update(old[ls.KEY], found_inf)
    metrics = {**metrics, "finite": jnp.isfinite(metrics["lm_loss"]),
               "loss_scale": new[ls.KEY]["scale"], "skipped": found_inf.astype(jnp.int32)}
    return new, metrics


def parallelize(cfg: Config, mesh: Mesh, model_class=GPT) -> Parallel:
    """Apply every parallelism of `cfg` on `mesh` (the order is in the module docstring).

    `model_class` (default GPT) is any model offering GPT's constructor and stage API."""
    check_offload_platform(cfg.model, mesh_platform(mesh))  # offload needs host memory spaces
    act_rules = activation_rules(cfg.parallel.sequence_parallel)  # 2. rules
    graphdef, shapes, names = abstract_model(cfg, model_class)  # 3. params
    sh = _shardings(cfg, mesh, graphdef, shapes, names)
    pipeline, tx = sh.pipeline, sh.tx
    rep = NamedSharding(mesh, replicated())
    state_sharding = {"params": sh.storage, "opt_state": sh.opt, "step": rep, "schedule_samples": rep}
    scaler = ls.Scaler.of(cfg)
    if scaler is not None:  # --fp16 / --loss-scale: the scaler's state, replicated
        state_sharding[ls.KEY] = jax.tree.map(lambda _: rep, scaler.init())
    num_micro = num_microbatches(cfg, mesh.size)
    batch_sharding = {k: NamedSharding(mesh, batch_spec()) for k in batch_keys(cfg)}

    # 7. jit
    def make(seed: int):
        params = init_params(cfg, seed, model_class)
        if pipeline is not None:
            params = pipeline.to_pipelined(params)
        state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
                 "schedule_samples": jnp.zeros((), jnp.int32)}
        return state if scaler is None else {**state, ls.KEY: scaler.init()}

    def init(seed: int):
        with jax.set_mesh(mesh):
            return jax.jit(lambda: make(seed), out_shardings=state_sharding)()

    def abstract_state():
        # Shapes and shardings only (compile-only devices hold no arrays: mlm_jax.plan).
        shapes = jax.eval_shape(lambda: make(0))
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                            state_sharding)

    loss_grads_aux, eval_sum = _plain_loss_and_grads(graphdef, sh)
    if _reduces_once(cfg, mesh):  # 1 data-parallel gradient reduction per step, not per microbatch
        loss_grads_aux = _reduce_once_loss_and_grads(graphdef, sh, loss_grads_aux, compute_dtype(cfg.model),
                                                     cfg.parallel.grad_reduce_in_bf16)
    if pipeline is not None:  # 6. pipeline: the schedule runs the microbatches

        def loss_grads_aux(params, batch, key, loss_scale=None):  # noqa: F811
            return pipeline.loss_and_grads(params, batch, key, sh.compute, sh.storage, loss_scale=loss_scale)

        def eval_sum(params, batch):  # noqa: F811
            return pipeline.loss_sum(params, batch, sh.compute)

    train_step = _train_step(cfg, tx, loss_grads_aux)

    def eval_step(params, batch):
        return eval_sum(params, batch), jnp.sum(batch["loss_mask"])

    with tracing(mesh, act_rules, cfg.parallel.cp_comm_type):
        train_jit = jax.jit(train_step, in_shardings=(state_sharding, batch_sharding, rep),
                            out_shardings=(state_sharding, rep), donate_argnums=(0,))
        grads_jit = jax.jit(lambda p, b, k: loss_grads_aux(p, b, k)[:2],
                            in_shardings=(sh.storage, batch_sharding, rep), out_shardings=(rep, sh.storage))
        eval_jit = jax.jit(eval_step, in_shardings=(sh.storage, batch_sharding), out_shardings=(rep, rep))

    cp = cfg.parallel.cp_comm_type
    return Parallel(
        cfg=cfg, mesh=mesh, graphdef=graphdef, shapes=sh.shapes, param_sharding=sh.storage,
        compute_sharding=sh.compute, opt_sharding=sh.opt, tx=tx,
        num_microbatches=num_micro, init=init, train_step=_traced(train_jit, mesh, act_rules, cp),
        eval_step=_traced(eval_jit, mesh, act_rules, cp), rules=act_rules,
        loss_and_grads=_traced(grads_jit, mesh, act_rules, cp), pipeline=pipeline,
        abstract_state=abstract_state,
    )


class _traced:
    """A jitted function that is traced (and lowered) inside the mesh and activation rules."""

    def __init__(self, fn, mesh, rules, cp_comm_type=None):
        self.fn, self.mesh, self.rules, self.cp_comm_type = fn, mesh, rules, cp_comm_type

    def __call__(self, *args):
        with tracing(self.mesh, self.rules, self.cp_comm_type):
            return self.fn(*args)

    def lower(self, *args):
        with tracing(self.mesh, self.rules, self.cp_comm_type):
            return self.fn.lower(*args)
