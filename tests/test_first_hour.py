"""A new user's first hour (issue 30): the quickstart's output read line by line as it arrives,
and what the README shows next run on the checkpoint it produced.

`python -m mlm_jax.train` with no flags but a shorter `--train-iters` (the same code path,
data, model and output; 300 iterations would only repeat the loop) must print its first line
before it imports JAX (an import of seconds; Python's import report shows the order, however
loaded the machine), never fall silent for more than 5 s unless it said it is compiling, end with rounded
figures, the run folder, and commands to try next that fit the model: each is then run exactly
as printed (the server on a free port instead of 5000). And a resumed run whose checkpoint is
already at or past --train-iters says so and reports the checkpoint's iteration.
"""

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.test_reliability import T, cmd, env

GAP_S = 5.0
# What the first line must come before: JAX and the libraries built on it take seconds to import.
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "tensorstore")


def quickstart_env() -> dict:
    """The quickstart's environment: the default CPU devices (one per core), not the tests' one, and
    none of the tests' XLA settings (their -O0 code evaluates the quickstart's whole corpus at
    less than half a user's speed: 122 s against 47 s here)."""
    e = env()
    for name in ("MLM_JAX_CPU_DEVICES", "XLA_FLAGS", "NPROC"):
        e.pop(name, None)
    return dict(e, PYTHONUNBUFFERED="1")


IMPORT_TIME = re.compile(r"import time: +\d+ \| +\d+ \| +(\S+)$")  # -X importtime's lines


def timed_output(args, cwd, timeout=600):
    """(exit code, [(seconds since start, line)], [(module, imported before the first line?)]):
    every line (progress-bar redraws split at carriage returns) stamped as it arrived. The run
    reports its imports (`-X importtime`, on stderr, which shares stdout's pipe: in the order
    written); those lines are taken out of the output."""
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-X", "importtime", "-m", "mlm_jax.train", *args], cwd=cwd,
                         env=quickstart_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines, imports, partial = [], [], b""

    def add(now, raw):
        line = raw.decode()
        if line.startswith("import time:"):
            module = IMPORT_TIME.match(line)
            if module:
                imports.append((module.group(1), not lines))
        elif line.strip():
            lines.append((now, line))

    while True:
        chunk = os.read(p.stdout.fileno(), 1 << 16)
        now = time.monotonic() - t0
        assert now < timeout, lines[-5:]
        if not chunk:
            break
        *done, partial = re.split(rb"[\r\n]", partial + chunk)
        for raw in done:
            add(now, raw)
    add(time.monotonic() - t0, partial)
    return p.wait(), lines, imports


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("quickstart")
    rc, lines, imports = timed_output(["--train-iters", "30"], cwd)
    return rc, lines, cwd, imports


def test_the_quickstart_speaks_at_once_and_never_falls_silent(quickstart):
    rc, lines, _, imports = quickstart
    text = "\n".join(f"{t:7.2f} {line[:140]}" for t, line in lines)
    assert rc == 0, text[-3000:]
    assert lines[0][1] == "> mlm_jax.train: starting JAX ...", text[:500]
    # The first line comes before any heavy import (not a timing: a loaded machine only slows
    # both); the report is read (mlm_jax's own modules before it, JAX's after it).
    before = [m for m, first in imports if first]
    assert "mlm_jax.arguments" in before and "jax" in {m for m, _ in imports}, imports[:20]
    heavy = [m for m in before if m.split(".")[0] in HEAVY]
    assert not heavy, f"imported before the first line: {heavy}"
    said = ""  # the last line that is not a progress-bar redraw
    for (t_prev, prev), (t, line) in zip(lines, lines[1:]):
        if not prev.startswith("training:"):
            said = prev
        elif "> " in prev:  # a line that followed a progress-bar redraw
            said = prev[prev.index("> "):]
        # A long silence only follows a line naming the one blocking call under way: a compile,
        # or JAX's import (one call; on a loaded 2-core machine it took 6.1 s).
        if t - t_prev > GAP_S:
            announced = "compiling" in said or said == "> mlm_jax.train: starting JAX ..."
            assert announced, f"{t - t_prev:.1f} s of silence after {said!r}\n{text}"
    assert "Traceback" not in text


def test_the_quickstart_ends_with_a_result_and_next_commands_that_run(quickstart):
    rc, lines, cwd, _ = quickstart
    out = [line for _, line in lines]
    done = next(i for i, line in enumerate(out) if line.startswith("> done: "))
    end = out[done:]
    assert re.match(r"> done: validation loss \d+\.\d\d -> \d+\.\d\d \(perplexity [\d,.]+ -> [\d,.]+\); "
                    r"iteration 30 in \d+ (s|min \d+ s); run folder runs/\S+$", end[0]), end[0]
    assert not re.search(r"\d\.\d{3,}", "\n".join(end)), end  # rounded figures only
    run_dir = end[0].rsplit(" ", 1)[1]
    summary = json.load(open(os.path.join(cwd, run_dir, "summary.json")))
    assert summary["last_iteration"] == summary["iterations"] == 30
    assert any(line.startswith("> sample: ") and "not a failure" in line for line in out[:done])
    assert end[2] == "> try next, on this checkpoint:"
    commands = [shlex.split(line, comments=True) for line in end[3:]]
    assert [c[2] for c in commands] == ["mlm_jax.generate", "mlm_jax.evaluate", "mlm_jax.serve"], end
    for c in commands:
        assert c[:2] == ["python", "-m"] and c[c.index("--load") + 1] == f"{run_dir}/checkpoints", c

    e = quickstart_env()
    generate, evaluate, serve = ([sys.executable] + c[1:] for c in commands)
    p = subprocess.run(generate, cwd=cwd, env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.startswith("> prompt 1:\n" + commands[0][commands[0].index("--prompt") + 1]), \
        p.stdout + p.stderr
    assert "\n> continuation 1:\n" in p.stdout, p.stdout
    p = subprocess.run(evaluate, cwd=cwd, env=e, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "validation results on VALID" in p.stdout, p.stdout + p.stderr

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve[serve.index("--port") + 1] = str(port)
    p = subprocess.Popen(serve, cwd=cwd, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(300):
            try:
                health = json.load(urllib.request.urlopen(url + "/health", timeout=5))
                break
            except OSError:
                assert p.poll() is None, p.stdout.read()
                time.sleep(0.5)
        assert health["status"] == "ok"
        req = urllib.request.Request(url + "/api", method="PUT", data=json.dumps(
            {"prompts": ["def main("], "tokens_to_generate": 4}).encode(), headers={"Content-Type": "application/json"})
        answer = json.load(urllib.request.urlopen(req, timeout=120))
        assert answer["text"][0].startswith("def main("), answer
        assert urllib.request.urlopen(url + "/", timeout=30).status == 200  # the page the line points at
    finally:
        p.send_signal(signal.SIGINT)
        rc_serve = p.wait(timeout=60)
    assert rc_serve == 130, p.stdout.read()


def test_a_checkpoint_already_past_train_iters_is_reported_at_its_own_iteration(tmp_path):
    """`--load CK` (iteration 4) with `--train-iters 2`: nothing to train, said so; the
    evaluation and the summary speak of iteration 4, and no checkpoint is written."""
    rc, out = cmd(T + ["--train-iters", "4", "--save", "ck", "--run-dir", "run"], tmp_path)
    assert rc == 0, out[-3000:]
    rc, out = cmd(T + ["--train-iters", "2", "--load", "ck", "--save", "ck", "--run-dir", "run"], tmp_path)
    assert rc == 0, out[-3000:]
    assert "> nothing to train: the checkpoint is at iteration 4, at or past --train-iters 2" in out, out
    assert re.search(r"validation loss at iteration +4 ", out) and "at iteration      2" not in out, out
    summary = json.load(open(tmp_path / "run" / "summary.json"))
    assert (summary["iterations"], summary["last_iteration"], summary["trained_iterations"]) == (4, 4, 0)
    assert summary["checkpoints"] == [] and sorted(os.listdir(tmp_path / "ck")) == ["4"]
