"""Tests run on a fake 8-device CPU mesh; the flags must be set before jax is imported."""

import os
import signal

# The Ctrl-C tests send SIGINT to this process and to the runs they start. A non-interactive
# shell starts a background job with SIGINT ignored, children inherit that, and a run with
# SIGINT ignored rightly leaves it ignored (nohup): started that way, the suite would test
# nothing. Take SIGINT back, as a foreground process has it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Tests check correctness, not speed: cheaper CPU codegen shortens every compile (LLVM at -O0).
# XLA:CPU's older fusion emitters compile the tiny test programs 1.5-3x faster than its MLIR
# fusion emitters (backend compile of a tp2 x dp4 ZeRO step, quiet machine: 1.27 -> 0.52 s;
# one device: 0.82 -> 0.27 s). They contract a multiply-add into an FMA in some loops and not in
# others, so a sharded program's random init then differs from one device's by an ulp here and
# there (tests/test_fp16.py found it); without FMA instructions (AVX's instruction set, x86 only)
# the layouts start from the same init again (and the pp2 x tp2 step's loss was the default
# emitters' to the last digit).
FAST_COMPILE = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
OLD_EMITTERS = ["--xla_cpu_use_fusion_emitters=false", "--xla_cpu_max_isa=AVX"]


def _old_emitters_accepted() -> bool:
    """Whether the installed XLA starts with OLD_EMITTERS (it aborts on a flag it does not know):
    asked once, by the first process (pytest's controller); its workers inherit the answer."""
    import platform
    import subprocess
    import sys

    known = os.environ.get("MLM_JAX_TEST_OLD_EMITTERS")
    if known is None:
        known = "0"
        if platform.machine().lower() in ("x86_64", "amd64"):
            probe = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True,
                                   env=dict(os.environ, XLA_FLAGS=" ".join(OLD_EMITTERS), JAX_PLATFORMS="cpu"))
            known = "1" if probe.returncode == 0 else "0"
        os.environ["MLM_JAX_TEST_OLD_EMITTERS"] = known
    return known == "1"


if _old_emitters_accepted():
    FAST_COMPILE += OLD_EMITTERS
os.environ["XLA_FLAGS"] = (
    " ".join(FAST_COMPILE) + " " + os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA:CPU's thread pool sized for 8 devices' collectives (a too-small pool deadlocks, see there).
from mlm_jax.xla_flags import cpu_collective_threads  # noqa: E402  (imports no jax)

cpu_collective_threads(8)
# No persistent compilation cache (this process and the runs it starts inherit it): with it, XLA:CPU
# crashed a worker now and then, in an executable's serialisation for the cache (abort) or in a
# later compile (segfault), and a crashed worker leaves pytest-xdist waiting forever (the CI run
# that did not finish). A cold suite took as long without it (19:46 against 20:20 with it); inside
# the workers it later cost more in retrievals than it saved (17.3 s against 8.7 s, benchmarks/RESULTS.md).
os.environ.setdefault("JAX_ENABLE_COMPILATION_CACHE", "false")

import jax  # noqa: E402

assert jax.device_count() == 8, f"expected 8 fake CPU devices, got {jax.device_count()}"


# The longest files first (wall seconds in a full run, 2026-12-05; test_fp8, test_fsdp and test_mla
# 2026-12-07), so that neither worker is left with one of them at the end; pyproject's
# `--no-loadscope-reorder` keeps this order (pytest-xdist otherwise hands out the files with the
# most tests first).
HEAVY_FIRST = ("test_gpu_compile.py", "test_pipeline.py", "test_moe.py", "test_reliability.py", "test_fp8.py",
               "test_fsdp.py", "test_megatron_examples.py", "test_compiled.py", "test_context_parallel.py", "test_mla.py",
               "test_checkpoint.py", "test_plan_calibration.py", "test_fp16.py", "test_reliability_data.py",
               "test_megatron_flags_model.py", "test_multihost.py", "test_reliability_eval.py",
               "test_megatron_checkpoint.py", "test_batch_schedule.py", "test_reliability_procs.py", "test_peers.py",
               "test_parallel.py")
# test_first_hour.py (the quickstart and its next commands, run as a user would; ~75 s) last, when
# the other worker is finishing: its checks of the output's timing (no silence over 5 s) want a
# machine that is not overloaded, and scheduled among the heavy files it once saw JAX's import
# take 5.8 s.
LAST = ("test_first_hour.py",)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    rank.update({name: len(HEAVY_FIRST) + 1 + i for i, name in enumerate(LAST)})
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.path)), len(HEAVY_FIRST)))  # stable


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
