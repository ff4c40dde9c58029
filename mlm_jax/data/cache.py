"""Where built artefacts (indices, the default corpus, its tokenizer) are cached, and how.

Every cache entry is keyed by an md5 of a JSON description of everything it depends on, and
written under a temporary name then renamed, so a crash or a concurrent writer on another host
never leaves a half-written entry that a later run would trust.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

import numpy as np


def default_cache_dir() -> str:
    """`$MLM_JAX_CACHE`, else `~/.cache/mlm_jax`."""
    return os.environ.get("MLM_JAX_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mlm_jax")


def describe(identifiers: dict) -> tuple[str, str]:
    """(description text, md5 hex digest) of a JSON-serialisable dict."""
    text = json.dumps(identifiers, indent=4, sort_keys=True)
    return text, hashlib.md5(text.encode("utf-8")).hexdigest()


def writable_dir(path: str) -> bool:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return False
    return os.access(path, os.W_OK)


def atomic_write_bytes(path: str, data: bytes) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_save_npy(path: str, array: np.ndarray) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-" + os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array, allow_pickle=False)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_npy(path: str) -> np.ndarray:
    return np.load(path, mmap_mode="r", allow_pickle=False)


def fingerprint_array(array: np.ndarray) -> str:
    """md5 of an array's bytes (e.g. a dataset's sequence lengths, which fix its sampling)."""
    h = hashlib.md5(str(array.dtype).encode())
    a = np.ascontiguousarray(array)
    step = 1 << 24
    flat = a.reshape(-1)
    for beg in range(0, flat.size, step):
        h.update(memoryview(flat[beg : beg + step]).cast("B"))
    return h.hexdigest()
