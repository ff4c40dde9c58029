"""`python -m mlm_jax.train [Megatron-LM flags]`: build config, mesh, data, state; loop; log.

With no flags: a small GPT on the installed Python standard library's source, tokenized by a
SentencePiece model trained on it on first use (cached), on whatever devices exist.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time

from mlm_jax.arguments import parse_args
from mlm_jax.config import Config, ConfigError, finalize
from mlm_jax.errors import RunFailure, cli


def _run_dir(cfg: Config) -> str:
    if cfg.train.run_dir:
        return cfg.train.run_dir
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def _data_parallel_rows(mesh) -> int:
    from mlm_jax.sharding.mesh import DATA, EXPERT

    return mesh.shape[DATA] * mesh.shape[EXPERT]


class TrainingStopped(RunFailure):
    """Training cannot go on (NaN/Inf loss or gradient); the message names the iteration."""


def train(cfg: Config, log=print) -> dict:
    """Run training as configured; returns a summary (final losses, timings, run dir)."""
    import jax
    import numpy as np
    from tqdm import tqdm

    from mlm_jax.data import BatchLoader, build_datasets, make_batch, megatron_num_samples
    from mlm_jax.generate import greedy
    from mlm_jax.metrics import device_memory, flops_per_token, measure_matmul_peak
    from mlm_jax.parallelize import abstract_model, count_params, parallelize
    from mlm_jax.sharding.mesh import make_mesh
    from mlm_jax import checkpoint as ckpt
    from mlm_jax.distributed import broadcast_str, check_same_config, initialize
    from mlm_jax.instruments import Instruments, RunLogger, Wandb, slow_iteration_line, step_memory

    initialize(cfg.distributed)  # joins the other processes (if any) before any device is touched
    start_time = time.time()
    world = jax.device_count()
    cfg = finalize(cfg, world)  # flag errors surface before any data or compile work
    check_same_config(cfg)  # processes started with other flags fail here, naming the fields
    cfg, found = ckpt.resolve_load(cfg, world, log)  # --load: which checkpoint (model args from it)
    t = cfg.train
    run_dir = broadcast_str(_run_dir(cfg))  # one run folder, named by process 0
    main = jax.process_index() == 0
    if not main:  # only process 0 prints; every process still does all the work
        log = lambda *args, **kwargs: None  # noqa: E731

    # Data (the tokenizer decides the true vocab size).
    t0 = time.perf_counter()
    sizes = megatron_num_samples(t.train_iters, t.global_batch_size, t.eval_interval, t.eval_iters)
    data = build_datasets(cfg.data, t.seq_length, t.seed, sizes, vocab_size=cfg.model.vocab_size)
    tokenizer = data.tokenizer
    if tokenizer is not None and tokenizer.vocab_size != cfg.model.vocab_size:
        cfg = cfg.replace(model=dataclasses.replace(cfg.model, vocab_size=tokenizer.vocab_size,
                                                    padded_vocab_size=None))
        cfg = finalize(cfg, world)
    log(f"> data ready in {time.perf_counter() - t0:.1f} s: {len(data.train)} training samples"
        + (f", {len(data.valid)} validation samples" if data.valid is not None else ""))

    mesh = make_mesh(cfg.parallel)
    pz = parallelize(cfg, mesh)
    n_params = count_params(abstract_model(cfg)[1])  # pz.shapes may hold pipeline padding rows
    log(f"> mesh {dict(mesh.shape)} on {world} {jax.devices()[0].platform} device(s); "
        f"{n_params / 1e6:.2f} M parameters; vocab {cfg.model.vocab_size} padded to {cfg.model.vocab}; "
        f"{pz.num_microbatches} microbatch(es) of {t.micro_batch_size} per data-parallel rank")
    if main:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)

    keep = ("tokens", "labels", "loss_mask", "position_ids") + (
        ("segment_ids",) if cfg.data.reset_attention_mask else ())

    def batch_fn(samples):
        full = make_batch(samples, eod=tokenizer.eod if tokenizer else cfg.model.vocab_size - 1,
                          eod_mask_loss=cfg.data.eod_mask_loss,
                          reset_position_ids=cfg.data.reset_position_ids,
                          reset_attention_mask=cfg.data.reset_attention_mask)
        return {k: full[k] for k in keep}

    shape = pz.batch_shape()

    t0 = time.perf_counter()
    if found is not None:
        state, start = ckpt.restore_train_state(cfg, pz, found, log)
    else:
        state, start = pz.init(t.seed), ckpt.Start()
        log(f"> parameters initialised in {time.perf_counter() - t0:.1f} s")
    if start.consumed_samples % t.global_batch_size:
        raise ckpt.CheckpointError(
            f"the checkpoint consumed {start.consumed_samples} samples, not a multiple of "
            f"--global-batch-size {t.global_batch_size}; resume with the batch size it was saved with")
    # The data order is a function of the sample index: resuming continues it exactly (validation
    # too: a checkpoint records how many validation batches were used).
    loader = BatchLoader(data.train, t.global_batch_size, pz.batch_sharding(), shape, batch_fn,
                         start_iteration=start.consumed_samples // t.global_batch_size,
                         prefetch=cfg.data.prefetch)
    valid_loader = (BatchLoader(data.valid, t.global_batch_size, pz.batch_sharding(), shape, batch_fn,
                                start_iteration=start.valid_batches, prefetch=0)
                    if data.valid is not None else None)
    saver = ckpt.Saver(cfg, pz, tokenizer, run_dir, start, log, start_time, valid_loader=valid_loader)

    peak = t.peak_flops
    peak_source = "given"
    if peak is None:
        peak = measure_matmul_peak(mesh, jax.numpy.bfloat16 if cfg.model.bf16 else jax.numpy.float32)
        peak_source = "measured"
    flops_causal = flops_per_token(cfg.model, t.seq_length, causal=True)
    flops_full = flops_per_token(cfg.model, t.seq_length, causal=False)
    log(f"> MFU denominator: {peak / 1e9:.1f} GFLOP/s per device ({peak_source} "
        f"{'bf16' if cfg.model.bf16 else 'fp32'} matmul peak)")

    logger = RunLogger(cfg.train.metrics_file or os.path.join(run_dir, "metrics.jsonl"),
                       cfg.train.tensorboard_dir or (os.path.join(run_dir, "tensorboard") if main else None),
                       write=tqdm.write, wandb=Wandb(cfg.instruments, cfg, run_dir, main, log))
    inst = Instruments(cfg.instruments, profile_dir=os.path.join(run_dir, "profile"), main=main)
    step_mem: dict = {}  # compiled memory analysis, where devices report no live memory
    seed_key = (jax.random.key(t.seed) if start.rng_key_data is None
                else jax.random.wrap_key_data(start.rng_key_data))
    tokens_per_iter = t.global_batch_size * t.seq_length

    def evaluate(iteration: int) -> float | None:
        if valid_loader is None:
            return None
        total, count = 0.0, 0.0
        for _ in range(t.eval_iters):
            try:
                batch, _ = next(valid_loader)
            except StopIteration:
                break
            loss_sum, n = pz.eval_step(state["params"], batch)
            total, count = total + float(loss_sum), count + float(n)
        if count == 0:
            return None
        loss = total / count
        ppl = math.exp(min(loss, 20.0))
        logger.log({"iteration": iteration, "valid_lm_loss": loss, "valid_ppl": ppl},
                   console=f" validation loss at iteration {iteration:6d} | lm loss value: "
                           f"{loss:.6E} | lm loss PPL: {ppl:.6E} |")
        return loss

    first_valid = evaluate(0) if start.iteration == 0 else None  # a resumed run evaluates on schedule
    bar = tqdm(total=t.train_iters, initial=start.iteration, desc="training", unit="it", dynamic_ncols=True,
               disable=not (main and t.progress_bar), file=sys.stderr)
    exit_reason = None
    iteration = start.iteration
    window_start, window_iters, window_wait = time.perf_counter(), 0, 0.0
    compile_done = None
    pending = None  # the previous step's metrics, checked after the next step is dispatched
    last_train_loss = None
    last_valid = first_valid

    def check(iteration, metrics):
        if t.check_for_nan_in_loss_and_grad and not bool(metrics["finite"]):
            raise TrainingStopped(
                f"iteration {iteration}: loss {float(metrics['lm_loss'])} or gradient norm "
                f"{float(metrics['grad_norm'])} is NaN/Inf; stopping "
                "(--no-check-for-nan-in-loss-and-grad to go on regardless)")

    try:
        for iteration in range(start.iteration + 1, t.train_iters + 1):
            inst.before_step(iteration)
            batch, wait = next(loader)
            window_wait += wait
            inst.add("data_wait", wait)
            with inst.step_annotation(iteration):
                state, metrics = pz.train_step(state, batch, jax.random.fold_in(seed_key, iteration))
            if pending is not None:
                check(*pending)
                slow = inst.step_finished(*pending)
                if slow is not None:
                    logger.log(slow, console=slow_iteration_line(slow))
            pending = (iteration, metrics)
            if compile_done is None:
                jax.block_until_ready(metrics)
                compile_done = time.perf_counter() - window_start
                log(f"> first step (compile + run) took {compile_done:.1f} s")
                if not device_memory():
                    step_mem = step_memory(pz.train_step, state, batch, jax.random.fold_in(seed_key, iteration))
                    if step_mem:
                        log("> step memory per device (XLA memory analysis; these devices report no live "
                            f"memory): {step_mem['compiled_total_bytes'] / 2**20:.1f} MiB = arguments "
                            f"{step_mem.get('compiled_argument_bytes', 0) / 2**20:.1f} + outputs "
                            f"{step_mem.get('compiled_output_bytes', 0) / 2**20:.1f} - donated "
                            f"{step_mem.get('compiled_alias_bytes', 0) / 2**20:.1f} + temporaries "
                            f"{step_mem.get('compiled_temp_bytes', 0) / 2**20:.1f}")
                window_start, window_iters, window_wait = time.perf_counter(), 0, 0.0
                inst.reset()
            else:
                window_iters += 1
            bar.update(1)
            if iteration % t.log_interval == 0 or iteration == t.train_iters:
                check(iteration, metrics)
                loss = float(metrics["lm_loss"])
                last_train_loss = loss
                elapsed = time.perf_counter() - window_start
                # The first step's window holds no finished iteration: report its own time.
                step_s = elapsed / window_iters if window_iters else compile_done
                tps = tokens_per_iter / step_s
                mfu = tps * flops_causal / world / peak
                record = {
                    "iteration": iteration, "consumed_samples": iteration * t.global_batch_size,
                    "lm_loss": loss, "lr": float(metrics["lr"]), "grad_norm": float(metrics["grad_norm"]),
                    "tokens_per_sec": tps, "step_time_ms": 1000 * step_s,
                    "data_wait_ms": 1000 * window_wait / max(window_iters, 1),
                    "mfu": mfu, "mfu_megatron_full_attention": tps * flops_full / world / peak,
                    "mfu_peak_source": peak_source, **device_memory(), **step_mem, **inst.window(),
                }
                memory = device_memory()
                logger.log(record, console=(
                    f" iteration {iteration:8d}/{t.train_iters:8d} | consumed samples: "
                    f"{iteration * t.global_batch_size:12d} | elapsed time per iteration (ms): "
                    f"{1000 * step_s:.1f} | learning rate: {record['lr']:.6E} | global batch size: "
                    f"{t.global_batch_size:5d} | lm loss: {loss:.6E} | grad norm: {record['grad_norm']:.3f} | "
                    f"tokens/s: {tps:,.0f} | MFU (causal): {100 * mfu:.1f}% | MFU (Megatron, full attention): "
                    f"{100 * record['mfu_megatron_full_attention']:.1f}% | data wait (ms): "
                    f"{record['data_wait_ms']:.1f} |"
                    + (f" checkpoint (ms): {record['checkpoint_ms']:.1f} |" if record.get("checkpoint_ms", 0) >= 1 else "")
                    + (f" slowest iteration (ms): {record['max_iteration_ms']:.1f} |" if "max_iteration_ms" in record else "")
                    + (f" memory (GiB): {memory['bytes_in_use'] / 2**30:.2f} in use, "
                       f"{memory.get('peak_bytes_in_use', 0) / 2**30:.2f} peak |" if "bytes_in_use" in memory else "")))
                bar.set_postfix(loss=f"{loss:.3f}")
                window_start, window_iters, window_wait = time.perf_counter(), 0, 0.0
            if iteration % t.eval_interval == 0 and iteration != t.train_iters:
                with inst.timed("eval"):
                    last_valid = evaluate(iteration)
            consumed = start.consumed_samples + (iteration - start.iteration) * t.global_batch_size
            with inst.timed("checkpoint"):
                exit_reason = saver.step_done(iteration, state, consumed, jax.random.key_data(seed_key))
            inst.after_step(iteration, metrics, last=bool(exit_reason) or iteration == t.train_iters)
            if exit_reason:
                log(f"> exiting at iteration {iteration}: {exit_reason}")
                break
        if pending is not None:
            check(*pending)
        if exit_reason is None:
            last_valid = evaluate(t.train_iters)
        saver.finish(iteration, state, start.consumed_samples
                     + (iteration - start.iteration) * t.global_batch_size, jax.random.key_data(seed_key))
    finally:
        inst.close()
        saver.close()
        bar.close()
        loader.close()
        if valid_loader is not None:
            valid_loader.close()
        logger.close()

    sample = None
    if t.sample_tokens > 0 and tokenizer is not None and data.valid is not None and exit_reason is None:
        # Prompt with the start of a held-out sample: real context, not a made-up string.
        prompt = [int(i) for i in data.valid[0][: max(8, t.seq_length // 4)]]
        ids = greedy(pz.graphdef, state["params"], prompt, t.sample_tokens, t.seq_length)
        try:
            prompt_text, new_text = tokenizer.detokenize(prompt), tokenizer.detokenize(ids)
        except Exception:  # a tokenizer without text (NullTokenizer) has nothing to show
            prompt_text = new_text = None
        if new_text is not None:
            sample = {"prompt": prompt_text, "continuation": new_text}
            log(f"> greedy sample, prompt:\n{prompt_text}\n> continuation:\n{new_text}")
    summary = {"run_dir": run_dir, "first_valid_loss": first_valid, "final_valid_loss": last_valid,
               "final_train_loss": last_train_loss, "iterations": t.train_iters,
               "parameters": n_params, "sample": sample, "exit_reason": exit_reason,
               "last_iteration": iteration, "resumed_from": start.resumed_from,
               "checkpoints": saver.saved_paths}
    if main:
        with open(os.path.join(run_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2)
    log(f"> done: validation loss {first_valid} -> {last_valid}; run folder {run_dir}")
    return summary


def use_every_cpu_core() -> None:
    """One XLA CPU device per core, unless the user chose: a single CPU device runs on about one
    core, so the default run would otherwise leave the rest idle. GPUs are unaffected."""
    import jax

    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags and os.environ.get("MLM_JAX_CPU_DEVICES") != "1":
        jax.config.update("jax_num_cpu_devices", max(1, os.cpu_count() or 1))


@cli
def main(argv=None) -> int:
    cfg = parse_args(argv)
    use_every_cpu_core()
    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
