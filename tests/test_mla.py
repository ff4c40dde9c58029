"""Multi-latent attention (mlm_jax/models/mla.py): the layer against an independent numpy
reference (latents, their norms, YaRN rope in MLA's channel order, the scores' scale), YaRN's
numbers for DeepSeek-V3's settings, every layout's loss and gradients against one device (with
multi-token prediction and DeepSeek's MoE), decoding with the latent cache against the uncached
forward, Hugging Face DeepSeek-V3 import and export, and the flags with their refusals."""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import mlm_jax

from mlm_jax.arguments import parse_args
from mlm_jax.config import ModelConfig, ParallelConfig
from mlm_jax.models.mla import MLAttention, rope_frequencies, softmax_scale
from mlm_jax.train import main
from tests.gen_util import memory_model, uncached_greedy
from tests.parallel_util import grads_for, tiny_config, unpad
from tests.test_parallel import GRAD_RTOL, LOSS_ATOL, assert_trees_close
from mlm_jax.validation import finalize

MLA = (("multi_latent_attention", True), ("q_lora_rank", 24), ("kv_lora_rank", 16), ("qk_head_dim", 8),
       ("qk_pos_emb_head_dim", 4), ("v_head_dim", 6), ("qk_layernorm", True), ("position_embedding_type", "rope"),
       ("normalization", "RMSNorm"), ("rotary_scaling_factor", 40.0), ("mscale", 1.0), ("mscale_all_dim", 1.0))
NO_Q_LATENT = tuple(kv for kv in MLA if kv[0] not in ("q_lora_rank", "qk_layernorm")) + (("rope_type", "rope"),)
DEEPSEEK_MOE = (("num_experts", 4), ("moe_router_topk", 2), ("moe_router_score_function", "sigmoid"),
                ("moe_router_enable_expert_bias", True), ("moe_shared_expert_intermediate_size", 32),
                ("moe_aux_loss_coeff", 0.01), ("swiglu", True))


# --------------------------------------------------------------------------- the layer


def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _yarn_reference(cfg):
    """transformers' `_compute_yarn_parameters` (DeepSeek-V3's rope_scaling), written out."""
    dim, base, factor = cfg.qk_pos_emb_head_dim, cfg.rotary_base, cfg.rotary_scaling_factor
    pos_freqs = base ** (np.arange(0, dim, 2) / dim)
    if cfg.rope_type == "rope":
        return 1.0 / pos_freqs, 1.0

    def correction_dim(rot):
        return (dim * math.log(cfg.yarn_original_max_position_embeddings / (rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = math.floor(correction_dim(cfg.yarn_beta_fast)), math.ceil(correction_dim(cfg.yarn_beta_slow))
    low, high = max(low, 0), min(high, dim - 1)
    ramp = np.clip((np.arange(dim // 2) - low) / ((high + 0.001 if low == high else high) - low), 0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation

    def get_mscale(scale, m):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    return inv, get_mscale(factor, cfg.mscale) / get_mscale(factor, cfg.mscale_all_dim)


def _rope_interleaved(x, positions, inv_freq, attention_factor):
    """DeepSeek-V3's `apply_rotary_pos_emb_interleave`: de-interleave, then rotate halves."""
    *lead, e = x.shape
    x = x.reshape(*lead, e // 2, 2).swapaxes(-1, -2).reshape(*lead, e)
    angles = positions[:, :, None] * inv_freq  # [b, s, e/2]
    emb = np.concatenate([angles, angles], axis=-1)[:, :, None, :]
    cos, sin = np.cos(emb) * attention_factor, np.sin(emb) * attention_factor
    rotated = np.concatenate([-x[..., e // 2:], x[..., :e // 2]], axis=-1)
    return x * cos + rotated * sin


def _reference(cfg, p, x, positions):
    """The attention layer in numpy fp64, from the layer's parameters `p`."""
    h, nope, e, r = cfg.num_attention_heads, cfg.qk_head_dim, cfg.qk_pos_emb_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank:
        q_lat = x @ p["wq_down"]
        q_lat = _rms(q_lat, p["q_norm"], cfg.norm_epsilon) if cfg.qk_layernorm else q_lat
        q = np.einsum("bsr,rhk->bshk", q_lat, p["wq_up"])
    else:
        q = np.einsum("bsd,dhk->bshk", x, p["wq"])
    kv = x @ p["wkv_down"]
    latent, k_pe = kv[..., :r], kv[..., r:]
    latent = _rms(latent, p["kv_norm"], cfg.norm_epsilon) if cfg.qk_layernorm else latent
    up = np.einsum("bsr,rhj->bshj", latent, p["wkv_up"])
    k_nope, v = up[..., :nope], up[..., nope:]
    inv, factor = _yarn_reference(cfg)
    q = np.concatenate([q[..., :nope], _rope_interleaved(q[..., nope:], positions, inv, factor)], axis=-1)
    k_pe = _rope_interleaved(k_pe[:, :, None, :], positions, inv, factor)
    k = np.concatenate([k_nope, np.broadcast_to(k_pe, (*k_nope.shape[:3], e))], axis=-1)
    scale = 1 / math.sqrt(nope + e)
    if cfg.rotary_scaling_factor > 1 and cfg.mscale_all_dim:
        m = 0.1 * cfg.mscale_all_dim * math.log(cfg.rotary_scaling_factor) + 1.0
        scale *= m * m
    scores = np.einsum("bshk,bthk->bhst", q, k) * scale
    s = x.shape[1]
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    o = np.einsum("bhst,bthv->bshv", probs, v)
    return np.einsum("bshv,hvd->bsd", o, p["wo"]) + p["bo"]


def _layer(model: tuple, seed: int = 0):
    cfg = ModelConfig(**dict(model, hidden_size=32, num_attention_heads=4, num_layers=2, hidden_dropout=0.0,
                             attention_dropout=0.0, init_method_std=0.3))
    with nnx.use_eager_sharding(False):
        layer = MLAttention(cfg, nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    for norm in (layer.q_norm, layer.kv_norm):  # not all ones: the norms' weights must count
        if norm is not None:
            norm.scale[...] = jnp.asarray(rng.uniform(0.5, 1.5, norm.scale.shape), jnp.float32)
    layer.bo[...] = jnp.asarray(rng.normal(size=layer.bo.shape), jnp.float32)
    params = {k: np.asarray(v[...], np.float64) for k, v in vars(layer).items() if isinstance(v, nnx.Param)}
    for name in ("q_norm", "kv_norm"):
        if getattr(layer, name) is not None:
            params[name] = np.asarray(getattr(layer, name).scale[...], np.float64)
    return cfg, layer, params


@pytest.mark.parametrize("model", [MLA + (("add_bias_linear", True),), NO_Q_LATENT + (("add_bias_linear", True),)],
                         ids=["q-latent-yarn", "q-direct-rope"])
def test_the_layer_equals_a_numpy_reference(model):
    cfg, layer, p = _layer(model)
    x = np.random.default_rng(1).normal(size=(2, 12, cfg.hidden_size))
    positions = np.broadcast_to(np.arange(12), (2, 12)) + np.array([[0], [300]])  # far positions: YaRN's slowed channels
    got = layer(jnp.asarray(x, jnp.float32), jnp.asarray(positions, jnp.int32), None, None)
    want = _reference(cfg, p, x, positions.astype(np.float64))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_yarn_for_deepseek_v3s_settings():
    """DeepSeek-V3's rope part (64 channels, base 10000, factor 40, original 4096 positions,
    beta 32 and 1, mscale and mscale_all_dim 1): channels 0-9 keep their frequency, 23 and up
    are slowed 40x, a linear blend between; cos and sin unscaled (the two mscales cancel) and
    the scores' scale (0.1 ln 40 + 1)^2 / sqrt(192)."""
    cfg = ModelConfig(multi_latent_attention=True, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128,
                      rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0)
    inv, magnitude = rope_frequencies(cfg)
    plain = 1.0 / 10000 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(inv[:11], plain[:11], rtol=1e-6)  # ramp 0 up to channel 10 (low = 10)
    np.testing.assert_allclose(inv[23:], plain[23:] / 40, rtol=1e-6)  # ramp 1 from channel 23 (high = 23)
    blend = (np.arange(32) - 10) / 13
    np.testing.assert_allclose(inv[11:23], (plain / 40 * blend + plain * (1 - blend))[11:23], rtol=1e-6)
    assert magnitude == 1.0
    assert softmax_scale(cfg) == pytest.approx((0.1 * math.log(40) + 1) ** 2 / math.sqrt(192), rel=1e-12)
    inv_ref, factor_ref = _yarn_reference(dataclasses.replace(cfg, mscale=0.707))
    inv2, magnitude2 = rope_frequencies(dataclasses.replace(cfg, mscale=0.707))
    np.testing.assert_allclose(inv2, inv_ref, rtol=1e-6)
    assert magnitude2 == pytest.approx(factor_ref)


# --------------------------------------------------------------------------- layouts

MTP1, MTP2 = (("mtp_num_layers", 1),), (("mtp_num_layers", 2), ("mtp_loss_scaling_factor", 0.5))
LAYOUTS = {
    "dp2_tp4_sp_mtp2": (ParallelConfig(tensor_model_parallel_size=4, sequence_parallel=True), 4, MLA + MTP2),
    # the pipeline: the MTP depths run after the last stage's layers, on every stage
    "dp2_tp2_pp2_q_direct_mtp2": (ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 4,
                                  NO_Q_LATENT + MTP2),
    "ep2_tp2_sp_deepseek_moe_mtp": (ParallelConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2,
                                               sequence_parallel=True), 2, MLA + DEEPSEEK_MOE + MTP1),
    # context parallelism: the ring over the load-balanced chunks, the values padded to the keys'
    # width; MTP rolls its tokens, labels and mask along the original sequence
    "cp2_p2p_tp2_dp2_mtp": (ParallelConfig(context_parallel_size=2, tensor_model_parallel_size=2), 2, MLA + MTP1),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_and_every_gradient_match_single_device(name):
    parallel, micro, model = LAYOUTS[name]
    # A MoE's aux loss and the MTP losses are each microbatch's means: the reference's microbatches
    # are the layout's (micro batch x the ranks of batch rows); the plain loss does not care.
    ranks = 8 // (parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size
                  * parallel.context_parallel_size)
    per_microbatch = dict(model).get("num_experts") or dict(model).get("mtp_num_layers")
    ref_micro = micro * ranks if per_microbatch else 4
    ref_loss, ref_grads = grads_for(ParallelConfig(), ref_micro, single_device=True, model=model)
    loss, grads = grads_for(parallel, micro, model=model)
    assert abs(loss - ref_loss) <= LOSS_ATOL, (loss, ref_loss)
    assert_trees_close(unpad(ref_grads), unpad(grads), GRAD_RTOL)
    attention = grads["layers"]["attention"]
    for leaf in ("wkv_down", "wkv_up", "wo") + (("wq_down", "wq_up") if dict(model).get("q_lora_rank") else ("wq",)):
        assert np.abs(attention[leaf]).max() > 0, leaf
    if dict(model).get("mtp_num_layers"):  # the depths' layers are in the comparison above, and learn
        assert np.abs(grads["mtp"]["eh_proj"]).max() > 0 and np.abs(grads["mtp"]["layer"]["attention"]["wo"]).max() > 0


# --------------------------------------------------------------------------- --recompute-modules

RECOMPUTED = MLA + DEEPSEEK_MOE + (("moe_layer_freq", (0, 1)), ("recompute_granularity", "selective"))


def _projections(eqn) -> bool:  # a matmul without batch dims (every projection; no attention product)
    return eqn.primitive.name == "dot_general" and not eqn.params["dimension_numbers"][1][0]


def test_recompute_modules_recompute_each_module_and_keep_the_gradients():
    """Megatron's DeepSeek-V3 script's `--recompute-modules mlp moe mla_up_proj layernorm` (and the
    other two): the gradient step (traced) runs each module's forward again in its backward: the
    dense layer's MLP first product, the MoE layer's router and experts, the shared expert's first
    product, MLA's two up projections per layer, the norms (rsqrt: the layers' two and MLA's two
    latent norms; no expert product again), and all four of them together each of these; the
    experts' activation output is not kept; the loss
    and every gradient are those without (one device, fp32: the same products, recomputed)."""
    import contextlib
    import io

    from mlm_jax.models.moe import expert_ffn
    from tests.parallel_util import build, count_eqns, fixed_batch, place

    def traced(modules):
        model = dict(RECOMPUTED, recompute_modules=modules) if modules else dict(RECOMPUTED)
        pz = build(ParallelConfig(), 4, jax.devices()[:1], **model)
        return pz.loss_and_grads.trace(pz.init(0)["params"], place(pz, fixed_batch()), jax.random.key(0)).jaxpr.jaxpr

    def counts(jaxpr):
        return {name: count_eqns(jaxpr, _projections if name == "dot" else lambda e, n=name: e.primitive.name == n)
                for name in ("dot", "rsqrt", "ragged_dot_general")}

    base, layers = counts(traced(())), 2
    more = {("mlp",): {"dot": 1}, ("shared_experts",): {"dot": 1}, ("moe",): {"dot": 2, "ragged_dot_general": 2},
            ("mla_up_proj",): {"dot": 2 * layers}, ("layernorm",): {"rsqrt": 4 * layers}}
    # All four of the script's together: each its own (layernorm's region keeps none of what the
    # others recompute: before, it kept the MoE's products and the up projections' outputs)
    script = ("mlp", "moe", "mla_up_proj", "layernorm")
    more[script] = {k: sum(more[(m,)].get(k, 0) for m in script) for k in base}
    for modules, extra in more.items():
        got = counts(traced(modules))
        assert got == {k: n + extra.get(k, 0) for k, n in base.items()}, (modules, got, base)

    def residuals(modules):  # what the experts' gradient keeps
        cfg = ModelConfig(hidden_size=16, num_attention_heads=4, num_experts=4, moe_ffn_hidden_size=8, swiglu=True,
                          recompute_granularity="selective", recompute_modules=modules)
        x, ids = jnp.ones((12, 16)), jnp.arange(12) % 4
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            jax.ad_checkpoint.print_saved_residuals(
                lambda x, w1, w2: expert_ffn(cfg, x, ids, w1, w2, None, None).sum(), x, jnp.ones((4, 16, 2, 8)),
                jnp.ones((4, 8, 16)))
        return out.getvalue()

    assert "mlp_activation" in residuals(None) and "mlp_activation" not in residuals(("moe_act",))
    ref_loss, ref = grads_for(ParallelConfig(), 4, single_device=True, model=RECOMPUTED)
    loss, grads = grads_for(ParallelConfig(), 4, single_device=True,
                            model=RECOMPUTED + (("recompute_modules", ("mlp", "moe", "mla_up_proj", "layernorm",
                                                                       "moe_act", "shared_experts")),))
    assert loss == ref_loss
    assert_trees_close(ref, grads, 1e-6)


# --------------------------------------------------------------------------- decoding


def test_decoding_with_the_latent_cache_equals_the_uncached_forward():
    model = memory_model(2, "mla")  # heads split over tensor, the latent cache whole on each rank
    prompts = [[1, 2, 3, 4, 5], [7, 8], list(range(10, 21))]
    outs = model.generate(prompts, max_new_tokens=8)
    assert [o.tokens for o in outs] == uncached_greedy(model.logits, prompts, 8, 32)


def test_the_cache_holds_the_latents_not_keys_and_values():
    from mlm_jax.models.gpt import GPT

    m = memory_model(1, "mla")
    with nnx.use_eager_sharding(False):
        cache = jax.eval_shape(lambda: nnx.eval_shape(lambda: GPT(m.config, nnx.Rngs(0))).init_cache(3, 16))
    c = m.config
    assert {k: v.shape for k, v in cache.items()} == {"latent": (c.num_layers, 3, 16, c.kv_lora_rank),
                                                      "rope": (c.num_layers, 3, 16, c.qk_pos_emb_head_dim)}


# --------------------------------------------------------------------------- flags


def test_megatrons_mla_flags_map_onto_the_config():
    cfg = parse_args(["--multi-latent-attention", "--q-lora-rank", "1536", "--kv-lora-rank", "512",
                      "--qk-head-dim", "128", "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128",
                      "--qk-layernorm", "--rotary-scaling-factor", "40", "--mscale", "1.0", "--mscale-all-dim", "1.0",
                      "--rope-type", "yarn", "--cache-mla-latents"])
    m = cfg.model
    assert (m.multi_latent_attention, m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim,
            m.v_head_dim, m.qk_layernorm, m.rotary_scaling_factor, m.mscale, m.mscale_all_dim, m.rope_type) == \
        (True, 1536, 512, 128, 64, 128, True, 40.0, 1.0, 1.0, "yarn")
    assert (m.head_dim, m.value_head_dim) == (192, 128)


@pytest.mark.parametrize("argv, message", [
    (["--qk-layernorm"], "--qk-layernorm without --multi-latent-attention: per-head query/key norms"),
    (["--mscale", "0.7"], "--mscale 0.7 is multi-latent attention's YaRN rope; add --multi-latent-attention"),
    (["--rope-type", "yarn"], "--rope-type yarn needs --multi-latent-attention"),
    (["--multi-latent-attention", "--group-query-attention", "--num-query-groups", "2"],
     "--group-query-attention and --multi-latent-attention exclude each other"),
    (["--multi-latent-attention", "--qk-pos-emb-head-dim", "3"], "--qk-pos-emb-head-dim must be even"),
    (["--multi-latent-attention", "--kv-lora-rank", "0"], "--kv-lora-rank must be a positive number, got 0"),
    (["--multi-latent-attention", "--bf16", "--attention-dropout", "0", "--qk-head-dim", "256", "--attention-backend",
      "flash"], "--attention-backend flash: cuDNN fused attention of multi-latent attention needs a query/key head dim "
     "(--qk-head-dim + --qk-pos-emb-head-dim) that is a multiple of 8, <= 128 and >= --v-head-dim; got 320 and 128 (256 "
     "on a Hopper or newer GPU)"),
])
def test_bad_mla_flags_are_refused_naming_the_flag(argv, message, capsys):
    assert main(["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--seq-length", "32", "--max-position-embeddings", "64", "--train-iters", "1", *argv]) == 2
    assert message in capsys.readouterr().err


def test_the_model_counts_mlas_flops_and_parameters():
    """Megatron's MLA FLOPs per token: the down and up projections' weights, and the scores and
    weighted sum over query/key 192 + value 128 channels per head."""
    from mlm_jax.metrics import flops_per_token
    from mlm_jax.models.build import init_params

    cfg = finalize(tiny_config(ParallelConfig(), 16, **dict(MLA)), 1)
    m = cfg.model
    d, h = m.hidden_size, m.num_attention_heads
    attn = 24 * (d + h * 12) + d * (16 + 4) + 16 * h * (8 + 6) + h * 6 * d
    assert m.attention_weights == attn
    params = init_params(cfg, 0)
    counted = sum(params["layers"]["attention"][k].size for k in ("wq_down", "wq_up", "wkv_down", "wkv_up", "wo"))
    assert counted == attn * m.num_layers
    s = cfg.train.seq_length
    mlp = 2 * d * m.ffn_size
    want = 3 * 2 * (m.num_layers * (attn + mlp) + d * m.vocab) + 3 * 2 * s * h * (12 + 6) * m.num_layers / 2
    assert flops_per_token(m, s) == pytest.approx(want)


# --------------------------------------------------------------------------- Hugging Face DeepSeek-V3

HF5 = os.path.join(os.path.dirname(__file__), "fixtures", "hf5")  # written by tests/make_hf5_fixtures.py


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_q_direct"])
def test_deepseek_v3_exports_the_tensors_it_imported(tmp_path, name):
    """import-hf then export-hf gives back transformers' own tensors, every one, exactly."""
    from safetensors.numpy import load_file

    from mlm_jax.tools import checkpoint as hfc

    folder = os.path.join(HF5, name)
    assert hfc.main(["import-hf", "--hf-dir", folder, "--save", str(tmp_path / "ck")]) == 0
    assert hfc.main(["export-hf", "--load", str(tmp_path / "ck"), "--hf-dir", str(tmp_path / "hf")]) == 0
    want = load_file(os.path.join(folder, "model.safetensors"))
    got = {}
    for f in os.listdir(tmp_path / "hf"):
        if f.endswith(".safetensors"):
            got.update(load_file(str(tmp_path / "hf" / f)))
    if name == "deepseek_v3_q_direct":  # tied: the head is the embedding, not stored
        want.pop("lm_head.weight", None)
    assert sorted(got) == sorted(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)
    # the exported config.json: its logits against transformers' in tests/test_hf_rope.py (round trip)


def test_the_deepseek_fixture_tells_yarn_groups_and_the_bias_apart():
    """The DeepSeek-V3 fixture's logits are far off (> 0.1) with YaRN read as plain rope, the
    scores' mscale dropped, the group limit dropped, or the expert bias ignored."""
    folder = os.path.join(HF5, "deepseek_v3")
    ids, want = np.load(os.path.join(folder, "ids.npy")), np.load(os.path.join(folder, "logits.npy"))
    m = mlm_jax.load(folder)
    assert (m.config.rope_type, m.config.rotary_scaling_factor, m.config.moe_router_num_groups) == ("yarn", 40.0, 2)
    for wrong in (dict(rope_type="rope"), dict(mscale_all_dim=0.0), dict(moe_router_num_groups=None,
                                                                          moe_router_group_topk=None)):
        bad = dataclasses.replace(m, config=dataclasses.replace(m.config, **wrong))
        assert np.abs(bad.logits(ids) - want).max() > 0.1, wrong
    params = jax.tree.map(np.asarray, m.params)
    params["moe_layers"]["mlp"]["expert_bias"] = np.zeros_like(params["moe_layers"]["mlp"]["expert_bias"])
    assert np.abs(dataclasses.replace(m, params=params).logits(ids) - want).max() > 0.1


def test_a_deepseek_config_it_cannot_compute_is_refused(tmp_path):
    import json
    import shutil

    from mlm_jax.tools import checkpoint as hfc

    for edit, message in [({"topk_group": 2}, "scores a group by its 2 best experts"),
                          ({"rope_interleave": False}, "rope_interleave=false is not supported"),
                          ({"norm_topk_prob": False}, "norm_topk_prob=false is not supported")]:
        dst = tmp_path / str(len(os.listdir(tmp_path)))
        shutil.copytree(os.path.join(HF5, "deepseek_v3"), dst)
        cfg = json.load(open(dst / "config.json"))
        cfg.update(edit)
        (dst / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(hfc.HFError, match=message):
            hfc.load_hf(str(dst))
