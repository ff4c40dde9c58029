"""Issue 14's Megatron flags that change the computation: --apply-layernorm-1p, --decoupled-lr /
--decoupled-min-lr, --grad-reduce-in-bf16 and --rotary-percent, each against an independent
reference (a plain model with the shifted weights, hand-run optax, the fp32 reduction, a numpy
partial rotary)."""

import dataclasses
import glob
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mlm_jax.config import ConfigError, OptimConfig, ParallelConfig
from mlm_jax.arguments import parse_args
from mlm_jax.models import GPT, tiny_gpt
from mlm_jax.models.layers import rotary
from mlm_jax.optim import apply_lr, decay_mask, decoupled_config, lr_at, make_optimizer
from mlm_jax.tools.hf_mapping import hf_to_params, params_to_hf
from mlm_jax.validation import finalize
from tests.parallel_util import build, fixed_batch, grads_for, place, tiny_config

CFG = tiny_gpt(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=300, padded_vocab_size=384,
               max_position_embeddings=32)
RNG = np.random.default_rng(0)
TOKENS = RNG.integers(0, 300, (2, 17)).astype(np.int32)
BATCH = {"tokens": TOKENS[:, :-1], "labels": TOKENS[:, 1:], "loss_mask": np.ones((2, 16), np.float32),
         "position_ids": np.broadcast_to(np.arange(16, dtype=np.int32), (2, 16)).copy()}


def model_parts(cfg):
    with nnx.use_eager_sharding(False):
        model = GPT(cfg, nnx.Rngs(0))
    return nnx.graphdef(model), nnx.to_pure_dict(nnx.state(model))


def loss_and_grads(graphdef, params):
    def loss(p):
        return nnx.merge(graphdef, p).loss(BATCH, None)[0]

    return jax.jit(jax.value_and_grad(loss))(params)


def map_scales(params, fn):
    """Apply fn to every norm weight (`.../scale`) of a pure-dict param tree."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: fn(x) if getattr(path[-1], "key", None) == "scale" else x, params)


# ------------------------------------------------------------------ --apply-layernorm-1p


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_is_the_plain_model_with_weights_plus_one(norm):
    """A 1p model storing w - 1 computes exactly what the plain model storing w computes, and its
    gradient w.r.t. w - 1 is the plain model's gradient w.r.t. w. The weights are 1 + k/256
    (exact in fp32, so w - 1 and 1 + (w - 1) round-trip exactly): the results are bit-equal."""
    plain_cfg = dataclasses.replace(CFG, normalization=norm)
    one_p_cfg = dataclasses.replace(plain_cfg, apply_layernorm_1p=True)
    g_plain, p_plain = model_parts(plain_cfg)
    g_1p, p_1p = model_parts(one_p_cfg)
    assert _scales(p_1p) and all(not np.any(s) for s in _scales(p_1p)), "1p norm weights start at 0 (gamma 1)"
    rng = np.random.default_rng(1)
    p_plain = map_scales(p_plain, lambda s: 1.0 + rng.integers(-64, 64, s.shape).astype(np.float32) / 256)
    p_1p = map_scales(p_plain, lambda s: s - 1.0)  # every other weight shared
    loss_plain, grads_plain = loss_and_grads(g_plain, p_plain)
    loss_1p, grads_1p = loss_and_grads(g_1p, p_1p)
    assert float(loss_1p) == float(loss_plain)
    for a, b in zip(jax.tree.leaves(grads_plain), jax.tree.leaves(grads_1p)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=0)


def _scales(params):
    out = []
    jax.tree_util.tree_map_with_path(
        lambda path, x: out.append(np.asarray(x)) if getattr(path[-1], "key", None) == "scale" else None, params)
    return out


def test_layernorm_1p_norm_weights_have_no_weight_decay():
    """Megatron's rule (no decay on 1-D parameters) holds for the w - 1 weights too."""
    _, params = model_parts(dataclasses.replace(CFG, apply_layernorm_1p=True))
    mask = decay_mask(params)
    assert not mask["final_norm"]["scale"] and not mask["layers"]["norm1"]["scale"]


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_layernorm_1p_hf_export_and_import_convert(kind):
    """Hugging Face stores gamma: export adds 1, import subtracts it; round trip exact."""
    style = ({} if kind == "gpt2" else dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                                            add_bias_linear=False))
    plain = dataclasses.replace(CFG, **style)
    one_p = dataclasses.replace(plain, apply_layernorm_1p=True)
    _, p = model_parts(plain)
    p = map_scales(p, lambda s: 1.0 + np.random.default_rng(2).integers(-64, 64, s.shape).astype(np.float32) / 256)
    p = jax.tree.map(np.asarray, p)
    stored = map_scales(p, lambda s: s - 1.0)
    hf_plain = params_to_hf(p, plain, kind)
    hf_1p = params_to_hf(stored, one_p, kind)
    assert hf_plain.keys() == hf_1p.keys()
    for name in hf_plain:
        np.testing.assert_array_equal(hf_1p[name], hf_plain[name], err_msg=name)
    back = hf_to_params(hf_1p, one_p, kind, 384)
    for a, b in zip(jax.tree.leaves(stored), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_layernorm_1p_checkpoint_of_the_other_kind_is_refused():
    """Its norm weights mean gamma - 1: loading one kind into the other is refused by name, and
    --use-checkpoint-args takes the setting (and --rotary-percent) from the checkpoint."""
    from mlm_jax.checkpoint.format import ARCH_FIELDS, CheckpointError, check_model_matches

    with pytest.raises(CheckpointError, match=r"--apply-layernorm-1p: checkpoint True, this run False"):
        check_model_matches(dataclasses.replace(CFG, apply_layernorm_1p=True), CFG, "ckpt")
    assert {"apply_layernorm_1p", "rotary_percent"} <= set(ARCH_FIELDS)


# ------------------------------------------------------------------ --decoupled-lr / --decoupled-min-lr


def _tree():
    rng = np.random.default_rng(3)
    shapes = {"embed": (6, 4), "pos_embed": (5, 4), "lm_head": (4, 6),
              "layers": {"attention": {"wqkv": (4, 3), "bqkv": (3,)}, "norm1": {"scale": (4,)}}}
    return jax.tree.map(lambda s: jnp.asarray(rng.normal(size=s), jnp.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))


def _run(tx, params, grads_seq):
    state = tx.init(params)
    for g in grads_seq:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _run_ours(cfg: OptimConfig, params, grads_seq, train_iters=10):
    """What the train step does: `make_optimizer`'s unit-LR AdamW, then `apply_lr` with Megatron's
    schedule at each completed-update count (and the decoupled one with --decoupled-lr)."""
    tx = make_optimizer(cfg)
    state = tx.init(params)
    for step, g in enumerate(grads_seq):
        updates, state = tx.update(g, state, params)
        dec = lr_at(decoupled_config(cfg), train_iters, step) if cfg.decoupled_lr is not None else None
        params = optax.apply_updates(params, apply_lr(updates, lr_at(cfg, train_iters, step), dec))
    return params


def test_decoupled_lr_moves_embedding_and_output_layer_by_their_own_schedule():
    """After 1 and 3 steps: `embed` and `lm_head` equal a hand-run optax AdamW on the decoupled
    schedule (peak --decoupled-lr, final --decoupled-min-lr), every other leaf (including the
    position table) an AdamW on --lr / --min-lr; clipping is global, so it is off here."""
    cfg = OptimConfig(lr=1e-2, min_lr=1e-3, decoupled_lr=3e-2, decoupled_min_lr=2e-3, lr_decay_style="linear",
                      lr_warmup_iters=0, lr_decay_iters=2, clip_grad=0.0, weight_decay=0.1)
    params = _tree()
    rng = np.random.default_rng(4)
    grads = [jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.float32), params) for _ in range(3)]

    def hand(peak, final):
        sched = optax.linear_schedule(peak, final, 2)  # Megatron's linear decay over 2 iterations, then final
        return optax.adamw(sched, b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_eps,
                           weight_decay=cfg.weight_decay, mask=decay_mask)

    for steps in (1, 3):
        got = _run_ours(cfg, params, grads[:steps])
        main = _run(hand(1e-2, 1e-3), params, grads[:steps])
        dec = _run(hand(3e-2, 2e-3), params, grads[:steps])
        for key in got:
            want = dec[key] if key in ("embed", "lm_head") else main[key]
            for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got[key])):
                np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7, err_msg=key)
        moved_main = float(jnp.max(jnp.abs(got["pos_embed"] - params["pos_embed"])))
        moved_dec = float(jnp.max(jnp.abs(got["embed"] - params["embed"])))
        assert moved_dec > 1.5 * moved_main  # the decoupled LR is 3x: not the same schedule


def test_without_decoupled_lr_the_optimizer_is_optax_adamw_bit_for_bit():
    cfg = OptimConfig(lr=1e-2, min_lr=1e-3, lr_decay_style="cosine", clip_grad=1.0, weight_decay=0.1)
    params = _tree()
    grads = [jax.tree.map(lambda p: p * 0.3 + 0.1, params)] * 2
    ref = optax.chain(optax.clip_by_global_norm(1.0),
                      optax.adamw(lambda c: lr_at(cfg, 10, c), b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1,
                                  mask=decay_mask))
    for a, b in zip(jax.tree.leaves(_run(ref, params, grads)), jax.tree.leaves(_run_ours(cfg, params, grads))):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_decoupled_lr_rules():
    assert parse_args(["--decoupled-lr", "1e-4"]).optim.decoupled_lr == 1e-4
    with pytest.raises(ConfigError, match=r"--decoupled-min-lr 1e-05 needs --decoupled-lr"):
        finalize(parse_args(["--decoupled-min-lr", "1e-5"]), 1)
    with pytest.raises(ConfigError, match=r"need --decoupled-min-lr \(0.1\) <= --decoupled-lr \(0.01\)"):
        finalize(parse_args(["--decoupled-lr", "1e-2", "--decoupled-min-lr", "0.1"]), 1)
    with pytest.raises(ConfigError, match=r"need --min-lr \(0.0001\) <= --decoupled-lr \(1e-05\)"):
        finalize(parse_args(["--decoupled-lr", "1e-5"]), 1)
    with pytest.raises(ConfigError, match=r"--decoupled-lr must be >= 0, got -1.0"):
        finalize(parse_args(["--decoupled-lr", "-1"]), 1)


def test_decoupled_lr_through_the_zero_train_step():
    """The sharded step (dp8, ZeRO) with --decoupled-lr: one constant-LR step moves the word
    embedding by the decoupled LR's Adam step (|update| = lr for a first Adam step with
    nonzero gradient and no decay) and a layer weight by --lr."""
    pz = build(ParallelConfig(use_distributed_optimizer=True), 1)
    optim = dataclasses.replace(pz.cfg.optim, lr=1e-3, decoupled_lr=5e-3, weight_decay=0.0, clip_grad=0.0,
                                adam_eps=1e-30)
    from mlm_jax.build import parallelize

    pz = parallelize(pz.cfg.replace(optim=optim), pz.mesh)
    state = pz.init(0)
    before = jax.tree.map(np.asarray, state["params"])
    state, _ = pz.train_step(state, place(pz, fixed_batch()), jax.random.key(0))
    after = jax.tree.map(np.asarray, state["params"])
    emb = np.abs(after["embed"] - before["embed"])[:500]
    emb = emb[emb > 0]
    np.testing.assert_allclose(emb, 5e-3, rtol=1e-3)
    w = np.abs(after["layers"]["mlp"]["w1"] - before["layers"]["mlp"]["w1"])
    np.testing.assert_allclose(w[w > 0], 1e-3, rtol=1e-3)


# ------------------------------------------------------------------ --grad-reduce-in-bf16

_REDUCE = re.compile(r"=\s*(.+?)\s+(all-reduce|reduce-scatter)(?:-start)?\(")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reduced_elements(hlo_text: str) -> dict[str, int]:
    """Elements reduced (all-reduce / reduce-scatter) per dtype in an HLO module's text."""
    out: dict[str, int] = {}
    for line in hlo_text.splitlines():
        m = _REDUCE.search(line)
        if m:
            for dtype, dims in re.findall(r"(bf16|f32)\[([\d,]*)\]", m.group(1)):
                out[dtype] = out.get(dtype, 0) + int(np.prod([int(d) for d in dims.split(",") if d]))
    return out


def test_grad_reduce_in_bf16_reduces_in_bf16(tmp_path):
    """The partitioned gradient step of dp8 and dp8 ZeRO (reduce-scatter, spelled all-reduce +
    slice on XLA:CPU): with the flag the data-parallel reduction carries at least one gradient's
    worth of bf16 elements and only scalars in f32; without it, no bf16 at all. Read before
    XLA:CPU's all-reduce-promotion pass, which widens every bf16 all-reduce to f32 on the CPU
    backend only (tests/bf16_reduce_worker.py compiles in a subprocess with that dump)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", JAX_ENABLE_COMPILATION_CACHE="false",
               XLA_FLAGS=f"--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                         f"--xla_dump_to={tmp_path} --xla_dump_hlo_pass_re=all-reduce-promotion")
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "bf16_reduce_worker.py")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    n_params = sum(int(np.prod(s.shape)) for s in jax.tree.leaves(build(ParallelConfig(), 1).shapes))
    counts = {}
    for case in ("dp8_f32", "dp8_bf16", "zero_f32", "zero_bf16"):
        [dump] = glob.glob(str(tmp_path / f"*jit_grads_{case}.*before_all-reduce-promotion.txt"))
        counts[case] = _reduced_elements(open(dump).read())
    for layout in ("dp8", "zero"):
        f32, bf16 = counts[f"{layout}_f32"], counts[f"{layout}_bf16"]
        assert f32.get("bf16", 0) == 0 and f32["f32"] >= n_params, counts
        assert bf16["bf16"] >= n_params and bf16.get("f32", 0) < 16, counts  # f32: the loss, token count


@pytest.mark.parametrize("parallel, model", [
    (ParallelConfig(), ()), (ParallelConfig(pipeline_model_parallel_size=2), ()),
    (ParallelConfig(expert_model_parallel_size=2), (("num_experts", 4), ("moe_router_topk", 2))),
    (ParallelConfig(overlap_grad_reduce=True, use_distributed_optimizer=True), ()),
    (ParallelConfig(use_megatron_fsdp=True, use_distributed_optimizer=True), ())],
    ids=["dp8", "pp2_dp4", "ep2_dp4_moe", "dp8_zero_overlap", "dp8_fsdp"])
def test_grad_reduce_in_bf16_matches_the_fp32_reduction_within_bf16_rounding(parallel, model):
    """Loss identical (the loss is reduced separately); every gradient leaf within bf16's
    rounding of the per-rank gradients and their sums: |diff| <= 2^-6 x the leaf's largest
    fp32 gradient. And not identical: the flag does take effect (the pipeline's one reduction
    too, expert parallelism's: experts over data, the rest over data x expert,
    --overlap-grad-reduce's, layer by layer in the backward, and FSDP's, each layer's
    reduce-scatter in its backward)."""
    loss32, g32 = grads_for(parallel, 1, model=model)
    loss16, g16 = grads_for(dataclasses.replace(parallel, grad_reduce_in_bf16=True), 1, model=model)
    assert loss16 == loss32
    differs = False
    for a, b in zip(jax.tree.leaves(g32), jax.tree.leaves(g16)):
        assert b.dtype == np.float32
        np.testing.assert_allclose(b, a, rtol=0, atol=2.0 ** -6 * float(np.max(np.abs(a))) + 1e-12)
        differs |= not np.array_equal(a, b)
    assert differs


def test_grad_reduce_in_bf16_says_where_it_does_not_apply():
    from mlm_jax.parallel.data import bf16_grad_reduce_note
    from mlm_jax.sharding.mesh import make_mesh

    def note(parallel, **model):
        cfg = finalize(tiny_config(dataclasses.replace(parallel, grad_reduce_in_bf16=True), 1, **model), 8)
        return bf16_grad_reduce_note(cfg, make_mesh(cfg.parallel))

    assert note(ParallelConfig()) is None and note(ParallelConfig(use_distributed_optimizer=True)) is None
    assert note(ParallelConfig(tensor_model_parallel_size=8)).startswith("no effect: the data-parallel size is 1")
    assert note(ParallelConfig(pipeline_model_parallel_size=2)) is None  # the pipeline reduces once too
    assert note(ParallelConfig(context_parallel_size=2)) is None  # context parallelism reduces once too
    assert note(ParallelConfig(), num_experts=4) is None  # a dropless MoE reduces once per step too
    assert note(ParallelConfig(pipeline_model_parallel_size=2), num_experts=4) is None  # in the pipeline too
    assert note(ParallelConfig(expert_model_parallel_size=2), num_experts=4) is None  # expert parallel too
    assert note(ParallelConfig(expert_model_parallel_size=8), num_experts=8) is None  # data 1, expert 8
    assert note(ParallelConfig(expert_model_parallel_size=2, pipeline_model_parallel_size=2), num_experts=4) is None
    assert note(ParallelConfig(), num_experts=4, moe_expert_capacity_factor=1.0) is None  # capacity dropping too
    assert note(ParallelConfig(), hidden_dropout=0.1) is None  # dropout reduces once per step too
    cfg = finalize(tiny_config(ParallelConfig(), 1), 8)
    assert bf16_grad_reduce_note(cfg, make_mesh(cfg.parallel)) is None  # not asked for


# ------------------------------------------------------------------ --rotary-percent


def numpy_partial_rotary(x, positions, base, percent):
    """GPT-NeoX / Megatron partial rotary, written from the definition: the first
    rot = int(k x percent) channels of each head rotated (rotate-half within them, frequencies
    base^(-2i/rot)), the other channels unchanged."""
    x = np.asarray(x, np.float64)
    k = x.shape[-1]
    rot = int(k * percent)
    half = rot // 2
    freq = base ** (-np.arange(half) * 2.0 / rot)
    ang = np.asarray(positions, np.float64)[:, :, None, None] * freq  # [b, s, 1, half]
    a, b = x[..., :half], x[..., half:rot]
    out = x.copy()
    out[..., :half] = a * np.cos(ang) - b * np.sin(ang)
    out[..., half:rot] = b * np.cos(ang) + a * np.sin(ang)
    return out


@pytest.mark.parametrize("percent", [0.5, 0.25, 1.0])
def test_partial_rotary_matches_the_reference(percent):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(2, 7, 3, 16)).astype(np.float32)
    pos = rng.integers(0, 50, (2, 7))
    got = np.asarray(rotary(jnp.asarray(x), jnp.asarray(pos), 10000.0, percent))
    np.testing.assert_allclose(got, numpy_partial_rotary(x, pos, 10000.0, percent), rtol=1e-5, atol=1e-5)
    rot = int(16 * percent)
    np.testing.assert_array_equal(got[..., rot:], x[..., rot:])


def test_partial_rotary_in_the_model_and_its_kv_cache():
    """A rope model with --rotary-percent 0.5: its logits differ from full rotary (the flag is
    used), and cached greedy decoding equals the argmax of full-sequence logits."""
    from tests.gen_util import LLAMA_STYLE, V, uncached_greedy
    from mlm_jax.config import Config, ModelConfig, padded_vocab_size
    from mlm_jax.loading import LoadedModel, _shardings
    from mlm_jax.models.build import init_params
    from mlm_jax.sharding.mesh import make_mesh

    def loaded(percent):
        m = ModelConfig(vocab_size=V, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.5,
                        rotary_percent=percent, **LLAMA_STYLE)
        m = dataclasses.replace(m, padded_vocab_size=padded_vocab_size(V, m.make_vocab_size_divisible_by, 1))
        mesh = make_mesh(ParallelConfig())
        _, shardings = _shardings(m, mesh)
        params = jax.tree.map(jax.device_put, init_params(Config(model=m), 0), shardings)
        return LoadedModel(m, params, mesh, None, f"rotary-{percent}", None)

    half = loaded(0.5)
    prompts = [[1, 2, 3, 4, 5], [7, 8]]
    outs = half.generate(prompts, max_new_tokens=6)
    assert [o.tokens for o in outs] == uncached_greedy(half.logits, prompts, 6, 32)
    buf = np.zeros((1, 32), np.int64)
    buf[0, :5] = prompts[0]
    assert not np.allclose(np.asarray(half.logits(buf))[0, :5], np.asarray(loaded(1.0).logits(buf))[0, :5])


def test_rotary_percent_rules():
    assert parse_args(["--position-embedding-type", "rope", "--rotary-percent", "0.5"]).model.rotary_percent == 0.5
    for argv, message in [
        (["--rotary-percent", "0.5"], "--rotary-percent 0.5 needs --position-embedding-type rope (got learned_absolute)"),
        (["--position-embedding-type", "rope", "--rotary-percent", "0"], "--rotary-percent must be in (0, 1], got 0.0"),
        (["--position-embedding-type", "rope", "--rotary-percent", "1.5"], "--rotary-percent must be in (0, 1], got 1.5"),
        (["--position-embedding-type", "rope", "--rotary-percent", "0.3"],
         "--rotary-percent 0.3 x head dim 32 = 9 rotary channels; they must be a positive even number (rotated in pairs)"),
    ]:
        with pytest.raises(ConfigError) as e:
            finalize(parse_args(argv), 1)
        assert str(e.value) == message


# ------------------------------------------------------------------ --overlap-grad-reduce / --overlap-param-gather


def test_overlap_flags_map_to_xla_gpu_scheduler_flags():
    from mlm_jax import xla_flags

    grad = parse_args(["--overlap-grad-reduce"]).parallel
    both = parse_args(["--overlap-grad-reduce", "--overlap-param-gather", "--use-distributed-optimizer"]).parallel
    assert xla_flags.overlap_flags(parse_args([]).parallel) == []
    assert xla_flags.overlap_flags(grad) == ["--xla_gpu_enable_latency_hiding_scheduler=true",
                                             "--xla_gpu_enable_pipelined_all_reduce=true",
                                             "--xla_gpu_enable_pipelined_reduce_scatter=true"]
    assert xla_flags.overlap_flags(both) == xla_flags.overlap_flags(grad) + ["--xla_gpu_enable_pipelined_all_gather=true"]
    # a flag the user set (to any value) is not repeated
    user = "--xla_dump_to=/x --xla_gpu_enable_latency_hiding_scheduler=false"
    assert xla_flags.overlap_flags(grad, user) == ["--xla_gpu_enable_pipelined_all_reduce=true",
                                                   "--xla_gpu_enable_pipelined_reduce_scatter=true"]


def test_overlap_flags_set_on_a_gpu_run_only(monkeypatch):
    from mlm_jax import xla_flags

    grad = parse_args(["--overlap-grad-reduce"]).parallel
    env = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    assert not xla_flags.gpu_run(env) and xla_flags.apply(grad, env) == []
    assert env == {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    # Without JAX_PLATFORMS: a GPU run needs both the CUDA plugin and an NVIDIA device node.
    for plugin, node in ((False, True), (True, False), (True, True)):
        with monkeypatch.context() as m:
            m.setattr(xla_flags.importlib.util, "find_spec", lambda name, plugin=plugin: object() if plugin else None)
            m.setattr(xla_flags.os.path, "exists", lambda path, node=node: node and path == "/dev/nvidiactl")
            assert xla_flags.gpu_run({}) == (plugin and node)
            assert xla_flags.gpu_run({"JAX_PLATFORMS": "cuda"}) == (plugin and node)
    monkeypatch.setattr(xla_flags, "gpu_run", lambda environ: True)
    env = {"XLA_FLAGS": "--a=1"}
    assert xla_flags.apply(grad, env) == list(xla_flags.GPU_TRAINING)  # the overlap flags among them
    assert set(xla_flags.GRAD_REDUCE + xla_flags.PARAM_GATHER) <= set(xla_flags.GPU_TRAINING)
    assert env["XLA_FLAGS"] == "--a=1 " + " ".join(xla_flags.GPU_TRAINING)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.9"
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8"}
    xla_flags.apply(grad, env)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.8"  # the user's
    # the user's XLA_FLAGS win, whatever the value
    env = {"XLA_FLAGS": "--xla_gpu_enable_triton_gemm=true"}
    assert "--xla_gpu_enable_triton_gemm=false" not in xla_flags.apply(grad, env)
    assert env["XLA_FLAGS"].split()[0] == "--xla_gpu_enable_triton_gemm=true"
    assert "triton_gemm=false" not in env["XLA_FLAGS"]
    # a deviceless compile for GPUs (mlm_jax.plan) asks for them on a machine without one
    env = {"JAX_PLATFORMS": "cpu"}
    monkeypatch.setattr(xla_flags, "gpu_run", lambda environ: False)
    assert xla_flags.apply(grad, env) == [] and xla_flags.apply(grad, env, gpu=True) == list(xla_flags.GPU_TRAINING)
    # Under sequence parallelism the pipelined all-gather is left out (two microbatches' activations
    # otherwise), even where --overlap-param-gather asks for it (ZeRO's gather is outside every loop).
    sp = parse_args(["--tensor-model-parallel-size", "2", "--sequence-parallel"]).parallel
    got = xla_flags.gpu_flags(sp)
    assert "--xla_gpu_enable_pipelined_all_gather=true" not in got
    assert got == [f for f in xla_flags.GPU_TRAINING if "pipelined_all_gather" not in f]
    sp_gather = parse_args(["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
                            "--overlap-param-gather"]).parallel
    assert got == xla_flags.gpu_flags(sp_gather)
    zero_gather = parse_args(["--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
                              "--overlap-param-gather"]).parallel
    assert "--xla_gpu_enable_pipelined_all_gather=true" in xla_flags.gpu_flags(zero_gather)
    # Context parallelism likewise (its key/value gathers and ring blocks inside every layer: each
    # microbatch's matmuls ran twice with it, benchmarks/RESULTS.md).
    cp = parse_args(["--context-parallel-size", "2", "--use-distributed-optimizer", "--overlap-param-gather"]).parallel
    assert xla_flags.gpu_flags(cp) == got
    # FSDP likewise (each layer's weights gathered inside the layer loop: 6.29 against 3.67 GiB at
    # two microbatches, mlm_jax/xla_flags.py); ZeRO-1's optim strategy keeps it.
    for strategy in ("optim_grads", "optim_grads_params"):
        fsdp = parse_args(["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy]).parallel
        assert xla_flags.gpu_flags(fsdp) == got, strategy
    optim = parse_args(["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim",
                        "--overlap-param-gather"]).parallel
    assert "--xla_gpu_enable_pipelined_all_gather=true" in xla_flags.gpu_flags(optim)
    # XLA's own rematerialization off (a user's --xla_disable_hlo_passes list replaces ours)
    assert xla_flags.NO_COMPILER_RECOMPUTE in xla_flags.GPU_TRAINING
    assert not xla_flags.compiler_recompute(" ".join(xla_flags.GPU_TRAINING))
    assert xla_flags.compiler_recompute("--xla_disable_hlo_passes=foo") and xla_flags.compiler_recompute("")
    assert not xla_flags.compiler_recompute("--xla_disable_hlo_passes=foo,rematerialization")


def test_overlap_xla_flags_are_known_to_xla():
    """Every flag we may set parses in this XLA (an unknown flag in XLA_FLAGS aborts XLA)."""
    from mlm_jax import xla_flags

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(dict.fromkeys(xla_flags.GPU_TRAINING + xla_flags.GRAD_REDUCE
                                                                     + xla_flags.PARAM_GATHER)))
    p = subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
