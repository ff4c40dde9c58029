"""fp8 matmuls (Megatron's `--fp8-format`, `--fp8-recipe tensorwise|delayed`): the layers'
projections (QKV, attention output, both MLP matmuls) multiply fp8 operands, everything else stays
in the compute dtype (bf16).

The forward multiplies e4m3 x e4m3; the backward quantizes the incoming gradient (e5m2 under
`hybrid`, e4m3 under `e4m3`) and multiplies it with the saved fp8 operands (the input's gradient
with the weight, the weight's with the input; with `--no-fp8-wgrad` the weight's gradient in the
compute dtype from the unquantized input). A product comes out in the compute dtype (fp32
accumulation) and is descaled in fp32: on an H100 (CUDA >= 12) XLA makes it one cuBLASLt fp8 GEMM.
A scale maps an amax onto the format's largest value: `scale = amax x 2^margin / fp8_max`;
values past the range saturate; a zero or non-finite amax gives scale 1 (no NaN from scaling).

The recipes (Transformer Engine's, as Megatron names them):
  tensorwise  per-tensor current scaling: each operand's amax in this step;
  delayed     delayed scaling (Megatron's default): each operand's amax from a history of the
              steps before (`--fp8-amax-history-len`, the most recent or the largest entry:
              `--fp8-amax-compute-algo`); a tensor with none recorded yet (the first step, or a
              history of zeros) is scaled by its current amax. The histories are parameters of
              the layers (`HISTORY` leaves, [3, history] for x, w and the gradient of each
              product), so they are checkpointed, resumed and laid out as every parameter; the
              backward returns this step's amaxes as their "gradient" (`record`), which the
              step combines with a max over microbatches and ranks instead of a sum (`combine`,
              `max_over`) and writes into the history instead of an optimizer update (`rolled`).
              A step records the amax of the whole step (Megatron records one per microbatch).

An amax is that of the whole tensor, whatever the layout: the trace reduces it where the mesh
splits the tensor (GSPMD inserts a max over the split axes), and where the step runs each
data-parallel rank's rows on their own (the trace's `rank_split`) it is a `pmax` over those ranks,
so every rank quantizes with the scale the unsharded model would use (Megatron reduces amaxes over
data, tensor and context parallel ranks the same way, unless `--tp-only-amax-red`). Scales carry
no gradient.

Layers stay in the compute dtype where `--first-last-layers-bf16` says so (`in_bf16`): the layer
scan runs those rows with fp8 switched off (`off`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mlm_jax.config import FP8_FORMATS, FP8_RECIPES, ModelConfig  # noqa: F401 (the names fp8 offers)
from mlm_jax.kernels.grouped_matmul import grouped_product, grouped_weight_product
from mlm_jax.kernels.tile_dot import FP8_ON_GPU
from mlm_jax.sharding import trace
from mlm_jax.sharding.mesh import in_mesh_order, psum, varying, varying_axes

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
    # The manual mesh axes over which this program holds only a piece of the weight (a MoE
    # layer's experts inside their dispatch: split over `expert` and `tensor`), else None.
    weights_over: tuple | None = None
    history_max: bool = False  # delayed scaling: --fp8-amax-compute-algo max (else most_recent)
    # The manual axes x and w vary over (set where the product is traced): in a shard_map that
    # checks them, their cotangents must vary over no more.
    operand_axes: tuple = ((), ())


# The leaves of the amax histories (delayed scaling): one per projection of a layer, named
# HISTORY + "_" + the projection.
HISTORY = "fp8_history"


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
    return Recipe(E4M3, backward, cfg.fp8_margin, cfg.fp8_wgrad, history_max=cfg.fp8_amax_compute_algo == "max")


def delayed(cfg: ModelConfig) -> bool:
    """Whether the model keeps amax histories (fp8 with delayed scaling)."""
    return cfg.fp8_format is not None and cfg.fp8_recipe == "delayed"


def history(cfg: ModelConfig):
    """A projection's amax history under delayed scaling (zeros: none recorded), else None."""
    if not delayed(cfg):
        return None
    return nnx.Param(jnp.zeros((3, cfg.fp8_amax_history_len), jnp.float32), out_sharding=(None, None))


def is_history(path) -> bool:
    """Whether a pytree key path leads to an amax history leaf."""
    return any(str(getattr(k, "key", k)).startswith(HISTORY) for k in path)


# The projections' weights (their products are fp8): --fp8-param-gather sends them in fp8.
_PROJECTION_WEIGHTS = frozenset({"wqkv", "wo", "w1", "w2", "wq_down", "wq_up", "wq", "wkv_down", "wkv_up"})


def weight_dims(cfg: ModelConfig):
    """path -> how many trailing dims one layer's projection weight has (the rest stack layers),
    None where the path leads to no projection's weight (a MoE layer's experts' are none: their
    block's `mlp` in a MoE stack, which is `layers` when the first layer is a MoE layer)."""
    dims = {"wqkv": 4, "wo": 3, "w1": 3 if cfg.swiglu else 2, "w2": 2,
            "wq_down": 2, "wq_up": 3, "wq": 3, "wkv_down": 2, "wkv_up": 3}  # the last five MLA's
    moe_stacks = {"moe_layers"} | ({"layers"} if cfg.is_moe_layer(0) else set())

    def of(path) -> int | None:
        keys = [str(getattr(k, "key", k)) for k in path]
        experts = keys[0] in moe_stacks and len(keys) >= 2 and keys[-2] == "mlp"
        return dims[keys[-1]] if keys[-1] in _PROJECTION_WEIGHTS and not experts else None

    return of


def gather_in_fp8(x: jax.Array, dims: int, storage, compute, dtype) -> jax.Array:
    """A stack of weights (`storage` sharded; each layer's the last `dims` dims) gathered to
    `compute` in e4m3, each layer's with the scale of its amax (a max over the shards), then
    widened to `dtype` (--fp8-param-gather: half the bytes of ZeRO's bf16 gather). A product's
    own quantization (`einsum`) rounds the widened values back to the same e4m3 values where its
    scale is this one (tensorwise: the layer's current amax) and once more where not (delayed).
    The values at the format's largest widen to the amax itself (448 x s can be an fp32 rounding
    off it), so the product's own amax, and so its scale, is the one the gather used."""
    m = jax.lax.stop_gradient(
        jnp.max(jnp.abs(x), axis=tuple(range(x.ndim - dims, x.ndim)), keepdims=True).astype(jnp.float32))
    s = scale_of(m, E4M3, 0)
    q = jax.lax.with_sharding_constraint(cast(x, s, E4M3), storage)  # cast on the shards...
    q = jax.lax.with_sharding_constraint(q, compute).astype(jnp.float32)  # ...then gathered
    top = float(jnp.finfo(E4M3).max)
    return jnp.where(jnp.abs(q) == top, jnp.sign(q) * m, q * s).astype(dtype)


def combine(acc, grads):
    """`acc + grads` leaf by leaf (in acc's dtype), the histories' records combined by a max: the
    microbatches' gradient accumulation."""
    return jax.tree_util.tree_map_with_path(
        lambda p, a, g: jnp.maximum(a, g.astype(a.dtype)) if is_history(p) else a + g.astype(a.dtype), acc, grads)


def sum_over(grads, axis: int = 0, sum_fn=None):
    """The per-rank gradients' reduction over `axis`: a sum (`sum_fn`, default jnp.sum), a max
    for the histories' records."""
    sum_fn = sum_fn or (lambda g: jnp.sum(g, axis=axis))
    return jax.tree_util.tree_map_with_path(
        lambda p, g: jnp.max(g, axis=axis) if is_history(p) else sum_fn(g), grads)


def without_records(grads):
    """The gradients with the histories' records zeroed (what the optimizer and the gradient norm
    see: a history is no weight)."""
    return jax.tree_util.tree_map_with_path(lambda p, g: jnp.zeros_like(g) if is_history(p) else g, grads)


def rolled(params, grads):
    """The parameters with each history advanced by this step's record (the newest entry first,
    the oldest dropped)."""
    def roll(p, prm, g):
        if not is_history(p):
            return prm
        return jnp.concatenate([g[..., :1].astype(prm.dtype), prm[..., :-1]], axis=-1)

    return jax.tree_util.tree_map_with_path(roll, params, grads)


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
        # Where the shard_map tracks it, only over the axes x varies over (it is the same on the
        # others, and jax 0.12 refuses a pmax over axes in mixed states); untracked, over all.
        known = varying_axes(m)
        axes = tuple(a for a in rows_over if a in known) if known else tuple(rows_over)
        if axes:
            m = jax.lax.pmax(m, axes)
    return jax.lax.stop_gradient(m)


def scale_of(m: jax.Array, dtype, margin: int) -> jax.Array:
    """The dequantizing scale (x ~ q x scale) that maps amax `m` onto `dtype`'s largest value
    over 2^margin; 1 where `m` is zero or not finite."""
    s = m * (2.0 ** margin) / float(jnp.finfo(dtype).max)
    return jnp.where((m > 0) & jnp.isfinite(m), s, jnp.float32(1.0))


def cast(x: jax.Array, s: jax.Array, dtype) -> jax.Array:
    """x / s in `dtype`, saturating at the format's range."""
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / s, -top, top).astype(dtype)


def from_history(h: jax.Array, current: jax.Array, rec: Recipe) -> jax.Array:
    """The amax delayed scaling uses: the history's most recent (or largest) entry, or `current`
    where none is recorded."""
    recorded = jnp.max(h) if rec.history_max else h[0]
    return jnp.where(recorded > 0, recorded, current)


def record(amaxes: jax.Array, h: jax.Array, grad_amax: jax.Array) -> jax.Array:
    """A history's "gradient": this step's amaxes in entry 0 (zeros elsewhere); nothing where the
    incoming gradient is all zero (a masked pipeline slot, a padding layer: its forward ran on
    no data) or an amax is not finite."""
    amaxes = jnp.where(jnp.isfinite(amaxes) & (grad_amax > 0), amaxes, 0.0)
    return jnp.zeros_like(h).at[:, 0].set(amaxes)


def _scaled(spec: str, a, b, scale, dtype):
    """einsum(spec) of fp8 `a` and `b` (fp32 accumulation) in `dtype`, descaled by `scale` in
    fp32. The product itself comes out in `dtype`, as a bf16 step's does: it is what
    `--recompute-granularity dots` keeps (in fp32 it kept twice the bytes: Llama-3 8B's dp8 step
    84.05 GiB against bf16's 61.1)."""
    return (jnp.einsum(spec, a, b, preferred_element_type=dtype).astype(jnp.float32) * scale).astype(dtype)


def experts(cfg: ModelConfig) -> Recipe | None:
    """The fp8 recipe of a MoE layer's experts here, or None (they run in the compute dtype), with
    current (tensorwise) scaling under either recipe (the histories cover the dense projections).
    Their products are fp8 where they run as the dropless grouped matmul's kernels (`grouped`:
    on an H100 the Pallas kernels multiply fp8 operands on fp8 `wgmma`) or as batched matmuls
    over [experts, capacity] slots (--moe-pad-expert-input-to-capacity: cuBLASLt fp8 GEMMs); not
    where a notebook sets `moe_grouped_gemm=False` (XLA's `ragged_dot`, which XLA:GPU expands
    into a dense product over every expert, has no fp8 GEMM). Traced inside the experts'
    dispatch, every manual axis but `pipe` holds a piece of the rows or of the weights (data and
    expert the rows, expert and tensor the weights), so each amax is a max over them: the whole
    tensor's, as one device has it."""
    rec = recipe(cfg)
    if rec is None or not (cfg.moe_pad_expert_input_to_capacity or (cfg.moe_grouped_gemm and FP8_ON_GPU)):
        return None
    manual = getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())
    axes = in_mesh_order(a for a in manual if a != "pipe") or None
    return dataclasses.replace(rec, rows_over=axes, weights_over=axes)


def experts_note(cfg: ModelConfig) -> str | None:
    """What an fp8 MoE run's log says of its experts where their products cannot be fp8."""
    if cfg.fp8_format is None or not cfg.num_experts or cfg.moe_pad_expert_input_to_capacity or FP8_ON_GPU:
        return None
    return (f"jax {jax.__version__} has no Pallas-Triton lowering table for the fp8 tile product: the MoE "
            "experts' grouped matmul stays bf16")


def grouped(x: jax.Array, w: jax.Array, sizes: jax.Array, rec: Recipe, implementation: str | None = None):
    """`grouped_matmul(x, w, sizes)` (rows sorted by expert: x [R, k], w [G, k, n]) with fp8
    operands under `rec`: the forward e4m3 x e4m3, the input gradient (gradient format) x e4m3
    and the weight gradient e4m3 x (gradient format) (in the compute dtype from x itself with
    --no-fp8-wgrad), each descaled in fp32, the result in x's dtype. Each amax is that of the
    rows the groups hold (rows past their sum are no one's, and their count differs by layout)."""
    rec = dataclasses.replace(rec, operand_axes=(tuple(sorted(varying_axes(x))), tuple(sorted(varying_axes(w)))))
    return _grouped(x, w, sizes, rec, implementation)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _grouped(x, w, sizes, rec, implementation):
    return _grouped_forward(x, w, sizes, rec, implementation)[0]


def _held(rows: jax.Array, sizes: jax.Array) -> jax.Array:
    """`rows` [R, ...] with the rows past the groups' sum zeroed."""
    return jnp.where((jnp.arange(rows.shape[0]) < jnp.sum(sizes))[:, None], rows, jnp.zeros((), rows.dtype))


def _grouped_forward(x, w, sizes, rec, implementation):
    x = _held(x, sizes)
    sx = scale_of(amax(x, rec.rows_over), rec.forward, rec.margin)
    sw = scale_of(amax(w, rec.weights_over), rec.forward, rec.margin)
    xq, wq = cast(x, sx, rec.forward), cast(w, sw, rec.forward)
    y = grouped_product(xq, wq, sizes, x.dtype, implementation=implementation)
    return _descaled(y, sx * sw), (xq if rec.wgrad else x, sx, wq, sw, sizes)


def _grouped_backward(rec, implementation, res, dy):
    x_kept, sx, wq, sw, sizes = res
    dy = _held(dy, sizes)
    sg = scale_of(amax(dy, rec.rows_over), rec.backward, rec.margin)
    gq = cast(dy, sg, rec.backward)
    dx = _descaled(grouped_product(gq, wq, sizes, dy.dtype, transpose_w=True, implementation=implementation), sg * sw)
    if rec.wgrad:
        dw = _descaled(grouped_weight_product(x_kept, gq, sizes, dy.dtype, implementation=implementation), sx * sg)
    else:
        dw = grouped_weight_product(x_kept, dy, sizes, dy.dtype, implementation=implementation)
    dx, dw = _summed_to(dx, rec.operand_axes[0]), _summed_to(dw, rec.operand_axes[1])
    return dx, dw, np.zeros(sizes.shape, jax.dtypes.float0)


_grouped.defvjp(_grouped_forward, _grouped_backward)


def _descaled(y: jax.Array, scale: jax.Array) -> jax.Array:
    return (y.astype(jnp.float32) * scale).astype(y.dtype)


def here(rec: Recipe) -> Recipe:
    """`rec` with the rows split of the trace in force (`rows_over`)."""
    split = trace.current().rank_split
    return dataclasses.replace(rec, rows_over=None if split is None else tuple(split[0]))


def einsum(spec: str, x: jax.Array, w: jax.Array, rec: Recipe, h: jax.Array | None = None) -> jax.Array:
    """`einsum(spec, x, w)` of a projection (x activations, w its weight; both in the compute
    dtype) with fp8 operands under `rec`; the result in x's dtype. `h`: its amax history
    (delayed scaling)."""
    return bound_einsum(spec, x, w, here(rec), h)


def bound_einsum(spec, x, w, rec, h=None):
    """`einsum` under a recipe already bound to its trace (`here`): for a product whose
    forward is traced again in a backward traced outside the forward's context. Tensorwise
    scaling is delayed scaling with nothing recorded (`from_history` takes the current amaxes),
    its record dropped with the constant history (typed as varying as the product, as its
    record comes out)."""
    if h is None:
        h = varying(jnp.zeros((3, 1), jnp.float32), sorted(varying_axes(x) | varying_axes(w)))
    rec = dataclasses.replace(rec, operand_axes=(tuple(sorted(varying_axes(x))), tuple(sorted(varying_axes(w)))))
    return _product(spec, x, w, h, rec)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4))
def _product(spec, x, w, h, rec):
    return _forward(spec, x, w, h, rec)[0]


def _forward(spec, x, w, h, rec):
    ax, aw = amax(x, rec.rows_over), amax(w, rec.weights_over)
    sx = scale_of(from_history(h[0], ax, rec), rec.forward, rec.margin)
    sw = scale_of(from_history(h[1], aw, rec), rec.forward, rec.margin)
    xq, wq = cast(x, sx, rec.forward), cast(w, sw, rec.forward)
    keep = x if not rec.wgrad else xq  # --no-fp8-wgrad: the weight's gradient from x itself
    return _scaled(spec, xq, wq, sx * sw, x.dtype), (keep, sx, wq, sw, h, jnp.stack([ax, aw]))


def _backward(spec, rec, res, dy):
    """(dx, dw, the history's record) from the quantized incoming gradient and the saved operands."""
    x_kept, sx, wq, sw, h, forward_amaxes = res
    ag = amax(dy, rec.rows_over)
    sg = scale_of(from_history(h[2], ag, rec), rec.backward, rec.margin)
    gq = cast(dy, sg, rec.backward)
    (xs, ws), ys = spec.split("->")[0].split(","), spec.split("->")[1]
    dx = _scaled(f"{ys},{ws}->{xs}", gq, wq, sg * sw, dy.dtype)
    if rec.wgrad:
        dw = _scaled(f"{xs},{ys}->{ws}", x_kept, gq, sx * sg, dy.dtype)
    else:
        dw = jnp.einsum(f"{xs},{ys}->{ws}", x_kept, dy)
    # In a shard_map that checks varying axes, a cotangent sums over the ranks its primal is the
    # same on (the weight over the ranks of rows, as autodiff's transpose of the broadcast would).
    dx, dw = _summed_to(dx, rec.operand_axes[0]), _summed_to(dw, rec.operand_axes[1])
    return dx, dw, record(jnp.concatenate([forward_amaxes, ag[None]]), h, ag)


def _summed_to(d: jax.Array, axes: tuple) -> jax.Array:
    """`d` summed over the manual axes it varies over and its primal (varying over `axes`) does
    not, and typed as varying over those the primal does."""
    extra = in_mesh_order(varying_axes(d) - set(axes))
    return varying(psum(d, extra) if extra else d, axes)


_product.defvjp(_forward, _backward)
