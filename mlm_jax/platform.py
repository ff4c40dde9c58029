"""Which kind of device a program is compiled for: the mesh's devices decide, not `jax.devices()`.

A deviceless GPU compile (`mlm_jax.plan`) runs in a CPU process whose mesh holds compile-only
NVIDIA devices, so every platform decision (the attention backend, host offload, the XLA flags)
asks the devices the step is traced for. `parallel.tracing` puts the mesh's platform in the trace
context (`sharding.trace`) while a step is traced; outside it the default device decides.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import os
import sys

CUDA, ROCM, CPU, TPU = "cuda", "rocm", "cpu", "tpu"

def device_platform(device) -> str:
    """'cuda' (NVIDIA GPU), 'rocm', 'cpu', 'tpu' or the device's own platform name."""
    platform = str(device.platform).lower()
    if platform not in ("gpu", CUDA, ROCM):
        return platform
    kind = str(getattr(device, "device_kind", "")).lower()
    version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
    if platform == ROCM or "rocm" in version or "hip" in version or kind.startswith("amd"):
        return ROCM
    return CUDA


def mesh_platform(mesh) -> str:
    """The platform of a mesh's devices (all of one kind)."""
    return device_platform(mesh.devices.flat[0])


def current() -> str:
    """The platform of the step being traced, else of the default device."""
    from mlm_jax.sharding import trace

    if trace.current().platform is not None:
        return trace.current().platform
    import jax

    return device_platform(jax.devices()[0])


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 to /dev/null (C libraries' prints included), restored after."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def _needs_quieting() -> bool:
    """The CUDA plugin is installed (deviceless compiles) on a machine with no NVIDIA GPU."""
    return not os.path.exists("/dev/nvidiactl") and any(
        importlib.util.find_spec(name) is not None for name in ("jax_cuda12_plugin", "jax_cuda13_plugin"))


def _quiet_discovery() -> None:
    from jax._src import xla_bridge

    discover = getattr(xla_bridge, "discover_pjrt_plugins", None)
    if discover is None or getattr(discover, "quiet", False):
        return

    def quietly() -> None:
        with _stderr_silenced():
            discover()

    quietly.quiet = True
    xla_bridge.discover_pjrt_plugins = quietly


def quiet_cuda_plugin() -> None:
    """On a machine without an NVIDIA GPU, jax's CUDA plugin (installed for deviceless compiles,
    `.[gpu-compile]`) prints driver-not-found lines to stderr when jax is imported and when it
    starts its backends; there they are noise, not news. On such a machine jax's import (whenever
    it comes: `import mlm_jax` stays light, so a command's first line is not kept waiting on it)
    and its later plugin discovery run with stderr silenced (the plugin still registers where it
    can: `mlm_jax.plan` compiles with it). Where a GPU is, or no plugin is installed, nothing
    changes."""
    if not _needs_quieting():
        return
    if "jax" in sys.modules:
        _quiet_discovery()
    elif not any(isinstance(f, _QuietJaxImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _QuietJaxImport())


class _QuietJaxImport(importlib.abc.MetaPathFinder):
    """Finds `jax` as the other finders do, and runs its module body with stderr silenced."""

    def find_spec(self, name, path=None, target=None):
        if name != "jax":
            return None
        sys.meta_path.remove(self)  # once: the spec below comes from the usual finders
        spec = importlib.util.find_spec("jax")
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _QuietLoader(spec.loader)
        return spec


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader):
        self.loader = loader

    def __getattr__(self, name):  # resources, source, is_package ...: the real loader's
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        with _stderr_silenced():
            self.loader.exec_module(module)
        _quiet_discovery()


def _capability(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in str(text).split("."))


@contextlib.contextmanager
def compiling_for(mesh):
    """jax's cuDNN attention checks answer for the mesh's NVIDIA devices while a step is traced.

    jax asks the local GPU's compute capability before it lets cuDNN's fused attention take a
    head wider than 128 (up to 256 on Hopper: DeepSeek-V3's 192-wide MLA heads) or MLA's unequal
    query and value widths. A deviceless compile (`mlm_jax.plan`) runs in a CPU process whose
    compile-only devices carry the target's capability: for its duration jax's two checks
    (`check_compute_capability`, `is_cuda_compute_capability_equal`) read that capability instead
    of failing over to "no GPU". Where the process has NVIDIA GPUs of its own, or the mesh is not
    NVIDIA's, nothing changes."""
    device = mesh.devices.flat[0]
    target = getattr(device, "compute_capability", None)
    if mesh_platform(mesh) != CUDA or target is None or _local_cuda():
        yield
        return
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa
    except ImportError:  # no cuDNN attention module in this jax: nothing asks
        yield
        return
    names = ("check_compute_capability", "is_cuda_compute_capability_equal")
    saved = {n: getattr(fa, n) for n in names if hasattr(fa, n)}
    answers = {"check_compute_capability": lambda c: _capability(target) >= _capability(c),
               "is_cuda_compute_capability_equal": lambda c: _capability(target) == _capability(c)}
    for name in saved:
        setattr(fa, name, answers[name])
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(fa, name, fn)


def _local_cuda() -> bool:
    """Whether this process's default backend is NVIDIA GPUs (a real device, not a deviceless compile)."""
    import jax

    try:
        return device_platform(jax.devices()[0]) == CUDA
    except RuntimeError:
        return False


def cudnn_capability_at_least(capability: str) -> bool:
    """jax's own answer to "is the GPU cuDNN runs on at least `capability`?" (the device this
    process runs on, or a deviceless compile's target inside `compiling_for`); False without a GPU."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        return bool(fa.check_compute_capability(capability))
    except (ImportError, AttributeError, RuntimeError, ValueError, TypeError):
        return False
