"""Joining the processes of a multi-host run: `jax.distributed`, from flags, env vars or SLURM.

`initialize(cfg)` is called by `train` before anything touches a device. Where the settings come
from, first match wins, field by field:

1. flags: `--coordinator-address HOST:PORT --num-processes N --process-id I`;
2. environment: `MLM_JAX_COORDINATOR_ADDRESS`, `MLM_JAX_NUM_PROCESSES`, `MLM_JAX_PROCESS_ID`
   (`JAX_COORDINATOR_ADDRESS`, jax's own name, is read too) - Kubernetes and bare machines;
3. SLURM, inside `srun` (`SLURM_JOB_ID`, `SLURM_STEP_NODELIST`, `SLURM_NTASKS`, `SLURM_PROCID`,
   `SLURM_LOCALID`): the coordinator is the step's first node, on port
   `61440 + SLURM_JOB_ID % 4096` (jax's rule; `JAX_COORDINATOR_PORT` overrides the port);
4. nothing: one process, `jax.distributed` is not started.

`--coordinator-timeout` / `MLM_JAX_COORDINATOR_TIMEOUT` (seconds, default 300) bounds both the
wait for the coordinator to accept connections and the wait for every process to join.

SLURM, one process per node or one per GPU. jax's own SLURM detection restricts every process
to GPU number `SLURM_LOCALID`, which with one task per node leaves each node 1 GPU of 8. Here
the local devices are chosen from the task layout instead: with one task on this node, all
visible GPUs; with several, GPU `SLURM_LOCALID` of the visible ones - unless SLURM already
narrowed `CUDA_VISIBLE_DEVICES` to this task (`--gpus-per-task`, fewer visible GPUs than tasks
here), in which case all of those. `JAX_LOCAL_DEVICE_IDS` overrides both.

Failures do not hang. XLA's client aborts the process (no Python exception) when the
coordinator cannot be reached, so non-zero processes first probe the coordinator's TCP port
themselves and raise `DistributedError` naming the address when it stays closed for the timeout;
when it is up but not every process joins, a watchdog names the address and the missing process
at the timeout and leaves (exit 1) before jax's own, later deadline would abort the process. `fail()` prints an error with the
process id and leaves at once, skipping jax's exit barrier that would hold a failed process for
minutes while the others sit in a collective. Once joined, the processes watch each other
(`mlm_jax.peers`): a dead one stops the rest within `--peer-timeout` seconds, naming it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import socket
import sys
import threading
import time
from typing import Mapping

from mlm_jax.config import DistributedConfig
from mlm_jax.errors import ConfigError, RunFailure

ENV_ADDRESS = "MLM_JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "MLM_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "MLM_JAX_PROCESS_ID"
ENV_TIMEOUT = "MLM_JAX_COORDINATOR_TIMEOUT"
ENV_PEER_TIMEOUT = "MLM_JAX_PEER_TIMEOUT"
DEFAULT_TIMEOUT = 300.0
DEFAULT_PEER_TIMEOUT = 20.0
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


class DistributedError(RunFailure):
    """The processes could not be joined; the message names the address and the process."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `initialize` does: the arguments of `jax.distributed.initialize` and their source."""

    num_processes: int
    process_id: int
    coordinator_address: str | None  # None: a single process, nothing to join
    local_device_ids: tuple[int, ...] | None  # None: every device the process sees
    timeout: float
    source: str  # where the settings came from, for messages
    peer_timeout: float = DEFAULT_PEER_TIMEOUT  # seconds of silence before a peer counts as dead

    @property
    def label(self) -> str:
        return f"process {self.process_id}/{self.num_processes}"


def _int(name: str, value) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def _seconds(flag: str, value: float | None, env_name: str, default: float, env: Mapping[str, str]) -> float:
    """A positive number of seconds: the flag, else the environment variable, else the default."""
    if value is None:
        try:
            value = float(env.get(env_name, default))
        except ValueError:
            raise ConfigError(f"{env_name}={env[env_name]!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{flag} must be a finite number > 0 (seconds), got {value:g}")
    return value


def split_address(address: str) -> tuple[str, int]:
    """'host:port' or '[v6]:port' -> (host, port); anything else is a ConfigError."""
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\s]+):(\d+)", address.strip())
    if not m:
        raise ConfigError(f"coordinator address {address!r} is not HOST:PORT")
    host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    if not 0 < int(port) < 65536:
        raise ConfigError(f"coordinator address {address!r}: port {port} is out of range")
    return host, int(port)


def slurm_first_node(nodelist: str) -> str:
    """The first hostname of a SLURM node list ('node[003-005,9],gpu1' -> 'node003')."""
    m = re.match(r"([^,\[]+)(?:\[([^\],\-]+))?", nodelist.strip())
    if not m:
        raise ConfigError(f"SLURM_STEP_NODELIST={nodelist!r}: cannot read the first node")
    return m.group(1) + (m.group(2) or "")


def _tasks_on_this_node(env: Mapping[str, str]) -> int | None:
    """Tasks of this step on this node, from SLURM_STEP_TASKS_PER_NODE ('4(x2),3') and
    SLURM_NODEID, else SLURM_NTASKS_PER_NODE, else tasks / nodes."""
    spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if spec:
        counts: list[int] = []
        for part in spec.split(","):
            m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
            if not m:
                counts = []
                break
            counts += [int(m.group(1))] * int(m.group(2) or 1)
        node = int(env.get("SLURM_NODEID", "0"))
        if counts and node < len(counts):
            return counts[node]
    if env.get("SLURM_NTASKS_PER_NODE"):
        return _int("SLURM_NTASKS_PER_NODE", env["SLURM_NTASKS_PER_NODE"])
    nodes = env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES")
    if nodes:
        return max(1, _int("SLURM_NTASKS", env["SLURM_NTASKS"]) // _int("SLURM_STEP_NUM_NODES", nodes))
    return None


def _slurm_local_devices(env: Mapping[str, str]) -> tuple[int, ...] | None:
    if env.get("JAX_LOCAL_DEVICE_IDS"):
        return None  # jax reads it itself
    here = _tasks_on_this_node(env)
    if here is None or here <= 1:
        return None  # one process per node: all of its GPUs
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if visible and len(visible) < here:
        return None  # SLURM bound this task to its own GPU(s) already (--gpus-per-task)
    return (_int("SLURM_LOCALID", env["SLURM_LOCALID"]),)  # one process per GPU


def resolve(cfg: DistributedConfig | None = None, env: Mapping[str, str] | None = None) -> Plan:
    """Flags, then MLM_JAX_* variables, then SLURM, field by field; a pure function of its inputs."""
    cfg = cfg or DistributedConfig()
    env = os.environ if env is None else env
    sources = []
    address, num, pid = cfg.coordinator_address, cfg.num_processes, cfg.process_id
    if (address, num, pid) != (None, None, None):
        sources.append("flags")
    env_values = (env.get(ENV_ADDRESS) or env.get("JAX_COORDINATOR_ADDRESS"),
                  env.get(ENV_NUM_PROCESSES), env.get(ENV_PROCESS_ID))
    if any(v is not None for v in env_values) and None in (address, num, pid):
        sources.append("MLM_JAX_* environment")
        address = address or env_values[0]
        num = num if num is not None else (None if env_values[1] is None else _int(ENV_NUM_PROCESSES, env_values[1]))
        pid = pid if pid is not None else (None if env_values[2] is None else _int(ENV_PROCESS_ID, env_values[2]))
    timeout = _seconds("--coordinator-timeout", cfg.coordinator_timeout, ENV_TIMEOUT, DEFAULT_TIMEOUT, env)
    peer_timeout = _seconds("--peer-timeout", cfg.peer_timeout, ENV_PEER_TIMEOUT, DEFAULT_PEER_TIMEOUT, env)

    local = None
    slurm = all(v in env for v in _SLURM_VARS)
    if slurm and None in (address, num, pid) and num != 1:
        ntasks = _int("SLURM_NTASKS", env["SLURM_NTASKS"])
        if ntasks > 1 or num is not None:
            sources.append(f"SLURM (job {env['SLURM_JOB_ID']}, {ntasks} tasks)")
            if address is None:
                # jax's rule: a port in [61440, 65535] that every task computes alike.
                port = env.get("JAX_COORDINATOR_PORT") or 61440 + _int("SLURM_JOB_ID", env["SLURM_JOB_ID"]) % 4096
                address = f"{slurm_first_node(env['SLURM_STEP_NODELIST'])}:{port}"
            num = ntasks if num is None else num
            pid = _int("SLURM_PROCID", env["SLURM_PROCID"]) if pid is None else pid
            local = _slurm_local_devices(env)

    source = " + ".join(sources) or "single process"
    if num is None and pid is None and address is None:
        return Plan(1, 0, None, None, timeout, "single process", peer_timeout)
    if num is not None and num < 1:
        raise ConfigError(f"--num-processes must be >= 1, got {num} (from {source})")
    if num == 1 and pid in (None, 0):
        return Plan(1, 0, None, None, timeout, source, peer_timeout)
    missing = [name for name, v in (("--coordinator-address", address), ("--num-processes", num),
                                    ("--process-id", pid)) if v is None]
    if missing:
        raise ConfigError(
            f"multi-process run ({source}) is missing {', '.join(missing)}: give all three of "
            f"--coordinator-address/--num-processes/--process-id (or {ENV_ADDRESS}, "
            f"{ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}), or run under srun")
    if not 0 <= pid < num:
        raise ConfigError(f"--process-id {pid} must be in [0, {num}) (from {source})")
    split_address(address)
    return Plan(num, pid, address, local, timeout, source, peer_timeout)


def _wait_for_coordinator(plan: Plan, deadline: float) -> None:
    """Process 0: the port must be free to bind. Others: it must accept a TCP connection."""
    host, port = split_address(plan.coordinator_address)
    if plan.process_id == 0:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
            except OSError as e:
                raise DistributedError(
                    f"[{plan.label}] cannot start the coordinator at {plan.coordinator_address}: "
                    f"port {port} is not free on this host ({e.strerror or e})") from None
        return
    last = "no attempt"
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError as e:
            last = e.strerror or str(e) or type(e).__name__
        if time.monotonic() >= deadline:
            raise DistributedError(
                f"[{plan.label}] cannot reach the coordinator at {plan.coordinator_address} within "
                f"{plan.timeout:g} s ({last}); settings from {plan.source}. Is process 0 running, and "
                "is that address reachable from this host? (--coordinator-address / "
                f"{ENV_ADDRESS}, --coordinator-timeout)")
        time.sleep(0.25)


def _watchdog(plan: Plan, deadline: float, done: threading.Event) -> None:
    """Leave with our error at the deadline while `jax.distributed.initialize` still waits.

    jax's client ends a failed join with a C++ abort (a fatal log line, a stack trace, exit 134)
    that no Python code can catch; its own deadline is set later (`_JAX_GRACE`), so this thread
    always speaks first and leaves with `os._exit`, before any jax atexit or C++ destructor."""
    if done.wait(max(0.0, deadline - time.monotonic()) + 0.5):
        return
    others = [j for j in range(plan.num_processes) if j != plan.process_id]
    who = (f"process {others[0]} never joined" if len(others) == 1 else
           f"not all {plan.num_processes} processes (--num-processes) joined")
    print(f"error: [{plan.label}] {who} the coordinator at {plan.coordinator_address} "
          f"(--coordinator-address) within --coordinator-timeout {plan.timeout:g} s (settings from "
          f"{plan.source}). Did every process start, with the same --coordinator-address and "
          "--num-processes?", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


_JAX_GRACE = 30  # seconds jax's own join deadline lies past ours: its expiry is a C++ abort


def initialize(cfg: DistributedConfig | None = None, env: Mapping[str, str] | None = None) -> Plan:
    """Join the other processes (or do nothing for one process); call before touching devices."""
    import jax

    plan = resolve(cfg, env)
    if plan.num_processes == 1:
        return plan
    if jax.distributed.is_initialized():
        if (jax.process_count(), jax.process_index()) != (plan.num_processes, plan.process_id):
            raise DistributedError(
                f"jax.distributed is already initialized as process {jax.process_index()}/"
                f"{jax.process_count()}, not {plan.label}")
        return plan
    try:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            raise DistributedError(
                f"[{plan.label}] jax is already using its devices, so it cannot join a multi-process "
                "run now: call mlm_jax.distributed.initialize() before any other JAX work")
    except ImportError:  # private module moved: jax.distributed.initialize says the same
        pass
    deadline = time.monotonic() + plan.timeout
    _wait_for_coordinator(plan, deadline)
    done = threading.Event()
    threading.Thread(target=_watchdog, args=(plan, deadline, done), daemon=True).start()
    try:
        jax.distributed.initialize(
            coordinator_address=plan.coordinator_address, num_processes=plan.num_processes,
            process_id=plan.process_id,
            local_device_ids=list(plan.local_device_ids) if plan.local_device_ids else None,
            cluster_detection_method="deactivate",  # `resolve` did the detection
            initialization_timeout=int(deadline - time.monotonic()) + _JAX_GRACE)
    finally:
        done.set()
    global _joined, _watch
    _joined = plan
    from mlm_jax.peers import PeerWatch, report_aborts

    _watch = PeerWatch(plan.process_id, plan.num_processes, plan.peer_timeout).start()
    report_aborts(_watch, plan.coordinator_address, split_address(plan.coordinator_address))
    return plan


def check_same_config(cfg) -> None:
    """In a multi-process run, fail on every process if any was started with another config
    (the differing fields named); a no-op for one process."""
    if _joined is None:
        return
    from mlm_jax.peers import check_same_config as check

    check(cfg, _joined.process_id, _joined.num_processes, _joined.timeout, watch=_watch, label=process_label())


_joined: Plan | None = None  # set by `initialize` once this process has joined
_watch = None  # mlm_jax.peers.PeerWatch of this process, once joined


def process_label() -> str:
    """'[process 1/2] ' in a multi-process run, '' otherwise. Never starts a backend: that
    would wait for every other process, and they may be the reason for the error."""
    if _joined is not None:
        return f"[{_joined.label}] "
    try:  # joined by someone else's jax.distributed.initialize call
        from jax._src.distributed import global_state

        if global_state.client is not None:
            return f"[process {global_state.process_id}/{global_state.num_processes}] "
    except (ImportError, AttributeError):
        pass
    return ""


def fail(message: str, code: int = 1, suspect_peers: bool = False) -> int:
    """Print `error: [process i/N] message` to stderr and return `code`; in a multi-process run,
    exit the process at once instead (jax's exit barrier would wait for the other processes,
    which are stuck in a collective, for minutes), telling the others why first.

    `suspect_peers`: the failure may be a peer's fault (an unexpected error, e.g. a collective
    that broke): wait for the peer watch's verdict a little, and lead with it when it comes.
    """
    import jax

    if _watch is not None and suspect_peers:
        reason = _watch.wait_for_verdict(_watch.timeout + 2.0)
        if reason is not None:
            message = f"{reason}; here: {message}"
    line = f"error: {process_label()}{message}"
    if _watch is not None:  # before the line: this may take a moment, and the line comes last
        _watch.mark_failed(message, line, code)
    if jax.distributed.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        # Nothing more on stderr, then one write: jax's coordination agent logs the peers' exits
        # from its own thread (seen in the suite after this line, when stderr was silenced after
        # the write). An abort meanwhile repeats the line on the same descriptor.
        out = os.dup(2)
        if _watch is not None:
            _watch.err_fd = out
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
        os.write(out, (line + "\n").encode())
        os._exit(code)
    print(line, file=sys.stderr, flush=True)
    return code


def broadcast_str(value: str) -> str:
    """Process 0's `value` on every process (e.g. a run folder named after the time)."""
    import jax

    if jax.process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    raw = np.zeros(1024, np.uint8)
    data = value.encode()[:1024]
    raw[: len(data)] = np.frombuffer(data, np.uint8)
    out = np.asarray(multihost_utils.broadcast_one_to_all(raw))
    return bytes(out[out != 0].tolist()).decode()
