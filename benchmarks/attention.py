"""Attention forward+backward vs sequence length: each backend and each context-parallel comm type.

Runs the model's attention on fp32 causal GQA inputs [1, s, h, k] (K/V with g groups) and
times jit(grad) of a fixed projection of the output (forward + backward), median of `--steps`
runs after a warm-up; per-device temp memory from the compiled program's memory analysis.
Rows: `xla` (the plain backend, one device: its custom VJP keeps the output and the softmax's
log-normaliser), `xla inputs-only` (autodiff under `jax.checkpoint`: context parallelism's path),
`cudnn` (NVIDIA GPU only), then `cp C p2p|allgather|a2a` on C fake devices (the sequence split
over `context` in the load-balanced chunk order). Prints a markdown table, writes JSON.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/attention.py \\
        [--seqs 1024,2048,4096] [--cp 2,4] [--heads 8] [--groups 4] [--head-dim 32] [--steps 5] [--comm p2p] [--only-cp]

On a CPU the fake devices share the cores: context parallelism shows its memory effect, not a
speed-up (each device does 1/C of the work but the devices run on the same two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from mlm_jax.models.attention import CUDNN, XLA, attention, on_nvidia_gpu
from mlm_jax.parallel.chunks import seq_order
from mlm_jax.parallel.context import COMM_TYPES, context_attention
from mlm_jax.sharding.mesh import AXES, CONTEXT
from mlm_jax.sharding import trace
from mlm_jax.sharding.rules import activation_rules


def inputs(seq, heads, groups, head_dim, dtype=jnp.float32):
    kq, kk, kv, kw = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (1, seq, heads, head_dim), dtype)
    k = jax.random.normal(kk, (1, seq, groups, head_dim), dtype)
    v = jax.random.normal(kv, (1, seq, groups, head_dim), dtype)
    w = jax.random.normal(kw, (1, seq, heads, head_dim), dtype)
    return q, k, v, w


def measure(fn, args, steps):
    """(median seconds of fn(*args), temp bytes per device, compile seconds)."""
    t0 = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), compiled.memory_analysis().temp_size_in_bytes, compile_s


def grad_of(attn):
    def loss(q, k, v, w):
        return jnp.sum(attn(q, k, v).astype(jnp.float32) * w)

    return jax.grad(loss, argnums=(0, 1, 2))


def plain_row(backend, inputs_only, args, steps):
    fn = grad_of(lambda q, k, v: attention(q, k, v, backend=backend, inputs_only=inputs_only))
    return measure(lambda q, k, v, w: fn(q, k, v, w), args, steps)


def cp_row(cp, comm, args, steps):
    devices = np.asarray(jax.devices()[:cp]).reshape(1, 1, 1, cp, 1)
    mesh = Mesh(devices, AXES, axis_types=(AxisType.Auto,) * len(AXES))
    order = seq_order(args[0].shape[1], cp)
    sh = NamedSharding(mesh, P(None, CONTEXT))
    placed = [jax.device_put(x[:, order], sh) for x in args]  # the load-balanced chunk order
    fn = grad_of(lambda q, k, v: context_attention(q, k, v, comm_type=comm))
    with jax.set_mesh(mesh), trace.using(rules=activation_rules(False)):
        return measure(fn, placed, steps)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", default="1024,2048,4096")
    p.add_argument("--cp", default="2,4")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--comm", default=",".join(COMM_TYPES), help="comm types to run")
    p.add_argument("--only-cp", action="store_true", help="skip the one-device rows")
    p.add_argument("--out", default="runs/benchmarks")
    a = p.parse_args()
    rows = []
    cps = [int(c) for c in a.cp.split(",") if int(c) <= jax.device_count()]
    print("| seq | backend | fwd+bwd ms | temp MB/device | compile s |\n|---|---|---|---|---|")
    for seq in [int(s) for s in a.seqs.split(",")]:
        args = inputs(seq, a.heads, a.groups, a.head_dim)
        cases = [] if a.only_cp else [("xla", lambda: plain_row(XLA, False, args, a.steps)),
                                      ("xla inputs-only", lambda: plain_row(XLA, True, args, a.steps))]
        if on_nvidia_gpu() and not a.only_cp:
            bf = tuple(x.astype(jnp.bfloat16) for x in args)
            cases.append(("cudnn", lambda: plain_row(CUDNN, False, bf, a.steps)))
        for cp in cps:
            for comm in a.comm.split(","):
                if comm == "a2a" and (a.heads % cp or a.groups % cp):
                    continue
                cases.append((f"cp{cp} {comm}", lambda cp=cp, comm=comm: cp_row(cp, comm, args, a.steps)))
        for name, run in cases:
            t, temp, comp = run()
            rows.append({"seq": seq, "backend": name, "ms": t * 1e3, "temp_mb": temp / 2**20, "compile_s": comp})
            print(f"| {seq} | {name} | {t * 1e3:.1f} | {temp / 2**20:.1f} | {comp:.1f} |", flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "attention.json"), "w") as f:
        json.dump({"device": jax.devices()[0].platform, "heads": a.heads, "groups": a.groups,
                   "head_dim": a.head_dim, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
