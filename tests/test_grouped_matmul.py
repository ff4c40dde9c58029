"""The grouped matmul's Pallas kernels (`mlm_jax/kernels/grouped_matmul.py`, in Pallas's interpret
mode on this CPU) against `jax.lax.ragged_dot` and its autodiff: the output, d_x and d_w.

Tolerances, relative to the scale (the reference's largest magnitude): fp32 1e-5 (the kernels
and XLA sum the same products in other orders: 1.8e-7 seen); bf16 2^-8, one bf16 step at the
scale (both accumulate in fp32 and round the sums to bf16, which may then differ by a step:
identical here). Small shapes and
8-row tiles keep the interpret mode fast; one compiled program per shape serves every pattern
of group sizes (the sizes are data)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlm_jax import platform
from mlm_jax.kernels import Tiles, grouped_matmul
from mlm_jax.kernels.grouped_matmul import default_implementation, grouped_product, grouped_weight_product, tile_table
from mlm_jax.sharding import trace

SMALL = Tiles(tm=8, tk=8, tn=8, band=2)  # band 2: several bands of row tiles
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 2**-8}


@functools.cache
def _out_and_grads(implementation: str, tiles: Tiles | None):
    def run(x, w, sizes, dy):
        out, pullback = jax.vjp(lambda x, w: grouped_matmul(x, w, sizes, implementation=implementation, tiles=tiles),
                                x, w)
        return (out, *pullback(dy))

    return jax.jit(run)


def _inputs(R, k, n, G, dtype, seed=0):
    kx, kw, ky = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (R, k), jnp.float32).astype(dtype)
    w = jax.random.normal(kw, (G, k, n), jnp.float32).astype(dtype)
    dy = jax.random.normal(ky, (R, n), jnp.float32).astype(dtype)
    return x, w, dy


def _check(sizes, R, k, n, dtype=jnp.float32, tiles=SMALL):
    sizes = jnp.asarray(sizes, jnp.int32)
    x, w, dy = _inputs(R, k, n, sizes.shape[0], dtype)
    got = _out_and_grads("pallas", tiles)(x, w, sizes, dy)
    want = _out_and_grads("xla", None)(x, w, sizes, dy)
    for name, a, b in zip(("out", "d_x", "d_w"), got, want):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = max(float(np.abs(b).max()), 1.0)
        assert float(np.abs(a - b).max()) <= TOLERANCE[dtype] * scale, (name, float(np.abs(a - b).max()), scale)
    total = int(sizes.sum())
    out, dx, _ = got
    assert not np.asarray(out[total:], np.float32).any() and not np.asarray(dx[total:], np.float32).any()
    return got


# R = 37, k = 20, n = 13: no dim a multiple of the 8-wide tiles.
@pytest.mark.parametrize("sizes", [
    [0, 5, 11, 0, 9, 0],  # empty groups, the first and last among them; 12 tail rows
    [10, 3, 0, 7, 9, 8],  # uneven, summing to the rows, group edges inside row tiles
    [0, 0, 37, 0, 0, 0],  # all rows in one group
    [0, 0, 0, 0, 0, 0],  # no rows at all: zeros everywhere
])
def test_fp32_matches_ragged_dot_and_its_gradients(sizes):
    _check(sizes, 37, 20, 13)


def test_empty_group_gets_a_zero_weight_gradient():
    _, _, dw = _check([0, 5, 11, 0, 9, 0], 37, 20, 13)
    assert not np.asarray(dw)[[0, 3, 5]].any()


@pytest.mark.parametrize("sizes", [[37], [30]])
def test_a_single_group(sizes):
    _check(sizes, 37, 20, 13)


def test_tile_multiples_take_the_unmasked_loads():
    _check([8, 0, 13, 11], 32, 16, 16)


@pytest.mark.parametrize("sizes", [[0, 5, 11, 0, 9, 0], [10, 3, 0, 7, 9, 8]])
def test_bf16_matches_ragged_dot_and_its_gradients(sizes):
    _check(sizes, 37, 20, 13, jnp.bfloat16)


@pytest.mark.parametrize("sizes", [[0, 5, 11, 0, 9, 0], [10, 3, 0, 7, 9, 8], [37, 0, 0, 0, 0, 0],
                                   [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 37]])
def test_tile_table_writes_every_row_once_within_its_bound(sizes):
    """Every output row in exactly one entry's [lo, hi), inside one row tile; an entry reads
    only its own group's rows; ceil(R/tm) + G - 1 entries at most."""
    R, tm = 37, 8
    group_e, lo_e, hi_e, read_end_e = np.asarray(tile_table(jnp.asarray(sizes, jnp.int32), R, tm))
    assert len(group_e) == -(-R // tm) + len(sizes) - 1
    written = np.zeros(R, int)
    for lo, hi in zip(lo_e, hi_e):
        written[lo:hi] += 1
        assert hi <= lo or lo // tm == (hi - 1) // tm
    assert (written == 1).all(), written
    ends = np.cumsum(sizes)
    for g, lo, end in zip(group_e, lo_e, read_end_e):
        if end > lo:
            assert ends[g] - sizes[g] <= lo and end <= ends[g]


def test_the_implementation_follows_the_platform():
    """None picks XLA's ragged_dot on a CPU and the Pallas kernels (not interpreted) for NVIDIA
    GPUs: the trace context's platform decides, as in a deviceless GPU compile."""
    x, w, _ = _inputs(16, 8, 8, 2, jnp.bfloat16)
    sizes = jnp.array([9, 7], jnp.int32)
    jaxpr = lambda: str(jax.make_jaxpr(lambda x, w: grouped_matmul(x, w, sizes))(x, w))  # noqa: E731
    assert default_implementation() == "xla"
    assert "ragged_dot" in jaxpr() and "pallas_call" not in jaxpr()
    with trace.using(platform=platform.CUDA):
        assert default_implementation() == "pallas"
        text = jaxpr()
        assert "pallas_call" in text and "ragged_dot" not in text and "interpret=True" not in text
    assert "interpret=True" in str(jax.make_jaxpr(
        lambda x, w: grouped_matmul(x, w, sizes, implementation="pallas"))(x, w))


def test_no_rows():
    w = jnp.ones((2, 8, 4), jnp.float32)
    total, dw = jax.value_and_grad(lambda w: grouped_matmul(jnp.zeros((0, 8)), w, jnp.zeros((2,), jnp.int32),
                                                          implementation="pallas").sum())(w)
    assert total == 0 and not dw.any()


def test_bad_arguments_are_named():
    x, w, _ = _inputs(16, 8, 8, 2, jnp.float32)
    sizes = jnp.array([9, 7], jnp.int32)
    with pytest.raises(ValueError, match="implementation 'triton'"):
        grouped_matmul(x, w, sizes, implementation="triton")
    with pytest.raises(ValueError, match="share a dtype"):
        grouped_matmul(x, w.astype(jnp.bfloat16), sizes, implementation="pallas")
    with pytest.raises(ValueError, match="power of 2"):
        Tiles(tm=24)


@functools.cache
def _fp8_products(implementation: str):
    """(forward e4m3 x e4m3, input gradient e5m2 x e4m3 with w read transposed, weight gradient
    e4m3 x e5m2), each in fp32: the products of an fp8 MoE layer (models/fp8.py `grouped`)."""
    def run(x, w, sizes, dy):
        e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
        tiles = SMALL if implementation == "pallas" else None
        kw = dict(implementation=implementation, tiles=tiles)
        return (grouped_product(x.astype(e4), w.astype(e4), sizes, jnp.float32, **kw),
                grouped_product(dy.astype(e5), w.astype(e4), sizes, jnp.float32, transpose_w=True, **kw),
                grouped_weight_product(x.astype(e4), dy.astype(e5), sizes, jnp.float32, **kw))

    return jax.jit(run)


@pytest.mark.parametrize("sizes", [[0, 5, 11, 0, 9, 0], [10, 3, 0, 7, 9, 8]])
def test_fp8_operands_of_two_formats_match_ragged_dot(sizes):
    """fp8 operands, the two formats mixed as a `hybrid` backward mixes them, through the kernels'
    fp8 tile product (`tile_dot`): the same products as `ragged_dot` of the operands widened
    (fp8 values are exact in fp32; only the order of the sums differs: within 1e-5 of the scale)."""
    sizes = jnp.asarray(sizes, jnp.int32)
    x, w, dy = _inputs(37, 20, 13, sizes.shape[0], jnp.float32)
    got = _fp8_products("pallas")(x, w, sizes, dy)
    want = _fp8_products("xla")(x, w, sizes, dy)
    for name, a, b in zip(("out", "d_x", "d_w"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype == jnp.float32, (name, a.shape, b.shape)
        scale = float(jnp.abs(b).max())
        assert scale > 1 and float(jnp.abs(a - b).max()) <= 1e-5 * scale, (name, float(jnp.abs(a - b).max()))
    # ...and they are the fp8 products: fp32 operands give other values
    exact = jax.lax.ragged_dot(x, w, sizes)
    assert float(jnp.abs(got[0] - exact).max()) > 1e-2 * float(jnp.abs(exact).max())
