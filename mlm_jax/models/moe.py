"""Mixture of experts: Megatron's router (softmax or sigmoid scores, top-k, load-balancing and
z losses, capacity dropping) and grouped experts, optionally with a shared expert.

The router runs on every token of the microbatch. Its statistics (load-balancing loss, load,
dropped fraction) are those of the whole microbatch, so every parallel layout computes the same
function; where the step runs each data-parallel rank's rows on their own to reduce gradients
once, it sums the router's counts over the ranks (the trace's `rank_split`). Capacity, as
Megatron sizes it (`moe_utils.get_capacity` on each rank's own tokens), is each data-parallel
rank's: the microbatch's rows route in the trace's `route_groups` equal blocks (one per rank of
the batch rows, data x expert), each block keeping at most C = capacity(its tokens) rows per
expert. A single device routes as one block unless the trace says otherwise (a test's
reference for a layout). The experts' grouped matmul is here (`expert_ffn`); the token dispatch to
expert-parallel ranks and the combine (shard_map over `expert`, all-to-all or all-gather) are
`mlm_jax/parallel/experts.py`'s, installed in the trace context by the step.

Formulas (Megatron-LM, megatron/core/transformer/moe/router.py and moe_utils.py), for T tokens,
E experts, top-k K, router logits z [T, E]:
  softmax:       probs = softmax(top-k(z))      (pre-softmax: top-k(softmax(z)))
  sigmoid:       s = sigmoid(z); probs = top-k(s) / sum(top-k(s)) (K > 1)
  aux_loss:      coeff * E / (K T) * sum_e count_e * mean_t score_te      (Switch)
  seq_aux_loss:  the same per sequence, averaged over the sequences
  z-loss:        coeff * mean_t logsumexp(z_t)^2
  scores for the aux losses: softmax(z) over all experts (sigmoid: s / sum_e s), counts from the
  top-k choice before any drop.
  capacity:      C = ceil(T K / E * capacity factor), T a routing group's tokens (a data-parallel
                 rank's); per expert and group, the C tokens with the highest probability
                 (policy probs) or the first C in token order (policy position) are kept, the
                 rest dropped (their weight 0: the residual carries them).

Shape letters: t token, e expert, k top-k choice, d embed, f expert mlp, b batch, s seq.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from mlm_jax.config import ModelConfig
from mlm_jax.kernels.grouped_matmul import XLA, grouped_matmul
from mlm_jax.models import fp8, recompute
from mlm_jax.models.layers import cast, mlp_activation, normal, param, zeros
from mlm_jax.models.mlp import MLP
from mlm_jax.sharding import trace
from mlm_jax.sharding.rules import constrain

# The per-layer statistics a MoE layer reports (summed over layers by the layer scan).
STAT_KEYS = ("load_balancing_loss", "z_loss", "imbalance", "dropped_fraction", "moe_layers")


@dataclasses.dataclass
class Routing:
    """The router's decision for T tokens: expert ids [T, K], combine weights [T, K] (0 where
    dropped), kept [T, K] (bool), and the layer's statistics (scalars, see STAT_KEYS)."""

    experts_tk: jax.Array
    weights_tk: jax.Array
    kept_tk: jax.Array
    stats: dict


# Where the step runs each data-parallel rank's rows on their own (the reduce-once step, the
# pipeline's per-rank schedule), the trace's `rank_split` is (manual axes, ranks): this program
# holds one of `ranks` row blocks of the microbatch. The router's statistics stay those of the
# whole microbatch: the counts the losses need are summed over the ranks (a psum of a few
# scalars per layer, no gradient through it) and every reported loss and metric becomes this
# rank's share, so that summing the ranks' losses, gradients and metrics gives the whole
# microbatch's. Capacity is the rank's own: its rows are one routing group.


def _split_axes():
    split = trace.current().rank_split
    return None if split is None else split[0]


def whole_microbatch(x):
    """The whole microbatch's sum of a per-rank statistic `x` (no gradient through it)."""
    axes = _split_axes()
    if axes is None:
        return x
    return jax.lax.psum(jax.lax.stop_gradient(x), axes)


def row_ranks() -> int:
    split = trace.current().rank_split
    return 1 if split is None else split[1]


def capacity(num_tokens: int, cfg: ModelConfig) -> int:
    """Megatron's per-expert capacity of a routing group of `num_tokens` tokens: ceil(tokens x
    top-k / experts x capacity factor)."""
    K, E = cfg.moe_router_topk, cfg.num_experts
    return int(math.ceil(num_tokens * K / E * cfg.moe_expert_capacity_factor))


def route_groups(rows: int) -> int:
    """How many routing groups (each with its own capacity) `rows` batch rows here hold: the
    trace's `route_groups` (1 in a per-rank body, whose rows are one rank's), or 1 where the rows
    do not split evenly into them (decoding a few prompts)."""
    groups = trace.current().route_groups
    return groups if rows % groups == 0 else 1


def top_k(cfg: ModelConfig, scores_te):
    """(values, indices) [T, K] of each token's top-k experts; with group-limited routing
    (--moe-router-num-groups G, --moe-router-group-topk g) among the experts of its g best groups,
    a group scored by the sum of its best K/g scores (Megatron-Core's `group_limited_topk`)."""
    K, G, g = cfg.moe_router_topk, cfg.moe_router_num_groups, cfg.moe_router_group_topk
    if not G:
        return jax.lax.top_k(scores_te, K)
    T, E = scores_te.shape
    group_tg = jnp.sum(jax.lax.top_k(scores_te.reshape(T, G, E // G), K // g)[0], axis=-1)  # [T, G]
    _, best_tg = jax.lax.top_k(group_tg, g)
    in_best_tg = jnp.any(jax.nn.one_hot(best_tg, G, dtype=bool), axis=1)  # [T, G]
    allowed_te = jnp.repeat(in_best_tg, E // G, axis=1)
    return jax.lax.top_k(jnp.where(allowed_te, scores_te, -jnp.inf), K)


def _scores_and_choice(cfg: ModelConfig, logits_te, bias_e=None):
    """(probs [T, K], experts [T, K], scores for the aux loss [T, E]); `bias_e` the expert bias
    (--moe-router-enable-expert-bias), added to the scores for the choice only."""
    probs, idx, scores = _unscaled_choice(cfg, logits_te, bias_e)
    if cfg.moe_router_topk_scaling_factor:
        probs = probs * cfg.moe_router_topk_scaling_factor
    return probs, idx, scores


def _unscaled_choice(cfg: ModelConfig, logits_te, bias_e=None):
    K = cfg.moe_router_topk
    if cfg.moe_router_score_function == "sigmoid":
        s = jax.nn.sigmoid(logits_te)
        if bias_e is None:
            top, idx = top_k(cfg, s)
        else:
            _, idx = top_k(cfg, s + jax.lax.stop_gradient(bias_e))
            top = jnp.take_along_axis(s, idx, axis=1)
        probs = top / (jnp.sum(top, -1, keepdims=True) + 1e-20) if K > 1 else top
        return probs, idx, s / (jnp.sum(s, -1, keepdims=True) + 1e-20)
    full = jax.nn.softmax(logits_te, axis=-1)
    if cfg.moe_router_pre_softmax:
        probs, idx = top_k(cfg, full)
    else:
        top, idx = top_k(cfg, logits_te)
        probs = jax.nn.softmax(top, axis=-1)
    return probs, idx, full


def load_balancing_loss(cfg: ModelConfig, scores_bse, chosen_bse) -> jax.Array:
    """Megatron's aux_loss (whole microbatch) or seq_aux_loss (per sequence), with its coeff.

    scores [b, s, E] fp32, chosen [b, s, E] 0/1 (the top-k choice before drops)."""
    kind, E, K = cfg.moe_router_load_balancing_type, cfg.num_experts, cfg.moe_router_topk
    if kind == "none" or cfg.moe_aux_loss_coeff == 0.0:
        return jnp.zeros((), jnp.float32)
    b, s = scores_bse.shape[:2]
    if kind == "seq_aux_loss":  # a mean over sequences: a rank's share is its sequences' sum / all
        f_be = jnp.sum(chosen_bse, axis=1) * E / (s * K)  # [b, E]
        per_seq = jnp.sum(f_be * jnp.mean(scores_bse, axis=1), -1)  # [b]
        return cfg.moe_aux_loss_coeff * jnp.sum(per_seq) / (b * row_ranks())
    T = b * s * row_ranks()  # the whole microbatch's tokens
    f_e = whole_microbatch(jnp.sum(chosen_bse, axis=(0, 1))) * E / (T * K)  # [E]
    p_e = jnp.sum(scores_bse, axis=(0, 1)) / T  # [E], this rank's share of the mean
    return cfg.moe_aux_loss_coeff * jnp.sum(f_e * p_e)


def z_loss(cfg: ModelConfig, logits_te) -> jax.Array:
    """Router z-loss (ST-MoE): coeff x mean over tokens of logsumexp(logits)^2."""
    if not cfg.moe_z_loss_coeff:
        return jnp.zeros((), jnp.float32)
    lse_sq = jnp.square(jax.nn.logsumexp(logits_te, axis=-1))
    return cfg.moe_z_loss_coeff * jnp.sum(lse_sq) / (lse_sq.shape[0] * row_ranks())


def keep_mask(cfg: ModelConfig, probs_tk, experts_tk, groups: int = 1) -> jax.Array:
    """[T, K] bool: True where the choice survives the capacity (all True when dropless). The T
    tokens (b-major) route in `groups` equal blocks of consecutive tokens, each with capacity C of
    its own tokens."""
    if cfg.moe_expert_capacity_factor is None:
        return jnp.ones(experts_tk.shape, bool)
    T, E = experts_tk.shape[0], cfg.num_experts
    n = T // groups  # a group's tokens
    C = capacity(n, cfg)
    onehot_gne = jax.nn.one_hot(experts_tk, E, dtype=jnp.int32).reshape(groups, n, -1, E)  # [g, n, K, E]
    chosen_gne = jnp.sum(onehot_gne, axis=2)  # [g, n, E]
    if cfg.moe_token_drop_policy == "position":
        arrival_gne = jnp.cumsum(chosen_gne, axis=1)  # 1-based arrival order per expert and group
        keep_gne = (chosen_gne > 0) & (arrival_gne <= C)
    else:  # the C most probable chosen tokens per expert and group
        prob_gne = jnp.sum(onehot_gne * probs_tk.reshape(groups, n, -1, 1), axis=2)  # 0 where not chosen
        score_gen = jnp.swapaxes(jnp.where(chosen_gne > 0, prob_gne, -1.0), 1, 2)  # [g, E, n]
        _, top_gec = jax.lax.top_k(score_gen, min(C, n))  # [g, E, C]
        keep_gen = jnp.zeros(score_gen.shape, bool).at[
            jnp.arange(groups)[:, None, None], jnp.arange(E)[None, :, None], top_gec].set(True)
        keep_gne = jnp.swapaxes(keep_gen, 1, 2) & (chosen_gne > 0)
    return jnp.take_along_axis(keep_gne.reshape(T, E), experts_tk, axis=1)  # [T, K]


# --------------------------------------------------------------------------- the expert bias
# Aux-loss-free balancing (DeepSeek-V3; Megatron-Core's --moe-router-enable-expert-bias): each MoE
# layer's `expert_bias` [E] (fp32, a parameter no optimizer moves) is added to the sigmoid scores
# for the top-k choice. The tokens each expert kept in a microbatch come back as the bias's
# "gradient" (`_loads_as_gradient`), so the step's gradient sums (microbatches, then the ranks:
# data, expert, tensor) make them the whole step's loads, as Megatron's all-reduce over the
# tensor, data and context ranks does; the step then moves the bias (`biased`, `updated_bias`).
EXPERT_BIAS = "expert_bias"


def is_expert_bias(path) -> bool:
    """Whether a pytree key path leads to an expert bias leaf."""
    return str(getattr(path[-1], "key", path[-1])) == EXPERT_BIAS if path else False


@jax.custom_vjp
def _loads_as_gradient(bias_e, loads_e):
    return bias_e


_loads_as_gradient.defvjp(lambda bias_e, loads_e: (bias_e, loads_e),
                          lambda loads_e, g: (loads_e.astype(g.dtype), jnp.zeros_like(loads_e)))


def updated_bias(bias, loads, rate: float):
    """Megatron-Core's `get_updated_expert_bias`: bias + rate x sign(mean load - load), per layer
    (the last dim the experts)."""
    return bias + rate * jnp.sign(jnp.mean(loads, axis=-1, keepdims=True) - loads)


def without_loads(grads):
    """The gradients with the expert biases' loads zeroed (no optimizer, norm or clipping sees them)."""
    return jax.tree_util.tree_map_with_path(lambda p, g: jnp.zeros_like(g) if is_expert_bias(p) else g, grads)


def biased(params, grads, rate: float):
    """The parameters with each expert bias moved by the step's loads (its "gradient")."""
    return jax.tree_util.tree_map_with_path(
        lambda p, prm, g: updated_bias(prm, g.astype(prm.dtype), rate) if is_expert_bias(p) else prm, params, grads)


def route(cfg: ModelConfig, logits_bse, bias_e=None) -> Routing:
    """The router's choice for a microbatch's fp32 logits [b, s, E] (tokens flattened b-major);
    `bias_e` the layer's expert bias (or None)."""
    b, s, E = logits_bse.shape
    logits_te = logits_bse.reshape(b * s, E)  # [T, E]
    probs_tk, experts_tk, scores_te = _scores_and_choice(cfg, logits_te, bias_e)
    chosen_te = jnp.sum(jax.nn.one_hot(experts_tk, E, dtype=jnp.float32), axis=1)  # [T, E]
    lb = load_balancing_loss(cfg, scores_te.reshape(b, s, E), chosen_te.reshape(b, s, E))
    kept_tk = keep_mask(cfg, probs_tk, experts_tk, route_groups(b))
    counts_e = whole_microbatch(jnp.sum(jax.nn.one_hot(experts_tk, E, dtype=jnp.float32) * kept_tk[..., None], axis=(0, 1)))
    total = float(b * s * cfg.moe_router_topk * row_ranks())
    share = 1.0 / row_ranks()  # the whole microbatch's figures below, split evenly over the ranks
    stats = {
        "load_balancing_loss": lb,
        "z_loss": z_loss(cfg, logits_te),
        # Busiest expert's tokens over the mean (1.0: perfectly balanced).
        "imbalance": share * jnp.max(counts_e) / (total / E),
        "dropped_fraction": share * (1.0 - jnp.sum(counts_e) / total),
        "moe_layers": jnp.full((), share, jnp.float32),
    }
    weights_tk = jnp.where(kept_tk, probs_tk, 0.0)
    if bias_e is not None:  # this rank's loads come back as the bias's gradient (0 x: no other effect)
        loads_e = jnp.sum(jax.nn.one_hot(experts_tk, E, dtype=jnp.float32) * kept_tk[..., None], axis=(0, 1))
        weights_tk = weights_tk + 0.0 * _loads_as_gradient(bias_e, jax.lax.stop_gradient(loads_e))[experts_tk]
    return Routing(experts_tk, weights_tk, kept_tk, stats)


def zero_stats() -> dict:
    """A dense layer's statistics: the MoE structure, all zero."""
    return {k: jnp.zeros((), jnp.float32) for k in STAT_KEYS}


class MoE(nnx.Module):
    """[batch, seq, embed] -> [batch, seq, embed] through the top-k of E experts (+ a shared
    expert); returns (output, statistics). Expert weights: w1 [E, d, (2,) f], w2 [E, f, d], the
    experts dim over `expert`, f over `tensor` (expert tensor parallelism = tensor size); b2 [E, d]
    whole."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, E, std = cfg.hidden_size, cfg.moe_ffn_size, cfg.num_experts, cfg.init_method_std
        out_std = std / math.sqrt(2.0 * cfg.num_layers)
        self.cfg = cfg
        self.router = param(rngs, normal(std), (d, E), ("embed", None))
        w1_shape, w1_names = (((E, d, 2, f), ("experts", "embed", None, "mlp")) if cfg.swiglu
                              else ((E, d, f), ("experts", "embed", "mlp")))
        self.w1 = param(rngs, normal(std), w1_shape, w1_names)
        self.w2 = param(rngs, normal(out_std), (E, f, d), ("experts", "mlp", "embed"))
        if cfg.add_bias_linear:
            self.b1 = param(None, zeros, (E, *w1_shape[2:]), ("experts", *w1_names[2:]))
            # Whole on every expert rank: it is applied outside the dispatch, by global expert id
            # (small: E x d).
            self.b2 = param(None, zeros, (E, d), (None, "embed"))
        else:
            self.b1 = self.b2 = None
        shared = cfg.moe_shared_expert_intermediate_size
        self.shared = MLP(dataclasses.replace(cfg, ffn_hidden_size=shared), rngs) if shared else None
        self.expert_bias = (nnx.Param(jnp.zeros((E,), jnp.float32), out_sharding=(None,))
                            if cfg.moe_router_enable_expert_bias else None)

    def __call__(self, y_bsd) -> tuple[jax.Array, dict]:
        # The expert-parallel dispatch where a step installed one (parallel/experts.py).
        dispatch_and_combine = trace.current().expert_dispatch or _all_experts_here_no_drops
        cfg, dt = self.cfg, y_bsd.dtype
        b, s, d = y_bsd.shape
        logits = jnp.einsum("bsd,de->bse", y_bsd.astype(jnp.float32), self.router[...])  # [b, s, E] fp32
        r = route(cfg, logits, None if self.expert_bias is None else self.expert_bias[...])
        experts_bsk = r.experts_tk.reshape(b, s, -1)
        weights_bsk = r.weights_tk.reshape(b, s, -1).astype(dt)
        out, dropped = dispatch_and_combine(cfg, y_bsd, experts_bsk, weights_bsk, cast(self.w1, dt),
                                            cast(self.w2, dt), cast(self.b1, dt))
        stats = with_buffer_drops(cfg, r.stats, dropped, b * s)
        if self.b2 is not None:  # sum_k weight_k * b2[expert_k]: linear, so outside the dispatch
            out = out + jnp.einsum("bsk,bskd->bsd", weights_bsk, cast(self.b2, dt)[experts_bsk])
        if self.shared is not None:
            out = out + recompute.module(cfg, "shared_experts", lambda y: self.shared(y), y_bsd)
        return constrain(out, ("batch", None, "embed")), stats


def with_buffer_drops(cfg: ModelConfig, stats: dict, dropped, tokens: int) -> dict:
    """The router's statistics with the (token, choice) rows the expert dispatch's receive
    buffers dropped (--moe-receive-buffer-factor; `dropped`: this program's, of its `tokens`)
    added to the dropped fraction, on the router's terms (the whole microbatch's, this rank's share)."""
    total = float(tokens * cfg.moe_router_topk * row_ranks())
    drops = whole_microbatch(jax.lax.stop_gradient(dropped)) / (total * row_ranks())
    return {**stats, "dropped_fraction": stats["dropped_fraction"] + drops}


def aux_record(aux: dict) -> dict:
    """The MoE metrics of a step's metrics["aux"] (summed over microbatches) for the metrics
    file: load-balancing and z losses summed over MoE layers, the busiest expert's load over the
    mean and the dropped fraction averaged over them; each averaged over the microbatches.
    Empty for a dense model."""
    mb = float(aux.get("moe_microbatches", 0.0))
    if not mb:
        return {}
    layers = max(float(aux["moe_layers"]), 1.0)  # MoE layer passes, summed like the rest
    return {"moe_load_balancing_loss": float(aux["moe_load_balancing_loss"]) / mb,
            "moe_z_loss": float(aux["moe_z_loss"]) / mb,
            "moe_imbalance": float(aux["moe_imbalance"]) / layers,
            "moe_dropped_fraction": float(aux["moe_dropped_fraction"]) / layers}


def format_aux(aux: dict) -> str:
    """The MoE part of a console log line ("" for a dense model), from metrics["aux"]."""
    r = aux_record(aux)
    if not r:
        return ""
    return (f"load balancing loss: {r['moe_load_balancing_loss']:.4E} | z loss: {r['moe_z_loss']:.4E} | "
            f"expert load max/mean: {r['moe_imbalance']:.3f} | dropped tokens: {100 * r['moe_dropped_fraction']:.2f}% |")


def aux_terms(stats: dict, loss_mask_bs) -> tuple[jax.Array, dict]:
    """(loss term, metrics) of one microbatch's summed layer statistics.

    The loss term is w - stop_gradient(w), w = tokens x (load-balancing + z losses): it adds
    nothing to the reported loss but its gradient, once the step divides the loss by the
    global batch's token count, is that of the token-weighted mean over microbatches of the
    MoE losses (Megatron adds them with the same effect through its aux-loss autoscaler)."""
    if not stats:
        return jnp.zeros((), jnp.float32), {}
    tokens = whole_microbatch(jnp.sum(loss_mask_bs).astype(jnp.float32))  # the whole microbatch's
    w = tokens * (stats["load_balancing_loss"] + stats["z_loss"])
    # Sums (over layers here, over microbatches and pipeline stages by the step); `aux_record`
    # turns them into means.
    metrics = {
        "moe_load_balancing_loss": jax.lax.stop_gradient(stats["load_balancing_loss"]),
        "moe_z_loss": jax.lax.stop_gradient(stats["z_loss"]),
        "moe_imbalance": jax.lax.stop_gradient(stats["imbalance"]),
        "moe_dropped_fraction": jax.lax.stop_gradient(stats["dropped_fraction"]),
        "moe_layers": jax.lax.stop_gradient(stats["moe_layers"]),
        "moe_microbatches": jnp.full((), 1.0 / row_ranks(), jnp.float32),
    }
    return w - jax.lax.stop_gradient(w), metrics


# --------------------------------------------------------------------------- the experts' compute
# The experts run as one grouped matmul over rows sorted by expert (`kernels.grouped_matmul`: a
# Pallas kernel on NVIDIA GPUs, where XLA's `ragged_dot` is a dense product over every expert;
# `ragged_dot` elsewhere), or, with --moe-pad-expert-input-to-capacity, as a batched matmul over
# [experts, capacity] slots.
# Shape letters here: r row (= token x choice). The dispatch of tokens to expert-parallel ranks
# (shard_map over `expert`) is `parallel/experts.py`'s, installed in the trace context.


# What the expert-parallel dispatch keeps for its backward (parallel/experts.py): the experts'
# two products (the second's input is one activation of the first; its output the router
# weights' gradient needs) and the rows it received (EXPERT_ROWS), nothing else, so no matmul or
# collective runs twice.
EXPERT_HIDDEN, EXPERT_OUT, EXPERT_ROWS = recompute.EXPERT_VALUES


def expert_ffn(cfg: ModelConfig, x_rd, ids_r, w1, w2, b1, cap: int | None, grouped: bool = False):
    """Rows x [R, d] through expert ids_r (local ids; id == n_local marks an empty row, output 0).

    w1 [n_local, d, (2,) f], w2 [n_local, f, d], b1 [n_local, (2,) f] or None. The partial sum
    over a tensor-split f is returned unreduced. `cap`: run as [n_local, cap] slots (padded to
    capacity) instead of the grouped matmul; every expert must have at most `cap` rows.
    `grouped`: the rows already come grouped by expert, empty rows last (no sort, no gathers)."""
    n_local, R = w1.shape[0], x_rd.shape[0]
    order = None if grouped else jnp.argsort(ids_r, stable=True)  # rows grouped by expert, empty rows last
    ids_s = ids_r if grouped else ids_r[order]
    xs = x_rd if grouped else x_rd[order]  # [R, d]
    sizes = jnp.bincount(ids_r, length=n_local + 1)[:n_local].astype(jnp.int32)  # [n_local]
    valid = ids_s < n_local
    rec = fp8.experts(cfg)
    if cap is None:
        gmm = (functools.partial(grouped_matmul, implementation=None if cfg.moe_grouped_gemm else XLA)
               if rec is None else functools.partial(fp8.grouped, rec=rec))
        w1_flat = w1.reshape(n_local, w1.shape[1], -1)  # [e, d, (2*)f]
        h = checkpoint_name(gmm(xs, w1_flat, sizes), EXPERT_HIDDEN).reshape(R, *w1.shape[2:])  # [r, (2,) f]
        if b1 is not None:
            h = h + b1[jnp.minimum(ids_s, n_local - 1)]
        # --recompute-modules moe_act: the activation's output recomputed for the product's backward
        ys = recompute.module(cfg, "moe_act", lambda h: gmm(jnp.where(
            valid[:, None], mlp_activation(h, cfg.swiglu, cfg.openai_gelu, 1), 0), w2, sizes), h)
        ys = checkpoint_name(ys, EXPERT_OUT)  # [r, d]
    else:
        starts = jnp.cumsum(sizes) - sizes
        slot = jnp.arange(R) - starts[jnp.minimum(ids_s, n_local - 1)]
        e_idx = jnp.where(valid, ids_s, n_local)  # out of range: dropped by the scatter
        buf = jnp.zeros((n_local, cap, x_rd.shape[1]), x_rd.dtype).at[e_idx, slot].set(xs, mode="drop")
        product = jnp.einsum if rec is None else (lambda spec, a, b: fp8.bound_einsum(spec, a, b, rec))
        h = product("ecd,edf->ecf", buf, w1.reshape(n_local, w1.shape[1], -1)).reshape(*buf.shape[:2], *w1.shape[2:])
        h = checkpoint_name(h, EXPERT_HIDDEN)  # [e, c, (2,) f]
        if b1 is not None:
            h = h + b1[:, None]
        y_ecd = recompute.module(cfg, "moe_act", lambda h: product(
            "ecf,efd->ecd", mlp_activation(h, cfg.swiglu, cfg.openai_gelu, 2), w2), h)
        y_ecd = checkpoint_name(y_ecd, EXPERT_OUT)
        ys = jnp.where(valid[:, None], y_ecd.at[e_idx, slot].get(mode="fill", fill_value=0), 0)
    return ys if grouped else jnp.zeros_like(ys).at[order].set(ys)  # back to the input row order


def row_capacity(cfg: ModelConfig, tokens_per_group: int, groups: int = 1) -> int | None:
    """Slots per expert with --moe-pad-expert-input-to-capacity: the capacity of `groups` routing
    groups of `tokens_per_group` tokens each (an expert receives at most C rows from each)."""
    if not cfg.moe_pad_expert_input_to_capacity:
        return None
    return groups * capacity(tokens_per_group, cfg)


def local_experts(cfg, x_td, e_tk, w_tk, w1, w2, b1, cap):
    """Every expert on this device: [T, d] -> [T, d] (partial over a tensor-split f)."""
    T, K = e_tk.shape
    ids = jnp.where(w_tk != 0, e_tk, w1.shape[0]).reshape(T * K)  # dropped rows: empty
    y_rd = expert_ffn(cfg, jnp.repeat(x_td, K, axis=0), ids, w1, w2, b1, cap)  # [T*K, d]
    return jnp.einsum("tk,tkd->td", w_tk, y_rd.reshape(T, K, -1))


def _all_experts_here_no_drops(*args):
    return all_experts_here(*args), jnp.zeros((), jnp.float32)


def all_experts_here(cfg, y_bsd, experts_bsk, weights_bsk, w1, w2, b1):
    """Every expert on every token, here: [b, s, d] -> [b, s, d] (no mesh, or nothing to split)."""
    b, s, d = y_bsd.shape
    groups = route_groups(b)
    cap = row_capacity(cfg, b * s // groups, groups)
    out = local_experts(cfg, y_bsd.reshape(b * s, d), experts_bsk.reshape(b * s, -1),
                 weights_bsk.reshape(b * s, -1), w1, w2, b1, cap)
    return out.reshape(b, s, d)
