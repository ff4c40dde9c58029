"""The dense MLP: column-parallel fc1 (GELU, or SwiGLU's fused gate and up), row-parallel fc2.

Shape letters: b batch, s seq, d embed, f mlp, n gate/up.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mlm_jax.config import ModelConfig
from mlm_jax.models import fp8
from mlm_jax.models.layers import (add_bias, cast, column_parallel, mlp_activation, normal, param, row_parallel, value,
                                    zeros)
from mlm_jax.sharding.rules import constrain


W1, W1_SWIGLU, W2 = ("embed", "mlp"), ("embed", None, "mlp"), ("mlp", "embed")
U = ("batch", "context_seq", "mlp")  # fc2's input


class MLP(nnx.Module):
    """[batch, seq, embed] -> [batch, seq, mlp/tensor] -> [batch, seq, embed] (before the
    residual add; the row-parallel all-reduce or reduce-scatter follows)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, std = cfg.hidden_size, cfg.ffn_size, cfg.init_method_std
        out_std = std / math.sqrt(2.0 * cfg.num_layers)  # Megatron's scaled init of output layers
        self.cfg = cfg
        # SwiGLU fuses gate and up into one [d, 2, f] matmul: one input gradient, one all-reduce.
        w1_shape, w1_names = ((d, 2, f), W1_SWIGLU) if cfg.swiglu else ((d, f), W1)
        self.w1 = param(rngs, normal(std), w1_shape, w1_names)
        self.w2 = param(rngs, normal(out_std), (f, d), W2)
        # delayed fp8 scaling's amax histories (models/fp8.py), else None
        self.fp8_history_fc1, self.fp8_history_fc2 = fp8.history(cfg), fp8.history(cfg)
        if cfg.add_bias_linear:
            self.b1 = param(None, zeros, w1_shape[1:], w1_names[1:])
            self.b2 = param(None, zeros, (d,), ("embed",))
        else:
            self.b1 = self.b2 = None

    def __call__(self, y_bsd) -> jax.Array:
        cfg, dt = self.cfg, y_bsd.dtype
        w1, rec = cast(self.w1, dt), fp8.recipe(cfg)
        if cfg.swiglu:  # [b, s, 2, f]
            h = column_parallel("bsd,dnf->bsnf", y_bsd, w1, W1_SWIGLU, ("batch", "context_seq", None, "mlp"), rec,
                                value(self.fp8_history_fc1))
        else:  # [b, s, f]
            h = column_parallel("bsd,df->bsf", y_bsd, w1, W1, ("batch", "context_seq", "mlp"), rec,
                                value(self.fp8_history_fc1))
        h = add_bias(h, cast(self.b1, dt))
        u = mlp_activation(h, cfg.swiglu, cfg.openai_gelu, gate_up_axis=2)  # [b, s, f]
        u = constrain(u, U)
        y = row_parallel("bsf,fd->bsd", u, cast(self.w2, dt), U, W2, rec, value(self.fp8_history_fc2))
        return add_bias(y, cast(self.b2, dt))
