"""Multi-token prediction (DeepSeek-V3; Megatron-Core's `MultiTokenPredictionBlock`, --mtp-num-layers D).

Depth k (1..D) predicts the token k + 1 places ahead. Its input is the previous depth's output h
(depth 1: the model's last hidden state after the final norm) and the embedding of the tokens
rolled k places to the left (the shared embedding); it runs
    x = eh_proj([enorm(embedding); hnorm(h)]),  x = its transformer layer(x),  h = final_norm(x)
and the shared LM head turns h into logits scored against the labels rolled k places (the loss
mask rolled with them, the rolled-in last k positions masked). The layer is the model's last
layer's kind (a MoE layer in DeepSeek-V3). The layers live in `models/gpt.py` (`MTPLayer`);
the rolling, the loss term and the metrics here.

The MTP losses add to the training objective as Megatron's `MTPLossAutoScaler` adds them:
--mtp-loss-scaling-factor / D times the sum over depths of each microbatch's mean loss, and they
are not part of the reported LM loss; each depth's mean is logged (`mtp_1 loss`, ...).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from mlm_jax.models.moe import row_ranks, whole_microbatch


def roll_left(x_bs: jax.Array, k: int, order=None) -> jax.Array:
    """x shifted k places to the left along the sequence, zeros rolled in (Megatron's `roll_tensor`
    k times). `order`: [s] the original index of each stored position where the sequence is
    stored in context parallelism's chunk order (`trace.current().seq_order`): the roll is along
    the original sequence (these are [b, s] token ids, labels and masks: gathered across the
    context ranks, a few bytes a token)."""
    if order is None:
        return jnp.concatenate([x_bs[:, k:], jnp.zeros_like(x_bs[:, :k])], axis=1)
    order = np.asarray(order)
    return jnp.take(roll_left(jnp.take(x_bs, np.argsort(order), axis=1), k), order, axis=1)


def loss_term(depth_sums: list, depth_counts: list, loss_mask_bs, scaling: float) -> tuple[jax.Array, dict]:
    """(loss term, metrics) of one microbatch's MTP depths: each depth's masked loss sum (this
    rank's rows) and its masked-token count (this rank's).

    The term is w - stop_gradient(w), w = tokens x scaling / D x sum_k mean_k (the means over the
    whole microbatch): nothing in the reported loss, and once the step divides by the batch's
    token count its gradient is the token-weighted mean over microbatches (as `moe.aux_terms`)."""
    tokens = whole_microbatch(jnp.sum(loss_mask_bs).astype(jnp.float32))
    means = [s / jnp.maximum(whole_microbatch(n.astype(jnp.float32)), 1.0) for s, n in zip(depth_sums, depth_counts)]
    w = tokens * scaling / len(means) * sum(means)
    metrics = {f"mtp_{k + 1}_loss": jax.lax.stop_gradient(m) for k, m in enumerate(means)}
    metrics["mtp_microbatches"] = jnp.full((), 1.0 / row_ranks(), jnp.float32)
    return w - jax.lax.stop_gradient(w), metrics


def record(aux: dict) -> dict:
    """Each depth's loss, averaged over the step's microbatches ({} without MTP)."""
    mb = float(aux.get("mtp_microbatches", 0.0))
    if not mb:
        return {}
    return {k: float(v) / mb for k, v in sorted(aux.items()) if k.startswith("mtp_") and k.endswith("_loss")}


def format_line(aux: dict) -> str:
    """Megatron's console form, "mtp_1 loss: 3.2E+00 |", per depth ("" without MTP)."""
    return " ".join(f"{k[:-5]} loss: {v:.6E} |" for k, v in record(aux).items())
