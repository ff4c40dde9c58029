"""Hugging Face import/export against independent numpy reference forward passes.

The tests write tiny GPT-2 and Llama checkpoints in Hugging Face's format themselves (config.json
+ safetensors, numpy only) and compute the reference logits with a numpy transcription of
transformers' GPT2LMHeadModel / LlamaForCausalLM forward (fp64), not with mlm_jax's model.
"""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mlm_jax
from mlm_jax.arguments import parse_args
from mlm_jax.config import ParallelConfig
from mlm_jax.sharding.mesh import make_mesh
from mlm_jax.tools import checkpoint as hfc

V, D, L, T = 100, 32, 2, 12
TOL = dict(rtol=2e-5, atol=2e-5)  # fp32 model vs fp64 reference; logits are O(1)


# --------------------------------------------------------------------------- reference models


def _layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _rms_norm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def _causal_attention(q, k, v):  # [b, h, t, k] each
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(q.shape[-1])
    t = q.shape[2]
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    return _softmax(scores) @ v


def gpt2_reference(w, cfg, ids):
    """transformers' GPT2LMHeadModel.forward, in numpy fp64 (Conv1D: x @ W + b)."""
    w = {k.removeprefix("transformer."): v.astype(np.float64) for k, v in w.items()}
    b, t = ids.shape
    h, d = cfg["n_head"], cfg["n_embd"]
    eps = cfg["layer_norm_epsilon"]
    x = w["wte.weight"][ids] + w["wpe.weight"][np.arange(t)]
    for i in range(cfg["n_layer"]):
        p = f"h.{i}."
        a = _layer_norm(x, w[p + "ln_1.weight"], w[p + "ln_1.bias"], eps)
        qkv = a @ w[p + "attn.c_attn.weight"] + w[p + "attn.c_attn.bias"]
        q, k, v = (z.reshape(b, t, h, d // h).transpose(0, 2, 1, 3) for z in np.split(qkv, 3, axis=-1))
        o = _causal_attention(q, k, v).transpose(0, 2, 1, 3).reshape(b, t, d)
        x = x + o @ w[p + "attn.c_proj.weight"] + w[p + "attn.c_proj.bias"]
        a = _layer_norm(x, w[p + "ln_2.weight"], w[p + "ln_2.bias"], eps)
        u = a @ w[p + "mlp.c_fc.weight"] + w[p + "mlp.c_fc.bias"]
        u = 0.5 * u * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (u + 0.044715 * u ** 3)))  # gelu_new
        x = x + u @ w[p + "mlp.c_proj.weight"] + w[p + "mlp.c_proj.bias"]
    x = _layer_norm(x, w["ln_f.weight"], w["ln_f.bias"], eps)
    return x @ w["wte.weight"].T


def _rope(x, theta):  # [b, h, t, k], rotate_half as transformers' apply_rotary_pos_emb
    k = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, k, 2) / k)
    freqs = np.arange(x.shape[2])[:, None] * inv_freq[None]
    emb = np.concatenate([freqs, freqs], -1)
    rot = np.concatenate([-x[..., k // 2:], x[..., : k // 2]], -1)
    return x * np.cos(emb) + rot * np.sin(emb)


def llama_reference(w, cfg, ids):
    """transformers' LlamaForCausalLM.forward (GQA via repeat_kv), in numpy fp64 ([out, in] weights)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    b, t = ids.shape
    h, g, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    hd = cfg.get("head_dim") or d // h
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    x = w["model.embed_tokens.weight"][ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = _rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q = (a @ w[p + "self_attn.q_proj.weight"].T).reshape(b, t, h, hd).transpose(0, 2, 1, 3)
        k = (a @ w[p + "self_attn.k_proj.weight"].T).reshape(b, t, g, hd).transpose(0, 2, 1, 3)
        v = (a @ w[p + "self_attn.v_proj.weight"].T).reshape(b, t, g, hd).transpose(0, 2, 1, 3)
        q, k = _rope(q, theta), _rope(k, theta)
        k, v = np.repeat(k, h // g, axis=1), np.repeat(v, h // g, axis=1)  # repeat_kv
        o = _causal_attention(q, k, v).transpose(0, 2, 1, 3).reshape(b, t, h * hd)
        x = x + o @ w[p + "self_attn.o_proj.weight"].T
        a = _rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        if "_mlp" in cfg:  # Mixtral's experts (mixtral_reference)
            x = x + cfg["_mlp"](i, a)
            continue
        gate, up = a @ w[p + "mlp.gate_proj.weight"].T, a @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1.0 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    x = _rms_norm(x, w["model.norm.weight"], eps)
    head = w["lm_head.weight"] if "lm_head.weight" in w else w["model.embed_tokens.weight"]
    return x @ head.T


# --------------------------------------------------------------------------- tiny HF folders


def _rand(rng, *shape, scale=0.2):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _tokenizer_json(folder):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, V - 1)}, "<|endoftext|>": V - 1}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)


def make_gpt2(folder, seed=0):
    rng = np.random.default_rng(seed)
    cfg = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": V, "n_positions": 16,
           "n_embd": D, "n_layer": L, "n_head": 4, "n_inner": None, "activation_function": "gelu_new",
           "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
           "initializer_range": 0.02, "tie_word_embeddings": True, "bos_token_id": V - 1, "eos_token_id": V - 1}
    w = {"transformer.wte.weight": _rand(rng, V, D, scale=0.5), "transformer.wpe.weight": _rand(rng, 16, D)}
    for i in range(L):
        p = f"transformer.h.{i}."
        w.update({p + "ln_1.weight": 1 + _rand(rng, D), p + "ln_1.bias": _rand(rng, D),
                  p + "attn.c_attn.weight": _rand(rng, D, 3 * D), p + "attn.c_attn.bias": _rand(rng, 3 * D),
                  p + "attn.c_proj.weight": _rand(rng, D, D), p + "attn.c_proj.bias": _rand(rng, D),
                  p + "ln_2.weight": 1 + _rand(rng, D), p + "ln_2.bias": _rand(rng, D),
                  p + "mlp.c_fc.weight": _rand(rng, D, 4 * D), p + "mlp.c_fc.bias": _rand(rng, 4 * D),
                  p + "mlp.c_proj.weight": _rand(rng, 4 * D, D), p + "mlp.c_proj.bias": _rand(rng, D)})
    w.update({"transformer.ln_f.weight": 1 + _rand(rng, D), "transformer.ln_f.bias": _rand(rng, D)})
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(w, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    _tokenizer_json(folder)
    return cfg, w


def make_llama(folder, seed=1, dtype=np.float32):
    """GQA (8 heads, 2 kv groups, head_dim 8 != D/heads), untied head, two safetensors shards."""
    rng = np.random.default_rng(seed)
    h, g, hd, f = 8, 2, 8, 48
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": D,
           "intermediate_size": f, "num_hidden_layers": L, "num_attention_heads": h, "num_key_value_heads": g,
           "head_dim": hd, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "rope_theta": 500.0,
           "hidden_act": "silu", "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
           "rope_scaling": None, "initializer_range": 0.02, "bos_token_id": V - 1, "eos_token_id": V - 1}
    w = {"model.embed_tokens.weight": _rand(rng, V, D, scale=0.5), "lm_head.weight": _rand(rng, V, D),
         "model.norm.weight": 1 + _rand(rng, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + _rand(rng, D),
                  p + "self_attn.q_proj.weight": _rand(rng, h * hd, D),
                  p + "self_attn.k_proj.weight": _rand(rng, g * hd, D),
                  p + "self_attn.v_proj.weight": _rand(rng, g * hd, D),
                  p + "self_attn.o_proj.weight": _rand(rng, D, h * hd),
                  p + "post_attention_layernorm.weight": 1 + _rand(rng, D),
                  p + "mlp.gate_proj.weight": _rand(rng, f, D), p + "mlp.up_proj.weight": _rand(rng, f, D),
                  p + "mlp.down_proj.weight": _rand(rng, D, f)})
    w = {k: v.astype(dtype) for k, v in w.items()}
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    names = sorted(w)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: w[k] for k in keys}, os.path.join(folder, file), metadata={"format": "pt"})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}, fh)
    return cfg, w


def _read_folder(folder):
    return hfc.read_safetensors(folder)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(7).integers(0, V, size=(2, T))


@pytest.fixture(scope="module")
def tp2_mesh():
    return make_mesh(ParallelConfig(tensor_model_parallel_size=2))


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt2")
    cfg, w = make_gpt2(str(tmp / "hf"))
    saved = hfc.import_hf(str(tmp / "hf"), str(tmp / "ckpt"), log=lambda *_: None)
    return tmp, cfg, w, saved


# --------------------------------------------------------------------------- tests


def test_gpt2_logits_equal_reference_from_hf_folder_and_imported_checkpoint(gpt2, tokens, tp2_mesh):
    tmp, cfg, w, saved = gpt2
    ref = gpt2_reference(w, cfg, tokens)
    direct = mlm_jax.load(str(tmp / "hf"))
    assert direct.logits(tokens).shape == (2, T, V)  # the true vocab, padding dropped
    np.testing.assert_allclose(direct.logits(tokens), ref, **TOL)
    imported = mlm_jax.load(str(tmp / "ckpt"))  # the save folder: its latest (only) checkpoint
    assert imported.config.vocab_size == V and imported.config.openai_gelu and imported.iteration == 0
    np.testing.assert_allclose(imported.logits(tokens), ref, **TOL)
    # Tensor parallel 2: vocab padded 128 -> 256 on restore, heads split; same function.
    np.testing.assert_allclose(mlm_jax.load(saved, mesh=tp2_mesh).logits(tokens), ref, **TOL)
    # The tokenizer came along.
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(os.path.join(saved, "tokenizer")))
    assert imported.tokenizer.tokenize("w5 w7 w9") == [5, 7, 9] and imported.tokenizer.eod == V - 1


def test_gpt2_export_reproduces_tensors_config_and_tokenizer(gpt2):
    tmp, cfg, w, saved = gpt2
    out = str(tmp / "export")
    hfc.export_hf(str(tmp / "ckpt"), out, log=lambda *_: None)
    got = load_file(os.path.join(out, "model.safetensors"))
    assert sorted(got) == sorted(w)
    for name in w:
        assert got[name].dtype == w[name].dtype and np.array_equal(got[name], w[name]), name
    exported_cfg = json.load(open(os.path.join(out, "config.json")))
    assert exported_cfg.pop("torch_dtype") == "float32" and exported_cfg == cfg
    assert open(os.path.join(out, "tokenizer.json")).read() == open(tmp / "hf" / "tokenizer.json").read()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_gqa_untied_sharded_logits_and_round_trip(tmp_path, tokens, tp2_mesh, dtype):
    import ml_dtypes

    np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
    cfg, w = make_llama(str(tmp_path / "hf"), dtype=np_dtype)
    saved = hfc.import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), log=lambda *_: None)
    if dtype == "float32":
        ref = llama_reference(w, cfg, tokens)
        m = mlm_jax.load(saved)
        c = m.config
        assert (c.num_query_groups, c.kv_channels, c.untie_embeddings_and_output_weights, c.swiglu,
                c.normalization, c.position_embedding_type, c.rotary_base) == (2, 8, True, True, "RMSNorm",
                                                                                "rope", 500.0)
        np.testing.assert_allclose(m.logits(tokens), ref, **TOL)
        np.testing.assert_allclose(mlm_jax.load(str(tmp_path / "hf"), mesh=tp2_mesh).logits(tokens), ref, **TOL)
    out = str(tmp_path / "export")
    hfc.export_hf(saved, out, max_shard_bytes=20_000, log=lambda *_: None)
    assert os.path.isfile(os.path.join(out, "model.safetensors.index.json"))  # sharded on export too
    got = _read_folder(out)
    assert sorted(got) == sorted(w)
    for name in w:  # bf16 -> fp32 -> bf16 is exact
        assert got[name].dtype == w[name].dtype and np.array_equal(got[name], w[name]), name
    exported_cfg = json.load(open(os.path.join(out, "config.json")))
    assert exported_cfg.pop("torch_dtype") == dtype and exported_cfg == cfg


def test_unsupported_models_and_broken_folders_say_why(tmp_path, gpt2):
    mixtral = tmp_path / "mamba"  # (Mixtral is supported now: an architecture that is not)
    mixtral.mkdir()
    (mixtral / "config.json").write_text(json.dumps({"architectures": ["MambaForCausalLM"],
                                                     "model_type": "mamba"}))
    with pytest.raises(hfc.HFError, match=r"'MambaForCausalLM' is not supported"):
        hfc.import_hf(str(mixtral), str(tmp_path / "out"))
    assert hfc.main(["import-hf", "--hf-dir", str(tmp_path / "nothing"), "--save", str(tmp_path / "o")]) == 2
    with pytest.raises(hfc.HFError, match="no config.json"):
        hfc.import_hf(str(mixtral / ".."), str(tmp_path / "out"))
    # A missing tensor is named; so is one the config does not use.
    tmp, cfg, w, _ = gpt2
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps(cfg))
    save_file({k: v for k, v in w.items() if "h.1.mlp.c_fc.bias" not in k}, str(broken / "model.safetensors"))
    with pytest.raises(hfc.HFError, match=r"no tensor 'transformer.h.1.mlp.c_fc.bias'"):
        hfc.import_hf(str(broken), str(tmp_path / "out2"))
    save_file({**w, "transformer.h.0.attn.q_norm.weight": np.ones(D, np.float32)}, str(broken / "model.safetensors"))
    with pytest.raises(hfc.HFError, match=r"does not use: \['transformer.h.0.attn.q_norm.weight'\]"):
        hfc.import_hf(str(broken), str(tmp_path / "out3"))
    # A model with no Hugging Face equivalent is refused on export, naming the fields.
    from mlm_jax.config import ModelConfig

    with pytest.raises(hfc.HFError, match="no Hugging Face equivalent"):
        hfc.export_kind(ModelConfig(position_embedding_type="rope"))


# --------------------------------------------------------------------------- Mixtral

E_MIX, K_MIX = 4, 2


def mixtral_reference(w, cfg, ids):
    """transformers' MixtralForCausalLM.forward in numpy fp64: Llama's attention, and per token
    softmax over the experts' router logits, the top-k renormalised, sum of SwiGLU experts."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    dense = {k: v for k, v in w.items() if "block_sparse_moe" not in k}
    b, t = ids.shape
    K = cfg["num_experts_per_tok"]

    def moe(i, a):  # [b, t, d]
        p = f"model.layers.{i}.block_sparse_moe."
        out = np.zeros_like(a)
        for bi in range(b):
            for ti in range(t):
                x = a[bi, ti]
                probs = _softmax(w[p + "gate.weight"] @ x)
                top = np.argsort(-probs)[:K]
                for e in top:
                    gate, up = w[p + f"experts.{e}.w1.weight"] @ x, w[p + f"experts.{e}.w3.weight"] @ x
                    y = w[p + f"experts.{e}.w2.weight"] @ (gate / (1.0 + np.exp(-gate)) * up)
                    out[bi, ti] += probs[e] / probs[top].sum() * y
        return out

    return llama_reference(dense, {**cfg, "_mlp": moe}, ids)


def make_mixtral(folder, seed=2):
    rng = np.random.default_rng(seed)
    h, g, f = 4, 2, 24
    cfg = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": V, "hidden_size": D,
           "intermediate_size": f, "num_hidden_layers": L, "num_attention_heads": h, "num_key_value_heads": g,
           "head_dim": D // h, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
           "hidden_act": "silu", "tie_word_embeddings": False, "rope_scaling": None, "initializer_range": 0.02,
           "num_local_experts": E_MIX, "num_experts_per_tok": K_MIX, "router_aux_loss_coef": 0.02,
           "sliding_window": None, "bos_token_id": 1, "eos_token_id": 2}
    w = {"model.embed_tokens.weight": _rand(rng, V, D, scale=0.5), "lm_head.weight": _rand(rng, V, D),
         "model.norm.weight": 1 + _rand(rng, D)}
    for i in range(L):
        p = f"model.layers.{i}."
        w.update({p + "input_layernorm.weight": 1 + _rand(rng, D),
                  p + "self_attn.q_proj.weight": _rand(rng, D, D),
                  p + "self_attn.k_proj.weight": _rand(rng, g * D // h, D),
                  p + "self_attn.v_proj.weight": _rand(rng, g * D // h, D),
                  p + "self_attn.o_proj.weight": _rand(rng, D, D),
                  p + "post_attention_layernorm.weight": 1 + _rand(rng, D),
                  p + "block_sparse_moe.gate.weight": _rand(rng, E_MIX, D, scale=1.0)})
        for e in range(E_MIX):
            q = p + f"block_sparse_moe.experts.{e}."
            w.update({q + "w1.weight": _rand(rng, f, D), q + "w3.weight": _rand(rng, f, D),
                      q + "w2.weight": _rand(rng, D, f)})
    os.makedirs(folder)
    with open(os.path.join(folder, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    save_file(w, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return cfg, w


def test_mixtral_logits_equal_reference_and_round_trip(tmp_path, tokens):
    cfg, w = make_mixtral(str(tmp_path / "hf"))
    ref = mixtral_reference(w, cfg, tokens)
    saved = hfc.import_hf(str(tmp_path / "hf"), str(tmp_path / "ckpt"), log=lambda *_: None)
    m = mlm_jax.load(saved)
    c = m.config
    assert (c.num_experts, c.moe_router_topk, c.moe_ffn_size, c.moe_router_pre_softmax) == (E_MIX, K_MIX, 24, False)
    np.testing.assert_allclose(m.logits(tokens), ref, **TOL)
    np.testing.assert_allclose(mlm_jax.load(str(tmp_path / "hf")).logits(tokens), ref, **TOL)
    out = str(tmp_path / "export")
    assert hfc.main(["export-hf", "--load", saved, "--hf-dir", out]) == 0
    got = _read_folder(out)
    assert sorted(got) == sorted(w)
    for name in w:
        assert np.array_equal(got[name], w[name]), name
    exported_cfg = json.load(open(os.path.join(out, "config.json")))
    assert exported_cfg.pop("torch_dtype") == "float32" and exported_cfg == cfg


def test_moe_models_without_a_mixtral_equivalent_are_refused_on_export():
    from mlm_jax.config import ModelConfig

    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False)
    assert hfc.export_kind(ModelConfig(**llama, num_experts=4)) == "mixtral"
    for extra, why in [(dict(moe_layer_freq=2), "every layer MoE"),
                       (dict(moe_router_pre_softmax=True), "softmax router"),
                       (dict(moe_expert_capacity_factor=1.0), "dropless"),
                       (dict(moe_shared_expert_intermediate_size=8), "no shared expert")]:
        with pytest.raises(hfc.HFError, match=why):
            hfc.export_kind(ModelConfig(**llama, num_experts=4, **extra))


def test_training_continues_from_an_imported_checkpoint(gpt2, tmp_path):
    """--load OUT --finetune --use-checkpoint-args: sizes and tokenizer from the checkpoint."""
    from mlm_jax.arguments import parse_args
    from mlm_jax.train import train

    tmp, cfg, w, saved = gpt2
    logs = []
    summary = train(parse_args([
        "--load", str(tmp / "ckpt"), "--finetune", "--use-checkpoint-args", "--mock-data",
        "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "2",
        "--eval-iters", "1", "--no-progress-bar", "--sample-tokens", "0", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--peak-flops-per-device", "1e12", "--run-dir", str(tmp_path / "run"),
        "--no-final-checkpoint"]), log=logs.append)
    text = "\n".join(map(str, logs))
    assert "weights only (--finetune), starting at iteration 0" in text, text
    assert "tokenizer HuggingFaceTokenizer from the checkpoint" in text, text
    n = sum(v.size for k, v in w.items()) + (128 - V) * D  # + the vocab padding rows
    assert summary["parameters"] == n and summary["resumed_from"] == saved
    assert summary["final_train_loss"] is not None and np.isfinite(summary["final_train_loss"])
    assert summary["checkpoints"] == [] and not os.path.exists(tmp_path / "run" / "checkpoints")  # --no-final-checkpoint


def test_export_hf_writes_the_tokenizer_as_transformers_reads_it(tmp_path):
    """A run whose GPT-2 BPE files carry Megatron's names (gpt2-vocab.json, gpt2-merges.txt):
    export-hf writes vocab.json, merges.txt and a tokenizer_config.json naming GPT2Tokenizer
    (transformers' AutoTokenizer loads them: tests/check_hf_tokenizer_export.py, by hand);
    import-hf of the export, and `mlm_jax.load` of it, tokenize as the original; a folder holding
    Megatron's names imports its tokenizer too."""
    from tokenizers.pre_tokenizers import ByteLevel

    from mlm_jax.data.tokenizers import build_tokenizer
    from tests.tiny_flags import tiny, train_run

    tok = tmp_path / "tok"
    tok.mkdir()
    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    vocab.update({"Ġw": 256, "or": 257, "<|endoftext|>": 258})
    (tok / "gpt2-vocab.json").write_text(json.dumps(vocab))
    (tok / "gpt2-merges.txt").write_text("#version: 0.2\nĠ w\no r\n")
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tok / "gpt2-vocab.json"),
             "--merge-file", str(tok / "gpt2-merges.txt")]
    train_run(tiny(*flags, "--train-iters", "1", "--micro-batch-size", "1", "--global-batch-size", "8",
                   "--save", str(tmp_path / "ck")), tmp_path / "run")
    assert hfc.main(["export-hf", "--load", str(tmp_path / "ck"), "--hf-dir", str(tmp_path / "hf")]) == 0
    names = set(os.listdir(tmp_path / "hf"))
    assert {"vocab.json", "merges.txt", "tokenizer_config.json"} <= names and not names & {"gpt2-vocab.json",
                                                                                            "gpt2-merges.txt"}, names
    config = json.load(open(tmp_path / "hf" / "tokenizer_config.json"))
    assert config["tokenizer_class"] == "GPT2Tokenizer" and config["eos_token"] == "<|endoftext|>", config
    original = build_tokenizer(parse_args(flags).data)
    text = "hello world, word for word"
    assert hfc.main(["import-hf", "--hf-dir", str(tmp_path / "hf"), "--save", str(tmp_path / "back")]) == 0
    for path in (tmp_path / "back", tmp_path / "hf"):
        got = mlm_jax.load(str(path)).tokenizer
        assert got is not None and list(got.tokenize(text)) == list(original.tokenize(text)), path
    megatron_names = tmp_path / "megatron_names"
    shutil.copytree(tmp_path / "hf", megatron_names)
    os.rename(megatron_names / "vocab.json", megatron_names / "gpt2-vocab.json")
    os.rename(megatron_names / "merges.txt", megatron_names / "gpt2-merges.txt")
    got = mlm_jax.load(str(megatron_names)).tokenizer
    assert got is not None and list(got.tokenize(text)) == list(original.tokenize(text))
