"""Tests run on a fake 8-device CPU mesh; the flags must be set before jax is imported."""

import os
import signal

# The Ctrl-C tests send SIGINT to this process and to the runs they start. A non-interactive
# shell starts a background job with SIGINT ignored, children inherit that, and a run with
# SIGINT ignored rightly leaves it ignored (nohup): started that way, the suite would test
# nothing. Take SIGINT back, as a foreground process has it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

os.environ["XLA_FLAGS"] = (
    # Tests check correctness, not speed: cheaper CPU codegen shortens every compile.
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true " +
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's thread pool sized for 8 devices' collectives (a too-small pool deadlocks, see there).
from mlm_jax.xla_flags import cpu_collective_threads  # noqa: E402  (imports no jax)

cpu_collective_threads(8)
# No persistent compilation cache (this process and the runs it starts inherit it): with it, XLA:CPU
# crashed a worker now and then, in an executable's serialisation for the cache (abort) or in a
# later compile (segfault), and a crashed worker leaves pytest-xdist waiting forever (the CI run
# that did not finish). A cold suite took as long without it (19:46 against 20:20 with it).
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

import jax  # noqa: E402

assert jax.device_count() == 8, f"expected 8 fake CPU devices, got {jax.device_count()}"


# The longest files first, so that neither worker is left with one of them at the end.
HEAVY_FIRST = ("test_gpu_compile.py", "test_pipeline.py", "test_moe.py", "test_compiled.py", "test_multihost.py",
               "test_reliability.py", "test_checkpoint.py", "test_megatron_examples.py")


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(rank)))  # stable


# .ci/run: each test's outcome, as the controller learns it (a worker's crash included), so that a
# run cut short by a crashed worker can name the files it did not finish (.ci/unfinished.py).
OUTCOMES = os.environ.get("MLM_JAX_TEST_OUTCOMES")


def pytest_runtest_logreport(report):
    if not OUTCOMES or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    if report.failed:
        outcome = "crashed" if "crashed while running" in str(report.longrepr) else "failed"
    elif report.skipped or (report.passed and report.when == "call"):
        outcome = "skipped" if report.skipped else "passed"
    else:
        return
    node = getattr(getattr(report, "node", None), "gateway", None)  # which worker ran it (xdist)
    with open(OUTCOMES, "a") as f:
        f.write(f"{outcome}\t{report.nodeid}\t{getattr(node, 'id', '')}\n")
