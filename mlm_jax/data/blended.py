"""Megatron-LM's BlendedDataset: draw each next sample from the dataset furthest below its share.

Sample k of the blend comes from the dataset d maximising `w_d * max(k, 1) - count_d` (the
first such d on ties), and is that dataset's next unused sample (`helpers.cpp`
`build_blending_indices`). The loop is in plain Python floats, which are IEEE doubles like
the C++'s, so the indices are identical to Megatron's.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Sequence

import numpy as np

from mlm_jax.data import cache as _cache
from mlm_jax.data.gpt_dataset import DatasetError

logger = logging.getLogger(__name__)

# Megatron's `mid_level_dataset_surplus`: each blended dataset builds 0.5% more samples than
# its share, so the blend never runs past a dataset's end.
MID_LEVEL_SURPLUS = 0.005


def normalize(weights: Sequence[float]) -> list[float]:
    w = np.array(weights, dtype=np.float64)
    return (w / np.sum(w)).tolist()


def sizes_per_dataset(weights: Sequence[float], target: int, surplus: float = 0.0) -> list[int]:
    """Megatron's `_get_size_per_split_per_dataset` for one split."""
    return [int(math.ceil(math.ceil(target * w) * (1 + surplus))) for w in weights]


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index int16 [size], dataset_sample_index int64 [size]), Megatron's greedy rule."""
    w = [float(x) for x in weights]
    counts = [0] * len(w)
    chosen = [0] * size
    taken = [0] * size
    others = range(1, len(w))
    for k in range(size):
        kf = float(k) if k > 0 else 1.0
        best = 0
        best_err = w[0] * kf - counts[0]
        for d in others:
            err = w[d] * kf - counts[d]
            if err > best_err:
                best_err = err
                best = d
        chosen[k] = best
        taken[k] = counts[best]
        counts[best] += 1
    return np.array(chosen, dtype=np.int16), np.array(taken, dtype=np.int64)


class BlendedDataset:
    """Blend of datasets by weight; `len` is `size`; `ds[i]` is that sample's int64 tokens."""

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int, cache_dir: str | None = None):
        if len(datasets) != len(weights):
            raise DatasetError(f"{len(datasets)} datasets but {len(weights)} weights")
        if len(datasets) >= 32767:
            raise DatasetError("at most 32766 datasets can be blended (int16 dataset index)")
        self.datasets = list(datasets)
        self.weights = normalize(weights)
        self.size = int(size)
        self.identifiers = {
            "class": "BlendedDataset",
            "datasets": [getattr(d, "identifiers", repr(d)) for d in self.datasets],
            "weights": self.weights,
            "size": self.size,
        }
        self.dataset_index, self.dataset_sample_index = self._load_or_build(cache_dir)
        # Megatron's bound check: the last sample of each dataset used must exist.
        for d, ds in enumerate(self.datasets):
            used = self.dataset_sample_index[self.dataset_index == d]
            if used.size and int(used.max()) >= len(ds):
                raise DatasetError(
                    f"blend draws {int(used.max()) + 1} samples from dataset {d}, which has only {len(ds)}"
                )

    def _load_or_build(self, cache_dir: str | None):
        if cache_dir:
            description, digest = _cache.describe(self.identifiers)
            base = os.path.join(cache_dir, f"{digest}-BlendedDataset")
            files = (f"{base}-dataset_index.npy", f"{base}-dataset_sample_index.npy")
            desc_file = f"{base}-description.txt"
            if all(os.path.isfile(p) for p in (*files, desc_file)):
                cached = self._load_cached(files)
                if cached is not None:
                    return cached
        built = build_blending_indices(self.weights, self.size)
        if cache_dir:
            try:
                for p, arr in zip(files, built):
                    _cache.atomic_save_npy(p, arr)
                _cache.atomic_write_bytes(desc_file, description.encode("utf-8"))
            except OSError as e:
                raise DatasetError(
                    f"cannot write the blend index cache in {cache_dir} ({e.strerror or e}); "
                    "point --data-cache-path to a writable folder"
                ) from None
        return built

    def _load_cached(self, files) -> tuple | None:
        """The cached indices, or None (rebuilt) when unreadable or not `size` long."""
        try:
            cached = tuple(_cache.load_npy(p) for p in files)
        except (OSError, ValueError, EOFError) as e:
            logger.warning("blend cache %s is unreadable (%s); rebuilding it", files[0], e)
            return None
        if any(a.shape != (self.size,) for a in cached) or (
            self.size and not 0 <= int(cached[0].min()) <= int(cached[0].max()) < len(self.datasets)
        ):
            logger.warning("blend cache %s does not match its description; rebuilding it", files[0])
            return None
        return cached

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> np.ndarray:
        if not 0 <= idx < self.size:
            raise IndexError(f"sample {idx} out of range for a blend of {self.size} samples")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]
