"""mlm_jax.testing.fake_devices in a fresh interpreter (the device count is fixed per process)."""

import subprocess
import sys


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": ""})


def test_fake_devices_gives_the_asked_count():
    out = run("from mlm_jax.testing import fake_devices; print(len(fake_devices(4)))")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("4")


def test_fake_devices_after_jax_started_says_why():
    out = run("import jax; jax.devices(); from mlm_jax.testing import fake_devices; fake_devices(4)")
    assert out.returncode != 0
    assert "jax already started with 1 CPU device(s); fake_devices(4) must run before" in out.stderr
