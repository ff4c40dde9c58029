"""AdamW with Megatron's learning-rate schedules, global-norm clipping and decay mask."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from mlm_jax.config import OptimConfig


def lr_at(cfg: OptimConfig, train_iters: int, step):
    """Megatron's OptimizerParamScheduler.get_lr at `step` completed updates (jnp-traceable).

    Linear warmup from 0 over `lr_warmup_iters`, then decay from `lr` to `min_lr` until
    `lr_decay_iters` (default: train_iters), `min_lr` after. WSD holds `lr` and anneals over the
    last `lr_wsd_decay_iters` of the decay window.
    """
    step = jnp.asarray(step, jnp.float32)
    max_lr, min_lr = cfg.lr, cfg.min_lr
    warmup = float(cfg.lr_warmup_iters)
    decay_steps = float(cfg.lr_decay_iters if cfg.lr_decay_iters is not None else train_iters)
    warm_lr = max_lr * step / max(warmup, 1.0)
    if cfg.lr_decay_style == "constant":
        after = jnp.asarray(max_lr, jnp.float32)
    else:
        if cfg.lr_decay_style == "WSD":
            anneal = float(cfg.lr_wsd_decay_iters
                           if cfg.lr_wsd_decay_iters is not None
                           else max(1, int(0.1 * (decay_steps - warmup))))
            start = decay_steps - anneal
            ratio = jnp.clip((step - start) / max(anneal, 1.0), 0.0, 1.0)
            shape = cfg.lr_wsd_decay_style
        else:
            ratio = jnp.clip((step - warmup) / max(decay_steps - warmup, 1.0), 0.0, 1.0)
            shape = cfg.lr_decay_style
        if shape == "linear":
            coeff = 1.0 - ratio
        elif shape == "cosine":
            coeff = 0.5 * (jnp.cos(math.pi * ratio) + 1.0)
        elif shape == "exponential":
            coeff = (2.0 * (0.5 ** ratio) - 1.0)
        else:
            raise ValueError(f"unknown decay style {shape!r}")
        after = min_lr + (max_lr - min_lr) * coeff
    return jnp.where((warmup > 0) & (step <= warmup), warm_lr, after)


_NO_DECAY = frozenset({"bqkv", "bo", "b1", "b2", "bias", "scale"})


def decay_mask(params) -> dict:
    """Weight decay on matrices only: not on biases or norm scales (Megatron's no_wd rule)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) not in _NO_DECAY, params
    )


# Megatron's `is_embedding_or_output_parameter`: the word embedding and the untied output layer
# (not the learned position table). Tied, the embedding is both.
DECOUPLED_PARAMS = frozenset({"embed", "lm_head"})


def decoupled_mask(params) -> dict:
    """True on the parameters --decoupled-lr applies to (top-level `embed` and `lm_head`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[0], "key", None) in DECOUPLED_PARAMS, params
    )


def decoupled_config(cfg: OptimConfig) -> OptimConfig:
    """The schedule of the decoupled parameters: --decoupled-lr peak, --decoupled-min-lr final
    (default --min-lr, as Megatron's param-group override leaves min_lr alone)."""
    min_lr = cfg.decoupled_min_lr if cfg.decoupled_min_lr is not None else cfg.min_lr
    return dataclasses.replace(cfg, lr=cfg.decoupled_lr, min_lr=min_lr)


def _scale_by_two_schedules(main, decoupled, mask_fn) -> optax.GradientTransformation:
    """optax.scale_by_learning_rate with `decoupled(count)` on the leaves `mask_fn` marks and
    `main(count)` elsewhere; one shared step counter."""

    def init(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        del params
        lr_main, lr_dec = main(state.count), decoupled(state.count)
        scaled = jax.tree.map(lambda u, m: u * -(lr_dec if m else lr_main).astype(u.dtype),
                              updates, mask_fn(updates))
        return scaled, optax.ScaleByScheduleState(count=optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def _adamw(cfg: OptimConfig, schedule, train_iters: int) -> optax.GradientTransformation:
    """optax.adamw (decoupled weight decay); with --decoupled-lr the same transforms with a
    per-parameter learning rate (optax.adamw = scale_by_adam, add_decayed_weights, scale by -lr)."""
    if cfg.decoupled_lr is None:
        return optax.adamw(learning_rate=schedule, b1=cfg.adam_beta1, b2=cfg.adam_beta2,
                           eps=cfg.adam_eps, weight_decay=cfg.weight_decay, mask=decay_mask)
    dec = decoupled_config(cfg)
    return optax.chain(
        optax.scale_by_adam(b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_eps),
        optax.add_decayed_weights(cfg.weight_decay, decay_mask),
        _scale_by_two_schedules(schedule, lambda count: lr_at(dec, train_iters, count), decoupled_mask),
    )


def make_optimizer(cfg: OptimConfig, train_iters: int) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW on Megatron's schedule (`lr_at`), no decay on biases and
    norms; --decoupled-lr gives the embedding and output layer their own peak and final LR."""
    schedule = lambda count: lr_at(cfg, train_iters, count)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_grad) if cfg.clip_grad > 0 else optax.identity(),
        _adamw(cfg, schedule, train_iters),
    )
