"""Multi-host on one machine: real processes joined through jax.distributed (gloo on loopback).

Two training runs of 2 processes x 4 CPU devices, 10 iterations of a tiny GPT on mock data:
  A: launch/local.sh, data=2 x tensor=4 (data parallel across the processes), ZeRO-1, a
     checkpoint every 5 iterations, a profiler window and (a stand-in) Weights & Biases;
  B: the SLURM route (srun's variables, one process per GPU), tensor=8 (each tensor-parallel
     group spans both processes), default run folder named by process 0.
Both loss curves equal the single-process 8-device run within 1e-5 (fp32: the same sums, reduced
in another order by gloo), and so does a 1-process resume of A's iteration-5 checkpoint.
Per-host data reads are asserted in tests/data/test_loader.py::test_each_host_reads_only_its_rows
(the same BatchLoader and batch sharding train uses); here the equal curves show the hosts
assembled the same global batches.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from mlm_jax.arguments import parse_args
from mlm_jax.config import ConfigError, DistributedConfig, InstrumentsConfig
from mlm_jax.distributed import resolve, slurm_first_node
from mlm_jax.instruments import Instruments, RunLogger, Wandb, slow_iteration_line
from mlm_jax.train import main, train
from tests.tiny_flags import NO_DROPOUT, tiny, xla_flags_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL_SH = os.path.join(ROOT, "launch", "local.sh")
WORKER = os.path.join(ROOT, "tests", "multihost_worker.py")
TOL = 1e-5  # fp32 losses of the same model and data; only the reduction order differs
TINY = tiny("--micro-batch-size", "8", "--global-batch-size", "16", *NO_DROPOUT, "--lr", "1e-3",
            "--lr-warmup-iters", "0", "--train-iters", "10", "--log-interval", "1", "--eval-interval", "5",
            "--eval-iters", "1", "--peak-flops-per-device", "1e9", "--use-distributed-optimizer")
GLOO = re.compile(r"^\[Gloo\]|^ is connected to \d+ peer ranks")
FAKE_WANDB = '''
import json, os
def _write(call, **kw):
    with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
        f.write(json.dumps({"call": call, "process": os.environ.get("MLM_JAX_PROCESS_ID"), **kw}) + "\\n")
def init(project=None, name=None, dir=None, config=None):
    _write("init", project=project, name=name)
    return object()
def log(values, step=None):
    _write("log", values=values, step=step)
def finish():
    _write("finish")
'''


DISTRIBUTED_VARS = ("MLM_JAX_COORDINATOR_ADDRESS", "MLM_JAX_NUM_PROCESSES", "MLM_JAX_PROCESS_ID",
                    "MLM_JAX_COORDINATOR_TIMEOUT", "JAX_COORDINATOR_ADDRESS", "JAX_COORDINATOR_PORT")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SLURM_") and k not in DISTRIBUTED_VARS}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def losses(path: str) -> list[float]:
    return [r["lm_loss"] for r in map(json.loads, open(path)) if "lm_loss" in r]


def wait_all(procs, timeout=420):
    """Wait for (name, Popen, log path) triples; on a timeout or failure kill all and show logs."""
    deadline = time.monotonic() + timeout
    for name, p, log in procs:
        try:
            p.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for _, p, _ in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the launcher's children too
            p.wait()
    bad = [(n, p.returncode, log) for n, p, log in procs if p.returncode != 0]
    assert not bad, "\n".join(f"--- {n} exited {rc}:\n{open(log).read()[-3000:]}" for n, rc, log in bad)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("multihost")
    a, b = tmp / "a", tmp / "b"
    a.mkdir(), b.mkdir()
    (tmp / "fake_wandb").mkdir()
    (tmp / "fake_wandb" / "wandb.py").write_text(FAKE_WANDB)

    # A: launch/local.sh, 2 processes x 4 devices, data=2 x tensor=4.
    argv_a = TINY + ["--tensor-model-parallel-size", "4", "--run-dir", str(a / "run"),
                     "--save", str(a / "ckpt"), "--save-interval", "5",
                     "--profile", "--profile-step-start", "2", "--profile-step-end", "4",
                     "--wandb-project", "mlm-test", "--wandb-exp-name", "a"]
    env_a = child_env(LOG_DIR=str(a / "logs"), FAKE_WANDB_LOG=str(a / "wandb.jsonl"),
                      PYTHON=sys.executable)
    env_a["PYTHONPATH"] += os.pathsep + str(tmp / "fake_wandb")
    out_a = open(a / "launcher.out", "w")
    proc_a = subprocess.Popen(["bash", LOCAL_SH, "2", "4"] + argv_a, env=env_a, cwd=a,
                              stdout=out_a, stderr=subprocess.STDOUT, start_new_session=True)

    # B: srun's variables (2 tasks on one node: one process per GPU), tensor=8 across processes.
    port = free_port()
    procs_b = []
    for i in range(2):
        env = child_env(XLA_FLAGS=xla_flags_for(4), JAX_PLATFORMS="cpu",
                        SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost", SLURM_NTASKS="2",
                        SLURM_PROCID=str(i), SLURM_LOCALID=str(i), SLURM_NODEID="0",
                        SLURM_STEP_TASKS_PER_NODE="2", JAX_COORDINATOR_PORT=str(port))
        log = b / f"process_{i}.log"
        procs_b.append((f"B process {i}", subprocess.Popen(
            [sys.executable, "-m", "mlm_jax.train"] + TINY + ["--tensor-model-parallel-size", "8"],
            env=env, cwd=b, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True), log))

    # Meanwhile, the single-process 8-device reference (this pytest process's fake mesh).
    ref = tmp / "ref"
    train(parse_args(TINY + ["--tensor-model-parallel-size", "4", "--run-dir", str(ref),
                             "--no-final-checkpoint"]), log=lambda *_: None)
    wait_all([("A (launch/local.sh)", proc_a, a / "launcher.out")] + procs_b)

    # Resume A's iteration-5 checkpoint on 1 process x 8 devices, on another layout (data=8).
    resumed = tmp / "resumed"
    train(parse_args(TINY + ["--micro-batch-size", "2", "--run-dir", str(resumed), "--load", str(a / "ckpt"),
                             "--ckpt-step", "5", "--no-final-checkpoint"]), log=lambda *_: None)
    runs_b = glob.glob(str(b / "runs" / "*"))
    return {"tmp": tmp, "a": a, "b": b, "ref": losses(ref / "metrics.jsonl"), "runs_b": runs_b,
            "resumed": losses(resumed / "metrics.jsonl")}


def test_two_processes_dp2_tp4_match_one_process(runs):
    ref, got = runs["ref"], losses(runs["a"] / "run" / "metrics.jsonl")
    assert len(ref) == len(got) == 10
    assert max(abs(x - y) for x, y in zip(ref, got)) < TOL, (ref, got)
    assert got[-1] < got[0]


def test_tensor_parallel_across_processes_under_slurm(runs):
    """tensor=8 over 2 processes (every TP all-reduce crosses them), joined from SLURM's
    variables, with one run folder agreed on from process 0's clock."""
    assert len(runs["runs_b"]) == 1, runs["runs_b"]
    run_dir = runs["runs_b"][0]
    got = losses(os.path.join(run_dir, "metrics.jsonl"))
    ref = runs["ref"]
    assert len(got) == 10 and max(abs(x - y) for x, y in zip(ref, got)) < TOL, (ref, got)
    # Parameters are sharded over both processes: each writes its own shards.
    params = os.path.join(run_dir, "checkpoints", "10", "params")
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(params))


def test_resume_on_one_process_continues_the_curve(runs):
    """Saved at iteration 5 by 2 processes (data=2 x tensor=4, ZeRO), resumed by 1 process on
    data=8: iterations 6..10 are the uninterrupted run's."""
    assert len(runs["resumed"]) == 5
    assert max(abs(x - y) for x, y in zip(runs["ref"][5:], runs["resumed"])) < TOL, (runs["ref"], runs["resumed"])
    # ZeRO shards the optimizer state over data, which spans the processes: both write shards.
    assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(runs["a"] / "ckpt" / "5" / "opt_state"))


def test_only_process_0_prints_and_logs(runs):
    a, b = runs["a"], runs["b"]
    out = open(a / "launcher.out").read()
    assert "validation loss at iteration     10" in out and " iteration       10/      10" in out
    assert "| MFU (causal): " in out and "| MFU (Megatron, full attention): " in out
    assert not any(GLOO.search(line) for line in out.splitlines()), "gloo lines were not filtered"
    # Process 1 may show library warnings, but none of the run's log lines.
    for log in (a / "logs" / "process_1.log", b / "process_1.log"):
        ours = [line for line in open(log).read().splitlines()
                if re.match(r"^( iteration | validation loss|> |error:)", line)]
        assert ours == [], ours
    assert "> first step (compile + run) took" in open(b / "process_0.log").read()
    records = [json.loads(line) for line in open(a / "run" / "metrics.jsonl")]
    assert [r["iteration"] for r in records if "lm_loss" in r] == list(range(1, 11))  # one writer
    last = [r for r in records if "lm_loss" in r][-1]
    for key in ("data_wait_ms", "checkpoint_ms", "eval_ms", "step_ms", "max_iteration_ms",
                "compiled_total_bytes", "mfu", "mfu_megatron_full_attention"):
        assert key in last, key
    assert last["compiled_temp_bytes"] > 0
    # The saves at iterations 5 and 10 blocked the loop: the checkpoint timer saw them.
    assert [r for r in records if r.get("iteration") == 5 and "lm_loss" in r][0]["checkpoint_ms"] > 0


def test_profile_window_and_wandb(runs):
    a = runs["a"]
    # --profile-step-start 2 --profile-step-end 4: iterations 3 and 4, as Megatron; process 0 only.
    traces = glob.glob(str(a / "run" / "profile" / "plugins" / "profile" / "*" / "*.trace.json.gz"))
    assert len(traces) == 1, traces
    events = json.load(gzip.open(traces[0]))["traceEvents"]
    steps = sorted(int(e["args"]["step_num"]) for e in events if e.get("name") == "train")
    assert steps == [3, 4]
    calls = [json.loads(line) for line in open(a / "wandb.jsonl")]
    assert {c["process"] for c in calls} == {"0"}
    assert calls[0] == {"call": "init", "process": "0", "project": "mlm-test", "name": "a"}
    assert calls[-1]["call"] == "finish"
    logged = [c["values"]["lm_loss"] for c in calls if c["call"] == "log" and "lm_loss" in c["values"]]
    assert logged == losses(a / "run" / "metrics.jsonl")


def test_launcher_stops_everyone_when_one_process_fails(tmp_path):
    env = child_env(LAUNCH_COMMAND=f"{sys.executable} {WORKER} fail {tmp_path}", GRACE_SECONDS="1",
                    LOG_DIR=str(tmp_path / "logs"), PYTHON=sys.executable)
    t0 = time.monotonic()
    # A session of its own: if the launcher itself hangs, the test kills it and its children.
    p = subprocess.Popen(["bash", LOCAL_SH, "3", "1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        p.stdout_text, p.stderr = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    elapsed = time.monotonic() - t0
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert "process 1 exited with status 3; stopping the others" in p.stderr
    assert "[process 1] error: [process 1/3] deliberate failure for the launcher test" in p.stderr
    assert elapsed < 60  # processes 0 and 2 would sleep 600 s
    for i in (0, 2):
        pid = int((tmp_path / f"pid{i}").read_text())
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launcher_usage():
    p = subprocess.run(["bash", LOCAL_SH, "two", "4"], capture_output=True, text=True)
    assert p.returncode == 2 and "usage:" in p.stderr


def test_unreachable_coordinator_fails_within_the_timeout():
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "mlm_jax.train", "--mock-data", "--coordinator-address",
                        f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1",
                        "--coordinator-timeout", "3"], env=child_env(JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - t0
    assert p.returncode == 1, p.stderr
    assert (f"error: [process 1/2] cannot reach the coordinator at 127.0.0.1:{port} within 3 s"
            in p.stderr), p.stderr
    assert "Traceback" not in p.stderr
    assert 3 <= elapsed < 40


def test_coordinator_up_but_a_process_missing_is_named_before_jax_stops():
    port = free_port()
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, WORKER, "join", "2", str(port)], env=child_env(JAX_PLATFORMS="cpu"),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "joined (unexpected)" not in p.stdout
    assert (f"error: [process 0/2] process 1 never joined the coordinator at 127.0.0.1:{port} "
            "(--coordinator-address) within --coordinator-timeout 2 s") in p.stderr, p.stderr
    assert time.monotonic() - t0 < 60


def test_port_in_use_is_named():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        p = subprocess.run([sys.executable, WORKER, "join", "2", str(port)], env=child_env(JAX_PLATFORMS="cpu"),
                           capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert f"cannot start the coordinator at 127.0.0.1:{port}: port {port} is not free" in p.stderr, p.stderr


# -- where the settings come from (no processes) -------------------------------------------------

SLURM = {"SLURM_JOB_ID": "1234", "SLURM_STEP_NODELIST": "gpu[017-018]", "SLURM_NTASKS": "2",
         "SLURM_PROCID": "1", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_STEP_TASKS_PER_NODE": "1(x2)"}


def test_single_process_by_default():
    plan = resolve(DistributedConfig(), {})
    assert (plan.num_processes, plan.coordinator_address) == (1, None)
    # One SLURM task, or --num-processes 1, is a single process too.
    assert resolve(DistributedConfig(), dict(SLURM, SLURM_NTASKS="1")).num_processes == 1
    assert resolve(DistributedConfig(num_processes=1), SLURM).num_processes == 1


def test_flags_then_environment():
    env = {"MLM_JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "MLM_JAX_NUM_PROCESSES": "4",
           "MLM_JAX_PROCESS_ID": "2", "MLM_JAX_COORDINATOR_TIMEOUT": "7"}
    plan = resolve(DistributedConfig(), env)
    assert (plan.coordinator_address, plan.num_processes, plan.process_id, plan.timeout) == ("10.0.0.1:1234", 4, 2, 7.0)
    plan = resolve(DistributedConfig(process_id=3, coordinator_timeout=9), env)
    assert (plan.process_id, plan.timeout, plan.source) == (3, 9, "flags + MLM_JAX_* environment")
    plan = resolve(DistributedConfig("[::1]:99", 2, 1), {})
    assert (plan.coordinator_address, plan.source, plan.timeout) == ("[::1]:99", "flags", 300.0)
    assert resolve(DistributedConfig(), {"JAX_COORDINATOR_ADDRESS": "h:1", "MLM_JAX_NUM_PROCESSES": "2",
                                         "MLM_JAX_PROCESS_ID": "0"}).coordinator_address == "h:1"


@pytest.mark.parametrize("cfg, env, message", [
    (DistributedConfig(num_processes=2, process_id=0), {},
     "multi-process run (flags) is missing --coordinator-address"),
    (DistributedConfig(coordinator_address="h:1"), {}, "is missing --num-processes, --process-id"),
    (DistributedConfig("h:1", 2, 2), {}, "--process-id 2 must be in [0, 2)"),
    (DistributedConfig("h", 2, 0), {}, "coordinator address 'h' is not HOST:PORT"),
    (DistributedConfig("h:1", 2, 0, coordinator_timeout=0), {}, "--coordinator-timeout must be a finite number > 0"),
    (DistributedConfig(), {"MLM_JAX_NUM_PROCESSES": "two"}, "MLM_JAX_NUM_PROCESSES='two' is not an integer"),
    (DistributedConfig(), {"MLM_JAX_COORDINATOR_TIMEOUT": "soon"}, "MLM_JAX_COORDINATOR_TIMEOUT='soon' is not a number"),
])
def test_incomplete_or_wrong_settings_are_named(cfg, env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(cfg, env)


def test_slurm_one_process_per_node_sees_all_its_gpus():
    plan = resolve(DistributedConfig(), SLURM)
    # jax's rule: the step's first node, port 61440 + job id % 4096.
    assert plan.coordinator_address == f"gpu017:{61440 + 1234 % 4096}"
    assert (plan.num_processes, plan.process_id) == (2, 1)
    assert plan.local_device_ids is None  # jax's own detection would give [SLURM_LOCALID] = [0]: 1 GPU
    assert plan.source.startswith("SLURM")
    assert resolve(DistributedConfig(), dict(SLURM, JAX_COORDINATOR_PORT="5000")).coordinator_address == "gpu017:5000"


def test_slurm_one_process_per_gpu():
    env = dict(SLURM, SLURM_NTASKS="16", SLURM_PROCID="11", SLURM_LOCALID="3",
               SLURM_STEP_TASKS_PER_NODE="8(x2)", CUDA_VISIBLE_DEVICES="0,1,2,3,4,5,6,7")
    plan = resolve(DistributedConfig(), env)
    assert (plan.num_processes, plan.process_id, plan.local_device_ids) == (16, 11, (3,))
    # --gpus-per-task: SLURM already narrowed CUDA_VISIBLE_DEVICES to this task's GPU.
    assert resolve(DistributedConfig(), dict(env, CUDA_VISIBLE_DEVICES="3")).local_device_ids is None
    # Without a per-node count, tasks / nodes.
    env2 = {k: v for k, v in env.items() if k != "SLURM_STEP_TASKS_PER_NODE"}
    assert resolve(DistributedConfig(), dict(env2, SLURM_STEP_NUM_NODES="2")).local_device_ids == (3,)
    # An explicit JAX_LOCAL_DEVICE_IDS is left to jax.
    assert resolve(DistributedConfig(), dict(env, JAX_LOCAL_DEVICE_IDS="5")).local_device_ids is None


@pytest.mark.parametrize("nodes, first", [("node001", "node001"), ("node001,host2", "node001"),
                                          ("node[001-015],host2", "node001"),
                                          ("node[007,009-015]", "node007"), ("a-b[3]", "a-b3")])
def test_slurm_first_node_as_jax_reads_it(nodes, first, monkeypatch):
    assert slurm_first_node(nodes) == first
    if nodes == "a-b[3]":
        return  # jax 0.10.2 reads 'a-b3]' here (a one-node bracket); the host is a-b3
    try:
        from jax._src.clusters.slurm_cluster import SlurmCluster
    except ImportError:
        return
    monkeypatch.setenv("SLURM_STEP_NODELIST", nodes)
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert SlurmCluster.get_coordinator_address(None, None) == f"{first}:{61440 + 77}"


# -- instruments (no processes) ---------------------------------------------------------------

class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_slow_iteration_is_reported_with_its_timers():
    clock = Clock()
    inst = Instruments(InstrumentsConfig(slow_iteration_factor=3.0), clock=clock)
    inst.reset()
    inst.step_finished(1)  # the clock starts at the first step's end
    slow = []
    for i in range(2, 12):  # 100 ms steps
        clock.t += 0.1
        slow.append(inst.step_finished(i))
    assert slow == [None] * 10
    # An evaluation makes an iteration long, but is not a straggler.
    inst.add("eval", 2.0)
    clock.t += 2.1
    assert inst.step_finished(12) is None
    # A data stall: 380 ms waiting for the loader in a 500 ms iteration.
    inst.add("data_wait", 0.38)
    clock.t += 0.5
    record = inst.step_finished(13)
    assert record is not None and record["iteration"] == 13
    assert record["slow_iteration_ms"] == pytest.approx(500) and record["median_iteration_ms"] == pytest.approx(100)
    assert record["data_wait_ms"] == pytest.approx(380) and record["step_ms"] == pytest.approx(120)
    line = slow_iteration_line(record)
    assert "slow iteration 13: 500.0 ms, 5.0x the running median 100.0 ms | data wait (ms): 380.0" in line
    window = inst.window()
    assert window["max_iteration_ms"] == pytest.approx(2100)
    assert window["eval_ms"] == pytest.approx(2000 / 12)
    assert inst.window() == {}
    # factor 0: never.
    quiet = Instruments(InstrumentsConfig(slow_iteration_factor=0), clock=clock)
    quiet.step_finished(1)
    for i in range(2, 10):
        clock.t += 0.1 if i < 9 else 10.0
        assert quiet.step_finished(i) is None


def test_checkpoint_timer_and_wandb_sink(tmp_path, monkeypatch):
    clock = Clock()
    inst = Instruments(InstrumentsConfig(), clock=clock)
    inst.step_finished(1)
    with inst.timed("checkpoint"):
        clock.t += 0.25
    clock.t += 0.05
    inst.step_finished(2)
    assert inst.window()["checkpoint_ms"] == pytest.approx(250)

    messages = []
    monkeypatch.setitem(sys.modules, "wandb", None)  # not installed
    assert Wandb(InstrumentsConfig(wandb_project="p"), {}, str(tmp_path), True, messages.append).run is None
    assert "wandb is not installed (pip install wandb); logging to TensorBoard" in messages[0]

    calls = []

    class FakeWandb:
        def init(self, **kw):
            calls.append(("init", kw["project"], kw["name"]))
            return object()

        def log(self, values, step):
            calls.append(("log", values, step))

        def finish(self):
            calls.append(("finish",))

    monkeypatch.setitem(sys.modules, "wandb", FakeWandb())
    logger = RunLogger(str(tmp_path / "m.jsonl"), None, write=lambda *_: None,
                       wandb=Wandb(InstrumentsConfig(wandb_project="p", wandb_exp_name="x"), {}, str(tmp_path), True))
    logger.log({"iteration": 3, "lm_loss": 2.5, "mfu_peak_source": "measured", "finite": True})
    logger.close()
    assert calls == [("init", "p", "x"), ("log", {"lm_loss": 2.5}, 3), ("finish",)]
    assert Wandb(InstrumentsConfig(wandb_project="p"), {}, str(tmp_path), main=False).run is None


def test_instrument_flag_errors(capsys):
    assert main(TINY + ["--tensor-model-parallel-size", "4", "--profile", "--profile-step-start", "5",
                        "--profile-step-end", "5"]) == 2
    assert "error: --profile needs 0 <= --profile-step-start (5) < --profile-step-end (5)" in capsys.readouterr().err
    assert main(["--num-processes", "2", "--process-id", "0"]) == 2
    assert "is missing --coordinator-address" in capsys.readouterr().err


# -- launch/ files (no cluster) -------------------------------------------------------------------

def test_launch_files_are_well_formed():
    import yaml

    from mlm_jax import distributed

    for script in ("local.sh", "slurm.sbatch"):
        p = subprocess.run(["bash", "-n", os.path.join(ROOT, "launch", script)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
    service, job = yaml.safe_load_all(open(os.path.join(ROOT, "launch", "k8s.yaml")))
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    env = {e["name"]: e for e in spec["template"]["spec"]["containers"][0]["env"]}
    assert int(env[distributed.ENV_NUM_PROCESSES]["value"]) == spec["completions"]
    assert "job-completion-index" in env[distributed.ENV_PROCESS_ID]["valueFrom"]["fieldRef"]["fieldPath"]
    host, port = distributed.split_address(env[distributed.ENV_ADDRESS]["value"])
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert port == service["spec"]["ports"][0]["port"]


def test_slurm_xla_flags_are_known_to_jaxlib():
    """An unknown XLA flag stops every process at start-up: the ones the sbatch sets must exist."""
    text = open(os.path.join(ROOT, "launch", "slurm.sbatch")).read()
    flags = re.findall(r"^ (--xla_\S+) \\?$", text, flags=re.M)
    assert len(flags) >= 5, flags
    p = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, text=True,
                       env=child_env(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags)))
    assert p.returncode == 0, p.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], capture_output=True, text=True,
                         env=child_env(JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_gpu_no_such_flag=true"))
    assert bad.returncode != 0  # the check above can fail
