"""Loss scaling for --fp16: Megatron-LM's grad scalers as a small pytree and a pure update.

fp16 has 10 mantissa bits and a range of 6e-8 .. 65504: small gradients of activations
underflow to zero. The step multiplies the loss by `scale` before differentiation, so every
activation gradient in the backward is `scale` times larger, then unscales the fp32 parameter
gradients (`unscale`). A gradient that overflowed (any inf/NaN, anywhere) skips the step: the
train state stays as it was, only the scaler moves (`keep_on_overflow`).

The rules (megatron/core/optimizer/grad_scaler.py):

  static (--loss-scale S)  the scale is S, always; an overflow still skips the step (and 3 in a
               row stop the run, naming the flag: a static scale never backs off; mlm_jax/loop.py).
  dynamic (the default with --fp16), from --initial-loss-scale (2**32):
    overflow   growth tracker := 0; hysteresis tracker -= 1; if the hysteresis tracker is
               <= 0, scale := max(scale / 2, --min-loss-scale). The tracker is *not* reset by
               clean steps in between: it counts overflows since the scale last grew, and once
               it has run out every further overflow halves the scale.
    clean      growth tracker += 1; when it reaches --loss-scale-window: growth tracker := 0,
               hysteresis tracker := --hysteresis, scale := scale * 2 (no upper bound).

The state is {"scale": f32[], "growth_tracker": i32[], "hysteresis_tracker": i32[]}, replicated,
part of the train state under "loss_scale" (and of checkpoints' metadata).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from mlm_jax.config import Config

KEY = "loss_scale"  # the scaler's entry in the train state


@dataclasses.dataclass(frozen=True)
class Scaler:
    """The scaling rules of one run (Megatron's flags); the values live in `init`'s state."""

    static: float | None = None  # --loss-scale: a constant scale
    initial: float = 2.0**32
    min_scale: float = 1.0
    window: int = 1000  # clean steps before the scale doubles
    hysteresis: int = 2  # overflows (since the last growth) before the scale halves

    @classmethod
    def of(cls, cfg: Config) -> "Scaler | None":
        """The run's scaler: with --fp16, or a static --loss-scale; None otherwise."""
        o = cfg.optim
        if not (cfg.model.fp16 or o.loss_scale is not None):
            return None
        return cls(o.loss_scale, o.initial_loss_scale, o.min_loss_scale, o.loss_scale_window, o.hysteresis)

    def init(self) -> dict:
        """The scaler state at the start of training."""
        start = self.static if self.static is not None else self.initial
        return {"scale": jnp.asarray(start, jnp.float32),
                "growth_tracker": jnp.zeros((), jnp.int32),
                "hysteresis_tracker": jnp.asarray(self.hysteresis, jnp.int32)}

    def update(self, state: dict, found_inf) -> dict:
        """The state after a step whose gradients overflowed (`found_inf`) or not: Megatron's
        DynamicGradScaler.update as a pure function (jnp-traceable); a static scaler's state
        never changes."""
        if self.static is not None:
            return state
        return _dynamic_update(self, state, found_inf)


def _dynamic_update(rules: Scaler, state: dict, found_inf) -> dict:
    scale, growth, hyst = state["scale"], state["growth_tracker"], state["hysteresis_tracker"]
    # Overflow: back off once the hysteresis has run out.
    o_hyst = hyst - 1
    o_scale = jnp.where(o_hyst <= 0, jnp.maximum(scale * 0.5, jnp.float32(rules.min_scale)), scale)
    # Clean: grow after `window` clean steps in a row.
    c_growth = growth + 1
    grow = c_growth == rules.window
    c_scale = jnp.where(grow, scale * 2.0, scale)
    c_growth = jnp.where(grow, 0, c_growth)
    c_hyst = jnp.where(grow, jnp.int32(rules.hysteresis), hyst)
    return {"scale": jnp.where(found_inf, o_scale, c_scale).astype(jnp.float32),
            "growth_tracker": jnp.where(found_inf, 0, c_growth).astype(jnp.int32),
            "hysteresis_tracker": jnp.where(found_inf, o_hyst, c_hyst).astype(jnp.int32)}


def token_weight(batch: dict, loss_scale=None):
    """The one factor every path of the step multiplies a microbatch's summed token loss by: one
    over the unmasked tokens of the whole global batch (at least 1), so the step's loss is the
    token mean however the batch is split, times the loss scale when there is one."""
    weight = 1.0 / jnp.maximum(jnp.sum(batch["loss_mask"]), 1.0)
    return weight if loss_scale is None else weight * loss_scale


def unscale(loss, grads, scale):
    """(loss, grads, found_inf) from the scaled loss and its gradients: both divided by the
    scale in fp32, found_inf when any gradient element is inf or NaN (over every shard: the
    reduction is global under jit).

    Divided, not multiplied by Megatron's inv_scale = 1/scale: for the power-of-two scales the
    scaler makes the two are bitwise the same, but above 2**126 the inverse is subnormal and
    XLA flushes it to zero, which made an overflowed loss inf x 0 = NaN (a NaN stop, not a
    skipped step) and every finite gradient 0."""
    scale = jnp.asarray(scale, jnp.float32)
    grads = jax.tree.map(lambda g: g.astype(jnp.float32) / scale, grads)
    finite = jnp.all(jnp.asarray([jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
    return loss / scale, grads, jnp.logical_not(finite)


def keep_on_overflow(new: dict, old: dict, found_inf) -> dict:
    """`new` where the step was clean, `old` (every entry but the scaler) where it overflowed:
    parameters, optimizer state, step and anything else the state holds stay as they were."""
    rest = [k for k in new if k != KEY]
    kept = jax.tree.map(lambda n, o: jnp.where(found_inf, o, n),
                        {k: new[k] for k in rest}, {k: old[k] for k in rest})
    return {**new, **kept}


def to_record(state: dict) -> dict:
    """The scaler state as JSON (checkpoint metadata); exact: an fp32 scale is a double exactly."""
    host = jax.device_get(state)
    return {"scale": float(host["scale"]), "growth_tracker": int(host["growth_tracker"]),
            "hysteresis_tracker": int(host["hysteresis_tracker"])}


def from_record(record: dict) -> dict:
    """`to_record`'s inverse (host arrays; the caller places them)."""
    import numpy as np

    return {"scale": np.float32(record["scale"]), "growth_tracker": np.int32(record["growth_tracker"]),
            "hysteresis_tracker": np.int32(record["hysteresis_tracker"])}
