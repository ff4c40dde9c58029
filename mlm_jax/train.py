"""`python -m mlm_jax.train [Megatron-LM flags]`: build config, mesh, data, state; loop; log.

With no flags: a small GPT on the installed Python standard library's source, tokenized by a
SentencePiece model trained on it on first use (cached), on whatever devices exist.

`train(cfg)` reads top to bottom: prepare (flags, --load, tokenizer, output paths: the config is
finalized once), the mesh and the batch layout, build the data, the model and its state, the
loaders and the saver; run the loop (`mlm_jax.loop.Loop`); sample; write the summary and the
closing lines (`mlm_jax.run_end`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable

from mlm_jax.arguments import parse_args
from mlm_jax.batch_layout import BatchLayout, batch_layout
from mlm_jax.batch_schedule import BatchSchedule, RunPlan, describe, for_layout, train_sample_count
from mlm_jax.cli import cli
from mlm_jax.config import Config
from mlm_jax.errors import UsageError
from mlm_jax.loop import Loop
from mlm_jax.paths import naming
from mlm_jax.run_end import done_lines, end_of_run_sample
from mlm_jax.validation import finalize, validate_checkpoint

# Files that mark a run folder as holding a run: reusing it is an error unless resuming.
RUN_FILES = ("config.json", "summary.json", "metrics.jsonl")


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


def check_outputs(cfg: Config, run_dir: str, main: bool):
    """Every output path usable before the first step (UsageError naming the flag otherwise),
    and a run folder holding an earlier run is not reused unless this run resumes (--load).
    Process 0 locks the --save folder for the run (`checkpoint.lock.SaveLock`, returned; None
    elsewhere): a second run writing into it is refused here."""
    from mlm_jax.checkpoint.lock import SaveLock
    from mlm_jax.distributed import broadcast_str
    from mlm_jax.paths import writable_dir

    if cfg.checkpoint.save:  # every process writes its own shards
        writable_dir(cfg.checkpoint.save, "--save")
    problem, lock = "", None
    if main:  # process 0 writes the run folder; every process raises the same error
        try:
            _check_run_outputs(cfg, run_dir)
            if cfg.checkpoint.save:
                lock = SaveLock.take(cfg.checkpoint.save, run_dir)
        except UsageError as e:
            problem = str(e)
    problem = broadcast_str(problem)
    if problem:
        if lock is not None:
            lock.release()
        raise UsageError(problem)
    return lock


def with_vocab_of(cfg: Config, tokenizer) -> Config:
    """`cfg` with the tokenizer's vocab size: the model's true vocab (None: the flag's)."""
    if tokenizer is None or tokenizer.vocab_size == cfg.model.vocab_size:
        return cfg
    return cfg.replace(model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size, padded_vocab_size=None))


def prepare(cfg: Config, log) -> tuple[Config, Any, Any, str, bool, Callable, Any]:
    """Join the other processes; find the --load checkpoint (with --use-checkpoint-args the model
    and tokenizer flags come from it) and build the tokenizer (whose vocab sizes the model), so
    that the config is finalized once, knowing both; check every output path and lock --save: all
    before any data or compile work. Returns (cfg, found, tokenizer, run_dir, main, log, the save
    folder's lock or None)."""
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
    lock = check_outputs(cfg, run_dir, main)
    if not main:  # only process 0 prints; every process still does all the work
        log = lambda *args, **kwargs: None  # noqa: E731
    return cfg, found, tokenizer, run_dir, main, log, lock


# --------------------------------------------------------------------------- building


def build_data(cfg: Config, schedule: BatchSchedule, tokenizer, log):
    """The datasets, read with the tokenizer `prepare` built (None: the data's own)."""
    from mlm_jax.data import build_datasets, megatron_num_samples

    t = cfg.train
    t0 = time.perf_counter()
    sizes = megatron_num_samples(t.train_iters, t.global_batch_size, t.eval_interval, t.eval_iters)
    sizes = (train_sample_count(cfg, schedule), *sizes[1:])
    data = build_datasets(cfg.data, t.seq_length, t.seed, sizes, vocab_size=cfg.model.vocab_size, tokenizer=tokenizer,
                          wanted=(True, True, False))  # the test split: never read by training
    log(f"> data ready in {time.perf_counter() - t0:.1f} s: {len(data.train)} training samples"
        + (f", {len(data.valid)} validation samples" if data.valid is not None else ""))
    return data


def build_model(cfg: Config, mesh, layout: BatchLayout, log):
    """(parallelized model and steps, parameter count)."""
    import jax

    from mlm_jax.metrics import active_params
    from mlm_jax.models.attention import backend_note
    from mlm_jax.models.build import abstract_model, count_params
    from mlm_jax.models.fp8 import experts_note as fp8_experts_note
    from mlm_jax.parallel.data import bf16_grad_reduce_note, overlap_grad_reduce_note
    from mlm_jax.parallel.fsdp import recompute_modules_note, torch_fsdp2_note
    from mlm_jax.build import parallelize
    from mlm_jax.platform import mesh_platform

    pz = parallelize(cfg, mesh)
    n_params = count_params(abstract_model(cfg)[1])  # pz.shapes may hold pipeline padding rows
    log(f"> mesh {dict(mesh.shape)} on {jax.device_count()} {jax.devices()[0].platform} device(s); "
        f"{n_params / 1e6:.2f} M parameters; vocab {cfg.model.vocab_size} padded to {cfg.model.vocab}; "
        f"{layout.num_microbatches} microbatch(es) of {layout.micro_batch_size} per data-parallel rank")
    for flag, note in (("--grad-reduce-in-bf16", bf16_grad_reduce_note(cfg, mesh)),
                       ("--overlap-grad-reduce", overlap_grad_reduce_note(cfg, mesh)),
                       ("--use-torch-fsdp2", torch_fsdp2_note(cfg)),
                       ("--recompute-modules", recompute_modules_note(cfg)),
                       ("--fp8-format", fp8_experts_note(cfg.model))):
        if note:
            log(f"> {flag}: {note}")
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
        log("> measuring this device's matmul peak, the MFU denominator (compiling and timing a matmul; "
            "--peak-flops-per-device gives it) ...")
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
    with naming(path), open(path, "w") as f:
        json.dump(dataclasses.asdict(cfg), f, indent=2)
    return path


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
    start_time = time.time()
    cfg, found, tokenizer, run_dir, main, log, lock = prepare(cfg, log)
    try:
        return _train(cfg, found, tokenizer, run_dir, main, log, start_time)
    finally:  # --save's lock, on every way out
        if lock is not None:
            lock.release()


def _train(cfg: Config, found, tokenizer, run_dir: str, main: bool, log, start_time: float) -> dict:
    """`train` past `prepare`."""
    from tqdm import tqdm

    from mlm_jax import checkpoint as ckpt
    from mlm_jax.instruments import Instruments, RunLogger, Wandb

    from mlm_jax.sharding.mesh import make_mesh

    if log is print:  # lines above the progress bar, never glued to its end
        log = lambda *args: tqdm.write(" ".join(map(str, args)))  # noqa: E731
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
               "validation_used_up_at": loop.valid_used_up,
               "final_train_loss": loop.last_train_loss, "iterations": max(t.train_iters, loop.iteration),
               "trained_iterations": loop.iteration - start.iteration,
               "parameters": n_params, "sample": sample, "exit_reason": loop.exit_reason,
               "last_iteration": loop.iteration, "resumed_from": start.resumed_from,
               "checkpoints": saver.saved_paths}
    if main:
        path = os.path.join(run_dir, "summary.json")
        with naming(path), open(path, "w") as f:
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
        print("> mlm_jax.train: starting JAX ...", flush=True)
    if command:
        from mlm_jax.checkpoint import silence_orbax  # imports Orbax and JAX: after the first line

        silence_orbax()

    xla_flags.apply(cfg.parallel)  # --overlap-grad-reduce / --overlap-param-gather: before JAX starts
    if command:  # this process's own allocator: keep a CPU step's freed memory for the next
        xla_flags.keep_host_memory()
    use_every_cpu_core()
    train(cfg)
    return 0


if __name__ == "__main__":
    code = main(command=True)
    from mlm_jax.checkpoint import exit_process

    exit_process(code)
