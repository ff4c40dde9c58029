"""A grouped matmul for the MoE experts: `jax.lax.ragged_dot`'s function, as Pallas kernels that
do only the useful work on NVIDIA GPUs.

XLA:GPU has no grouped GEMM for CUDA: it expands `ragged_dot` into a dense product over all G
experts (a masked [R, G, k] copy of the rows, one dot over every expert, the same in the
backward), so a dropless MoE layer costs G times its expert FLOPs and a [R, G, k] buffer (at
Mixtral's sizes, G = 8, R = 8192, k = 4096, n = 14336: a 7.70 TFLOP forward for 0.96 useful).
The kernels here (megablox's scheme, Pallas with the Triton backend) walk the rows sorted by
group in row tiles instead:

- forward, out[r] = x[r] @ w[g(r)]: one program per (table entry, n tile); a table entry is a
  (group, row tile) pair, at most ceil(R/tm) + G - 1 of them (a row tile that straddles a group
  edge is visited once per group in it), built in plain jax from the group sizes and passed to
  the kernel as an input; loads and stores of the rows outside the entry's group are masked;
- input gradient, dx[r] = dy[r] @ w[g(r)]^T: the same kernel reading w's tiles transposed (no
  transposed copy of w);
- weight gradient, dw[g] = x_g^T @ dy_g: one program per (group, k tile, n tile), looping over
  that group's rows (none for an empty group: zeros).

fp8 operands (`grouped_product`, `grouped_weight_product`: no autodiff, models/fp8.py supplies
the backward; two formats may mix) multiply through `tile_dot`, which keeps them fp8 on Hopper's
`wgmma` where Pallas's own dot lowering would upcast them to f16.

Executed FLOPs are at most (1 + (G - 1) tm / R) times the useful ones (forward and input
gradient), (1 + G tk / R) for the weight gradient: 1.094 x in all at Mixtral's sizes
(tests/test_gpu_compile.py). Off a GPU the kernels run in Pallas's interpret mode (the CPU test
suite checks them against `ragged_dot` and its autodiff). The Triton lowering asks which GPU it
compiles for: jax 0.10 the default device, jax 0.12 also the mesh in context, so a deviceless
compile lowers inside `jax.set_mesh` of the compile-only devices (as `parallelize` lowers a
step). jax 0.12 deprecates Pallas's Triton backend (for Mosaic GPU, whose kernels are compiled
only on a device: a deviceless compile could not check them); it still lowers and compiles.

Shape letters: r row (rows sorted by group), g group, k contracted (input) dim, n output dim,
e table entry, m the rows of one row tile; tm, tk, tn the tiles (`Tiles`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from mlm_jax import platform
from mlm_jax.kernels.tile_dot import tile_dot
from mlm_jax.sharding.mesh import varying, varying_axes

PALLAS, XLA = "pallas", "xla"


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Every kernel computes [tm, tn] output tiles, stepping tk along the contracted dim: the
    row-wise products (forward, input gradient) tile rows by tm and step tk along k (n for the
    input gradient); the weight gradient tiles dw[g]'s [k, n] by [tm, tn] and steps tk rows of
    the group at a time. The defaults are a common Triton bf16 GEMM shape on H100 (wgmma on
    128-row tiles; 3 stages of 32 KiB of operands fit the shared memory); untuned on a device.
    `band`: the programs run in bands of `band` output row tiles, down each column of tiles then
    across (Triton's grouped ordering), so that the programs resident at once share a few row
    tiles and weight columns in L2."""

    tm: int = 128
    tk: int = 64
    tn: int = 128
    num_warps: int = 8
    num_stages: int = 3
    band: int = 8

    def __post_init__(self):
        for name in ("tm", "tk", "tn"):
            size = getattr(self, name)
            if size < 1 or size & (size - 1):  # Triton's tensors: power-of-2 sizes only
                raise ValueError(f"Tiles.{name} must be a power of 2, got {size}")


def default_implementation() -> str:
    """'pallas' where the step is traced for NVIDIA GPUs (the trace context's platform: a
    deviceless GPU compile runs in a CPU process), else 'xla'."""
    return PALLAS if platform.current() == platform.CUDA else XLA


def grouped_matmul(x, w, group_sizes, *, implementation: str | None = None, tiles: Tiles | None = None):
    """Same semantics as jax.lax.ragged_dot(x, w, group_sizes): x [R, k] rows sorted by group, w [G, k, n],
    group_sizes [G] int32 with sum <= R; rows past sum(group_sizes) give 0. Returns [R, n] in x.dtype
    (fp32 accumulation).

    implementation: 'pallas' (the kernels here; Triton on a GPU, interpret mode elsewhere), 'xla'
    (`jax.lax.ragged_dot`), None: `default_implementation()`. tiles: the kernels' tiles
    (`Tiles()` by default). Differentiable in x and w (the kernels' own backward)."""
    implementation = _implementation(implementation, x, w, group_sizes)
    if implementation == XLA:
        return jax.lax.ragged_dot(x, w, group_sizes)
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    if x.shape[0] == 0:  # no rows, no kernel (and zero gradients)
        return jnp.zeros((0, w.shape[2]), x.dtype)
    x, w, group_sizes = _varying_alike(x, w, group_sizes.astype(jnp.int32))
    return _pallas_gmm(x, w, group_sizes, tiles or Tiles(), _interpret())


def grouped_product(x, w, group_sizes, out_dtype, *, transpose_w: bool = False, implementation: str | None = None,
                    tiles: Tiles | None = None):
    """out[r] = x[r] @ w[g(r)] as `grouped_matmul`, in `out_dtype`, with no autodiff: x and w may be
    fp8, of two formats (a caller with its own backward: models/fp8.py). transpose_w: w is
    [G, n, k], read as its transpose (an input gradient). The kernels keep fp8 operands fp8 on an
    H100 (`tile_dot`); the 'xla' implementation widens them to `out_dtype` (exactly) for
    `ragged_dot`."""
    implementation = _implementation(implementation, x, w.swapaxes(1, 2) if transpose_w else w, group_sizes)
    if implementation == XLA:
        w = w.swapaxes(1, 2) if transpose_w else w
        return jax.lax.ragged_dot(x.astype(out_dtype), w.astype(out_dtype), group_sizes,
                                  preferred_element_type=jnp.float32).astype(out_dtype)
    if x.shape[0] == 0:
        return jnp.zeros((0, w.shape[1] if transpose_w else w.shape[2]), out_dtype)
    x, w, group_sizes = _varying_alike(x, w, group_sizes.astype(jnp.int32))
    return _gmm(x, w, group_sizes, tiles or Tiles(), _interpret(), transpose_w=transpose_w, out_dtype=out_dtype)


def grouped_weight_product(x, dy, group_sizes, out_dtype, *, implementation: str | None = None,
                           tiles: Tiles | None = None):
    """dw[g] = x_g^T @ dy_g ([G, k, n] in `out_dtype`, zero for an empty group): the weight
    gradient of `grouped_product`, x [R, k] and dy [R, n] of any float types (fp8 included)."""
    G = group_sizes.shape[0]
    implementation = _implementation(implementation, x, jax.ShapeDtypeStruct((G, x.shape[1], dy.shape[1]), dy.dtype),
                                     group_sizes)
    if implementation == XLA:
        # (typed as varying as the operands: a transpose onto an invariant zero sums over the ranks)
        dw0 = varying(jnp.zeros((G, x.shape[1], dy.shape[1]), out_dtype), sorted(varying_axes(x) | varying_axes(dy)))
        _, vjp = jax.vjp(lambda w: jax.lax.ragged_dot(x.astype(out_dtype), w, group_sizes,
                                                      preferred_element_type=jnp.float32), dw0)
        return vjp(dy.astype(jnp.float32))[0].astype(out_dtype)
    if x.shape[0] == 0:
        return jnp.zeros((G, x.shape[1], dy.shape[1]), out_dtype)
    x, dy, group_sizes = _varying_alike(x, dy, group_sizes.astype(jnp.int32))
    return _tgmm(x, dy, group_sizes, tiles or Tiles(), _interpret(), out_dtype=out_dtype)


def _implementation(implementation, x, w, group_sizes) -> str:
    """The implementation asked for (None: the default) once the operands' shapes are checked."""
    implementation = implementation or default_implementation()
    if implementation not in (PALLAS, XLA):
        raise ValueError(f"implementation {implementation!r}: choose 'pallas', 'xla' or None")
    if x.ndim != 2 or w.ndim != 3 or group_sizes.shape != w.shape[:1] or x.shape[1] != w.shape[1]:
        raise ValueError(f"want x [R, k], w [G, k, n], group_sizes [G]; got {x.shape}, {w.shape}, {group_sizes.shape}")
    return implementation


def _interpret() -> bool:
    """Whether the kernels run in Pallas's interpret mode (off a GPU)."""
    return platform.current() not in (platform.CUDA, platform.ROCM)


def _varying_alike(*arrays):
    """The arrays cast to vary over the same manual axes (inside a shard_map that checks them, a
    kernel's operands and result must agree on it): the union of theirs. Outside one: as they are."""
    axes = sorted(frozenset().union(*map(varying_axes, arrays)))
    return tuple(varying(a, axes) for a in arrays)


def _result(shape, dtype, like):
    """A kernel's result type: `shape` and `dtype`, varying over the manual axes `like` does."""
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _pallas_gmm(x_rk, w_gkn, sizes_g, tiles: Tiles, interpret: bool):
    return _gmm(x_rk, w_gkn, sizes_g, tiles, interpret)


def _pallas_gmm_fwd(x_rk, w_gkn, sizes_g, tiles, interpret):
    return _gmm(x_rk, w_gkn, sizes_g, tiles, interpret), (x_rk, w_gkn, sizes_g)


def _pallas_gmm_bwd(tiles, interpret, residuals, dy_rn):
    x_rk, w_gkn, sizes_g = residuals
    dx_rk = _gmm(dy_rn, w_gkn, sizes_g, tiles, interpret, transpose_w=True)
    dw_gkn = _tgmm(x_rk, dy_rn, sizes_g, tiles, interpret)
    return dx_rk, dw_gkn, np.zeros(sizes_g.shape, jax.dtypes.float0)


_pallas_gmm.defvjp(_pallas_gmm_fwd, _pallas_gmm_bwd)


def _group_bounds(sizes_g, rows: int):
    """Each group's first row and end (clamped to the rows: a sum past R reads nothing past it)."""
    ends_g = jnp.minimum(jnp.cumsum(sizes_g), rows)
    starts_g = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_g[:-1]])
    return starts_g, ends_g


def tile_table(sizes_g, rows: int, tm: int):
    """The forward kernel's work list, int32 [4, E] with E = ceil(rows/tm) + G - 1 (static):
    per entry its group, the rows [lo, hi) it writes and the end of the rows it reads (lo..
    read_end, the group's own rows). The groups' write ranges partition [0, rows), the last
    group's running on to `rows` (its entries write the zero rows past the groups' sum), so
    every output row is written by exactly one entry. Entries past the used ones write nothing."""
    G = sizes_g.shape[0]
    starts_g, ends_g = _group_bounds(sizes_g, rows)
    write_ends_g = ends_g.at[-1].set(rows)
    first_tile_g = starts_g // tm
    tiles_g = jnp.where(write_ends_g > starts_g, (write_ends_g - 1) // tm - first_tile_g + 1, 0)
    offsets_g = jnp.cumsum(tiles_g)  # entry index past each group's last
    e = jnp.arange(pl.cdiv(rows, tm) + G - 1, dtype=jnp.int32)
    group_e = jnp.minimum(jnp.sum(e[:, None] >= offsets_g[None, :], axis=1, dtype=jnp.int32), G - 1)  # [e]
    tile_e = first_tile_g[group_e] + e - (offsets_g[group_e] - tiles_g[group_e])
    used_e = e < offsets_g[-1]
    lo_e = jnp.where(used_e, jnp.maximum(tile_e * tm, starts_g[group_e]), 0)
    hi_e = jnp.where(used_e, jnp.minimum((tile_e + 1) * tm, write_ends_g[group_e]), 0)
    read_end_e = jnp.minimum(hi_e, ends_g[group_e])
    return jnp.stack([group_e, lo_e, hi_e, read_end_e])  # [4, e]


def _params(tiles: Tiles, interpret: bool) -> dict:
    if interpret:
        return {"interpret": True}
    return {"compiler_params": plgpu.CompilerParams(num_warps=tiles.num_warps, num_stages=tiles.num_stages)}


def _gmm(x_rk, w, sizes_g, tiles: Tiles, interpret: bool, *, transpose_w: bool = False, out_dtype=None):
    """out[r] = x[r] @ w[g(r)] ([R, n] in `out_dtype`, default x's dtype); transpose_w: w is
    [G, n, k] read as its transpose, out[r] = x[r] @ w[g(r)]^T (the input gradient, with no
    transposed copy of w)."""
    R, K = x_rk.shape
    N = w.shape[1] if transpose_w else w.shape[2]
    table = tile_table(sizes_g, R, tiles.tm)
    kernel = functools.partial(_gmm_kernel, tiles=tiles, transpose_w=transpose_w)
    return pl.pallas_call(
        kernel, out_shape=_result((R, N), out_dtype or x_rk.dtype, x_rk),
        grid=(table.shape[1] * pl.cdiv(N, tiles.tn),), name="grouped_matmul" + ("_wt" if transpose_w else ""),
        **_params(tiles, interpret))(table, x_rk, w)


def _gmm_kernel(table_ref, x_ref, w_ref, out_ref, *, tiles: Tiles, transpose_w: bool):
    # table [4, E]; x [R, K]; w [G, K, N] ([G, N, K] transposed); out [R, N]
    tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
    K, N = x_ref.shape[1], out_ref.shape[1]
    e, j = _banded(pl.program_id(0), table_ref.shape[1], pl.cdiv(N, tn), tiles.band)
    group, lo, hi, read_end = table_ref[0, e], table_ref[1, e], table_ref[2, e], table_ref[3, e]
    r0, n0 = (lo // tm) * tm, j * tn
    rows_m = r0 + jnp.arange(tm)
    read_m = (rows_m >= lo) & (rows_m < read_end)
    in_n = n0 + jnp.arange(tn) < N if N % tn else None  # masks only where a tile can pass the end

    def step(i, acc_mn):
        k0 = i * tk
        in_k = k0 + jnp.arange(tk) < K if K % tk else None  # past K: read as 0
        x_mk = _load(x_ref.at[pl.ds(r0, tm), pl.ds(k0, tk)], _both(read_m, in_k, (tm, tk)))
        if transpose_w:
            w_nk = _load(w_ref.at[group, pl.ds(n0, tn), pl.ds(k0, tk)], _both(in_n, in_k, (tn, tk)))
            return acc_mn + _product(x_mk, w_nk, (((1,), (1,)), ((), ())))
        w_kn = _load(w_ref.at[group, pl.ds(k0, tk), pl.ds(n0, tn)], _both(in_k, in_n, (tk, tn)))
        return acc_mn + _product(x_mk, w_kn, (((1,), (0,)), ((), ())))

    # An entry with no rows of its group to read (tail rows past the groups' sum) writes zeros.
    # (integer arithmetic, not a select: Triton's loop bound came out as an i1 from one)
    steps = jnp.clip(read_end - lo, 0, 1) * pl.cdiv(K, tk)
    acc_mn = jax.lax.fori_loop(0, steps, step, jnp.zeros((tm, tn), jnp.float32))
    write_m = (rows_m >= lo) & (rows_m < hi)
    plgpu.store(out_ref.at[pl.ds(r0, tm), pl.ds(n0, tn)], acc_mn.astype(out_ref.dtype),
                mask=_both(write_m, in_n, (tm, tn)))


def _tgmm(x_rk, dy_rn, sizes_g, tiles: Tiles, interpret: bool, *, out_dtype=None):
    """dw[g] = x_g^T @ dy_g: [G, K, N] in `out_dtype` (default x's dtype), zero for an empty group."""
    (R, K), N, G = x_rk.shape, dy_rn.shape[1], sizes_g.shape[0]
    starts_g, ends_g = _group_bounds(sizes_g, R)
    bounds = jnp.stack([starts_g, ends_g])  # [2, g]
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, tiles=tiles), out_shape=_result((G, K, N), out_dtype or x_rk.dtype, x_rk),
        grid=(G * pl.cdiv(K, tiles.tm) * pl.cdiv(N, tiles.tn),), name="grouped_matmul_dw",
        **_params(tiles, interpret))(bounds, x_rk, dy_rn)


def _tgmm_kernel(bounds_ref, x_ref, dy_ref, dw_ref, *, tiles: Tiles):
    # bounds [2, G]; x [R, K]; dy [R, N]; dw [G, K, N]
    tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
    K, N = x_ref.shape[1], dy_ref.shape[1]
    G, pid = bounds_ref.shape[1], pl.program_id(0)
    g = pid % G  # the groups of one [k, n] tile side by side: together they read all rows once
    i, j = _banded(pid // G, pl.cdiv(K, tm), pl.cdiv(N, tn), tiles.band)
    start, end = bounds_ref[0, g], bounds_ref[1, g]
    k0, n0 = i * tm, j * tn
    in_k = k0 + jnp.arange(tm) < K if K % tm else None
    in_n = n0 + jnp.arange(tn) < N if N % tn else None

    def step(s, acc_kn):
        r0 = start + s * tk
        in_group = r0 + jnp.arange(tk) < end
        x_rk = _load(x_ref.at[pl.ds(r0, tk), pl.ds(k0, tm)], _both(in_group, in_k, (tk, tm)))
        dy_rn = _load(dy_ref.at[pl.ds(r0, tk), pl.ds(n0, tn)], _both(in_group, in_n, (tk, tn)))
        return acc_kn + _product(x_rk, dy_rn, (((0,), (0,)), ((), ())))

    acc_kn = jax.lax.fori_loop(0, pl.cdiv(end - start, tk), step, jnp.zeros((tm, tn), jnp.float32))
    plgpu.store(dw_ref.at[g, pl.ds(k0, tm), pl.ds(n0, tn)], acc_kn.astype(dw_ref.dtype),
                mask=_both(in_k, in_n, (tm, tn)))


def _product(a, b, dims):
    """`dot_general(a, b, dims)` of two tiles in fp32: fp8 operands through `tile_dot` (which keeps
    them fp8 on an H100 and takes two formats), others through jax's dot."""
    if not (_is_fp8(a.dtype) or _is_fp8(b.dtype)):
        return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)
    ((ca,), (cb,)), _ = dims
    return tile_dot(a if ca == 1 else a.T, b if cb == 0 else b.T)


def _is_fp8(dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 1 and jnp.issubdtype(dtype, jnp.floating)


def _banded(pid, rows: int, cols: int, band: int):
    """The (row, column) tile of program `pid` of rows x cols tiles in banded order."""
    per_band = band * cols
    first = pid // per_band * band
    height = jnp.minimum(rows - first, band)  # the last band's may be shorter
    return first + pid % per_band % height, pid % per_band // height


def _load(ref, mask):
    """The tile `ref`, 0 where `mask` is false (None: all of it)."""
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=jnp.zeros((), ref.dtype))


def _both(rows, cols, shape):
    """The `shape` mask of a rows mask and a columns mask (None: all true), or None (no mask)."""
    if rows is None and cols is None:
        return None
    if rows is None:
        return jnp.broadcast_to(cols[None, :], shape)
    if cols is None:
        return jnp.broadcast_to(rows[:, None], shape)
    return rows[:, None] & cols[None, :]
