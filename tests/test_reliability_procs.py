"""The processes around a run end cleanly and say what they do: a multi-process join that never
completes, a preprocessing run stopped mid-document, the local launcher's output, and the
progress rate (reliability issue, process rows).

Each case runs the real command in a subprocess and asserts its exit code and last line; where a
C++ library would otherwise speak (jax's distributed client, gloo), that none of its lines show.
Run as a script (`python tests/test_reliability_procs.py gloo`), this file is the launcher
case's per-process command: it joins through mlm_jax.distributed and runs one gloo collective.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

from tests.tiny_flags import xla_flags_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL_SH = os.path.join(ROOT, "launch", "local.sh")
# The tiny model of tests/test_reliability.py (T), on one CPU device.
T = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
     "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
     "--global-batch-size", "4", "--vocab-size", "256", "--sample-tokens", "0",
     "--peak-flops-per-device", "1e12"]
CPP = re.compile(r"Check failure|Terminating process|^\s+@\s+0x|^[FE]\d{4} ", re.M)
GLOO = re.compile(r"\[Gloo\]|peer ranks")
DISTRIBUTED_VARS = ("MLM_JAX_COORDINATOR_ADDRESS", "MLM_JAX_NUM_PROCESSES", "MLM_JAX_PROCESS_ID",
                    "MLM_JAX_COORDINATOR_TIMEOUT", "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT")


def env(**extra) -> dict:
    """One CPU device, this checkout's code, no distributed settings inherited."""
    e = {k: v for k, v in os.environ.items()
         if not k.startswith("SLURM_") and k not in DISTRIBUTED_VARS and k != "MLM_JAX_DEBUG"}
    e.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", MLM_JAX_CPU_DEVICES="1",
             XLA_FLAGS=xla_flags_for(None))
    e.update(extra)
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_last_error(rc: int, out: str, code: int, *named: str) -> str:
    """Exit `code`; the last line is `error: ...` naming every `named`; no traceback, no C++."""
    assert rc == code, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert not CPP.search(out), out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: "), out[-3000:]
    for text in named:
        assert text in last, (text, last)
    return last


# ----------------------------------------------------------------------------- 1. a join that never completes

def test_process_0_alone_ends_with_our_line_not_a_cpp_abort(tmp_path):
    """Process 0 of 2, process 1 never started: our line at --coordinator-timeout, exit 1 (jax's
    client used to abort with exit 134 and a C++ stack trace after it)."""
    port = free_port()
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "mlm_jax.train", *T, "--coordinator-address", f"127.0.0.1:{port}",
                        "--num-processes", "2", "--process-id", "0", "--coordinator-timeout", "3"],
                       cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert_last_error(p.returncode, p.stdout + p.stderr, 1, "[process 0/2] process 1 never joined",
                      f"127.0.0.1:{port} (--coordinator-address)", "--coordinator-timeout 3 s", "--num-processes")
    assert time.monotonic() - t0 < 60


def test_process_1_without_process_0_ends_with_our_line(tmp_path):
    port = free_port()
    p = subprocess.run([sys.executable, "-m", "mlm_jax.train", *T, "--coordinator-address", f"127.0.0.1:{port}",
                        "--num-processes", "2", "--process-id", "1", "--coordinator-timeout", "3"],
                       cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert_last_error(p.returncode, p.stdout + p.stderr, 1,
                      f"[process 1/2] cannot reach the coordinator at 127.0.0.1:{port} within 3 s",
                      "--coordinator-address", "--coordinator-timeout")


# ----------------------------------------------------------------------------- 2. preprocessing stopped mid-document

PRE = ["-m", "mlm_jax.data.preprocess", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
       "--no-progress"]


def snapshot(folder) -> dict[str, str]:
    return {p: hashlib.md5(open(p, "rb").read()).hexdigest()
            for p in glob.glob(os.path.join(folder, "*")) if os.path.isfile(p)}


def test_signal_stops_preprocessing_mid_document_at_once(tmp_path):
    """One 80 MB document (several seconds in a worker): SIGTERM and Ctrl-C stop within seconds,
    not after the document (the pool's workers are killed), with one line and the exit code of
    mlm_jax/errors.py (SIGTERM: 1, a stopped run; Ctrl-C: 130); no temporary file is left and the
    earlier complete output is untouched."""
    out = tmp_path / "out"
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "1 2 3"}\n')
    p = subprocess.run([sys.executable, *PRE, "--input", good, "--output-prefix", out / "o"], env=env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    before = snapshot(out)
    big = tmp_path / "big.jsonl"
    big.write_text('{"text": "' + "7 " * 40_000_000 + '"}\n')
    for sig, code, said in ((signal.SIGTERM, 1, "stopped by SIGTERM; no output written"),
                            (signal.SIGINT, 130, "interrupted (Ctrl-C)")):
        p = subprocess.Popen([sys.executable, *PRE, "--input", big, "--output-prefix", out / "o", "--workers", "2"],
                             env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not glob.glob(str(out / "*.tmp-*.bin")) and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(2.0)  # the workers are started and one holds the document
        assert p.poll() is None, "preprocessing ended before it could be stopped"
        t0 = time.monotonic()
        p.send_signal(sig)
        _, err = p.communicate(timeout=120)
        stopped_in = time.monotonic() - t0
        assert_last_error(p.returncode, err, code, said)
        assert stopped_in < 4, stopped_in  # the document alone takes longer than that
        assert glob.glob(str(out / "*.tmp-*")) == []
        assert snapshot(out) == before


# ----------------------------------------------------------------------------- 3. the local launcher's output

def test_local_launcher_shows_no_gloo_lines_but_every_error(tmp_path):
    """launch/local.sh, 2 processes that run a real gloo collective after a progress-bar-like
    line without a newline (where gloo's announcement used to land mid-line and pass the
    filter); process 1 then fails. No gloo line shows, process 0's output and process 1's error
    do."""
    logs = tmp_path / "logs"
    p = subprocess.run(["bash", LOCAL_SH, "2", "1"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=env(LAUNCH_COMMAND=f"{sys.executable} {os.path.abspath(__file__)} gloo",
                               LOG_DIR=str(logs), GRACE_SECONDS="1", PYTHON=sys.executable))
    out = p.stdout + p.stderr
    assert p.returncode == 3, out
    assert "gloo collective: 2.0" in out and "training:   0%|" in out, out
    assert "[process 1] error: [process 1/2] deliberate failure after the collective" in p.stderr, out
    assert not GLOO.search(out), out
    assert "[Gloo] Rank 0 is connected to 1 peer ranks" in (logs / "process_0.log").read_text()  # gloo did speak


def gloo_worker() -> int:
    """The launcher case's process: join, half a progress bar, one gloo collective."""
    import numpy as np
    from jax.experimental import multihost_utils

    from mlm_jax.distributed import fail, initialize

    plan = initialize()
    sys.stderr.write("training:   0%|          | 0/1 [00:00<?, ?it/s]")
    sys.stderr.flush()
    total = float(np.sum(multihost_utils.process_allgather(np.ones(1, np.float32))))
    if plan.process_id == 0:
        print(f"\ngloo collective: {total}", flush=True)
        time.sleep(600)  # until the launcher stops it
        return 0
    time.sleep(1.0)  # process 0 prints first
    return fail("deliberate failure after the collective", 3)


# ----------------------------------------------------------------------------- 4. the progress rate

def test_time_per_iteration_and_progress_rate_leave_out_eval_and_saves(tmp_path):
    """Evaluation (300 batches) after every step and a save every 2: the logged elapsed time per
    iteration and the progress bar's rate are a training step's, far below an evaluation's
    (before, the bar's rate included evaluation, saves and compiling)."""
    p = subprocess.run([sys.executable, "-m", "mlm_jax.train", *T, "--train-iters", "6", "--log-interval", "1",
                        "--eval-interval", "1", "--eval-iters", "300", "--save", tmp_path / "ckpt",
                        "--save-interval", "2", "--run-dir", tmp_path / "run"],
                       cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    records = [r for r in map(json.loads, open(tmp_path / "run" / "metrics.jsonl")) if "lm_loss" in r]
    assert [r["iteration"] for r in records] == list(range(1, 7))
    # Iteration 1's window is the compiling step; the timers of iteration i are those of i - 1
    # (its step is checked after the next one is dispatched), so they start at iteration 3.
    timed = [r for r in records if "eval_ms" in r]
    assert len(timed) >= 3 and all(r["eval_ms"] > 0 for r in timed), records
    eval_s = sum(r["eval_ms"] for r in timed) / len(timed) / 1000  # one evaluation
    for r in records[1:]:
        assert r["step_time_ms"] / 1000 < eval_s / 4, (r["step_time_ms"], eval_s)
    # The bar's last state, e.g. "training: 100%|...| 6/6 [00:01<00:00,  4.91it/s, loss=5.4]".
    last = p.stderr.replace("\r", "\n").split("\n")
    rates = [m for line in last if line.startswith("training: 100%")
             for m in re.findall(r"([\d.]+)(s/it|it/s)", line)]
    assert rates, p.stderr[-3000:]
    value, unit = rates[-1]
    s_per_it = float(value) if unit == "s/it" else 1 / float(value)
    assert s_per_it < eval_s / 4, (s_per_it, eval_s, rates)


if __name__ == "__main__" and sys.argv[1:] == ["gloo"]:
    sys.exit(gloo_worker())
