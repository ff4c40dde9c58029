"""Multi-token prediction (mlm_jax/models/mtp.py, `GPT._multi_token_prediction`): the loss and every
gradient against the objective written out by hand (Megatron's rolled tokens, labels and loss
mask, each depth's mean loss x scaling / D), what the training command logs, the FLOPs it counts,
and the flags with their refusals. Its layouts against one device: tests/test_mla.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mlm_jax.arguments import parse_args
from mlm_jax.config import ModelConfig
from mlm_jax.metrics import flops_per_token
from mlm_jax.models.gpt import GPT
from mlm_jax.train import main
from tests.tiny_flags import tiny, train_run

V, S, B = 50, 12, 3


def _model(depths: int, scaling: float = 0.3):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V, padded_vocab_size=64,
                      max_position_embeddings=S, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2,
                      mtp_num_layers=depths, mtp_loss_scaling_factor=scaling)
    with nnx.use_eager_sharding(False):
        return GPT(cfg, nnx.Rngs(0))


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (B, S + 1))
    mask = (rng.random((B, S)) > 0.2).astype(np.float32)
    return {"tokens": jnp.asarray(tokens[:, :-1], jnp.int32), "labels": jnp.asarray(tokens[:, 1:], jnp.int32),
            "loss_mask": jnp.asarray(mask), "position_ids": jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))}


def _ce_sum(h, w_vd, labels, mask):
    logp = jax.nn.log_softmax(jnp.einsum("bsd,vd->bsv", h, w_vd)[..., :V].astype(jnp.float32), axis=-1)
    return -jnp.sum(jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0] * mask)


def _by_hand(model: GPT, batch, depths: int, scaling: float):
    """(main loss sum, [each depth's mean loss], the objective whose gradient training follows)."""
    t, pos, lab, mask = batch["tokens"], batch["position_ids"], batch["labels"], batch["loss_mask"]
    x = model.run_layers(model.embed_tokens(t, pos, None), pos, None, None)
    main_sum = _ce_sum(model.final_norm(x), model.head_weight(), lab, mask)
    h, means = model.final_norm(x), []
    for k in range(1, depths + 1):
        roll = lambda a: jnp.concatenate([a[:, k:], jnp.zeros_like(a[:, :k])], axis=1)  # noqa: E731
        layer = nnx.merge(*nnx.split(model.mtp)[:1], jax.tree.map(lambda a: a[k - 1], nnx.split(model.mtp)[1]))
        emb = model.embed_tokens(roll(t), roll(pos), None)  # the tokens k ahead (learned positions rolled too)
        w = layer.eh_proj[...]
        z = jnp.concatenate([layer.enorm(emb), layer.hnorm(h)], axis=-1) @ w.reshape(-1, w.shape[-1])
        h = layer.final_norm(layer.layer(z, pos, None, None)[0])
        mask_k = roll(mask)
        means.append(_ce_sum(h, model.head_weight(), roll(lab), mask_k) / jnp.maximum(jnp.sum(mask_k), 1.0))
    return main_sum, means, main_sum + jnp.sum(mask) * scaling / depths * sum(means)


@pytest.mark.parametrize("depths", [1, 2])
def test_the_loss_and_every_gradient_equal_the_objective_written_out(depths):
    model, batch, scaling = _model(depths), _batch(), 0.3
    graphdef, params = nnx.split(model)

    def ours(p):
        return nnx.merge(graphdef, p).loss(batch, None)

    def theirs(p):
        return _by_hand(nnx.merge(graphdef, p), batch, depths, scaling)[2]

    (loss, aux), grads = jax.value_and_grad(ours, has_aux=True)(params)
    main_sum, means, _ = _by_hand(model, batch, depths, scaling)
    np.testing.assert_allclose(float(loss), float(main_sum), rtol=1e-6)  # the MTP term adds nothing to the loss
    for k, m in enumerate(means):
        np.testing.assert_allclose(float(aux[f"mtp_{k + 1}_loss"]), float(m), rtol=1e-5)
    want = jax.grad(theirs)(params)
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want)):
        scale = float(jnp.max(jnp.abs(w)))
        assert float(jnp.max(jnp.abs(g - w))) <= 2e-5 * scale + 1e-9, jax.tree_util.keystr(path)
    mtp = grads["mtp"]
    assert all(float(jnp.max(jnp.abs(a))) > 0 for a in jax.tree.leaves(mtp))  # every MTP weight learns


def test_the_scaling_factor_weights_the_depths():
    """--mtp-loss-scaling-factor 0: the MTP layers get no gradient and the model's is the plain one."""
    model, batch = _model(1, scaling=0.0), _batch()
    graphdef, params = nnx.split(model)
    grads = jax.grad(lambda p: nnx.merge(graphdef, p).loss(batch, None)[0])(params)
    assert all(float(jnp.max(jnp.abs(a))) == 0 for a in jax.tree.leaves(grads["mtp"]))
    graphdef_on, params_on = nnx.split(_model(1, 0.5))  # the same weights (seed 0), the MTP losses on
    with_mtp = jax.grad(lambda p: nnx.merge(graphdef_on, p).loss(batch, None)[0])(params_on)
    assert float(jnp.max(jnp.abs(with_mtp["embed"][...] - grads["embed"][...]))) > 1e-6


def test_training_logs_each_depths_loss(tmp_path, capsys):
    _, records, _ = train_run(tiny("--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.1",
                                   "--train-iters", "2", "--log-interval", "1"), tmp_path)
    train = [r for r in records if "lm_loss" in r]
    assert len(train) == 2 and all(r["mtp_1_loss"] > 0 and r["mtp_2_loss"] > 0 for r in train), train
    console = capsys.readouterr().out
    assert console.count("mtp_1 loss: ") == 2 and console.count("mtp_2 loss: ") == 2, console


def test_flops_count_the_depths():
    base = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V, padded_vocab_size=64)
    one = ModelConfig(**{**base.__dict__, "mtp_num_layers": 1})
    d, per_layer = 32, base.attention_weights + 2 * 32 * base.ffn_size
    extra = 3 * (2 * (per_layer + 2 * d * d + d * 64) + 2 * S * base.attention_core_width / 2)
    assert flops_per_token(one, S) - flops_per_token(base, S) == pytest.approx(extra)


def test_megatrons_mtp_flags_map_onto_the_config():
    m = parse_args(["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"]).model
    assert (m.mtp_num_layers, m.mtp_loss_scaling_factor) == (1, 0.3)
    assert parse_args([]).model.mtp_loss_scaling_factor == 0.1  # Megatron's default


@pytest.mark.parametrize("argv, message", [
    (["--mtp-num-layers", "0"], "--mtp-num-layers must be a positive number, got 0"),
    (["--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "-1"], "--mtp-loss-scaling-factor must be 0 or more"),
    (["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2", "--bf16", "--fp8-format", "hybrid"],
     "--mtp-num-layers with --fp8-format and --pipeline-model-parallel-size 2: the depths' fp8 amax histories"),
])
def test_bad_mtp_flags_are_refused_naming_the_flag(argv, message, capsys):
    assert main(["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--seq-length", "32", "--max-position-embeddings", "64", "--train-iters", "1", *argv]) == 2
    assert message in capsys.readouterr().err
