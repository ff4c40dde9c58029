"""GPT 125M / 350M / 1.3B in bf16 at seq 2048 on one GPU: tokens/s, MFU, peak memory, the
attention backend and its time, recompute off and on, an fp8 row (hybrid fp8 projections with
delayed scaling; MFU still over the bf16 peak), and beside the measured step the step time
`python -m mlm_jax.plan` estimates from the same compiled program (mlm_jax/plan/step_time.py) with
its executed matmul FLOPs / model FLOPs. One command, no installs:

    python benchmarks/gpu.py                       # all three: recompute off and full, and fp8 (off+fp8)
    python benchmarks/gpu.py --models 1.3b --recompute off,dots --steps 20
    python benchmarks/gpu.py --smoke               # tiny sizes on any backend (CPU): checks the script
    python benchmarks/gpu.py --check-blocks        # only cuDNN's ring-attention blocks against XLA's
    python benchmarks/gpu.py --check-moe           # only the experts' grouped matmul against ragged_dot

Each configuration runs in its own process (a clean peak-memory counter, and one that runs out of
memory does not end the rest), the step exactly as `python -m mlm_jax.train` compiles it
(`parallelize` on a one-device mesh, synthetic tokens like `--mock-data`, no dropout). MFU is
model FLOPs (causal attention halved; Megatron's full-attention count beside it) over the
datasheet dense bf16 peak of the device (`mlm_jax.metrics.DATASHEET_PEAKS`), or a measured
sustained matmul peak where the device is not in that table. The attention time is the
attention call alone (forward + backward at the model's shape, backend as the model picks it),
times the layers. The estimate needs the device's target description (mlm_jax/targets/: H100 SXM,
H200, A100 SXM 80 GB, B200); on any other device, a CPU included, it is skipped with a note.
Writes benchmarks/results/gpu-<time>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

# (layers, hidden, heads): GPT-3 paper sizes.
MODELS = {"125m": (12, 768, 12), "350m": (24, 1024, 16), "1.3b": (24, 2048, 16)}
SMOKE = {"tiny": (2, 64, 4)}


# "+fp8" after a recompute choice: Megatron's Llama-3 fp8 recipe (hybrid fp8 projections, delayed scaling).
FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"]


def flags(name: str, recompute: str, smoke: bool, micro: int) -> list[str]:
    if recompute.endswith("+fp8"):
        return flags(name, recompute[:-len("+fp8")], smoke, micro) + FP8
    layers, hidden, heads = (SMOKE if smoke else MODELS)[name]
    seq, vocab = (128, 512) if smoke else (2048, 50257)
    out = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
           "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--vocab-size", str(vocab),
           "--micro-batch-size", str(micro), "--global-batch-size", str(micro), "--bf16", "--mock-data",
           "--hidden-dropout", "0", "--attention-dropout", "0", "--lr-warmup-iters", "0"]
    return out + ([] if recompute == "off" else ["--recompute-granularity", recompute])


def attention_ms(cfg, micro: int) -> tuple[str, float]:
    """(backend, ms) of one layer's attention call, forward + backward, at the model's shape."""
    import jax
    import jax.numpy as jnp

    from mlm_jax.models.attention import attention, choose_backend

    m, dt = cfg.model, jnp.bfloat16
    backend = choose_backend(m, dt, documents=False, aligned=True, dropout_on=False)
    shape = (micro, cfg.train.seq_length, m.num_attention_heads, m.head_dim)
    q, k, v = (jax.random.normal(jax.random.key(i), shape, dt) for i in range(3))
    f = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attention(q, k, v, backend=backend).astype(jnp.float32)),
                         argnums=(0, 1, 2)))
    jax.block_until_ready(f(q, k, v))
    reps = 10
    t = time.perf_counter()
    for _ in range(reps):
        out = f(q, k, v)
    jax.block_until_ready(out)
    return backend, 1000 * (time.perf_counter() - t) / reps


def estimate(compiled, cfg, mesh) -> dict:
    """The plan's step-time estimate of the compiled step for this device's target (one GPU), or
    a note saying why there is none."""
    import jax

    from mlm_jax.metrics import flops_per_token
    from mlm_jax.plan import step_time
    from mlm_jax.plan.targets import by_device_kind

    kind = jax.devices()[0].device_kind
    target = by_device_kind(kind)
    if target is None:
        return {"estimate_note": f"not applicable: no target description for device {kind!r}"}
    est = step_time.estimate(compiled.as_text(), target, dict(mesh.shape), gpus_per_node=1,
                             grouped_rows=step_time.grouped_rows(cfg))
    model = flops_per_token(cfg.model, cfg.train.seq_length) * cfg.train.global_batch_size * cfg.train.seq_length
    return {"estimated_step_ms": 1000 * est.seconds, "executed_matmul_flops_ratio": est.matmul_flops / model}


def run_one(name: str, recompute: str, smoke: bool, micro: int, steps: int) -> dict:
    """One configuration, in this process: compile, warm up, time `steps` steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mlm_jax.arguments import parse_args
    from mlm_jax.instruments import step_memory
    from mlm_jax.metrics import device_memory, device_peak, flops_per_token
    from mlm_jax.models.build import count_params
    from mlm_jax.build import parallelize
    from mlm_jax.sharding import make_mesh
    from mlm_jax.validation import finalize

    cfg = finalize(parse_args(flags(name, recompute, smoke, micro) + ["--train-iters", str(steps + 2)]), 1)
    mesh = make_mesh(cfg.parallel, jax.devices()[:1])
    pz = parallelize(cfg, mesh)
    state = pz.init(0)
    shape = pz.batch_shape()
    toks = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (shape[0], shape[1], shape[2] + 1))
    host = {"tokens": toks[..., :-1].astype(np.int32), "labels": toks[..., 1:].astype(np.int32),
            "loss_mask": np.ones(shape, np.float32),
            "position_ids": np.broadcast_to(np.arange(shape[2], dtype=np.int32), shape).copy()}
    batch = {k: jax.device_put(v, pz.batch_sharding()) for k, v in host.items()}
    key = jax.random.key(0)
    t = time.perf_counter()
    compiled = pz.train_step.lower(state, batch, key).compile()
    compile_s = time.perf_counter() - t
    for _ in range(2):  # warm-up
        state, metrics = compiled(state, batch, key)
    jax.block_until_ready(metrics)
    t = time.perf_counter()
    for _ in range(steps):  # one step in flight, as the training loop keeps it
        state, metrics = compiled(state, batch, key)
    jax.block_until_ready(metrics)
    step_s = (time.perf_counter() - t) / steps
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    peak, source = device_peak(mesh, jnp.bfloat16)
    tps = tokens / step_s
    mem = device_memory() or step_memory(pz.train_step, state, batch, key)
    backend, attn_ms = attention_ms(cfg, micro)
    return {
        "model": name, "recompute": recompute, "params": count_params(pz.shapes), "seq": cfg.train.seq_length,
        "micro_batch": micro, "steps": steps, "step_ms": 1000 * step_s, "tokens_per_sec": tps,
        "mfu": tps * flops_per_token(cfg.model, cfg.train.seq_length, causal=True) / peak,
        "mfu_megatron_full_attention": tps * flops_per_token(cfg.model, cfg.train.seq_length, causal=False) / peak,
        "peak_flops": peak, "peak_source": source, "compile_s": compile_s,
        "peak_memory_gib": (mem.get("peak_bytes_in_use") or mem.get("compiled_total_bytes", 0)) / 2**30,
        "memory_source": "device peak_bytes_in_use" if "peak_bytes_in_use" in mem else "compiled memory analysis",
        "attention_backend": backend, "attention_ms_per_layer": attn_ms,
        "attention_ms_per_step": attn_ms * cfg.model.num_layers * pz.num_microbatches,
        "lm_loss": float(metrics["lm_loss"]), "device": jax.devices()[0].device_kind,
        **estimate(compiled, cfg, mesh),
    }


def check_fused_blocks(fused: str | None = None) -> dict:
    """cuDNN's block kernels as context parallelism's p2p ring uses them (`block_forward`'s
    output and log-sum-exp, `block_backward` fed the merged ones), against XLA's blocks, bf16:
    the largest difference of each block's output and lse, and of a two-block merge's output and
    gradients against whole attention. Not checkable without an NVIDIA GPU (skipped there).
    `fused`: the backend checked (default cuDNN; XLA against itself checks this function)."""
    import jax
    import jax.numpy as jnp

    from mlm_jax.models.attention import CUDNN, XLA, block_backward, block_forward

    fused = fused or CUDNN
    if fused == CUDNN and jax.devices()[0].platform != "gpu":
        return {"skipped": f"no NVIDIA GPU ({jax.devices()[0].platform})"}
    b, s, h, g, kd = 2, 256, 8, 4, 64
    q, k, v, do = (jax.random.normal(jax.random.key(i), (b, s, n, kd), jnp.bfloat16)
                   for i, n in enumerate((h, g, g, h)))
    err = lambda a, r: float(jnp.max(jnp.abs(a.astype(jnp.float32) - r.astype(jnp.float32))))  # noqa: E731
    out = {}
    for causal in (True, False):
        (o_c, l_c), (o_x, l_x) = (jax.jit(block_forward, static_argnums=(3, 4))(q, k, v, causal, be)
                                  for be in (fused, XLA))
        out[f"{'causal' if causal else 'full'}_out"], out[f"{'causal' if causal else 'full'}_lse"] = err(o_c, o_x), err(l_c, l_x)

    def merged(backend):  # two unmasked key blocks, merged as the ring merges them, and the ring's backward
        halves = [(k[:, :s // 2], v[:, :s // 2]), (k[:, s // 2:], v[:, s // 2:])]
        parts = [block_forward(q, kb, vb, False, backend) for kb, vb in halves]
        lse = jnp.logaddexp(parts[0][1], parts[1][1])
        o = sum(p[0].astype(jnp.float32) * jnp.einsum("bhs->bsh", jnp.exp(p[1] - lse))[..., None] for p in parts)
        o = o.astype(q.dtype)
        grads = [block_backward(q, kb, vb, False, o, lse, do, backend) for kb, vb in halves]
        dq = sum(gr[0].astype(jnp.float32) for gr in grads)
        dk = jnp.concatenate([gr[1] for gr in grads], axis=1)
        return o, dq, dk

    (o_c, dq_c, dk_c), (o_x, dq_x, dk_x) = (jax.jit(merged, static_argnums=0)(be) for be in (fused, XLA))
    out.update(merged_out=err(o_c, o_x), merged_dq=err(dq_c, dq_x), merged_dk=err(dk_c, dk_x))
    out["ok"] = all(val < 0.1 for val in out.values())  # bf16 inputs of unit scale
    return out


def check_grouped_matmul(smoke: bool) -> dict:
    """The experts' grouped matmul kernel (`mlm_jax.kernels.grouped_matmul`, what a MoE step runs
    on NVIDIA GPUs) against XLA's `ragged_dot` (dense over the experts there), value and both
    gradients at Mixtral 8x7B's expert sizes (R = 8192 (token, choice) rows over G = 8 experts,
    uneven, k = 4096, n = 14336, bf16; tiny with --smoke): the time of each, the useful TFLOP/s
    (3 x 2 R k n over the time) and the largest difference of their results."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mlm_jax.kernels.grouped_matmul import PALLAS, XLA, Tiles, grouped_matmul

    R, G, k, n = (64, 4, 32, 48) if smoke else (8192, 8, 4096, 14336)
    tiles = Tiles(tm=16, tk=16, tn=16) if smoke else None
    sizes = np.random.default_rng(0).multinomial(R, np.linspace(0.5, 1.5, G) / G).astype(np.int32)
    x = jax.random.normal(jax.random.key(0), (R, k), jnp.bfloat16)
    w = (jax.random.normal(jax.random.key(1), (G, k, n)) / np.sqrt(k)).astype(jnp.bfloat16)
    out = {"rows": R, "experts": G, "k": k, "n": n, "group_sizes": sizes.tolist()}
    results = {}
    for impl in (PALLAS, XLA):
        f = jax.jit(jax.value_and_grad(
            lambda x, w, impl=impl: jnp.sum(grouped_matmul(x, w, jnp.asarray(sizes), implementation=impl,
                                                           tiles=tiles).astype(jnp.float32) ** 2), argnums=(0, 1)))
        results[impl] = jax.block_until_ready(f(x, w))
        reps = 2 if smoke else 10
        t = time.perf_counter()
        for _ in range(reps):
            r = f(x, w)
        jax.block_until_ready(r)
        ms = 1000 * (time.perf_counter() - t) / reps
        out[f"{impl}_ms"] = ms
        out[f"{impl}_useful_tflops"] = 3 * 2 * R * k * n / (ms / 1000) / 1e12
    (v_p, (dx_p, dw_p)), (v_x, (dx_x, dw_x)) = results[PALLAS], results[XLA]
    rel = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)))  # noqa: E731
                             / (jnp.max(jnp.abs(b.astype(jnp.float32))) + 1e-30))
    out.update(value_rel=abs(float(v_p) - float(v_x)) / abs(float(v_x)), dx_rel=rel(dx_p, dx_x), dw_rel=rel(dw_p, dw_x))
    out["ok"] = max(out["value_rel"], out["dx_rel"], out["dw_rel"]) < 2e-2  # bf16 operands, fp32 accumulation
    return out


def table(rows: list[dict]) -> str:
    out = ["| model | recompute | params | step ms | estimated ms | executed / model FLOPs | tokens/s | MFU | "
           "MFU (Megatron) | peak GiB | attention | attn ms/step | compile s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['model']} | {r['recompute']} | {r['error']} |||||||||||")
            continue
        est = (f"{r['estimated_step_ms']:.1f} | {r['executed_matmul_flops_ratio']:.3f}" if "estimated_step_ms" in r
               else "n/a | n/a")
        out.append(f"| {r['model']} | {r['recompute']} | {r['params'] / 1e6:.0f}M | {r['step_ms']:.1f} | {est} | "
                   f"{r['tokens_per_sec']:,.0f} | {100 * r['mfu']:.1f}% | {100 * r['mfu_megatron_full_attention']:.1f}% | "
                   f"{r['peak_memory_gib']:.2f} | {r['attention_backend']} | {r['attention_ms_per_step']:.1f} | "
                   f"{r['compile_s']:.1f} |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description="GPT 125M/350M/1.3B bf16 throughput and MFU on one GPU")
    ap.add_argument("--models", default=None, help="comma list of " + ", ".join(MODELS))
    ap.add_argument("--recompute", default="off,full,off+fp8",
                    help="comma list: off, full, selective, dots, offload; +fp8 after one: fp8 projections "
                         "(hybrid, delayed scaling)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--budget-s", type=float, default=560, help="skip what would start after this")
    ap.add_argument("--timeout-s", type=float, default=240, help="per configuration")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, any backend: checks the script")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--check-blocks", action="store_true",
                    help="only the cuDNN ring-block check (context parallelism's p2p kernels)")
    ap.add_argument("--check-moe", action="store_true",
                    help="only the experts' grouped matmul kernel against XLA's ragged_dot (time, TFLOP/s, numerics)")
    ap.add_argument("--one", nargs=2, metavar=("MODEL", "RECOMPUTE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    micro = 2 if args.smoke else args.micro_batch_size
    steps = 2 if args.smoke else args.steps
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one[0], args.one[1], args.smoke, micro, steps)), flush=True)
        return 0
    if args.check_blocks:
        print("RESULT " + json.dumps(check_fused_blocks()), flush=True)
        return 0
    if args.check_moe:
        print("RESULT " + json.dumps(check_grouped_matmul(args.smoke)), flush=True)
        return 0
    models = (args.models or ("tiny" if args.smoke else ",".join(MODELS))).split(",")
    start, rows = time.time(), []
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--check-blocks"], capture_output=True,
                          text=True, timeout=args.timeout_s)
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    blocks = json.loads(found[-1][len("RESULT "):]) if found else {"error": (proc.stderr.strip() or "no output")[-300:]}
    print(f"cuDNN ring blocks against XLA's: {blocks}", flush=True)
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--check-moe"] + (["--smoke"] if args.smoke else []),
                          capture_output=True, text=True, timeout=args.timeout_s)
    found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    moe = json.loads(found[-1][len("RESULT "):]) if found else {"error": (proc.stderr.strip() or "no output")[-300:]}
    print(f"MoE grouped matmul against ragged_dot: {moe}", flush=True)
    for name in models:
        for recompute in args.recompute.split(","):
            if time.time() - start > args.budget_s:
                rows.append({"model": name, "recompute": recompute, "error": "skipped: over --budget-s"})
                continue
            cmd = [sys.executable, os.path.abspath(__file__), "--one", name, recompute,
                   "--micro-batch-size", str(micro), "--steps", str(steps)] + (["--smoke"] if args.smoke else [])
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
            except subprocess.TimeoutExpired:
                rows.append({"model": name, "recompute": recompute, "error": f"over {args.timeout_s:.0f} s"})
                continue
            result = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
            if proc.returncode or not result:
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1][:160]
                rows.append({"model": name, "recompute": recompute, "error": f"failed: {last}"})
            else:
                rows.append(json.loads(result[-1][len("RESULT "):]))
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"gpu-{time.strftime('%Y%m%d-%H%M%S')}{'-smoke' if args.smoke else ''}.json")
    with open(path, "w") as f:
        json.dump({"rows": rows, "cudnn_ring_blocks": blocks, "moe_grouped_matmul": moe, "wall_s": time.time() - start},
                  f, indent=2)
    print(table(rows))
    print(f"wrote {path} ({time.time() - start:.0f} s)")
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
