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

The step itself (loss and gradients over the microbatches, the pipeline's schedule chosen as a
value, one optimizer update, fp16 overflow skipping) is `mlm_jax/step.py`'s; the data-parallel
pieces it places by hand are `mlm_jax/parallel/data.py`'s; what a step is traced in (the mesh,
the activation rules, the hand-written parallel pieces the model calls) `parallel.tracing`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from mlm_jax import loss_scale as ls
from mlm_jax.batch_layout import BatchLayout, batch_layout
from mlm_jax.config import Config
from mlm_jax.data.batch import batch_keys
from mlm_jax.models.build import abstract_model, init_params
from mlm_jax.models.gpt import GPT
from mlm_jax.models.recompute import check_offload_platform
from mlm_jax.optim import make_optimizer, optimizer_shardings
from mlm_jax.parallel import fsdp
from mlm_jax.parallel.data import overlaps_grad_reduce
from mlm_jax.parallel.tracing import tracing
from mlm_jax.platform import mesh_platform
from mlm_jax.sharding.rules import activation_rules, logical_to_spec, param_rules, zero_spec
from mlm_jax.sharding.specs import batch_spec, replicated
from mlm_jax.step import loss_functions, train_step as make_train_step


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
    layout: BatchLayout  # the batch sizes: [microbatches, micro * dp, seq]
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
                for k in batch_keys(self.cfg.data)}

    def batch_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, batch_spec())

    @property
    def num_microbatches(self) -> int:
        return self.layout.num_microbatches

    def batch_shape(self, global_batch_size: int | None = None) -> tuple[int, int, int]:
        """[microbatches, micro * dp, seq] of a global batch (default: --global-batch-size)."""
        return self.layout.batch_shape(global_batch_size)

    def model(self, params: dict) -> GPT:
        return nnx.merge(self.graphdef, self.plain(params))

    def plain(self, tree):
        """A params-like tree (params, grads, optimizer state) in the unpipelined layout."""
        return tree if self.pipeline is None else self.pipeline.to_plain(tree)


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
        # --overlap-grad-reduce reduce-scatters one layer at a time: the layers dim stays whole.
        skip = 1 if overlaps_grad_reduce(cfg, mesh) else 0
        storage_spec = jax.tree.map(lambda s, a, n: zero_spec(s, a.shape, sizes, skip=skip * (n[:1] == ("layers",))),
                                    compute_spec, shapes, names, is_leaf=is_spec)
        if fsdp.shards_layers(cfg):  # FSDP: each layer's own shard (gathered one layer at a time)
            storage_spec = jax.tree_util.tree_map_with_path(
                lambda path, st, s, a: fsdp.storage_spec(s, a.shape, sizes) if fsdp.layer_leaf(path) else st,
                storage_spec, compute_spec, shapes, is_leaf=is_spec)
    if pipeline is not None:  # the parameters every stage computes with whole, stored split over pipe
        storage_spec = pipeline.shared_storage_specs(storage_spec, shapes)
    to_sharding = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
    compute = jax.tree.map(to_sharding, compute_spec, is_leaf=is_spec)
    storage = jax.tree.map(to_sharding, storage_spec, is_leaf=is_spec)
    # 4. optimizer: moments follow the stored parameters; counters are replicated.
    tx = make_optimizer(cfg.optim)
    return _Shardings(shapes, compute, storage, optimizer_shardings(tx, shapes, storage, mesh), tx, pipeline)


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
    batch_sharding = {k: NamedSharding(mesh, batch_spec()) for k in batch_keys(cfg.data)}

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

    loss_grads_aux, eval_sum = loss_functions(cfg, mesh, graphdef, sh.compute, sh.storage, pipeline)
    train_step = make_train_step(cfg, tx, loss_grads_aux)

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
        layout=batch_layout(cfg, mesh), init=init, train_step=_traced(train_jit, mesh, act_rules, cp),
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

    def trace(self, *args):
        """jax's Traced (`.jaxpr`: the program before lowering)."""
        with tracing(self.mesh, self.rules, self.cp_comm_type):
            return self.fn.trace(*args)
