"""Notebook helpers: a fake multi-device CPU mesh on one machine."""

from __future__ import annotations


def fake_devices(n: int = 8) -> list:
    """Make jax see `n` CPU devices; call before anything else touches jax's devices.

    Returns the devices. Raises if jax already started with a different number (the count is
    fixed once the backend exists; restart the kernel and call this first).
    """
    import jax

    from mlm_jax import xla_flags

    if n < 1:
        raise ValueError(f"fake_devices needs n >= 1, got {n}")
    xla_flags.cpu_collective_threads(n)  # read when the CPU client starts (it may already have)
    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:  # the backend is already initialised
        have = len(jax.devices("cpu"))
        if have != n:
            raise RuntimeError(
                f"jax already started with {have} CPU device(s); fake_devices({n}) must run "
                "before any jax computation (restart the interpreter and call it first)"
            ) from e
    devices = jax.devices()
    if len(devices) != n:
        raise RuntimeError(f"asked for {n} fake CPU devices, jax has {len(devices)}: {devices}")
    return devices
