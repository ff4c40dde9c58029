"""Models: the GPT/Llama decoder, its modules and presets, and the parameter format version."""

from mlm_jax.models.attention import Attention
from mlm_jax.models.gpt import GPT, Block, cross_entropy
from mlm_jax.models.mlp import MLP
from mlm_jax.models.params import PARAM_FORMAT_VERSION, ParamFormatError, downgrade_params, upgrade_params
from mlm_jax.models.presets import PRESETS, gpt2_small, gpt3_175b, llama3_8b, llama3_70b, tiny_gpt

__all__ = ["GPT", "Attention", "Block", "MLP", "cross_entropy", "PARAM_FORMAT_VERSION",
           "ParamFormatError", "downgrade_params", "upgrade_params", "PRESETS", "gpt2_small", "gpt3_175b", "llama3_8b",
           "llama3_70b", "tiny_gpt"]
