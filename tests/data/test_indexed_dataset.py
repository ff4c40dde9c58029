"""The MMIDIDX .bin/.idx format: golden bytes, independent bytes, round trips, every bad input."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest

from mlm_jax.data.indexed_dataset import (
    DTYPE_CODES,
    IndexedDataset,
    IndexedDatasetBuilder,
    IndexedDatasetError,
    optimal_dtype,
    write_indexed_dataset,
)


def hand_idx(code: int, lengths, pointers, docs, magic=b"MMIDIDX\x00\x00", version=1) -> bytes:
    """An .idx written from the format description alone, with struct."""
    out = magic + struct.pack("<Q", version) + struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(docs))
    out += struct.pack(f"<{len(lengths)}i", *lengths)
    out += struct.pack(f"<{len(pointers)}q", *pointers)
    out += struct.pack(f"<{len(docs)}q", *docs)
    return out


def write_pair(prefix, idx: bytes, bin_: bytes) -> str:
    with open(f"{prefix}.idx", "wb") as f:
        f.write(idx)
    with open(f"{prefix}.bin", "wb") as f:
        f.write(bin_)
    return str(prefix)


def test_writer_matches_golden_bytes(tmp_path):
    prefix = write_indexed_dataset(str(tmp_path / "d"), [[1, 2, 3], [4, 5], [65535]], dtype=np.uint16)
    golden_idx = hand_idx(8, [3, 2, 1], [0, 6, 10], [0, 1, 2, 3])
    assert open(prefix + ".idx", "rb").read() == golden_idx
    assert len(golden_idx) == 34 + 3 * 4 + 3 * 8 + 4 * 8
    assert open(prefix + ".bin", "rb").read() == struct.pack("<6H", 1, 2, 3, 4, 5, 65535)


def test_reads_independently_written_bytes(tmp_path):
    # int32 tokens; document 0 has two sequences (Megatron allows sentence-level splits).
    tokens = [[10, 11, 12], [13], [-7, 2**31 - 1]]
    bin_ = b"".join(struct.pack(f"<{len(t)}i", *t) for t in tokens)
    idx = hand_idx(4, [3, 1, 2], [0, 12, 16], [0, 2, 3])
    ds = IndexedDataset(write_pair(tmp_path / "x", idx, bin_))
    assert len(ds) == 3 and ds.num_documents == 2
    assert ds.dtype == np.int32
    assert ds.sequence_lengths.tolist() == [3, 1, 2]
    assert ds.document_indices.tolist() == [0, 2, 3]
    for i, t in enumerate(tokens):
        assert ds[i].tolist() == t
    assert ds.get(0, offset=1, length=2).tolist() == [11, 12]
    assert ds.get(2, offset=1).tolist() == [2**31 - 1]
    with pytest.raises(IndexError):
        ds[3]
    with pytest.raises(IndexError):
        ds.get(0, offset=2, length=2)


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_round_trip_every_dtype(tmp_path, code):
    dtype = np.dtype(DTYPE_CODES[code])
    rng = np.random.default_rng(code)
    docs = [rng.integers(0, 100, size=n).astype(dtype) for n in (5, 1, 17, 3)]
    prefix = write_indexed_dataset(str(tmp_path / "d"), docs, dtype=dtype)
    assert open(prefix + ".idx", "rb").read()[17] == code
    ds = IndexedDataset(prefix)
    assert ds.dtype == dtype
    for a, b in zip(docs, (ds[i] for i in range(len(ds)))):
        np.testing.assert_array_equal(a, b)


def test_builder_multi_sequence_documents_and_empty_documents(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    b.add_document([1, 2, 3, 4], lengths=[1, 3])
    b.add_item([5, 6])
    b.add_item([7])
    b.end_document()
    b.add_document([])  # Megatron writes an empty text as a document with no sequence
    b.add_documents([8, 9, 10], [2, 0, 1])
    b.finalize(str(tmp_path / "d.idx"))
    ds = IndexedDataset(str(tmp_path / "d"))
    assert ds.sequence_lengths.tolist() == [1, 3, 2, 1, 2, 1]
    assert ds.document_indices.tolist() == [0, 2, 4, 4, 5, 5, 6]
    assert [ds[i].tolist() for i in range(len(ds))] == [[1], [2, 3, 4], [5, 6], [7], [8, 9], [10]]


def test_builder_rejects_tokens_outside_dtype(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "d.bin"), np.uint16)
    with pytest.raises(IndexedDatasetError, match="do not fit the dataset dtype uint16"):
        b.add_document(np.array([1, 70000]))


def test_optimal_dtype_threshold():
    assert optimal_dtype(65499) == np.uint16
    assert optimal_dtype(65500) == np.int32
    assert optimal_dtype(None) == np.int32


def test_empty_dataset(tmp_path):
    ds = IndexedDataset(write_pair(tmp_path / "e", hand_idx(8, [], [], [0]), b""))
    assert len(ds) == 0 and ds.num_documents == 0


# ---------------------------------------------------------------- bad inputs


@pytest.fixture
def good(tmp_path):
    idx = hand_idx(8, [2, 3], [0, 4], [0, 1, 2])
    bin_ = struct.pack("<5H", 1, 2, 3, 4, 5)
    return tmp_path, idx, bin_


def expect_error(prefix, exc, *fragments):
    with pytest.raises(exc) as info:
        IndexedDataset(str(prefix))
    msg = str(info.value)
    for frag in fragments:
        assert frag in msg, (frag, msg)


def test_good_fixture_reads(good):
    tmp, idx, bin_ = good
    assert IndexedDataset(write_pair(tmp / "g", idx, bin_))[1].tolist() == [3, 4, 5]


def test_missing_idx(good):
    tmp, idx, bin_ = good
    write_pair(tmp / "m", idx, bin_)
    os.unlink(tmp / "m.idx")
    expect_error(tmp / "m", FileNotFoundError, str(tmp / "m.idx"), "missing")


def test_missing_bin(good):
    tmp, idx, bin_ = good
    write_pair(tmp / "m", idx, bin_)
    os.unlink(tmp / "m.bin")
    expect_error(tmp / "m", FileNotFoundError, str(tmp / "m.bin"), "missing")


def test_bad_magic(good):
    tmp, idx, bin_ = good
    write_pair(tmp / "b", b"NOTMMIDX\x00" + idx[9:], bin_)
    expect_error(tmp / "b", IndexedDatasetError, str(tmp / "b.idx"), "bad magic")


def test_bad_version(good):
    tmp, idx, bin_ = good
    write_pair(tmp / "b", idx[:9] + struct.pack("<Q", 2) + idx[17:], bin_)
    expect_error(tmp / "b", IndexedDatasetError, str(tmp / "b.idx"), "unsupported version 2")


@pytest.mark.parametrize("code", [0, 9, 255])
def test_bad_dtype_code(good, code):
    tmp, idx, bin_ = good
    write_pair(tmp / "b", idx[:17] + bytes([code]) + idx[18:], bin_)
    expect_error(tmp / "b", IndexedDatasetError, str(tmp / "b.idx"), f"bad dtype code {code}")


@pytest.mark.parametrize("cut", [1, 8, 30])
def test_truncated_idx(good, cut):
    tmp, idx, bin_ = good
    write_pair(tmp / "t", idx[:-cut], bin_)
    expect_error(tmp / "t", IndexedDatasetError, str(tmp / "t.idx"), "truncated index")


def test_truncated_header(good):
    tmp, idx, bin_ = good
    write_pair(tmp / "t", idx[:20], bin_)
    expect_error(tmp / "t", IndexedDatasetError, str(tmp / "t.idx"), "truncated header")


def test_trailing_bytes_in_idx(good):
    tmp, idx, bin_ = good
    write_pair(tmp / "t", idx + b"\x00" * 5, bin_)
    expect_error(tmp / "t", IndexedDatasetError, str(tmp / "t.idx"), "unexpected trailing bytes")


def test_multimodal_modes_are_accepted(good):
    tmp, idx, bin_ = good
    ds = IndexedDataset(write_pair(tmp / "mm", idx + b"\x00\x01", bin_))  # one int8 mode per sequence
    assert ds[0].tolist() == [1, 2]


@pytest.mark.parametrize("delta", [-2, 2])
def test_bin_size_mismatch(good, delta):
    tmp, idx, bin_ = good
    bad = bin_[:delta] if delta < 0 else bin_ + b"\x00" * delta
    write_pair(tmp / "s", idx, bad)
    expect_error(tmp / "s", IndexedDatasetError, str(tmp / "s.bin"), f"size {len(bad)} bytes",
                 "10 bytes", "truncated or mismatched")


def test_inconsistent_pointer(good):
    tmp, _, bin_ = good
    write_pair(tmp / "p", hand_idx(8, [2, 3], [0, 6], [0, 1, 2]), bin_)
    expect_error(tmp / "p", IndexedDatasetError, str(tmp / "p.idx"), "sequence pointer 1 is 6")


def test_bad_document_indices(good):
    tmp, _, bin_ = good
    write_pair(tmp / "d", hand_idx(8, [2, 3], [0, 4], [0, 1, 3]), bin_)
    expect_error(tmp / "d", IndexedDatasetError, str(tmp / "d.idx"), "end at the sequence count 2")
