"""Mixture of experts: tokens/s of a small MoE GPT train step against the number of experts E
and the top-k K, and the share of the step spent in the token dispatch and combine.

The dispatch/combine share: the MoE layer's dispatch_and_combine (forward + backward) is timed
alone on one layer's activations, and so is the grouped expert computation it contains
(expert_ffn on the same number of rows, no collectives); their difference, times the MoE layers,
over the step time. An estimate (XLA overlaps and fuses differently inside the whole step), not
a profile.

    python benchmarks/moe.py [--experts 4,8,16] [--topk 1,2,4] [--ep 4] [--steps 5] [--out runs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from mlm_jax.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from mlm_jax.metrics import active_params, flops_per_token, time_train_steps
from mlm_jax.models.moe import expert_ffn
from mlm_jax.parallel.experts import dispatch_and_combine
from mlm_jax.parallel import tracing
from mlm_jax.build import parallelize
from mlm_jax.sharding import make_mesh
from mlm_jax.validation import finalize


def _median_time(fn, *args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _batch(pz, vocab: int, seq: int):
    shape = pz.batch_shape()
    toks = np.random.default_rng(0).integers(0, vocab, shape).astype(np.int32)
    host = {"tokens": toks, "labels": np.roll(toks, -1, -1), "loss_mask": np.ones(shape, np.float32),
            "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int32), shape).copy()}
    return {k: jax.device_put(v, pz.batch_sharding()) for k, v in host.items()}


def step_time(cfg: Config, steps: int) -> tuple[float, object]:
    pz = parallelize(cfg, make_mesh(cfg.parallel))
    state = pz.init(0)
    batch = _batch(pz, cfg.model.vocab_size, cfg.train.seq_length)
    step_fn = pz.train_step.lower(state, batch, jax.random.key(0)).compile()
    times, state = time_train_steps(step_fn, state, batch, steps)
    return float(np.median(times)), pz


def dispatch_time(cfg: Config, pz, reps: int) -> tuple[float, float]:
    """(dispatch_and_combine fwd+bwd, expert compute alone fwd+bwd) on one layer's tokens, s."""
    m = cfg.model
    micro_rows = pz.batch_shape()[1]
    b, s, d, f, E, K = micro_rows, cfg.train.seq_length, m.hidden_size, m.moe_ffn_size, m.num_experts, m.moe_router_topk
    rng = np.random.default_rng(1)
    y = jnp.asarray(rng.normal(size=(b, s, d)), jnp.float32)
    experts = jnp.asarray(np.argsort(rng.random((b, s, E)), -1)[..., :K], jnp.int32)
    weights = jnp.full((b, s, K), 1.0 / K, jnp.float32)
    w1 = jnp.asarray(rng.normal(size=(E, d, 2, f)) * 0.02, jnp.float32)
    w2 = jnp.asarray(rng.normal(size=(E, f, d)) * 0.02, jnp.float32)

    def full(y, w1, w2):
        return jnp.sum(dispatch_and_combine(m, y, experts, weights, w1, w2, None) ** 2)

    with tracing(pz.mesh, pz.rules):
        t_full = _median_time(jax.jit(jax.grad(full, argnums=(0, 1, 2))), y, w1, w2, reps=reps)
    # The expert compute one device does: its share of the rows, its share of the experts.
    ep = cfg.parallel.expert_model_parallel_size
    rows = b * s * K // (pz.mesh.size // cfg.parallel.tensor_model_parallel_size) * ep
    x_r = jnp.asarray(rng.normal(size=(rows, d)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, E // ep, rows), jnp.int32)
    local = lambda x, a, c: jnp.sum(expert_ffn(m, x, ids, a, c, None, None) ** 2)  # noqa: E731
    t_expert = _median_time(jax.jit(jax.grad(local, argnums=(0, 1, 2))), x_r, w1[: E // ep], w2[: E // ep], reps=reps)
    return t_full, t_expert


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", default="4,8,16")
    ap.add_argument("--topk", default="1,2,4")
    ap.add_argument("--ep", type=int, default=4)
    ap.add_argument("--dispatcher", default="alltoall")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--out", default="runs/benchmarks")
    args = ap.parse_args()
    n = jax.device_count()
    rows = []
    print(f"{n} x {jax.devices()[0].platform}, ep={args.ep}, dispatcher {args.dispatcher}")
    print("| E | K | step ms | tokens/s | active / total params | dispatch+combine share |")
    print("|---|---|---|---|---|---|")
    for E in map(int, args.experts.split(",")):
        for K in map(int, args.topk.split(",")):
            if K > E:
                continue
            model = ModelConfig(num_layers=2, hidden_size=128, num_attention_heads=4, vocab_size=2048,
                                max_position_embeddings=args.seq, swiglu=True, num_experts=E, moe_router_topk=K,
                                moe_ffn_hidden_size=256, add_bias_linear=False, moe_aux_loss_coeff=0.01,
                                moe_token_dispatcher_type=args.dispatcher, hidden_dropout=0.0,
                                attention_dropout=0.0)
            cfg = finalize(Config(model=model, parallel=ParallelConfig(expert_model_parallel_size=args.ep),
                                  optim=OptimConfig(lr_warmup_iters=0),
                                  train=TrainConfig(micro_batch_size=2, seq_length=args.seq, train_iters=10)), n)
            step, pz = step_time(cfg, args.steps)
            t_full, t_expert = dispatch_time(cfg, pz, args.steps)
            share = max(t_full - t_expert, 0.0) * model.num_layers / step
            tokens = cfg.train.global_batch_size * args.seq
            total = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(pz.shapes))
            row = {"experts": E, "topk": K, "ep": args.ep, "step_s": step, "tokens_per_s": tokens / step,
                   "active_params": active_params(model), "total_params": total,
                   "flops_per_token": flops_per_token(model, args.seq), "dispatch_share": share,
                   "dispatch_combine_s": t_full, "expert_compute_s": t_expert}
            rows.append(row)
            print(f"| {E} | {K} | {step * 1e3:.1f} | {tokens / step:,.0f} | "
                  f"{row['active_params'] / 1e6:.2f} M / {total / 1e6:.2f} M | {share:.0%} |", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "moe.json"), "w") as f:
        json.dump({"devices": n, "platform": jax.devices()[0].platform, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
