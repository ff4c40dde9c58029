"""AdamW with Megatron's learning-rate schedules, global-norm clipping and decay mask."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax

from mlm_jax.config import OptimConfig
from mlm_jax.models import fp8, moe


def schedule_lengths(cfg: OptimConfig, train_iters: int, train_samples: int | None = None):
    """(warmup, decay, WSD anneal) lengths of Megatron's scheduler in its own unit: iterations
    for iteration-based flags, samples for sample-based ones (`train_samples` given).

    Megatron counts both in samples (an iteration-based length is iterations x global batch);
    with a constant batch the ratios are the same, so iteration-based lengths stay in
    iterations and `schedule_position` divides the sample count by the batch instead."""
    if train_samples is None:
        decay = float(cfg.lr_decay_iters if cfg.lr_decay_iters is not None else train_iters)
        warmup, wsd = float(cfg.lr_warmup_iters), cfg.lr_wsd_decay_iters
    else:
        decay = float(cfg.lr_decay_samples if cfg.lr_decay_samples is not None else train_samples)
        warmup, wsd = float(cfg.lr_warmup_samples), cfg.lr_wsd_decay_samples
    if cfg.lr_warmup_fraction is not None:
        warmup = cfg.lr_warmup_fraction * decay
    anneal = float(wsd if wsd is not None else max(1, int(0.1 * (decay - warmup))))
    return warmup, decay, anneal


def lr_at(cfg: OptimConfig, train_iters: int, step, train_samples: int | None = None):
    """Megatron's OptimizerParamScheduler.get_lr at scheduler position `step` (jnp-traceable):
    completed iterations for iteration-based flags, samples of the completed updates for
    sample-based ones (`train_samples` given; Megatron's `num_steps`).

    Linear warmup from `lr_warmup_init` over the warmup length, then decay from `lr` to
    `min_lr` until the decay length (default: the whole run), `min_lr` after. WSD holds `lr`
    and anneals over the last WSD-decay length of the decay window.
    """
    step = jnp.asarray(step, jnp.float32)
    max_lr, min_lr, init = cfg.lr, cfg.min_lr, cfg.lr_warmup_init
    warmup, decay_steps, anneal = schedule_lengths(cfg, train_iters, train_samples)
    if init:
        warm_lr = init + (max_lr - init) * step / max(warmup, 1.0)
    else:  # today's expression, kept bit for bit
        warm_lr = max_lr * step / max(warmup, 1.0)
    if cfg.lr_decay_style == "constant":
        after = jnp.asarray(max_lr, jnp.float32)
    else:
        if cfg.lr_decay_style == "WSD":
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


def schedule_position(global_batch_size: int, train_samples: int | None, samples):
    """The scheduler position `lr_at` takes, from the samples of the completed updates (the
    train state's counter, int32): those samples for sample-based training; for iteration-based
    training samples / global batch, split into whole and remainder so that a constant batch
    gives exactly the iteration count."""
    if train_samples is not None:
        return jnp.asarray(samples, jnp.float32)
    whole, part = jnp.divmod(samples, global_batch_size)
    return whole.astype(jnp.float32) + part.astype(jnp.float32) / global_batch_size


def lr_for(cfg, samples):
    """The learning rate of the update after `samples` scheduled samples (`cfg`: a Config)."""
    t = cfg.train
    return lr_at(cfg.optim, t.train_iters, schedule_position(t.global_batch_size, t.train_samples, samples),
                 t.train_samples)


def decoupled_lr_for(cfg, samples):
    """--decoupled-lr's learning rate at the same scheduler position (None without the flag)."""
    if cfg.optim.decoupled_lr is None:
        return None
    return lr_for(cfg.replace(optim=decoupled_config(cfg.optim)), samples)


def apply_lr(updates, lr, decoupled_lr=None):
    """`make_optimizer`'s updates (the negative AdamW direction) times the learning rate; with
    `decoupled_lr` (--decoupled-lr), times that one on the embedding and output layer."""
    if decoupled_lr is None:
        return jax.tree.map(lambda u: lr.astype(u.dtype) * u, updates)
    return jax.tree.map(lambda u, m: (decoupled_lr if m else lr).astype(u.dtype) * u,
                        updates, decoupled_mask(updates))


_NO_DECAY = frozenset({"bqkv", "bo", "b1", "b2", "bias", "scale"})


def decay_mask(params) -> dict:
    """Weight decay on matrices only: not on biases or norm scales (Megatron's no_wd rule), nor on
    delayed fp8 scaling's amax histories or the MoE expert biases (no weights: the step writes
    them, `fp8.rolled`, `moe.biased`)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: getattr(path[-1], "key", None) not in _NO_DECAY and not fp8.is_history(path)
        and not moe.is_expert_bias(path), params
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


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """Clipping and AdamW with a unit learning rate: the step multiplies the updates by
    `lr_for(state's sample counter)` (`apply_lr`), since Megatron's scheduler is driven by
    consumed samples, which optax's update counter cannot see. The schedule slot stays (a
    constant 1) so optimizer states keep their structure, and checkpoints with them."""
    schedule = lambda count: 1.0  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_grad) if cfg.clip_grad > 0 else optax.identity(),
        optax.adamw(
            learning_rate=schedule,
            b1=cfg.adam_beta1,
            b2=cfg.adam_beta2,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        ),
    )


def optimizer_shardings(tx: optax.GradientTransformation, shapes: dict, param_sharding: dict, mesh):
    """The shardings of `tx`'s state for parameters of `shapes` stored as `param_sharding`: the
    moments exactly like their parameters (sharded over `data` too under ZeRO), the counters
    replicated."""
    from jax.sharding import NamedSharding

    from mlm_jax.sharding.specs import replicated

    return optax.tree_map_params(tx, lambda _, s: s, jax.eval_shape(tx.init, shapes), param_sharding,
                                 transform_non_params=lambda _: NamedSharding(mesh, replicated()))

