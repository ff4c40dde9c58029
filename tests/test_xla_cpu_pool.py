"""XLA:CPU's intra-op pool is sized for in-process collectives (`xla_flags.cpu_collective_threads`).

With too few pool threads, a multi-device CPU program whose devices run independent collectives
concurrently deadlocks now and then (the two-slot pipeline did, 2 runs in 6 under load: gdb
showed all 8 pool threads waiting in collectives and the devices' own threads waiting for the
pool). These tests check the sizing rule and that the jaxlib in use honours it.
"""

import os
import subprocess
import sys

from mlm_jax import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pool_threads() -> int:
    """Threads of this process named as XLA's Eigen pool threads."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sum(name == "tf_XLAEigen" for name in names)


def test_pool_sized_per_device_unless_the_user_chose():
    env = {}
    assert xla_flags.cpu_collective_threads(8, env) == max(os.cpu_count(), 32) and env == {"NPROC": str(max(os.cpu_count(), 32))}
    env = {"NPROC": "12"}
    assert xla_flags.cpu_collective_threads(8, env) is None and env == {"NPROC": "12"}
    env = {}
    assert xla_flags.cpu_collective_threads(1, env) is None and env == {}  # no collectives


def test_the_suite_runs_with_the_sized_pool():
    import jax

    jax.jit(lambda x: x + 1)(1.0).block_until_ready()  # the CPU client exists
    assert os.environ["NPROC"] == str(max(os.cpu_count(), 32))
    assert _pool_threads() >= 32


def test_the_command_sizes_the_pool_for_its_cpu_devices():
    """`use_every_cpu_core` (what `python -m mlm_jax.train` runs before JAX starts) sizes the
    pool for the device count it sets, and XLA's CPU client takes the size."""
    code = ("import os; from mlm_jax.train import use_every_cpu_core; use_every_cpu_core(); import jax; "
            "jax.jit(lambda x: x + 1)(1.0).block_until_ready(); "
            "from tests.test_xla_cpu_pool import _pool_threads; "
            "print(jax.device_count(), os.environ['NPROC'], _pool_threads())")
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "XLA_FLAGS")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", MLM_JAX_CPU_DEVICES="3")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    devices, nproc, threads = map(int, out.stdout.split())
    assert (devices, nproc) == (3, max(os.cpu_count(), 12)) and threads >= 12
