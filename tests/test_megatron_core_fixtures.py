"""Checkpoints written by Megatron-Core itself (0.16.1 on the CPU, `tests/make_megatron_fixtures.py`,
run by hand; tests/fixtures/megatron/manifest.json holds Megatron-Core's own logits): mlm_jax reads
both formats without PyTorch and computes the same logits (and, for the DeepSeek-V3 style model
with a multi-token prediction depth, the depth's logits too)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import mlm_jax

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "megatron")
MANIFEST = json.load(open(os.path.join(HERE, "manifest.json")))
CASES = [(kind, folder) for kind, rec in MANIFEST["models"].items() for folder in rec["folders"]]


@pytest.mark.parametrize("kind,folder", CASES, ids=[f for _, f in CASES])
def test_logits_equal_megatron_cores(kind, folder):
    loaded = mlm_jax.load(os.path.join(HERE, folder))
    assert loaded.iteration == MANIFEST["iteration"]
    want = np.asarray(MANIFEST["models"][kind]["logits"], np.float32)
    got = loaded.logits(np.asarray(MANIFEST["ids"], np.int32))[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    _assert_mtp_logits(loaded, kind)


def _assert_mtp_logits(loaded, kind: str) -> None:
    """A model with multi-token prediction depths: each depth's logits are Megatron-Core's (its
    MultiTokenPredictionBlock's, through the shared output layer)."""
    want = MANIFEST["models"][kind].get("mtp_logits")
    got = loaded.mtp_logits(np.asarray(MANIFEST["ids"], np.int32))
    assert len(got) == len(want or [])
    for depth, (g, w) in enumerate(zip(got, want or [])):
        np.testing.assert_allclose(g[0], np.asarray(w, np.float32), rtol=0, atol=1e-5, err_msg=f"MTP depth {depth + 1}")


# --------------------------------------------------------------------------- resuming Megatron's Adam

RESUME = MANIFEST["resume"]["llama"]
RESUME_ROOT = os.path.join(HERE, RESUME["folders"][0])
TRAIN = np.asarray(RESUME["train_ids"], np.int32)  # [global batch, seq + 1]


def _resume_config(parallel, devices: int):
    from mlm_jax.config import Config, OptimConfig, ParallelConfig, TrainConfig
    from mlm_jax.checkpoint.find import megatron_found
    from mlm_jax.validation import finalize

    o = RESUME["optim"]
    found = megatron_found(RESUME_ROOT, None, parallel.get("tensor_model_parallel_size", 1), optimizer=True)
    cfg = Config(model=found.config.model, parallel=ParallelConfig(**parallel),
                 optim=OptimConfig(lr=o["lr"], min_lr=o["min_lr"], weight_decay=o["weight_decay"],
                                   adam_beta1=o["adam_beta1"], adam_beta2=o["adam_beta2"], adam_eps=o["adam_eps"],
                                   clip_grad=o["clip_grad"], lr_warmup_iters=o["lr_warmup_iters"],
                                   lr_decay_iters=o["lr_decay_iters"], lr_decay_style=o["lr_decay_style"]),
                 train=TrainConfig(micro_batch_size=1, global_batch_size=TRAIN.shape[0], seq_length=TRAIN.shape[1] - 1,
                                   train_iters=o["train_iters"]))
    return finalize(cfg, devices), found


LAYOUTS = {"1 device": ({}, 1),
           "tp2 x dp4 ZeRO": ({"tensor_model_parallel_size": 2, "use_distributed_optimizer": True}, 8)}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_megatron_adam_state_resumes_and_steps_as_megatron_core(layout):
    """The fully reshardable distributed-optimizer checkpoint Megatron-Core wrote after 3 Adam steps:
    restored onto one device and onto tp2 x dp4 with ZeRO, Adam's moments are Megatron's (per-key
    sums and the final norm's values; fp32), its count is Megatron's step, the iteration, samples
    and LR schedule continue; the next step's loss and the logits after it are Megatron-Core's."""
    import jax
    import optax

    from mlm_jax.checkpoint.restore import restore_train_state
    from mlm_jax.config import ParallelConfig
    from mlm_jax.optim import lr_for
    from mlm_jax.build import parallelize
    from mlm_jax.sharding import make_mesh
    from tests.parallel_util import place

    parallel, devices = LAYOUTS[layout]
    cfg, found = _resume_config(parallel, devices)
    pz = parallelize(cfg, make_mesh(cfg.parallel, jax.devices()[:devices]))
    state, start = restore_train_state(cfg, pz, found, log=lambda *_: None)
    assert (start.iteration, start.consumed_samples) == (RESUME["iteration"], RESUME["consumed_samples"])
    assert RESUME["adam_step"] == [RESUME["iteration"]]
    assert int(state["step"]) == RESUME["iteration"]
    assert int(state["schedule_samples"]) == RESUME["consumed_samples"]
    np.testing.assert_allclose(float(lr_for(cfg, state["schedule_samples"])), RESUME["next_lr"], rtol=1e-6)

    adam = [s for s in jax.tree.leaves(state["opt_state"], is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(s, optax.ScaleByAdamState)]
    assert len(adam) == 1 and int(adam[0].count) == RESUME["iteration"]
    mu, nu = (jax.tree.map(np.asarray, pz.plain(t)) for t in (adam[0].mu, adam[0].nu))
    stats = RESUME["moment_stats"]
    for tree, name in ((mu, "exp_avg"), (nu, "exp_avg_sq")):
        np.testing.assert_allclose(tree["final_norm"]["scale"], RESUME["final_norm_moments"][name], rtol=0, atol=0)
        for leaf, key in ((tree["embed"], "embedding.word_embeddings.weight"), (tree["lm_head"], "output_layer.weight"),
                          (tree["layers"]["mlp"]["w1"], "decoder.layers.mlp.linear_fc1.weight"),
                          (tree["layers"]["attention"]["wqkv"], "decoder.layers.self_attention.linear_qkv.weight")):
            want = stats[f"optimizer.state.{name}.{key}"]
            np.testing.assert_allclose(np.asarray(leaf, np.float64).sum(), want["sum"], rtol=1e-6, atol=1e-12)
            np.testing.assert_allclose(np.abs(np.asarray(leaf, np.float64)).sum(), want["abs_sum"], rtol=1e-6)
        total = sum(v["abs_sum"] for k, v in stats.items() if k.startswith(f"optimizer.state.{name}."))
        got = sum(np.abs(np.asarray(x, np.float64)).sum() for x in jax.tree.leaves(tree))
        np.testing.assert_allclose(got, total, rtol=1e-6)

    batch = {"tokens": TRAIN[:, :-1], "labels": TRAIN[:, 1:], "loss_mask": np.ones(TRAIN[:, 1:].shape, np.float32),
             "position_ids": np.broadcast_to(np.arange(TRAIN.shape[1] - 1, dtype=np.int32), TRAIN[:, 1:].shape).copy()}
    state, metrics = pz.train_step(state, place(pz, batch), jax.random.key(0))
    np.testing.assert_allclose(float(metrics["lm_loss"]), RESUME["next_loss"], rtol=0, atol=1e-5)
    np.testing.assert_allclose(float(metrics["lr"]), RESUME["next_lr"], rtol=1e-6)
    from mlm_jax.loading import LoadedModel

    params = jax.tree.map(lambda x: jax.device_put(np.asarray(x), jax.devices()[0]), pz.plain(state["params"]))
    after = LoadedModel(cfg.model, params, make_mesh(ParallelConfig(), jax.devices()[:1]), None, RESUME_ROOT, None)
    got = after.logits(np.asarray(MANIFEST["ids"], np.int32))[0]
    want = np.asarray(RESUME["logits_after_next_step"], np.float32)
    print(layout, "max |logits - Megatron-Core's after the next step| =", np.abs(got - want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- import -> export args

# The args that change what a GPT computes, in the names Megatron-Core's own args use.
FUNCTION_ARGS = ("openai_gelu", "bias_gelu_fusion", "swiglu", "normalization", "norm_epsilon", "layernorm_epsilon",
                 "add_bias_linear", "add_qkv_bias", "position_embedding_type", "add_position_embedding", "rotary_base",
                 "rotary_percent", "untie_embeddings_and_output_weights", "apply_layernorm_1p", "num_layers",
                 "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
                 "num_experts", "moe_router_topk", "moe_router_score_function", "moe_router_pre_softmax",
                 "moe_layer_freq", "moe_shared_expert_intermediate_size", "moe_router_num_groups",
                 "moe_router_group_topk", "moe_router_topk_scaling_factor", "moe_router_enable_expert_bias",
                 "multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim",
                 "v_head_dim", "qk_layernorm", "rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim",
                 "mtp_num_layers", "mtp_loss_scaling_factor")


@pytest.mark.parametrize("kind", sorted({k for k, _ in CASES}))
def test_import_then_export_keeps_every_model_arg(kind, tmp_path):
    """import-megatron then export-megatron (torch_dist) of Megatron-Core's own checkpoint: every
    arg that changes the function is the source's (the GPT-2 style's GELU once came back as
    openai_gelu True, bias_gelu_fusion False), and the export's logits are the source's."""
    from mlm_jax.checkpoint.megatron import read_checkpoint
    from mlm_jax.tools.checkpoint import main

    folder = next(f for k, f in CASES if k == kind and "dist" in f)
    source = os.path.join(HERE, folder)
    assert main(["import-megatron", "--load", source, "--save", str(tmp_path / "imported")]) == 0
    assert main(["export-megatron", "--load", str(tmp_path / "imported"), "--save", str(tmp_path / "export")]) == 0
    src, out = read_checkpoint(source).args, read_checkpoint(str(tmp_path / "export")).args
    differ = {name: (getattr(src, name), getattr(out, name, "missing")) for name in FUNCTION_ARGS
              if hasattr(src, name) and getattr(src, name) != getattr(out, name, "missing")}
    assert not differ, differ
    ids = np.asarray(MANIFEST["ids"], np.int32)
    exported = mlm_jax.load(str(tmp_path / "export"))
    np.testing.assert_allclose(exported.logits(ids)[0], np.asarray(MANIFEST["models"][kind]["logits"], np.float32),
                               rtol=0, atol=1e-5)
    _assert_mtp_logits(exported, kind)
