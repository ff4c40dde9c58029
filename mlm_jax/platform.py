"""Which kind of device a program is compiled for: the mesh's devices decide, not `jax.devices()`.

A deviceless GPU compile (`mlm_jax.plan`) runs in a CPU process whose mesh holds compile-only
NVIDIA devices, so every platform decision (the attention backend, host offload, the XLA flags)
asks the devices the step is traced for. `parallelize.tracing` puts the mesh's platform in force
while a step is traced; outside it the default device decides.
"""

from __future__ import annotations

import contextlib

CUDA, ROCM, CPU, TPU = "cuda", "rocm", "cpu", "tpu"

_ACTIVE: list[str] = []  # the platform of the mesh being traced (innermost last)


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


@contextlib.contextmanager
def use_platform(platform: str):
    """The platform in force while a step is traced (see `current`)."""
    _ACTIVE.append(platform)
    try:
        yield platform
    finally:
        _ACTIVE.pop()


def current() -> str:
    """The platform of the step being traced, else of the default device."""
    if _ACTIVE:
        return _ACTIVE[-1]
    import jax

    return device_platform(jax.devices()[0])
