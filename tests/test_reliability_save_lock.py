"""Issue "reliability, round three", its data-loss row: two `train` processes given one `--save`
folder both ran, and iteration 5 "committed" by one held the other's parameters. Now process 0
of a run locks the folder for the run's life (mlm_jax/checkpoint/lock.py): a second run is
refused at start naming the folder and the first run's process; the lock goes on every exit
path, kill -9 included (a dead run's lock is no lock)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mlm_jax.checkpoint.lock import LOCK_NAME, SaveLock
from mlm_jax.errors import UsageError
from tests.test_reliability import T, assert_named_error, cmd, env


def _wait_for(path, proc, timeout=240):
    t0 = time.time()
    while not os.path.exists(path):
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() - t0 < timeout, "the first run never locked its --save folder"
        time.sleep(0.2)


def test_a_second_run_on_one_save_folder_is_refused_and_a_killed_run_leaves_no_lock(tmp_path):
    save = tmp_path / "ck"
    first = subprocess.Popen([sys.executable, "-m", "mlm_jax.train", *T, "--train-iters", "100000",
                              "--save", str(save), "--save-interval", "1000", "--run-dir", str(tmp_path / "r1")],
                             cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(save / LOCK_NAME, first)
        owner = json.loads((save / LOCK_NAME).read_text())
        assert owner["pid"] == first.pid
        rc, out = cmd(T + ["--train-iters", "2", "--save", save, "--run-dir", tmp_path / "r2"], tmp_path)
        line = assert_named_error(rc, out, 2, f"--save {save}", "another training run", f"pid {first.pid}",
                                  str(tmp_path / "r1"))
        assert "give another --save folder" in line
        assert first.poll() is None  # the first run goes on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    # kill -9 released the lock with the process; the file it left names a dead process
    rc, out = cmd(T + ["--train-iters", "2", "--save", save, "--run-dir", tmp_path / "r3"], tmp_path)
    assert rc == 0, out[-3000:]
    assert not (save / LOCK_NAME).exists()  # released at the end of the run
    assert "2" in os.listdir(save)


def test_the_lock_is_released_on_every_exit_and_a_folder_it_made_goes_if_empty(tmp_path, monkeypatch):
    lock = SaveLock.take(str(tmp_path / "new"), "run")
    with pytest.raises(UsageError, match=f"--save {tmp_path / 'new'}: another training run .*pid {os.getpid()}"):
        SaveLock.take(str(tmp_path / "new"))
    lock.release()
    lock.release()  # idempotent
    assert not (tmp_path / "new").exists()  # made by the lock, left empty: gone
    (tmp_path / "kept").mkdir()
    again = SaveLock.take(str(tmp_path / "kept"))
    again.release()
    assert os.listdir(tmp_path / "kept") == []
    # a run that fails after taking the lock (here its data, past the checks) lets it go
    from mlm_jax import train as train_module
    from mlm_jax.arguments import parse_args

    def no_data(*args, **kwargs):
        assert (tmp_path / "s" / LOCK_NAME).exists()  # held while the run is on
        raise OSError("the data went away")

    monkeypatch.setattr(train_module, "build_data", no_data)
    with pytest.raises(OSError, match="the data went away"):
        train_module.train(parse_args(T + ["--train-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "8",
                                           "--save", str(tmp_path / "s"),
                                           "--run-dir", str(tmp_path / "r")]))
    SaveLock.take(str(tmp_path / "s")).release()
