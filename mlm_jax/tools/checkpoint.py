"""Hugging Face <-> mlm_jax checkpoints: GPT-2 (GPT2LMHeadModel), Llama (LlamaForCausalLM) and
Mixtral (MixtralForCausalLM); Megatron-LM checkpoints (torch_dist or legacy torch) -> mlm_jax.

    python -m mlm_jax.tools.checkpoint import-hf --hf-dir DIR --save OUT
    python -m mlm_jax.tools.checkpoint export-hf --load CKPT --hf-dir OUT [--dtype bfloat16]
    python -m mlm_jax.tools.checkpoint import-megatron --load MEGATRON_DIR --save OUT
    python -m mlm_jax.tools.checkpoint export-megatron --load CKPT --save DIR [--ckpt-format torch_dist|torch]
        [--tensor-model-parallel-size T] [--pipeline-model-parallel-size P]

Local files only: `config.json` plus `model.safetensors` or sharded `model-0000x-of-0000y.safetensors`
with `model.safetensors.index.json`. Tokenizer files found next to them are carried along both
ways. Import writes a weights-only mlm_jax checkpoint at iteration 0 (`--load OUT --finetune`
continues training from it; add `--use-checkpoint-args` to take the model sizes from it).

Weight layouts (mlm_jax/tools/hf_mapping.py; all conversions are exact reshapes/transposes in numpy):
  GPT-2  Conv1D weights are [in, out]. `c_attn` is [d, 3d] = q | k | v blocks of h heads each;
         ours is [d, groups=h, r + 2 = 3, k] (per head: its q, k, v), Megatron's interleave.
         tanh GELU (gelu_new) = --openai-gelu; learned positions; LayerNorm; tied head.
  Llama  Linear weights are [out, in]. q [h*k, d], k/v [g*k, d]; query head j uses kv group
         j // (h/g), which is our [d, g, r, k] order. gate/up/down -> w1 [d, 2, f], w2 [f, d].
         RMSNorm, rotate-half RoPE (the same as ours), no biases; untied head [V, d] -> [d, V].
  Mixtral  Llama's attention; block_sparse_moe.gate [E, d] -> router [d, E]; experts.j.w1 (gate)
         and w3 (up) [f, d] -> w1[j] [d, 2, f], w2 (down) [d, f] -> w2[j] [f, d]. Its router
         (softmax over all experts, top-k, renormalised) is ours without pre-softmax, dropless.
The vocab is padded with zero rows to Megatron's padded size on import; export writes the true
vocab rows only.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from mlm_jax.arguments import ArgumentParser
from mlm_jax.cli import cli
from mlm_jax.errors import UsageError
from mlm_jax.config import Config, ModelConfig, padded_vocab_size
from mlm_jax.paths import inside, not_there, writable_dir
from mlm_jax.xla_flags import use_cpu_devices
from mlm_jax.tools.hf_mapping import HFError, _flatten, _gpt2_prefix, hf_to_params, params_to_hf

# Megatron-LM's names of the same files (its scripts' `--vocab-file gpt2-vocab.json`, and an mlm_jax
# checkpoint's tokenizer/ folder, which keeps the names it was given): read as the Hugging Face ones.
MEGATRON_NAMES = {"gpt2-vocab.json": "vocab.json", "gpt2-merges.txt": "merges.txt", "spm.model": "tokenizer.model"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "generation_config.json", *MEGATRON_NAMES)
_SENTENCEPIECE = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


# --------------------------------------------------------------------------- files


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    why = not_there(hf_dir)
    if why:
        raise HFError(f"--hf-dir {hf_dir}: {why}; a local Hugging Face model folder is needed")
    if not os.path.isfile(path):
        raise HFError(f"--hf-dir {hf_dir}: no config.json (a local Hugging Face model folder is needed; "
                      "nothing is downloaded)")
    return _read_json(path)


def _read_json(path: str) -> dict:
    """A JSON object from `path`; errors name the file and the line."""
    try:
        with open(path) as f:
            out = json.load(f)
    except json.JSONDecodeError as e:
        raise HFError(f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from e
    except UnicodeDecodeError as e:
        raise HFError(f"{path}: not a text (JSON) file") from e
    if not isinstance(out, dict):
        raise HFError(f"{path}: a JSON object {{...}} is expected, not a {type(out).__name__}")
    return out


def read_safetensors(hf_dir: str) -> dict[str, np.ndarray]:
    """Every tensor of the folder: model.safetensors, or the shards its index json names."""
    from safetensors import safe_open

    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise HFError(f"{index}: no \"weight_map\" object naming the shard of each tensor")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = sorted(f for f in os.listdir(hf_dir) if f.endswith(".safetensors"))
    if not files:
        raise HFError(f"--hf-dir {hf_dir}: no *.safetensors weights (PyTorch .bin files are not read)")
    out = {}
    for name in files:
        path = inside(hf_dir, name)
        if path is None and os.path.isfile(index):
            keys = sorted(k for k, v in weight_map.items() if v == name)
            raise HFError(f"{index}: \"weight_map\" sends {keys[0]!r} to {name!r}, outside --hf-dir {hf_dir}; "
                          "only files inside it are read")
        if path is None:
            raise HFError(f"{os.path.join(hf_dir, name)}: a link to {os.path.realpath(os.path.join(hf_dir, name))}, "
                          f"outside --hf-dir {hf_dir}; only files inside it are read")
        if not os.path.isfile(path):
            raise HFError(f"{index}: names {name}, which is missing")
        try:
            with safe_open(path, framework="np") as f:
                for key in f.keys():
                    out[key] = f.get_tensor(key)
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            reason = " ".join(str(e).split())[:200] or type(e).__name__
            raise HFError(f"{path}: not a readable safetensors file ({reason}); truncated or corrupted?") from e
    return out


def write_safetensors(tensors: dict[str, np.ndarray], out_dir: str, max_shard_bytes: int = 5 << 30) -> list[str]:
    """model.safetensors, or shards + model.safetensors.index.json past `max_shard_bytes`."""
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    shards, current, size = [], {}, 0
    for name in tensors:
        nbytes = tensors[name].nbytes
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = np.ascontiguousarray(tensors[name])
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, os.path.join(out_dir, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.nbytes for t in tensors.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return names


def tokenizer_files(folder: str) -> dict[str, bytes]:
    out = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


def hf_tokenizer_record(files: dict[str, bytes], vocab_size: int) -> dict | None:
    """The mlm_jax tokenizer record for a folder's tokenizer files (None: no tokenizer there), read
    under the Hugging Face names or Megatron-LM's (`MEGATRON_NAMES`)."""
    def named(hf: str) -> str | None:
        return hf if hf in files else next((m for m, h in MEGATRON_NAMES.items() if h == hf and m in files), None)

    if "tokenizer.json" in files:
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": "tokenizer.json",
                "vocab_size": vocab_size}
    vocab, merges, model = named("vocab.json"), named("merges.txt"), named("tokenizer.model")
    if vocab and merges:
        return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": vocab, "merge_file": merges,
                "vocab_size": vocab_size}
    if model:
        return {"tokenizer_type": "GPTSentencePieceTokenizer", "tokenizer_model": model, "vocab_size": vocab_size}
    return None


def hf_tokenizer_export(folder: str, record: dict | None, max_length: int) -> tuple[dict[str, bytes], str | None]:
    """The files an export writes for the checkpoint's tokenizer (its tokenizer/ `folder`, described
    by `record`) under the names transformers reads (vocab.json + merges.txt, tokenizer.model,
    tokenizer.json) with a tokenizer_config.json naming the class, and a note where transformers
    has no such tokenizer (TikTokenizer, Llama-3's tiktoken file: carried under its own name)."""
    files = {}
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name != "commit_success.txt":
                with open(os.path.join(folder, name), "rb") as f:
                    files[name] = f.read()
    if not files or not record:
        return files, None
    kind = record.get("tokenizer_type")
    renames = ({record.get("vocab_file"): "vocab.json", record.get("merge_file"): "merges.txt"}
               if kind == "GPT2BPETokenizer" else
               {record.get("tokenizer_model"): "tokenizer.model"} if kind in _SENTENCEPIECE else
               {record.get("tokenizer_model"): "tokenizer.json"} if kind == "HuggingFaceTokenizer" else {})
    renames = {os.path.basename(src): dst for src, dst in renames.items() if src}
    out = {renames.get(name, name): data for name, data in files.items()}
    if "tokenizer_config.json" not in out:
        config = {"model_max_length": max_length}
        if kind == "GPT2BPETokenizer":
            eod = next((tok for tok, i in json.loads(out["vocab.json"]).items() if i == record.get("eod")),
                       "<|endoftext|>")
            config.update(tokenizer_class="GPT2Tokenizer", bos_token=eod, eos_token=eod, unk_token=eod)
        elif kind in _SENTENCEPIECE:
            config.update(tokenizer_class="LlamaTokenizer", add_bos_token=kind == "Llama2Tokenizer",
                          add_eos_token=False)
        elif kind == "HuggingFaceTokenizer":
            config.update(tokenizer_class="PreTrainedTokenizerFast")
        else:
            return out, f"{kind} has no transformers tokenizer: its files are carried under their own names"
        out["tokenizer_config.json"] = json.dumps(config, indent=2).encode()
    return out, None


# --------------------------------------------------------------------------- configs


def hf_kind(hf: dict) -> str:
    arch = (hf.get("architectures") or [None])[0]
    model_type = hf.get("model_type")
    if model_type == "mixtral" or arch == "MixtralForCausalLM":
        return "mixtral"
    if model_type == "gpt2" or arch in ("GPT2LMHeadModel", "GPT2Model"):
        return "gpt2"
    if model_type == "llama" or arch == "LlamaForCausalLM":
        return "llama"
    if model_type == "deepseek_v3" or arch == "DeepseekV3ForCausalLM":
        return "deepseek_v3"
    raise HFError(f"Hugging Face architecture {arch or model_type!r} is not supported; "
                  "supported: GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM, DeepseekV3ForCausalLM")


_GELU = {"gelu_new": True, "gelu_pytorch_tanh": True, "gelu_fast": True, "gelu": False}


def model_config_from_hf(hf: dict) -> ModelConfig:
    """The ModelConfig computing the same function as the Hugging Face model."""
    kind = hf_kind(hf)
    if kind == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in _GELU:
            raise HFError(f"GPT-2 activation_function {act!r} is not supported (gelu_new, gelu)")
        for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
            if hf.get(key):
                raise HFError(f"GPT-2 config {key}=true is not supported")
        if hf.get("scale_attn_weights", True) is False:
            raise HFError("GPT-2 config scale_attn_weights=false is not supported")
        d = hf["n_embd"]
        return ModelConfig(
            num_layers=hf["n_layer"], hidden_size=d, ffn_hidden_size=hf.get("n_inner") or 4 * d,
            num_attention_heads=hf["n_head"], vocab_size=hf["vocab_size"],
            max_position_embeddings=hf["n_positions"], position_embedding_type="learned_absolute",
            normalization="LayerNorm", norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            openai_gelu=_GELU[act], swiglu=False,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
            add_bias_linear=True, hidden_dropout=hf.get("resid_pdrop", 0.1),
            attention_dropout=hf.get("attn_pdrop", 0.1), init_method_std=hf.get("initializer_range", 0.02))
    if kind == "deepseek_v3":
        return _deepseek_v3_config(hf)
    if hf.get("hidden_act", "silu") != "silu":
        raise HFError(f"Llama hidden_act {hf.get('hidden_act')!r} is not supported (silu)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            raise HFError(f"Llama config {key}=true is not supported")
    d, h = hf["hidden_size"], hf["num_attention_heads"]
    g = hf.get("num_key_value_heads") or h
    head_dim = hf.get("head_dim") or d // h
    moe = _mixtral_fields(hf) if kind == "mixtral" else {}
    return ModelConfig(**moe,
        num_layers=hf["num_hidden_layers"], hidden_size=d, ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=h, num_query_groups=None if g == h else g,
        kv_channels=None if head_dim * h == d else head_dim, vocab_size=hf["vocab_size"],
        max_position_embeddings=hf.get("max_position_embeddings", 2048),
        position_embedding_type="rope", **rope_fields_from_hf(hf),
        normalization="RMSNorm", norm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=hf.get("attention_dropout", 0.0),
        init_method_std=hf.get("initializer_range", 0.02))


def _deepseek_v3_config(hf: dict) -> ModelConfig:
    """DeepseekV3ForCausalLM: multi-latent attention (its latents always normed), YaRN or plain
    rope in MLA's interleaved order, the first `first_k_dense_replace` layers dense, then MoE
    layers of sigmoid-scored, group-limited routing with the expert bias, normalised top-k weights
    times routed_scaling_factor and `n_shared_experts` experts' worth of shared expert."""
    if hf.get("hidden_act", "silu") != "silu":
        raise HFError(f"DeepSeek-V3 hidden_act {hf.get('hidden_act')!r} is not supported (silu)")
    if hf.get("attention_bias"):
        raise HFError("DeepSeek-V3 config attention_bias=true is not supported")
    if hf.get("rope_interleave", True) is not True:
        raise HFError("DeepSeek-V3 config rope_interleave=false is not supported (MLA's rope order is interleaved)")
    L, h = hf["num_hidden_layers"], hf["num_attention_heads"]
    K, E = hf["num_experts_per_tok"], hf["n_routed_experts"]
    groups, group_topk = hf.get("n_group") or 1, hf.get("topk_group") or 1
    if groups > 1 and K // group_topk != 2:
        raise HFError(f"DeepSeek-V3 scores a group by its 2 best experts; this router (num_experts_per_tok {K}, "
                      f"topk_group {group_topk}) would score it by {K // group_topk} (Megatron's top-k / group top-k)")
    if K > 1 and hf.get("norm_topk_prob", True) is not True:
        raise HFError("DeepSeek-V3 config norm_topk_prob=false is not supported (the top-k weights are normalised)")
    if K == 1 and hf.get("norm_topk_prob", True):
        raise HFError("DeepSeek-V3 with num_experts_per_tok 1 and norm_topk_prob: not supported (one choice's "
                      "weight is its score here, as in Megatron-LM)")
    dense = min(int(hf.get("first_k_dense_replace", 3) or 0), L)
    shared = hf.get("n_shared_experts") or 0
    moe = {} if dense == L else dict(
        num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_layer_freq=1 if dense == 0 else tuple([0] * dense + [1] * (L - dense)),
        moe_shared_expert_intermediate_size=hf["moe_intermediate_size"] * shared or None,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        moe_router_num_groups=groups if groups > 1 else None, moe_router_group_topk=group_topk if groups > 1 else None,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0)
    return ModelConfig(
        **moe, **_deepseek_rope(hf),
        num_layers=L, hidden_size=hf["hidden_size"], ffn_hidden_size=hf["intermediate_size"],
        num_attention_heads=h, vocab_size=hf["vocab_size"], max_position_embeddings=hf.get("max_position_embeddings", 4096),
        multi_latent_attention=True, q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
        qk_head_dim=hf["qk_nope_head_dim"], qk_pos_emb_head_dim=hf["qk_rope_head_dim"], v_head_dim=hf["v_head_dim"],
        qk_layernorm=True, position_embedding_type="rope", normalization="RMSNorm",
        norm_epsilon=hf.get("rms_norm_eps", 1e-6), swiglu=True,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        add_bias_linear=False, hidden_dropout=0.0, attention_dropout=hf.get("attention_dropout", 0.0),
        init_method_std=hf.get("initializer_range", 0.02))


_YARN_KEYS = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
              "truncate")


def _deepseek_rope(hf: dict) -> dict:
    """The MLA rope fields of a DeepSeek-V3 config: default (plain) or yarn, as transformers
    computes them (`_compute_yarn_parameters`, `yarn_apply_mscale`)."""
    rope = dict(hf.get("rope_scaling") or {})
    rope.update(hf.get("rope_parameters") or {})
    if "rope_theta" in hf:
        rope.setdefault("rope_theta", hf["rope_theta"])
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    base = float(rope.get("rope_theta", 10000.0))
    if rope_type == "default":
        return dict(rotary_base=base, rope_type="rope")
    if rope_type != "yarn":
        raise HFError(f"DeepSeek-V3 rope_type {rope_type!r} is not supported (default, yarn)")
    unknown = sorted(set(rope) - {"rope_type", "type", "rope_theta", *_YARN_KEYS})
    if unknown:
        raise HFError(f"rope yarn key {unknown[0]}={rope[unknown[0]]!r} is not supported")
    if rope.get("truncate", True) is not True:
        raise HFError("rope yarn truncate=false is not supported (the correction range is rounded, as Megatron's)")
    original = int(rope["original_max_position_embeddings"])
    factor = rope.get("factor") or hf.get("max_position_embeddings", original) / original
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):  # transformers' magnitude is then mscale(factor, 1) alone
        mscale, mscale_all_dim = 1.0, float(mscale_all_dim or 0.0)
    return dict(rotary_base=base, rope_type="yarn", rotary_scaling_factor=float(factor), mscale=float(mscale),
                mscale_all_dim=float(mscale_all_dim), yarn_original_max_position_embeddings=original,
                yarn_beta_fast=float(rope.get("beta_fast") or 32), yarn_beta_slow=float(rope.get("beta_slow") or 1))


_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def rope_fields_from_hf(hf: dict) -> dict:
    """The ModelConfig rope fields of a Llama or Mixtral config.json, in either form: top-level
    `rope_theta` and `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5).
    Both forms present and disagreeing is an error; so is any rope type but default and
    llama3, and any rope key not understood (each changes the math)."""
    params = hf.get("rope_parameters")
    legacy = dict(hf.get("rope_scaling") or {})
    if "rope_theta" in hf:
        legacy["rope_theta"] = hf["rope_theta"]
    if params is not None:
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise HFError(f"rope_parameters {params!r} is not supported (one rope for every layer is)")
        for key in set(params) & set(legacy):
            if _rope_value(params, key) != _rope_value(legacy, key):
                name = "rope_theta" if key == "rope_theta" else f"rope_scaling.{key}"
                raise HFError(f"rope_parameters.{key}={params[key]!r} and {name}={legacy[key]!r} disagree")
        rope = {**legacy, **params}
    else:
        rope = legacy
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if "rope_type" in rope and "type" in rope and rope["type"] != rope["rope_type"]:
        raise HFError(f"rope type {rope['type']!r} and rope_type {rope['rope_type']!r} disagree")
    if rope_type not in ("default", "llama3"):
        raise HFError(f"rope_type {rope_type!r} is not supported (default, llama3)")
    known = {"rope_type", "type", "rope_theta"} | (set(_LLAMA3_KEYS) if rope_type == "llama3" else set())
    unknown = sorted(set(rope) - known)
    if unknown:
        raise HFError(f"rope {rope_type} key {unknown[0]}={rope[unknown[0]]!r} is not supported")
    out = {"rotary_base": float(rope.get("rope_theta", 10000.0))}
    if rope_type == "llama3":
        missing = [k for k in _LLAMA3_KEYS if k not in rope]
        if missing:
            raise HFError(f"rope_type 'llama3' without {missing[0]!r}")
        out.update(use_rope_scaling=True, rope_scaling_factor=float(rope["factor"]),
                   rope_scaling_low_freq_factor=float(rope["low_freq_factor"]),
                   rope_scaling_high_freq_factor=float(rope["high_freq_factor"]),
                   rope_scaling_original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
    return out


def _rope_value(rope: dict, key: str):
    value = rope[key]
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def hf_rope_parameters(m: ModelConfig) -> dict:
    """`rope_parameters` as transformers 5 writes it, for `m`'s rope."""
    if not m.use_rope_scaling:
        return {"rope_theta": m.rotary_base, "rope_type": "default"}
    return {"rope_theta": m.rotary_base, "rope_type": "llama3", "factor": m.rope_scaling_factor,
            "low_freq_factor": m.rope_scaling_low_freq_factor,
            "high_freq_factor": m.rope_scaling_high_freq_factor,
            "original_max_position_embeddings": m.rope_scaling_original_max_position_embeddings}


def _mixtral_fields(hf: dict) -> dict:
    """The MoE fields of a Mixtral config.json (every layer MoE, dropless, softmax router)."""
    window = hf.get("sliding_window")
    if window is not None and window < hf.get("max_position_embeddings", 0):
        raise HFError(f"Mixtral sliding_window {window} is not supported (full causal attention only)")
    return dict(num_experts=hf["num_local_experts"], moe_router_topk=hf["num_experts_per_tok"],
                moe_ffn_hidden_size=hf["intermediate_size"], moe_layer_freq=1,
                moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))


def export_kind(m: ModelConfig) -> str:
    """gpt2 or llama, whichever computes the same function as `m`; else an error naming why."""
    if m.multi_latent_attention:
        return _deepseek_v3_export_kind(m)
    if m.rotary_percent != 1.0:  # HF's GPT-2 and Llama rotate (or not) every channel of a head
        raise HFError(f"--rotary-percent {m.rotary_percent}: GPT2LMHeadModel and LlamaForCausalLM have no "
                      "partial rotary embedding; this model cannot be exported")
    gpt2 = {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "swiglu": False,
            "add_bias_linear": True}
    llama = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True,
             "add_bias_linear": False}
    for kind, want in (("gpt2", gpt2), ("llama", llama)):
        if all(getattr(m, k) == v for k, v in want.items()):
            if m.num_experts:
                return _mixtral_export_kind(m, kind)
            if kind == "gpt2" and (m.query_groups != m.num_attention_heads
                                   or m.head_dim * m.num_attention_heads != m.hidden_size):
                raise HFError("GPT-2 has no grouped-query attention or --kv-channels; this model cannot be "
                              "exported as GPT2LMHeadModel")
            return kind
    raise HFError(
        "this model has no Hugging Face equivalent: GPT-2 needs learned positions, LayerNorm, GELU and "
        "biases; Llama needs rope, RMSNorm, SwiGLU and no biases (got "
        + ", ".join(f"{k}={getattr(m, k)!r}" for k in gpt2) + ")")


def _mixtral_export_kind(m: ModelConfig, kind: str) -> str:
    """mixtral when the MoE model is one MixtralForCausalLM computes; else an error naming why."""
    checks = [
        (kind != "llama", "Llama's attention and norms (rope, RMSNorm, SwiGLU, no biases)"),
        (any(not m.is_moe_layer(i) for i in range(m.num_layers)), "every layer MoE (--moe-layer-freq 1)"),
        (m.moe_router_score_function != "softmax" or m.moe_router_pre_softmax, "the softmax router without pre-softmax"),
        (bool(m.moe_router_num_groups or m.moe_router_topk_scaling_factor or m.moe_router_enable_expert_bias),
         "plain top-k routing (no groups, scaling factor or expert bias)"),
        (m.moe_expert_capacity_factor is not None, "dropless experts (no --moe-expert-capacity-factor)"),
        (bool(m.moe_shared_expert_intermediate_size), "no shared expert"),
    ]
    _refuse_unless(checks, "this MoE model", "MixtralForCausalLM")
    return "mixtral"


def _refuse_unless(checks: list[tuple[bool, str]], model: str, hf_class: str) -> None:
    """An HFError naming what `hf_class` needs that `model` lacks: each (lacking, what it needs)."""
    problems = [why for bad, why in checks if bad]
    if problems:
        raise HFError(f"{model} has no Hugging Face equivalent: {hf_class} needs " + "; ".join(problems))


def _deepseek_v3_export_kind(m: ModelConfig) -> str:
    """deepseek_v3 when DeepseekV3ForCausalLM computes the MLA model `m`; else an error naming why."""
    moe = [m.is_moe_layer(i) for i in range(m.num_layers)]
    dense = moe.index(True) if any(moe) else m.num_layers
    K, g = m.moe_router_topk, m.moe_router_group_topk
    checks = [
        ((m.position_embedding_type, m.normalization, m.swiglu, m.add_bias_linear) != ("rope", "RMSNorm", True, False),
         "rope, RMSNorm, SwiGLU and no biases"),
        (not m.qk_layernorm, "the latents' norms (--qk-layernorm)"),
        (m.mscale_all_dim == 0 and m.mscale != 1.0 and m.rope_type != "rope",
         "--mscale 1 when --mscale-all-dim is 0 (transformers then ignores mscale)"),
        (any(moe[dense:]) and not all(moe[dense:]), "dense layers first, then MoE layers only (first_k_dense_replace)"),
        (any(moe) and (m.moe_router_score_function != "sigmoid"), "the sigmoid router"),
        (any(moe) and K == 1, "top-k > 1 (transformers normalises one choice's weight to 1)"),
        (any(moe) and bool(m.moe_router_num_groups) and K // (g or 1) != 2,
         "groups scored by their 2 best experts (top-k / group top-k = 2)"),
        (any(moe) and m.moe_expert_capacity_factor is not None, "dropless experts (no --moe-expert-capacity-factor)"),
        (any(moe) and (m.moe_shared_expert_intermediate_size or 0) % m.moe_ffn_size != 0,
         "a shared expert of a whole number of experts' size"),
    ]
    _refuse_unless(checks, "this multi-latent attention model", "DeepseekV3ForCausalLM")
    return "deepseek_v3"


def _deepseek_v3_hf_config(m: ModelConfig) -> dict:
    """DeepseekV3ForCausalLM's config.json keys for `m` (`_deepseek_v3_export_kind` passed)."""
    moe = [m.is_moe_layer(i) for i in range(m.num_layers)]
    experts = any(moe)
    f = m.moe_ffn_size if experts else m.ffn_size
    if m.rope_type == "rope":
        rope = {"rope_type": "default", "rope_theta": m.rotary_base}
    else:
        rope = {"rope_type": "yarn", "rope_theta": m.rotary_base, "factor": m.rotary_scaling_factor,
                "original_max_position_embeddings": m.yarn_original_max_position_embeddings,
                "beta_fast": m.yarn_beta_fast, "beta_slow": m.yarn_beta_slow, "mscale": m.mscale,
                "mscale_all_dim": m.mscale_all_dim}
    return dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=m.vocab_size,
        hidden_size=m.hidden_size, intermediate_size=m.ffn_size, moe_intermediate_size=f,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.num_attention_heads, n_routed_experts=m.num_experts if experts else 1,
        num_experts_per_tok=m.moe_router_topk if experts else 1,
        n_shared_experts=(m.moe_shared_expert_intermediate_size or 0) // f if experts else 0,
        routed_scaling_factor=m.moe_router_topk_scaling_factor or 1.0,
        n_group=m.moe_router_num_groups or 1, topk_group=m.moe_router_group_topk or 1,
        first_k_dense_replace=moe.index(True) if experts else m.num_layers, norm_topk_prob=True,
        kv_lora_rank=m.kv_lora_rank, q_lora_rank=m.q_lora_rank, qk_nope_head_dim=m.qk_head_dim,
        qk_rope_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim, head_dim=m.qk_pos_emb_head_dim,
        rope_interleave=True, rope_parameters=rope, max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.norm_epsilon, hidden_act="silu", attention_bias=False, num_nextn_predict_layers=0,
        tie_word_embeddings=not m.untie_embeddings_and_output_weights)


def hf_config_from_model(m: ModelConfig, kind: str, base: dict | None = None, dtype: str = "float32") -> dict:
    """config.json for `m`; `base` (the imported model's original config) keeps its other keys."""
    out = dict(base or {})
    if kind == "deepseek_v3":
        for key in ("rope_theta", "rope_scaling", "qk_head_dim"):
            out.pop(key, None)
        out.update(_deepseek_v3_hf_config(m))
        out.setdefault("initializer_range", m.init_method_std)
    elif kind == "gpt2":
        out.update(architectures=["GPT2LMHeadModel"], model_type="gpt2", vocab_size=m.vocab_size,
                   n_positions=m.max_position_embeddings, n_embd=m.hidden_size, n_layer=m.num_layers,
                   n_head=m.num_attention_heads,
                   n_inner=None if m.ffn_size == 4 * m.hidden_size else m.ffn_size,
                   activation_function="gelu_new" if m.openai_gelu else "gelu",
                   layer_norm_epsilon=m.norm_epsilon,
                   tie_word_embeddings=not m.untie_embeddings_and_output_weights)
        out.setdefault("resid_pdrop", m.hidden_dropout)
        out.setdefault("embd_pdrop", m.hidden_dropout)
        out.setdefault("attn_pdrop", m.attention_dropout)
        out.setdefault("initializer_range", m.init_method_std)
    else:
        mixtral = kind == "mixtral"
        out.update(architectures=["MixtralForCausalLM" if mixtral else "LlamaForCausalLM"],
                   model_type=kind, vocab_size=m.vocab_size, hidden_size=m.hidden_size,
                   intermediate_size=m.moe_ffn_size if mixtral else m.ffn_size, num_hidden_layers=m.num_layers,
                   num_attention_heads=m.num_attention_heads, num_key_value_heads=m.query_groups,
                   head_dim=m.head_dim, max_position_embeddings=m.max_position_embeddings,
                   rms_norm_eps=m.norm_epsilon, hidden_act="silu",
                   tie_word_embeddings=not m.untie_embeddings_and_output_weights,
                   attention_bias=False, mlp_bias=False)
        if mixtral:
            out.update(num_local_experts=m.num_experts, num_experts_per_tok=m.moe_router_topk,
                       router_aux_loss_coef=m.moe_aux_loss_coeff, sliding_window=None)
            for key in ("attention_bias", "mlp_bias"):
                out.pop(key)
        rope = hf_rope_parameters(m)
        if "rope_parameters" in out or "rope_theta" not in out:
            out["rope_parameters"] = rope  # transformers 5's form
            out.pop("rope_theta", None)
            out.pop("rope_scaling", None)
        else:  # an imported transformers-4 config keeps its form, which transformers 5 reads too
            out["rope_theta"] = rope.pop("rope_theta")
            out["rope_scaling"] = rope if rope["rope_type"] != "default" else None
        out.setdefault("initializer_range", m.init_method_std)
    out["torch_dtype"] = dtype
    return out


# The sizes each kind's config.json must give as positive integers (None allowed where optional).
_HF_SIZES = {
    "gpt2": (("n_layer", False), ("n_embd", False), ("n_head", False), ("vocab_size", False), ("n_positions", False),
             ("n_inner", True)),
    "llama": (("num_hidden_layers", False), ("hidden_size", False), ("num_attention_heads", False),
              ("num_key_value_heads", True), ("intermediate_size", False), ("vocab_size", False),
              ("max_position_embeddings", True), ("head_dim", True)),
    "deepseek_v3": (("num_hidden_layers", False), ("hidden_size", False), ("num_attention_heads", False),
                    ("intermediate_size", False), ("moe_intermediate_size", False), ("vocab_size", False),
                    ("max_position_embeddings", True), ("kv_lora_rank", False), ("q_lora_rank", True),
                    ("qk_nope_head_dim", False), ("qk_rope_head_dim", False), ("v_head_dim", False),
                    ("n_routed_experts", False), ("num_experts_per_tok", False)),
}


def check_hf_sizes(hf: dict, kind: str) -> None:
    """The config's sizes are positive integers that divide as the model needs; an HFError
    naming the key and the value otherwise (a 0 head count was a ZeroDivisionError)."""
    for key, optional in _HF_SIZES[kind if kind in _HF_SIZES else "llama"]:
        value = hf.get(key)
        if value is None and optional:
            continue
        if value is None:
            raise KeyError(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise HFError(f"{key} {value!r}: a positive integer is expected")
    heads, hidden = (hf["n_head"], hf["n_embd"]) if kind == "gpt2" else (hf["num_attention_heads"], hf["hidden_size"])
    head_key, hidden_key = ("n_head", "n_embd") if kind == "gpt2" else ("num_attention_heads", "hidden_size")
    if kind != "deepseek_v3" and not hf.get("head_dim") and hidden % heads:
        raise HFError(f"{hidden_key} {hidden} is not divisible by {head_key} {heads}")
    groups = hf.get("num_key_value_heads")
    if kind == "deepseek_v3":
        return  # MLA: every head its own keys and values (num_key_value_heads is the head count)
    if kind != "gpt2" and groups and heads % groups:
        raise HFError(f"num_attention_heads {heads} is not divisible by num_key_value_heads {groups}")


def config_from_hf_file(hf: dict, path: str) -> tuple[ModelConfig, str]:
    """(ModelConfig, kind) of the Hugging Face config read from `path`; errors name the file."""
    try:
        kind = hf_kind(hf)
        check_hf_sizes(hf, kind)
        return model_config_from_hf(hf), kind
    except HFError as e:
        raise HFError(f"{path}: {e}") from e
    except KeyError as e:
        raise HFError(f"{path}: no {e.args[0]!r}, which a {hf.get('model_type') or 'this'} model needs") from e
    except (TypeError, ValueError) as e:
        raise HFError(f"{path}: a value has the wrong type ({e})") from e


def check_weights(tensors: dict[str, np.ndarray], hf_dir: str) -> None:
    """Weights are floating point and finite: an integer tensor (a quantized export) or a NaN
    or infinity (a corrupted file, a diverged run) would load and then answer every prompt with
    token 0 and every evaluation with a NaN loss. Refused naming the tensor."""
    for key in sorted(tensors):
        x = tensors[key]
        if not np.issubdtype(x.dtype, np.floating) and str(x.dtype) not in ("bfloat16",):
            raise HFError(f"--hf-dir {hf_dir}: tensor {key!r} has dtype {x.dtype}; floating-point weights are "
                          "expected (quantized checkpoints are not read: export the float model)")
        bad = int(np.size(x) - np.count_nonzero(np.isfinite(x if x.dtype.kind == "f" else x.astype(np.float32))))
        if bad:
            raise HFError(f"--hf-dir {hf_dir}: tensor {key!r} holds {bad} NaN or infinite value(s) of {np.size(x)}; "
                          "a model with them answers nothing useful (re-export it from a finite checkpoint)")


def load_hf(hf_dir: str, divisible_by: int = 128, tensor_parallel: int = 1):
    """(ModelConfig with padded vocab, numpy params, original config, tensor naming) of a folder."""
    hf = read_hf_config(hf_dir)
    m, kind = config_from_hf_file(hf, os.path.join(hf_dir, "config.json"))
    padded = padded_vocab_size(m.vocab_size, divisible_by, tensor_parallel)
    m = dataclasses.replace(m, make_vocab_size_divisible_by=divisible_by, padded_vocab_size=padded)
    tensors = read_safetensors(hf_dir)
    check_weights(tensors, hf_dir)
    params = hf_to_params(tensors, m, kind, padded)
    dtypes = sorted({str(v.dtype) for v in tensors.values()})
    naming = {"kind": kind, "prefix": _gpt2_prefix(tensors) if kind == "gpt2" else "",
              "tied_head_stored": (not m.untie_embeddings_and_output_weights) and "lm_head.weight" in tensors,
              "dtype": dtypes[0] if len(dtypes) == 1 else "float32"}
    return m, params, hf, naming


# --------------------------------------------------------------------------- commands


def import_hf(hf_dir: str, save: str, divisible_by: int = 128, log=print) -> str:
    """Write the Hugging Face model of `hf_dir` as an mlm_jax checkpoint (iteration 0) under `save`."""
    from mlm_jax.checkpoint import write_params_checkpoint

    writable_dir(save, "--save")
    m, params, hf, naming = load_hf(hf_dir, divisible_by)
    files = tokenizer_files(hf_dir)
    record = hf_tokenizer_record(files, m.vocab_size)
    data = Config().data
    if record is not None:
        data = dataclasses.replace(data, tokenizer_type=record["tokenizer_type"])
    cfg = Config(model=m, data=data)
    path = write_params_checkpoint(save, 0, params, cfg, record, files,
                                   extra={"hf": {"config": hf, **naming, "source": os.path.abspath(hf_dir)}})
    n = sum(x.size for x in _flatten(params).values())
    log(f"> imported {naming['kind']} ({n / 1e6:.2f} M parameters, vocab {m.vocab_size} padded to "
        f"{m.vocab}) from {hf_dir} to {path}" + (f"; tokenizer files: {', '.join(files)}" if files else ""))
    return path


def import_megatron(load: str, save: str, step: int | None = None, log=print) -> str:
    """Write the Megatron-LM checkpoint `load` (a save root or an iter_XXXXXXX folder; read by
    mlm_jax/checkpoint/megatron/, no PyTorch) as an mlm_jax checkpoint under `save`, at the
    Megatron iteration with its consumed samples: `--load OUT --no-load-optim` continues the run
    there (fresh optimizer state and LR schedule, as Megatron's --no-load-optim), `--load OUT
    --finetune` starts from its weights. Megatron's optimizer state is not carried."""
    from mlm_jax.checkpoint import write_params_checkpoint
    from mlm_jax.checkpoint.format import tokenizer_record
    from mlm_jax.checkpoint.megatron import read_checkpoint

    writable_dir(save, "--save")
    ck = read_checkpoint(load, step=step, flag="--load")
    record, files = tokenizer_record(ck.tokenizer)
    data = Config().data
    if record is not None:
        data = dataclasses.replace(data, tokenizer_type=record["tokenizer_type"])
    cfg = Config(model=ck.config, data=data)
    iteration = ck.iteration or 0
    extra = {"consumed_samples": ck.consumed_samples, "opt_step": iteration,
             "megatron": {"source": os.path.abspath(ck.path), "format": ck.format, "iteration": ck.iteration,
                          "schedule_samples": ck.schedule_samples}}
    path = write_params_checkpoint(save, iteration, ck.params, cfg, record, files, extra=extra)
    n = sum(x.size for x in _flatten(ck.params).values())
    log(f"> imported Megatron-LM {ck.format} checkpoint {ck.path} (iteration {iteration}, "
        f"{ck.consumed_samples} consumed samples, {n / 1e6:.2f} M parameters, vocab {ck.config.vocab_size} "
        f"padded to {ck.config.vocab}) to {path}" + (f"; tokenizer files: {', '.join(files)}" if files else ""))
    return path


def export_megatron(load: str, save: str, ckpt_format: str = "torch_dist", tensor_parallel: int = 1,
                    pipeline_parallel: int = 1, step: int | None = None, log=print) -> str:
    """Write the mlm_jax checkpoint `load` as a Megatron-LM checkpoint (fp32 weights and args; no
    optimizer or RNG state) under `save`: Megatron-Core's `torch_dist` (global tensors, any
    parallel layout loads it: megatron/dcp_write.py), or the legacy `torch` format
    split for tensor parallel size T and pipeline size P (megatron/torch_write.py). No PyTorch."""
    from mlm_jax.checkpoint import TOKENIZER, find_checkpoint, restore_host_params
    from mlm_jax.checkpoint.megatron import MegatronCheckpointError
    from mlm_jax.checkpoint.megatron.dcp_write import write_torch_dist
    from mlm_jax.checkpoint.megatron.torch_write import write_legacy

    if ckpt_format not in ("torch", "torch_dist"):
        raise MegatronCheckpointError(f"--ckpt-format {ckpt_format}: choose torch_dist or torch")
    if ckpt_format == "torch_dist" and (tensor_parallel, pipeline_parallel) != (1, 1):
        raise MegatronCheckpointError(
            "--ckpt-format torch_dist (the default, as in Megatron-LM) holds global tensors that any parallel "
            "layout loads: leave out --tensor-model-parallel-size / --pipeline-model-parallel-size, or add "
            "--ckpt-format torch (the legacy format they split)")
    save_abs = os.path.abspath(save)
    if os.path.exists(save_abs) and (not os.path.isdir(save_abs) or os.listdir(save_abs)):
        raise MegatronCheckpointError(f"--save {save}: exists and is not empty")
    writable_dir(save, "--save")
    found = find_checkpoint(load, step, flag="--load", log=log)
    if found is None:
        raise MegatronCheckpointError(f"--load {load}: no complete checkpoint in this folder")
    m = found.config.model
    tok = found.meta.get("tokenizer")
    files = {}
    folder = os.path.join(found.path, TOKENIZER)
    if os.path.isdir(folder):
        for name in sorted(os.listdir(folder)):
            if name != "commit_success.txt":
                with open(os.path.join(folder, name), "rb") as f:
                    files[name] = f.read()
    # check the layout before reading the weights
    from mlm_jax.checkpoint.megatron.layout_write import check_layout

    check_layout(m, tensor_parallel, pipeline_parallel)
    params = restore_host_params(found)
    consumed = int(found.meta.get("consumed_samples", 0) or 0)
    if ckpt_format == "torch_dist":
        path = write_torch_dist(save, params, m, found.iteration, consumed, tok, files)
        log(f"> exported iteration {found.iteration} of {found.path} as a Megatron-Core torch_dist checkpoint "
            f"to {path}")
        return path
    path = write_legacy(save, params, m, found.iteration, tensor_parallel, pipeline_parallel, consumed, tok, files)
    log(f"> exported iteration {found.iteration} of {found.path} as a Megatron-LM torch checkpoint "
        f"(tensor parallel {tensor_parallel}, pipeline parallel {pipeline_parallel}) to {path}")
    return path


_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": "bfloat16"}


def export_hf(load: str, hf_dir: str, dtype: str | None = None, step: int | None = None,
              max_shard_bytes: int = 5 << 30, log=print) -> str:
    """Write the mlm_jax checkpoint `load` as a Hugging Face folder `hf_dir`."""
    from mlm_jax.checkpoint import TOKENIZER, find_checkpoint, restore_host_params

    if os.path.isdir(hf_dir) and os.listdir(hf_dir):
        raise HFError(f"--hf-dir {hf_dir}: exists and is not empty")
    writable_dir(hf_dir, "--hf-dir")  # before the weights are read
    found = find_checkpoint(load, step, flag="--load", log=log)
    if found is None:
        raise HFError(f"--load {load}: no complete checkpoint in this folder")
    m = found.config.model
    kind = export_kind(m)
    imported = found.meta.get("hf") or {}
    dtype = dtype or imported.get("dtype") or "float32"
    if dtype not in _DTYPES:
        raise HFError(f"--dtype {dtype!r}: choose one of {', '.join(_DTYPES)}")
    np_dtype = _DTYPES[dtype]
    if np_dtype == "bfloat16":
        import ml_dtypes

        np_dtype = ml_dtypes.bfloat16
    params = restore_host_params(found)
    tensors = params_to_hf(params, m, kind, np_dtype, prefix=imported.get("prefix", "transformer."),
                           write_tied_head=imported.get("tied_head_stored", False))
    written = write_safetensors(tensors, hf_dir, max_shard_bytes)
    config = hf_config_from_model(m, kind, imported.get("config") if imported.get("kind") == kind else None,
                                  dtype)
    tok = found.meta.get("tokenizer") or {}
    if "eod" in tok and not imported:
        config.setdefault("bos_token_id", tok["eod"])
        config.setdefault("eos_token_id", tok["eod"])
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    carried, note = hf_tokenizer_export(os.path.join(found.path, TOKENIZER), found.meta.get("tokenizer"),
                                        m.max_position_embeddings)
    for name, data in carried.items():
        with open(os.path.join(hf_dir, name), "wb") as f:
            f.write(data)
    log(f"> exported iteration {found.iteration} of {found.path} as {config['architectures'][0]} ({dtype}) "
        f"to {hf_dir}: {', '.join(written)}" + (f"; tokenizer files: {', '.join(carried)}" if carried else "")
        + (f" ({note})" if note else ""))
    return hf_dir


@cli
def main(argv=None) -> int:
    """The command: exit 0, 2 (a bad flag, file or checkpoint) or 1, one `error:` line last."""
    parser = ArgumentParser(prog="python -m mlm_jax.tools.checkpoint",
                                     description="Convert checkpoints between Hugging Face, Megatron-LM and mlm_jax.")
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import-hf", help="Hugging Face folder -> mlm_jax checkpoint (iteration 0)")
    imp.add_argument("--hf-dir", required=True, help="local folder: config.json + *.safetensors")
    imp.add_argument("--save", required=True, help="mlm_jax save folder to create")
    imp.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    exp = sub.add_parser("export-hf", help="mlm_jax checkpoint -> Hugging Face folder")
    exp.add_argument("--load", required=True, help="an mlm_jax save folder (latest) or checkpoint folder")
    exp.add_argument("--hf-dir", required=True, help="output folder (created; must be empty)")
    exp.add_argument("--ckpt-step", type=int, default=None, help="iteration to export (default latest)")
    exp.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                     help="tensor dtype (default: the imported model's, else float32)")
    exp.add_argument("--max-shard-size-gb", type=float, default=5.0)
    meg = sub.add_parser("import-megatron", help="Megatron-LM checkpoint (torch_dist or torch) -> mlm_jax checkpoint")
    meg.add_argument("--load", required=True, help="a Megatron-LM save root (latest_checkpointed_iteration.txt) "
                     "or one iter_XXXXXXX folder")
    meg.add_argument("--save", required=True, help="mlm_jax save folder to create")
    meg.add_argument("--ckpt-step", type=int, default=None, help="iteration to import (default: the tracker's)")
    mex = sub.add_parser("export-megatron", help="mlm_jax checkpoint -> Megatron-LM checkpoint (torch_dist, or legacy torch)")
    mex.add_argument("--load", required=True, help="an mlm_jax save folder (latest) or checkpoint folder")
    mex.add_argument("--save", required=True, help="Megatron save root to create (must not exist or be empty)")
    mex.add_argument("--ckpt-step", type=int, default=None, help="iteration to export (default latest)")
    mex.add_argument("--ckpt-format", default="torch_dist", choices=("torch_dist", "torch"),
                     help="torch_dist (default, as Megatron-LM's): Megatron-Core's global tensors, loadable at any "
                          "parallel layout; torch: legacy mp_rank_* files, split by the sizes below")
    mex.add_argument("--tensor-model-parallel-size", type=int, default=1)
    mex.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    args = parser.parse_args(argv)
    use_cpu_devices()
    if getattr(args, "make_vocab_size_divisible_by", 1) < 1:
        raise UsageError(f"--make-vocab-size-divisible-by must be >= 1, got {args.make_vocab_size_divisible_by}")
    shard_gb = getattr(args, "max_shard_size_gb", 1.0)
    if not (math.isfinite(shard_gb) and shard_gb > 0):
        raise UsageError(f"--max-shard-size-gb must be a finite number > 0, got {shard_gb}")
    if args.command == "export-megatron":
        export_megatron(args.load, args.save, args.ckpt_format, args.tensor_model_parallel_size,
                        args.pipeline_model_parallel_size, args.ckpt_step)
    elif args.command == "import-hf":
        import_hf(args.hf_dir, args.save, args.make_vocab_size_divisible_by)
    elif args.command == "import-megatron":
        import_megatron(args.load, args.save, args.ckpt_step)
    else:
        export_hf(args.load, args.hf_dir, args.dtype, args.ckpt_step, int(args.max_shard_size_gb * (1 << 30)))
    return 0

if __name__ == "__main__":
    from mlm_jax.checkpoint import exit_process, silence_orbax

    silence_orbax()  # the command's output ends with its own error line, not Orbax's reports
    exit_process(main())
