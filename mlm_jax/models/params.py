"""The parameter tree's format version, and the conversion of older trees.

Version 1 (up to the Attention/MLP split) kept every layer parameter directly under `layers`:
    layers/{norm1, wqkv, bqkv, wo, bo, norm2, w1, b1, w2, b2}
Version 2 groups them by module:
    layers/{norm1, attention/{wqkv, bqkv, wo, bo}, norm2, mlp/{w1, b1, w2, b2}}
Values and shapes are unchanged; only the paths move.
"""

from __future__ import annotations

from collections.abc import Mapping

PARAM_FORMAT_VERSION = 2

# Version 1 -> 2: the module each moved leaf now lives in.
_V1_TO_V2 = {"wqkv": "attention", "bqkv": "attention", "wo": "attention", "bo": "attention",
             "w1": "mlp", "b1": "mlp", "w2": "mlp", "b2": "mlp"}


class ParamFormatError(ValueError):
    """A parameter tree of a format this version cannot read; names both versions."""


def _layers_v1_to_v2(layers: Mapping) -> dict:
    out: dict = {}
    for name, value in layers.items():
        module = _V1_TO_V2.get(name)
        if module is None:
            out[name] = value
        else:
            out.setdefault(module, {})[name] = value
    return out


def _layers_v2_to_v1(layers: Mapping) -> dict:
    out: dict = {}
    for name, value in layers.items():
        if name in ("attention", "mlp") and isinstance(value, Mapping):
            out.update(value)
        else:
            out[name] = value
    return out


def _walk(tree, fix_layers):
    """Rebuild `tree` (dicts, lists, tuples, namedtuples), applying `fix_layers` to every
    mapping found under a "layers" key."""
    if isinstance(tree, Mapping):
        return {k: (fix_layers(v) if k == "layers" and isinstance(v, Mapping) else _walk(v, fix_layers))
                for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple (optax states)
        return type(tree)(*(_walk(v, fix_layers) for v in tree))
    if isinstance(tree, (list, tuple)):
        return type(tree)(_walk(v, fix_layers) for v in tree)
    return tree


def upgrade_params(tree, from_version: int):
    """A params-like tree (parameters, gradients, optimizer moments: anything mirroring the
    parameters) of format `from_version` in the current format (PARAM_FORMAT_VERSION).

    Every mapping under a "layers" key is converted, wherever it sits in the tree (so the Adam
    moments inside an optax state are converted with the parameters). Leaves are not copied.
    A version newer than this code, or unknown, raises ParamFormatError naming both versions.
    """
    if from_version == PARAM_FORMAT_VERSION:
        return tree
    if from_version == 1:
        return _walk(tree, _layers_v1_to_v2)
    raise ParamFormatError(
        f"parameter format version {from_version} cannot be read by this mlm_jax (it reads "
        f"versions 1 to {PARAM_FORMAT_VERSION})")


def downgrade_params(tree, to_version: int):
    """The inverse of `upgrade_params`: a current-format params-like tree in the layout of
    `to_version`. Restoring an old checkpoint needs it to build the restore target (the saved
    tree's structure), which `upgrade_params` then converts."""
    if to_version == PARAM_FORMAT_VERSION:
        return tree
    if to_version == 1:
        return _walk(tree, _layers_v2_to_v1)
    raise ParamFormatError(
        f"parameter format version {to_version} cannot be written by this mlm_jax (it writes "
        f"versions 1 to {PARAM_FORMAT_VERSION})")
