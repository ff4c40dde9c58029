"""One tile's product inside a Pallas kernel, [m, k] x [k, n] -> [m, n] in fp32, that keeps fp8
operands fp8 on an H100.

Pallas's Triton lowering of a dot (jax 0.10 to 0.12) builds Triton's `tt.dot` without
`max_num_imprecise_acc`, and Triton multiplies fp8 operands into an fp32 accumulator on Hopper's
fp8 `wgmma` only where that attribute lets the tensor core accumulate at least 32 products in
its own precision; otherwise it falls back to `mma.sync`, which has no fp8 form, and upcasts both
operands to f16 (PTX `mma.sync ... f16.f16`: half the fp8 rate). The lowering also refuses
operands of two formats (e5m2 x e4m3: the gradients' products under `--fp8-format hybrid`).

`tile_dot` is a primitive of its own. Its Triton lowering is `tt.dot` with
`max_num_imprecise_acc = k`: the tensor core accumulates one tile's k products (PTX
`wgmma ... f32.e4m3.e4m3`, `f32.e5m2.e4m3`), and the kernel's fp32 accumulator adds the tiles
(DeepSeek-V3 promotes fp8 sums to fp32 every 128 products; the kernels here every tk = 64).
Everywhere else (XLA, Pallas's interpret mode on a CPU) it is the exact product in fp32: fp8
and bf16 values are exact in fp32.

The Triton rule is registered in jax's private table of Pallas-Triton lowering rules
(`jax._src.pallas.triton.lowering.triton_lowering_rules`, the same name in jax 0.10 and 0.12);
`FP8_ON_GPU` is False where that table is missing; models/fp8.py then keeps the dropless experts
in the compute dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import mlir

tile_dot_p = Primitive("mlm_jax_tile_dot")


def tile_dot(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [m, k] @ b [k, n] in fp32; a and b any float types, fp8 included, not necessarily the same."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"tile_dot wants a [m, k] and b [k, n], got {a.shape} and {b.shape}")
    return tile_dot_p.bind(a, b)


def _exact(a, b):
    return jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


tile_dot_p.def_impl(_exact)
tile_dot_p.def_abstract_eval(lambda a, b: jax.core.ShapedArray((a.shape[0], b.shape[1]), jnp.float32))
mlir.register_lowering(tile_dot_p, mlir.lower_fun(_exact, multiple_results=False))


def _register_triton() -> bool:
    try:
        from jax._src.pallas.triton import lowering
        from jaxlib.triton import dialect as tt
    except ImportError:
        return False
    if not hasattr(lowering, "triton_lowering_rules") or not hasattr(lowering, "_zeros"):
        return False

    def rule(ctx, a, b):
        [out] = ctx.avals_out
        k = ctx.avals_in[0].shape[1]
        acc = lowering._zeros(lowering.ir.RankedTensorType.get(list(out.shape), lowering.ir.F32Type.get()))
        return tt.dot(a, b, acc, max_num_imprecise_acc=max(k, 32))

    lowering.triton_lowering_rules[tile_dot_p] = rule
    return True


FP8_ON_GPU = _register_triton()
