"""XLA settings that must be in the environment before JAX starts its backends.

On every GPU run (and every deviceless GPU compile of `mlm_jax.plan`) the training flags NVIDIA's
JAX-Toolbox recommends for LLMs (rosetta/docs/GPU_performance.md), `GPU_TRAINING`:

  --xla_gpu_enable_latency_hiding_scheduler=true     move each async collective's start early and
                                                     its done late, across independent compute
  --xla_gpu_enable_highest_priority_async_stream=true  collectives on the highest-priority stream
  --xla_gpu_enable_pipelined_{all_gather,reduce_scatter,all_reduce}=true
                                                     a collective of iteration i of a while loop
                                                     (the layer scan) runs behind iteration i+1
  --xla_gpu_{all_reduce,all_gather,reduce_scatter}_combine_threshold_bytes=134217728
                                                     small collectives combined up to 128 MiB
                                                     (fewer NCCL calls; bounded extra memory)
  --xla_gpu_enable_triton_gemm=false                 matmuls on cuBLAS (Triton GEMM fusions are
                                                     slower for LLM shapes, and without a device
                                                     to autotune on a deviceless compile would
                                                     choose them by heuristics)

and one of mlm_jax's own, `NO_COMPILER_RECOMPUTE`:

  --xla_disable_hlo_passes=rematerialization         XLA's HLO rematerialization pass off: when a
                                                     program nears the device's memory it
                                                     duplicates instructions (backward matmuls
                                                     among them) to shorten live ranges. On the
                                                     jax Python 3.12+ installs (0.12) it made
                                                     Llama-3 8B's dp8 `dots` step run 1.33x its
                                                     matmul FLOPs at the same 60.9 GiB; 0.10's
                                                     XLA did not (benchmarks/RESULTS.md).
                                                     Recompute is the user's trade, made with
                                                     --recompute-granularity; a step that does
                                                     not fit without the compiler's is reported
                                                     so by `mlm_jax.plan`, naming those flags.
                                                     MaxText's GPU scripts turn it off too.

and XLA_PYTHON_CLIENT_MEM_FRACTION=0.9 (JAX's allocator takes 75 % of device memory by default).

Under --sequence-parallel, context parallelism and FSDP the pipelined all-gather is left out,
--overlap-param-gather or not: the all-gathers it pipelines are then the sequence gathers (SP) or
the key/value gathers and ring blocks (context) inside every layer, and to run them a
step early XLA's collective pipeliner hoists the *next microbatch's* forward into the
microbatch loop's body (inside a pipeline, the next tick's stage recompute into the tick loop),
keeping two microbatches' activations alive. ZeRO's parameter all-gather, the one
--overlap-param-gather is about, runs once per step outside every loop (`parallel.data.gather_once`),
where the scheduler overlaps it and the pipeliner has nothing to do. Measured, H100
deviceless: GPT 1.3B shapes, 4 layers, tp2 SP dp4 ZeRO, micro 2: 3.56 GiB of temporaries with
it, 2.08 without (2.25 without SP); Llama-3 70B tp4 x pp4 SP ZeRO (Megatron's Llama-3 script,
--overlap-param-gather on): 81.74 GiB per device with it, 58.27 without; no layout without SP
changes (benchmarks/RESULTS.md). FSDP (--data-parallel-sharding-strategy optim_grads(_params),
mlm_jax/parallel/fsdp.py) gathers each layer's weights inside the layer loop: left out there too
(GPT 350M shapes, 8 layers, dp8, 2 microbatches: 6.29 GiB with it, 3.67 without; Llama-3 8B
dp8 micro 1: 43.43 and 42.92 GiB, the estimated step 596 and 594 ms, every gather overlapped
either way). Context parallelism: the tiny cp2 x tp2 p2p step ran every
microbatch's matmuls twice with it (2.000 x 6NT, the estimated step 22.9 ms, 29.1 MiB of
temporaries), 1.048 x 6NT, 12.9 ms and 17.8 MiB without; allgather and a2a likewise.

Not set: `--xla_gpu_enable_while_loop_double_buffering` (unrolls the layer scan twice: twice the
compile time, more temporaries). Megatron's --overlap-grad-reduce / --overlap-param-gather ask for
a subset of these (`GRAD_REDUCE`, `PARAM_GATHER`): on GPUs the scheduler's overlap is always on
(--overlap-grad-reduce also moves the gradient reduction into the backward, where there is
compute to overlap: mlm_jax/parallel/data.py).

XLA reads XLA_FLAGS once, when its backend starts, so `apply` runs before any JAX work. A flag
the user already set in XLA_FLAGS, to any value, is left alone (a user's own
--xla_disable_hlo_passes list replaces ours: add `rematerialization` to it to keep the pass off;
`compiler_recompute` says whether it is on, and `mlm_jax.plan` prints it); an unknown flag would
abort XLA, so every flag here is checked against the installed XLA by a test.

The thread pool of XLA:CPU for fake multi-device runs (`cpu_collective_threads`), the number
of CPU devices every command runs on (`use_cpu_devices`, MLM_JAX_CPU_DEVICES), and the C
allocator's settings that let a CPU step reuse its memory (`keep_host_memory`).
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import sys

from mlm_jax.config import ParallelConfig
from mlm_jax.errors import UsageError

_LHS = "--xla_gpu_enable_latency_hiding_scheduler=true"
GRAD_REDUCE = (_LHS, "--xla_gpu_enable_pipelined_all_reduce=true", "--xla_gpu_enable_pipelined_reduce_scatter=true")
PARAM_GATHER = (_LHS, "--xla_gpu_enable_pipelined_all_gather=true")
_COMBINE = 128 * 2**20
MEM_FRACTION_ENV, MEM_FRACTION = "XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9"
GPU_TRAINING = (
    _LHS, "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_enable_pipelined_all_gather=true", "--xla_gpu_enable_pipelined_reduce_scatter=true",
    "--xla_gpu_enable_pipelined_all_reduce=true",
    f"--xla_gpu_all_reduce_combine_threshold_bytes={_COMBINE}",
    f"--xla_gpu_all_gather_combine_threshold_bytes={_COMBINE}",
    f"--xla_gpu_reduce_scatter_combine_threshold_bytes={_COMBINE}",
    "--xla_gpu_enable_triton_gemm=false",
)
NO_COMPILER_RECOMPUTE = "--xla_disable_hlo_passes=rematerialization"
GPU_TRAINING += (NO_COMPILER_RECOMPUTE,)


def _not_given(flags, existing: str) -> list[str]:
    given = {item.split("=", 1)[0] for item in existing.split()}
    return [f for f in dict.fromkeys(flags) if f.split("=", 1)[0] not in given]


def overlap_flags(parallel: ParallelConfig, existing: str = "") -> list[str]:
    """The XLA flags the overlap switches ask for, less those `existing` (XLA_FLAGS) already sets."""
    wanted: list[str] = []
    for on, flags in ((parallel.overlap_grad_reduce, GRAD_REDUCE), (parallel.overlap_param_gather, PARAM_GATHER)):
        wanted += [f for f in flags if on]
    return _not_given(wanted, existing)


_PIPELINED_ALL_GATHER = "--xla_gpu_enable_pipelined_all_gather=true"


def gpu_flags(parallel: ParallelConfig, existing: str = "") -> list[str]:
    """Every XLA flag a GPU run sets (`GPU_TRAINING`, the overlap switches' among them; under
    --sequence-parallel or context parallelism without the pipelined all-gather, see above),
    less those `existing` (XLA_FLAGS) already sets."""
    flags = GPU_TRAINING + tuple(overlap_flags(parallel))
    gathers_in_layers = (parallel.sequence_parallel or parallel.context_parallel_size > 1
                         or parallel.sharding_strategy in ("optim_grads", "optim_grads_params"))
    return _not_given([f for f in flags if not (gathers_in_layers and f == _PIPELINED_ALL_GATHER)], existing)


def compiler_recompute(xla_flags: str) -> bool:
    """Whether XLA's own rematerialization pass runs under these XLA_FLAGS (a GPU run's, after
    `apply`: only a user's --xla_disable_hlo_passes without it turns it back on)."""
    disabled = re.findall(r"--xla_disable_hlo_passes=(\S*)", xla_flags)
    return not disabled or "rematerialization" not in disabled[-1].split(",")


def gpu_run(environ=os.environ) -> bool:
    """Will JAX start a GPU backend? (Asked before JAX starts: JAX_PLATFORMS, the CUDA plugin,
    and an NVIDIA device node.)"""
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    if platforms and not any(p in platforms for p in ("cuda", "gpu")):
        return False
    plugin = any(importlib.util.find_spec(name) is not None for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    return plugin and os.path.exists("/dev/nvidiactl")


def apply(parallel: ParallelConfig, environ=os.environ, gpu: bool | None = None) -> list[str]:
    """Append the GPU flags to `environ`'s XLA_FLAGS on a GPU run (`gpu`: decided by the caller,
    e.g. a deviceless compile for GPUs; default `gpu_run`); returns those added."""
    if not (gpu_run(environ) if gpu is None else gpu):
        return []
    added = gpu_flags(parallel, environ.get("XLA_FLAGS", ""))
    # JAX's allocator takes 75 % of GPU memory by default; JAX-Toolbox trains with 90 %.
    environ.setdefault(MEM_FRACTION_ENV, MEM_FRACTION)
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


# glibc's mallopt parameters (malloc.h) and the environment variables that set them; a user who
# set any of these (or glibc's malloc tunables) chose the allocator's behaviour: left alone.
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8
_MALLOC_ENV = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")


def keep_host_memory(environ=os.environ) -> bool:
    """On a Linux CPU run, make glibc's malloc keep and reuse the memory a step frees: one
    arena, no mmap-backed blocks, no trimming. Returns whether it did.

    XLA:CPU allocates each execution's temporaries in one block (W's step: 229 MiB), which glibc
    serves with a fresh mmap and unmaps after the step, so every step first-touches all of it
    again: 58,900 page faults and 110-170 ms of kernel time per W step on the 2-core development
    machine (benchmarks/RESULTS.md, issue 29), 0-12,000 with these settings. The arena limit matters
    because XLA's executing thread is not the main thread, and a thread arena serves a block
    that large with mmap whatever M_MMAP_MAX says. The cost: the process keeps its peak heap
    (a training run does anyway). Not on GPUs (device memory is XLA's own allocator's), nor when
    the user set the allocator (`_MALLOC_ENV`, GLIBC_TUNABLES' glibc.malloc); runs before JAX
    starts its threads, so that they share the one arena: `python -m mlm_jax.train` calls it at
    the start of its process (not when `train.main` is called inside another program, whose
    allocator is its own)."""
    if not sys.platform.startswith("linux") or gpu_run(environ):
        return False
    if any(name in environ for name in _MALLOC_ENV) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(param, value) == 1 for param, value in
               ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1)))


CPU_DEVICES_ENV = "MLM_JAX_CPU_DEVICES"


def use_cpu_devices(every_core: bool = False) -> int | None:
    """Set the number of XLA CPU devices before JAX starts its backends; every command (train,
    generate, evaluate, serve, the checkpoint tools) calls it at entry, so all honour the same
    variable. `MLM_JAX_CPU_DEVICES=N` asks for N devices (XLA_FLAGS'
    --xla_force_host_platform_device_count wins when both are set); unset, `every_core` asks
    for one per core (train: a single CPU device runs on about one core, so the default run
    would otherwise leave the rest idle) and otherwise JAX's default (one) is kept. With
    several, XLA:CPU's thread pool is sized for their collectives (`cpu_collective_threads`).
    GPUs are unaffected. Returns the count set (None: JAX's default)."""
    import jax

    forced = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    asked = os.environ.get(CPU_DEVICES_ENV)
    if forced:
        count = int(forced.group(1))
    elif asked is not None:
        if not asked.strip().isdigit() or int(asked) < 1:
            raise UsageError(f"{CPU_DEVICES_ENV}={asked!r}: must be a whole number of CPU devices, 1 or more")
        count = int(asked)
    elif every_core:
        count = max(1, os.cpu_count() or 1)
    else:
        return None
    if not gpu_run():
        cpu_collective_threads(count)
    if not forced:
        try:
            jax.config.update("jax_num_cpu_devices", count)
        except RuntimeError:  # called in a process whose JAX already runs (a test, a notebook): kept
            pass
    return count
