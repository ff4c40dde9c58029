"""Greedy decoding for the end-of-run sample (no KV cache: a fixed window, one compile)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def greedy(graphdef: nnx.GraphDef, params: dict, prompt: list[int], new_tokens: int,
           window: int) -> list[int]:
    """Extend `prompt` by `new_tokens` argmax tokens, attending to at most `window` tokens."""
    tokens = list(prompt)[-window:] or [0]

    @jax.jit
    def next_token(params, buf, length):
        logits = nnx.merge(graphdef, params)(buf[None])[0]  # [window, vocab]
        return jnp.argmax(logits[length - 1])

    for _ in range(new_tokens):
        ctx = tokens[-window:]
        buf = np.zeros((window,), np.int32)
        buf[: len(ctx)] = ctx
        tokens.append(int(next_token(params, jnp.asarray(buf), len(ctx))))
    return tokens[len(prompt) :] if prompt else tokens[1:]
