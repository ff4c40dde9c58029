"""Workload W on this machine: `python -m mlm_jax.train` against a plain `jax.jit` train step of
the same model, one device, fp32.

W: 4 layers, hidden 256, 8 heads, ffn 1024, vocab 8192, seq 256, batch 8, AdamW, no dropout.
The plain step is the least a JAX program can do for W: the same GPT module's loss, optax's
AdamW, one jit with donated state, one fixed batch already on the device, no microbatch loop,
no logging. The CLI run adds everything a real run has (data loading, the step loop with one
step in flight, --log-interval 1 logging every step, metrics file, TensorBoard). Variants of the
plain step measure what XLA allows beyond it (layers unrolled instead of scanned).

    python benchmarks/workload_w.py [--steps 20] [--variants plain,unrolled] [--no-cli]
        [--torch-python /tmp/torchvenv/bin/python]   # + benchmarks/torch_reference.py's figures

Prints a table (tokens/s, ratio CLI / plain) and writes JSON under benchmarks/results/.
Run it with nothing else on the machine; the load average is printed beside the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("MLM_JAX_CPU_DEVICES", "1")

W_FLAGS = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
           "--ffn-hidden-size", "1024", "--vocab-size", "8192", "--seq-length", "256",
           "--max-position-embeddings", "256", "--micro-batch-size", "8", "--global-batch-size", "8",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--mock-data", "--lr-warmup-iters", "0"]


def plain_step_tps(steps: int, unrolled: bool) -> float:
    """Tokens/s of a plain jitted step of W: the median of `steps` timed steps after warm-up."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from mlm_jax.arguments import parse_args
    from mlm_jax.models import recompute
    from mlm_jax.models.gpt import GPT
    from mlm_jax.optim import apply_lr, lr_for, make_optimizer
    from mlm_jax.validation import finalize

    cfg = finalize(parse_args(W_FLAGS + ["--train-iters", str(steps + 2)]), 1)
    with nnx.use_eager_sharding(False):
        graphdef, params = nnx.split(GPT(cfg.model, nnx.Rngs(0)))
    params = nnx.to_pure_dict(params)
    tx = make_optimizer(cfg.optim)
    rng = np.random.default_rng(0)
    toks = rng.integers(0, cfg.model.vocab_size, (8, 257)).astype(np.int32)
    batch = {"tokens": jnp.asarray(toks[:, :-1]), "labels": jnp.asarray(toks[:, 1:]),
             "loss_mask": jnp.ones((8, 256), jnp.float32),
             "position_ids": jnp.broadcast_to(jnp.arange(256, dtype=jnp.int32), (8, 256))}
    scan = jax.lax.scan
    if unrolled:  # the layer scan fully unrolled: one straight-line program of 4 layers
        recompute.jax.lax.scan = lambda f, init, xs, **kw: scan(f, init, xs, unroll=True, **kw)

    def loss_fn(p, b):
        loss_sum, _ = nnx.merge(graphdef, p).loss(b, None)
        return loss_sum / jnp.sum(b["loss_mask"])

    def step(p, o, n, b):  # n: the LR scheduler's sample count, as in the train state
        loss, g = jax.value_and_grad(loss_fn)(p, b)
        updates, o = tx.update(g, o, p)
        updates = apply_lr(updates, lr_for(cfg, n))
        return jax.tree.map(jnp.add, p, updates), o, n + 8, loss

    try:
        step = jax.jit(step, donate_argnums=(0, 1))
        opt, n = tx.init(params), jnp.zeros((), jnp.int32)
        params, opt, n, loss = step(params, opt, n, batch)
        jax.block_until_ready(loss)
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            params, opt, n, loss = step(params, opt, n, batch)
            jax.block_until_ready(loss)
            times.append(time.perf_counter() - t)
    finally:
        recompute.jax.lax.scan = scan
    return 8 * 256 / statistics.median(times)


def cli_tps(steps: int) -> tuple[float, list[float]]:
    """Tokens/s of `python -m mlm_jax.train` for W with --log-interval 1: the median of the
    logged iterations after the first two (the metrics file's tokens_per_sec)."""
    with tempfile.TemporaryDirectory() as tmp:
        argv = [sys.executable, "-m", "mlm_jax.train", *W_FLAGS, "--train-iters", str(steps + 2),
                "--log-interval", "1", "--eval-interval", "100000", "--eval-iters", "1",
                "--sample-tokens", "0", "--no-progress-bar", "--run-dir", os.path.join(tmp, "run"),
                "--peak-flops-per-device", "1e11"]
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        records = [json.loads(line) for line in open(os.path.join(tmp, "run", "metrics.jsonl"))]
    tps = [r["tokens_per_sec"] for r in records if "tokens_per_sec" in r][2:]
    return statistics.median(tps), tps


def torch_tps(python: str, steps: int, compiled: bool) -> float:
    """Tokens/s of `benchmarks/torch_reference.py` (nanoGPT-style W step) under `python`."""
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_reference.py")
    argv = [python, script, "--steps", str(steps)] + ([] if compiled else ["--no-compile"])
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--variants", default="plain,unrolled")
    ap.add_argument("--no-cli", action="store_true")
    ap.add_argument("--torch-python", help="a Python with torch: also run benchmarks/torch_reference.py "
                    "(torch.compile and eager) for the ratio")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    rows = {}
    load = [os.getloadavg()[0]]
    for v in args.variants.split(","):
        rows[f"plain jax.jit step ({'layers unrolled' if v == 'unrolled' else 'layer scan'})"] = \
            plain_step_tps(args.steps, v == "unrolled")
        load.append(os.getloadavg()[0])
    if not args.no_cli:
        rows["python -m mlm_jax.train --log-interval 1"], _ = cli_tps(args.steps)
        load.append(os.getloadavg()[0])
    if args.torch_python:
        for compiled in (True, False):
            rows[f"nanoGPT-style PyTorch step ({'torch.compile' if compiled else 'eager'})"] = \
                torch_tps(args.torch_python, args.steps, compiled)
            load.append(os.getloadavg()[0])
    base = next(iter(rows.values()))
    print(f"workload W, one CPU device, {args.steps} timed steps each; load average "
          f"{min(load):.1f}-{max(load):.1f} during the runs")
    print("| run | tokens/s | / plain scan step |\n|---|---|---|")
    for name, tps in rows.items():
        print(f"| {name} | {tps:,.0f} | {tps / base:.2f} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "workload_w.json"), "w") as f:
        json.dump({"tokens_per_sec": rows, "load_average": load, "steps": args.steps}, f, indent=2)


if __name__ == "__main__":
    main()
