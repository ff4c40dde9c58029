"""A Megatron checkpoint's `args` (argparse.Namespace) -> mlm_jax's ModelConfig and tokenizer.

Megatron's argument names are mlm_jax's ModelConfig field names (mlm_jax/arguments.py maps the
same flags onto them), so a field is taken from the attribute of its name. Settings that change
the function and that mlm_jax does not compute are refused, each by its argument name.
"""

from __future__ import annotations

import dataclasses
import os

from mlm_jax.checkpoint.megatron.errors import MegatronCheckpointError
from mlm_jax.checkpoint.megatron.torch_pickle import EnumValue
from mlm_jax.config import ModelConfig

# Fields not taken from args: the run's choice (compute dtype, remat, backend, dispatcher), or
# set from the checkpoint's tensors and tokenizer (vocab).
_NOT_FROM_ARGS = {"padded_vocab_size", "vocab_size", "recompute_granularity", "recompute_method",
                  "recompute_num_layers", "bf16", "fp16", "attention_backend", "moe_grouped_gemm",
                  "moe_token_dispatcher_type", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
                  "moe_z_loss_coeff", "num_query_groups"}

# Settings that change what the model computes and that mlm_jax does not have: refused when set.
UNSUPPORTED = {
    "rotary_interleaved": "interleaved rotary embedding", "use_rope_scaling": "Llama 3.1 rope scaling",
    "rope_scaling": "rope scaling",
    "squared_relu": "squared ReLU", "quick_geglu": "quick GeGLU", "moe_shared_expert_gate": "a gated shared expert",
    "moe_use_legacy_grouped_gemm": "the legacy GroupedMLP weights", "softmax_scale": "a custom softmax scale",
    "window_size": "sliding-window attention", "heterogeneous_layers_config_path": "heterogeneous layers",
    "experimental_attention_variant": "an experimental attention variant",
    "linear_attention_type": "linear attention",
}


def _is_set(name: str, value) -> bool:
    """Whether an UNSUPPORTED setting is on (None, False, 0, "" and [] are off)."""
    if value is None or value is False or value in ("", []):
        return False
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value != 0
    return True


def _unsupported(args, where: str) -> None:
    for name, what in UNSUPPORTED.items():
        value = getattr(args, name, None)
        if _is_set(name, value):
            raise MegatronCheckpointError(f"{where}: args.{name} = {value!r}: {what} is not supported by mlm_jax")
    if getattr(args, "qk_layernorm", False) and not getattr(args, "multi_latent_attention", False):
        raise MegatronCheckpointError(f"{where}: args.qk_layernorm = True without multi-latent attention: query/key "
                                      "layer norms are not supported by mlm_jax (with args.multi_latent_attention "
                                      "they are the latents' norms)")
    factor = getattr(args, "rotary_seq_len_interpolation_factor", None)
    if factor not in (None, 1, 1.0):
        raise MegatronCheckpointError(f"{where}: args.rotary_seq_len_interpolation_factor = {factor!r} is not "
                                      "supported by mlm_jax")
    if getattr(args, "add_qkv_bias", False) and not getattr(args, "add_bias_linear", True):
        raise MegatronCheckpointError(f"{where}: args.add_qkv_bias without add_bias_linear (a QKV bias alone) "
                                      "is not supported by mlm_jax")
    kind = getattr(args, "position_embedding_type", "learned_absolute")
    if getattr(args, "use_rotary_position_embeddings", False):
        kind = "rope"
    if kind not in ("learned_absolute", "rope"):
        raise MegatronCheckpointError(f"{where}: args.position_embedding_type = {kind!r} is not supported "
                                      "(learned_absolute, rope)")
    balancing = getattr(args, "moe_router_load_balancing_type", None)
    if getattr(args, "num_experts", None) and "sinkhorn" in (balancing if isinstance(balancing, list) else [balancing]):
        raise MegatronCheckpointError(f"{where}: args.moe_router_load_balancing_type = {balancing!r}: Sinkhorn "
                                      "routing is not supported by mlm_jax")
    model_type = getattr(args, "model_type", None)
    if isinstance(model_type, EnumValue) and model_type.value not in (1, "encoder_or_decoder"):
        raise MegatronCheckpointError(f"{where}: args.model_type = {model_type}: only GPT (decoder) models")


def _value(name: str, value):
    if value is None:
        return None
    if name == "moe_layer_freq" and isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    if name in ("rotary_base", "rotary_percent", "norm_epsilon", "init_method_std", "hidden_dropout",
                "attention_dropout", "moe_expert_capacity_factor"):
        return float(value)
    return value


def model_config_from_args(args, where: str) -> ModelConfig:
    """The ModelConfig of the model `args` describes (vocab_size left to the caller)."""
    _unsupported(args, where)
    fields = {}
    for f in dataclasses.fields(ModelConfig):
        if f.name in _NOT_FROM_ARGS or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value is None and f.default is not None:
            continue
        fields[f.name] = _value(f.name, value)
    if getattr(args, "use_rotary_position_embeddings", False):
        fields["position_embedding_type"] = "rope"
    # Megatron-Core's fused bias + GELU (--bias-gelu-fusion, on by default with biases) is the tanh
    # approximation (megatron/core/fusions/fused_bias_gelu.py): the model computes openai_gelu.
    if (not fields.get("swiglu") and fields.get("add_bias_linear", True) and getattr(args, "bias_gelu_fusion", False)):
        fields["openai_gelu"] = True
    if getattr(args, "group_query_attention", False):
        g = getattr(args, "num_query_groups", None)
        fields["num_query_groups"] = None if g in (None, args.num_attention_heads) else int(g)
    h, d = args.num_attention_heads, args.hidden_size
    if fields.get("kv_channels") == d // h and d % h == 0:
        fields["kv_channels"] = None
    if not getattr(args, "num_experts", None):
        fields["num_experts"] = None
    try:
        return ModelConfig(**fields)
    except (TypeError, ValueError) as e:
        raise MegatronCheckpointError(f"{where}: the args make no mlm_jax model config ({e})") from e


def tokenizer_from_args(args, root: str | None = None):
    """The tokenizer the args name when its files exist (paths as saved, else beside the
    checkpoint root), else None."""
    from mlm_jax.data.tokenizers import make_tokenizer

    kind = getattr(args, "tokenizer_type", None)
    if kind is None:
        return None
    files = {}
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        path = getattr(args, name, None)
        if path is None:
            continue
        if not os.path.exists(path) and root is not None:
            local = os.path.join(root, os.path.basename(str(path)))
            path = local if os.path.exists(local) else path
        if not os.path.exists(path):
            return None
        files[name] = path
    try:
        return make_tokenizer(kind, vocab_size=getattr(args, "vocab_size", None), **files)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot be built: logits still work
        return None


def true_vocab_size(args, tokenizer, checkpoint_vocab: int) -> int:
    """The true vocab: the tokenizer's, else NullTokenizer's V + 1, args.vocab_size, or the
    checkpoint's padded rows when nothing says."""
    if tokenizer is not None:
        return int(tokenizer.vocab_size)
    v = getattr(args, "vocab_size", None)
    if v:
        return int(v) + 1 if getattr(args, "tokenizer_type", None) == "NullTokenizer" else int(v)
    return checkpoint_vocab
