"""GPT sampling: equality with a literal port of Megatron's loops, and the index invariants."""

from __future__ import annotations

import numpy as np
import pytest

from mlm_jax.data.gpt_dataset import (
    DatasetError,
    GPTDataset,
    MockLowLevelDataset,
    build_document_index,
    build_indices,
    build_sample_index,
    build_shuffle_index,
    build_gpt_splits,
    num_epochs_for,
    parse_split,
    split_indices,
    split_matrix,
)
from mlm_jax.data.indexed_dataset import IndexedDataset, write_indexed_dataset

from .conftest import random_documents


def megatron_sample_idx_loop(sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, extra=1):
    """helpers.cpp build_sample_idx (drop_last_partial_sequence=True), line by line."""
    num_samples = (num_epochs * tokens_per_epoch - extra) // seq_length
    out = np.zeros((num_samples + 1, 2), dtype=np.int64)
    sample_idx_index, document_idx_index, doc_offset = 0, 0, 0
    out[0] = (document_idx_index, doc_offset)
    sample_idx_index += 1
    while sample_idx_index <= num_samples:
        remaining = seq_length + extra
        while remaining != 0:
            document_length = int(sizes[doc_idx[document_idx_index]]) - doc_offset
            remaining -= document_length
            if remaining <= 0:
                doc_offset += remaining + document_length - extra
                remaining = 0
            else:
                if document_idx_index == len(doc_idx) - 1:
                    doc_offset = int(sizes[doc_idx[document_idx_index]]) - extra
                    break
                document_idx_index += 1
                doc_offset = 0
        out[sample_idx_index] = (document_idx_index, doc_offset)
        sample_idx_index += 1
    return out


def megatron_document_index(documents, num_epochs, rng, separate_final_epoch):
    """gpt_dataset._build_document_index, as Megatron writes it (mgrid, then int32, then shuffle)."""
    if not separate_final_epoch or num_epochs == 1:
        index = np.mgrid[0:num_epochs, 0 : len(documents)][1]
        index[:] = documents
        index = index.reshape(-1).astype(np.int32)
        rng.shuffle(index)
        return index
    first = megatron_document_index(documents, num_epochs - 1, rng, False)
    last = megatron_document_index(documents, 1, rng, False)
    return np.concatenate((first, last))


def test_sample_index_hand_example():
    # Documents of 3, 5, 2 tokens in that order; seq 3: samples start at tokens 0, 3, 6, 9.
    out = build_sample_index(np.array([3, 5, 2], np.int32), np.array([0, 1, 2], np.int32), 3, 1, 10)
    assert out.tolist() == [[0, 0], [1, 0], [1, 3], [2, 1]]
    assert out.dtype == np.int32


@pytest.mark.parametrize("seed", range(6))
def test_sample_index_equals_megatron_loop(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    sizes = rng.integers(0 if seed % 2 else 1, 40, size=n).astype(np.int32)  # odd seeds: empty docs too
    sizes[0] = max(sizes[0], 2)
    epochs = int(rng.integers(1, 4))
    doc_idx = np.tile(np.arange(n, dtype=np.int32), epochs)
    rng.shuffle(doc_idx)
    tpe = int(sizes.sum())
    for seq in (2, 3, 7, 16, 64):
        if (epochs * tpe - 1) // seq < 1:
            continue
        np.testing.assert_array_equal(
            build_sample_index(sizes, doc_idx, seq, epochs, tpe),
            megatron_sample_idx_loop(sizes, doc_idx, seq, epochs, tpe),
        )


@pytest.mark.parametrize("separate", [False, True])
def test_document_index_equals_megatron(separate):
    docs = np.arange(5, 42, dtype=np.int32)
    ours = build_document_index(docs, 3, np.random.RandomState(7), separate)
    ref = megatron_document_index(docs, 3, np.random.RandomState(7), separate)
    np.testing.assert_array_equal(ours, ref)
    assert ours.dtype == np.int32


def test_shuffle_index_halves():
    s = build_shuffle_index(10, 14, np.random.RandomState(0))
    assert s.dtype == np.uint32
    assert sorted(s[:10].tolist()) == list(range(10)) and sorted(s[10:].tolist()) == list(range(10, 14))


def test_split_parsing_and_matrix():
    v = parse_split("969,30,1")
    assert v == pytest.approx([0.969, 0.030, 0.001])
    m = split_matrix(v)
    assert m[0] == (0.0, v[0]) and m[1][0] == m[0][1] and m[2][1] == pytest.approx(1.0)
    assert split_matrix(parse_split("100,0,0"))[1:] == [None, None]
    assert split_matrix(parse_split("98,2"))[2] is None
    assert split_indices((0.25, 0.75), 10).tolist() == [2, 3, 4, 5, 6, 7]  # round(2.5)=2, round(7.5)=8
    with pytest.raises(DatasetError, match="--split"):
        parse_split("0,0,0")


def test_num_epochs():
    assert num_epochs_for(100, 3, 33) == 1  # 3*33+1 = 100 tokens
    assert num_epochs_for(100, 4, 33) == 2
    assert num_epochs_for(100, None, 33) == 1


def flat_stream(sizes, document_index, get):
    return np.concatenate([get(int(d)) for d in document_index])


@pytest.fixture
def small_dataset(tmp_path):
    return write_indexed_dataset(str(tmp_path / "d"), random_documents(40, seed=3), dtype=np.uint16)


def test_samples_tile_the_token_stream(small_dataset):
    """Unshuffled, sample k is tokens [k*S, k*S + S] of the shuffled-document stream: every
    token is used, samples cross document boundaries, overlapping by exactly one token."""
    low = IndexedDataset(small_dataset)
    seq = 16
    ds = GPTDataset(low, np.arange(len(low), dtype=np.int32), None, seq, seed=5)
    stream = flat_stream(low.sequence_lengths, ds.document_index, low.get)
    inverse = np.argsort(ds.shuffle_index)
    n = len(ds)
    assert n == (len(stream) - 1) // seq
    for k in range(n):
        np.testing.assert_array_equal(ds[int(inverse[k])], stream[k * seq : k * seq + seq + 1])
    assert sorted(np.asarray(ds.shuffle_index).tolist()) == list(range(n))
    assert sorted(np.asarray(ds.document_index).tolist()) == list(range(len(low)))  # one epoch


def test_epochs_and_separate_final_epoch(small_dataset):
    low = IndexedDataset(small_dataset)
    docs = np.arange(len(low), dtype=np.int32)
    seq = 16
    per_epoch = (int(low.sequence_lengths.sum()) - 1) // seq
    # Two epochs plus a sliver of a third: the final epoch is shuffled separately.
    want = 2 * per_epoch + 3
    d_idx, s_idx, sh_idx = build_indices(low.sequence_lengths, docs, want, seq, seed=1)
    assert len(d_idx) == 3 * len(docs)
    np.testing.assert_array_equal(d_idx, megatron_document_index(docs, 3, np.random.RandomState(1), True))
    assert sorted(d_idx[2 * len(docs) :].tolist()) == docs.tolist()  # last epoch alone
    sans_final = (2 * int(low.sequence_lengths.sum()) - 1) // seq
    assert set(sh_idx[:sans_final].tolist()) == set(range(sans_final))
    assert set(sh_idx[sans_final:].tolist()) == set(range(sans_final, len(s_idx) - 1))
    # Most of a third epoch wanted: everything is shuffled together.
    d_idx, _, sh_idx = build_indices(low.sequence_lengths, docs, 2 * per_epoch + int(0.9 * per_epoch), seq, 1)
    np.testing.assert_array_equal(d_idx, megatron_document_index(docs, 3, np.random.RandomState(1), False))
    assert len(sh_idx) >= 2 * per_epoch + int(0.9 * per_epoch)


def test_gpt_dataset_is_deterministic_and_cached(small_dataset, tmp_path):
    low = IndexedDataset(small_dataset)
    docs = np.arange(len(low), dtype=np.int32)
    a = GPTDataset(low, docs, 100, 8, seed=3, cache_dir=str(tmp_path / "c"))
    b = GPTDataset(low, docs, 100, 8, seed=3, cache_dir=str(tmp_path / "c"))
    assert a.built_anew and not b.built_anew
    assert len(a) >= 100
    for i in (0, 1, 57, 99):
        np.testing.assert_array_equal(a[i], b[i])
        assert a[i].dtype == np.int64 and a[i].shape == (9,)
    c = GPTDataset(low, docs, 100, 8, seed=4, cache_dir=str(tmp_path / "c"))
    assert c.built_anew
    assert any(not np.array_equal(a[i], c[i]) for i in range(20))


def test_build_splits_partition_documents(small_dataset, tmp_path):
    splits = build_gpt_splits(small_dataset, split_matrix(parse_split("80,15,5")), [10, 5, 5], 8, 1,
                              data_cache_path=str(tmp_path / "c"))
    used = [set(np.unique(np.asarray(s.document_index)).tolist()) for s in splits]
    assert used[0] == set(range(0, 32)) and used[1] == set(range(32, 38)) and used[2] == set(range(38, 40))
    assert len(splits[0]) >= 10


def test_empty_split_is_an_error(small_dataset):
    with pytest.raises(DatasetError, match="valid split .* has no documents"):
        build_gpt_splits(small_dataset, split_matrix(parse_split("999,1,0")), [1, 1, 1], 8, 1)


def test_mock_low_level_matches_megatron():
    low = MockLowLevelDataset(eod=50000)
    expected_lengths = np.random.default_rng(0).integers(1, 4096, size=100000, dtype=np.int32)
    np.testing.assert_array_equal(low.sequence_lengths, expected_lengths)
    n = int(low.sequence_lengths[7])
    doc = low.get(7)
    assert doc.tolist() == list(range(1, n)) + [50000]
    assert low.get(7, 2, 3).tolist() == doc[2:5].tolist()
    small = MockLowLevelDataset(eod=10)
    assert small.get(7).max() == 10 and small.get(7)[:-1].max() <= 9
