"""The training step: loss and gradients over the microbatches, one optimizer update, overflow
skipping. `parallelize` builds it (with the shardings) and jits it.

The step takes a global batch shaped [microbatches, micro * dp, seq] and averages the loss over
every unmasked token of the global batch (`loss_scale.token_weight`), so the result does not
depend on how the batch is split. How the microbatches run is chosen once, as a value (`loss_functions`):
  - the pipeline's schedule (mlm_jax/pipeline/runtime.py) with pipeline size > 1;
  - else a `lax.scan` over the microbatches, per data-parallel rank with the gradients reduced
    once after the loop where `parallel.data.reduces_once` allows; else (one rank, or a model
    whose head reports batch-wide aux) with GSPMD reducing each microbatch's gradients.
All of them run the model's stage API (`GPT.loss` = embed_tokens, run_layers, head); the head's
`aux` scalars are summed over microbatches into the metrics (`metrics["aux"]`).

Loss scaling (--fp16, or a static --loss-scale; mlm_jax/loss_scale.py): every gradient path takes
the scale and differentiates loss x scale; the step unscales in fp32, skips the update when any
gradient overflowed (the whole state but the scaler kept) and moves the scaler, which lives in
the state under "loss_scale".
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from mlm_jax import loss_scale as ls
from mlm_jax.config import Config
from mlm_jax.models import fp8, moe
from mlm_jax.models.layers import compute_dtype
from mlm_jax.parallel import fsdp
from mlm_jax.optim import apply_lr, decoupled_lr_for, lr_for
from mlm_jax.parallel.data import (ReduceInBackward, fp8_param_gather, gather_once, leaf_reduction, overlaps_grad_reduce,
                                   per_rank_trace, rank_axes, reduce_over_ranks, reduces_once)
from mlm_jax.sharding import trace
from mlm_jax.sharding.mesh import DATA
from mlm_jax.sharding.specs import manual_part, rows_over, stacked_per_rank

# (params, batch, key, loss_scale=None) -> (token-mean loss, grads in storage sharding, summed aux)
LossAndGrads = Callable
# (params, batch) -> the batch's summed token loss (evaluation: no dropout)
LossSum = Callable


def sum_aux(acc: dict, aux: dict) -> dict:
    return jax.tree.map(jnp.add, acc, aux)


def loss_functions(cfg: Config, mesh, graphdef, compute: dict, storage: dict,
                   pipeline=None) -> tuple[LossAndGrads, LossSum]:
    """The step's (loss_and_grads, loss_sum) for parameters stored as `storage` and computed
    with as `compute`: the pipeline's schedule when there is a `pipeline`, else the microbatch
    loop (reducing gradients once per step where `reduces_once` allows)."""
    if pipeline is not None:

        def pipelined(params, batch, key, loss_scale=None):
            return pipeline.loss_and_grads(params, batch, key, compute, storage, loss_scale=loss_scale)

        return pipelined, lambda params, batch: pipeline.loss_sum(params, batch, compute)
    run, loss_sum = plain_loss_and_grads(graphdef, compute, storage)
    if reduces_once(mesh):  # one data-parallel gradient reduction per step, not per microbatch
        bf16 = cfg.parallel.grad_reduce_in_bf16
        layers = None
        if fsdp.shards_layers(cfg):  # optim_grads(_params): the layers gathered and reduced one at a time
            layers = lambda manual: fsdp.GatherPerLayer.of(cfg, storage, compute, manual, bf16)  # noqa: E731
        run = reduce_once_loss_and_grads(graphdef, compute, storage, run, compute_dtype(cfg.model),
                                         bf16, overlaps_grad_reduce(cfg, mesh), fp8_param_gather(cfg), layers)
    return run, loss_sum


def plain_loss_and_grads(graphdef, compute: dict, storage: dict) -> tuple[LossAndGrads, LossSum]:
    """The microbatches accumulated with lax.scan under GSPMD: each microbatch's gradients are
    reduced (reduce-scattered into ZeRO's storage) as they come."""

    def gathered(params):
        # Storage -> compute mapping: under ZeRO this is the all-gather of the parameters.
        return jax.lax.with_sharding_constraint(params, compute)

    def run(params, batch, key, loss_scale=None):
        weight = ls.token_weight(batch, loss_scale)

        def loss_fn(prm, mb, mb_key):
            loss_sum, aux = nnx.merge(graphdef, gathered(prm)).loss(mb, mb_key)
            return loss_sum * weight, aux

        def micro(carry, xs):
            grads_acc, loss_acc, aux_acc = carry
            mb, index = xs
            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                params, mb, jax.random.fold_in(key, index))
            # Back to storage: under ZeRO the gradient reduce-scatters over data.
            grads = jax.lax.with_sharding_constraint(grads, storage)
            return (fp8.combine(grads_acc, grads), loss_acc + loss, sum_aux(aux_acc, aux)), None

        first = jax.tree.map(lambda x: x[0], batch)
        aux0 = jax.tree.map(jnp.zeros_like, jax.eval_shape(loss_fn, params, first, key)[1])
        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), storage)
        num_micro = batch["tokens"].shape[0]  # [microbatches, micro * dp, seq]
        (grads, loss, aux), _ = jax.lax.scan(
            micro, (zeros, jnp.zeros((), jnp.float32), aux0), (batch, jnp.arange(num_micro)))
        return loss, grads, aux

    def loss_sum(params, batch):
        def micro(acc, mb):
            return acc + nnx.merge(graphdef, gathered(params)).loss(mb, None)[0], None

        return jax.lax.scan(micro, jnp.zeros((), jnp.float32), batch)[0]

    return run, loss_sum


def reduce_once_loss_and_grads(graphdef, compute: dict, storage: dict, fallback: LossAndGrads,
                               gather_dtype=None, bf16: bool = False, overlap: bool = False,
                               fp8_gather=None, layers=None) -> LossAndGrads:
    """Like `plain_loss_and_grads`' run, with data-parallel gradients reduced once per step.

    The microbatch loop runs in a shard_map that is manual over `data` only (tensor parallelism
    stays GSPMD's), so every rank accumulates the gradient of its own rows and nothing ties the
    ranks together inside the loop: the accumulator is one unreduced gradient per rank
    (Megatron's local gradient buffer), stacked [dp/data, ...] on the way out and summed over dp
    once after the loop (an all-reduce, or a reduce-scatter into ZeRO's storage sharding; in
    bf16 with `bf16`, see `parallel.data.reduce_over_ranks`).
    Parameters are gathered to the compute sharding once, before the loop (ZeRO's all-gather
    once per step, the compute-dtype leaves cast to `gather_dtype` first: see
    `parallel.data.gather_once`), and each rank differentiates that copy, accumulating its
    gradients in fp32. A model whose head reports aux scalars that are not MoE rank shares
    takes `fallback` (`reduces_once`).

    With `overlap` (--overlap-grad-reduce where `parallel.data.overlaps_grad_reduce` allows) the
    loop runs the first m - 1 microbatches only, and the last one's backward reduces each
    gradient (its own plus the accumulated) as soon as it is complete, the layers' one layer at
    a time inside the layer scan (`parallel.data.ReduceInBackward`): the same one reduction per
    parameter per step, now overlapping the rest of the backward. The model's step is then
    compiled twice (the loop's body and the last microbatch).

    With `layers` (manual axes -> `parallel.fsdp.GatherPerLayer`: --data-parallel-sharding-strategy
    optim_grads or optim_grads_params) the stacked layers enter the per-rank body as each rank's
    shard of their storage, gathered one layer at a time in the layer scan, their gradients
    reduce-scattered there and accumulated shard-sized (not reduced again after the loop).
    """
    def loss_fn(prm, mb, mb_key, weight):
        loss_sum, aux = nnx.merge(graphdef, prm).loss(mb, mb_key)
        return loss_sum * weight, aux

    def accumulate(prm, weight, key, carry, mbs, first: int = 0):
        """The microbatches `mbs` [n, b, s] (numbered from `first`) differentiated at `prm`, their
        (loss, aux) and gradients added to `carry`'s fp32 accumulators."""
        def micro(carry, xs):
            grads_acc, loss_acc, aux_acc = carry
            mb, index = xs
            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                prm, mb, jax.random.fold_in(key, index), weight)
            return (fp8.combine(grads_acc, grads), loss_acc + loss, sum_aux(aux_acc, aux)), None

        num = mbs["tokens"].shape[0]
        return jax.lax.scan(micro, carry, (mbs, first + jnp.arange(num)))[0] if num else carry

    def run(params, batch, key, loss_scale=None):
        # Gathered once, the weights kept in the compute dtype: no fp32 copy of them lives
        # through the loop, and each microbatch's weight gradients come in the compute dtype
        # (the same values the fp32 copy's cast would widen), accumulated in fp32.
        gathered = gather_once(params, storage, compute, gather_dtype, fp8_gather)
        if layers is not None:  # FSDP: the layers' shards as stored (each gathered in the layer scan)
            gathered = jax.tree_util.tree_map_with_path(lambda p, g, x: x if fsdp.layer_leaf(p) else g,
                                                        gathered, params)
        first = jax.tree.map(lambda x: x[0], batch)
        weight = ls.token_weight(batch, loss_scale)  # one replicated argument of the shard_map
        aux0 = jax.tree.map(jnp.zeros_like, jax.eval_shape(loss_fn, gathered, first, key, weight)[1])
        mesh = jax.tree.leaves(compute)[0].mesh
        if not reduces_once(mesh, aux0):
            return fallback(params, batch, key, loss_scale)
        ranks = rank_axes(mesh)
        held = jax.tree.map(lambda sharding: manual_part(sharding.spec, ranks), compute)  # the experts
        if layers is not None:  # FSDP: each rank's shard of the stored layers
            held = jax.tree_util.tree_map_with_path(
                lambda p, h, st: manual_part(st.spec, ranks) if fsdp.layer_leaf(p) else h, held, storage)

        def start(prm):  # fp32 gradient accumulators, loss, aux
            return jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), prm), jnp.zeros((), jnp.float32), aux0

        if overlap:
            sizes = dict(mesh.shape)
            reductions = jax.tree_util.tree_map_with_path(
                lambda path, st, co: leaf_reduction(st.spec, co.spec, sizes, ReduceInBackward.stacked(path), bf16),
                storage, compute)

            def per_rank(prm, mbs, key, weight):
                # Manual over `data` (tensor still GSPMD's): mbs [m, b, s] holds this rank's rows.
                num_micro, rows_here = mbs["tokens"].shape[:2]
                shares0 = ReduceInBackward.zero_shares(prm, reductions, sizes[DATA])

                def micro(carry, xs):
                    acc, shares, loss_acc, aux_acc = carry
                    mb, index = xs
                    mb_key = jax.random.fold_in(key, index)

                    def earlier():  # accumulated, not reduced
                        (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(prm, mb, mb_key, weight)
                        return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads), shares, loss, aux

                    def last():  # reduced in the backward: the shares' gradient
                        def loss_at(shares):
                            hooks = ReduceInBackward(reductions, acc, shares)
                            with trace.using(layer_grad_hook=hooks):
                                return loss_fn(hooks.hooked(prm), mb, mb_key, weight)

                        (loss, aux), reduced = jax.value_and_grad(loss_at, has_aux=True)(shares0)
                        return acc, reduced, loss, aux

                    # Both kinds in the loop, chosen per microbatch: each one's activations then
                    # live inside its own branch (the last microbatch's outside the loop would
                    # be placed beside the loop's, not after them).
                    acc, shares, loss, aux = jax.lax.cond(index == num_micro - 1, last, earlier)
                    return (acc, shares, loss_acc + loss, sum_aux(aux_acc, aux)), None

                acc0, loss0, aux0_ = start(prm)
                with per_rank_trace(mesh, ranks, rows_here):
                    (_, shares, loss, aux), _ = jax.lax.scan(micro, (acc0, shares0, loss0, aux0_),
                                                             (mbs, jnp.arange(num_micro)))
                return shares, loss[None], jax.tree.map(lambda a: a[None], aux)

            grads_spec = jax.tree_util.tree_map_with_path(
                lambda path, r: r.out_spec(ReduceInBackward.stacked(path)), reductions)
        else:
            hook = None if layers is None else layers(ranks)

            def per_rank(prm, mbs, key, weight):
                # Manual over `data` (and `expert`; tensor still GSPMD's): mbs [m, b, s] holds this
                # rank's rows, prm this rank's experts (and under FSDP its shards of the layers).
                with per_rank_trace(mesh, ranks, mbs["tokens"].shape[1]), trace.using(layer_grad_hook=hook):
                    grads, loss, aux = accumulate(prm, weight, key, start(prm), mbs)
                # [1, ...] per rank: stacked over the ranks outside, summed there once (FSDP's
                # layers: reduced already, each rank's share).
                grads = jax.tree_util.tree_map_with_path(lambda p, g: g if reduced(p) else g[None], grads)
                return grads, loss[None], jax.tree.map(lambda a: a[None], aux)

            reduced = (lambda p: False) if layers is None else fsdp.layer_leaf
            grads_spec = jax.tree_util.tree_map_with_path(
                lambda p, spec: spec if reduced(p) else stacked_per_rank(spec, ranks), held)

        grads, loss, aux = jax.shard_map(
            per_rank, in_specs=(held, rows_over(ranks), P(), P()), out_specs=(grads_spec, P(ranks), P(ranks)),
            axis_names=set(ranks), check_vma=False)(gathered, batch, key, weight)
        aux = jax.tree.map(lambda a: jnp.sum(a, axis=0), aux)  # each rank holds its share
        if overlap:  # reduced in the backward: each rank's share assembled in storage
            grads = jax.tree.map(lambda r, g, p: r.unpiece(g, p.shape), reductions, grads, gathered)
            return jnp.sum(loss), jax.lax.with_sharding_constraint(grads, storage), aux
        # the one dp reduction (of all but FSDP's layers)
        return jnp.sum(loss), reduce_over_ranks(grads, storage, bf16, None if layers is None else fsdp.layer_leaf), aux

    return run


def train_step(cfg: Config, tx: optax.GradientTransformation, loss_and_grads: LossAndGrads):
    """(state, batch, key) -> (state, metrics): gradients, one AdamW update, the metrics
    (the head's aux scalars, summed over the microbatches, under "aux").

    The learning rate follows Megatron's scheduler, driven by the samples of the completed
    updates: `state["schedule_samples"]`, advanced here by this batch's size (so a step that
    keeps the old state, e.g. an fp16 overflow, keeps the schedule where it was).

    With loss scaling (--fp16, --loss-scale; mlm_jax/loss_scale.py) the gradients are those of
    loss x scale, unscaled in fp32; an overflow keeps the whole state but the scaler as it was
    (a skipped iteration: metrics["skipped"]) and the scaler moves by Megatron's rules."""
    scaler = ls.Scaler.of(cfg)

    def train_step(state, batch, key):  # the name of the compiled program (HLO module jit_train_step)
        params = state["params"]
        if scaler is None:
            loss, grads, aux = loss_and_grads(params, batch, key)
            records = grads
        else:
            loss, grads, aux = loss_and_grads(params, batch, key, state[ls.KEY]["scale"])
            records = grads  # amaxes of the tensors as scaled: no unscaling
            loss, grads, found_inf = ls.unscale(loss, grads, state[ls.KEY]["scale"])
        # Delayed fp8 scaling: the amax histories' records come as their gradients; they are
        # written into the histories, and the optimizer and the norm see zeros there.
        grads = moe.without_loads(fp8.without_records(grads))  # and the expert biases' loads
        grad_norm = optax.tree.norm(grads)
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
        new_params = fp8.rolled(optax.apply_updates(params, updates), records)
        if cfg.model.moe_router_enable_expert_bias:
            new_params = moe.biased(new_params, records, cfg.model.moe_router_bias_update_rate)
        new_state = {"params": new_params, "opt_state": opt_state,
                     "step": state["step"] + 1, "schedule_samples": state["schedule_samples"] + samples}
        if scaler is not None:
            new_state, metrics = skip_on_overflow(scaler, state, new_state, metrics, found_inf)
        return new_state, metrics

    return train_step


def skip_on_overflow(scaler: ls.Scaler, old: dict, new: dict, metrics: dict, found_inf):
    """The state and metrics of a loss-scaled step: `old` (but the scaler) on an overflow; the
    scaler after this step's update ("loss_scale", as Megatron logs it) and the skip in the
    metrics. An overflow is no NaN stop: "finite" looks at the loss only, and a loss that the
    scale itself overflowed (+inf: a sum of non-negative token losses times the scale) with
    overflowed gradients is a skipped step too (Megatron scales only the backward, so its
    logged loss stays finite there); a NaN loss still stops the run."""
    new = ls.keep_on_overflow({**old, **new}, old, found_inf)
    new[ls.KEY] = scaler.update(old[ls.KEY], found_inf)
    loss = metrics["lm_loss"]
    metrics = {**metrics, "finite": jnp.isfinite(loss) | (found_inf & jnp.isposinf(loss)),
               "loss_scale": new[ls.KEY]["scale"], "skipped": found_inf.astype(jnp.int32)}
    return new, metrics
