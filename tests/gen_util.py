"""Shared pieces of the generation, evaluation and server tests: tiny in-memory models on a
mesh, tiny Hugging Face folders (written by tests/test_hf.py's helpers) and numpy decoders."""

import dataclasses
import functools

import jax
import numpy as np

from mlm_jax.config import Config, ModelConfig, ParallelConfig, padded_vocab_size
from mlm_jax.loading import LoadedModel, _shardings
from mlm_jax.models.build import init_params
from mlm_jax.sharding.mesh import make_mesh
from tests.test_hf import gpt2_reference, llama_reference, make_gpt2, make_llama  # noqa: F401

V = 100
GPT2_STYLE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=64)
LLAMA_STYLE = dict(GPT2_STYLE, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
                   num_query_groups=2, add_bias_linear=False, untie_embeddings_and_output_weights=True)
# DeepSeek-V3's attention (tests/test_mla.py): latents, YaRN rope, a latent cache when decoding
MLA_STYLE = dict({k: v for k, v in LLAMA_STYLE.items() if k != "num_query_groups"}, multi_latent_attention=True,
                 q_lora_rank=12, kv_lora_rank=8, qk_head_dim=6, qk_pos_emb_head_dim=4, v_head_dim=5,
                 qk_layernorm=True, rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0)
STYLES = {"gpt2": GPT2_STYLE, "llama": LLAMA_STYLE, "mla": MLA_STYLE}


@functools.lru_cache(maxsize=None)
def memory_model(tp: int, style: str, seed: int = 0) -> LoadedModel:
    """A randomly initialised model (std 0.5: peaked, so greedy choices are clear) on a tp mesh,
    `style` "gpt2", "llama" or "mla"; one per arguments for the whole session (compiles are shared)."""
    style = STYLES[style]
    m = ModelConfig(vocab_size=V, hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.5, **style)
    m = dataclasses.replace(m, padded_vocab_size=padded_vocab_size(V, m.make_vocab_size_divisible_by, tp))
    mesh = make_mesh(ParallelConfig(tensor_model_parallel_size=tp))
    _, shardings = _shardings(m, mesh)
    params = jax.tree.map(jax.device_put, init_params(Config(model=m), seed), shardings)
    return LoadedModel(m, params, mesh, None, f"memory-{tp}", None)


def uncached_greedy(logits_fn, prompts, new_tokens: int, window: int):
    """Greedy decoding by the argmax of full-sequence logits, all prompts in one fixed
    [rows, window] array (one compile): logits_fn(int [rows, window]) -> [rows, window, V]."""
    seqs = [list(p) for p in prompts]
    buf = np.zeros((len(seqs), window), np.int64)
    for i, s in enumerate(seqs):
        buf[i, : len(s)] = s
    for _ in range(new_tokens):
        logits = np.asarray(logits_fn(buf))
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(logits[i, len(s) - 1])))
            buf[i, len(s) - 1] = s[-1]
    return [s[len(p):] for s, p in zip(seqs, prompts)]


def numpy_decoder(reference, w, cfg, prompt, new_tokens: int):
    """Greedy decoding with a numpy reference forward (fp64) of the Hugging Face model."""
    ids = list(prompt)
    for _ in range(new_tokens):
        logits = reference(w, cfg, np.asarray([ids]))
        ids.append(int(np.argmax(logits[0, -1])))
    return ids[len(prompt):]


def log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))
