"""Model pieces on one device: schedules, decay mask, init, recomputation, bf16, masks, dropout."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mlm_jax.config import OptimConfig
from mlm_jax.models import GPT, tiny_gpt
from mlm_jax.models.gpt import PADDED_LOGIT
from mlm_jax.models import PARAM_FORMAT_VERSION, ParamFormatError, downgrade_params, upgrade_params
from mlm_jax.optim import decay_mask, lr_at, make_optimizer

CFG = tiny_gpt(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=300,
               padded_vocab_size=384, max_position_embeddings=32)


def megatron_lr(cfg: OptimConfig, step: int, train_iters: int) -> float:
    """Megatron's OptimizerParamScheduler.get_lr, transcribed (WSD anneal linear)."""
    warmup, decay = cfg.lr_warmup_iters, cfg.lr_decay_iters or train_iters
    if warmup > 0 and step <= warmup:
        return cfg.lr * step / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    if step > decay:
        return cfg.min_lr
    if cfg.lr_decay_style == "WSD":
        anneal = cfg.lr_wsd_decay_iters
        start = decay - anneal
        coeff = 1.0 if step <= start else 1.0 - (step - start) / anneal
    else:
        ratio = (step - warmup) / (decay - warmup)
        coeff = 1.0 - ratio if cfg.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return cfg.min_lr + coeff * (cfg.lr - cfg.min_lr)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "WSD"])
def test_lr_schedule_matches_megatron(style):
    cfg = OptimConfig(lr=1e-3, min_lr=1e-4, lr_decay_style=style, lr_warmup_iters=10,
                      lr_decay_iters=80, lr_wsd_decay_iters=20)
    for step in [0, 1, 5, 10, 11, 40, 59, 60, 61, 79, 80, 81, 100]:
        assert float(lr_at(cfg, 100, step)) == pytest.approx(megatron_lr(cfg, step, 100), rel=1e-6, abs=1e-12), step


def test_weight_decay_skips_biases_and_norms():
    mask = decay_mask(model_parts(CFG)[1])
    assert mask["embed"] and mask["pos_embed"] and mask["layers"]["attention"]["wqkv"]
    assert mask["layers"]["mlp"]["w2"]
    assert not mask["layers"]["attention"]["bqkv"] and not mask["layers"]["mlp"]["b2"]
    assert not mask["layers"]["norm1"]["scale"] and not mask["final_norm"]["bias"]


def test_megatron_init():
    cfg = tiny_gpt(num_layers=8, hidden_size=256, num_attention_heads=4, vocab_size=1000,
                   padded_vocab_size=1024, init_method_std=0.02)
    p = model_parts(cfg)[1]
    assert np.std(p["layers"]["attention"]["wqkv"]) == pytest.approx(0.02, rel=0.02)
    assert np.std(p["layers"]["mlp"]["w2"]) == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.02)
    assert not np.any(p["embed"][1000:])  # padding rows
    assert np.all(p["layers"]["norm1"]["scale"] == 1.0) and not np.any(p["layers"]["mlp"]["b1"])


def model_parts(cfg):
    """(graphdef, pure-dict params) of an unsharded model."""
    with nnx.use_eager_sharding(False):
        model = GPT(cfg, nnx.Rngs(0))
    return nnx.graphdef(model), nnx.to_pure_dict(nnx.state(model))


def build(cfg):
    return nnx.merge(*model_parts(cfg))


def _loss_and_grads(cfg, tokens, key=None):
    graphdef, params = model_parts(cfg)

    def loss(p):
        logits = nnx.merge(graphdef, p)(tokens[:, :-1], dropout_key=key)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    return jax.jit(jax.value_and_grad(loss))(params)


TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 300, (2, 17)), jnp.int32)


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_recomputation_changes_nothing_but_memory(granularity):
    import dataclasses

    ref_loss, ref = _loss_and_grads(CFG, TOKENS)
    loss, grads = _loss_and_grads(dataclasses.replace(CFG, recompute_granularity=granularity), TOKENS)
    assert float(loss) == pytest.approx(float(ref_loss), abs=1e-6)
    for a, b in zip(jax.tree.leaves(ref), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 * float(np.max(np.abs(a))) + 1e-10)


def test_a_cpus_unrolled_layers_equal_the_layer_scan(monkeypatch):
    """On a CPU, without recomputation, up to 8 layers run unrolled (no layer loop in the compiled
    program): loss and every gradient equal the layer scan's (fp32); with recomputation, deeper,
    or traced for a GPU, the scan stays."""
    from mlm_jax.models import recompute
    from mlm_jax.sharding import trace

    assert recompute.unrolled(2, None) and recompute.unrolled(8, "selective")
    assert not recompute.unrolled(9, None) and not recompute.unrolled(2, "full") and not recompute.unrolled(2, "dots")
    with trace.using(platform="cuda"):
        assert not recompute.unrolled(2, None)

    def loss_and_grads():
        graphdef, params = model_parts(CFG)

        def loss(p):
            logits = nnx.merge(graphdef, p)(TOKENS[:, :-1])
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), TOKENS[:, 1:, None], -1))

        step = jax.jit(jax.value_and_grad(loss))
        return step(params), step.lower(params).compile().as_text()

    layer_loop = '"known_trip_count":{"n":"2"}'  # a loop over CFG's 2 layers
    (loss, grads), text = loss_and_grads()
    assert layer_loop not in text
    monkeypatch.setattr(recompute, "_UNROLLED_LAYERS", {})
    (scan_loss, scan_grads), scan_text = loss_and_grads()
    assert layer_loop in scan_text
    assert float(loss) == pytest.approx(float(scan_loss), abs=1e-6)
    for a, b in zip(jax.tree.leaves(scan_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-6 * float(np.max(np.abs(a))) + 1e-10)


def test_bf16_computes_in_bf16_and_stays_close():
    import dataclasses

    ref_loss, _ = _loss_and_grads(CFG, TOKENS)
    cfg = dataclasses.replace(CFG, bf16=True)
    loss, grads = _loss_and_grads(cfg, TOKENS)
    # bf16 keeps 8 mantissa bits: a loss of ~5.7 agrees to ~1e-2.
    assert float(loss) == pytest.approx(float(ref_loss), abs=3e-2)
    assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))  # fp32 master gradients
    graphdef, params = model_parts(cfg)
    hlo = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t)).lower(params, TOKENS).as_text()
    assert "bf16" in hlo and "dot_general" in hlo


def test_padded_vocab_logits_are_masked():
    logits = build(CFG)(TOKENS)
    assert logits.shape[-1] == 384
    assert np.all(np.asarray(logits[..., 300:]) == PADDED_LOGIT)


def test_reset_attention_mask_isolates_documents():
    model = build(CFG)
    seg = jnp.asarray([[0] * 8 + [1] * 8] * 2, jnp.int32)
    a = TOKENS[:, :16]
    b = a.at[:, :8].set((a[:, :8] + 7) % 300)  # change only the first document
    la, lb = model(a, segment_ids_bs=seg), model(b, segment_ids_bs=seg)
    np.testing.assert_allclose(la[:, 8:], lb[:, 8:], atol=1e-5)  # second document unaffected
    assert not np.allclose(la[:, :8], lb[:, :8])
    lc = model(b)  # without segments the second document does see the change
    assert not np.allclose(la[:, 8:], lc[:, 8:], atol=1e-5)


def test_dropout_is_keyed_and_off_without_a_key():
    import dataclasses

    cfg = dataclasses.replace(CFG, hidden_dropout=0.1, attention_dropout=0.1)
    model = build(cfg)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    assert np.array_equal(model(TOKENS, dropout_key=k1), model(TOKENS, dropout_key=k1))
    assert not np.allclose(model(TOKENS, dropout_key=k1), model(TOKENS, dropout_key=k2))
    assert np.array_equal(model(TOKENS), model(TOKENS))
    assert not np.allclose(model(TOKENS), model(TOKENS, dropout_key=k1))


@pytest.mark.parametrize("chunks", [1, 4])
def test_fused_loss_gives_autodiffs_loss_and_gradients(monkeypatch, chunks):
    """The LM head + loss as one op (gradient computed in the forward, the rows in chunks)
    against autodiff of the plain head and cross-entropy: padded vocab, loss-masked tokens.
    fp32: loss within 1e-6 relative, each gradient within 1e-6 of its largest entry."""
    from mlm_jax.models import gpt

    monkeypatch.setattr(gpt, "_MIN_CHUNK_ROWS", 4)
    monkeypatch.setattr(gpt, "_CHUNK_LOGITS", {"cpu": 2 * 32 * 384 // chunks})
    assert gpt._row_chunks(2, 32, 384) == chunks
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 32, 64)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((384, 64)) * 0.3, jnp.float32)
    labels = jnp.asarray(rng.integers(0, 300, (2, 32)), jnp.int32)
    weights = jnp.asarray(rng.random((2, 32)) > 0.2, jnp.float32)

    def plain(x, w, weights):
        logits = jnp.einsum("bsd,vd->bsv", x, w)
        logits = jnp.where(jnp.arange(384) < 300, logits, PADDED_LOGIT)
        return jnp.sum(gpt.cross_entropy(logits, labels) * weights)

    def fused(x, w, weights):
        return gpt.linear_cross_entropy(x, w, labels, weights, 300)

    want, want_grads = jax.value_and_grad(plain, argnums=(0, 1, 2))(x, w, weights)
    got, got_grads = jax.jit(jax.value_and_grad(fused, argnums=(0, 1, 2)))(x, w, weights)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    assert float(jax.jit(fused)(x, w, weights)) == pytest.approx(float(want), rel=1e-6)  # no grad
    for name, g, r in zip(["x", "w", "weights"], got_grads, want_grads):
        err = float(jnp.max(jnp.abs(g - r)))
        assert err <= 1e-6 * float(jnp.max(jnp.abs(r))), (name, err)
    assert not np.any(np.asarray(got_grads[1][300:]))  # padding rows of the head: no gradient


# n: 384 head rows, 96 per device, or padded to 385 = 5 x 77; chunks: the fused loss's row chunks;
# head: tied (the embedding, strided rows), untied whole (strided) or untied given in blocks
@pytest.mark.parametrize("n,head_kind,chunks", [(4, "tied", 1), (5, "untied", 1), (4, "untied", 4), (5, "tied", 4),
                                                (4, "blocked", 1), (4, "blocked", 4)])
def test_head_split_over_a_manual_axis_gives_the_whole_heads_loss_and_gradients(monkeypatch, n, head_kind, chunks):
    """The pipeline's head (`GPT.head(..., vocab_split=VocabSplit(axis, blocked))`): on each of
    n devices of a manual axis the logits of its 1/n of the vocab (every n-th row of a head held
    whole, or the contiguous block of an untied head passed in split over the axis), the softmax
    combined by collectives over the axis. Loss and the gradients of the input and every head
    parameter (tied embedding or untied head, final norm) equal the whole head's (fp32, 1e-6),
    the padding rows' gradients zero."""
    from jax.sharding import PartitionSpec

    from mlm_jax.models import gpt

    monkeypatch.setattr(gpt, "_MIN_CHUNK_ROWS", 4)
    rows = -(-384 // n)  # per device
    monkeypatch.setattr(gpt, "_CHUNK_LOGITS", {"cpu": 2 * 16 * (384 // n + 1) // chunks})
    assert gpt._row_chunks(2, 16, rows) == chunks
    untied = head_kind != "tied"
    cfg = dataclasses.replace(CFG, untie_embeddings_and_output_weights=untied, normalization="RMSNorm")
    graphdef, params = model_parts(cfg)
    params = jax.tree.map(jnp.asarray, params)
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((2, 16, 64)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 300, (2, 16)), jnp.int32)
    mask = jnp.asarray(rng.random((2, 16)) > 0.2, jnp.float32)

    def loss(params, x, split=None):
        return nnx.merge(graphdef, params).head(x, labels, mask, split)[0]

    want, want_grads = jax.value_and_grad(loss, argnums=(0, 1))(params, x)
    mesh = jax.make_mesh((n,), ("v",), devices=jax.devices()[:n])
    vocab_split = gpt.VocabSplit("v", blocked=head_kind == "blocked")
    specs = jax.tree.map(lambda _: PartitionSpec(), params)
    if vocab_split.blocked:  # the untied head [embed, vocab] enters as each device's block
        specs["lm_head"] = PartitionSpec(None, "v")
    split = jax.jit(jax.shard_map(lambda p, x: jax.value_and_grad(loss, argnums=(0, 1))(p, x, vocab_split),
                                  mesh=mesh, in_specs=(specs, PartitionSpec()),
                                  out_specs=(PartitionSpec(), (specs, PartitionSpec()))))
    placed = jax.device_put(params, jax.tree.map(lambda sp: jax.sharding.NamedSharding(mesh, sp), specs))
    got, got_grads = split(placed, x)
    got_grads = jax.tree.map(np.asarray, got_grads)  # whole arrays (the blocked head's gathered)
    assert float(got) == pytest.approx(float(want), rel=1e-6)
    head = "lm_head" if untied else "embed"
    assert float(jnp.max(jnp.abs(want_grads[0][head]))) > 0
    for path, g in jax.tree_util.tree_leaves_with_path(got_grads):
        r = want_grads
        for k in path:
            r = r[k.key if hasattr(k, "key") else k.idx]
        err = float(jnp.max(jnp.abs(g - r)))
        assert err <= 1e-6 * float(jnp.max(jnp.abs(r))) + 1e-12, (jax.tree_util.keystr(path), err)
    w = got_grads[0][head]
    assert not np.any(np.asarray(w[:, 300:] if untied else w[300:]))  # padding rows: no gradient


# The version-1 layer leaves, all directly under `layers` (before the Attention/MLP split).
V1_LAYER_LEAVES = {"norm1", "wqkv", "bqkv", "wo", "bo", "norm2", "w1", "b1", "w2", "b2"}


def _as_v1(tree):
    """A version-2 params-like dict written back in the version-1 layout, by hand."""
    layers = dict(tree["layers"])
    flat = {**layers.pop("attention"), **layers.pop("mlp"), **layers}
    assert set(flat) == V1_LAYER_LEAVES
    return {**tree, "layers": flat}


def test_upgrade_params_converts_version_1_params_and_optimizer_moments():
    assert PARAM_FORMAT_VERSION == 2
    params = model_parts(CFG)[1]
    old = _as_v1(params)
    new = upgrade_params(old, 1)
    assert jax.tree.structure(new) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params)):
        assert a is b  # moved, not copied
    # AdamW's state holds mu and nu mirroring the params inside optax namedtuples.
    tx = make_optimizer(OptimConfig())
    state_old = tx.init(old)
    state = upgrade_params(state_old, 1)
    assert jax.tree.structure(state) == jax.tree.structure(tx.init(params))
    assert upgrade_params(params, PARAM_FORMAT_VERSION) is params
    # The restore target of a version-1 checkpoint: the current tree in the old layout.
    assert jax.tree.structure(downgrade_params(params, 1)) == jax.tree.structure(old)
    assert jax.tree.structure(downgrade_params(tx.init(params), 1)) == jax.tree.structure(state_old)
    with pytest.raises(ParamFormatError, match="parameter format version 3 cannot be read by this "
                                               "mlm_jax \\(it reads versions 1 to 2\\)"):
        upgrade_params(params, 3)
