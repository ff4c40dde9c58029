"""What a run reports: model FLOPs, the measured matmul peak, console / JSON / TensorBoard logs."""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from mlm_jax.config import ModelConfig


def flops_per_token(m: ModelConfig, seq_length: int, causal: bool = True) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), recomputation excluded.

    Matmuls: 2 FLOPs per weight per token (q/k/v/o, MLP, LM head; not the embedding lookup).
    Attention scores and the weighted sum: 2 x 2 x seq x (heads x head_dim) per token per layer
    under Megatron's convention (`causal=False`, the full square); the causal mask halves it.
    Mixture-of-experts layers count their *active* parameters: the router, the top-k experts a
    token goes through and the shared expert (not all E experts).
    """
    d, h, g, k, f = m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim, m.ffn_size
    attn_weights = d * (h + 2 * g) * k + h * k * d
    per_ffn = d * (3 if m.swiglu else 2)  # weights per hidden unit of an MLP
    mlp = [d * f * (3 if m.swiglu else 2) if not m.is_moe_layer(i) else
           d * m.num_experts + per_ffn * (m.moe_router_topk * m.moe_ffn_size
                                          + (m.moe_shared_expert_intermediate_size or 0))
           for i in range(m.num_layers)]
    forward = 2.0 * (m.num_layers * attn_weights + sum(mlp) + d * m.vocab)
    attention = 4.0 * seq_length * h * k * m.num_layers
    forward += attention / 2 if causal else attention
    return 3.0 * forward


def active_params(m: ModelConfig) -> int | None:
    """Parameters one token goes through (top-k of each MoE layer's experts): the count FLOPs and
    MFU use. None for a dense model (every parameter is active)."""
    if not m.num_experts:
        return None
    d, h, g, k = m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim
    per_ffn = d * (3 if m.swiglu else 2)
    total = d * m.vocab * (2 if m.untie_embeddings_and_output_weights else 1)
    for i in range(m.num_layers):
        total += d * (h + 2 * g) * k + h * k * d
        total += (d * m.num_experts + per_ffn * (m.moe_router_topk * m.moe_ffn_size
                                                 + (m.moe_shared_expert_intermediate_size or 0))
                  if m.is_moe_layer(i) else per_ffn * m.ffn_size)
    return total


def measure_matmul_peak(mesh: Mesh, dtype=jnp.float32, n: int = 1024, reps: int = 5) -> float:
    """FLOP/s per device of a large matmul on every device at once (the MFU denominator)."""
    devices = mesh.devices.size
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    a = jax.device_put(jnp.ones((devices, n, n), dtype), sharding)
    f = jax.jit(lambda x: jnp.einsum("bij,bjk->bik", x, x), out_shardings=sharding)
    f(a).block_until_ready()
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 / best


def device_memory() -> dict[str, int]:
    """Bytes in use / peak on the first local device, where the backend reports them."""
    stats = jax.local_devices()[0].memory_stats() or {}
    return {k: int(stats[k]) for k in ("bytes_in_use", "peak_bytes_in_use") if k in stats}


class Logger:
    """Megatron-style console lines, a JSON-lines metrics file, TensorBoard (process 0 only)."""

    def __init__(self, metrics_file: str | None, tensorboard_dir: str | None, write=print):
        self.main = jax.process_index() == 0
        self.write = write
        self.metrics = None
        self.tb = None
        if self.main and metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self.metrics = open(metrics_file, "a", buffering=1)
        if self.main and tensorboard_dir:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(tensorboard_dir)

    def line(self, text: str) -> None:
        if self.main:
            self.write(text)

    def log(self, record: dict[str, Any], console: str | None = None) -> None:
        if not self.main:
            return
        if console:
            self.write(console)
        if self.metrics:
            self.metrics.write(json.dumps(_plain(record)) + "\n")
        if self.tb:
            step = int(record["iteration"])
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self.metrics:
            self.metrics.close()
        if self.tb:
            self.tb.close()


def _plain(record: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, v in record.items():
        if isinstance(v, (np.generic,)):
            v = v.item()
        if isinstance(v, float) and not math.isfinite(v):
            v = str(v)
        out[k] = v
    return out
