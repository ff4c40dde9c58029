"""fp8 matmuls (Megatron's `--fp8-format`, `--fp8-recipe tensorwise`): the layers' projections
(QKV, attention output, both MLP matmuls) multiply fp8 operands, everything else stays in the
compute dtype (bf16).

Per-tensor current scaling (Transformer Engine's Float8CurrentScaling, Megatron's `tensorwise`):
each operand's scale comes from its own amax in this step, `scale = amax x 2^margin / fp8_max`, so
the largest value lands on the format's largest. The forward multiplies e4m3 x e4m3; the backward
quantizes the incoming gradient (e5m2 under `hybrid`, e4m3 under `e4m3`) and multiplies it with the
saved fp8 operands (the input's gradient with the weight, the weight's with the input; with
`--no-fp8-wgrad` the weight's gradient in the compute dtype from the unquantized input). The
product comes out in the compute dtype (fp32 accumulation) and is descaled in fp32: on an H100
(CUDA >= 12) XLA turns that into one cuBLASLt fp8 GEMM.

An amax is that of the whole tensor, whatever the layout: the trace reduces it where the mesh
splits the tensor (GSPMD inserts a max over the split axes), and where the step runs each
data-parallel rank's rows on their own (the trace's `rank_split`) it is a `pmax` over those ranks,
so every rank quantizes with the scale the unsharded model would use (Megatron reduces amaxes over
data, tensor and context parallel ranks the same way, unless `--tp-only-amax-red`). Scales carry
no gradient. A zero or non-finite amax gives scale 1; values past the format's range saturate.

Layers stay in the compute dtype where `--first-last-layers-bf16` says so (`in_bf16`): the layer
scan runs those rows with fp8 switched off (`off`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp

from mlm_jax.config import FP8_FORMATS, FP8_RECIPES, ModelConfig  # noqa: F401 (the names fp8 offers)
from mlm_jax.sharding import trace

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How a projection quantizes: the forward's and the gradient's fp8 types, the margin (powers
    of two of headroom below the format's largest value) and whether the weight's gradient is an
    fp8 product too."""
    forward: object = E4M3
    backward: object = E5M2
    margin: int = 0
    wgrad: bool = True
    # The manual mesh axes over which this program holds only its rank's rows (the trace's
    # `rank_split` where the product is traced; its backward may be traced outside that context).
    rows_over: tuple | None = None


_OFF: list[bool] = []  # innermost last: True while a bf16 layer is traced


@contextlib.contextmanager
def off():
    """Projections traced inside run in the compute dtype (a `--first-last-layers-bf16` layer)."""
    _OFF.append(True)
    try:
        yield
    finally:
        _OFF.pop()


def recipe(cfg: ModelConfig) -> Recipe | None:
    """The fp8 recipe of `cfg`'s projections here; None: they run in the compute dtype."""
    if cfg.fp8_format is None or _OFF:
        return None
    backward = E5M2 if cfg.fp8_format == "hybrid" else E4M3
    return Recipe(E4M3, backward, cfg.fp8_margin, cfg.fp8_wgrad)


def in_bf16(cfg: ModelConfig, layer):
    """Whether layer `layer` (global 0-based index, int or traced) stays in the compute dtype
    (`--first-last-layers-bf16` with `--num-layers-at-start-in-bf16` / `-at-end-in-bf16`)."""
    start, end = bf16_layers(cfg)
    return (layer < start) | (layer >= cfg.num_layers - end)


def per_layer(cfg: ModelConfig, layer, run):
    """`run()` (a layer's forward) as layer `layer` (global index, int or traced) runs it: with
    fp8 projections, or traced under `off` where `--first-last-layers-bf16` keeps it bf16 (a
    conditional in the layer scan: each row runs one of the two)."""
    if bf16_layers(cfg) == (0, 0):
        return run()

    def in_compute_dtype():
        with off():
            return run()

    return jax.lax.cond(in_bf16(cfg, layer), in_compute_dtype, run)


def bf16_layers(cfg: ModelConfig) -> tuple[int, int]:
    """(layers at the start, layers at the end) kept in the compute dtype: (0, 0) without fp8 or
    without `--first-last-layers-bf16`."""
    if cfg.fp8_format is None or not cfg.first_last_layers_bf16:
        return 0, 0
    return cfg.num_layers_at_start_in_bf16, cfg.num_layers_at_end_in_bf16


def amax(x: jax.Array, rows_over=None) -> jax.Array:
    """max |x| over the whole tensor, as fp32; a max over the ranks `rows_over` too (each holding
    its own rows)."""
    m = jnp.max(jnp.abs(x)).astype(jnp.float32)
    if rows_over is not None:
        m = jax.lax.pmax(m, rows_over)
    return jax.lax.stop_gradient(m)


def scale_of(m: jax.Array, dtype, margin: int) -> jax.Array:
    """The dequantizing scale (x ~ q x scale) that maps amax `m` onto `dtype`'s largest value
    over 2^margin; 1 where `m` is zero or not finite."""
    s = m * (2.0 ** margin) / float(jnp.finfo(dtype).max)
    return jnp.where((m > 0) & jnp.isfinite(m), s, jnp.float32(1.0))


def quantize(x: jax.Array, dtype, margin: int, rows_over=None) -> tuple[jax.Array, jax.Array]:
    """(x in `dtype`, its scale), saturating at the format's range; `rows_over` as in `amax`."""
    s = scale_of(amax(x, rows_over), dtype, margin)
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / s, -top, top).astype(dtype), s


def _scaled(spec: str, a, b, scale, dtype):
    """einsum(spec) of fp8 `a` and `b` (fp32 accumulation) in `dtype`, descaled by `scale` in
    fp32. The product itself comes out in `dtype`, as a bf16 step's does: it is what
    `--recompute-granularity dots` keeps (in fp32 it kept twice the bytes: Llama-3 8B's dp8 step
    84.05 GiB against bf16's 61.1)."""
    return (jnp.einsum(spec, a, b, preferred_element_type=dtype).astype(jnp.float32) * scale).astype(dtype)


def here(rec: Recipe) -> Recipe:
    """`rec` with the rows split of the trace in force (`rows_over`)."""
    split = trace.current().rank_split
    return dataclasses.replace(rec, rows_over=None if split is None else tuple(split[0]))


def einsum(spec: str, x: jax.Array, w: jax.Array, rec: Recipe) -> jax.Array:
    """`einsum(spec, x, w)` of a projection (x activations, w its weight; both in the compute
    dtype) with fp8 operands under `rec`; the result in x's dtype."""
    return bound_einsum(spec, x, w, here(rec))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 3))
def bound_einsum(spec, x, w, rec):
    """`einsum` under a recipe already bound to its trace (`here`): for a product whose
    forward is traced again in a backward traced outside the forward's context."""
    return _forward(spec, x, w, rec)[0]


def _forward(spec, x, w, rec):
    xq, sx = quantize(x, rec.forward, rec.margin, rec.rows_over)
    wq, sw = quantize(w, rec.forward, rec.margin)  # every rank holds the same weight
    keep = x if not rec.wgrad else xq  # --no-fp8-wgrad: the weight's gradient from x itself
    return _scaled(spec, xq, wq, sx * sw, x.dtype), (keep, sx, wq, sw)


def _backward(spec, rec, res, dy):
    x_kept, sx, wq, sw = res
    (xs, ws), ys = spec.split("->")[0].split(","), spec.split("->")[1]
    gq, sg = quantize(dy, rec.backward, rec.margin, rec.rows_over)
    dx = _scaled(f"{ys},{ws}->{xs}", gq, wq, sg * sw, dy.dtype)
    if rec.wgrad:
        dw = _scaled(f"{xs},{ys}->{ws}", x_kept, gq, sx * sg, dy.dtype)
    else:
        dw = jnp.einsum(f"{xs},{ys}->{ws}", x_kept, dy)
    return dx, dw


bound_einsum.defvjp(_forward, _backward)
