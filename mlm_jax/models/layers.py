"""The small pieces every module of the decoder shares: parameter creation, norms, dropout,
rotary embeddings and the compute dtype. No mesh here: parameters carry logical dim names.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from flax import nnx

from mlm_jax import platform
from mlm_jax.config import ModelConfig
from mlm_jax.models import fp8
from mlm_jax.sharding import trace
from mlm_jax.sharding.mesh import psum, varying, varying_axes, zeros_like_typed
from mlm_jax.sharding.rules import active_rules, constrain, free_axes, logical_to_spec, spec_on_axes, specs_if_split
from mlm_jax.sharding.specs import entry_axes


def compute_dtype(cfg: ModelConfig):
    """The dtype activations and matmul operands use; parameters stay fp32 (master weights)."""
    if cfg.fp16:
        return jnp.float16
    return jnp.bfloat16 if cfg.bf16 else jnp.float32


def normal(std: float):
    return nnx.initializers.normal(stddev=std)


def ones(shape, dtype=jnp.float32):
    return jnp.ones(shape, dtype)


def zeros(shape, dtype=jnp.float32):
    return jnp.zeros(shape, dtype)


def param(rngs: nnx.Rngs | None, init, shape, names) -> nnx.Param:
    """An fp32 parameter whose dims carry the logical `names`; `rngs` None for constant inits."""
    value = init(rngs.params(), shape, jnp.float32) if rngs is not None else init(shape, jnp.float32)
    return nnx.Param(value, out_sharding=tuple(names))


def cast(p: nnx.Param | None, dtype):
    """A parameter's value in the compute dtype (None stays None: an absent bias)."""
    return None if p is None else p[...].astype(dtype)


def value(p: nnx.Param | None):
    """A parameter's value as stored (None stays None: e.g. an fp8 amax history under tensorwise)."""
    return None if p is None else p[...]


def used_in_compute_dtype(path) -> bool:
    """Whether the parameter at `path` (a pytree key path) is only ever read through `cast` to the
    compute dtype (or looked up, then cast): every weight and bias except the norms' (applied in
    fp32) and the MoE router's (fp32 logits). Such a parameter can travel in the compute dtype
    (ZeRO's all-gather in bf16) without changing a single value the model computes."""
    keys = [str(getattr(k, "key", k)) for k in path]
    return not any("norm" in k or k == "router" or k.startswith(fp8.HISTORY) for k in keys)


def add_bias(y, b):
    return y if b is None else y + b


class Norm(nnx.Module):
    """LayerNorm (with bias, as Megatron always has) or RMSNorm; computed in fp32.

    With --apply-layernorm-1p (Megatron's zero-centered gamma) `scale` holds gamma - 1, starts at
    zero and is applied as (1 + scale): weight decay then pulls gamma towards 1, not 0 (norm
    weights are excluded from decay anyway, as in Megatron, so the two give the same function).
    """

    def __init__(self, cfg: ModelConfig, width: int | None = None):
        d = width or cfg.hidden_size  # `width`: another vector's (MLA's latents)
        self.rms = cfg.normalization == "RMSNorm"
        self.eps = cfg.norm_epsilon
        self.one_p = cfg.apply_layernorm_1p
        self.scale = param(None, zeros if self.one_p else ones, (d,), ("embed",))
        self.bias = None if self.rms else param(None, zeros, (d,), ("embed",))

    def __call__(self, x_bsd: jax.Array) -> jax.Array:
        bias = None if self.bias is None else self.bias[...]
        return norm(x_bsd, self.scale[...], bias, self.rms, self.eps, self.one_p)


def _normalized(x: jax.Array, rms: bool, eps: float):
    """(x normalized, mean or None, 1 / std), in fp32: [.., d], [.., 1], [.., 1]."""
    x = x.astype(jnp.float32)
    mean = None if rms else jnp.mean(x, axis=-1, keepdims=True)
    centered = x if rms else x - mean
    rstd = jax.lax.rsqrt(jnp.mean(jnp.square(centered), axis=-1, keepdims=True) + eps)
    return centered * rstd, mean, rstd


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def norm(x_bsd, scale, bias, rms: bool, eps: float, one_p: bool):
    """LayerNorm / RMSNorm of `x_bsd` over its last dim, computed in fp32, returned in its dtype.

    The backward keeps only the input (in its own dtype: the residual stream, kept anyway) and
    each row's mean and 1 / std, and recomputes the normalized rows from them: autodiff of the
    fp32 forward kept fp32 copies of the rows (the upcast input, the centered and the normalized
    rows: 12 bytes per element of every norm's [b, s, d] input in a bf16 step, most of a layer's
    saved activations). Megatron's fused norms keep the same (input, mean, rstd)."""
    return _norm_forward(x_bsd, scale, bias, rms, eps, one_p)[0]


def _norm_forward(x_bsd, scale, bias, rms, eps, one_p):
    xhat, mean, rstd = _normalized(x_bsd, rms, eps)
    gamma = scale.astype(jnp.float32)
    y = xhat * (1.0 + gamma if one_p else gamma)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(x_bsd.dtype), (x_bsd, mean, rstd, scale, bias)


def _like(ct, primal):
    """A custom backward's cotangent typed as its primal input: summed over the manual mesh axes
    it varies over and the input does not (inside a shard_map the input was the same on every
    device of those axes and used by each: the sum autodiff's own transpose takes)."""
    if ct is None:
        return None
    extra = sorted(varying_axes(ct) - varying_axes(primal))
    return psum(ct, tuple(extra)) if extra else ct


def _norm_backward(rms, eps, one_p, res, dy):
    x_bsd, mean, rstd, scale, bias = res
    x = x_bsd.astype(jnp.float32)
    xhat = (x if rms else x - mean) * rstd
    dy = dy.astype(jnp.float32)
    rows = tuple(range(dy.ndim - 1))
    dscale = jnp.sum(dy * xhat, axis=rows).astype(scale.dtype)
    dbias = None if bias is None else jnp.sum(dy, axis=rows).astype(bias.dtype)
    gamma = scale.astype(jnp.float32)
    g = dy * (1.0 + gamma if one_p else gamma)  # d loss / d xhat
    proj = jnp.mean(g * xhat, axis=-1, keepdims=True)
    if rms:
        dx = rstd * (g - xhat * proj)
    else:
        dx = rstd * (g - jnp.mean(g, axis=-1, keepdims=True) - xhat * proj)
    return _like(dx.astype(x_bsd.dtype), x_bsd), _like(dscale, scale), _like(dbias, bias)


norm.defvjp(_norm_forward, _norm_backward)


SEQ_SPLIT = ("batch", "seq", "embed")  # a block boundary: the sequence split over tensor with SP
SEQ_WHOLE = ("batch", "context_seq", "embed")  # inside the tensor-parallel region


def column_parallel(spec: str, y_bsd: jax.Array, w: jax.Array, w_names, out_names,
                    rec: fp8.Recipe | None = None, h: jax.Array | None = None) -> jax.Array:
    """`einsum(spec, y, w)` of a column-parallel matmul (QKV, fc1) whose normed input `y_bsd`
    arrives as a block boundary holds it and is multiplied gathered to the whole sequence;
    `w_names` and `out_names` are the logical dims of the weight and the product.

    With sequence parallelism the backward gathers `y` over tensor again instead of keeping the
    gathered copy from the forward, as Megatron's SP does: a layer keeps the s/t shard of each
    projection's input (Korthikanti et al. 2022, eq. 4), one all-gather more per projection in
    the backward. Autodiff kept the gathered [b, s, d] input of both projections, t times that.
    Without sequence parallelism it is the einsum. With an fp8 recipe `rec` the product (and its
    gradients) multiply fp8 operands (`models/fp8.py`; `h` its amax history under delayed scaling)."""
    specs = specs_if_split(SEQ_SPLIT, SEQ_WHOLE)
    if specs is None:
        return _product(spec, constrain(y_bsd, SEQ_WHOLE), w, rec, h)
    split, whole = specs
    w_spec, out_spec = (logical_to_spec(n, active_rules()) for n in (w_names, out_names))
    y = jax.lax.with_sharding_constraint(y_bsd, split)
    rec = None if rec is None else fp8.here(rec)
    return _pinned_product(spec, (split, whole, w_spec, out_spec, out_spec), rec, y, w, h)


def row_parallel(spec: str, u: jax.Array, w: jax.Array, u_names, w_names,
                 rec: fp8.Recipe | None = None, h: jax.Array | None = None) -> jax.Array:
    """`einsum(spec, u, w)` of a row-parallel matmul (attention's output projection, fc2): its
    partial sums over tensor leave as a block boundary holds them (a reduce-scatter under
    sequence parallelism, an all-reduce without); `u_names`, `w_names` the logical dims of the
    input and the weight.

    Under sequence parallelism the backward gathers the incoming gradient over tensor once and
    both products (the input's and the weight's gradient) read that copy: left to GSPMD, each
    product asked for its own gather of the same cotangent, and at micro batch 1 XLA did not
    merge the two (2 of a layer's 8 backward halves over tensor were the same gather twice).
    Without sequence parallelism it is the einsum (`_product`); fp8 with `rec` as above."""
    specs = specs_if_split(SEQ_SPLIT, SEQ_WHOLE)
    if specs is None:
        return _product(spec, u, w, rec, h)
    split, whole = specs
    u_spec, w_spec = (logical_to_spec(n, active_rules()) for n in (u_names, w_names))
    rec = None if rec is None else fp8.here(rec)
    return _pinned_product(spec, (u_spec, u_spec, w_spec, split, whole), rec, u, w, h)


def _product(spec: str, x: jax.Array, w: jax.Array, rec: fp8.Recipe | None = None,
             h: jax.Array | None = None) -> jax.Array:
    """`einsum(spec, x, w)` of a projection (fp8 operands under `rec`, `h` the amax history); on a
    CPU its weight gradient multiplies x transposed (`_TRANSPOSED_INPUT`)."""
    if rec is not None:
        return fp8.einsum(spec, x, w, rec, h)
    if platform.current() not in _TRANSPOSED_INPUT:
        return jnp.einsum(spec, x, w)
    return _transposed_input_product(spec, x, w)


# A projection's weight gradient x^T dy contracts the rows (batch, sequence) of both operands.
# XLA:CPU runs that product (Eigen's) at 120-170 GFLOP/s on workload W's shapes; with x
# transposed first (kept so by an optimization barrier, else XLA folds the transpose back into
# the product) it is a plain product, which runs at 160-190 (QKV's [256, 2048] x [2048, 768]:
# 4.8 -> 4.3 ms; benchmarks/RESULTS.md). Where x is the wider operand (fc2's [b, s, f]) dy is
# transposed instead and the weight-sized result after: XLA:CPU transposed that 8 MB input
# (for its own row-contracting product too) in 8 ms per layer inside the layer scan, dy's 2 MB
# in 0.3. Accelerators' matmul libraries take either.
_TRANSPOSED_INPUT = (platform.CPU,)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _transposed_input_product(spec, x, w):
    return jnp.einsum(spec, x, w)


def _transposed_input_forward(spec, x, w):
    return jnp.einsum(spec, x, w), (x, w)


def _transposed_input_backward(spec, residuals, dy):
    x, w = residuals
    (xs, ws), ys = spec.split("->")[0].split(","), spec.split("->")[1]
    dx = jnp.einsum(f"{ys},{ws}->{xs}", dy, w)
    rows, cols = [c for c in xs if c not in ws], [c for c in xs if c in ws]
    if _wider(x, xs, cols, w):  # fc2's [b, s, f] input: dy^T x, dy transposed, then the [d, f] result
        outs = [c for c in ys if c not in xs]
        dy_t = jax.lax.optimization_barrier(jnp.transpose(dy, [ys.index(c) for c in outs + rows]))
        dw_t = jnp.einsum(f"{''.join(outs + rows)},{xs}->{''.join(outs + cols)}", dy_t, x)
        dw = jnp.einsum(f"{''.join(outs + cols)}->{ws}", jax.lax.optimization_barrier(dw_t))
        return dx.astype(x.dtype), dw.astype(w.dtype)
    x_t = jax.lax.optimization_barrier(jnp.transpose(x, [xs.index(c) for c in cols + rows]))
    dw = jnp.einsum(f"{''.join(cols + rows)},{ys}->{ws}", x_t, dy)
    return dx.astype(x.dtype), dw.astype(w.dtype)


def _wider(x, xs, cols, w) -> bool:
    """Has x more columns (the dims it shares with the weight) than the product's output?"""
    width = math.prod(x.shape[xs.index(c)] for c in cols)
    return width * width > w.size


_transposed_input_product.defvjp(_transposed_input_forward, _transposed_input_backward)


def _einsum(spec: str, rec: fp8.Recipe | None):
    """(a, b, h) -> einsum(spec, a, b), fp8 under `rec` (h: the amax history, or None)."""
    if rec is None:
        return lambda a, b, h: jnp.einsum(spec, a, b)
    return lambda a, b, h: fp8.bound_einsum(spec, a, b, rec, h)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _pinned_product(spec, layout, rec, x, w, h):
    """`einsum(spec, x, w)` with every operand, result and gradient in a stated layout:
    (x as kept for the backward, x as multiplied, w, the result, the incoming gradient as
    multiplied). The backward's products read x and the incoming gradient in those layouts (one
    reshard each) and return x's gradient as x is kept, w's as w is: pinned, GSPMD cannot pick
    another split for them (inside a pipeline stage it split the weight gradient's product over
    the sequence and all-reduced whole [d, f] gradients)."""
    _, x_used, w_spec, out_spec, _ = layout
    pin = jax.lax.with_sharding_constraint
    return pin(_einsum(spec, rec)(pin(x, x_used), pin(w, w_spec), h), out_spec)


def _pinned_product_forward(spec, layout, rec, x, w, h):
    return _pinned_product(spec, layout, rec, x, w, h), (x, w, h)


def _pinned_product_backward(spec, layout, rec, res, ct):
    x_kept, x_used, w_spec, out_spec, ct_used = layout
    x, w, h = res
    pin = jax.lax.with_sharding_constraint
    _, pull = jax.vjp(_einsum(spec, rec), pin(x, x_used), pin(w, w_spec), h)
    dx, dw, dh = pull(pin(pin(ct, out_spec), ct_used))
    return pin(dx, x_kept), pin(dw, w_spec), dh


_pinned_product.defvjp(_pinned_product_forward, _pinned_product_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def lookup(table, ids_bs, names):
    """`table[ids_bs]`: an embedding lookup ([batch, seq, embed]) whose gradient, a scatter-add
    into the table laid out as its logical `names`, each device takes from its own rows.

    jax's own gradient leaves that scatter to XLA's partitioner, and jax 0.12.1's XLA aborts
    partitioning it inside a partly manual program ("Check failed: ... spmd_partitioner_util.cc:515":
    every context x tensor x data layout on a CPU, every data-parallel step compiled for GPUs).
    Where the rows are this rank's own (the per-rank body of a step that reduces gradients
    once, or one data-parallel rank), it is a shard_map over the mesh axes not manual already,
    each device adding its rows into its block of the table, with what the partitioner chose
    before where the sequence is split (context, tensor with SP), whichever moves fewer bytes:
    the rows' gradient gathered whole along the sequence (in its own dtype; Megatron's
    vocab-parallel embedding gathers it over tensor too), or the table's gradient summed over
    those ranks."""
    return table[ids_bs]


def _lookup_forward(table, ids_bs, names):
    like = varying(jnp.zeros((), table.dtype), sorted(varying_axes(table)))  # the table's dtype and varying axes
    return table[ids_bs], (ids_bs, like, table.shape)


def _lookup_backward(names, res, dx_bsd):
    ids_bs, like, shape = res
    free = free_axes()
    if not free:
        return zeros_like_typed(like, shape).at[ids_bs].add(dx_bsd.astype(like.dtype)), None
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    split = lambda part: math.prod(sizes[a] for a in entry_axes(part))  # noqa: E731
    batch_spec = spec_on_axes(("batch", "seq"), free)
    if split(batch_spec[0]) > 1:
        # Rows split over free batch axes (a pipeline stage not run per rank): XLA's partitioner
        # keeps the table's gradient a partial sum over them until the step's one reduction
        # over data, which a shard_map's sum here would bring into every microbatch.
        return zeros_like_typed(like, shape).at[ids_bs].add(dx_bsd.astype(like.dtype)), None
    table_spec = spec_on_axes(names, free)
    table_axes = entry_axes(table_spec[0] if len(table_spec) else None)
    b, s = ids_bs.shape
    gathered = b * s * dx_bsd.dtype.itemsize  # per embed column
    summed = shape[0] // split(table_spec[0] if len(table_spec) else None) * like.dtype.itemsize
    ids_spec = spec_on_axes(("batch", None if gathered <= summed else "context_seq"), free)
    over = tuple(a for part in ids_spec for a in entry_axes(part) if sizes[a] > 1)  # the ranks of rows: summed after

    def rows_here(ids, dx):  # this device's rows -> its block of the table's gradient
        n = shape[0] // math.prod(jax.lax.axis_size(a) for a in table_axes)
        first = 0
        for a in table_axes:
            first = first * jax.lax.axis_size(a) + jax.lax.axis_index(a)
        local = ids - first * n
        local = jnp.where((local >= 0) & (local < n), local, n)  # others' rows: dropped
        d_table = jnp.zeros((n, *shape[1:]), like.dtype).at[local].add(dx.astype(like.dtype), mode="drop")
        return psum(d_table, over) if over else d_table

    d_table = jax.shard_map(rows_here, in_specs=(ids_spec, P(*ids_spec, None)), out_specs=table_spec,
                            axis_names=free, check_vma=False)(ids_bs, dx_bsd)
    return varying(d_table, sorted(varying_axes(like))), None  # (inside a pipeline stage: as the table)


lookup.defvjp(_lookup_forward, _lookup_backward)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when `key` is None (evaluation) or the rate is 0.

    The mask is a function of the key and each element's index in the *global* tensor (dim 0,
    the batch rows, offset by the trace's `row_offset`), never of how the tensor is split: a
    data-parallel rank running its own rows (parallelize's reduce-once step) draws exactly the mask those rows get
    on one device."""
    if key is None or rate == 0.0:
        return x
    keep = keep_mask(key, x.shape, 1.0 - rate)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def row_offset() -> jax.Array:
    """The global index of this program's row 0 (the trace's `row_offset`; 0 outside a per-rank
    body), as an int32 array: for a custom VJP, whose backward is traced apart and so must
    receive it as an argument."""
    offset = trace.current().row_offset
    return jnp.asarray(0 if offset is None else offset, jnp.int32)


def _fmix32(h):
    """MurmurHash3's 32-bit finalizer: every input bit flips each output bit with p ~ 1/2."""
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def keep_mask(key: jax.Array, shape: tuple[int, ...], keep_prob: float) -> jax.Array:
    """Bernoulli(keep_prob) bool mask: a counter-based hash of (key, global element index).

    Hashing the index one dimension at a time needs no linear index (which would overflow 32 bits
    for attention probabilities [b, g, r, s, t]); under GSPMD each iota is the global one."""
    words = jax.random.key_data(key).reshape(-1).astype(jnp.uint32)
    h = _fmix32(words[0] ^ _fmix32(words[-1] + jnp.uint32(0x9E3779B9)))
    h = jnp.broadcast_to(h, shape)
    for dim in range(len(shape)):
        idx = jax.lax.broadcasted_iota(jnp.uint32, shape, dim)
        if dim == 0 and trace.current().row_offset is not None:
            idx = idx + jnp.asarray(trace.current().row_offset).astype(jnp.uint32)
        h = _fmix32(h ^ (idx * jnp.uint32(0x9E3779B1) + jnp.uint32(dim + 1)))
    threshold = jnp.uint32(min(int(keep_prob * (1 << 24)), 1 << 24))
    return (h >> 8) < threshold  # 24 uniform bits against keep_prob


def rope_scaling(cfg: ModelConfig) -> tuple[float, float, float, int] | None:
    """(factor, low freq factor, high freq factor, original max positions) of Llama 3.1's rope
    scaling when --use-rope-scaling is on; else None."""
    if not cfg.use_rope_scaling:
        return None
    return (cfg.rope_scaling_factor, cfg.rope_scaling_low_freq_factor, cfg.rope_scaling_high_freq_factor,
            cfg.rope_scaling_original_max_position_embeddings)


def _llama3_scaled(inv_freq: jax.Array, scaling: tuple[float, float, float, int]) -> jax.Array:
    """Llama 3.1's frequency scaling, as Megatron-LM's `_apply_scaling` and transformers'
    `_compute_llama3_parameters`: wavelengths shorter than original/high kept, longer than
    original/low divided by the factor, a linear blend in 1/wavelength between."""
    factor, low, high, original = scaling
    wavelen = 2 * math.pi / inv_freq  # [k/2]
    slowed = jnp.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return jnp.where(medium, blended, slowed)


def rotary(x_bshk: jax.Array, positions_bs: jax.Array, base: float, percent: float = 1.0,
           scaling: tuple[float, float, float, int] | None = None) -> jax.Array:
    """Rotary embedding, rotate-half layout (Megatron's and Hugging Face Llama's).

    `percent` < 1 (--rotary-percent): only the first int(k x percent) channels of each head are
    rotated, with frequencies over that width; the rest pass through (Megatron's and GPT-NeoX's
    partial rotary). `scaling` (`rope_scaling`): Llama 3.1's frequency scaling.
    """
    k = x_bshk.shape[-1]
    rot = int(k * percent)
    if rot < k:
        rotated = rotary(x_bshk[..., :rot], positions_bs, base, scaling=scaling)  # [b, s, h, rot]
        return jnp.concatenate([rotated, x_bshk[..., rot:]], axis=-1)  # [b, s, h, k]
    half = k // 2
    inv_freq = 1.0 / (base ** (jnp.arange(half, dtype=jnp.float32) / half))  # [k/2]
    if scaling is not None:
        inv_freq = _llama3_scaled(inv_freq, scaling)
    return rotate(x_bshk, positions_bs, inv_freq)


def rotate(x_bshk: jax.Array, positions_bs: jax.Array, inv_freq, magnitude: float = 1.0) -> jax.Array:
    """Rotate-half rope of all k channels at the frequencies `inv_freq` [k/2]; cos and sin
    times `magnitude` (YaRN's concentration factor, models/mla.py)."""
    half = x_bshk.shape[-1] // 2
    angles = positions_bs.astype(jnp.float32)[..., None] * inv_freq  # [b, s, k/2]
    cos = jnp.cos(angles)[:, :, None, :]  # [b, s, 1, k/2]
    sin = jnp.sin(angles)[:, :, None, :]
    if magnitude != 1.0:
        cos, sin = cos * magnitude, sin * magnitude
    x = x_bshk.astype(jnp.float32)
    x1, x2 = x[..., :half], x[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_bshk.dtype)


def fp32_einsum(spec: str, grad_a: str, grad_b: str):
    """`einsum(spec, a, b)` with an fp32 result from compute-dtype operands, whose backward
    matmuls run in the compute dtype too, accumulating in fp32.

    Left to autodiff, the fp32 cotangent (softmax, loss) would make both backward matmuls
    fp32 x fp32 under --bf16 (TF32 on a GPU, half rate); here it is cast to the operands' dtype
    first. `grad_a` and `grad_b` are the einsums (cotangent, b) -> da and (cotangent, a) -> db.
    """

    @jax.custom_vjp
    def product(a, b):
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)

    def forward(a, b):
        return product(a, b), (a, b)

    def backward(residuals, ct):
        a, b = residuals
        ct = ct.astype(a.dtype)
        da = jnp.einsum(grad_a, ct, b, preferred_element_type=jnp.float32)
        db = jnp.einsum(grad_b, ct, a, preferred_element_type=jnp.float32)
        return da.astype(a.dtype), db.astype(b.dtype)

    product.defvjp(forward, backward)
    return product


def mlp_activation(h: jax.Array, swiglu: bool, openai_gelu: bool, gate_up_axis: int) -> jax.Array:
    """The MLP's activation of fc1's output `h`: SwiGLU (silu(gate) x up, the two stacked on
    `gate_up_axis`) or GELU (tanh-approximated with --openai-gelu, else exact). Computed in fp32,
    returned in h's dtype; the backward keeps only the activation's input and recomputes the rest
    (autodiff kept its intermediates too: two more [b, s, f] per layer)."""
    if swiglu:
        gate, up = (jnp.take(h, i, axis=gate_up_axis) for i in (0, 1))
        return _swiglu(gate, up)
    return _gelu(h, openai_gelu)


_TANH_K = math.sqrt(2.0 / math.pi)


def _gelu_f32(x, approximate: bool):
    if approximate:
        return 0.5 * x * (1.0 + jnp.tanh(_TANH_K * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1.0 + jax.lax.erf(x / math.sqrt(2.0)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gelu(x, approximate: bool):
    return _gelu_f32(x.astype(jnp.float32), approximate).astype(x.dtype)


def _gelu_forward(x, approximate):
    return _gelu(x, approximate), x


def _gelu_backward(approximate, x, dy):
    x32 = x.astype(jnp.float32)
    if approximate:
        t = jnp.tanh(_TANH_K * (x32 + 0.044715 * x32 ** 3))
        d = 0.5 * (1.0 + t) + 0.5 * x32 * (1.0 - t * t) * _TANH_K * (1.0 + 3 * 0.044715 * x32 * x32)
    else:
        d = 0.5 * (1.0 + jax.lax.erf(x32 / math.sqrt(2.0))) + x32 * jnp.exp(-0.5 * x32 * x32) / math.sqrt(2 * math.pi)
    return (_like((dy.astype(jnp.float32) * d).astype(x.dtype), x),)


_gelu.defvjp(_gelu_forward, _gelu_backward)


@jax.custom_vjp
def _swiglu(gate, up):
    g = gate.astype(jnp.float32)
    return (g * jax.nn.sigmoid(g) * up.astype(jnp.float32)).astype(gate.dtype)


def _swiglu_forward(gate, up):
    return _swiglu(gate, up), (gate, up)


def _swiglu_backward(res, du):
    gate, up = res
    g, u, du = gate.astype(jnp.float32), up.astype(jnp.float32), du.astype(jnp.float32)
    sig = jax.nn.sigmoid(g)
    dgate = du * u * sig * (1.0 + g * (1.0 - sig))
    return _like(dgate.astype(gate.dtype), gate), _like((du * g * sig).astype(up.dtype), up)


_swiglu.defvjp(_swiglu_forward, _swiglu_backward)

