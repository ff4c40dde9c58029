"""Megatron's --overlap-grad-reduce / --overlap-param-gather as XLA's GPU scheduler flags.

Megatron overlaps the data-parallel gradient reduce-scatter/all-reduce (and ZeRO's parameter
all-gather) with the backward (forward) pass through bucketed asynchronous NCCL calls. On XLA
the compiler schedules the collectives: on NVIDIA GPUs collectives are asynchronous already, and
these flags let its scheduler overlap them with compute:

  --overlap-grad-reduce   --xla_gpu_enable_latency_hiding_scheduler=true
                          --xla_gpu_enable_pipelined_all_reduce=true
                          --xla_gpu_enable_pipelined_reduce_scatter=true
  --overlap-param-gather  --xla_gpu_enable_latency_hiding_scheduler=true
                          --xla_gpu_enable_pipelined_all_gather=true

(the latency-hiding scheduler moves each async collective's start early and its done late,
across independent compute; the pipelined ones move a collective of a while loop's iteration i
(the layer scan) into iteration i+1, behind that iteration's compute). XLA reads XLA_FLAGS once,
when its GPU backend starts, so `apply` runs before any JAX work. Only on a GPU run; a flag the
user already set in XLA_FLAGS, to any value, is left alone.
"""

from __future__ import annotations

import importlib.util
import os

from mlm_jax.config import ParallelConfig

_LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"
GRAD_REDUCE = (_LHS, "--xla_gpu_enable_pipelined_all_reduce=true", "--xla_gpu_enable_pipelined_reduce_scatter=true")
PARAM_GATHER = (_LHS, "--xla_gpu_enable_pipelined_all_gather=true")


def overlap_flags(parallel: ParallelConfig, existing: str = "") -> list[str]:
    """The XLA flags the overlap switches ask for, less those `existing` (XLA_FLAGS) already sets."""
    wanted: list[str] = []
    for on, flags in ((parallel.overlap_grad_reduce, GRAD_REDUCE), (parallel.overlap_param_gather, PARAM_GATHER)):
        wanted += [f for f in flags if on and f not in wanted]
    given = {item.split("=", 1)[0] for item in existing.split()}
    return [f for f in wanted if f.split("=", 1)[0] not in given]


def gpu_run(environ=os.environ) -> bool:
    """Will JAX start a GPU backend? (Asked before JAX starts: JAX_PLATFORMS, the CUDA plugin,
    and an NVIDIA device node.)"""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    plugin = any(importlib.util.find_spec(name) is not None for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    return plugin and os.path.exists("/dev/nvidiactl")


def apply(parallel: ParallelConfig, environ=os.environ) -> list[str]:
    """Append the overlap flags to `environ`'s XLA_FLAGS on a GPU run; returns those added."""
    if not gpu_run(environ):
        return []
    added = overlap_flags(parallel, environ.get("XLA_FLAGS", ""))
    if added:
        environ["XLA_FLAGS"] = " ".join([environ.get("XLA_FLAGS", "").strip(), *added]).strip()
    return added
