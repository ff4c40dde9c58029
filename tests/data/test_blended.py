"""Blending (Megatron's greedy rule) and `build_datasets` for every way of naming data."""

from __future__ import annotations

import math

import numpy as np
import pytest

from mlm_jax.config import DataConfig
from mlm_jax.data.blended import BlendedDataset, build_blending_indices
from mlm_jax.data.builder import build_datasets, build_split, megatron_num_samples, parse_blend
from mlm_jax.data.gpt_dataset import DatasetError, GPTDataset
from mlm_jax.data.indexed_dataset import write_indexed_dataset

from .conftest import random_documents


def test_blending_hand_examples():
    d, s = build_blending_indices([0.5, 0.5], 4)
    assert d.tolist() == [0, 1, 0, 1] and s.tolist() == [0, 0, 1, 1]
    d, s = build_blending_indices([0.25, 0.75], 8)
    assert d.tolist() == [1, 0, 1, 1, 0, 1, 1, 1]
    assert s.tolist() == [0, 0, 1, 2, 1, 3, 4, 5]
    assert d.dtype == np.int16 and s.dtype == np.int64


def test_blending_stays_within_one_sample_of_every_share():
    w = np.array([0.07, 0.5, 0.13, 0.3])
    d, s = build_blending_indices(w.tolist(), 5000)
    counts = np.zeros(4)
    for k in range(5000):
        assert np.all(np.abs(counts - w * max(k, 1)) <= 1.0 + 1e-9)
        assert s[k] == counts[d[k]]  # each dataset's samples are taken in order
        counts[d[k]] += 1
    np.testing.assert_allclose(counts / 5000, w, atol=1e-3)


def test_parse_blend():
    assert parse_blend(["0.3", "a", "0.7", "b"]) == (["a", "b"], [0.3, 0.7])
    assert parse_blend(["a", "b"]) == (["a", "b"], None)
    assert parse_blend(["a"]) == (["a"], None)
    with pytest.raises(DatasetError, match="looks like a weight"):
        parse_blend(["0.3", "a", "b"])


@pytest.fixture
def two_datasets(tmp_path):
    a = write_indexed_dataset(str(tmp_path / "a"), random_documents(60, seed=1, vocab=500), np.uint16)
    b = write_indexed_dataset(str(tmp_path / "b"), [d + 500 for d in random_documents(90, seed=2, vocab=500)],
                              np.uint16)
    return a, b


def cfg(**kw) -> DataConfig:
    return DataConfig(tokenizer_type="NullTokenizer", **kw)


def test_weighted_blend_follows_megatron_sizes_and_shares(two_datasets, tmp_path):
    a, b = two_datasets
    data = build_datasets(cfg(data_path=("0.3", a, "0.7", b), split="90,10,0",
                              data_cache_path=str(tmp_path / "c")), 8, 1234, (101, 11, 0), vocab_size=1000)
    train = data.train
    assert isinstance(train, BlendedDataset)
    assert len(train) == math.ceil(101 * 0.3) + math.ceil(101 * 0.7)
    for mid, w in zip(train.datasets, (0.3, 0.7)):
        assert isinstance(mid, GPTDataset)
        assert mid.num_samples == math.ceil(math.ceil(101 * w) * 1.005)
    from_a = sum(bool(train[i].max() < 500) for i in range(len(train)))
    assert abs(from_a - 0.3 * len(train)) <= 1
    for i in (0, 5, 50):
        d, j = int(train.dataset_index[i]), int(train.dataset_sample_index[i])
        np.testing.assert_array_equal(train[i], train.datasets[d][j])
    assert data.test is None  # split 90,10,0
    assert data.tokenizer.eod == 1000


def test_unweighted_blend_uses_dataset_sizes(two_datasets):
    a, b = two_datasets
    data = build_datasets(cfg(data_path=(a, b), split="1,0,0"), 8, 1, (50, 0, 0), vocab_size=1000)
    train = data.train
    lengths = [len(m) for m in train.datasets]
    assert len(train) == min(50, sum(lengths))
    assert train.weights == pytest.approx(np.array(lengths) / sum(lengths))
    assert data.valid is None and data.test is None


def test_single_prefix_is_a_plain_gpt_dataset(two_datasets):
    a, _ = two_datasets
    data = build_datasets(cfg(data_path=(a,), split="8,1,1"), 8, 1, (20, 5, 5), vocab_size=1000)
    assert all(isinstance(s, GPTDataset) for s in data)
    assert len(data.train) >= 20


def test_per_split_paths(two_datasets):
    a, b = two_datasets
    data = build_datasets(cfg(train_data_path=(a,), valid_data_path=("1", a, "2", b)), 8, 1, (20, 9, 0),
                          vocab_size=1000)
    assert isinstance(data.train, GPTDataset) and isinstance(data.valid, BlendedDataset)
    assert data.test is None
    # The whole of `a` is the train split: every document appears.
    assert set(np.asarray(data.train.document_index).tolist()) == set(range(60))
    assert len(data.valid) == 3 + 6


def test_mock_data_without_tokenizer():
    data = build_datasets(DataConfig(mock_data=True), 512, 1, (10, 4, 4), vocab_size=8192)
    assert data.tokenizer.vocab_size == 8192 and data.tokenizer.eod == 8191
    s = data.train[0]
    assert s.shape == (513,) and s.max() <= 8191
    again = build_datasets(DataConfig(mock_data=True), 512, 1, (10, 4, 4), vocab_size=8192)
    np.testing.assert_array_equal(again.train[3], data.train[3])


def test_data_path_needs_a_tokenizer(two_datasets):
    a, _ = two_datasets
    with pytest.raises(DatasetError, match="--tokenizer-type"):
        build_datasets(DataConfig(data_path=(a,)), 8, 1, (1, 1, 1))


def test_build_split_train_only(two_datasets):
    a, _ = two_datasets
    ds, tok = build_split(DataConfig(data_path=(a,)), "train", 8, 1, 30, tokenizer_optional=True)
    assert tok is None and len(ds) >= 30


def test_megatron_num_samples():
    assert megatron_num_samples(300, 16, 100, 10) == (4800, 640, 160)
