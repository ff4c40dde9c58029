"""Per-array checksums written at save and checked at load: a flipped bit in a checkpoint's files
that still decodes (Orbax's zarr3 files checksum only their shard index, not the chunks) is caught
by name instead of training on, or generating from, damaged weights.

An array's fingerprint is sum_i bits(x_i) * w_i mod 2^32 over its elements in row-major order,
`bits` the element's bit pattern widened to uint32 and `w_i` an odd weight from the index. The
sum is of integers mod 2^32, so it is the same whatever the layout the array is sharded in (the
save's and the load's may differ) and XLA computes it on the devices, each its own shard, in one
pass with the weights made in place (no host copy, no index array). Any single flipped bit
changes it: the element changes by ±2^k, times an odd weight, which is not 0 mod 2^32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}
_GOLDEN = 2654435761  # Knuth's multiplicative hash constant


def _one(x: jax.Array) -> jax.Array:
    bits = jax.lax.bitcast_convert_type(x, _BITS[x.dtype.itemsize]).astype(jnp.uint32)
    index = jnp.zeros(x.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(x.ndim)):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, d) * jnp.uint32(stride % 2**32)
        stride *= x.shape[d]
    weight = (index * jnp.uint32(_GOLDEN) + jnp.uint32(0x9E3779B9)) | jnp.uint32(1)
    return jnp.sum(bits * weight, dtype=jnp.uint32)


@jax.jit
def _all(leaves):
    return [_one(x) for x in leaves]


def fingerprints(tree) -> dict[str, list]:
    """{key path: [fingerprint, shape]} of every array leaf of `tree` (a JSON-able record)."""
    leaves = [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
              if hasattr(x, "dtype") and x.dtype.itemsize in _BITS]
    values = jax.device_get(_all([x for _, x in leaves]))
    return {path: [int(np.asarray(v)), list(x.shape)] for (path, x), v in zip(leaves, values)}


def mismatched(tree, recorded: dict) -> list[str]:
    """The key paths of `tree` whose fingerprint differs from the one `recorded` at save (paths
    not recorded, or of another shape, as a vocab padded anew, are not checked)."""
    return [path for path, (value, shape) in fingerprints(tree).items()
            if path in recorded and recorded[path][1] == shape and recorded[path][0] != value]
