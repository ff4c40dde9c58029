"""Saving: the training-time Saver (interval, exit requests, end of run; asynchronous) with
its exit policy (signals, --exit-interval, --exit-duration-in-mins), and weights-only writes."""

from __future__ import annotations

import os
import signal
import threading
import time

from mlm_jax.config import Config
from mlm_jax.checkpoint.format import (FORMAT, FORMAT_VERSION, META, OPT_STATE, PARAMS, TOKENIZER,
                                       CheckpointError, config_to_dict, files_handler, tokenizer_record)
from mlm_jax.checkpoint.find import scan
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


def _agree(flag: bool) -> bool:
    """True on every host when it is True on any (hosts must save and exit together)."""
    import jax

    if jax.process_count() == 1:
        return flag
    import numpy as np
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.asarray([flag]))))


class Saver:
    """Saves during training: on the interval, on exit requests, at the end; asynchronously.

    `step_done(...)` after every iteration returns an exit reason (signal, --exit-interval,
    --exit-duration-in-mins) once a checkpoint for it has been saved, else None.
    """

    def __init__(self, cfg: Config, pz, tokenizer, run_dir: str, start: Start, log=print,
                 start_time: float | None = None, valid_loader=None):
        c = cfg.checkpoint
        self.valid_loader = valid_loader  # its position is saved: evaluations resume in order
        self.cfg, self.pz, self.log, self.c = cfg, pz, log, c
        self.dir = c.save or (os.path.join(run_dir, "checkpoints") if c.final_checkpoint else None)
        self.start = start
        self.start_time = time.time() if start_time is None else start_time
        self.tokenizer, self.files = tokenizer_record(tokenizer)
        self.mngr = None
        self.last_saved = None
        self.pending = None  # (iteration, path, t_start) of the save still being written
        self.saved_paths: list[str] = []
        self.signal_received = None
        self._old_handlers = {}
        if self.dir and os.path.isdir(self.dir):
            later = [s for s in scan(self.dir)[0] if s > start.iteration]
            if later:
                raise CheckpointError(
                    f"--save {self.dir} already holds checkpoints of iterations {later}, after this run's "
                    f"start (iteration {start.iteration}); they belong to another run. Resume from the "
                    "latest with --load, or save to another folder")
        if c.exit_signal_handler and threading.current_thread() is threading.main_thread():
            # SIGTERM only (Megatron's): what schedulers send before a kill; Ctrl-C still stops.
            self._old_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame):
        self.signal_received = signal.Signals(signum).name

    def _manager(self):
        if self.mngr is None:
            import orbax.checkpoint as ocp

            policy = (ocp.checkpoint_managers.LatestN(n=self.c.keep_last) if self.c.keep_last else None)
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=self.c.async_save, create=True,
                cleanup_tmp_directories=True, preservation_policy=policy)
            self.mngr = ocp.CheckpointManager(os.path.abspath(self.dir), options=options)
        return self.mngr

    def _report_finished(self, wait: bool) -> None:
        if self.pending is None:
            return
        if wait:
            self.mngr.wait_until_finished()
        elif self.mngr.is_saving_in_progress():
            return
        iteration, path, t_start = self.pending
        self.pending = None
        self.log(f"> checkpoint of iteration {iteration} committed to {path} "
                 f"({'written in' if wait else 'seen done'} {time.perf_counter() - t_start:.2f} s "
                 "after the save began)")

    def save(self, iteration: int, state: dict, consumed_samples: int, rng_key_data) -> float:
        """Save now; returns the seconds training was blocked."""
        import jax
        import numpy as np
        import orbax.checkpoint as ocp

        t0 = time.perf_counter()
        mngr = self._manager()
        self._report_finished(wait=True)  # one save in flight at a time
        if iteration in mngr.all_steps():
            mngr.delete(iteration)
        params, opt_state = state["params"], state["opt_state"]
        _, p_sh, o_sh, pipe = plain_layout(self.pz)
        if pipe is not None:
            params = jax.jit(pipe.to_plain, out_shardings=p_sh)(params)
            opt_state = jax.jit(pipe.to_plain, out_shardings=o_sh)(opt_state)
        meta = {
            "format": FORMAT, "version": FORMAT_VERSION, "iteration": int(iteration),
            "consumed_samples": int(consumed_samples), "opt_step": int(jax.device_get(state["step"])),
            "valid_batches": int(self.valid_loader.iteration) if self.valid_loader is not None else 0,
            "has_optimizer": bool(self.c.save_optim),
            "rng": ({"seed": self.cfg.train.seed, "impl": "threefry2x32",
                     "key_data": [int(x) for x in np.asarray(rng_key_data).reshape(-1)]}
                    if self.c.save_rng and rng_key_data is not None else None),
            "config": config_to_dict(self.cfg), "tokenizer": self.tokenizer,
            "layout": layout_record(self.pz), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        items = {PARAMS: ocp.args.StandardSave(params), META: ocp.args.JsonSave(meta),
                 TOKENIZER: files_handler()(self.files)}
        if self.c.save_optim:
            items[OPT_STATE] = ocp.args.StandardSave(opt_state)
        mngr.save(iteration, args=ocp.args.Composite(**items), force=True)
        blocked = time.perf_counter() - t0
        path = os.path.join(self.dir, str(iteration))
        self.last_saved = iteration
        self.saved_paths.append(path)
        self.pending = (iteration, path, t0)
        self.log(f"> saving checkpoint of iteration {iteration} to {path}: training blocked "
                 f"{blocked:.2f} s" + ("; writing in the background" if self.c.async_save else ""))
        if not self.c.async_save:
            self._report_finished(wait=True)
        return blocked

    def step_done(self, iteration: int, state: dict, consumed_samples: int, rng_key_data) -> str | None:
        """After iteration `iteration`: save on the interval; on an exit request save and return why."""
        c = self.c
        if self.pending is not None:
            self._report_finished(wait=False)
        if self.dir and c.save_interval and iteration % c.save_interval == 0:
            self.save(iteration, state, consumed_samples, rng_key_data)
        reason = None
        if c.exit_signal_handler and _agree(self.signal_received is not None):
            reason = f"received {self.signal_received or 'a signal (on another host)'}"
        elif c.exit_interval and iteration % c.exit_interval == 0:
            reason = f"--exit-interval {c.exit_interval}"
        elif c.exit_duration_in_mins is not None and _agree(
                (time.time() - self.start_time) / 60.0 > c.exit_duration_in_mins):
            reason = f"--exit-duration-in-mins {c.exit_duration_in_mins:g}"
        if reason and self.dir and self.last_saved != iteration:
            self.save(iteration, state, consumed_samples, rng_key_data)
        return reason

    def finish(self, iteration: int, state: dict, consumed_samples: int, rng_key_data) -> None:
        """The end-of-training checkpoint (unless this iteration was just saved)."""
        if (self.dir and self.c.final_checkpoint and self.last_saved != iteration
                and iteration > self.start.iteration):
            self.save(iteration, state, consumed_samples, rng_key_data)

    def close(self) -> None:
        """Wait for the write in flight (a run ends only with its checkpoints committed)."""
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers = {}
        if self.mngr is not None:
            self._report_finished(wait=True)
            self.mngr.close()
            self.mngr = None

