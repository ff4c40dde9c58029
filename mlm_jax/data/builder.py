"""`build_datasets`: the train/valid/test datasets and tokenizer a run asks for.

Mirrors Megatron-LM's `BlendedMegatronDatasetBuilder`:

* `--data-path a` (one prefix, no weight): one GPTDataset per split of `a`, with `--split`.
* `--data-path 0.3 a 0.7 b`: per split, each prefix's GPTDataset asks for
  `ceil(ceil(n * w) * 1.005)` samples, and a BlendedDataset of `sum(ceil(n * w))` samples
  draws from them by weight.
* `--data-path a b` (no weights): each prefix gives one epoch per split, blended by size
  (weights = dataset lengths), `min(n, total)` samples.
* `--train-data-path/--valid-data-path/--test-data-path`: each split from its own blend
  (no `--split`); a single prefix there is used directly even with a weight.
* `--mock-data`: Megatron's synthetic documents (split 1,1,1), no files.
* none of these: the default corpus (the Python stdlib, see `default_corpus`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from mlm_jax.data.blended import MID_LEVEL_SURPLUS, BlendedDataset, normalize, sizes_per_dataset
from mlm_jax.data.gpt_dataset import (
    SPLIT_NAMES,
    DatasetError,
    build_gpt_splits,
    index_cache_dir,
    parse_split,
    split_matrix,
)
from mlm_jax.data.tokenizers import NullTokenizer, build_tokenizer
from mlm_jax.errors import ConfigError


@dataclasses.dataclass
class Datasets:
    """Each split supports `len()` and `ds[i] -> int64 [seq_length + 1]`; valid/test may be None."""

    train: object | None
    valid: object | None
    test: object | None
    tokenizer: object

    def __iter__(self):
        return iter((self.train, self.valid, self.test))


def megatron_num_samples(train_iters: int, global_batch_size: int, eval_interval: int, eval_iters: int) -> tuple[int, int, int]:
    """Megatron's `train_valid_test_num_samples`: (train, valid, test) sample counts."""
    evals = (train_iters // eval_interval + 1) * eval_iters
    return train_iters * global_batch_size, evals * global_batch_size, eval_iters * global_batch_size


def parse_blend(paths: Sequence[str]) -> tuple[list[str], list[float] | None]:
    """Megatron's `get_blend_from_list`: `[w1, p1, w2, p2, ...]` or `[p1, p2, ...]`."""
    paths = [str(p) for p in paths]
    if not paths:
        raise DatasetError("empty data path")
    if len(paths) % 2 == 0:
        weights = []
        for w in paths[0::2]:
            try:
                weights.append(float(w))
            except ValueError:
                weights = None
                break
        if weights is not None:
            prefixes = [p.strip() for p in paths[1::2]]
            if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
                raise DatasetError(f"data path weights {weights} must be finite, non-negative and not all zero")
            return prefixes, weights
    for p in paths:
        try:
            float(p)
        except ValueError:
            continue
        raise DatasetError(
            f"data path {paths}: {p!r} looks like a weight, but weights must come one before every "
            "prefix (`0.3 a 0.7 b`) or not at all (`a b`)"
        )
    return [p.strip() for p in paths], None


def _blend_split(prefixes, weights, split, sizes, i, seq_length, seed, cache_path, vocab=None):
    """Megatron's blended branch for split i, given every prefix's mid-level datasets."""
    only_i = [split[j] if j == i else None for j in range(3)]
    if weights is not None:
        if sizes[i] is None:
            raise DatasetError(f"weighted data paths need a sample count for the {SPLIT_NAMES[i]} split")
        weights = normalize(weights)
        buffer = sizes_per_dataset(weights, sizes[i], MID_LEVEL_SURPLUS)
        target = sizes_per_dataset(weights, sizes[i])
        mid_sizes = [[buffer[k] if j == i else None for j in range(3)] for k in range(len(prefixes))]
    else:
        mid_sizes = [[None, None, None] for _ in prefixes]
    mids = [
        build_gpt_splits(p, only_i, mid_sizes[k], seq_length, seed, cache_path, vocab=vocab)[i]
        for k, p in enumerate(prefixes)
    ]
    if weights is not None:
        size = sum(target)
        blend_weights = weights
    else:
        blend_weights = [len(m) for m in mids]
        size = sum(blend_weights) if sizes[i] is None else min(sizes[i], sum(blend_weights))
    cache_dir = cache_path or index_cache_dir(prefixes[0], None)
    return BlendedDataset(mids, blend_weights, size, cache_dir)


def _vocab_rule(tokenizer):
    """(the model's true vocab size, where it comes from): the bound every token id must stay
    below, since train.py sizes the model by the tokenizer. None without a tokenizer (only
    when inspecting ids: training on files always has one)."""
    if tokenizer is None:
        return None
    kind = getattr(tokenizer, "tokenizer_type", type(tokenizer).__name__)
    if kind == "NullTokenizer":
        return tokenizer.vocab_size, f"--vocab-size {tokenizer.vocab_size - 1} of NullTokenizer plus its EOD"
    return tokenizer.vocab_size, f"the vocab of --tokenizer-type {kind}"


def _check_paths(data_cfg) -> None:
    paths = {"--data-path": data_cfg.data_path, "--train-data-path": data_cfg.train_data_path,
             "--valid-data-path": data_cfg.valid_data_path, "--test-data-path": data_cfg.test_data_path}
    given = [flag for flag, value in paths.items() if value]
    if data_cfg.mock_data and given:
        # Megatron lets --mock-data win and never reads the path; here that silence is refused.
        raise ConfigError(f"--mock-data with {given[0]}: give one; --mock-data trains on synthetic tokens and "
                          f"would ignore {given[0]} (drop --mock-data to train on the data, or drop {given[0]})")
    if data_cfg.data_path and (data_cfg.train_data_path or data_cfg.valid_data_path or data_cfg.test_data_path):
        raise DatasetError("--data-path cannot be combined with --train/valid/test-data-path")


def _tokenizer(data_cfg, vocab_size, optional=False):
    if data_cfg.tokenizer_type is not None:
        return build_tokenizer(data_cfg, vocab_size)
    if data_cfg.mock_data:
        if vocab_size is None:
            raise DatasetError("mock data without --tokenizer-type needs a vocab size")
        return NullTokenizer(vocab_size - 1)
    if data_cfg.uses_default_corpus:
        from mlm_jax.data.default_corpus import own_tokenizer

        return own_tokenizer()
    if optional:
        return None
    raise DatasetError("--data-path/--train-data-path need --tokenizer-type (and its files) to know the EOD token")


def run_tokenizer(data_cfg, vocab_size: int | None = None):
    """The tokenizer that `build_datasets` reads `data_cfg`'s data with, built on its own: a run
    learns its model's true vocab size from it before it finalizes its config, then passes it to
    `build_datasets` (`tokenizer=`). `vocab_size`: NullTokenizer's `--vocab-size`, and the vocab
    of mock data without a tokenizer type (NullTokenizer(vocab_size - 1), EOD = vocab_size - 1).
    The default corpus's own tokenizer is trained on first use (the corpus is built later)."""
    _check_paths(data_cfg)
    return _tokenizer(data_cfg, vocab_size)


def build_datasets(
    data_cfg,
    seq_length: int,
    seed: int,
    num_samples: Sequence[int | None] = (None, None, None),
    vocab_size: int | None = None,
    tokenizer_optional: bool = False,
    tokenizer=None,
    wanted: tuple[bool, bool, bool] = (True, True, True),
) -> Datasets:
    """Build the (train, valid, test) datasets and the tokenizer of `data_cfg` (a `DataConfig`).
    `wanted`: which of the three to build (None where not: training never reads the test split,
    so a small corpus whose 1 % test share holds no document still trains).

    `num_samples`: samples each split must provide (`megatron_num_samples`); a split given 0
    or None still gets one epoch. `vocab_size`: NullTokenizer's `--vocab-size`, and the vocab
    of mock data without a tokenizer type (then EOD = vocab_size - 1). `tokenizer_optional`:
    read --data-path data without a tokenizer (tokenizer None; for inspecting token ids).
    `tokenizer`: `data_cfg`'s tokenizer already built (`run_tokenizer`), used instead of building
    it again. Every dataset's token ids must lie below the model's vocab (the tokenizer's): checked
    once per .bin (`vocab_check`), a `VocabularyError` naming it if not.
    """
    return _build(data_cfg, seq_length, seed, num_samples, vocab_size, tokenizer_optional, wanted, tokenizer)


def _build(data_cfg, seq_length, seed, num_samples, vocab_size, tokenizer_optional, wanted, tokenizer=None) -> Datasets:
    sizes = list(num_samples)
    if len(sizes) != 3:
        raise DatasetError(f"num_samples must be (train, valid, test), got {num_samples}")
    cache_path = data_cfg.data_cache_path
    _check_paths(data_cfg)
    if tokenizer is None:
        tokenizer = _tokenizer(data_cfg, vocab_size, tokenizer_optional)

    if data_cfg.mock_data:
        split = _mask(split_matrix(parse_split("1,1,1")), wanted)
        splits = build_gpt_splits(None, split, sizes, seq_length, seed, mock_eod=tokenizer.eod,
                                  vocab=(tokenizer.vocab_size, "the tokenizer"))
        return Datasets(*splits, tokenizer)

    if data_cfg.uses_default_corpus:
        from mlm_jax.data.default_corpus import build_default_corpus

        # Without --tokenizer-type the corpus is read with its own tokenizer (and cached as such).
        prefix, _ = build_default_corpus(tokenizer=tokenizer if data_cfg.tokenizer_type else None)
        split = _mask(split_matrix(parse_split(data_cfg.split)), wanted)
        vocab = _vocab_rule(tokenizer)
        return Datasets(*build_gpt_splits(prefix, split, sizes, seq_length, seed, cache_path, vocab=vocab), tokenizer)

    vocab = _vocab_rule(tokenizer)
    if data_cfg.data_path:
        prefixes, weights = parse_blend(data_cfg.data_path)
        split = _mask(split_matrix(parse_split(data_cfg.split)), wanted)
        if len(prefixes) == 1 and weights is None:
            return Datasets(*build_gpt_splits(prefixes[0], split, sizes, seq_length, seed, cache_path, vocab=vocab),
                            tokenizer)
        out = [
            _blend_split(prefixes, weights, split, sizes, i, seq_length, seed, cache_path, vocab)
            if split[i] is not None else None
            for i in range(3)
        ]
        return Datasets(*out, tokenizer)

    out = []
    for i, paths in enumerate((data_cfg.train_data_path, data_cfg.valid_data_path, data_cfg.test_data_path)):
        if not paths or not wanted[i]:
            out.append(None)
            continue
        prefixes, weights = parse_blend(paths)
        spoof_split = [None, None, None]
        spoof_split[i] = (0.0, 1.0)
        spoof_sizes = [0, 0, 0]
        spoof_sizes[i] = sizes[i]
        if len(prefixes) == 1:
            out.append(build_gpt_splits(prefixes[0], spoof_split, spoof_sizes, seq_length, seed, cache_path,
                                        vocab=vocab)[i])
        else:
            out.append(_blend_split(prefixes, weights, spoof_split, spoof_sizes, i, seq_length, seed, cache_path,
                                    vocab))
    return Datasets(*out, tokenizer)


def _mask(split, wanted):
    return [s if w else None for s, w in zip(split, wanted)]


def build_split(data_cfg, split_name: str, seq_length: int, seed: int, num_samples: int | None,
                vocab_size: int | None = None, tokenizer_optional: bool = False):
    """One split only (e.g. for inspecting the train order): (dataset, tokenizer)."""
    i = SPLIT_NAMES.index(split_name)
    sizes = [0, 0, 0]
    sizes[i] = num_samples
    wanted = tuple(j == i for j in range(3))
    ds = _build(data_cfg, seq_length, seed, sizes, vocab_size, tokenizer_optional, wanted)
    return list(ds)[i], ds.tokenizer
