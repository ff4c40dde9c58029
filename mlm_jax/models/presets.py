"""Model presets as Python functions (Megatron's published shapes)."""

from __future__ import annotations

from mlm_jax.config import ModelConfig


def tiny_gpt(**overrides) -> ModelConfig:
    """The default run's model: a few million parameters, trains on a laptop CPU in minutes."""
    base = dict(num_layers=4, hidden_size=256, num_attention_heads=4, max_position_embeddings=256,
                hidden_dropout=0.0, attention_dropout=0.0)
    return ModelConfig(**{**base, **overrides})


def gpt2_small(**overrides) -> ModelConfig:
    base = dict(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257,
                max_position_embeddings=1024, openai_gelu=True)
    return ModelConfig(**{**base, **overrides})


def gpt3_175b(**overrides) -> ModelConfig:
    """GPT-3 175B (Brown et al. 2020, table 2.1): 96 layers, d=12288, 96 heads, context 2048."""
    base = dict(num_layers=96, hidden_size=12288, num_attention_heads=96, vocab_size=50257,
                max_position_embeddings=2048, init_method_std=0.006)
    return ModelConfig(**{**base, **overrides})


def llama3_8b(**overrides) -> ModelConfig:
    base = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8,
                ffn_hidden_size=14336, vocab_size=128256, max_position_embeddings=8192,
                position_embedding_type="rope", rotary_base=500000.0, normalization="RMSNorm",
                swiglu=True, untie_embeddings_and_output_weights=True, add_bias_linear=False,
                hidden_dropout=0.0, attention_dropout=0.0, norm_epsilon=1e-5)
    return ModelConfig(**{**base, **overrides})


def llama3_70b(**overrides) -> ModelConfig:
    """Llama-3 70B: 80 layers, d=8192, 64 heads in 8 kv groups, SwiGLU 28672, vocab 128256."""
    return llama3_8b(**{**dict(num_layers=80, hidden_size=8192, num_attention_heads=64,
                               ffn_hidden_size=28672), **overrides})


PRESETS = {f.__name__: f for f in (tiny_gpt, gpt2_small, gpt3_175b, llama3_8b, llama3_70b)}
