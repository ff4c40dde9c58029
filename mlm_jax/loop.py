"""The training loop (`Loop`): steps, the logged iterations, evaluations, saves and early exits,
and what a logged iteration reports. `mlm_jax.train` builds everything the loop reads and runs it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

from mlm_jax.batch_layout import BatchLayout
from mlm_jax.batch_schedule import RunPlan
from mlm_jax.config import Config
from mlm_jax.errors import ConfigError, RunFailure
from mlm_jax.run_end import perplexity

# Overflowed (skipped) steps in a row after which a static --loss-scale stops the run.
STATIC_SKIP_LIMIT = 3


class TrainingStopped(RunFailure):
    """Training cannot go on (NaN/Inf loss or gradient); the message names the iteration."""


class Loop:
    """The training loop: steps, the logged iterations, evaluations, saves and early exits.

    One step stays in flight: step i is dispatched before step i-1's metrics are read, so the
    host never waits on the device except at a logged iteration.
    """

    bar = None  # the progress bar (set by `run`), whose rate leaves out what `excluded` times

    def __init__(self, cfg: Config, pz, state, start, loader, valid_loader, saver, logger, inst,
                 throughput, log, plan: RunPlan, layout: BatchLayout):
        import jax

        self.cfg, self.t, self.pz, self.state, self.start = cfg, cfg.train, pz, state, start
        self.plan = plan  # each iteration's global batch and consumed samples (constant, or a ramp-up)
        self.layout = layout
        self.loader, self.valid_loader, self.saver = loader, valid_loader, saver
        self.logger, self.inst, self.throughput, self.log = logger, inst, throughput, log
        self.seed_key = (jax.random.key(cfg.train.seed) if start.rng_key_data is None
                         else jax.random.wrap_key_data(start.rng_key_data))
        self.iteration = start.iteration
        self.exit_reason: str | None = None
        self.last_train_loss: float | None = None
        self.step_mem: dict = {}  # compiled memory analysis, where devices report no live memory
        self.compile_s: float | None = None
        self.eval_compiled = False  # the first evaluation compiles its step: said before it starts
        self.valid_used_up: int | None = None  # the iteration whose evaluation found the validation data used up
        self.pending = None  # the previous step's (iteration, metrics), checked after the next dispatch
        self.skips_counted = start.iteration  # loss scaling: iterations whose skip is counted
        self.skips_in_a_row = 0  # loss scaling: overflowed iterations since the last clean one
        self._new_window()

    def _new_window(self) -> None:
        self.window_start, self.window_iters, self.window_wait = time.perf_counter(), 0, 0.0
        self.window_excluded = 0.0  # evaluation and checkpoint seconds: not training throughput
        self.window_skipped = 0  # loss scaling: overflowed (skipped) iterations of the log window

    @contextlib.contextmanager
    def excluded(self, timer: str):
        """Time `timer` (eval, checkpoint) and keep it out of the elapsed time per iteration,
        tokens/s and MFU, as Megatron's timers do, and out of the progress bar's rate."""
        from mlm_jax.instruments import exclude_from_rate

        t0 = time.perf_counter()
        with self.inst.timed(timer):
            yield
        spent = time.perf_counter() - t0
        self.window_excluded += spent
        exclude_from_rate(self.bar, spent)

    def window_step_s(self) -> float:
        """Mean step time of the log window, evaluation and checkpoint time excluded; the first
        step's window holds no finished iteration: its own (compile + run) time."""
        if not self.window_iters:
            return self.compile_s
        return (time.perf_counter() - self.window_start - self.window_excluded) / self.window_iters

    def consumed(self, iteration: int) -> int:
        """Samples consumed after `iteration` (Megatron's consumed_train_samples)."""
        return self.plan.consumed(iteration)

    def evaluate(self, iteration: int) -> float | None:
        """Validation loss over --eval-iters batches (logged), or None without validation data."""
        from mlm_jax.instruments import validation_line

        if self.valid_loader is None:
            return None
        if not self.eval_compiled:
            self.log("> compiling the evaluation step ...")
            self.eval_compiled = True
        total, count = 0.0, 0.0
        for _ in range(self.t.eval_iters):
            try:
                batch, _ = next(self.valid_loader)
            except StopIteration:
                if self.valid_used_up is None:  # said once, and at the end of the run
                    self.valid_used_up = iteration
                    self.log(f"> validation at iteration {iteration}: the validation data is used up (it was sized "
                             "for the run's --train-iters, --eval-interval and --eval-iters from iteration 0; a "
                             "resumed run that evaluates more often or longer reads past it); no validation from here")
                break
            loss_sum, n = self.pz.eval_step(self.state["params"], batch)
            total, count = total + float(loss_sum), count + float(n)
        if count == 0:
            return None
        loss = total / count
        ppl = perplexity(loss)
        self.logger.log({"iteration": iteration, "valid_lm_loss": loss, "valid_ppl": ppl},
                        console=validation_line(iteration, loss, ppl))
        return loss

    def count_skip(self, iteration: int, metrics) -> None:
        """Add iteration `iteration`'s skip (a loss-scale overflow) to the window, once."""
        if "skipped" in metrics and iteration > self.skips_counted:
            skipped = int(metrics["skipped"])
            self.window_skipped += skipped
            self.skips_counted = iteration
            self.skips_in_a_row = self.skips_in_a_row + 1 if skipped else 0
            self.check_static_scale(iteration)

    def check_static_scale(self, iteration: int) -> None:
        """A static --loss-scale never backs off: overflowing STATIC_SKIP_LIMIT steps in a row
        (or every step of a shorter run) it would skip every step to the end, training nothing."""
        scale = self.cfg.optim.loss_scale
        limit = min(STATIC_SKIP_LIMIT, self.t.train_iters - self.start.iteration)
        if scale is not None and self.skips_in_a_row >= limit:
            raise ConfigError(
                f"--loss-scale {scale:g}: the scaled gradients overflowed {self.skips_in_a_row} steps in a row "
                f"(iterations {iteration - self.skips_in_a_row + 1}..{iteration} skipped); give a "
                "smaller --loss-scale, or leave it out for dynamic loss scaling")

    def check(self, iteration: int, metrics) -> None:
        if self.t.check_for_nan_in_loss_and_grad and not bool(metrics["finite"]):
            raise TrainingStopped(
                f"iteration {iteration}: loss {float(metrics['lm_loss'])} or gradient norm "
                f"{float(metrics['grad_norm'])} is NaN/Inf; stopping "
                "(--no-check-for-nan-in-loss-and-grad to go on regardless)")

    def step(self, iteration: int):
        """Dispatch step `iteration`, then check (and time) the one before it."""
        import jax

        from mlm_jax.instruments import slow_iteration_line

        self.inst.before_step(iteration)
        self.note_batch_size(iteration)
        batch, wait = next(self.loader)
        self.window_wait += wait
        self.inst.add("data_wait", wait)
        key = jax.random.fold_in(self.seed_key, iteration)
        if self.compile_s is None:
            self.log("> compiling the training step ...")
        with self.inst.step_annotation(iteration):
            self.state, metrics = self.pz.train_step(self.state, batch, key)
        if self.pending is not None:
            self.check(*self.pending)
            self.count_skip(*self.pending)
            slow = self.inst.step_finished(*self.pending)
            if slow is not None:
                self.logger.log(slow, console=slow_iteration_line(slow))
        self.pending = (iteration, metrics)
        if self.compile_s is None:
            self.first_step_done(metrics, batch, key)
        else:
            self.window_iters += 1
        return metrics

    def note_batch_size(self, iteration: int) -> None:
        """Megatron's line when a batch-size schedule changes the global batch (each new size
        compiles its own step once)."""
        size = self.plan.batch_size(iteration)
        before = self.plan.batch_size(iteration - 1) if iteration - 1 > self.start.iteration else None
        if self.plan.schedule.varies and size != before:
            micro = self.layout.microbatches(size)
            self.log(f"> {'setting initial batch size to' if before is None else f'ramping up batch size from {before} to'}"
                     f" {size} at iteration {iteration} ({micro} microbatch(es), {self.consumed(iteration - 1)} "
                     "consumed samples)")

    def first_step_done(self, metrics, batch, key) -> None:
        """After the compiling step: report its time (and memory), restart the clocks."""
        import jax

        from mlm_jax.instruments import exclude_from_rate, step_memory, step_memory_line
        from mlm_jax.metrics import device_memory

        jax.block_until_ready(metrics)
        self.compile_s = time.perf_counter() - self.window_start - self.window_excluded
        # The bar's rate, like the logged time per iteration, starts after the compiling step
        # (whose time the line below reports).
        exclude_from_rate(self.bar, self.compile_s)
        self.log(f"> first step (compile + run) took {self.compile_s:.1f} s")
        if not device_memory():
            self.step_mem = step_memory(self.pz.train_step, self.state, batch, key)
            if self.step_mem:
                self.log(step_memory_line(self.step_mem))
        self._new_window()
        self.inst.reset()

    def window_throughput(self, iteration: int):
        """The Throughput of the log window: its mean tokens per iteration (the batch may ramp up)."""
        if not self.plan.schedule.varies:
            return self.throughput
        n = max(1, min(self.window_iters, iteration - self.start.iteration))
        samples = (self.consumed(iteration) - self.consumed(iteration - n)) / n
        return dataclasses.replace(self.throughput, tokens_per_iter=samples * self.t.seq_length)

    def log_iteration(self, iteration: int, metrics) -> float:
        """The metrics record and console line of a logged iteration; returns the loss."""
        import jax

        from mlm_jax.instruments import iteration_line, iteration_record
        from mlm_jax.metrics import device_memory
        from mlm_jax.models import mtp
        from mlm_jax.models.moe import aux_record, format_aux

        self.check(iteration, metrics)
        self.count_skip(iteration, metrics)
        host = {k: float(metrics[k]) for k in ("lm_loss", "lr", "grad_norm")}
        # Megatron's "loss scale" (after this step's update) and skips in the window (fp16).
        scaling = ({"loss_scale": float(metrics["loss_scale"]), "skipped_iterations": self.window_skipped}
                   if "loss_scale" in metrics else {})
        step_s = self.window_step_s()
        aux = jax.device_get(metrics.get("aux", {}))  # MoE's losses and balance ({} when dense)
        batch = self.plan.batch_size(iteration)
        record = iteration_record(iteration, batch, host, step_s,
                                  self.window_wait / max(self.window_iters, 1), self.window_throughput(iteration),
                                  scaling, device_memory(), self.step_mem, self.inst.window(),
                                  {**aux_record(aux), **mtp.record(aux)}, consumed_samples=self.consumed(iteration))
        line = iteration_line(record, self.t.train_iters, batch)
        extra = [part for part in (format_aux(aux), mtp.format_line(aux)) if part]
        self.logger.log(record, console=" ".join([line, *extra]))
        self._new_window()
        return host["lm_loss"]

    def one_iteration(self, iteration: int, bar) -> None:
        """Step, log, evaluate and save as scheduled; sets `exit_reason` on an early exit."""
        import jax

        t = self.t
        metrics = self.step(iteration)
        self.iteration = iteration
        bar.update(1)
        if iteration % t.log_interval == 0 or iteration == t.train_iters:
            self.last_train_loss = self.log_iteration(iteration, metrics)
            bar.set_postfix(loss=f"{self.last_train_loss:.3f}")
        if iteration % t.eval_interval == 0 and iteration != t.train_iters:
            # Step `iteration` is still running: its time is training time, not evaluation's.
            jax.block_until_ready(self.state["params"])
            with self.excluded("eval"):
                self.last_valid = self.evaluate(iteration)
        with self.excluded("checkpoint"):
            self.exit_reason = self.saver.step_done(iteration, self.state, self.consumed(iteration),
                                                    jax.random.key_data(self.seed_key))
        self.inst.after_step(iteration, metrics, last=bool(self.exit_reason) or iteration == t.train_iters)
        if self.exit_reason:
            self.log(f"> exiting at iteration {iteration}: {self.exit_reason}")

    def run(self, bar) -> None:
        """Iterations start+1 .. --train-iters (or until an exit request), then the final
        evaluation and checkpoint."""
        import jax

        # Validation before the first step only where asked (the default run); a resumed run
        # evaluates on schedule.
        self.bar = bar
        self.first_valid = None
        if self.start.iteration == 0 and self.t.eval_at_start:
            with self.excluded("eval"):  # before the first step: not its compile time either
                self.first_valid = self.evaluate(0)
        self.last_valid = self.first_valid
        if self.start.iteration >= self.t.train_iters:
            self.log(f"> nothing to train: the checkpoint is at iteration {self.start.iteration}, at or past "
                     f"--train-iters {self.t.train_iters} (give a larger --train-iters to train on); evaluating it")
        for iteration in range(self.start.iteration + 1, self.t.train_iters + 1):
            self.one_iteration(iteration, bar)
            if self.exit_reason:
                break
        if self.pending is not None:
            self.check(*self.pending)
        if self.exit_reason is None:
            with self.excluded("eval"):
                self.last_valid = self.evaluate(self.iteration)
        with self.excluded("checkpoint"):
            self.saver.finish(self.iteration, self.state, self.consumed(self.iteration),
                              jax.random.key_data(self.seed_key))
