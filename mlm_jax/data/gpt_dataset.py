"""Megatron-LM's GPTDataset sampling, reproduced exactly, with vectorized index building.

Given the same indexed data, split, sequence length, seed and number of samples, the samples
and their order equal Megatron-LM's (`megatron/core/datasets/gpt_dataset.py`, the split
matrix of `blended_megatron_dataset_config.py`, and `build_sample_idx` in `helpers.cpp`):

1. **Split.** `--split 969,30,1` is normalised and turned into book-ends over the *sequences*
   (one per document for GPT data): split i covers `[round(b_i * n), round(e_i * n))`.
2. **Epochs.** As many passes over the split's documents as `num_samples * seq_length + 1`
   tokens need.
3. **Document index.** The split's document ids repeated per epoch and shuffled with
   `numpy.random.RandomState(seed)`. When the last epoch would contribute fewer than 80% of an
   epoch's samples, it is shuffled separately and appended (the "separate final epoch" rule),
   so it is not mixed into the earlier epochs.
4. **Sample index.** The shuffled documents are concatenated into one token stream; sample k
   starts at token `k * seq_length` and reads `seq_length + 1` tokens (samples overlap by the
   one label token, and cross document boundaries). Row k of the index is (position in the
   document index, offset in that document) of that start.
5. **Shuffle index.** A permutation of the samples from the same RandomState; with a separate
   final epoch, the samples before it and those of it are shuffled separately.

`__getitem__(i)` returns sample `shuffle_index[i]` as int64 tokens of length seq_length + 1.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Sequence

import numpy as np

from mlm_jax.data import cache as _cache
from mlm_jax.data.indexed_dataset import IndexedDataset
from mlm_jax.data.vocab_check import check_token_ids
from mlm_jax.errors import UsageError

logger = logging.getLogger(__name__)

SPLIT_NAMES = ("train", "valid", "test")
# Bump when index building changes, so stale cached indices are never reused.
_INDEX_FORMAT = 1
SEPARATE_FINAL_EPOCH_THRESHOLD = 0.80


class DatasetError(UsageError):
    """A dataset request that cannot be served; the message names the data and the numbers."""


# ----------------------------------------------------------------------------- split


def parse_split(split: str) -> list[float]:
    """'969,30,1' -> normalised [train, valid, test] weights (missing entries are 0).

    Weights are separated by ',' (or '/', as older Megatron accepted); each must be a finite
    number >= 0. Anything else is refused rather than read loosely (`90,x` is not `90`).
    """
    text = str(split).strip()
    parts = text.split("/") if "/" in text and "," not in text else text.split(",")
    usage = f"--split {split!r}: expected up to three comma-separated weights >= 0, e.g. 969,30,1"
    if not text or len(parts) > 3:
        raise DatasetError(usage)
    values = []
    for part in parts:
        try:
            value = float(part)
        except ValueError:
            raise DatasetError(f"{usage}; {part.strip()!r} is not a number") from None
        if not math.isfinite(value) or value < 0:
            raise DatasetError(f"{usage}; got {part.strip()}")
        values.append(value)
    values += [0.0] * (3 - len(values))
    total = float(np.sum(np.array(values, dtype=np.float64)))
    if total <= 0:
        raise DatasetError(f"--split {split!r}: the weights must not all be zero")
    return (np.array(values, dtype=np.float64) / total).tolist()


def split_matrix(vector: Sequence[float]) -> list[tuple[float, float] | None]:
    """Normalised split weights -> per-split (begin, end) fractions, None for an empty split."""
    ends = [0.0]
    for w in vector:  # the same float additions, in the same order, as Megatron
        ends.append(ends[-1] + w)
    return [(b, e) if e > b else None for b, e in zip(ends[:-1], ends[1:])]


def split_indices(bookend: tuple[float, float], num_elements: int) -> np.ndarray:
    beg = int(round(bookend[0] * float(num_elements)))
    end = int(round(bookend[1] * float(num_elements)))
    return np.arange(beg, end, dtype=np.int32)


# ----------------------------------------------------------------------------- index building


def num_epochs_for(tokens_per_epoch: int, num_samples: int | None, seq_length: int, add_extra_token: int = 1) -> int:
    if num_samples is None:
        return 1
    needed = num_samples * seq_length + add_extra_token
    # ceil(needed / tokens_per_epoch), but at least one epoch (Megatron's counting loop).
    return max(1, -(-needed // tokens_per_epoch))


def build_document_index(
    documents: np.ndarray, num_epochs: int, rng: np.random.RandomState, separate_final_epoch: bool
) -> np.ndarray:
    """Megatron's `_build_document_index`: documents tiled over epochs (int32), shuffled."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.tile(np.asarray(documents, dtype=np.int32), num_epochs)
        rng.shuffle(index)
        return index
    first = build_document_index(documents, num_epochs - 1, rng, False)
    last = build_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def build_sample_index(
    sizes: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    add_extra_token: int = 1,
) -> np.ndarray:
    """Megatron's `build_sample_idx` (helpers.cpp, drop_last_partial_sequence=True), vectorized.

    The C++ walks documents sample by sample; equivalently, sample k starts at token
    p_k = k * seq_length of the concatenated stream, in the document d whose cumulative start
    c_d satisfies c_d <= p_k < c_{d+1} (so never in an empty document), at offset p_k - c_d.
    Row 0 is (0, 0) whatever the first document's length, as in the C++.
    """
    if seq_length <= 1 or tokens_per_epoch <= 1 or num_epochs <= 0:
        raise DatasetError(
            f"cannot sample: seq_length {seq_length}, tokens per epoch {tokens_per_epoch}, epochs {num_epochs}"
        )
    num_samples = (num_epochs * tokens_per_epoch - add_extra_token) // seq_length
    doc_lengths = np.asarray(sizes)[document_index].astype(np.int64)
    starts = np.zeros(len(doc_lengths) + 1, dtype=np.int64)
    np.cumsum(doc_lengths, out=starts[1:])
    if starts[-1] != num_epochs * tokens_per_epoch:
        raise DatasetError("document index does not cover num_epochs * tokens_per_epoch tokens")
    big = max(len(document_index), int(np.max(sizes)) if len(sizes) else 0) > np.iinfo(np.int32).max
    dtype = np.int64 if big else np.int32
    positions = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc = np.searchsorted(starts, positions, side="right") - 1
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    out[:, 0] = doc
    out[:, 1] = positions - starts[doc]
    out[0] = 0
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """Megatron's `_build_shuffle_index`: shuffle [0, num_samples) then [num_samples, total_size)."""
    dtype = np.int64 if total_size >= np.iinfo(np.uint32).max - 1 else np.uint32
    first = np.arange(0, num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_indices(
    sizes: np.ndarray, documents: np.ndarray, num_samples: int | None, seq_length: int, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(document_index, sample_index, shuffle_index) exactly as Megatron's GPTDataset builds them."""
    tokens_per_epoch = int(np.sum(np.asarray(sizes)[documents], dtype=np.int64))
    num_epochs = num_epochs_for(tokens_per_epoch, num_samples, seq_length)
    separate_final_epoch = False
    if num_epochs > 1:
        samples_sans_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
        from_final = num_samples - samples_sans_final
        per_epoch = (tokens_per_epoch - 1) // seq_length
        assert 0 <= from_final <= per_epoch + 1
        separate_final_epoch = from_final < int(SEPARATE_FINAL_EPOCH_THRESHOLD * per_epoch)
    rng = np.random.RandomState(seed)
    try:
        document_index = build_document_index(documents, num_epochs, rng, separate_final_epoch)
        sample_index = build_sample_index(sizes, document_index, seq_length, num_epochs, tokens_per_epoch)
        total = sample_index.shape[0] - 1
        first = samples_sans_final if separate_final_epoch else total
        shuffle_index = build_shuffle_index(first, total, rng)
    except MemoryError as e:  # numpy's refusal of the allocation, before any index exists
        raise DatasetError(
            f"{num_samples} samples of {seq_length} tokens need {num_epochs} epochs of a dataset of "
            f"{tokens_per_epoch} tokens: the sample index does not fit in memory; lower --train-samples "
            "(or --train-iters x --global-batch-size)") from e
    return document_index, sample_index, shuffle_index


# ----------------------------------------------------------------------------- datasets


class MockLowLevelDataset:
    """Megatron's MockGPTLowLevelDataset: 100000 synthetic documents, lengths from seed 0.

    Document i is `1, 2, ..., L_i - 1, eod`. Token ids wrap below `eod`, so any vocab works;
    for eod >= 4096 the tokens equal Megatron's exactly. An end-of-document id below 2 (GPT-2 BPE
    vocabularies whose EOD is 0) wraps the tokens over the rest of the `vocab` instead.
    """

    seed = 0
    size = 100000
    max_sequence_length = 4096

    def __init__(self, eod: int, vocab: int | None = None):
        if eod < 2 and (vocab is None or vocab < 3):
            raise DatasetError(f"mock data needs a vocab of at least 3 tokens, got {vocab or 'none'} "
                               f"(end-of-document id {eod})")
        self.eod, self.vocab = int(eod), vocab
        rng = np.random.default_rng(seed=self.seed)
        self.sequence_lengths = rng.integers(1, self.max_sequence_length, size=self.size, dtype=np.int32)
        self.path_prefix = None

    def __len__(self) -> int:
        return self.size

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        n = int(self.sequence_lengths[i])
        if length is None:
            length = n - offset
        doc = np.empty(n, dtype=np.int64)
        if self.eod >= 2:
            doc[:-1] = np.arange(n - 1) % (self.eod - 1) + 1
        else:  # ids 1.. of the vocab, stepping over the end-of-document id
            t = np.arange(n - 1) % (self.vocab - 2) + 1
            doc[:-1] = t + (t >= self.eod)
        doc[-1] = self.eod
        return doc[offset : offset + length]


class GPTDataset:
    """Samples of seq_length + 1 tokens over one split of one indexed dataset (Megatron order).

    Args:
        low_level: an `IndexedDataset` (or `MockLowLevelDataset`).
        indices: the sequence ids this split exposes (`split_indices`).
        num_samples: samples wanted; the index covers at least this many (None: one epoch).
        split_name: "train" | "valid" | "test" (part of the cache key only).
        cache_dir: where to cache the indices; None: do not cache (mock data).
    """

    def __init__(
        self,
        low_level,
        indices: np.ndarray,
        num_samples: int | None,
        seq_length: int,
        seed: int,
        split_name: str = "train",
        cache_dir: str | None = None,
        name: str | None = None,
    ):
        self.dataset = low_level
        self.indices = np.asarray(indices, dtype=np.int32)
        self.num_samples = num_samples
        self.seq_length = int(seq_length)
        self.seed = int(seed)
        self.split_name = split_name
        self.name = name or str(getattr(low_level, "path_prefix", None) or "mock")
        if len(self.indices) == 0:
            raise DatasetError(
                f"the {split_name} split of {self.name} has no documents; "
                "give it a larger share in --split or use more data"
            )
        sizes = low_level.sequence_lengths
        tokens = int(np.sum(np.asarray(sizes)[self.indices], dtype=np.int64))
        if tokens <= 1:
            raise DatasetError(f"the {split_name} split of {self.name} holds {tokens} tokens; cannot sample from it")
        self.identifiers = {
            "class": "GPTDataset",
            "format": _INDEX_FORMAT,
            "dataset": self.name,
            "sequence_lengths_md5": _cache.fingerprint_array(np.asarray(sizes)),
            "indices": [int(self.indices[0]), int(self.indices[-1]) + 1, len(self.indices)],
            "num_samples": num_samples,
            "split": split_name,
            "seq_length": self.seq_length,
            "seed": self.seed,
        }
        self.cache_files: dict[str, str] | None = None
        self.built_anew = False
        self.document_index, self.sample_index, self.shuffle_index = self._load_or_build(cache_dir)

    def _load_or_build(self, cache_dir: str | None):
        names = ("document_index", "sample_index", "shuffle_index")
        if cache_dir:
            description, digest = _cache.describe(self.identifiers)
            base = os.path.join(cache_dir, f"{digest}-GPTDataset-{self.split_name}")
            self.cache_files = {n: f"{base}-{n}.npy" for n in names}
            desc_file = f"{base}-description.txt"
            if all(os.path.isfile(p) for p in (*self.cache_files.values(), desc_file)):
                cached = self._load_cached(names)
                if cached is not None:
                    return cached
        t0 = time.perf_counter()
        built = build_indices(self.dataset.sequence_lengths, self.indices, self.num_samples, self.seq_length, self.seed)
        self.built_anew = True
        logger.info("built %s %s indices (%d samples) in %.2f s", self.name, self.split_name,
                    len(built[1]) - 1, time.perf_counter() - t0)
        if cache_dir:
            try:
                for n, arr in zip(names, built):
                    _cache.atomic_save_npy(self.cache_files[n], arr)
                # The description is written last: its presence marks a complete entry.
                _cache.atomic_write_bytes(desc_file, description.encode("utf-8"))
            except OSError as e:
                raise DatasetError(
                    f"cannot write the sample index cache in {cache_dir} ({e.strerror or e}); "
                    "point --data-cache-path to a writable folder"
                ) from None
        return built

    def _load_cached(self, names) -> tuple | None:
        """The cached indices, or None (rebuilt) when an entry is unreadable or inconsistent:
        a damaged cache costs a rebuild, never a traceback or wrong samples."""
        try:
            doc, sample, shuffle = (_cache.load_npy(self.cache_files[n]) for n in names)
        except (OSError, ValueError, EOFError) as e:
            logger.warning("index cache %s is unreadable (%s); rebuilding it", self.cache_files["sample_index"], e)
            return None
        n = sample.shape[0] - 1 if sample.ndim == 2 else -1
        consistent = (
            doc.ndim == 1 and sample.ndim == 2 and sample.shape[1] == 2 and shuffle.ndim == 1
            and n >= 0 and shuffle.shape[0] == n
            and (self.num_samples is None or n >= self.num_samples)
        )
        if not consistent:
            logger.warning("index cache %s does not match its description; rebuilding it",
                           self.cache_files["sample_index"])
            return None
        return doc, sample, shuffle

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1

    def __getitem__(self, idx: int) -> np.ndarray:
        n = len(self)
        if not 0 <= idx < n:
            raise IndexError(f"sample {idx} out of range for the {self.split_name} split of {self.name} ({n} samples)")
        i = int(self.shuffle_index[idx])
        d0, o0 = (int(x) for x in self.sample_index[i])
        d1, o1 = (int(x) for x in self.sample_index[i + 1])
        get = self.dataset.get
        if d0 == d1:
            parts = [get(int(self.document_index[d0]), o0, o1 - o0 + 1)]
        else:
            parts = [get(int(self.document_index[d0]), o0)]
            parts += [get(int(self.document_index[d])) for d in range(d0 + 1, d1)]
            parts.append(get(int(self.document_index[d1]), 0, o1 + 1))
        sample = np.concatenate(parts).astype(np.int64, copy=False)
        assert sample.shape[0] == self.seq_length + 1, (sample.shape, self.seq_length)
        return sample

    def document_ids(self, idx: int) -> np.ndarray:
        """The document (sequence) ids sample `idx` draws from, in order."""
        i = int(self.shuffle_index[idx])
        d0, d1 = int(self.sample_index[i][0]), int(self.sample_index[i + 1][0])
        return np.asarray(self.document_index[d0 : d1 + 1], dtype=np.int64)


def index_cache_dir(prefix: str, data_cache_path: str | None) -> str:
    """`--data-cache-path`, else Megatron's `<prefix>/cache/GPTDataset_indices` (when writable),
    else `<default cache>/indices`."""
    if data_cache_path:
        return data_cache_path
    beside = os.path.join(prefix, "cache", "GPTDataset_indices")
    if _cache.writable_dir(beside):
        return beside
    return os.path.join(_cache.default_cache_dir(), "indices")


def build_gpt_splits(
    prefix: str | None,
    split: Sequence[tuple[float, float] | None],
    num_samples: Sequence[int | None],
    seq_length: int,
    seed: int,
    data_cache_path: str | None = None,
    mock_eod: int | None = None,
    vocab: tuple[int, str] | None = None,
) -> list[GPTDataset | None]:
    """One GPTDataset per split of one indexed dataset (Megatron's `_build_megatron_dataset_splits`).

    `split[i]` is the (begin, end) book-end of split i, or None to skip it. `vocab`:
    (the model's vocab size, where it comes from): every token id must be below it.
    """
    if prefix is None:
        low = MockLowLevelDataset(mock_eod, None if vocab is None else vocab[0])
        cache_dir = None
    else:
        low = IndexedDataset(prefix)
        cache_dir = index_cache_dir(prefix, data_cache_path)
        if vocab is not None:
            check_token_ids(low, vocab[0], cache_dir, vocab[1])
    out: list[GPTDataset | None] = []
    for i, name in enumerate(SPLIT_NAMES):
        if split[i] is None:
            out.append(None)
            continue
        indices = split_indices(split[i], len(low))
        out.append(GPTDataset(low, indices, num_samples[i], seq_length, seed, name, cache_dir))
    return out
