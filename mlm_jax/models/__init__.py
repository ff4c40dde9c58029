"""Models: the GPT/Llama decoder and its presets."""

from mlm_jax.models.gpt import GPT, Block, cross_entropy
from mlm_jax.models.presets import PRESETS, gpt2_small, gpt3_175b, llama3_8b, llama3_70b, tiny_gpt

__all__ = ["GPT", "Block", "cross_entropy", "PRESETS", "gpt2_small", "gpt3_175b", "llama3_8b",
           "llama3_70b", "tiny_gpt"]
