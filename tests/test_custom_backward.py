"""The norms' and the MLP activations' own backwards (mlm_jax/models/layers.py keeps only the
input and the norm's row statistics) give autodiff's gradients of the plain formulas; so does the
CPU projections' backward whose weight gradient multiplies a transposed operand."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlm_jax.models.layers import mlp_activation, norm

EPS = 1e-5


def plain_norm(x, scale, bias, rms, one_p):
    x = x.astype(jnp.float32)
    if rms:
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + EPS)
    else:
        mean = jnp.mean(x, axis=-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True) + EPS)
    y = y * (1.0 + scale if one_p else scale)
    return y if bias is None else y + bias


def plain_activation(h, swiglu, openai_gelu):
    if swiglu:
        return jax.nn.silu(h[:, :, 0]) * h[:, :, 1]
    return jax.nn.gelu(h, approximate=openai_gelu)


def _inputs(shape, seed=0):
    keys = jax.random.split(jax.random.key(seed), 4)
    return [jax.random.normal(k, s, jnp.float32) for k, s in zip(keys, shape)]


@pytest.mark.parametrize("rms,one_p,with_bias", [(False, False, True), (True, False, False), (False, True, True)])
def test_norm_gradients_equal_autodiffs(rms, one_p, with_bias):
    x, scale, bias, w = _inputs([(2, 5, 16), (16,), (16,), (2, 5, 16)])
    x = 3.0 * x + 0.5  # rows with a mean and a spread away from 0 and 1
    b = bias if with_bias else None

    def loss(f, x, scale, bias):
        return jnp.sum(f(x, scale, bias) * w)

    ours = jax.grad(lambda *a: loss(lambda x, s, b_: norm(x, s, b_, rms, EPS, one_p), *a), argnums=(0, 1, 2))
    ref = jax.grad(lambda *a: loss(lambda x, s, b_: plain_norm(x, s, b_, rms, one_p), *a), argnums=(0, 1, 2))
    np.testing.assert_allclose(norm(x, scale, b, rms, EPS, one_p), plain_norm(x, scale, b, rms, one_p),
                               rtol=0, atol=2e-6)
    for got, want in zip(ours(x, scale, b), ref(x, scale, b)):
        if want is None:
            assert got is None
            continue
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("swiglu,openai_gelu", [(False, False), (False, True), (True, False)])
def test_activation_gradients_equal_autodiffs(swiglu, openai_gelu):
    shape = (2, 5, 2, 8) if swiglu else (2, 5, 8)
    h, w = _inputs([shape, shape[:2] + (8,)])
    h = 2.5 * h

    def loss(f, h):
        return jnp.sum(f(h) * w)

    ours = jax.grad(lambda h: loss(lambda h: mlp_activation(h, swiglu, openai_gelu, gate_up_axis=2), h))(h)
    ref = jax.grad(lambda h: loss(lambda h: plain_activation(h, swiglu, openai_gelu), h))(h)
    np.testing.assert_allclose(mlp_activation(h, swiglu, openai_gelu, 2), plain_activation(h, swiglu, openai_gelu),
                               rtol=0, atol=2e-6)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)
    assert math.isfinite(float(jnp.sum(ours)))


def test_backwards_keep_only_their_inputs():
    """What the backward keeps: the norm's input (in its own dtype) and two [.., 1] row statistics,
    the activation's input; no fp32 copy of a [.., d] row."""
    x = jnp.ones((2, 5, 16), jnp.bfloat16)
    scale = jnp.ones((16,), jnp.float32)
    _, vjp = jax.vjp(lambda x: norm(x, scale, None, False, EPS, False), x)
    kept = [leaf for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "shape")]
    big = [leaf for leaf in kept if leaf.size >= x.size]
    assert [(leaf.shape, leaf.dtype) for leaf in big] == [((2, 5, 16), jnp.bfloat16)], kept
    h = jnp.ones((2, 5, 2, 8), jnp.bfloat16)
    _, vjp = jax.vjp(lambda h: mlp_activation(h, True, False, 2), h)
    big = [leaf for leaf in jax.tree.leaves(vjp) if hasattr(leaf, "shape") and leaf.size >= 2 * 5 * 8]
    assert sorted((leaf.shape, str(leaf.dtype)) for leaf in big) == [((2, 5, 8), "bfloat16")] * 2, big


@pytest.mark.parametrize("spec,x_shape,w_shape", [
    ("bsd,dgjk->bsgjk", (2, 8, 16), (16, 2, 3, 4)),  # QKV: x the narrower operand, x transposed
    ("bshk,hkd->bsd", (2, 8, 4, 8), (4, 8, 32)),  # attention output
    ("bsd,dnf->bsnf", (2, 8, 16), (16, 2, 48)),  # SwiGLU's fc1
    ("bsf,fd->bsd", (2, 8, 64), (64, 16)),  # fc2: x the wider operand, dy transposed
])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_projection_gradients_equal_autodiffs(spec, x_shape, w_shape, dtype):
    from mlm_jax.models import layers

    rng = np.random.default_rng(0)
    x, w = (jnp.asarray(rng.standard_normal(shape), dtype) for shape in (x_shape, w_shape))
    out_shape = jax.eval_shape(lambda: jnp.einsum(spec, x, w)).shape
    cot = jnp.asarray(rng.standard_normal(out_shape), dtype)

    def grads(product, x, w, cot):
        return jax.jit(jax.grad(lambda x, w: jnp.sum((product(spec, x, w) * cot).astype(jnp.float32)),
                                argnums=(0, 1)))(x, w)

    xs, ws = spec.split("->")[0].split(",")
    assert layers._wider(x, xs, [c for c in xs if c in ws], w) == spec.startswith("bsf")  # both paths run
    assert "custom_vjp" in str(jax.make_jaxpr(lambda x, w: layers._product(spec, x, w))(x, w))  # taken on a CPU
    # The reference is autodiff's gradient in fp32 of the same (bf16-exact) values. In bf16 ours
    # must be it rounded once to bf16 (half a bf16 spacing: at most 2^-8 relative; atol for fp32's
    # summation order). Not autodiff's bf16 gradient: on jax 0.12 XLA:CPU runs fc2's weight
    # gradient (a transposed product contracting batch and sequence) with its running sum rounded
    # to bf16 after every term, up to 4 bf16 spacings off at these 16 rows (jax 0.10.2 summed in fp32).
    want = grads(jnp.einsum, *(a.astype(jnp.float32) for a in (x, w, cot)))
    rtol, atol = (1e-5, 1e-5) if dtype == jnp.float32 else (2.0 ** -8, 1e-5)
    for got, want, operand in zip(grads(layers._transposed_input_product, x, w, cot), want, (x, w)):
        assert got.dtype == operand.dtype
        np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=rtol, atol=atol)
