"""Mixture of experts (mlm_jax/models/moe.py, mlm_jax/parallel/experts.py).

Checked here:
  - the MoE layer (dropless, grouped matmul) equals a per-token dense reference written below
    (every token through its top-k experts, weighted as the router says): output and every
    gradient, GELU with biases and SwiGLU without, softmax, pre-softmax and sigmoid routers;
  - the load-balancing (aux_loss, seq_aux_loss) and z losses equal numpy hand computations;
  - capacity dropping keeps exactly the tokens the policy names (probs: the most probable per
    expert; position: the first in token order), and padding to capacity computes the same;
  - every parallel layout equals one device: EP = 2 and 4 with each dispatcher, EP x TP x DP
    with sequence parallelism and ZeRO, EP x PP, a mixed dense/MoE pattern, capacity dropping
    with padding under EP (loss and every gradient leaf, fp32, tests/test_parallel.py's
    tolerances);
  - the flags (the layer-pattern syntax, the refusals naming the flag);
  - the alltoall dispatcher's ragged path (NVIDIA targets; XLA:CPU has no ragged all-to-all):
    its offsets and sizes against numpy, and the layouts' loss and gradients with the
    collective emulated (jnp and a dense all_to_all, as jax's docstring defines it).

The reference of a layout has the same microbatches (rows per microbatch) as the layout: the
MoE losses and capacities are per microbatch, so their split must match. Capacity is each
data-parallel rank's (Megatron's `get_capacity` on a rank's own tokens): the reference of a
layout with capacity dropping runs on one device with each microbatch's rows routed in as many
equal blocks as the layout has ranks of batch rows (data x expert; the trace's `route_groups`),
each block with its own capacity: the tokens a rank of the layout holds.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mlm_jax.arguments import parse_args
from mlm_jax.config import ConfigError, ModelConfig, ParallelConfig
from mlm_jax.models import moe as moe_lib
from mlm_jax.models.moe import MoE, route
from mlm_jax.sharding import trace
from mlm_jax.validation import finalize
from tests.parallel_util import VOCAB, grads_for, tiny_config, unpad
from tests.test_parallel import GRAD_RTOL, LOSS_ATOL, assert_trees_close

E, K, D, F = 4, 2, 16, 32


def layer_cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=D, num_attention_heads=2, num_experts=E, moe_router_topk=K,
                moe_ffn_hidden_size=F, vocab_size=64)
    return ModelConfig(**{**base, **kw})


def make_layer(cfg: ModelConfig, seed: int = 0) -> MoE:
    with nnx.use_eager_sharding(False):
        layer = MoE(cfg, nnx.Rngs(seed))
    # Non-zero biases, so that their routing to the right expert is checked too.
    for name in ("b1", "b2"):
        p = getattr(layer, name)
        if p is not None:
            p[...] = jax.random.normal(jax.random.key(7), p[...].shape) * 0.1
    return layer


def dense_reference(cfg: ModelConfig, params: dict, x_bsd):
    """Every expert on every token, weighted by a dense [T, E] gate built token by token from
    the router's top-k (the per-token definition of a dropless MoE)."""
    b, s, d = x_bsd.shape
    x = x_bsd.reshape(b * s, d)
    logits = x @ params["router"]  # [T, E]
    if cfg.moe_router_score_function == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        top, idx = jax.lax.top_k(scores, K)
        probs = top / jnp.sum(top, -1, keepdims=True)
    elif cfg.moe_router_pre_softmax:
        probs, idx = jax.lax.top_k(jax.nn.softmax(logits, -1), K)
    else:
        top, idx = jax.lax.top_k(logits, K)
        probs = jax.nn.softmax(top, -1)
    gate = jnp.zeros((b * s, E)).at[jnp.arange(b * s)[:, None], idx].set(probs)  # [T, E]
    outs = []
    for e in range(E):
        if cfg.swiglu:
            h = jnp.einsum("td,dnf->tnf", x, params["w1"][e])
            u = jax.nn.silu(h[:, 0]) * h[:, 1]
        else:
            u = jax.nn.gelu(x @ params["w1"][e] + params["b1"][e], approximate=False)
        y = u @ params["w2"][e]
        outs.append(y + params["b2"][e] if "b2" in params else y)
    y_ted = jnp.stack(outs, 1)  # [T, E, d]
    return jnp.einsum("te,ted->td", gate, y_ted).reshape(b, s, d)


ROUTERS = {
    "softmax_gelu_bias": dict(),
    "pre_softmax_swiglu": dict(moe_router_pre_softmax=True, swiglu=True, add_bias_linear=False),
    "sigmoid_gelu": dict(moe_router_score_function="sigmoid"),
}


@pytest.mark.parametrize("name", list(ROUTERS))
def test_dropless_moe_equals_the_per_token_dense_reference(name):
    cfg = layer_cfg(**ROUTERS[name])
    layer = make_layer(cfg)
    graphdef, state = nnx.split(layer)
    params = nnx.to_pure_dict(state)
    x = jax.random.normal(jax.random.key(1), (2, 8, D))
    probe = jax.random.normal(jax.random.key(2), (2, 8, D))

    def ours(p, x):
        nnx.replace_by_pure_dict(state, p)
        return jnp.sum(nnx.merge(graphdef, state)(x)[0] * probe)

    def ref(p, x):
        return jnp.sum(dense_reference(cfg, p, x) * probe)

    (v_ours, g_ours) = jax.value_and_grad(ours, argnums=(0, 1))(params, x)
    (v_ref, g_ref) = jax.value_and_grad(ref, argnums=(0, 1))(params, x)
    assert abs(float(v_ours) - float(v_ref)) <= 1e-5 * max(1.0, abs(float(v_ref)))
    assert_trees_close(jax.tree.map(np.asarray, g_ref), jax.tree.map(np.asarray, g_ours), 1e-5)


# --------------------------------------------------------------------------- losses by hand


def _np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss"])
def test_load_balancing_and_z_losses_equal_hand_computations(kind):
    cfg = layer_cfg(moe_router_load_balancing_type=kind, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    b, s = 3, 5
    logits = np.random.default_rng(0).normal(size=(b, s, E)).astype(np.float32) * 2
    stats = route(cfg, jnp.asarray(logits)).stats
    scores = _np_softmax(logits.astype(np.float64))  # [b, s, E]
    chosen = np.zeros((b, s, E))
    for i in range(b):
        for j in range(s):
            chosen[i, j, np.argsort(-logits[i, j])[:K]] = 1
    if kind == "aux_loss":  # Switch: E / (K T) sum_e count_e mean_t p_te
        T = b * s
        want = 0.01 * E / (K * T) * np.sum(chosen.sum((0, 1)) * scores.mean((0, 1)))
    else:  # per sequence, then the mean over sequences
        want = 0.01 * np.mean([E / (K * s) * np.sum(chosen[i].sum(0) * scores[i].mean(0)) for i in range(b)])
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(float(stats["load_balancing_loss"]), want, rtol=1e-5)
    np.testing.assert_allclose(float(stats["z_loss"]), 0.001 * np.mean(lse ** 2), rtol=1e-5)
    assert float(stats["dropped_fraction"]) == 0.0
    counts = chosen.sum((0, 1))
    np.testing.assert_allclose(float(stats["imbalance"]), counts.max() / (b * s * K / E), rtol=1e-6)


def test_sigmoid_scores_for_the_aux_loss_are_normalised_over_experts():
    cfg = layer_cfg(moe_router_score_function="sigmoid", moe_aux_loss_coeff=1.0)
    logits = np.random.default_rng(1).normal(size=(1, 6, E)).astype(np.float32)
    stats = route(cfg, jnp.asarray(logits)).stats
    sig = 1 / (1 + np.exp(-logits[0].astype(np.float64)))
    scores = sig / sig.sum(-1, keepdims=True)
    chosen = np.zeros((6, E))
    for t in range(6):
        chosen[t, np.argsort(-sig[t])[:K]] = 1
    want = E / (K * 6) * np.sum(chosen.sum(0) * scores.mean(0))
    np.testing.assert_allclose(float(stats["load_balancing_loss"]), want, rtol=1e-5)


# --------------------------------------------------------------------------- capacity


@pytest.mark.parametrize("groups", [1, 2], ids=["one_rank", "two_ranks"])
@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_drops_exactly_the_tokens_the_policy_names(policy, groups):
    # 16 tokens (2 rows of 8), top-1, 2 experts, capacity factor 0.5, routed as `groups` ranks'
    # rows: C = ceil(16 / groups * 1 / 2 * 0.5) per expert and rank (4 on one, 2 on each of two).
    # Pre-softmax: with top-1 the post-top-k softmax would make every probability 1.
    cfg = layer_cfg(num_experts=2, moe_router_topk=1, moe_expert_capacity_factor=0.5,
                    moe_token_drop_policy=policy, moe_router_pre_softmax=True)
    C = moe_lib.capacity(16 // groups, cfg)
    assert C == 4 // groups
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 8, 2)).astype(np.float32)
    logits[:, :, 0] += 3.0  # most tokens prefer expert 0, so it overflows
    with trace.using(route_groups=groups):
        r = route(cfg, jnp.asarray(logits))
    probs = _np_softmax(logits.reshape(16, 2))
    choice = probs.argmax(-1)
    keep = np.zeros(16, bool)
    for g in range(groups):  # each rank's tokens on their own
        first = g * 16 // groups
        for e in range(2):
            mine = first + np.flatnonzero(choice[first:first + 16 // groups] == e)
            if policy == "probs":
                mine = mine[np.argsort(-probs[mine, e], kind="stable")]
            keep[mine[:C]] = True
    n = 16 // groups
    assert all((choice[g * n:(g + 1) * n] == 0).sum() > C for g in range(groups))  # every rank really drops
    np.testing.assert_array_equal(np.asarray(r.kept_tk)[:, 0], keep)
    np.testing.assert_array_equal(np.asarray(r.experts_tk)[:, 0], choice)
    np.testing.assert_allclose(float(r.stats["dropped_fraction"]), 1 - keep.mean(), rtol=1e-6)
    # Dropped tokens contribute nothing (their weight is zero: the residual carries them).
    assert np.all(np.asarray(r.weights_tk)[~keep] == 0)


def test_padding_to_capacity_computes_what_the_grouped_matmul_does():
    cfg = layer_cfg(moe_expert_capacity_factor=1.0)
    padded = dataclasses.replace(cfg, moe_pad_expert_input_to_capacity=True)
    x = jax.random.normal(jax.random.key(4), (2, 8, D))
    a, _ = make_layer(cfg)(x)
    b, stats = make_layer(padded)(x)
    assert float(stats["dropped_fraction"]) > 0  # capacity 1.0 drops some of 16 tokens x 2
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- layouts

MOE = (("num_experts", 4), ("moe_router_topk", 2), ("moe_aux_loss_coeff", 0.01), ("moe_z_loss_coeff", 0.001))
# 8 rows per microbatch (two microbatches of the 16-row batch) in every layout below.
REFERENCE = (ParallelConfig(), 8)

LAYOUTS = {
    "ep2_alltoall": (ParallelConfig(expert_model_parallel_size=2), 1, MOE),
    "ep4_alltoall": (ParallelConfig(expert_model_parallel_size=4), 1, MOE),
    "ep2_allgather": (ParallelConfig(expert_model_parallel_size=2), 1,
                      MOE + (("moe_token_dispatcher_type", "allgather"),)),
    "ep4_allgather": (ParallelConfig(expert_model_parallel_size=4), 1,
                      MOE + (("moe_token_dispatcher_type", "allgather"),)),
    "ep2_tp2_dp2_sp_zero": (ParallelConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                                           sequence_parallel=True, use_distributed_optimizer=True), 2,
                            MOE + (("swiglu", True), ("moe_shared_expert_intermediate_size", 64))),
    "ep2_pp2": (ParallelConfig(expert_model_parallel_size=2, pipeline_model_parallel_size=2), 2,
                MOE + (("moe_router_load_balancing_type", "seq_aux_loss"),)),
    # Receive buffers of 1.5x the rows a rank sends (the worst case: 2x), which this routing never
    # overflows: the bounded exchange, in the pipeline's per-rank schedule
    "ep2_pp2_receive_buffer": (ParallelConfig(expert_model_parallel_size=2, pipeline_model_parallel_size=2), 2,
                               MOE + (("moe_receive_buffer_factor", 1.5),)),
    "ep2_tp2_pp2": (ParallelConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                                   pipeline_model_parallel_size=2), 4, MOE + (("swiglu", True),)),
    "ep2_mixed_pattern": (ParallelConfig(expert_model_parallel_size=2), 1,
                          MOE + (("num_layers", 3), ("moe_layer_freq", (0, 1, 1)))),
    # (With the probs policy this layout's loss is 2.4e-6 off at the suite's XLA opt level 0,
    # 9.5e-7 at the default level, gradients within 6e-7 either way: a rounding of the loss
    # sum, not a token dropped differently, which would move an expert's gradient ~1e-3.)
    "ep4_capacity_padded": (ParallelConfig(expert_model_parallel_size=4), 1,
                            MOE + (("moe_expert_capacity_factor", 1.0), ("moe_token_drop_policy", "position"),
                                   ("moe_pad_expert_input_to_capacity", True))),
    # A MoE reduces its gradients once per step: each data rank runs its own rows, the router's
    # counts summed over the ranks (the trace's rank_split); so do the layouts above (each data x expert
    # rank its rows and experts; capacity each rank's own).
    "dp8_reduce_once": (ParallelConfig(), 1, MOE),
    # Capacity dropping reduces once too: each rank keeps at most C of its own tokens per expert.
    "dp8_capacity_probs": (ParallelConfig(), 1, MOE + (("moe_expert_capacity_factor", 0.75),)),
    # (Capacity 0.75 here: at 1.0, with each rank's own capacity, the loss is 2.9e-6 off, every
    # gradient within 6.8e-7 of the reference's: the same tokens kept, a rounding of the loss sum;
    # 0.75 drops more tokens and is 4.8e-7 off.)
    "dp2_ep2_tp2_capacity_probs_padded": (
        ParallelConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2), 2,
        MOE + (("moe_expert_capacity_factor", 0.75), ("moe_pad_expert_input_to_capacity", True))),
    "ep2_pp2_capacity_allgather": (ParallelConfig(expert_model_parallel_size=2, pipeline_model_parallel_size=2), 2,
                                   MOE + (("moe_expert_capacity_factor", 0.75),
                                          ("moe_token_dispatcher_type", "allgather"))),
    "dp4_pp2_capacity_position": (ParallelConfig(pipeline_model_parallel_size=2), 2,
                                  MOE + (("moe_expert_capacity_factor", 0.75), ("moe_token_drop_policy", "position"))),
    "dp2_tp4_sp_zero_reduce_once_seq_aux": (
        ParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True, use_distributed_optimizer=True), 4,
        MOE + (("moe_router_load_balancing_type", "seq_aux_loss"), ("swiglu", True))),
    "dp4_pp2_reduce_once": (ParallelConfig(pipeline_model_parallel_size=2), 2, MOE),
    # A MoE in a tensor-parallel pipeline without expert parallelism keeps each expert's f split
    # over `tensor` (each tensor rank runs its shard on the microbatch's rows): per rank (dp2,
    # reduced once) and, with one data rank, not per rank.
    "dp2_tp2_pp2": (ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 4,
                    MOE + (("swiglu", True),)),
    # (Policy position: with probs at 0.75 this layout's loss is 2.4e-6 off, as it was when the
    # stage gathered the experts whole, every gradient within 6.3e-7: the same tokens kept, a
    # rounding of the loss sum.)
    "dp2_tp2_pp2_sp_capacity_position": (
        ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, sequence_parallel=True), 4,
        MOE + (("moe_expert_capacity_factor", 0.75), ("moe_token_drop_policy", "position"))),
    # (the expert bias: the loads of the schedule's masked slots are no one's)
    # and an MTP depth (a MoE layer, run after the last stage's layers on every stage): its loads
    # and MoE losses counted once
    "tp4_pp2_expert_bias_mtp": (ParallelConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=2), 8,
                                MOE + (("moe_router_score_function", "sigmoid"), ("moe_router_enable_expert_bias", True),
                                       ("mtp_num_layers", 1))),
    # DeepSeek's router: sigmoid scores, group-limited top-k, scaled weights, the expert bias (whose
    # "gradient", the loads, is compared as every leaf: summed over the ranks, the one device's)
    "ep2_dp4_group_limited_expert_bias": (
        ParallelConfig(expert_model_parallel_size=2), 1,
        MOE + (("moe_router_score_function", "sigmoid"), ("moe_router_num_groups", 2), ("moe_router_group_topk", 1),
               ("moe_router_topk_scaling_factor", 2.5), ("moe_router_enable_expert_bias", True))),
    "dp2_tp2_ep2_sp_expert_bias": (
        ParallelConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True), 2,
        MOE + (("moe_router_score_function", "sigmoid"), ("moe_router_enable_expert_bias", True))),
    "tp4_pp2_capacity_probs_padded": (
        ParallelConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=2), 8,
        MOE + (("moe_expert_capacity_factor", 0.5), ("moe_pad_expert_input_to_capacity", True))),
}


def rank_blocks(parallel: ParallelConfig) -> int:
    """The ranks of batch rows (data x expert) of a layout on the 8-device mesh: each routes its
    own rows with a capacity of its own."""
    p = parallel
    return 8 // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size)


def reference_model(model: tuple) -> tuple:
    """A layout's model on one device: the dispatcher, its padding and its receive buffers are
    execution choices (the reference runs the plain model; with capacity dropping, routing each
    microbatch as the layout's ranks hold its rows)."""
    return tuple(kv for kv in model if kv[0] not in ("moe_token_dispatcher_type", "moe_receive_buffer_factor"))


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_and_every_gradient_match_single_device(name):
    parallel, micro, model = LAYOUTS[name]
    ref_model = reference_model(model)
    groups = rank_blocks(parallel) if dict(model).get("moe_expert_capacity_factor") else 1
    ref_loss, ref_grads = grads_for(*REFERENCE, single_device=True, model=ref_model, route_groups=groups)
    loss, grads = grads_for(parallel, micro, model=model)
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    assert not np.any(grads["embed"][VOCAB:])
    assert_trees_close(unpad(ref_grads), unpad(grads), GRAD_RTOL)
    # The router's gradient is really there (the MoE losses and the gates reach it).
    router = grads["layers"]["mlp"]["router"] if "moe_layers" not in grads else grads["moe_layers"]["mlp"]["router"]
    assert np.abs(router).max() > 0


def test_moe_losses_move_the_router_gradient():
    """The aux and z losses are part of the objective (their gradient reaches the router)."""
    plain = tuple(kv for kv in MOE if kv[0] not in ("moe_aux_loss_coeff", "moe_z_loss_coeff"))
    _, with_losses = grads_for(*REFERENCE, single_device=True, model=MOE)
    loss0, without = grads_for(*REFERENCE, single_device=True, model=plain)
    loss1, _ = grads_for(*REFERENCE, single_device=True, model=MOE)
    assert loss0 == loss1  # the reported loss is the LM loss alone
    diff = np.abs(with_losses["layers"]["mlp"]["router"] - without["layers"]["mlp"]["router"]).max()
    assert diff > 1e-6


# --------------------------------------------------------------------------- flags


def test_group_limited_routing_takes_the_top_k_within_the_best_groups():
    """--moe-router-num-groups 4 --moe-router-group-topk 2, top-4 of 8 experts (pairs): each token's
    groups scored by the sum of their best 2 scores, the experts taken within the best 2 groups
    (Megatron-Core's group_limited_topk), checked against a hand-written loop; the weights times
    --moe-router-topk-scaling-factor."""
    from mlm_jax.models import moe

    cfg = ModelConfig(num_experts=8, moe_router_topk=4, moe_router_num_groups=4, moe_router_group_topk=2,
                      moe_router_score_function="sigmoid")
    scores = np.array(jax.random.uniform(jax.random.key(3), (16, 8)), np.float32)
    scores[0] = [0.9, 0.0, 0.5, 0.5, 0.7, 0.1, 0.0, 0.0]  # groups 0.9, 1.0, 0.8, 0.0
    values, idx = moe.top_k(cfg, jnp.asarray(scores))
    for t in range(16):
        groups = scores[t].reshape(4, 2)
        best = np.argsort(-np.sort(groups, axis=1)[:, -2:].sum(axis=1), kind="stable")[:2]
        allowed = [e for e in range(8) if e // 2 in best]
        want = sorted(allowed, key=lambda e: -scores[t, e])[:4]
        assert sorted(np.asarray(idx[t]).tolist()) == sorted(want), (t, idx[t], want)
        np.testing.assert_allclose(np.asarray(values[t]), np.sort(scores[t, want])[::-1], rtol=0, atol=0)
    assert sorted(np.asarray(idx[0]).tolist()) == [0, 1, 2, 3]  # groups 1 and 0, though expert 4 beats 2 and 3
    plain, _, _ = moe._scores_and_choice(cfg, jnp.asarray(scores))
    scaled = dataclasses.replace(cfg, moe_router_topk_scaling_factor=2.5)
    np.testing.assert_allclose(np.asarray(moe._scores_and_choice(scaled, jnp.asarray(scores))[0]),
                               2.5 * np.asarray(plain), rtol=1e-6)


def test_the_expert_bias_moves_by_megatrons_rule_after_a_step():
    """--moe-router-enable-expert-bias: the loads come back as the bias's gradient, each layer's
    summing to the step's tokens x top-k; the step moves the bias by rate x sign(mean - load)
    (Megatron-Core's get_updated_expert_bias; by hand: loads [3, 1, 2, 2] -> [-r, +r, 0, 0]) and
    nothing else touches it (no Adam, no weight decay); a moved bias changes the next choice."""
    from tests.parallel_util import build, fixed_batch, place

    np.testing.assert_array_equal(moe_lib.updated_bias(np.zeros(4, np.float32), np.array([3., 1., 2., 2.]), 0.5),
                                  [-0.5, 0.5, 0.0, 0.0])
    model = dict(MOE + (("moe_router_score_function", "sigmoid"), ("moe_router_enable_expert_bias", True),
                        ("moe_router_bias_update_rate", 0.01)))
    pz = build(*REFERENCE, jax.devices()[:1], **model)
    state = pz.init(0)
    batch = place(pz, fixed_batch())
    _, grads = pz.loss_and_grads(state["params"], batch, jax.random.key(0))
    loads = np.asarray(grads["layers"]["mlp"]["expert_bias"])  # [layers, E]
    tokens = fixed_batch()["tokens"].size
    np.testing.assert_array_equal(loads.sum(axis=1), [tokens * 2] * loads.shape[0])
    new, _ = pz.train_step(state, batch, jax.random.key(0))
    want = 0.01 * np.sign(loads.mean(axis=1, keepdims=True) - loads)
    np.testing.assert_allclose(np.asarray(new["params"]["layers"]["mlp"]["expert_bias"]), want, rtol=0, atol=1e-7)
    assert np.abs(want).sum() > 0
    moved = moe_lib.route(pz.cfg.model, jnp.zeros((1, 2, 4)), jnp.asarray([0.0, 0.3, 0.0, 0.2]))
    assert sorted(np.asarray(moved.experts_tk[0]).tolist()) == [1, 3]  # equal scores: the bias chooses


def test_moe_flags_map_onto_the_config():
    cfg = parse_args(["--num-experts", "8", "--moe-router-topk", "2", "--moe-layer-freq", "([0]*1+[1]*3)",
                      "--moe-router-num-groups", "4", "--moe-router-group-topk", "2",
                      "--moe-router-topk-scaling-factor", "2.5", "--moe-router-enable-expert-bias",
                      "--moe-router-bias-update-rate", "0.002",
                      "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "0.01",
                      "--moe-z-loss-coeff", "0.001", "--moe-router-pre-softmax",
                      "--moe-router-score-function", "sigmoid", "--moe-expert-capacity-factor", "1.5",
                      "--moe-token-drop-policy", "position", "--moe-pad-expert-input-to-capacity",
                      "--moe-shared-expert-intermediate-size", "256", "--moe-token-dispatcher-type",
                      "allgather", "--moe-grouped-gemm", "--moe-ffn-hidden-size", "512",
                      "--expert-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"])
    m = cfg.model
    assert (m.num_experts, m.moe_router_topk, m.moe_layer_freq) == (8, 2, (0, 1, 1, 1))
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk_scaling_factor) == (4, 2, 2.5)
    assert m.moe_router_enable_expert_bias and m.moe_router_bias_update_rate == 0.002
    assert [m.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert m.moe_router_load_balancing_type == "seq_aux_loss" and m.moe_router_pre_softmax
    assert (m.moe_expert_capacity_factor, m.moe_token_drop_policy) == (1.5, "position")
    assert m.moe_shared_expert_intermediate_size == 256 and m.moe_token_dispatcher_type == "allgather"
    assert cfg.parallel.expert_model_parallel_size == 2 and m.moe_ffn_size == 512
    assert parse_args(["--num-experts", "4", "--moe-layer-freq", "2"]).model.moe_layer_freq == 2


@pytest.mark.parametrize("argv, message", [
    (["--moe-layer-freq", "__import__('os')"], "--moe-layer-freq"),
    (["--moe-router-score-function", "relu"], "--moe-router-score-function 'relu'"),
    (["--moe-token-dispatcher-type", "deepep"], "--moe-token-dispatcher-type 'deepep'"),  # flex: alltoall
])
def test_bad_moe_flags_are_refused_naming_the_flag(argv, message, capsys):
    with pytest.raises((ConfigError, SystemExit)) as e:
        parse_args(argv)
    text = str(e.value) if isinstance(e.value, ConfigError) else capsys.readouterr().err
    assert message in text


@pytest.mark.parametrize("parallel, model, message", [
    (ParallelConfig(expert_model_parallel_size=3), dict(num_experts=6), "--expert-model-parallel-size 3"),
    (ParallelConfig(expert_model_parallel_size=8), dict(num_experts=4), "--num-experts 4 is not divisible"),
    (ParallelConfig(), dict(num_experts=4, moe_router_topk=5), "--moe-router-topk 5"),
    (ParallelConfig(), dict(num_experts=4, moe_layer_freq=(1, 0, 1)), "--moe-layer-freq [1, 0, 1]"),
    (ParallelConfig(pipeline_model_parallel_size=2), dict(num_experts=4, moe_layer_freq=(0, 1)),
     "mixes dense and MoE layers"),
    (ParallelConfig(tensor_model_parallel_size=2, expert_tensor_parallel_size=1), dict(num_experts=4),
     "--expert-tensor-parallel-size 1"),
    (ParallelConfig(), dict(num_experts=4, moe_pad_expert_input_to_capacity=True),
     "needs --moe-expert-capacity-factor"),
    (ParallelConfig(expert_model_parallel_size=2), dict(), "needs --num-experts"),
    (ParallelConfig(), dict(num_experts=4, moe_router_num_groups=2), "--moe-router-num-groups needs "
                                                                     "--moe-router-group-topk"),
    (ParallelConfig(), dict(num_experts=6, moe_router_num_groups=4, moe_router_group_topk=1),
     "--moe-router-num-groups 4 must divide --num-experts 6"),
    (ParallelConfig(), dict(num_experts=4, moe_router_num_groups=2, moe_router_group_topk=3),
     "--moe-router-group-topk 3 must be between 1 and --moe-router-num-groups 2"),
    (ParallelConfig(), dict(num_experts=8, moe_router_topk=3, moe_router_num_groups=4, moe_router_group_topk=2),
     "--moe-router-topk 3 must be a multiple of --moe-router-group-topk 2"),
    (ParallelConfig(), dict(num_experts=4, moe_router_topk_scaling_factor=0.0),
     "--moe-router-topk-scaling-factor must be a positive number"),
    (ParallelConfig(), dict(num_experts=4, moe_router_enable_expert_bias=True),
     "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"),
    (ParallelConfig(), dict(num_experts=4, moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
                            moe_router_bias_update_rate=-1.0), "--moe-router-bias-update-rate must be a positive"),
    (ParallelConfig(expert_model_parallel_size=2), dict(num_experts=4, moe_receive_buffer_factor=0.0),
     "--moe-receive-buffer-factor 0.0 must be positive"),
    (ParallelConfig(), dict(num_experts=4, moe_receive_buffer_factor=1.5),
     "--moe-receive-buffer-factor sizes the alltoall dispatcher's receive buffers, which "
     "--expert-model-parallel-size 1 with --moe-token-dispatcher-type alltoall does not have"),
    (ParallelConfig(expert_model_parallel_size=2), dict(num_experts=4, moe_receive_buffer_factor=1.5,
                                                        moe_token_dispatcher_type="allgather"),
     "--expert-model-parallel-size 2 with --moe-token-dispatcher-type allgather does not have"),
    (ParallelConfig(), dict(moe_receive_buffer_factor=1.5), "--moe-receive-buffer-factor needs --num-experts"),
])
def test_invalid_moe_configs_fail_naming_the_rule(parallel, model, message):
    with pytest.raises(ConfigError, match=None) as e:
        finalize(tiny_config(parallel, 1, **model), 8)
    assert message in str(e.value)


def test_flops_count_the_active_experts_only():
    from mlm_jax.metrics import active_params, flops_per_token

    dense = ModelConfig(num_layers=4, hidden_size=64, ffn_hidden_size=256, swiglu=True)
    moe = dataclasses.replace(dense, num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128,
                              moe_layer_freq=(0, 1, 0, 1))
    # Two MoE layers: each token goes through 2 of 8 experts of 128 (= one dense MLP of 256),
    # plus the router's 64 x 8 weights; the other 6 experts add nothing.
    router = 2 * 2.0 * 64 * 8 * 3
    assert flops_per_token(moe, 128) == pytest.approx(flops_per_token(dense, 128) + router)
    assert flops_per_token(dataclasses.replace(moe, num_experts=64), 128) == pytest.approx(
        flops_per_token(dense, 128) + router * 8)
    assert active_params(dense) is None
    with nnx.use_eager_sharding(False):
        from mlm_jax.models.gpt import GPT

        total = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(lambda: GPT(moe, nnx.Rngs(0))), nnx.Param)))
    assert active_params(moe) < total


def test_checkpoints_restore_across_expert_parallel_sizes(tmp_path):
    """Saved on ep=4 (experts split 4 ways), restored onto ep=2 x tp=2 and onto ep=1 with ZeRO:
    every parameter and Adam moment equal (checkpoints hold the plain, unsharded tree)."""
    from mlm_jax import checkpoint as ckpt
    from mlm_jax.build import parallelize
    from mlm_jax.sharding.mesh import make_mesh

    base = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
            "--seq-length", "32", "--max-position-embeddings", "32", "--vocab-size", "512",
            "--global-batch-size", "16", "--micro-batch-size", "1", "--train-iters", "4",
            "--num-experts", "4", "--moe-router-topk", "2", "--swiglu", "--disable-bias-linear"]
    world = jax.device_count()

    def layout(extra):
        cfg = finalize(parse_args(base + extra), world)
        return cfg, parallelize(cfg, make_mesh(cfg.parallel))

    cfg4, pz4 = layout(["--expert-model-parallel-size", "4"])
    assert pz4.param_sharding["layers"]["mlp"]["w1"].spec[1] == "expert"
    state = pz4.init(5)
    saver = ckpt.Saver(cfg4.replace(checkpoint=dataclasses.replace(cfg4.checkpoint, save=str(tmp_path / "EP4"))),
                       pz4, None, str(tmp_path / "run"), ckpt.Start(), log=lambda *_: None)
    saver.save(2, state, 32, jax.random.key_data(jax.random.key(3)))
    saver.close()
    found = ckpt.find_checkpoint(str(tmp_path / "EP4"))
    for extra in (["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2"],
                  ["--use-distributed-optimizer"]):
        cfg, pz = layout(extra)
        back, _ = ckpt.restore_train_state(cfg, pz, found, log=lambda *_: None)
        got = jax.tree.map(lambda x: x.sharding, back["params"])
        assert jax.tree.leaves(got) == jax.tree.leaves(pz.param_sharding)
        for x, y in zip(jax.tree.leaves(state["params"]), jax.tree.leaves(back["params"])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(jax.tree.leaves(state["opt_state"]), jax.tree.leaves(back["opt_state"])):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_aux_metrics_reach_the_train_step_and_format():
    """metrics["aux"] of a train step on ep2 x pp2 equal the single device's (same microbatches),
    and format into the log line's MoE part."""
    from mlm_jax.models.moe import aux_record, format_aux
    from tests.parallel_util import build, fixed_batch, place

    model = dict(MOE + (("moe_expert_capacity_factor", 0.75), ("moe_token_drop_policy", "position")))

    def metrics(parallel, micro, single, groups=1):
        with trace.using(route_groups=groups):  # one device routing as `groups` ranks (capacity)
            pz = build(parallel, micro, jax.devices()[:1] if single else None, fresh=groups > 1, **model)
            _, m = pz.train_step(pz.init(0), place(pz, fixed_batch()), jax.random.key(0))
        return jax.tree.map(float, m["aux"])

    ref = metrics(ParallelConfig(), 8, True, groups=4)  # ep2 x pp2: 4 ranks of batch rows
    got = metrics(ParallelConfig(expert_model_parallel_size=2, pipeline_model_parallel_size=2), 2, False)
    assert ref["moe_microbatches"] == got["moe_microbatches"] == 2.0
    for key in ref:
        assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), key
    ref_dropping = ref
    # Dropless on dp8 (gradients reduced once, each rank reporting its share): the same metrics.
    # And on dp4 x pp2, where the pipeline's ranks reduce once too, and on dp4 x ep2 (each
    # data x expert rank its share).
    model = dict(MOE)
    ref = metrics(ParallelConfig(), 8, True)
    for parallel, micro in ((ParallelConfig(), 1), (ParallelConfig(pipeline_model_parallel_size=2), 2),
                            (ParallelConfig(expert_model_parallel_size=2), 1)):
        got = metrics(parallel, micro, False)
        assert got["moe_microbatches"] == pytest.approx(2.0), parallel
        for key in ref:
            assert got[key] == pytest.approx(ref[key], rel=1e-5, abs=1e-7), (parallel, key)
        assert aux_record(got)["moe_imbalance"] > 1.0 and aux_record(got)["moe_dropped_fraction"] == 0.0
    r = aux_record(ref_dropping)
    assert r["moe_load_balancing_loss"] > 0 and r["moe_z_loss"] > 0
    # The busiest expert's kept load over the ideal T K / E: capped at the capacity factor.
    assert r["moe_imbalance"] == pytest.approx(0.75)
    assert 0 < r["moe_dropped_fraction"] < 1  # capacity 0.75 drops some
    line = format_aux(ref_dropping)
    assert "load balancing loss" in line and "dropped tokens" in line
    assert format_aux({}) == "" and aux_record({"tokens": 3.0}) == {}


def test_rows_the_receive_buffers_drop_are_reported(monkeypatch):
    """ep2 with --moe-receive-buffer-factor 0.5 (buffers of half the rows a rank sends: a
    quarter of the worst case): the train step's dropped fraction counts the rows the buffers
    dropped (no capacity here: the router drops none), the same on the ragged path (the
    collective emulated)."""
    from mlm_jax.models.moe import aux_record
    from mlm_jax.parallel import experts
    from tests.parallel_util import build, fixed_batch, place

    def dropped() -> float:
        pz = build(ParallelConfig(expert_model_parallel_size=2), 1, fresh=True,
                   **dict(MOE + (("moe_receive_buffer_factor", 0.5),)))
        _, m = pz.train_step(pz.init(0), place(pz, fixed_batch()), jax.random.key(0))
        return aux_record(jax.tree.map(float, m["aux"]))["moe_dropped_fraction"]

    padded = dropped()
    assert 0.5 <= padded < 1  # at most half the rows fit
    monkeypatch.setattr(experts, "_ragged_here", lambda: True)
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    assert dropped() == pytest.approx(padded, rel=1e-6)


@pytest.mark.parametrize("ep", [1, 2], ids=["dp4_pp2", "dp2_ep2_pp2"])
def test_dropless_moe_pipeline_reduces_data_parallel_gradients_once(ep):
    """dp4 x pp2 and dp2 x ep2 x pp2, dropless: inside the tick scans the only collectives over
    `data` (or `expert`) are the router's count sums ([experts] and scalars) and, with expert
    parallelism, the dispatch's all-to-alls of tokens; the gradient reduction runs after the
    schedule."""
    from tests.parallel_util import build, fixed_batch, place
    from tests.test_compiled import _COLLECTIVE, _data_parallel_collectives_in_loops, _largest_result, _lines_in_loops

    pz = build(ParallelConfig(pipeline_model_parallel_size=2, expert_model_parallel_size=ep), 2, **dict(MOE))
    assert pz.mesh.shape["data"] * ep == 4 and pz.num_microbatches >= 2
    text = pz.train_step.lower(pz.init(0), place(pz, fixed_batch()), jax.random.key(0)).compile().as_text()
    in_loops = _data_parallel_collectives_in_loops(pz, text)
    dispatch = [line for line in in_loops if " all-to-all(" in line]
    assert bool(dispatch) == (ep > 1), dispatch  # each rank's tokens go to their experts' ranks
    in_loops = [line for line in in_loops if line not in dispatch]
    assert in_loops and all(_largest_result(line) <= 4 for line in in_loops), in_loops
    # Outside every loop by the program's structure (op_name metadata is no guide: XLA's combiner
    # merges the metadata of the collectives it combines, here a hoisted one's from a loop body).
    looped = set(_lines_in_loops(text))
    outside = [line for line in text.splitlines() if _COLLECTIVE.search(line) and line not in looped]
    assert any(" all-reduce" in line and _largest_result(line) > 4 for line in outside)


def test_the_rows_a_rank_computes_do_not_grow_with_data_parallelism():
    """Capacity is each rank's own (Megatron's `get_capacity` on a rank's tokens): padded to
    capacity, a rank of dp2 and of dp8 with a row each runs its experts on [E, C] slots, C the
    capacity of that row's tokens; a capacity of the whole microbatch made them dp times more."""
    from tests.parallel_util import SEQ, build, fixed_batch, place

    model = dict(MOE + (("moe_expert_capacity_factor", 1.0), ("moe_pad_expert_input_to_capacity", True)))
    cfg = layer_cfg(**{k: v for k, v in model.items() if k.startswith("moe_") or k == "num_experts"})
    rank = moe_lib.capacity(SEQ, cfg)  # one row per rank
    for dp in (2, 8):
        pz = build(ParallelConfig(), 1, jax.devices()[:dp], **model)
        text = pz.loss_and_grads.lower(pz.init(0)["params"], place(pz, fixed_batch()), jax.random.key(0)).as_text()
        slots = {int(c) for c in re.findall(rf"stablehlo.dot_general[^\n]*-> tensor<{E}x(\d+)x", text)}
        whole = moe_lib.capacity(dp * SEQ, cfg)  # the microbatch's dp rows
        assert rank in slots and whole not in slots, (dp, slots, rank, whole)  # (the others: weight gradients)


@pytest.mark.parametrize("name", ["ep2_alltoall", "ep2_tp2_dp2_sp_zero"])
def test_the_grouped_matmul_kernel_in_the_dispatch_equals_one_device(name, monkeypatch):
    """The experts' Pallas grouped matmul (what NVIDIA GPUs run, here in interpret mode) inside the
    expert-parallel dispatch, its shard_map and its saved residuals: loss and every gradient equal
    the single device's (which runs `ragged_dot`)."""
    import importlib

    from tests.parallel_util import build, fixed_batch, place

    gmm = importlib.import_module("mlm_jax.kernels.grouped_matmul")  # the module (the package exports the function)
    parallel, micro, model = LAYOUTS[name]
    ref_loss, ref_grads = grads_for(*REFERENCE, single_device=True, model=model)
    monkeypatch.setattr(gmm, "default_implementation", lambda: gmm.PALLAS)
    pz = build(parallel, micro, fresh=True, **dict(model))
    lowered = pz.loss_and_grads.lower(pz.init(0)["params"], place(pz, fixed_batch()), jax.random.key(0))
    text = lowered.as_text(debug_info=True)
    assert "grouped_matmul_dw" in text and "ragged_dot" not in text  # the kernels (by name), not ragged_dot
    loss, grads = pz.loss_and_grads(pz.init(0)["params"], place(pz, fixed_batch()), jax.random.key(0))
    assert abs(float(loss) - ref_loss) <= LOSS_ATOL, (float(loss), ref_loss)
    assert_trees_close(unpad(ref_grads), unpad(jax.tree.map(np.asarray, pz.plain(grads))), GRAD_RTOL)


# --------------------------------------------------------------------------- the ragged all-to-all
# On NVIDIA targets the alltoall dispatcher sends exactly each destination's rows with
# `jax.lax.ragged_all_to_all` (parallel/experts.py). XLA:CPU has none (jax 0.10 and 0.12:
# "UNIMPLEMENTED: HLO opcode `ragged-all-to-all` is not supported by XLA:CPU"), so here its
# bookkeeping is checked against numpy, and the whole path end to end with the collective
# emulated as jax's docstring defines it; tests/test_gpu_compile.py compiles the real one.


def _np_ragged_all_to_all(operands, outputs, offsets):
    """`jax.lax.ragged_all_to_all` over len(operands) ranks in numpy, as its docstring defines it
    (offsets[rank] = (input_offsets, send_sizes, output_offsets, recv_sizes)); the recv sizes
    checked against what their sources send."""
    n = len(operands)
    results = [np.array(o, copy=True) for o in outputs]
    for src, (in_off, send, out_off, _) in enumerate(offsets):
        per = len(in_off) // n
        for s in range(len(in_off)):
            results[s // per][out_off[s]:out_off[s] + send[s]] = operands[src][in_off[s]:in_off[s] + send[s]]
    for dst, (*_, recv) in enumerate(offsets):
        per = len(recv) // n
        assert list(recv) == [offsets[s // per][1][dst * per + s % per] for s in range(len(recv))]
    return results


def _np_within(sizes_in: np.ndarray, rows: int | None) -> np.ndarray:
    """The receive buffer's rule written out: [source, e] rows cut to `rows` in all, every
    expert keeping at most the largest c that fits, each expert's rows from source 0 first."""
    if rows is None:
        return sizes_in
    per_e = sizes_in.sum(0)
    c = max(c for c in range(int(per_e.max()) + 1) if np.minimum(per_e, c).sum() <= rows)
    before = np.cumsum(sizes_in, 0) - sizes_in
    return np.clip(c - before, 0, sizes_in)


@pytest.mark.parametrize("ep, n_local, cap, buffer", [
    (2, 1, None, None), (4, 1, None, None), (4, 3, None, None), (4, 2, 3, None), (8, 2, 1, None),
    (4, 3, None, 20), (4, 2, 3, 9), (8, 2, 1, 5), (2, 3, None, 1)])
def test_ragged_offsets_deliver_every_row_to_its_expert_and_back(ep, n_local, cap, buffer):
    """`experts.ragged_offsets` (vmapped over `expert` ranks) against numpy: every rank's rows,
    sorted by (destination, local expert), land in each destination's buffer sorted by local
    expert, each expert's from source 0, 1, ... (at most `cap` of each source's; with `buffer`,
    at most that many rows in all, cut as `_np_within` says), an empty tail after them; the
    return brings every row sent back to its place, and nothing else."""
    from mlm_jax.parallel import experts
    from mlm_jax.sharding.mesh import EXPERT

    rng = np.random.default_rng(ep * 10 + n_local)
    counts = rng.integers(0, 6, (ep, ep, n_local)).astype(np.int32)  # [source, dest, e]
    counts[0, 1] = 0  # a source that sends a destination nothing
    R = int(counts.sum((1, 2)).max()) + 2  # every source's rows (the last few dropped: sent nowhere)
    received = ep * (R if cap is None else min(R, n_local * cap)) if buffer is None else buffer
    got = jax.vmap(lambda c: experts.ragged_offsets(c, cap, buffer), axis_name=EXPERT)(jnp.asarray(counts))
    dispatch, combine, expert_rows = jax.tree.map(np.asarray, got)
    on = lambda offsets, rank: tuple(a[rank] for a in offsets)  # noqa: E731
    rows = [1000 * (i + 1) + np.arange(R, dtype=np.float32)[:, None] for i in range(ep)]  # [R, 1] labels
    buffers = _np_ragged_all_to_all(rows, [np.zeros((received, 1), np.float32)] * ep,
                                    [on(dispatch, i) for i in range(ep)])
    capped = counts if cap is None else np.minimum(counts, cap)
    sizes = np.stack([_np_within(capped[:, j], buffer) for j in range(ep)], 1)  # [source, dest, e]
    if buffer is not None:
        assert (sizes < capped).any() and sizes.sum((0, 2)).max() <= buffer  # the case cuts rows
    starts = np.cumsum(counts.reshape(ep, -1), 1).reshape(counts.shape) - counts  # in each source's rows
    for j in range(ep):
        want = [rows[i][starts[i, j, e]:starts[i, j, e] + sizes[i, j, e]] for e in range(n_local) for i in range(ep)]
        want = np.concatenate(want) if want else np.zeros((0, 1))
        np.testing.assert_array_equal(buffers[j][:len(want)], want)
        assert not buffers[j][len(want):].any()  # the empty tail
        np.testing.assert_array_equal(expert_rows[j], sizes[:, j].sum(0))
    back = _np_ragged_all_to_all(buffers, [np.zeros((R, 1), np.float32)] * ep, [on(combine, j) for j in range(ep)])
    for i in range(ep):
        sent = np.zeros(R, bool)
        for j, e in np.ndindex(ep, n_local):
            sent[starts[i, j, e]:starts[i, j, e] + sizes[i, j, e]] = True
        np.testing.assert_array_equal(back[i][:, 0], np.where(sent, rows[i][:, 0], 0))


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                                axis_name, axis_index_groups=None):
    """`jax.lax.ragged_all_to_all` as its docstring defines it, from jnp and a dense all_to_all
    (XLA:CPU has no ragged one): each rank sends every destination an image of the output rows
    it writes there, with a mask. Differentiable as any jnp function."""
    del recv_sizes, axis_index_groups  # (what the sources send: checked by the numpy test above)
    n = jax.lax.axis_size(axis_name)
    M, per = output.shape[0], input_offsets.shape[0] // n
    at = jnp.arange(M)
    io, ss, oo = (a.reshape(n, per, 1) for a in (input_offsets, send_sizes, output_offsets))
    hit = (at >= oo) & (at < oo + ss)  # [dest, slice, M]
    row = jnp.sum(jnp.where(hit, io + at - oo, 0), axis=1)  # [dest, M]: the operand row written there
    sent = hit.any(1)
    trailing = (1,) * (operand.ndim - 1)
    image = jnp.where(sent.reshape(*sent.shape, *trailing), operand[jnp.clip(row, 0, operand.shape[0] - 1)], 0)
    got = jax.lax.all_to_all(image, axis_name, 0, 0, tiled=True).sum(0)  # [M, ...]: slices never overlap
    mask = jax.lax.all_to_all(sent.astype(jnp.int32), axis_name, 0, 0, tiled=True).sum(0)
    return jnp.where(mask.reshape(M, *trailing) > 0, got, output)


def test_the_emulated_ragged_all_to_all_is_jaxs_docstring_example():
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    per_rank = ([[1, 2, 2], [3, 4, 0]], [[0] * 4] * 2,  # operand, output
                [[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])  # offsets, sizes
    args = [np.array(a, np.float32 if i < 2 else np.int32) for i, a in enumerate(per_rank)]
    f = jax.shard_map(lambda *a: _emulated_ragged_all_to_all(*(x[0] for x in a), axis_name="x")[None],
                      mesh=mesh, in_specs=(P("x"),) * 6, out_specs=P("x"))
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(*args)), [[1, 3, 0, 0], [2, 2, 4, 0]])


@pytest.mark.parametrize("ragged", [False, True], ids=["padded", "ragged"])
def test_a_bounded_receive_buffer_drops_the_rows_within_says(ragged, monkeypatch):
    """--moe-receive-buffer-factor 0.5 on 4 expert ranks (each sends 16 rows; a buffer of 8 where
    the worst case is 64), routing skewed towards rank 0's experts: the alltoall dispatch (the
    padded exchange of XLA:CPU, and the ragged one of NVIDIA targets with the collective
    emulated) equals every expert on every token with the rows `_np_within` cuts given weight 0:
    output, the count of rows dropped, and the gradients of tokens, weights and experts."""
    from jax.sharding import Mesh, PartitionSpec as P

    from mlm_jax.parallel import experts
    from mlm_jax.sharding.mesh import EXPERT

    if ragged:
        monkeypatch.setattr(experts, "_ragged_here", lambda: True)
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", _emulated_ragged_all_to_all)
    ep, T, n_experts = 4, 8, 8
    n_local, R = n_experts // ep, T * K
    cfg = layer_cfg(num_experts=n_experts, moe_receive_buffer_factor=0.5)
    buffer = experts.receive_rows(cfg, R, n_local, None, ep)
    assert buffer == 8
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ep, T, D)).astype(np.float32)
    p = np.array([4, 3, 1, 1, 1, 1, 1, 1], float)  # rank 0's experts (0, 1) the busiest
    e = np.stack([[rng.choice(n_experts, K, replace=False, p=p / p.sum()) for _ in range(T)]
                  for _ in range(ep)]).astype(np.int32)  # [rank, T, K]
    w = rng.uniform(0.2, 1.0, (ep, T, K)).astype(np.float32)
    w1 = (0.3 * rng.normal(size=(n_experts, D, F))).astype(np.float32)
    w2 = (0.3 * rng.normal(size=(n_experts, F, D))).astype(np.float32)
    g = rng.normal(size=(ep, T, D)).astype(np.float32)

    # The rule: each source's rows in (expert, token) order; the first `within` of each (dest, e) go.
    counts = np.zeros((ep, ep, n_local), np.int64)  # [source, dest, e]
    for i in range(ep):
        np.add.at(counts[i], (e[i] // n_local, e[i] % n_local), 1)
    sent = np.stack([_np_within(counts[:, j], buffer) for j in range(ep)], 1)
    keep = np.zeros((ep, T, K), np.float32)
    for i in range(ep):
        order = np.argsort(e[i].reshape(-1), kind="stable")
        seen = np.zeros(n_experts, np.int64)
        for r in order:
            ex = e[i].reshape(-1)[r]
            keep[i].reshape(-1)[r] = seen[ex] < sent[i, ex // n_local, ex % n_local]
            seen[ex] += 1
    assert 0 < keep.sum() < keep.size  # some rows dropped, not all

    def reference(x, w, w1, w2):
        return jnp.stack([moe_lib.local_experts(cfg, x[i], e[i], w[i] * keep[i], w1, w2, None, None)
                          for i in range(ep)])

    mesh = Mesh(np.array(jax.devices()[:ep]), (EXPERT,))
    ours = jax.shard_map(lambda x, e, w, w1, w2: jax.tree.map(
        lambda a: a[None], experts._alltoall(cfg, x[0], e[0], w[0], w1, w2, None, None, ep)),
        mesh=mesh, in_specs=(P(EXPERT),) * 5, out_specs=(P(EXPERT), P(EXPERT)), check_vma=False)
    out, dropped = jax.jit(ours)(x, e, w, w1, w2)
    # fp32, the same products summed in another order (grouped per expert and rank): 1e-5 relative
    np.testing.assert_allclose(np.asarray(out), np.asarray(reference(x, w, w1, w2)), rtol=1e-5, atol=1e-6)
    assert float(np.sum(dropped)) == keep.size - keep.sum()
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(ours(a[0], e, *a[1:])[0] * g), argnums=(0, 1, 2, 3)))(x, w, w1, w2)
    want = jax.grad(lambda *a: jnp.sum(reference(*a) * g), argnums=(0, 1, 2, 3))(x, w, w1, w2)
    for got, ref in zip(grads, want):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)


RAGGED = ["ep4_alltoall", "ep4_capacity_padded", "ep2_tp2_dp2_sp_zero", "ep2_pp2", "ep2_pp2_receive_buffer"]


@pytest.mark.parametrize("name", RAGGED)
def test_ragged_dispatch_matches_single_device(name, monkeypatch):
    """The alltoall dispatcher's ragged path (NVIDIA targets), the collective emulated: loss and
    every gradient leaf equal one device's, as the padded path's do (the layouts above: in a
    shard_map over data, expert and tensor, with capacity padding, in the pipeline's per-rank
    schedule). The backward is the custom VJP's reverse exchange."""
    from mlm_jax.parallel import experts
    from tests.parallel_util import build, fixed_batch, place

    calls = []

    def counted(*args, **kw):
        calls.append(args[0].shape)
        return _emulated_ragged_all_to_all(*args, **kw)

    monkeypatch.setattr(experts, "_ragged_here", lambda: True)
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", counted)
    parallel, micro, model = LAYOUTS[name]
    groups = rank_blocks(parallel) if dict(model).get("moe_expert_capacity_factor") else 1
    ref_loss, ref_grads = grads_for(*REFERENCE, single_device=True, model=reference_model(model), route_groups=groups)
    pz = build(parallel, micro, fresh=True, **dict(model))  # traced anew: the ragged path
    loss, grads = pz.loss_and_grads(pz.init(0)["params"], place(pz, fixed_batch()), jax.random.key(0))
    assert calls, "the ragged path did not run"
    assert abs(float(loss) - ref_loss) <= LOSS_ATOL, (float(loss), ref_loss)
    assert_trees_close(unpad(ref_grads), unpad(jax.tree.map(np.asarray, pz.plain(grads))), GRAD_RTOL)


@pytest.mark.parametrize("parallel, micro", [
    (ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 4),  # dp2, per rank
    (ParallelConfig(tensor_model_parallel_size=4, pipeline_model_parallel_size=2), 8),  # dp1, not per rank
], ids=["dp2_tp2_pp2", "tp4_pp2"])
def test_a_tensor_parallel_pipeline_keeps_the_experts_split(parallel, micro):
    """A MoE in a pipeline stage with tensor but no expert parallelism: no collective gathers an
    expert's weights whole over `tensor` (each tensor rank runs its f shard of every expert on
    the microbatch's rows), and no buffer of the compiled program holds them whole, only a
    device's [E, d, f/tp] share. The stage gathered every layer's w1 and w2 whole before."""
    from mlm_jax.sharding.hlo import collectives
    from tests.parallel_util import build, fixed_batch, place

    # f = 192: no other dim of the program (rows: 256, 512) is taken for an expert's
    pz = build(parallel, micro, **dict(MOE + (("moe_ffn_hidden_size", 192),)))
    m, tp = pz.cfg.model, parallel.tensor_model_parallel_size
    d, f = m.hidden_size, m.moe_ffn_size
    text = pz.train_step.lower(pz.init(0), place(pz, fixed_batch()), jax.random.key(0)).compile().as_text()
    whole = {(E, d, f), (E, f, d)}  # w1, w2 of one layer
    gathered = [c for c in collectives(text) if c.kind == "all-gather" and whole & set(c.shapes)]
    assert gathered == [], gathered
    # No buffer of the program holds one ([E, d, f] or [E, f, d], or a stack of them), but its share.
    assert not re.findall(rf"[\[,]{E},(?:{d},{f}|{f},{d})\]", text)
    assert re.findall(rf"[\[,]{E},{d},{f // tp}\]", text) and re.findall(rf"[\[,]{E},{f // tp},{d}\]", text)


def test_a_pipeline_whose_head_reports_aux_runs_the_experts_split_as_one_device():
    """A pipeline whose head reports batch-wide aux does not run per rank (`reduces_once`): its
    stages dispatch over data, expert and tensor themselves (dp2 x tp2 x pp2 and ep2 x tp2 x
    pp2): loss and every gradient equal one device's."""
    from tests.parallel_util import build, fixed_batch, place
    from tests.test_pipeline import ZLossGPT

    def run(parallel, micro, devices=None):
        pz = build(parallel, micro, devices, model_class=ZLossGPT, **dict(MOE))
        state = pz.init(0)
        batch = place(pz, fixed_batch())
        if devices is None:
            assert not pz.pipeline.reduces_once(state["params"], batch)
        loss, grads = pz.loss_and_grads(state["params"], batch, jax.random.key(0))
        return float(loss), jax.tree.map(np.asarray, pz.plain(grads))

    ref_loss, ref_grads = run(ParallelConfig(), 8, jax.devices()[:1])
    for ep in (1, 2):
        loss, grads = run(ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                         expert_model_parallel_size=ep), 4)
        assert abs(loss - ref_loss) <= LOSS_ATOL, (ep, loss, ref_loss)
        assert_trees_close(unpad(ref_grads), unpad(grads), GRAD_RTOL)


@pytest.mark.parametrize("name", ["dp2_tp2_pp2", "ep2_tp2_pp2"])
def test_pipeline_moe_in_a_layer_loop_with_full_recompute_matches_single_device(name):
    """The stage's dispatch map nested in the layers as a GPU runs them (a scanned loop; the CPU
    unrolls up to 8 layers) and under full recompute, where jax partially evaluates the layer
    scan around it: loss and every gradient equal one device's."""
    from tests.parallel_util import build, fixed_batch, layer_loop, place

    parallel, micro, model = LAYOUTS[name]
    model = model + (("recompute_granularity", "full"),)

    def run(parallel, micro, devices=None):
        with layer_loop():
            pz = build(parallel, micro, devices, fresh=True, **dict(model))
            state = pz.init(0)
            loss, grads = pz.loss_and_grads(state["params"], place(pz, fixed_batch()), jax.random.key(0))
        return float(loss), jax.tree.map(np.asarray, pz.plain(grads))

    ref_loss, ref_grads = run(*REFERENCE, jax.devices()[:1])
    loss, grads = run(parallel, micro)
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    assert_trees_close(unpad(ref_grads), unpad(grads), GRAD_RTOL)
