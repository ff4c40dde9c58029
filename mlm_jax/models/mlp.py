"""The dense MLP: column-parallel fc1 (GELU, or SwiGLU's fused gate and up), row-parallel fc2.

Shape letters: b batch, s seq, d embed, f mlp, n gate/up.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.config import ModelConfig
from mlm_jax.models.layers import add_bias, cast, mlp_activation, normal, param, zeros
from mlm_jax.sharding.rules import constrain


class MLP(nnx.Module):
    """[batch, seq, embed] -> [batch, seq, mlp/tensor] -> [batch, seq, embed] (before the
    residual add; the row-parallel all-reduce or reduce-scatter follows)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, std = cfg.hidden_size, cfg.ffn_size, cfg.init_method_std
        out_std = std / math.sqrt(2.0 * cfg.num_layers)  # Megatron's scaled init of output layers
        self.cfg = cfg
        # SwiGLU fuses gate and up into one [d, 2, f] matmul: one input gradient, one all-reduce.
        w1_shape, w1_names = ((d, 2, f), ("embed", None, "mlp")) if cfg.swiglu else ((d, f), ("embed", "mlp"))
        self.w1 = param(rngs, normal(std), w1_shape, w1_names)
        self.w2 = param(rngs, normal(out_std), (f, d), ("mlp", "embed"))
        if cfg.add_bias_linear:
            self.b1 = param(None, zeros, w1_shape[1:], w1_names[1:])
            self.b2 = param(None, zeros, (d,), ("embed",))
        else:
            self.b1 = self.b2 = None

    def __call__(self, y_bsd) -> jax.Array:
        cfg, dt = self.cfg, y_bsd.dtype
        if cfg.swiglu:
            h = add_bias(jnp.einsum("bsd,dnf->bsnf", y_bsd, cast(self.w1, dt)), cast(self.b1, dt))  # [b, s, 2, f]
        else:
            h = add_bias(jnp.einsum("bsd,df->bsf", y_bsd, cast(self.w1, dt)), cast(self.b1, dt))  # [b, s, f]
        u = mlp_activation(h, cfg.swiglu, cfg.openai_gelu, gate_up_axis=2)  # [b, s, f]
        u = constrain(u, ("batch", "context_seq", "mlp"))
        return add_bias(jnp.einsum("bsf,fd->bsd", u, cast(self.w2, dt)), cast(self.b2, dt))
