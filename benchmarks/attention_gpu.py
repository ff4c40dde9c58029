"""XLA vs cuDNN attention on an NVIDIA GPU: outputs and gradients compared in bf16, both timed.

Runs `mlm_jax.models.attention.attention` with backend XLA and CUDNN on the same bf16 causal
GQA inputs, for each sequence length: the max-abs difference of the outputs and of the three
input gradients (each over the largest magnitude of the XLA side), both against an fp32 XLA
reference, and the median time of forward and forward+backward. Prints a table, writes JSON.

    python benchmarks/attention_gpu.py [--seqs 2048,8192] [--batch 1] [--heads 32] [--groups 8]
                                       [--head-dim 128] [--steps 20] [--out runs/benchmarks]

Needs an NVIDIA GPU (exits 2 saying so elsewhere). Figures belong in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from mlm_jax.models.attention import CUDNN, XLA, attention, on_nvidia_gpu


def inputs(batch: int, seq: int, heads: int, groups: int, head_dim: int, seed: int = 0):
    """bf16 q [b, s, h, k], k and v [b, s, g, k], unit-scale normals."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, seq, heads, head_dim), jnp.float32)
    k = jax.random.normal(kk, (batch, seq, groups, head_dim), jnp.float32)
    v = jax.random.normal(kv, (batch, seq, groups, head_dim), jnp.float32)
    return tuple(x.astype(jnp.bfloat16) for x in (q, k, v))


def fns(backend: str):
    """(forward, forward+backward) jitted for one backend; the loss is a fixed projection of
    the output, so every gradient entry is exercised."""

    def forward(q, k, v):
        return attention(q, k, v, backend=backend)

    def loss(q, k, v, w):
        return jnp.sum(forward(q, k, v).astype(jnp.float32) * w)

    return jax.jit(forward), jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def timed(fn, *args, steps: int) -> float:
    """Median seconds of `steps` calls after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def rel_err(ref, got) -> float:
    ref, got = np.asarray(ref, np.float32), np.asarray(got, np.float32)
    return float(np.max(np.abs(ref - got)) / max(np.max(np.abs(ref)), 1e-30))


def compare(seq: int, batch: int, heads: int, groups: int, head_dim: int, steps: int) -> dict:
    """One sequence length: errors of XLA-bf16 and cuDNN-bf16 against XLA-fp32, and timings."""
    q, k, v = inputs(batch, seq, heads, groups, head_dim)
    w = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)
    ref_fwd, ref_grad = fns(XLA)
    _, (ref_g) = ref_grad(*(x.astype(jnp.float32) for x in (q, k, v)), w)
    ref_out = ref_fwd(*(x.astype(jnp.float32) for x in (q, k, v)))
    row: dict = {"seq": seq, "batch": batch, "heads": heads, "groups": groups, "head_dim": head_dim}
    for name in (XLA, CUDNN):
        fwd, grad = fns(name)
        out = fwd(q, k, v)
        _, g = grad(q, k, v, w)
        row[f"{name}_out_err"] = rel_err(ref_out, out)
        row[f"{name}_grad_err"] = max(rel_err(r, x) for r, x in zip(ref_g, g))
        row[f"{name}_fwd_ms"] = 1e3 * timed(fwd, q, k, v, steps=steps)
        row[f"{name}_fwd_bwd_ms"] = 1e3 * timed(grad, q, k, v, w, steps=steps)
    out_x, out_c = fns(XLA)[0](q, k, v), fns(CUDNN)[0](q, k, v)
    row["xla_vs_cudnn_out_err"] = rel_err(out_x, out_c)
    g_x, g_c = fns(XLA)[1](q, k, v, w)[1], fns(CUDNN)[1](q, k, v, w)[1]
    row["xla_vs_cudnn_grad_err"] = max(rel_err(a, b) for a, b in zip(g_x, g_c))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="2048,8192")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default="runs/benchmarks")
    args = ap.parse_args(argv)
    if not on_nvidia_gpu():
        print(f"attention_gpu.py needs an NVIDIA GPU (cuDNN); this is {jax.devices()[0].platform}",
              file=sys.stderr)
        return 2
    rows = [compare(int(s), args.batch, args.heads, args.groups, args.head_dim, args.steps)
            for s in args.seqs.split(",")]
    print(f"{jax.devices()[0].device_kind}, bf16, causal, GQA {args.heads}/{args.groups}, head dim {args.head_dim}")
    print(f"{'seq':>6} {'backend':>7} {'out err':>9} {'grad err':>9} {'fwd ms':>8} {'fwd+bwd ms':>11}")
    for r in rows:
        for name in (XLA, CUDNN):
            print(f"{r['seq']:>6} {name:>7} {r[f'{name}_out_err']:>9.2e} {r[f'{name}_grad_err']:>9.2e} "
                  f"{r[f'{name}_fwd_ms']:>8.2f} {r[f'{name}_fwd_bwd_ms']:>11.2f}")
        print(f"{r['seq']:>6} xla vs cudnn: out {r['xla_vs_cudnn_out_err']:.2e}, "
              f"grads {r['xla_vs_cudnn_grad_err']:.2e}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "attention_gpu.json")
    with open(path, "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "rows": rows}, f, indent=2)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
