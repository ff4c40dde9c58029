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
from mlm_jax.paths import naming


def flops_per_token(m: ModelConfig, seq_length: int, causal: bool = True) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), recomputation excluded.

    Matmuls: 2 FLOPs per weight per token (q/k/v/o, MLP, LM head; not the embedding lookup).
    Attention scores and the weighted sum: 2 x seq x heads x (query/key + value head dims) per
    token per layer (4 x seq x heads x head_dim without MLA) under Megatron's convention
    (`causal=False`, the full square); the causal mask halves it.
    Mixture-of-experts layers count their *active* parameters: the router, the top-k experts a
    token goes through and the shared expert (not all E experts). Multi-token prediction depths
    count their layer (the last layer's kind), their projection of [embedding; hidden] and their
    pass through the head.
    """
    d, f = m.hidden_size, m.ffn_size
    attn_weights = m.attention_weights
    per_ffn = d * (3 if m.swiglu else 2)  # weights per hidden unit of an MLP
    mlp = [d * f * (3 if m.swiglu else 2) if not m.is_moe_layer(i) else
           d * m.num_experts + per_ffn * (m.moe_router_topk * m.moe_ffn_size
                                          + (m.moe_shared_expert_intermediate_size or 0))
           for i in range(m.num_layers)]
    layers = m.num_layers + (m.mtp_num_layers or 0)  # MTP depths: a layer of the last layer's kind each
    mlp += [mlp[-1]] * (m.mtp_num_layers or 0)
    heads = 1 + (m.mtp_num_layers or 0)
    forward = 2.0 * (layers * attn_weights + sum(mlp) + heads * d * m.vocab + (m.mtp_num_layers or 0) * 2 * d * d)
    attention = 2.0 * seq_length * m.attention_core_width * layers
    forward += attention / 2 if causal else attention
    return 3.0 * forward


def active_params(m: ModelConfig) -> int | None:
    """Parameters one token goes through (top-k of each MoE layer's experts): the count FLOPs and
    MFU use. None for a dense model (every parameter is active)."""
    if not m.num_experts:
        return None
    d = m.hidden_size
    per_ffn = d * (3 if m.swiglu else 2)
    total = d * m.vocab * (2 if m.untie_embeddings_and_output_weights else 1)
    for i in range(m.num_layers):
        total += m.attention_weights
        total += (d * m.num_experts + per_ffn * (m.moe_router_topk * m.moe_ffn_size
                                                 + (m.moe_shared_expert_intermediate_size or 0))
                  if m.is_moe_layer(i) else per_ffn * m.ffn_size)
    return total


# Datasheet dense peaks per device, FLOP/s (no 2:4 sparsity): (bf16/fp16, fp32 as TF32).
# Matched against `device_kind` by substring, most specific first (H100 PCIe before H100).
DATASHEET_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H100 PCIe", 756e12, 378e12),
    ("H100 NVL", 835e12, 418e12),
    ("H200", 989.4e12, 494.7e12),  # H200 SXM: same Hopper tensor cores as H100 SXM
    ("H100", 989.4e12, 494.7e12),  # H100 SXM5
    ("GH200", 989.4e12, 494.7e12),
    ("B200", 2250e12, 1100e12),
    ("A100", 312e12, 156e12),
)


def datasheet_peak(device_kind: str, dtype) -> float | None:
    """The vendor's dense peak for `device_kind` in `dtype` (fp32 counts as TF32), or None."""
    low = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    for name, half, tf32 in DATASHEET_PEAKS:
        if name.lower() in device_kind.lower():
            return half if low else tf32
    return None


def measure_matmul_peak(mesh: Mesh, dtype=jnp.float32, n: int | None = None, reps: int = 2,
                        chain: int | None = None, min_seconds: float = 0.25) -> float:
    """Sustained FLOP/s per device of large matmuls on every device at once (the MFU
    denominator where no datasheet figure is known).

    One timed call runs `chain` dependent [n, n] @ [n, n] products inside one compiled loop, so
    dispatch and synchronisation (microseconds) are paid once per call, not per matmul; `chain`
    grows until one call takes at least `min_seconds`; the best of `reps` such calls counts. The rule that keeps MFU at or below 1: a model step is
    matmuls of at most this size plus everything else, so it cannot sustain a higher rate than
    this loop of the largest, best-shaped matmul the device runs, timed over a long run.
    """
    devices = mesh.devices.size
    if n is None:
        n = 1024 if jax.devices()[0].platform == "cpu" else 8192
    sharding = NamedSharding(mesh, P(mesh.axis_names))
    # Scaled so that repeated products stay finite in any dtype: x / sqrt(n) keeps unit norm-ish rows.
    a = jax.device_put(jnp.full((devices, n, n), 1.0 / n, dtype), sharding)

    def run(x, steps):
        def body(_, y):
            return jnp.einsum("bij,bjk->bik", y, x)  # [dev, n, n] @ [dev, n, n]

        return jax.lax.fori_loop(0, steps, body, x)

    f = jax.jit(run, static_argnums=1, out_shardings=sharding)
    steps = chain or 1
    while True:
        f(a, steps).block_until_ready()  # compile
        t = time.perf_counter()
        f(a, steps).block_until_ready()
        took = time.perf_counter() - t
        if chain is not None or took >= min_seconds or steps >= 4096:
            break
        steps *= max(2, min(16, int(min_seconds / max(took, 1e-6)) + 1))
    best = took
    for _ in range(reps - 1):
        t = time.perf_counter()
        f(a, steps).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2.0 * n**3 * steps / best


_MEASURED: dict[tuple, float] = {}  # (device ids, dtype) -> measured peak, this process


def device_peak(mesh: Mesh, dtype) -> tuple[float, str]:
    """(FLOP/s per device, source): the datasheet dense figure for a known accelerator, else a
    sustained matmul measurement on this mesh, taken once per process and set of devices (a
    notebook or program that trains several times pays its second or so once)."""
    kind = jax.devices()[0].device_kind
    peak = datasheet_peak(kind, dtype)
    if peak is not None:
        return peak, f"datasheet {kind}"
    key = (tuple(d.id for d in mesh.devices.flat), jnp.dtype(dtype).name)
    if key not in _MEASURED:
        _MEASURED[key] = measure_matmul_peak(mesh, dtype)
    return _MEASURED[key], "measured"


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
            with naming(self.metrics.name):
                self.metrics.write(json.dumps(_plain(record)) + "\n")
        if self.tb:
            step = int(record["iteration"])
            for key, value in record.items():
                if key != "iteration" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.tb.add_scalar(key, value, step)

    def close(self) -> None:
        if self.metrics:
            with naming(self.metrics.name):
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


def time_train_steps(step_fn, state, batch, steps: int):
    """(seconds of each of `steps` calls of a compiled train step after one warm-up call, final
    state): the timing loop of the benchmarks. Each call is waited for, so dispatch is counted."""
    import jax

    state, metrics = step_fn(state, batch, jax.random.key(0))
    jax.block_until_ready(metrics)
    times = []
    for i in range(steps):
        t = time.perf_counter()
        state, metrics = step_fn(state, batch, jax.random.key(i))
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - t)
    return times, state
