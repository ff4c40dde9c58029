"""Token ids outside the model's vocabulary are an error, found before the first step.

JAX clamps an out-of-range embedding gather instead of failing, so a dataset tokenized with a
larger vocab than the model's would train silently on wrong tokens. The .idx holds only
lengths, so the .bin is scanned once for its smallest and largest id; the result is cached
in the index cache under a key of the .bin's path, size and modification time, so a
rewritten .bin is scanned again and an unchanged one never is.
"""

from __future__ import annotations

import json
import logging
import os
import time

from mlm_jax.data import cache as _cache
from mlm_jax.data.indexed_dataset import IndexedDataset, bin_path
from mlm_jax.errors import UsageError

logger = logging.getLogger(__name__)


class VocabularyError(UsageError):
    """Token ids in a dataset that the model's vocabulary does not have."""


def _key(bin_file: str, dtype) -> dict:
    st = os.stat(bin_file)
    return {"class": "TokenRange", "bin": os.path.abspath(bin_file), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "dtype": str(dtype)}


def _read_cached(path: str) -> tuple | None:
    """The cached (min, max), or None when absent or unreadable (then it is rebuilt)."""
    try:
        with open(path, encoding="utf-8") as f:
            entry = json.load(f)
        lo, hi = entry["min"], entry["max"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (lo, hi)) or lo > hi:
        return None
    return lo, hi


def token_range(dataset: IndexedDataset, cache_dir: str | None) -> tuple | None:
    """(min, max) token id of `dataset`'s .bin, from the cache when the .bin is unchanged."""
    key = _key(bin_path(dataset.path_prefix), dataset.dtype)
    description, digest = _cache.describe(key)
    path = os.path.join(cache_dir, f"{digest}-TokenRange.json") if cache_dir else None
    if path and os.path.isfile(path):
        cached = _read_cached(path)
        if cached is not None:
            return cached
        logger.warning("%s: unreadable token-range cache entry; scanning the data again", path)
    t0 = time.perf_counter()
    found = dataset.token_range()
    logger.info("scanned %s for its token ids in %.2f s", key["bin"], time.perf_counter() - t0)
    if path and found is not None:
        entry = {"min": found[0], "max": found[1], "key": key}
        try:
            _cache.atomic_write_bytes(path, json.dumps(entry, indent=1).encode("utf-8"))
        except OSError as e:  # a read-only cache only costs a rescan next time
            logger.warning("cannot cache the token range in %s: %s", path, e)
    return found


def outside_vocab(lo: int, hi: int, vocab_size: int, source: str = "") -> str | None:
    """None when the token ids lo..hi are all in the model's vocab; else what is wrong, naming
    the offending id and the vocab size (`source`: where the vocab size comes from). The one
    wording of this error: a dataset's .bin (training, evaluate), generate's prompt ids and
    the server's token-id prompts."""
    if lo >= 0 and hi < vocab_size:
        return None
    bad = f"a negative token id ({lo})" if lo < 0 else f"token ids up to {hi}"
    return (f"{bad}, but the model's vocab has {vocab_size} tokens (ids 0..{vocab_size - 1}"
            + (f", {source}" if source else "") + f"): token ids must be in [0, {vocab_size})")


def prompt_outside_vocab(ids, vocab_size: int) -> str | None:
    """`outside_vocab` for one prompt's token ids (an empty prompt: None)."""
    return outside_vocab(min(ids), max(ids), vocab_size) if len(ids) else None


def check_token_ids(dataset: IndexedDataset, vocab_size: int, cache_dir: str | None, source: str) -> None:
    """Raise VocabularyError naming the .bin, the offending id and the vocab size when a token
    id of `dataset` is negative or >= `vocab_size`; `source` says where the vocab size comes from."""
    found = token_range(dataset, cache_dir)
    problem = None if found is None else outside_vocab(found[0], found[1], vocab_size, source)
    if problem is None:
        return
    raise VocabularyError(
        f"{bin_path(dataset.path_prefix)}: {problem}; the data was tokenized with another tokenizer or "
        "vocab size: use the tokenizer flags it was made with, or preprocess it again"
    )
