"""GPU targets for deviceless compiles: compile-only NVIDIA devices on a machine without any.

Each target is a `stream_executor.GpuTargetConfigProto` text in `mlm_jax/targets/` (compute
capability, SM count, memory, bandwidth, cuDNN version); jax's CUDA plugin turns it into a
topology of compile-only devices that meshes and shardings accept and `jit(...).lower().compile()`
compiles for, as on the cluster. Nothing can run on them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import re
import shutil

from mlm_jax.errors import UsageError

TARGET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "targets")


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str  # the --gpu value
    description: str  # the device kind the devices report
    memory_bytes: int  # device memory (what the program must fit in)
    bf16_tflops: float  # dense bf16 tensor-core peak (datasheet, without sparsity)
    fp32_tflops: float  # fp32 on the CUDA cores, not the tensor cores (datasheet)

    @property
    def target_file(self) -> str:
        return os.path.join(TARGET_DIR, f"{self.name}.txtpb")

    @property
    def memory_bandwidth(self) -> float:
        """HBM bytes/s: the target description's `memory_bandwidth` (what XLA's cost model reads)."""
        return _bandwidth(self.target_file)


@functools.cache
def _bandwidth(path: str) -> float:
    with open(path) as f:
        m = re.search(r"^\s*memory_bandwidth:\s*(\d+)", f.read(), re.M)
    if not m:
        raise ValueError(f"{path}: no memory_bandwidth")
    return float(m.group(1))


# Device memory as CUDA reports it (cudaMemGetInfo's total); peaks from NVIDIA's datasheets (SXM;
# B200's fp32: the HGX B200 sheet's 600 TFLOPS for 8 GPUs).
GPUS = {
    "h100": Gpu("h100", "NVIDIA H100 80GB HBM3", 84_942_979_072, 989.0, 67.0),
    "h200": Gpu("h200", "NVIDIA H200", 150_754_820_096, 989.0, 67.0),
    "a100": Gpu("a100", "NVIDIA A100-SXM4-80GB", 85_198_045_184, 312.0, 19.5),
    "b200": Gpu("b200", "NVIDIA B200", 191_537_889_280, 2250.0, 75.0),
}


def plugin_missing() -> str | None:
    """Why deviceless GPU compiles cannot run here (None: they can)."""
    if importlib.util.find_spec("jax_cuda12_plugin") is None and importlib.util.find_spec("jax_cuda13_plugin") is None:
        return ("the CUDA plugin for jax is not installed: pip install -e \".[gpu-compile]\" "
                "(compile-only, no GPU or driver needed)")
    if not _ptxas_found():
        return ("no ptxas (XLA assembles every GPU kernel with it): pip install -e \".[gpu-compile]\" "
                "installs it (nvidia-cuda-nvcc-cu12), or put a CUDA toolkit's bin on PATH")
    return None


def _ptxas_found() -> bool:
    """Whether XLA will find ptxas: on PATH, in a CUDA toolkit where XLA looks (CUDA_DIR,
    /usr/local/cuda, /opt/cuda) or in the nvidia-cuda-nvcc wheel."""
    if shutil.which("ptxas"):
        return True
    dirs = [os.environ.get("CUDA_DIR", ""), "/usr/local/cuda", "/opt/cuda"]
    try:
        spec = importlib.util.find_spec("nvidia.cuda_nvcc")
    except ModuleNotFoundError:  # no nvidia namespace at all
        spec = None
    dirs += list(spec.submodule_search_locations or []) if spec else []
    return any(d and os.access(os.path.join(d, "bin", "ptxas"), os.X_OK) for d in dirs)


# The wheels whose versions a GPU run's program depends on: cuDNN (XLA gates fused kernels on
# its version) and the CUDA runtime (below 12 XLA emits no fp8 cuBLASLt GEMM), `jax[cuda12]`'s
# and `.[gpu-compile]`'s (which has nvcc's wheel, of the runtime's release, in its place).
_CUDNN_WHEELS = ("nvidia-cudnn-cu12", "nvidia-cudnn-cu13")
_CUDA_WHEELS = ("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime-cu13", "nvidia-cuda-nvcc-cu12", "nvidia-cuda-nvcc-cu13")


def installed_version(wheels) -> tuple[int, int] | None:
    """(major, minor) of the first of `wheels` installed here, None if none is."""
    from importlib import metadata

    for name in wheels:
        try:
            major, minor = metadata.version(name).split(".")[:2]
            return int(major), int(minor)
        except (metadata.PackageNotFoundError, ValueError):
            continue
    return None


def _with_version(text: str, field: str, version: tuple[int, int] | None) -> str:
    if version is None:
        return text
    block = f"{field} {{\n  major: {version[0]}\n  minor: {version[1]}\n}}"
    return re.sub(field + r" \{[^}]*\}", block, text) if field + " {" in text else text + block + "\n"


def target_text(target: Gpu) -> str:
    """`target`'s description for XLA: its file (mlm_jax/targets/), whose cuDNN and CUDA runtime
    versions are replaced by those of the wheels installed here, as a GPU node that installs
    `.[cuda12]` at the same time gets them: XLA gates features on both, so a target claiming
    older ones compiles a different program from the one that runs (the files' own, 9.28 and
    12.9, are `jax[cuda12]`'s of 2026-12, for machines without the wheels)."""
    with open(target.target_file) as f:
        text = f.read()
    text = _with_version(text, "dnn_version_info", installed_version(_CUDNN_WHEELS))
    return _with_version(text, "runtime_version", installed_version(_CUDA_WHEELS))


def by_device_kind(kind: str) -> Gpu | None:
    """The target whose devices report `kind` (jax's `device_kind`), or None: the part is not
    described here (a PCIe or NVL card, another memory size, a CPU)."""
    return next((g for g in GPUS.values() if g.description == kind), None)


def gpu(name: str) -> Gpu:
    if name not in GPUS:
        raise UsageError(f"--gpu {name!r}: choose one of {', '.join(GPUS)}")
    return GPUS[name]


def check_cluster(count: int, per_node: int) -> int:
    """GPUs per node as used (a cluster smaller than a node is one node); UsageError naming
    --gpus / --gpus-per-node when the counts do not make whole nodes."""
    if count < 1 or per_node < 1:
        raise UsageError(f"--gpus {count} / --gpus-per-node {per_node}: both must be >= 1")
    if count % min(per_node, count):
        raise UsageError(f"--gpus {count} is not a multiple of --gpus-per-node {per_node}")
    return min(per_node, count)


def devices(target: Gpu, count: int, per_node: int = 8) -> list:
    """`count` compile-only devices of `target`, `per_node` to a host (hosts x gpus per host)."""
    why = plugin_missing()
    if why:
        raise UsageError(why)
    per_node = check_cluster(count, per_node)
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", target_config=target_text(target),
                                        topology=f"1x{count // per_node}x{per_node}")
    return list(topo.devices)
