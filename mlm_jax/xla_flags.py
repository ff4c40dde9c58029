"""XLA settings that must be in the environment before JAX starts its backends.

Megatron's --overlap-grad-reduce / --overlap-param-gather as XLA's GPU scheduler flags.

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

The thread pool of XLA:CPU for fake multi-device runs (`cpu_collective_threads`).
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


# XLA:CPU's intra-op pool threads per in-process device (see `cpu_collective_threads`).
CPU_POOL_THREADS_PER_DEVICE = 4


def cpu_collective_threads(devices: int, environ=os.environ) -> int | None:
    """Give XLA:CPU's intra-op thread pool `CPU_POOL_THREADS_PER_DEVICE` threads per device of a
    multi-device CPU run, unless the user sized it; returns the size set (None: left alone).

    XLA:CPU's thunk executor runs a program's independent operations concurrently, offloading
    them to the process's one intra-op pool (NPROC threads when set, else about one per core or
    device), and an in-process collective holds its pool thread until every participating device
    has arrived. When all the pool's threads hold collectives whose partners are queued behind
    them, the process deadlocks: seen with the two-slot pipeline on 8 fake devices, every one of
    the 8 pool threads waiting in a collective-permute, all-gather or all-reduce (gdb) and the
    devices' own threads waiting for work the pool never ran. A device has only a few
    independent collectives ready at once, so a pool with several threads per device leaves free
    threads for the partners. Idle threads cost nothing; XLA reads NPROC once, when the CPU
    client starts, so this runs before any JAX work. GPUs are unaffected."""
    if devices <= 1 or "NPROC" in environ:
        return None
    size = max(os.cpu_count() or 1, CPU_POOL_THREADS_PER_DEVICE * devices)
    environ["NPROC"] = str(size)
    return size
