"""Causal load balance for context parallelism (Megatron's chunk order), as pure functions.

Under a causal mask the last tokens of a sequence attend to everything and the first to almost
nothing, so cutting the sequence into C contiguous pieces would give the last context rank C
times the first one's work. Megatron cuts it into 2C chunks and gives rank i chunks i and
2C-1-i: every rank then holds one early and one late chunk and the same amount of work.

The batch is stored in that order (`seq_order`): a plain split of the permuted sequence over
the `context` axis hands each rank exactly its two chunks. Position ids travel with the tokens
(rotary and learned positions follow the original positions); the causal order inside attention
comes from `local_order` (the original index of each local token). Every loss is a sum over
tokens, so the loss is identical to C = 1. With C = 1 the order is the identity.
"""

from __future__ import annotations

import numpy as np


def check_divisible(seq_length: int, context_size: int) -> None:
    """ValueError unless the sequence splits into 2C equal chunks."""
    if seq_length % (2 * context_size):
        raise ValueError(f"sequence length {seq_length} is not divisible by 2 x context size "
                         f"{context_size} = {2 * context_size}")


def local_order(rank, context_size: int, local_len: int, xp=np):
    """Original sequence index of each of rank `rank`'s `local_len` tokens: [local_len] ints.

    `rank` may be traced (`xp=jax.numpy`, inside shard_map) or a Python int (`xp=numpy`).
    """
    c = local_len // 2
    ar = xp.arange(c, dtype=xp.int32)
    return xp.concatenate([rank * c + ar, (2 * context_size - 1 - rank) * c + ar])


def seq_order(seq_length: int, context_size: int) -> np.ndarray:
    """[seq] original index of each position of the stored (permuted) sequence."""
    check_divisible(seq_length, context_size)
    local = seq_length // context_size
    return np.concatenate([local_order(r, context_size, local) for r in range(context_size)])


def permute_seq(batch: dict, context_size: int, axis: int = -1) -> dict:
    """Every [..., seq] array of `batch` in the load-balanced order (numpy; C = 1: unchanged)."""
    if context_size == 1:
        return dict(batch)
    out = {}
    for key, arr in batch.items():
        arr = np.asarray(arr)
        out[key] = np.take(arr, seq_order(arr.shape[axis], context_size), axis=axis)
    return out


def unpermute_seq(arr: np.ndarray, context_size: int, axis: int = -1) -> np.ndarray:
    """Inverse of `permute_seq` for one array: back to the original token order."""
    if context_size == 1:
        return np.asarray(arr)
    order = seq_order(np.shape(arr)[axis], context_size)
    return np.take(np.asarray(arr), np.argsort(order), axis=axis)


def sharding_seq_order(sharding, shape) -> np.ndarray | None:
    """The stored order for a [..., seq] batch of `shape` laid out by `sharding` (a
    NamedSharding): the load-balanced order when its seq dim is split over a `context` axis
    larger than 1, else None (the plain order)."""
    from mlm_jax.sharding.mesh import CONTEXT

    spec, mesh = getattr(sharding, "spec", None), getattr(sharding, "mesh", None)
    if spec is None or mesh is None or len(spec) < len(shape):
        return None  # trailing dims left out of a spec are unsharded
    last = spec[len(shape) - 1]
    axes = (last,) if isinstance(last, str) else tuple(last or ())
    size = dict(mesh.shape).get(CONTEXT, 1)
    if CONTEXT not in axes or size == 1:
        return None
    return seq_order(shape[-1], size)
