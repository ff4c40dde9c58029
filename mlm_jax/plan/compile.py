"""Compile the exact train step of `python -m mlm_jax.train` for GPUs this machine does not have.

The same code path as training: flags -> config (finalized for the cluster's GPU count) -> mesh
over compile-only devices -> `parallelize` -> `train_step.lower(abstract state, abstract batch,
key).compile()`. Nothing is allocated: the state and batch are ShapeDtypeStructs carrying the
shardings training would place them with.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from mlm_jax.config import Config
from mlm_jax.sharding.specs import replicated


@dataclasses.dataclass
class Compiled:
    cfg: Config
    pz: object  # the Parallel
    compiled: object  # jax's Compiled
    text: str  # optimised, scheduled HLO
    lower_seconds: float
    compile_seconds: float
    state_bytes: dict  # per device: params, opt_state, other
    batch_bytes: int  # per device


def _per_device_bytes(tree) -> int:
    """Bytes of one device's shards of a tree of ShapeDtypeStructs with shardings."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shape = leaf.sharding.shard_shape(leaf.shape) if leaf.sharding is not None else leaf.shape
        total += math.prod(shape) * jnp.dtype(leaf.dtype).itemsize
    return total


def compile_step(cfg: Config, devices: list, log=lambda *a, **k: None) -> Compiled:
    """Lower and compile `cfg`'s train step on a mesh of `devices` (compile-only ones)."""
    from mlm_jax.build import parallelize
    from mlm_jax.sharding.mesh import make_mesh

    mesh = make_mesh(cfg.parallel, devices)
    pz = parallelize(cfg, mesh)
    state = pz.abstract_state()
    batch = pz.abstract_batch()
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                               sharding=NamedSharding(mesh, replicated()))
    t0 = time.perf_counter()
    lowered = pz.train_step.lower(state, batch, key)
    t1 = time.perf_counter()
    log(f"> lowered in {t1 - t0:.1f} s; compiling for {len(devices)} x {devices[0].device_kind} ...")
    compiled = lowered.compile()
    t2 = time.perf_counter()
    other = {k: v for k, v in state.items() if k not in ("params", "opt_state")}
    return Compiled(
        cfg=cfg, pz=pz, compiled=compiled, text=compiled.as_text(), lower_seconds=t1 - t0,
        compile_seconds=t2 - t1,
        state_bytes={"params": _per_device_bytes(state["params"]),
                     "opt_state": _per_device_bytes(state["opt_state"]), "other": _per_device_bytes(other)},
        batch_bytes=_per_device_bytes(batch))
