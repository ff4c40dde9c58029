"""Bad inputs and faults end with one named error and a meaningful exit code, never a traceback,
a hang or lost data (issue 9): failed saves, relative paths, output paths checked before the
first step, damaged checkpoints and Hugging Face files, Ctrl-C, run folders never reused,
MLM_JAX_CPU_DEVICES; and the end-of-run sample of an interleaved pipeline (issue 10).

The command-line cases run `python -m mlm_jax.train` in a subprocess on one CPU device with the
tiny model T; each asserts the exit code, the `error:` line naming the flag or file, the absence
of "Traceback", and that nothing on disk was lost or overwritten.
"""

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

import mlm_jax
from mlm_jax import checkpoint as ckpt
from mlm_jax.arguments import parse_args
from mlm_jax.tools import checkpoint as hfc
from mlm_jax.train import train
from tests.tiny_flags import xla_flags_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
     "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
     "--global-batch-size", "4", "--vocab-size", "256", "--no-progress-bar", "--sample-tokens", "0",
     "--eval-iters", "1", "--peak-flops-per-device", "1e12"]


def env(devices: str = "1") -> dict:
    """One CPU device (not conftest's 8), this checkout's code, the shared compilation cache."""
    e = dict(os.environ, MLM_JAX_CPU_DEVICES=devices, PYTHONPATH=ROOT)
    e["XLA_FLAGS"] = xla_flags_for(None)
    e.pop("MLM_JAX_DEBUG", None)
    return e


def cmd(args, cwd, timeout=240, module="mlm_jax.train", **kwargs):
    """(exit code, output) of `python -m module args` in `cwd`."""
    p = subprocess.run([sys.executable, "-m", module] + [str(a) for a in args], cwd=cwd, env=env(),
                       capture_output=True, text=True, timeout=timeout, **kwargs)
    return p.returncode, p.stdout + p.stderr


def last_line(out: str) -> str:
    return out.strip().splitlines()[-1]


def assert_named_error(rc, out, code, *names):
    assert rc == code, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    line = last_line(out)
    assert line.startswith("error: "), out[-3000:]
    for name in names:
        assert name in line, (name, line)
    return line


def digest(folder) -> dict:
    """{relative path: sha256} of every file under `folder` (what must not change)."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A folder holding one earlier run: `--save ck` (relative), iterations 2 and 4, run folder
    `run1`; then resumed into the same run folder with `--load ck --save ck` (relative, the
    README's pattern) to 6."""
    tmp = tmp_path_factory.mktemp("reliability")
    rc, out = cmd(T + ["--train-iters", "4", "--save", "ck", "--save-interval", "2", "--run-dir", "run1"], tmp)
    assert rc == 0, out[-3000:]
    config = (tmp / "run1" / "config.json").read_bytes()
    rc, resumed = cmd(T + ["--train-iters", "6", "--load", "ck", "--save", "ck", "--save-interval", "2",
                           "--run-dir", "run1"], tmp)
    # Resuming continues the run's files: metrics appended in order, the first config kept.
    assert (tmp / "run1" / "config.json").read_bytes() == config
    assert json.loads((tmp / "run1" / "config.resumed-4.json").read_text())["train"]["train_iters"] == 6
    return tmp, out, resumed, rc


# --------------------------------------------------------------------------- 2. relative paths


def test_relative_paths_resume_load_and_export(work, monkeypatch):
    tmp, _, resumed, rc = work
    assert rc == 0 and "Traceback" not in resumed, resumed[-3000:]
    assert f"resumed from checkpoint {tmp / 'ck' / '4'}: iteration 4" in resumed, resumed[-3000:]
    assert ckpt.scan(str(tmp / "ck"))[0] == [2, 4, 6]
    records = [json.loads(line) for line in open(tmp / "run1" / "metrics.jsonl")]
    assert [r["iteration"] for r in records if "lm_loss" in r] == [4, 6]  # the last of each part
    monkeypatch.chdir(tmp)
    m = mlm_jax.load("ck")  # relative, in Python
    assert m.iteration == 6
    assert hfc.main(["export-hf", "--load", "ck", "--hf-dir", "hf"]) == 0  # relative, the tool
    assert os.path.isfile(tmp / "hf" / "config.json") and os.path.isfile(tmp / "hf" / "model.safetensors")


# --------------------------------------------------------------------------- 3, 8. output paths


def test_output_paths_checked_before_the_first_step(work):
    """Each bad output path is refused before any step (no "iteration" line), naming the flag;
    the earlier run's folder and checkpoints are left byte for byte as they were."""
    tmp, _, _, _ = work
    (tmp / "a_file").write_text("not a folder\n")
    before = {name: digest(tmp / name) for name in ("run1", "ck")}
    cases = [
        (["--save", "a_file"], "--save", "exists and is a file"),
        (["--save", "a_file/sub"], "--save", "cannot create the folder"),
        (["--run-dir", "a_file"], "--run-dir", "exists and is a file"),
        (["--run-dir", "run1"], "--run-dir", "holds an earlier run"),  # 8: never reused ...
        (["--run-dir", "new1", "--metrics-file", "run1/metrics.jsonl"], "--metrics-file", "earlier run"),
        (["--run-dir", "new2", "--metrics-file", "a_file/m.jsonl"], "--metrics-file", "cannot create"),
        (["--run-dir", "new3", "--tensorboard-dir", "a_file"], "--tensorboard-dir", "exists and is a file"),
    ]
    for extra, flag, reason in cases:
        rc, out = cmd(T + ["--train-iters", "2"] + extra, tmp)
        line = assert_named_error(rc, out, 2, flag, reason)
        assert not re.search(r"^ iteration +\d+/", out, re.M), (extra, out[-2000:])
        if "run1" in extra:
            assert "--load" in line and "new --run-dir" in line, line  # ... and says what to do
    assert {name: digest(tmp / name) for name in ("run1", "ck")} == before
    assert (tmp / "a_file").read_text() == "not a folder\n"


def _read_only(folder):
    """Make `folder` refuse new entries, even to root (chattr +i); None if this system cannot."""
    if os.geteuid() != 0:
        os.chmod(folder, 0o555)
        return lambda: os.chmod(folder, 0o755)
    if shutil.which("chattr") and subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
        return lambda: subprocess.run(["chattr", "-i", str(folder)], check=True)
    return None


def test_read_only_save_folder_is_refused_at_start(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    undo = _read_only(ro)
    if undo is None:
        pytest.skip("this file system cannot make a folder read-only for root (no chattr +i)")
    try:
        rc, out = cmd(T + ["--train-iters", "2", "--save", "ro", "--run-dir", "run"], tmp_path)
    finally:
        undo()
    assert_named_error(rc, out, 2, "--save", str(ro), "not writable")
    assert os.listdir(ro) == []


# --------------------------------------------------------------------------- 1. failed saves


def test_save_folder_turned_read_only_mid_run_ends_the_job(tmp_path):
    """The folder becomes read-only after the start checks passed (a remount, a quota, an
    admin): today's failure was a "committed" line, then a hang in Orbax's threads forever.
    The job must end with `error: --save DIR: ...`, exit 1, well within the timeout."""
    ck = tmp_path / "ck"
    ck.mkdir()  # an empty save folder that exists at the start (checks create nothing)
    p = subprocess.Popen([sys.executable, "-m", "mlm_jax.train"] + T + [
        "--train-iters", "400", "--log-interval", "1", "--save", "ck", "--save-interval", "40",
        "--run-dir", "run"], cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    undo, lines = None, []
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith(" iteration        1/"):
                undo = _read_only(ck)
                break
        if undo is None:
            p.kill()
            pytest.skip("this file system cannot make a folder read-only for root (no chattr +i)")
        t0 = time.time()
        out = "".join(lines) + p.communicate(timeout=120)[0]
        took = time.time() - t0
    finally:
        if p.poll() is None:
            p.kill()
        if undo is not None:
            undo()
    assert_named_error(p.returncode, out, 1, f"--save {ck}", "iteration 40 failed")
    assert "committed to" not in out and took < 60, (took, out[-3000:])
    assert ckpt.scan(str(ck))[0] == []


def test_disk_full_during_an_async_save_ends_the_job(tmp_path):
    """Orbax's writer fails in its background threads (here: the file size limit, as a full
    disk would): exit 1 naming --save and the reason, no "committed" line, no traceback."""

    # The limit is set in the child (a preexec_fn would fork this multithreaded process).
    limited = ("import os, resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)); "
               "os.execv(sys.executable, [sys.executable, '-m', 'mlm_jax.train'] + sys.argv[1:])")
    p = subprocess.run([sys.executable, "-c", limited] + T + [
        "--train-iters", "4", "--save", "ck", "--save-interval", "2", "--run-dir", "run"],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=240)
    rc, out = p.returncode, p.stdout + p.stderr
    assert_named_error(rc, out, 1, f"--save {tmp_path / 'ck'}", "iteration 2 failed", "File too large")
    assert "committed to" not in out
    assert ckpt.scan(str(tmp_path / "ck"))[0] == []


# --------------------------------------------------------------------------- 5. damaged inputs


def test_damaged_checkpoint_names_the_array_and_the_previous_one(work, capfd):
    tmp, _, _, _ = work
    bad = tmp / "ck_bad"
    shutil.copytree(tmp / "ck", bad)
    data = bad / "6" / "params" / "ocdbt.process_0" / "d"
    largest = max(data.iterdir(), key=lambda f: f.stat().st_size)
    with open(largest, "r+b") as f:
        f.truncate(100)
    rc, out = cmd(T + ["--train-iters", "8", "--load", "ck_bad", "--run-dir", "run_bad"], tmp)
    line = assert_named_error(rc, out, 2, f"--load {bad / '6'}", "damaged", "--ckpt-step 4")
    assert re.search(r"cannot read array '(embed|pos_embed|final_norm|layers)[\w.]*' of params/", line), line
    assert len(out.splitlines()) < 10, out[-3000:]  # no pages of Orbax/TensorStore reports
    capfd.readouterr()
    with pytest.raises(ckpt.CheckpointError, match=r"damaged: cannot read array .* --ckpt-step 4"):
        mlm_jax.load(str(bad))  # in Python too, and quietly
    reports = capfd.readouterr()
    assert "Traceback" not in reports.err + reports.out and "Exception ignored" not in reports.err, reports.err
    rc, out = cmd(["export-hf", "--load", "ck_bad", "--hf-dir", "hf_bad"], tmp, module="mlm_jax.tools.checkpoint")
    assert_named_error(rc, out, 2, "damaged", "--ckpt-step 4")
    assert not os.path.exists(tmp / "hf_bad")
    # Damaged metadata, and an array's index files deleted: the same, naming what is wrong.
    for name, damage, named in (
            ("meta", lambda c: (c / "meta" / "metadata").write_text("{not json"), "metadata"),
            ("index", lambda c: [os.remove(c / "params" / f) for f in ("manifest.ocdbt", "_METADATA")],
             "not found")):
        shutil.copytree(tmp / "ck", tmp / f"ck_{name}")
        damage(tmp / f"ck_{name}" / "6")
        rc, out = cmd(T + ["--train-iters", "8", "--load", f"ck_{name}", "--run-dir", f"run_{name}"], tmp)
        assert_named_error(rc, out, 2, str(tmp / f"ck_{name}" / "6"), "damaged", named, "--ckpt-step 4")


def test_a_flipped_bit_is_caught_by_the_checksums_written_at_save(work):
    """A bit flipped in an array file that still reads (Orbax checksums its shard index, not the
    values): the load names the array and the previous complete checkpoint, training and
    `mlm_jax.load` alike (they once trained on, or generated from, the damaged weights)."""
    tmp, _, _, _ = work
    bad = tmp / "ck_flip"
    shutil.copytree(tmp / "ck", bad)
    data = bad / "6" / "params" / "ocdbt.process_0" / "d"
    largest = max(data.iterdir(), key=lambda f: f.stat().st_size)
    raw = bytearray(largest.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    largest.write_bytes(bytes(raw))
    rc, out = cmd(T + ["--train-iters", "8", "--load", "ck_flip", "--run-dir", "run_flip"], tmp)
    line = assert_named_error(rc, out, 2, f"--load {bad / '6'}", "damaged", "--ckpt-step 4")
    assert re.search(r"array params/\S+ differs from the checksum written when it was saved", line), line
    with pytest.raises(ckpt.CheckpointError, match=r"array params/\S+ differs from the checksum .* --ckpt-step 4"):
        mlm_jax.load(str(bad))


def test_bad_hugging_face_files_name_the_file(work, capsys):
    tmp, _, _, _ = work
    good = tmp / "hf"  # exported by test_relative_paths_resume_load_and_export, or here
    if not (good / "config.json").exists():
        assert hfc.main(["export-hf", "--load", str(tmp / "ck"), "--hf-dir", str(good)]) == 0
    config = json.loads((good / "config.json").read_text())
    cases = {
        "not_json": ("config.json", b"{ this is not json", "not valid JSON (Expecting property name"),
        "missing_key": ("config.json", json.dumps({k: v for k, v in config.items() if k != "n_embd"}).encode(),
                        "no 'n_embd'"),
        "unsupported": ("config.json", json.dumps({**config, "model_type": "bert", "architectures": ["BertModel"]}
                                                  ).encode(), "'BertModel' is not supported"),
        "truncated": ("model.safetensors", (good / "model.safetensors").read_bytes()[:1000],
                      "not a readable safetensors file"),
    }
    for name, (file, content, reason) in cases.items():
        folder = tmp / f"hf_{name}"
        shutil.copytree(good, folder)
        (folder / file).write_bytes(content)
        capsys.readouterr()
        assert hfc.main(["import-hf", "--hf-dir", str(folder), "--save", str(tmp / f"imp_{name}")]) == 2, name
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert_named_error(2, err, 2, str(folder / file), reason)
        assert not os.path.exists(tmp / f"imp_{name}")


# --------------------------------------------------------------------------- 7. Ctrl-C


def _interrupt(tmp, name, second_after=None):
    """Start a long run, Ctrl-C it after its first logged iteration (and again `second_after`
    seconds later); returns (exit code, output, seconds from the first signal to the exit)."""
    p = subprocess.Popen([sys.executable, "-m", "mlm_jax.train"] + T + [
        "--train-iters", "100000", "--log-interval", "1", "--save", f"ck_{name}", "--run-dir", f"run_{name}"],
        cwd=tmp, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if line.startswith(" iteration ") if second_after is None else line.startswith("> MFU denominator"):
                break
        t0 = time.time()
        p.send_signal(signal.SIGINT)
        if second_after is not None:
            time.sleep(second_after)
            p.send_signal(signal.SIGINT)
        out = "".join(lines) + p.communicate(timeout=120)[0]
    finally:
        if p.poll() is None:
            p.kill()
    return p.returncode, out, time.time() - t0


def test_ctrl_c_saves_and_exits_130(tmp_path):
    """Never swallowed (three tries), never a KeyboardInterrupt traceback, the checkpoint of the
    iteration it stopped at committed."""
    for i in range(3):
        rc, out, _ = _interrupt(tmp_path, str(i))
        assert_named_error(rc, out, 130, "interrupted (Ctrl-C)")
        stopped = int(out.split("> exiting at iteration ")[1].split(":")[0])
        assert f"> exiting at iteration {stopped}: received SIGINT" in out
        assert ckpt.scan(str(tmp_path / f"ck_{i}"))[0] == [stopped]
        assert f"committed to {tmp_path / f'ck_{i}' / str(stopped)}" in out


def test_second_ctrl_c_stops_at_once():
    """The exit policy itself, in this process: the first Ctrl-C asks for a clean stop (the
    loop saves, then the run ends with 130), the second raises KeyboardInterrupt there and then."""
    policy = ckpt.ExitPolicy(parse_args([]).checkpoint, time.time())
    try:
        assert policy.reason(1) is None
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.01)  # the handler runs at the next bytecode boundary
        assert policy.reason(2) == "received SIGINT" and policy.interrupted
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
    finally:
        policy.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_twice_during_the_first_compile(tmp_path):
    """Two quick Ctrl-Cs while the first step compiles: exit 130 promptly, no traceback, and no
    checkpoint claimed for a step that did not finish."""
    rc, out, took = _interrupt(tmp_path, "twice", second_after=0.05)
    assert_named_error(rc, out, 130, "interrupted (Ctrl-C)")
    assert took < 60, (took, out[-2000:])
    saved = ckpt.scan(str(tmp_path / "ck_twice"))[0] if (tmp_path / "ck_twice").exists() else []
    for stopped in saved:  # a save only after a finished step
        assert f"> exiting at iteration {stopped}: received SIGINT" in out


# --------------------------------------------------------------------------- 9. CPU devices


def test_cpu_devices_variable_is_honoured_or_refused(tmp_path):
    p = subprocess.run([sys.executable, "-m", "mlm_jax.train"] + T + [
        "--train-iters", "1", "--micro-batch-size", "1", "--run-dir", "run", "--no-final-checkpoint"],
        cwd=tmp_path, env=env("4"), capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "on 4 cpu device(s)" in out, out[-3000:]
    for bad in ("x", "0", "-2"):
        p = subprocess.run([sys.executable, "-m", "mlm_jax.train"] + T + ["--train-iters", "1"],
                           cwd=tmp_path, env=env(bad), capture_output=True, text=True, timeout=120)
        assert_named_error(p.returncode, p.stdout + p.stderr, 2, f"MLM_JAX_CPU_DEVICES={bad!r}")


# --------------------------------------------------------------------------- issue 10: the sample


def test_end_of_run_sample_of_an_interleaved_pipeline_equals_pp1(tmp_path):
    """The greedy sample comes from the plain-layout model: an interleaved pipeline stores its
    layers permuted ([0, 2, 1, 3] here), and the same function must give the same tokens."""
    base = ["--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "256",
            "--global-batch-size", "16", "--micro-batch-size", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--train-iters", "2", "--eval-iters", "1", "--no-progress-bar",
            "--sample-tokens", "12", "--peak-flops-per-device", "1e12", "--no-final-checkpoint"]
    pp1 = train(parse_args(base + ["--run-dir", str(tmp_path / "pp1")]), log=lambda *_: None)
    pp2 = train(parse_args(base + ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                                   "1", "--run-dir", str(tmp_path / "pp2")]), log=lambda *_: None)
    assert pp1["sample"]["prompt_ids"] == pp2["sample"]["prompt_ids"]
    assert len(pp1["sample"]["ids"]) == 12
    assert pp1["sample"]["ids"] == pp2["sample"]["ids"], (pp1["sample"], pp2["sample"])


def test_a_save_failure_names_the_os_reason_whatever_tensorstore_appends():
    """TensorStore's write errors end with the OS reason, sometimes followed by a long spec
    annotation; the one line the run prints keeps the reason (a CI run once lost it)."""
    from mlm_jax.checkpoint.saver import _save_reason

    spec = "{" + ", ".join(f'\\"key{i}\\":\\"value\\"' for i in range(60)) + "}"
    message = ('OUT_OF_RANGE: Error writing "1.0.mu.layers.attention.bo/0.0" in OCDBT database at local file '
               '"/tmp/ck/2.orbax-checkpoint-tmp/opt_state/ocdbt.process_0/d/a90b2d94": Failed to write '
               "247278 bytes to file 19: File too large [os_error_code='27'] "
               f"[source locations='tensorstore/kvstore/file/file_key_value_store.cc:427'] [tensorstore_spec='{spec}']")
    reason = _save_reason(ValueError(message))
    assert "File too large" in reason and "tensorstore_spec" not in reason and len(reason) < 400, reason
    assert _save_reason(ValueError("plain failure")) == "plain failure"
