"""Saving: the training-time Saver (interval, exit requests, end of run; asynchronous) with
its exit policy (signals, --exit-interval, --exit-duration-in-mins), and weights-only writes."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time

from mlm_jax.config import Config
from mlm_jax.errors import EXIT_INTERRUPTED, RunFailure
from mlm_jax.checkpoint.format import (FORMAT, FORMAT_VERSION, META, OPT_STATE, PARAMS, TOKENIZER,
                                       CheckpointError, config_to_dict, files_handler, tokenizer_record)
from mlm_jax.checkpoint.find import is_checkpoint, scan
from mlm_jax.checkpoint.restore import Start, layout_record, plain_layout


def write_params_checkpoint(root: str, iteration: int, params: dict, cfg: Config,
                            tokenizer: dict | None = None, files: dict[str, bytes] | None = None,
                            extra: dict | None = None) -> str:
    """Write a weights-only checkpoint (no optimizer state, no RNG) synchronously, e.g. an
    imported model; `params` may be numpy. Returns the checkpoint folder."""
    import orbax.checkpoint as ocp

    meta = {"format": FORMAT, "version": FORMAT_VERSION, "iteration": int(iteration), "consumed_samples": 0,
            "opt_step": 0, "has_optimizer": False, "rng": None, "config": config_to_dict(cfg),
            "tokenizer": tokenizer, "layout": None, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            **(extra or {})}
    root = os.path.abspath(root)
    if os.path.isdir(root) and scan(root)[0]:
        raise CheckpointError(f"--save {root} already holds checkpoints {scan(root)[0]}; choose an empty folder")
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    with ocp.CheckpointManager(root, options=options) as mngr:
        mngr.save(iteration, force=True, args=ocp.args.Composite(**{
            PARAMS: ocp.args.StandardSave(params), META: ocp.args.JsonSave(meta),
            TOKENIZER: files_handler()(files or {})}))
        mngr.wait_until_finished()
    return os.path.join(root, str(iteration))


class SaveFailed(RunFailure):
    """A checkpoint write failed (exit 1): the message names --save and the reason."""


# Set once an Orbax save has failed: its background threads may never finish, so the process
# must leave with os._exit rather than wait for them at interpreter shutdown (a hang).
_orbax_wedged = False


def orbax_wedged() -> bool:
    """True when a failed save may have left Orbax threads that would block a normal exit."""
    return _orbax_wedged


def exit_process(code: int) -> None:
    """End a command-line process with `code`. After a failed save or a Ctrl-C it leaves at once
    (os._exit): Orbax's background threads may never finish, and interpreter shutdown would
    wait for them forever (the job would hold its nodes until walltime)."""
    sys.stdout.flush()
    sys.stderr.flush()
    if _orbax_wedged or code == EXIT_INTERRUPTED:
        os._exit(code)
    sys.exit(code)


def _save_reason(exc: BaseException) -> str:
    """The most specific line of a save failure (Orbax wraps the OS error several times)."""
    while exc.__cause__ is not None or exc.__context__ is not None:
        exc = exc.__cause__ or exc.__context__
    if isinstance(exc, OSError) and exc.strerror:
        return f"{exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    text = " ".join(str(exc).split()) or type(exc).__name__
    # TensorStore's messages end "...: File too large [os_error_code='27']", sometimes followed
    # by "[source locations='...']" and a long "[tensorstore_spec='{...}']": those are dropped,
    # and the OS reason is kept whatever the cut.
    os_reason = re.search(r":\s*([^:\[\]]+?)\s*\[os_error_code=", text)
    text = re.sub(r" ?\[(?:source locations|tensorstore_spec)=.*$", "", text) or text
    if len(text) > 320:
        text = f"{text[:140]} ... {text[-160:]}"
    if os_reason and os_reason.group(1) not in text:
        text += f" ({os_reason.group(1)})"
    return text


def _agree(flag: bool) -> bool:
    """True on every host when it is True on any (hosts must save and exit together)."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag]))))


class ExitPolicy:
    """When training stops early: a signal, --exit-interval, --exit-duration-in-mins.

    Ctrl-C (SIGINT) always: the first asks for a clean stop (save when --save is set, then exit
    130, see `interrupted`), a second exits at once (KeyboardInterrupt). SIGTERM only with
    --exit-signal-handler (Megatron's): what schedulers send before a kill; it saves and exits 0.
    A handler only sets a flag, checked between iterations, so a signal is never lost in a
    library's thread or swallowed by a `try` somewhere in a step.
    """

    def __init__(self, c, start_time: float, log_interval: int = 1):
        self.c = c
        self.start_time = start_time
        self.log_interval = max(1, log_interval)
        self.signal_received: str | None = None
        self.interrupted = False  # a Ctrl-C stop: the run ends with exit code 130
        self._old_handlers = {}
        if threading.current_thread() is threading.main_thread():
            # A SIGINT ignored at start stays ignored (a background job of a script: Ctrl-C at
            # the terminal is meant for the script, e.g. launch/local.sh, not for its children).
            if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
                self._old_handlers[signal.SIGINT] = signal.signal(signal.SIGINT, self._on_sigint)
            if c.exit_signal_handler:
                self._old_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        self.signal_received = signal.Signals(signum).name

    def _on_sigint(self, signum, frame):
        if self.signal_received == "SIGINT":  # the second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal_received = "SIGINT"
        # os.write: a print here could re-enter a print the signal interrupted.
        os.write(2, b"> Ctrl-C: stopping after this iteration" + (b", saving a checkpoint first" if self.c.save
                 else b"") + b"; press Ctrl-C again to stop at once\n")

    def reason(self, iteration: int) -> str | None:
        """Why training should stop after `iteration` (the same answer on every host), or None."""
        import jax

        c = self.c
        # Every host must agree, which costs a collective in multi-host runs: there SIGTERM is
        # checked every iteration when asked for, Ctrl-C every log interval.
        every = jax.process_count() == 1 or c.exit_signal_handler or iteration % self.log_interval == 0
        local = self.signal_received
        if every and _agree(local is not None):
            # Another host's signal: without --exit-signal-handler only Ctrl-C is caught.
            self.interrupted = local == "SIGINT" or (local is None and not c.exit_signal_handler)
            return f"received {local or 'a signal (on another host)'}"
        if c.exit_interval and iteration % c.exit_interval == 0:
            return f"--exit-interval {c.exit_interval}"
        if c.exit_duration_in_mins is not None and _agree(
                (time.time() - self.start_time) / 60.0 > c.exit_duration_in_mins):
            return f"--exit-duration-in-mins {c.exit_duration_in_mins:g}"
        return None

    def close(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}


class Saver:
    """Saves during training: on the interval, on exit requests, at the end; asynchronously.

    `step_done(...)` after every iteration returns an exit reason (signal, --exit-interval,
    --exit-duration-in-mins) once a checkpoint for it has been saved, else None. A save that
    fails raises SaveFailed (never a "committed" line for it).
    """

    def __init__(self, cfg: Config, pz, tokenizer, run_dir: str, start: Start, log=print,
                 start_time: float | None = None, valid_loader=None):
        c = cfg.checkpoint
        self.valid_loader = valid_loader  # its position is saved: evaluations resume in order
        self.cfg, self.pz, self.log, self.c = cfg, pz, log, c
        folder = c.save or (os.path.join(run_dir, "checkpoints") if c.final_checkpoint else None)
        self.dir = os.path.abspath(folder) if folder else None
        self.flag = "--save" if c.save else "--run-dir"
        self.start = start
        self.tokenizer, self.files = tokenizer_record(tokenizer)
        self.mngr = None
        self.last_saved = None
        self.pending = None  # (iteration, path, t_start) of the save still being written
        self.saved_paths: list[str] = []
        if self.dir and os.path.isdir(self.dir):
            later = [s for s in scan(self.dir)[0] if s > start.iteration]
            if later:
                raise CheckpointError(
                    f"--save {self.dir} already holds checkpoints of iterations {later}, after this run's "
                    f"start (iteration {start.iteration}); they belong to another run. Resume from the "
                    "latest with --load, or save to another folder")
        self.exit = ExitPolicy(c, time.time() if start_time is None else start_time,
                               cfg.train.log_interval)

    @property
    def signal_received(self) -> str | None:
        return self.exit.signal_received

    def _manager(self):
        if self.mngr is None:
            import orbax.checkpoint as ocp

            policy = (ocp.checkpoint_managers.LatestN(n=self.c.keep_last) if self.c.keep_last else None)
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=self.c.async_save, create=True,
                cleanup_tmp_directories=True, preservation_policy=policy)
            self.mngr = ocp.CheckpointManager(self.dir, options=options)
        return self.mngr

    def _failed(self, what: str, exc: BaseException | None = None) -> SaveFailed:
        global _orbax_wedged
        _orbax_wedged = True
        self.pending = None
        reason = _save_reason(exc) if exc is not None else "Orbax finished without committing it"
        return SaveFailed(f"{self.flag} {self.dir}: {what} failed: {reason}")

    def _report_finished(self, wait: bool) -> None:
        """Log the save in flight as committed once it is (waiting for it when `wait`); a save
        that failed raises SaveFailed."""
        if self.pending is None:
            return
        iteration, path, t_start = self.pending
        what = f"saving the checkpoint of iteration {iteration}"
        try:
            if wait:
                self.mngr.wait_until_finished()
            elif self.mngr.is_saving_in_progress():
                return
            self.mngr.check_for_errors()
        except Exception as e:  # noqa: BLE001 - every failure of Orbax's writer ends the run
            raise self._failed(what, e) from e
        if not is_checkpoint(path):  # Orbax said nothing yet, but the folder is not there
            try:  # its finalize thread holds the error: waiting on it raises it
                self.mngr.wait_until_finished()
            except Exception as e:  # noqa: BLE001 - as above
                raise self._failed(what, e) from e
            raise self._failed(what)
        self.pending = None
        self.log(f"> checkpoint of iteration {iteration} committed to {path} "
                 f"({'written in' if wait else 'seen done'} {time.perf_counter() - t_start:.2f} s "
                 "after the save began)")

    def _meta(self, iteration: int, state: dict, consumed_samples: int, rng_key_data, saved: dict) -> dict:
        import jax
        import numpy as np

        from mlm_jax import loss_scale as ls
        from mlm_jax.checkpoint.fingerprint import fingerprints

        # fp16's loss scaler (only in runs that have one: other runs' metadata is unchanged).
        scaler = {"loss_scale": ls.to_record(state[ls.KEY])} if ls.KEY in state else {}
        return {
            **scaler, "format": FORMAT, "version": FORMAT_VERSION, "iteration": int(iteration),
            "consumed_samples": int(consumed_samples), "opt_step": int(jax.device_get(state["step"])),
            "schedule_samples": int(jax.device_get(state["schedule_samples"])),
            "valid_batches": int(self.valid_loader.iteration) if self.valid_loader is not None else 0,
            "has_optimizer": bool(self.c.save_optim),
            "rng": ({"seed": self.cfg.train.seed, "impl": "threefry2x32",
                     "key_data": [int(x) for x in np.asarray(rng_key_data).reshape(-1)]}
                    if self.c.save_rng and rng_key_data is not None else None),
            "config": config_to_dict(self.cfg), "tokenizer": self.tokenizer,
            "layout": layout_record(self.pz), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            # each saved array's checksum, checked at load (checkpoint/fingerprint.py)
            "fingerprints": fingerprints(saved),
        }

    def save(self, iteration: int, state: dict, consumed_samples: int, rng_key_data) -> float:
        """Save now; returns the seconds training was blocked."""
        import jax
        import orbax.checkpoint as ocp

        t0 = time.perf_counter()
        self._report_finished(wait=True)  # one save in flight at a time
        params, opt_state = state["params"], state["opt_state"]
        _, p_sh, o_sh, pipe = plain_layout(self.pz)
        if pipe is not None:
            params = jax.jit(pipe.to_plain, out_shardings=p_sh)(params)
            opt_state = jax.jit(pipe.to_plain, out_shardings=o_sh)(opt_state)
        saved = {PARAMS: params, **({OPT_STATE: opt_state} if self.c.save_optim else {})}
        items = {PARAMS: ocp.args.StandardSave(params),
                 META: ocp.args.JsonSave(self._meta(iteration, state, consumed_samples, rng_key_data, saved)),
                 TOKENIZER: files_handler()(self.files)}
        if self.c.save_optim:
            items[OPT_STATE] = ocp.args.StandardSave(opt_state)
        path = os.path.join(self.dir, str(iteration))
        try:
            mngr = self._manager()
            if iteration in mngr.all_steps():
                mngr.delete(iteration)
            mngr.save(iteration, args=ocp.args.Composite(**items), force=True)
        except Exception as e:  # noqa: BLE001 - as in _report_finished
            raise self._failed(f"saving the checkpoint of iteration {iteration}", e) from e
        blocked = time.perf_counter() - t0
        self.last_saved = iteration
        self.pending = (iteration, path, t0)
        self.log(f"> saving checkpoint of iteration {iteration} to {path}: training blocked "
                 f"{blocked:.2f} s" + ("; writing in the background" if self.c.async_save else ""))
        if not self.c.async_save:
            self._report_finished(wait=True)
        self.saved_paths.append(path)
        return blocked

    def step_done(self, iteration: int, state: dict, consumed_samples: int, rng_key_data) -> str | None:
        """After iteration `iteration`: save on the interval; on an exit request save and return why."""
        c = self.c
        if self.pending is not None:
            self._report_finished(wait=False)
        if self.dir and c.save_interval and iteration % c.save_interval == 0:
            self.save(iteration, state, consumed_samples, rng_key_data)
        reason = self.exit.reason(iteration)
        if reason and self.dir and self.last_saved != iteration:
            self.save(iteration, state, consumed_samples, rng_key_data)
        return reason

    @property
    def interrupted(self) -> bool:
        """The run stopped on Ctrl-C: it must end with exit code 130 once saved."""
        return self.exit.interrupted

    def finish(self, iteration: int, state: dict, consumed_samples: int, rng_key_data) -> None:
        """The end-of-training checkpoint (unless this iteration was just saved)."""
        if (self.dir and self.c.final_checkpoint and self.last_saved != iteration
                and iteration > self.start.iteration):
            self.save(iteration, state, consumed_samples, rng_key_data)

    def close(self) -> None:
        """Wait for the write in flight (a run ends only with its checkpoints committed)."""
        self.exit.close()
        if self.mngr is not None:
            try:
                self._report_finished(wait=True)
            finally:
                if not _orbax_wedged:  # closing a failed manager waits on its dead threads
                    self.mngr.close()
                self.mngr = None
