"""Turn (config, mesh) into sharded train state and compiled steps: parallelism in one place.

The order, once:
  1. mesh       given (mlm_jax/sharding/mesh.py), axes pipe, data, expert, context, tensor;
  2. rules      parameter storage rules, compute rules, activation rules (sequence parallel);
  3. params     the abstract model's logical dim names -> compute shardings -> storage
                shardings (the distributed optimizer adds `data` to storage: ZeRO);
  4. optimizer  AdamW state sharded exactly like the stored parameters;
  5. remat      the model applies `--recompute-granularity` itself (jax.checkpoint policies);
  6. pipeline   with pipeline size > 1 (mlm_jax/pipeline/runtime.py): the stacked layers are
                stored [P*V*Lmax, ...] sharded over `pipe` (their spec's first dim becomes
                `pipe`; ZeRO still adds `data`), and loss_and_grads / eval_step run the schedule
                in one shard_map over `pipe`;
  7. jit        init with out_shardings (values independent of layout: threefry is
                partitionable), train/eval steps with explicit in/out shardings and donation.

The train step takes a global batch shaped [microbatches, micro * dp, seq], accumulates
gradients over the microbatches with `lax.scan`, and averages the loss over every unmasked
token of the global batch, so the result does not depend on how the batch is split.
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

from mlm_jax.config import Config
from mlm_jax.models.gpt import GPT, cross_entropy
from mlm_jax.optim import lr_at, make_optimizer
from mlm_jax.sharding.mesh import DATA
from mlm_jax.sharding.rules import activation_rules, logical_to_spec, param_rules, use_rules, zero_spec

BATCH_SPEC = P(None, DATA, None)  # [microbatch, batch/data, seq]
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids")  # + segment_ids with reset mask


def abstract_model(cfg: Config) -> tuple[nnx.GraphDef, dict, dict]:
    """(graphdef, pure dict of ShapeDtypeStruct, pure dict of logical names): no memory used."""
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: GPT(cfg.model, nnx.Rngs(0)))
        graphdef, state = nnx.split(model)
    shapes = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), nnx.to_pure_dict(state))
    names = jax.tree.map(
        lambda v: tuple(v.get_metadata()["out_sharding"]),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    return graphdef, shapes, nnx.to_pure_dict(names) if isinstance(names, nnx.State) else names


def init_params(cfg: Config, seed: int) -> dict:
    """Unsharded fp32 parameters as a pure dict (the reference the parallel layouts must match)."""
    with nnx.use_eager_sharding(False):
        return nnx.to_pure_dict(nnx.state(GPT(cfg.model, nnx.Rngs(seed))))


def count_params(shapes: dict) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(shapes))


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
    train_step: Callable  # (state, batch, key) -> (state, metrics)
    eval_step: Callable  # (params, batch) -> (loss_sum, token_count)
    rules: tuple
    loss_and_grads: Callable  # (params, batch, key) -> (loss, grads); compiled on first use
    pipeline: Any = None  # mlm_jax.pipeline.runtime.Pipeline when pipeline size > 1

    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, BATCH_SPEC)

    def batch_shape(self) -> tuple[int, int, int]:
        t = self.cfg.train
        return (self.num_microbatches, t.global_batch_size // self.num_microbatches, t.seq_length)

    def model(self, params: dict) -> GPT:
        return nnx.merge(self.graphdef, self.plain(params))

    def plain(self, tree):
        """A params-like tree (params, grads, optimizer state) in the unpipelined layout."""
        return tree if self.pipeline is None else self.pipeline.to_plain(tree)


@contextlib.contextmanager
def tracing(mesh: Mesh, rules: tuple):
    """The mesh and activation rules in force while a step is traced."""
    with jax.set_mesh(mesh), use_rules(rules):
        yield


def _loss_sum(graphdef, params, mb, key) -> jax.Array:
    """Sum of masked per-token losses of one microbatch."""
    model = nnx.merge(graphdef, params)
    # segment_ids travel only with --reset-attention-mask; otherwise the mask is just causal.
    logits = model(mb["tokens"], mb["position_ids"], mb.get("segment_ids"), key)
    return jnp.sum(cross_entropy(logits, mb["labels"]) * mb["loss_mask"])


def parallelize(cfg: Config, mesh: Mesh) -> Parallel:
    """Apply every parallelism of `cfg` on `mesh` (the order is in the module docstring)."""
    sizes = dict(mesh.shape)
    p = cfg.parallel
    # 2. rules
    act_rules = activation_rules(p.sequence_parallel)
    prules = param_rules()
    # 3. params
    graphdef, shapes, names = abstract_model(cfg)
    compute_spec = jax.tree.map(lambda n: logical_to_spec(n, prules), names,
                                is_leaf=lambda x: isinstance(x, tuple))
    pipeline = None
    if p.pipeline_model_parallel_size > 1:  # 6. pipeline: stored layout of the stacked layers
        from mlm_jax.pipeline.runtime import Pipeline

        pipeline = Pipeline(cfg, mesh, graphdef)
        shapes, compute_spec = pipeline.stored_shapes(shapes), pipeline.stored_specs(compute_spec)
    if p.use_distributed_optimizer:
        storage_spec = jax.tree.map(lambda s, a: zero_spec(s, a.shape, sizes), compute_spec, shapes,
                                    is_leaf=lambda x: isinstance(x, P))
    else:
        storage_spec = compute_spec
    to_sharding = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    compute_sharding = jax.tree.map(to_sharding, compute_spec, is_leaf=is_spec)
    param_sharding = jax.tree.map(to_sharding, storage_spec, is_leaf=is_spec)
    # 4. optimizer: moments follow the stored parameters; counters are replicated.
    tx = make_optimizer(cfg.optim, cfg.train.train_iters)
    opt_sharding = optax.tree_map_params(
        tx, lambda _, s: s, jax.eval_shape(tx.init, shapes), param_sharding,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
    )
    replicated = NamedSharding(mesh, P())
    state_sharding = {"params": param_sharding, "opt_state": opt_sharding, "step": replicated}
    dp = sizes[DATA] * sizes.get("expert", 1)
    num_micro = cfg.train.global_batch_size // (cfg.train.micro_batch_size * dp)
    keys = BATCH_KEYS + (("segment_ids",) if cfg.data.reset_attention_mask else ())
    batch_sharding = {k: NamedSharding(mesh, BATCH_SPEC) for k in keys}

    # 7. jit
    def init(seed: int):
        def make():
            params = init_params(cfg, seed)
            if pipeline is not None:
                params = pipeline.to_pipelined(params)
            return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32)}

        with jax.set_mesh(mesh):
            return jax.jit(make, out_shardings=state_sharding)()

    def gathered(params):
        # Storage -> compute mapping: under ZeRO this is the all-gather of the parameters.
        return jax.lax.with_sharding_constraint(params, compute_sharding)

    def loss_and_grads(params, batch, key):
        """Token-mean loss of the global batch and its gradient, accumulated over microbatches."""
        total_tokens = jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)

        def micro(carry, xs):
            grads_acc, loss_acc = carry
            mb, index = xs
            loss, grads = jax.value_and_grad(
                lambda prm: _loss_sum(graphdef, gathered(prm), mb, jax.random.fold_in(key, index))
                / total_tokens
            )(params)
            # Back to storage: under ZeRO the gradient reduce-scatters over data.
            grads = jax.lax.with_sharding_constraint(grads, param_sharding)
            return (jax.tree.map(jnp.add, grads_acc, grads), loss_acc + loss), None

        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), param_sharding)
        (grads, loss), _ = jax.lax.scan(
            micro, (zeros, jnp.zeros((), jnp.float32)), (batch, jnp.arange(num_micro))
        )
        return loss, grads

    if pipeline is not None:  # 6. pipeline: the schedule runs the microbatches

        def loss_and_grads(params, batch, key):  # noqa: F811
            return pipeline.loss_and_grads(params, batch, key, compute_sharding, param_sharding)

    def train_step(state, batch, key):
        params = state["params"]
        loss, grads = loss_and_grads(params, batch, key)
        total_tokens = jnp.sum(batch["loss_mask"])
        grad_norm = optax.global_norm(grads)
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_params = optax.apply_updates(params, updates)
        metrics = {
            "lm_loss": loss,
            "grad_norm": grad_norm,
            "lr": lr_at(cfg.optim, cfg.train.train_iters, state["step"]),
            "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm),
            "tokens": total_tokens,
        }
        new_state = {"params": new_params, "opt_state": opt_state, "step": state["step"] + 1}
        return new_state, metrics

    def eval_step(params, batch):
        def micro(acc, mb):
            return acc + _loss_sum(graphdef, gathered(params), mb, None), None

        if pipeline is not None:
            loss_sum = pipeline.loss_sum(params, batch, compute_sharding)
        else:
            loss_sum, _ = jax.lax.scan(micro, jnp.zeros((), jnp.float32), batch)
        return loss_sum, jnp.sum(batch["loss_mask"])

    with jax.set_mesh(mesh), use_rules(act_rules):
        train_jit = jax.jit(
            train_step,
            in_shardings=(state_sharding, batch_sharding, replicated),
            out_shardings=(state_sharding, replicated),
            donate_argnums=(0,),
        )
        grads_jit = jax.jit(
            loss_and_grads,
            in_shardings=(param_sharding, batch_sharding, replicated),
            out_shardings=(replicated, param_sharding),
        )
        eval_jit = jax.jit(
            eval_step,
            in_shardings=(param_sharding, batch_sharding),
            out_shardings=(replicated, replicated),
        )

    return Parallel(
        cfg=cfg, mesh=mesh, graphdef=graphdef, shapes=shapes, param_sharding=param_sharding,
        compute_sharding=compute_sharding, opt_sharding=opt_sharding, tx=tx,
        num_microbatches=num_micro, init=init, train_step=_traced(train_jit, mesh, act_rules),
        eval_step=_traced(eval_jit, mesh, act_rules), rules=act_rules,
        loss_and_grads=_traced(grads_jit, mesh, act_rules), pipeline=pipeline,
    )


class _traced:
    """A jitted function that is traced (and lowered) inside the mesh and activation rules."""

    def __init__(self, fn, mesh, rules):
        self.fn, self.mesh, self.rules = fn, mesh, rules

    def __call__(self, *args):
        with tracing(self.mesh, self.rules):
            return self.fn(*args)

    def lower(self, *args):
        with tracing(self.mesh, self.rules):
            return self.fn.lower(*args)
