"""Tokens/s, step time and MFU of a small GPT train step on the present devices.

MFU = model FLOPs/s per device (causal attention halved; Megatron's full-attention figure too)
over the matmul peak measured in this same run. Prints a table; writes JSON.

    python benchmarks/throughput.py [--steps 10] [--layouts dp,tp,dp_tp_sp] [--out runs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np

from mlm_jax.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from mlm_jax.metrics import flops_per_token, measure_matmul_peak, time_train_steps
from mlm_jax.build import parallelize
from mlm_jax.sharding import make_mesh
from mlm_jax.validation import finalize


def layouts(n: int) -> dict[str, ParallelConfig]:
    out = {"dp": ParallelConfig(), "dp_zero": ParallelConfig(use_distributed_optimizer=True)}
    if n % 2 == 0 and n > 1:
        out["tp2"] = ParallelConfig(tensor_model_parallel_size=2)
        out["tp2_sp_zero"] = ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True,
                                            use_distributed_optimizer=True)
    return out


def bench(parallel: ParallelConfig, model: ModelConfig, seq: int, micro: int, steps: int, peak: float):
    n = jax.device_count()
    cfg = finalize(Config(model=model, parallel=parallel, optim=OptimConfig(lr_warmup_iters=0),
                          train=TrainConfig(micro_batch_size=micro, seq_length=seq, train_iters=steps)), n)
    pz = parallelize(cfg, make_mesh(cfg.parallel))
    state = pz.init(0)
    shape = pz.batch_shape()
    rng = np.random.default_rng(0)
    toks = rng.integers(0, model.vocab_size, shape).astype(np.int32)
    host = {"tokens": toks, "labels": np.roll(toks, -1, -1), "loss_mask": np.ones(shape, np.float32),
            "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int32), shape).copy()}
    batch = {k: jax.device_put(v, pz.batch_sharding()) for k, v in host.items()}
    t = time.perf_counter()
    step_fn = pz.train_step.lower(state, batch, jax.random.key(0)).compile()
    compile_s = time.perf_counter() - t
    memory = step_fn.memory_analysis()
    times, state = time_train_steps(step_fn, state, batch, steps)
    step = float(np.median(times))
    tokens = cfg.train.global_batch_size * seq
    tps = tokens / step
    return {
        "mesh": {k: int(v) for k, v in pz.mesh.shape.items()},
        "global_batch": cfg.train.global_batch_size, "seq": seq,
        "compile_s": compile_s, "step_time_ms": 1000 * step, "tokens_per_sec": tps,
        # Per device, from the compiled program: arguments are the train state (+ the batch).
        "argument_bytes_per_device": int(memory.argument_size_in_bytes),
        "temp_bytes_per_device": int(memory.temp_size_in_bytes),
        "mfu": tps * flops_per_token(cfg.model, seq, causal=True) / n / peak,
        "mfu_megatron_full_attention": tps * flops_per_token(cfg.model, seq, causal=False) / n / peak,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--out", default="runs/benchmarks")
    args = ap.parse_args()

    model = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=8192,
                        max_position_embeddings=args.seq, hidden_dropout=0.0, attention_dropout=0.0,
                        bf16=args.bf16)
    mesh = make_mesh(ParallelConfig())
    dtype = jax.numpy.bfloat16 if args.bf16 else jax.numpy.float32
    # The VM's speed drifts: the best of a measurement before and one after the runs is the peak.
    peak = measure_matmul_peak(mesh, dtype, reps=10)
    device = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    print(f"devices: {device}; measured {'bf16' if args.bf16 else 'fp32'} matmul peak "
          f"{peak / 1e9:.1f} GFLOP/s per device")
    results = {}
    print(f"{'layout':14s} {'step ms':>9s} {'tokens/s':>10s} {'MFU':>7s} {'MFU(full)':>9s} "
          f"{'compile s':>9s} {'state MB/dev':>12s} {'temp MB/dev':>11s}")
    for name, parallel in layouts(jax.device_count()).items():
        r = bench(parallel, model, args.seq, args.micro, args.steps, peak)
        results[name] = r
        print(f"{name:14s} {r['step_time_ms']:9.1f} {r['tokens_per_sec']:10.0f} {100 * r['mfu']:6.1f}% "
              f"{100 * r['mfu_megatron_full_attention']:8.1f}% {r['compile_s']:9.1f} "
              f"{r['argument_bytes_per_device'] / 1e6:12.2f} {r['temp_bytes_per_device'] / 1e6:11.2f}")
    after = measure_matmul_peak(mesh, dtype, reps=10)
    if after > peak:
        for r in results.values():
            r["mfu"] *= peak / after
            r["mfu_megatron_full_attention"] *= peak / after
        print(f"peak re-measured after the runs: {after / 1e9:.1f} GFLOP/s per device; MFU above "
              f"is against the first figure, x{peak / after:.2f} against this one (in the JSON)")
        peak = after
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "throughput.json")
    with open(path, "w") as f:
        json.dump({"device": device, "peak_flops_per_device": peak, "model": "4L d256 h8 V8192",
                   "dtype": str(dtype.dtype if hasattr(dtype, 'dtype') else dtype), "results": results}, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
