"""Which kind of device a program is compiled for: the mesh's devices decide, not `jax.devices()`.

A deviceless GPU compile (`mlm_jax.plan`) runs in a CPU process whose mesh holds compile-only
NVIDIA devices, so every platform decision (the attention backend, host offload, the XLA flags)
asks the devices the step is traced for. `parallel.tracing` puts the mesh's platform in the trace
context (`sharding.trace`) while a step is traced; outside it the default device decides.
"""

from __future__ import annotations

import contextlib
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
    starts its backends; there they are noise, not news. On such a machine import jax now and
    have it discover its plugins later, both with stderr silenced (the plugin still registers
    where it can: `mlm_jax.plan` compiles with it). Where a GPU is, or no plugin is installed,
    nothing changes and jax is not imported here."""
    if not _needs_quieting():
        return
    if "jax" not in sys.modules:
        with _stderr_silenced():
            import jax  # noqa: F401
    _quiet_discovery()
