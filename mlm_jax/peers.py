"""The processes of a multi-host run watch each other: a dead peer or a differing config ends the
run at once, with the process named, instead of a stall and a C++ abort minutes later.

Both go through the key-value store of jax.distributed's coordination service (process 0 hosts
it), so they need no extra port or thread in the training loop:

- Heartbeats. Every process writes a counter under `mlm_jax/heartbeat/<i>` each second and reads
  everyone's. A counter that stops changing for `--peer-timeout` seconds (default 20) means that
  process is gone (killed, hung outside Python, machine lost); a store that stops answering for
  as long means process 0 is gone. Then every survivor prints
  `error: [process i/N] process j stopped (...)` and leaves (exit 1) from the watching thread,
  whatever its main thread is blocked in. A process that fails on its own writes its error there
  first (`mark_failed`), so the others stop within a second and quote it; one that finishes
  writes `done`, so the others never mistake the end of a run for a death.
  Without this, jax's own heartbeat aborts the survivors after 100 s with a C++ stack trace.
- Config agreement. `check_same_config` compares every process's config with process 0's before
  anything is compiled; processes started with different flags fail at start-up naming the
  fields (without it they fail inside the first collective, with a gloo size mismatch).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import sys
import threading
import time
from typing import Any

from mlm_jax.errors import ConfigError, exit_code

PREFIX = "mlm_jax/heartbeat/"
CONFIG_PREFIX = "mlm_jax/config/"
DONE, FAILED = "done", "failed:"
BEAT_SECONDS = 1.0


def _client():
    from jax._src.distributed import global_state

    return global_state.client


class PeerWatch:
    """Heartbeats of this process and a verdict on the others (see the module docstring)."""

    def __init__(self, process_id: int, num_processes: int, timeout: float, client=None):
        self.pid, self.n, self.timeout = process_id, num_processes, timeout
        self.client = client if client is not None else _client()
        self.stop = threading.Event()
        now = time.monotonic()
        self.seen: dict[int, tuple[str, float]] = {j: ("", now) for j in range(num_processes)}
        self.last_answer = now  # when the store last answered (process 0 hosts it)
        self.leaving: tuple[str, int] | None = None  # (error line, exit code) once failing
        self.err_fd = 2  # where the leaving line goes: `distributed.fail` silences fd 2 as it leaves
        self.count = 0

    def start(self) -> "PeerWatch":
        threading.Thread(target=self._beat_loop, name="mlm_jax-heartbeat", daemon=True).start()
        threading.Thread(target=self._judge_loop, name="mlm_jax-peer-judge", daemon=True).start()
        atexit.register(self.finish)
        return self

    def _beat_loop(self) -> None:
        while not self.stop.is_set():
            try:
                self.count += 1
                self.client.key_value_set(f"{PREFIX}{self.pid}", str(self.count), allow_overwrite=True)
                entries = self.client.key_value_dir_get(PREFIX)
                now = time.monotonic()
                self.last_answer = now
                for key, value in entries:
                    j = int(key.rsplit("/", 1)[-1])
                    if self.seen.get(j, ("", 0))[0] != value:
                        self.seen[j] = (value, now)
            except Exception:  # noqa: BLE001 - an unanswered store is judged by its silence
                pass
            self.stop.wait(BEAT_SECONDS)

    def verdict(self) -> str | None:
        """Why the run cannot go on ('process j stopped (...)'), or None while all is well."""
        now = time.monotonic()
        for j, (value, since) in sorted(self.seen.items()):
            if j == self.pid or value == DONE:
                continue
            if value.startswith(FAILED):
                return f"process {j} stopped ({value[len(FAILED):]})"
            if now - since > self.timeout and now - self.last_answer <= self.timeout:
                return (f"process {j} stopped (no heartbeat for {now - since:.0f} s; "
                        "killed, hung or its machine lost? --peer-timeout sets the wait)")
        if self.pid != 0 and now - self.last_answer > self.timeout:
            return (f"process 0 stopped (its coordination service has not answered for "
                    f"{now - self.last_answer:.0f} s; --peer-timeout sets the wait)")
        return None

    def _judge_loop(self) -> None:
        while not self.stop.wait(0.5):
            reason = self.verdict()
            if reason is not None and not self.stop.is_set():
                print(f"error: [process {self.pid}/{self.n}] {reason}", file=sys.stderr, flush=True)
                sys.stdout.flush()
                os._exit(1)

    def wait_for_verdict(self, seconds: float) -> str | None:
        """A verdict within `seconds` (this process's own failure may be a peer's fault)."""
        deadline = time.monotonic() + seconds
        while True:
            reason = self.verdict()
            if reason is not None or time.monotonic() >= deadline:
                return reason
            time.sleep(0.2)

    def _mark(self, value: str, wait: float = 2.0) -> None:
        """Publish this process's final state; bounded, since a store that is gone with
        process 0 can hold the call for minutes."""
        self.stop.set()

        def put():
            try:
                self.client.key_value_set(f"{PREFIX}{self.pid}", value, allow_overwrite=True)
            except Exception:  # noqa: BLE001 - nobody left to tell
                pass

        writer = threading.Thread(target=put, daemon=True)
        writer.start()
        writer.join(wait)

    def finish(self) -> None:
        """This process ends normally: the others must not take its silence for a death."""
        if not self.stop.is_set():
            self._mark(DONE)

    def mark_failed(self, message: str, line: str | None = None, code: int = 1) -> None:
        """This process is failing: tell the others why, so they stop now and quote it.
        `line` and `code` are how this process is leaving, should jax abort it meanwhile."""
        self.leaving = (line, code) if line is not None else None
        self._mark(FAILED + " ".join(message.split())[:500])


def flat_config(cfg: Any) -> dict[str, Any]:
    """`section.field -> value` of a config, without the fields that differ per process."""
    out = {}
    for section, values in dataclasses.asdict(cfg).items():
        if section == "distributed":
            continue
        for name, value in values.items():
            out[f"{section}.{name}"] = value
    return out


def config_differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Fields whose values differ, as '--flag-name: A here, B on the other' strings."""
    out = []
    for key in sorted(set(mine) | set(theirs)):
        a, b = mine.get(key), theirs.get(key)
        if a != b:
            flag = "--" + key.split(".", 1)[1].replace("_", "-")
            out.append(f"{flag} ({key}) is {a!r} here but {b!r}")
    return out


def check_same_config(cfg: Any, process_id: int, num_processes: int, timeout: float, client=None,
                      watch: PeerWatch | None = None, label: str = "") -> None:
    """Every process compares its config with every other's; any difference is a ConfigError
    naming the fields, raised on every process before anything is compiled.

    `watch`: told how this process leaves before the barrier that lets process 0 go, since
    process 0's exit takes the coordination service with it and jax then aborts the others,
    maybe before they reach their own error line (`label` starts that line)."""
    client = client if client is not None else _client()
    mine = json.loads(json.dumps(flat_config(cfg), default=str))  # as the others will read it
    client.key_value_set(f"{CONFIG_PREFIX}{process_id}", json.dumps(mine), allow_overwrite=True)
    problem = None
    for j in range(num_processes):
        if j == process_id:
            continue
        try:
            theirs = json.loads(client.blocking_key_value_get(f"{CONFIG_PREFIX}{j}", int(timeout * 1000)))
        except Exception as e:  # noqa: BLE001 - a peer that never publishes is a failed start
            raise ConfigError(f"process {j} did not publish its configuration within {timeout:g} s "
                              f"({' '.join(str(e).split())[:200]})") from None
        diffs = config_differences(mine, theirs)
        if diffs and problem is None:
            shown = "; ".join(d + f" on process {j}" for d in diffs[:8])
            more = f" (and {len(diffs) - 8} more)" if len(diffs) > 8 else ""
            problem = (f"the processes were started with different configurations: {shown}{more}; "
                       "start every process with the same flags")
    if problem is not None and watch is not None:
        watch.leaving = (f"error: {label}{problem}", exit_code(ConfigError(problem)))
    # Nobody leaves before everyone has read: process 0's exit would take the store with it.
    try:
        client.wait_at_barrier("mlm_jax/config_compared", int(timeout * 1000))
    except Exception:  # noqa: BLE001 - a peer gone already; its own error says why
        pass
    if problem is not None:
        raise ConfigError(problem)


_abort_handler = None  # the ctypes thunk must outlive the call that installs it


def report_aborts(watch: PeerWatch, coordinator_address: str, coordinator: tuple[str, int]) -> None:
    """Turn jax's C++ abort on a lost coordination service into our one-line error.

    When process 0 (and with it the coordination service) goes away, jax's distributed client
    aborts every other process within a second, from a C++ thread, with a stack trace; the
    client's callback for this cannot be set from Python (its status argument has no Python
    type). So a C-level SIGABRT handler prints the verdict instead and leaves with exit 1:
    the peer watch's, else 'process 0 stopped' when its address no longer accepts connections;
    an abort for any other reason is only labelled as one, and its own lines stay above.
    `coordinator` is the (host, port) of `coordinator_address`, parsed by the caller
    (`distributed.split_address`) before any abort can come.
    """
    global _abort_handler
    import ctypes
    import signal
    import socket

    def on_abort(signum):
        if watch.leaving is not None:  # already failing on its own: say that, not jax's abort
            line, code = watch.leaving
            os.write(watch.err_fd, f"{line}\n".encode())
            os._exit(code)
        reason = watch.verdict()
        if reason is None and watch.pid != 0:
            try:
                with socket.create_connection(coordinator, timeout=1.0):
                    pass
            except OSError:
                reason = f"process 0 stopped (its coordinator at {coordinator_address} is gone)"
        if reason is None:
            reason = "jax aborted this process (a C++ failure; its message is above)"
        os.write(2, f"error: [process {watch.pid}/{watch.n}] {reason}\n".encode())
        watch.mark_failed(reason)
        os._exit(1)

    try:
        handler_type = ctypes.CFUNCTYPE(None, ctypes.c_int)
        _abort_handler = handler_type(on_abort)
        ctypes.CDLL(None).signal(signal.SIGABRT, _abort_handler)
    except (OSError, AttributeError):  # no libc signal(): jax's own abort stays
        _abort_handler = None
