"""Multi-host faults end fast with a reason (mlm_jax/peers.py).

Real processes joined through jax.distributed on loopback, started without the launcher (as a
cluster scheduler would start them), 2 processes x 1 CPU device, a tiny GPT training until it is
stopped. Killing one process must stop the other within --peer-timeout plus a few seconds, with
`error: [process i/N] process j stopped (...)` as its last line, exit 1 and no Python traceback;
processes started with different flags must fail at start-up naming the flag.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from mlm_jax.peers import DONE, FAILED, PREFIX, PeerWatch, config_differences
from tests.test_multihost import child_env, free_port
from tests.tiny_flags import xla_flags_for

PEER_TIMEOUT = 6.0
RUN = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
       "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "256",
       "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "100000",
       "--log-interval", "5", "--eval-interval", "100000", "--eval-iters", "1", "--no-progress-bar",
       "--sample-tokens", "0", "--peak-flops-per-device", "1e9", "--peer-timeout", str(PEER_TIMEOUT)]


def start(tmp, extra=(None, None)):
    """Two training processes (no launcher); their output goes to tmp/p<i>.log."""
    port = free_port()
    procs = []
    for i in range(2):
        env = child_env(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1", MLM_JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                        MLM_JAX_NUM_PROCESSES="2", MLM_JAX_PROCESS_ID=str(i),
                        XLA_FLAGS=xla_flags_for(1))
        argv = RUN + ["--run-dir", str(tmp / "run")] + list(extra[i] or [])
        log = open(tmp / f"p{i}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "mlm_jax.train", *argv], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def wait_for_line(path, text, procs, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if text in path.read_text():
            return
        assert all(p.poll() is None for p in procs), path.read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"no {text!r} within {timeout} s:\n{path.read_text()[-3000:]}")


def kill_all(procs):
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def kill_and_time_survivor(tmp, victim):
    procs = start(tmp)
    try:
        wait_for_line(tmp / "p0.log", "iteration        5/", procs)
        procs[victim].kill()
        t0 = time.monotonic()
        survivor = procs[1 - victim]
        survivor.wait(timeout=PEER_TIMEOUT + 60)
        return survivor.returncode, time.monotonic() - t0, (tmp / f"p{1 - victim}.log").read_text()
    finally:
        kill_all(procs)


def last_line(log: str) -> str:
    return [line for line in log.splitlines() if line.strip()][-1]


def test_killed_worker_stops_the_others_within_the_peer_timeout(tmp_path):
    code, seconds, log = kill_and_time_survivor(tmp_path, victim=1)
    print(f"survivor (process 0) exited {code} {seconds:.1f} s after process 1 was killed")
    assert code == 1, log[-3000:]
    assert last_line(log).startswith("error: [process 0/2] process 1 stopped (no heartbeat for"), log[-3000:]
    assert "Traceback" not in log
    assert seconds < PEER_TIMEOUT + 10


def test_killed_coordinator_process_stops_the_others(tmp_path):
    code, seconds, log = kill_and_time_survivor(tmp_path, victim=0)
    print(f"survivor (process 1) exited {code} {seconds:.1f} s after process 0 was killed")
    assert code == 1, log[-3000:]
    assert last_line(log).startswith("error: [process 1/2] process 0 stopped"), log[-3000:]
    assert "Traceback" not in log
    assert seconds < PEER_TIMEOUT + 10


def test_processes_with_different_flags_fail_at_start_naming_the_flag(tmp_path):
    procs = start(tmp_path, extra=(["--num-layers", "2"], ["--num-layers", "3"]))
    try:
        for p in procs:
            p.wait(timeout=120)
    finally:
        kill_all(procs)
    for i, p in enumerate(procs):
        log = (tmp_path / f"p{i}.log").read_text()
        assert p.returncode == 2, log[-3000:]
        line = last_line(log)
        assert line.startswith(f"error: [process {i}/2] the processes were started with different "
                               "configurations: --num-layers (model.num_layers) is"), log[-3000:]
        assert "Traceback" not in log and "iteration" not in log  # nothing was trained


# -- the verdict logic, on a stand-in for jax's key-value store ----------------------------------


class Store:
    """jax's coordination key-value store, as far as PeerWatch uses it."""

    def __init__(self):
        self.kv, self.up = {}, True

    def key_value_set(self, key, value, allow_overwrite=False):
        if not self.up:
            raise RuntimeError("UNAVAILABLE")
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        if not self.up:
            raise RuntimeError("UNAVAILABLE")
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def watch_of(pid, store, timeout=0.5):
    watch = PeerWatch(pid, 3, timeout, client=store)
    watch.stop.set()  # driven by hand below: no threads
    return watch


def beat(watch):
    watch.stop.clear()
    watch.count += 1
    store = watch.client
    store.key_value_set(f"{PREFIX}{watch.pid}", str(watch.count))
    now = time.monotonic()
    watch.last_answer = now
    for key, value in store.key_value_dir_get(PREFIX):
        j = int(key.rsplit("/", 1)[-1])
        if watch.seen[j][0] != value:
            watch.seen[j] = (value, now)
    watch.stop.set()


def test_verdict_names_the_silent_process_and_respects_done_and_failed():
    store = Store()
    w0, w1, w2 = (watch_of(i, store) for i in range(3))
    for w in (w0, w1, w2, w0):
        beat(w)
    assert w0.verdict() is None
    time.sleep(0.6)
    beat(w1)
    beat(w0)
    assert w0.verdict().startswith("process 2 stopped (no heartbeat for")  # 1 beat again, 2 did not
    store.kv[f"{PREFIX}2"] = DONE  # a finished process is not a dead one
    beat(w0)
    assert w0.verdict() is None
    store.kv[f"{PREFIX}1"] = FAILED + "error: bad data"
    beat(w0)
    assert w0.verdict() == "process 1 stopped (error: bad data)"


def test_verdict_when_the_store_is_gone():
    store = Store()
    w1 = watch_of(1, store)
    beat(w1)
    store.up = False
    time.sleep(0.6)
    assert w1.verdict().startswith("process 0 stopped (its coordination service has not answered")


def test_config_differences_name_flags():
    assert config_differences({"model.num_layers": 2, "train.lr": 1.0}, {"model.num_layers": 3, "train.lr": 1.0}) == [
        "--num-layers (model.num_layers) is 2 here but 3"]
