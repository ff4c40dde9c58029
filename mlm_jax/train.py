"""`python -m mlm_jax.train [Megatron-LM flags]`: build config, mesh, data, state; loop; log.

With no flags: a small GPT on the installed Python standard library's source, tokenized by a
SentencePiece model trained on it on first use (cached), on whatever devices exist.

`train(cfg)` reads top to bottom: prepare (flags, --load, tokenizer, output paths: the config is
finalized once), the mesh and the batch layout, build the data, the model and its state, the
loaders and the saver; run the loop (`Loop`); sample; write the summary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Callable

from mlm_jax.arguments import parse_args
from mlm_jax.batch_layout import BatchLayout, batch_layout
from mlm_jax.batch_schedule import BatchSchedule, RunPlan, describe, for_layout, train_sample_count
from mlm_jax.cli import cli
from mlm_jax.config import Config
from mlm_jax.errors import ConfigError, RunFailure, UsageError
from mlm_jax.run_end import done_lines, end_of_run_sample
from mlm_jax.validation import finalize, validate_checkpoint

# Files that mark a run folder as holding a run: reusing it is an error unless resuming.
RUN_FILES = ("config.json", "summary.json", "metrics.jsonl")


# Overflowed (skipped) steps in a row after which a static --loss-scale stops the run.
STATIC_SKIP_LIMIT = 3


class TrainingStopped(RunFailure):
    """Training cannot go on (NaN/Inf loss or gradient); the message names the iteration."""


def _run_dir(cfg: Config) -> str:
    """--run-dir, or a new folder runs/<date-time>[-N] (never an existing one)."""
    if cfg.train.run_dir:
        return cfg.train.run_dir
    base = os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


# --------------------------------------------------------------------------- preparing


def absolute_paths(cfg: Config) -> Config:
    """Every path flag resolved once, here, against the working directory: later code (Orbax
    above all, which refuses relative paths) sees absolute paths only."""
    ab = lambda p: os.path.abspath(p) if p else p  # noqa: E731
    c, t = cfg.checkpoint, cfg.train
    return cfg.replace(
        checkpoint=dataclasses.replace(c, save=ab(c.save), load=ab(c.load)),
        train=dataclasses.replace(t, run_dir=ab(t.run_dir), metrics_file=ab(t.metrics_file),
                                  tensorboard_dir=ab(t.tensorboard_dir)))


def _check_run_outputs(cfg: Config, run_dir: str) -> None:
    from mlm_jax.paths import writable_dir, writable_file

    t = cfg.train
    flag = "--run-dir" if t.run_dir else "the run folder"
    if not cfg.checkpoint.load:  # resuming continues a run's files; a new run must not touch them
        earlier = [f for f in RUN_FILES if os.path.exists(os.path.join(run_dir, f))]
        if earlier:
            raise UsageError(
                f"{flag} {run_dir}: holds an earlier run ({os.path.join(run_dir, earlier[0])}); nothing "
                "in it is overwritten: choose a new --run-dir, or resume that run with --load <its checkpoints>")
        if t.metrics_file and os.path.isfile(t.metrics_file) and os.path.getsize(t.metrics_file):
            raise UsageError(f"--metrics-file {t.metrics_file}: holds an earlier run's metrics; choose a new "
                             "file, or resume that run with --load <its checkpoints>")
    writable_dir(run_dir, flag)
    if t.metrics_file:
        writable_file(t.metrics_file, "--metrics-file")
    if t.tensorboard_dir:
        writable_dir(t.tensorboard_dir, "--tensorboard-dir")


def check_outputs(cfg: Config, run_dir: str, main: bool) -> None:
    """Every output path usable before the first step (UsageError naming the flag otherwise),
    and a run folder holding an earlier run is not reused unless this run resumes (--load)."""
    from mlm_jax.distributed import broadcast_str
    from mlm_jax.paths import writable_dir

    if cfg.checkpoint.save:  # every process writes its own shards
        writable_dir(cfg.checkpoint.save, "--save")
    problem = ""
    if main:  # process 0 writes the run folder; every process raises the same error
        try:
            _check_run_outputs(cfg, run_dir)
        except UsageError as e:
            problem = str(e)
    problem = broadcast_str(problem)
    if problem:
        raise UsageError(problem)


def with_vocab_of(cfg: Config, tokenizer) -> Config:
    """`cfg` with the tokenizer's vocab size: the model's true vocab (None: the flag's)."""
    if tokenizer is None or tokenizer.vocab_size == cfg.model.vocab_size:
        return cfg
    return cfg.replace(model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size, padded_vocab_size=None))


def prepare(cfg: Config, log) -> tuple[Config, Any, Any, str, bool, Callable]:
    """Join the other processes; find the --load checkpoint (with --use-checkpoint-args the model
    and tokenizer flags come from it) and build the tokenizer (whose vocab sizes the model), so
    that the config is finalized once, knowing both; check every output path: all before any data
    or compile work. Returns (cfg, found, tokenizer, run_dir, main, log)."""
    import jax

    from mlm_jax import checkpoint as ckpt
    from mlm_jax.data.builder import run_tokenizer
    from mlm_jax.distributed import broadcast_str, check_same_config, initialize

    initialize(cfg.distributed)  # joins the other processes (if any) before any device is touched
    if jax.process_index() == 0:
        log(f"> JAX {jax.__version__} on {jax.device_count()} {jax.devices()[0].platform} device(s); "
            "the tokenizer and the data next ...")
    cfg = absolute_paths(cfg)
    validate_checkpoint(cfg.checkpoint)  # the --load flags' own rules, before --load is read
    cfg, found = ckpt.resolve_load(cfg, log)  # --load: which checkpoint (model args from it)
    # A --vocab-size below 1 is refused by finalize, naming the flag, before any tokenizer is built.
    tokenizer = run_tokenizer(cfg.data, cfg.model.vocab_size) if cfg.model.vocab_size > 0 else None
    cfg = finalize(with_vocab_of(cfg, tokenizer), jax.device_count())  # flag errors before data or compile work
    check_same_config(cfg)  # processes started with other flags fail here, naming the fields
    run_dir = os.path.abspath(broadcast_str(_run_dir(cfg)))  # one run folder, named by process 0
    main = jax.process_index() == 0
    check_outputs(cfg, run_dir, main)
    if not main:  # only process 0 prints; every process still does all the work
        log = lambda *args, **kwargs: None  # noqa: E731
    return cfg, found, tokenizer, run_dir, main, log


# --------------------------------------------------------------------------- building


def build_data(cfg: Config, schedule: BatchSchedule, tokenizer, log):
    """The datasets, read with the tokenizer `prepare` built (None: the data's own)."""
    from mlm_jax.data import build_datasets, megatron_num_samples

    t = cfg.train
    t0 = time.perf_counter()
    sizes = megatron_num_samples(t.train_iters, t.global_batch_size, t.eval_interval, t.eval_iters)
    sizes = (train_sample_count(cfg, schedule), *sizes[1:])
    data = build_datasets(cfg.data, t.seq_length, t.seed, sizes, vocab_size=cfg.model.vocab_size, tokenizer=tokenizer)
    log(f"> data ready in {time.perf_counter() - t0:.1f} s: {len(data.train)} training samples"
        + (f", {len(data.valid)} validation samples" if data.valid is not None else ""))
    return data


def build_model(cfg: Config, mesh, layout: BatchLayout, log):
    """(parallelized model and steps, parameter count)."""
    import jax

    from mlm_jax.metrics import active_params
    from mlm_jax.models.attention import backend_note
    from mlm_jax.models.build import abstract_model, count_params
    from mlm_jax.parallel.data import bf16_grad_reduce_note
    from mlm_jax.parallelize import parallelize
    from mlm_jax.platform import mesh_platform

    pz = parallelize(cfg, mesh)
    n_params = count_params(abstract_model(cfg)[1])  # pz.shapes may hold pipeline padding rows
    log(f"> mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} device(s); "
        f"{n_params / 1e6:.2f} M parameters; vocab {cfg.model.vocab_size} padded to {cfg.model.vocab}; "
        f"{layout.num_microbatches} microbatch(es) of {layout.micro_batch_size} per data-parallel rank")
    note = bf16_grad_reduce_note(cfg, mesh)
    if note:
        log(f"> --grad-reduce-in-bf16: {note}")
    note = backend_note(cfg.model, mesh_platform(mesh))
    if note:
        log(f"> {note}")
    active = active_params(cfg.model)
    if active is not None:
        log(f"> MoE: FLOPs and MFU count {active / 1e6:.2f} M active parameters per token (top-"
            f"{cfg.model.moe_router_topk} of {cfg.model.num_experts} experts in each MoE layer)")
    return pz, n_params


def build_state(cfg: Config, pz, found, schedule: BatchSchedule, log):
    """(train state, Start): restored from `found`, or initialised from --seed."""
    from mlm_jax import checkpoint as ckpt

    t = cfg.train
    t0 = time.perf_counter()
    if found is not None:
        state, start = ckpt.restore_train_state(cfg, pz, found, log)
    else:
        log("> compiling the parameter initialiser ...")
        state, start = pz.init(t.seed), ckpt.Start()
        log(f"> parameters initialised in {time.perf_counter() - t0:.1f} s")
    if start.consumed_samples % t.global_batch_size and not schedule.varies:
        raise ckpt.CheckpointError(
            f"the checkpoint consumed {start.consumed_samples} samples, not a multiple of "
            f"--global-batch-size {t.global_batch_size}; resume with the batch size it was saved with")
    return state, start


def build_loaders(cfg: Config, layout: BatchLayout, pz, data, start, plan: RunPlan):
    """(training loader, validation loader or None), each continuing where `start` left off:
    the data order is a function of the sample index, so resuming continues it exactly
    (validation too: a checkpoint records how many validation batches were used). With a
    batch-size schedule, `plan` gives each iteration's batch."""
    from mlm_jax.data import BatchLoader
    from mlm_jax.data.batch import batch_fn

    tokenizer = data.tokenizer
    make = batch_fn(cfg.data, tokenizer.eod if tokenizer else cfg.model.vocab_size - 1)
    gbs, shape, sharding = layout.global_batch_size, layout.batch_shape(), pz.batch_sharding()
    if plan.schedule.varies:  # loader index k serves iteration k + 1
        loader = BatchLoader(data.train, gbs, sharding, shape, make,
                             start_iteration=start.iteration, prefetch=cfg.data.prefetch,
                             end_iteration=cfg.train.train_iters,
                             plan=lambda k: (plan.first_sample(k + 1), layout.batch_shape(plan.batch_size(k + 1))))
    else:
        loader = BatchLoader(data.train, gbs, sharding, shape, make,
                             start_iteration=start.consumed_samples // gbs, prefetch=cfg.data.prefetch)
    valid = (BatchLoader(data.valid, gbs, sharding, shape, make, start_iteration=start.valid_batches, prefetch=0)
             if data.valid is not None and cfg.train.eval_iters > 0 else None)  # --eval-iters 0: no validation
    return loader, valid


def build_throughput(cfg: Config, mesh, log):
    """The MFU denominator (given, or this device's measured matmul peak) and FLOPs per token."""
    import jax
    import jax.numpy as jnp

    from mlm_jax.instruments import Throughput
    from mlm_jax.metrics import device_peak, flops_per_token
    from mlm_jax.models.layers import compute_dtype

    t = cfg.train
    peak, source = t.peak_flops, "given"
    if peak is None:
        log("> measuring this device's matmul peak (the MFU denominator; --peak-flops-per-device to give it) ...")
        peak, source = device_peak(mesh, compute_dtype(cfg.model))
    log(f"> MFU denominator: {peak / 1e9:.1f} GFLOP/s per device ({source} "
        f"{jnp.dtype(compute_dtype(cfg.model)).name} matmul peak)")
    return Throughput(t.global_batch_size * t.seq_length, flops_per_token(cfg.model, t.seq_length, causal=True),
                      flops_per_token(cfg.model, t.seq_length, causal=False), jax.device_count(), peak, source)


def write_config(run_dir: str, cfg: Config, found=None) -> str:
    """The run's config.json; a run resumed into its own folder keeps the earlier one and writes
    config.resumed-<iteration>.json beside it (metrics.jsonl is appended to)."""
    os.makedirs(run_dir, exist_ok=True)  # created only now, once every check has passed
    path = os.path.join(run_dir, "config.json")
    if found is not None and os.path.exists(path):
        path = os.path.join(run_dir, f"config.resumed-{found.iteration}.json")
    with open(path, "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
    return path


# --------------------------------------------------------------------------- the loop


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
                break
            loss_sum, n = self.pz.eval_step(self.state["params"], batch)
            total, count = total + float(loss_sum), count + float(n)
        if count == 0:
            return None
        loss = total / count
        ppl = math.exp(min(loss, 20.0))
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
                                  scaling, device_memory(), self.step_mem, self.inst.window(), aux_record(aux),
                                  consumed_samples=self.consumed(iteration))
        line = iteration_line(record, self.t.train_iters, batch)
        self.logger.log(record, console=line + (f" {format_aux(aux)}" if aux_record(aux) else ""))
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


# --------------------------------------------------------------------------- the end


def close_all(*things) -> None:
    """Close each of `things` (None skipped), all of them even when one fails; then raise the
    first failure (a save that failed while the last write was awaited)."""
    first = None
    for thing in things:
        try:
            if thing is not None:
                thing.close()
        except BaseException as e:  # noqa: BLE001 - re-raised below, after the rest are closed
            first = first or e
    if first is not None:
        raise first


def train(cfg: Config, log=print) -> dict:
    """Run training as configured; returns a summary (final losses, timings, run dir). Ctrl-C
    stops after the current iteration, saves (with --save) and raises KeyboardInterrupt."""
    from tqdm import tqdm

    from mlm_jax import checkpoint as ckpt
    from mlm_jax.instruments import Instruments, RunLogger, Wandb

    from mlm_jax.sharding.mesh import make_mesh

    start_time = time.time()
    cfg, found, tokenizer, run_dir, main, log = prepare(cfg, log)
    mesh = make_mesh(cfg.parallel)
    layout = batch_layout(cfg, mesh)  # the batch sizes that the data, the loaders and the loop read
    schedule = for_layout(cfg, layout)
    data = build_data(cfg, schedule, tokenizer, log)
    if schedule.varies:
        log(describe(cfg, schedule))
    pz, n_params = build_model(cfg, mesh, layout, log)
    if main:
        write_config(run_dir, cfg, found)
    state, start = build_state(cfg, pz, found, schedule, log)
    plan = RunPlan(schedule, start.iteration, start.consumed_samples, cfg.train.train_iters)
    plan.schedule.check_sizes(plan.sizes)  # from a resumed position too (Megatron checks after loading)
    loader, valid_loader = build_loaders(cfg, layout, pz, data, start, plan)
    saver = ckpt.Saver(cfg, pz, data.tokenizer, run_dir, start, log, start_time, valid_loader=valid_loader)
    t = cfg.train
    logger = RunLogger(t.metrics_file or os.path.join(run_dir, "metrics.jsonl"),
                       t.tensorboard_dir or (os.path.join(run_dir, "tensorboard") if main else None),
                       write=tqdm.write, wandb=Wandb(cfg.instruments, cfg, run_dir, main, log))
    inst = Instruments(cfg.instruments, profile_dir=os.path.join(run_dir, "profile"), main=main)
    loop = Loop(cfg, pz, state, start, loader, valid_loader, saver, logger, inst,
                build_throughput(cfg, mesh, log), log, plan, layout)
    bar = tqdm(total=t.train_iters, initial=start.iteration, desc="training", unit="it", dynamic_ncols=True,
               disable=not (main and t.progress_bar), file=sys.stderr)
    try:
        loop.run(bar)
    finally:
        close_all(inst, saver, bar, loader, valid_loader, logger)
    sample = (None if loop.exit_reason else
              end_of_run_sample(cfg, pz, loop.state["params"], data, n_params, loop.iteration, log))
    summary = {"run_dir": run_dir, "first_valid_loss": loop.first_valid, "final_valid_loss": loop.last_valid,
               "final_train_loss": loop.last_train_loss, "iterations": max(t.train_iters, loop.iteration),
               "trained_iterations": loop.iteration - start.iteration,
               "parameters": n_params, "sample": sample, "exit_reason": loop.exit_reason,
               "last_iteration": loop.iteration, "resumed_from": start.resumed_from,
               "checkpoints": saver.saved_paths}
    if main:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    if saver.interrupted:
        log(f"> stopped by Ctrl-C at iteration {loop.iteration}"
            + (f"; checkpoint saved to {saver.saved_paths[-1]}" if saver.saved_paths else ""))
        raise KeyboardInterrupt
    for line in done_lines(cfg, summary, data, time.time() - start_time):
        log(line)
    return summary


# --------------------------------------------------------------------------- the command


def use_every_cpu_core() -> None:
    """One XLA CPU device per core unless MLM_JAX_CPU_DEVICES or XLA_FLAGS says otherwise
    (`xla_flags.use_cpu_devices`)."""
    from mlm_jax import xla_flags

    xla_flags.use_cpu_devices(every_core=True)


@cli
def main(argv=None, command: bool = False) -> int:
    """The command: exit 0, 2 (usage), 1 (runtime failure) or 130 (Ctrl-C), one `error:` line
    last (see mlm_jax.cli). `command`: this is the process's command (`python -m`), whose output
    ends with its own error line, not Orbax's reports."""
    cfg = parse_args(argv)
    from mlm_jax import xla_flags
    from mlm_jax.distributed import resolve

    if resolve(cfg.distributed).process_id == 0:  # the first line within a second: JAX takes a few to import
        print(f"> mlm_jax.train: {cfg.train.train_iters} iterations; starting JAX ...", flush=True)
    if command:
        from mlm_jax.checkpoint import silence_orbax  # imports Orbax and JAX: after the first line

        silence_orbax()

    xla_flags.apply(cfg.parallel)  # --overlap-grad-reduce / --overlap-param-gather: before JAX starts
    use_every_cpu_core()
    train(cfg)
    return 0


if __name__ == "__main__":
    code = main(command=True)
    from mlm_jax.checkpoint import exit_process

    exit_process(code)
