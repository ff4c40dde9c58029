"""Megatron-LM's memory-mapped indexed dataset (the `MMIDIDX` .bin/.idx pair).

A dataset is two files sharing a prefix:

* `<prefix>.bin`: every sequence's tokens back to back, in one numeric dtype, no header.
* `<prefix>.idx`, little-endian throughout:

  ====================  ==========================================================
  9 bytes               magic `b"MMIDIDX\\x00\\x00"`
  uint64                version, always 1
  uint8                 dtype code (`DTYPE_CODES`)
  uint64                sequence count S
  uint64                document count D (= number of documents + 1)
  int32[S]              sequence lengths, in tokens
  int64[S]              byte offset of each sequence in the .bin
  int64[D]              document indices: 0, then the sequence count after each document
  (int8[S])             optional per-sequence modes (Megatron's multimodal files; ignored)
  ====================  ==========================================================

For GPT data every document is one sequence, so sequences and documents coincide.
Files written here are byte-identical to Megatron-LM's `IndexedDatasetBuilder` output, and
Megatron's files read here unchanged.
"""

from __future__ import annotations

import contextlib
import os
import struct
from typing import Iterable, Sequence

import numpy as np

from mlm_jax.errors import UsageError
from mlm_jax.paths import naming

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8  # 34

# Megatron's DType enum: the code stored in the .idx for the token dtype of the .bin.
DTYPE_CODES: dict[int, type] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


class IndexedDatasetError(UsageError):
    """A .bin/.idx pair that cannot be read; the message names the file and what is wrong."""


class MissingDatasetError(IndexedDatasetError, FileNotFoundError):
    """A dataset prefix whose .bin or .idx does not exist (still a `FileNotFoundError`)."""


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def optimal_dtype(vocab_size: int | None) -> type:
    """Megatron's rule: uint16 tokens when the vocab has fewer than 65500 entries, else int32."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def dtype_code(dtype) -> int:
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        valid = ", ".join(np.dtype(t).name for t in DTYPE_CODES.values())
        raise IndexedDatasetError(f"dtype {np.dtype(dtype).name} has no Megatron code; use one of {valid}")


def exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def encode_index(sequence_lengths, document_indices, dtype) -> bytes:
    """The complete .idx file contents for these sequences (pointers are derived from lengths)."""
    lengths = np.asarray(sequence_lengths, dtype=np.int64)
    if lengths.size and lengths.min() < 0:
        raise IndexedDatasetError("sequence lengths must be non-negative")
    if lengths.size and lengths.max() > np.iinfo(np.int32).max:
        raise IndexedDatasetError("a sequence longer than 2^31-1 tokens does not fit the int32 length field")
    itemsize = np.dtype(dtype).itemsize
    pointers = np.zeros(lengths.size, dtype=np.int64)
    if lengths.size > 1:
        np.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
    docs = np.asarray(document_indices, dtype=np.int64)
    header = MAGIC + struct.pack("<Q", VERSION) + struct.pack("<B", dtype_code(dtype))
    header += struct.pack("<Q", lengths.size) + struct.pack("<Q", docs.size)
    return b"".join(
        [header, lengths.astype("<i4").tobytes(), pointers.astype("<i8").tobytes(), docs.astype("<i8").tobytes()]
    )


def _read_index_header(ipath: str) -> tuple[np.dtype, int, int]:
    """(token dtype, sequence count, document-index count) from an .idx header, after checking the
    magic, version, dtype code and that the file size matches those counts exactly."""
    try:
        idx_size = os.path.getsize(ipath)
        with open(ipath, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError as e:
        raise IndexedDatasetError(f"{ipath}: cannot read ({e.strerror or e})") from None
    if len(head) < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
        raise IndexedDatasetError(
            f"{ipath}: bad magic {head[: len(MAGIC)]!r}, expected {MAGIC!r}; "
            "this is not a Megatron MMIDIDX index file"
        )
    if len(head) < HEADER_BYTES:
        raise IndexedDatasetError(
            f"{ipath}: truncated header ({len(head)} bytes, need {HEADER_BYTES})"
        )
    (version,) = struct.unpack("<Q", head[9:17])
    if version != VERSION:
        raise IndexedDatasetError(f"{ipath}: unsupported version {version}, expected {VERSION}")
    code = head[17]
    if code not in DTYPE_CODES:
        raise IndexedDatasetError(
            f"{ipath}: bad dtype code {code}; valid codes are "
            + ", ".join(f"{c} ({np.dtype(t).name})" for c, t in DTYPE_CODES.items())
        )
    dtype = np.dtype(DTYPE_CODES[code])
    seq_count, doc_count = struct.unpack("<QQ", head[18:34])
    expected = HEADER_BYTES + seq_count * (4 + 8) + doc_count * 8
    if idx_size < expected:
        raise IndexedDatasetError(
            f"{ipath}: truncated index: {idx_size} bytes, but the header's {seq_count} sequences "
            f"and {doc_count} document indices need {expected} bytes"
        )
    if idx_size not in (expected, expected + seq_count):  # + seq_count: multimodal modes
        raise IndexedDatasetError(
            f"{ipath}: {idx_size - expected} unexpected trailing bytes after the document indices "
            f"(expected {expected} bytes for {seq_count} sequences and {doc_count} document indices)"
        )
    return dtype, seq_count, doc_count


class IndexedDataset:
    """Read-only, memory-mapped view of a Megatron indexed dataset.

    `len(ds)` is the sequence count; `ds[i]` is sequence i as a read-only numpy array in the
    file's dtype; `ds.get(i, offset, length)` reads part of one. Every structural problem is an
    `IndexedDatasetError` (missing files: `FileNotFoundError`) naming the file.
    """

    def __init__(self, prefix: str):
        self.path_prefix = prefix
        ipath, bpath = idx_path(prefix), bin_path(prefix)
        odd = [p for p in (ipath, bpath) if os.path.exists(p) and not os.path.isfile(p)]
        if odd:  # a folder, a device, a pipe (a link to /dev/zero is no dataset)
            kind = "a folder" if os.path.isdir(odd[0]) else "not a regular file"
            raise IndexedDatasetError(f"indexed dataset {prefix!r}: {odd[0]} is {kind} "
                                      f"({os.path.realpath(odd[0])}); a dataset is a .bin/.idx pair of files")
        missing = [p for p in (ipath, bpath) if not os.path.isfile(p)]
        if missing:
            raise MissingDatasetError(
                f"indexed dataset {prefix!r}: missing {' and '.join(missing)} "
                "(a dataset is a .bin/.idx pair; pass the path without the extension)"
            )
        self.dtype, seq_count, doc_count = _read_index_header(ipath)
        self._map_index(ipath, seq_count, doc_count)
        self._map_bin(bpath, ipath)

    def _map_index(self, ipath: str, seq_count: int, doc_count: int) -> None:
        """Map the index's three arrays (after the header) and check them against each other."""
        self._idx_mmap = np.memmap(ipath, mode="r", dtype=np.uint8)
        off = HEADER_BYTES
        self.sequence_lengths = np.frombuffer(self._idx_mmap, np.dtype("<i4"), seq_count, off)
        off += seq_count * 4
        self.sequence_pointers = np.frombuffer(self._idx_mmap, np.dtype("<i8"), seq_count, off)
        off += seq_count * 8
        self.document_indices = np.frombuffer(self._idx_mmap, np.dtype("<i8"), doc_count, off)
        self._check_index(ipath, seq_count, doc_count)

    def _map_bin(self, bpath: str, ipath: str) -> None:
        """Map the token file once its size matches exactly what the index describes."""
        bin_size = os.path.getsize(bpath)
        needed = self._data_bytes()
        if bin_size != needed:
            raise IndexedDatasetError(
                f"{bpath}: size {bin_size} bytes does not match its index {ipath}, which describes "
                f"{needed} bytes ({int(self.sequence_lengths.sum(dtype=np.int64))} tokens of "
                f"{self.dtype.name}); the pair is truncated or mismatched"
            )
        # An empty file cannot be memory-mapped.
        try:
            self._bin = np.memmap(bpath, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)
        except OSError as e:
            raise IndexedDatasetError(f"{bpath}: cannot read ({e.strerror or e})") from None

    def _data_bytes(self) -> int:
        if not len(self.sequence_lengths):
            return 0
        return int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * self.dtype.itemsize

    def _check_index(self, ipath: str, seq_count: int, doc_count: int) -> None:
        docs = self.document_indices
        if doc_count == 0 or docs[0] != 0 or docs[-1] != seq_count:
            first = int(docs[0]) if doc_count else None
            last = int(docs[-1]) if doc_count else None
            raise IndexedDatasetError(
                f"{ipath}: document indices must start at 0 and end at the sequence count {seq_count}; "
                f"got first={first}, last={last}"
            )
        if doc_count > 1 and np.any(docs[1:] < docs[:-1]):
            raise IndexedDatasetError(f"{ipath}: document indices are not non-decreasing")
        itemsize = self.dtype.itemsize
        # Check every pointer against the lengths, in chunks so huge indices stay cheap in memory.
        chunk, expect_next = 1 << 22, 0
        for beg in range(0, seq_count, chunk):
            lengths = self.sequence_lengths[beg : beg + chunk].astype(np.int64)
            if lengths.size and lengths.min() < 0:
                raise IndexedDatasetError(f"{ipath}: negative sequence length")
            starts = np.empty_like(lengths)
            starts[0] = expect_next
            np.cumsum(lengths[:-1] * itemsize, out=starts[1:])
            starts[1:] += expect_next
            if not np.array_equal(starts, self.sequence_pointers[beg : beg + chunk]):
                bad = beg + int(np.argmax(starts != self.sequence_pointers[beg : beg + chunk]))
                raise IndexedDatasetError(
                    f"{ipath}: sequence pointer {bad} is {int(self.sequence_pointers[bad])}, but the "
                    f"lengths before it place it at byte {int(starts[bad - beg])}"
                )
            expect_next = int(starts[-1] + lengths[-1] * itemsize)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens [offset, offset+length) of sequence i (to its end when length is None)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.path_prefix!r} with {n} sequences")
        i = int(i) % n
        size = int(self.sequence_lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {i} of length {size}")
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def token_range(self, chunk: int = 1 << 26) -> tuple[int, int] | None:
        """(smallest, largest) token id in the .bin, read once in chunks; None when empty.

        Python ints (floats for the float dtypes the format allows)."""
        tokens = np.frombuffer(self._bin, self.dtype.newbyteorder("<"))
        lo = hi = None
        for beg in range(0, tokens.size, chunk):
            part = tokens[beg : beg + chunk]
            plo, phi = part.min(), part.max()
            lo = plo if lo is None else min(lo, plo)
            hi = phi if hi is None else max(hi, phi)
        return None if lo is None else (lo.item(), hi.item())


class IndexedDatasetBuilder:
    """Writes a .bin incrementally and the .idx at `finalize`, in Megatron's exact layout.

    Use `add_document(tokens)` (one sequence per document, the GPT case) or `add_item` for
    each sequence followed by `end_document()`.
    """

    def __init__(self, bin_file: str, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        dtype_code(self.dtype)
        self.bin_file = bin_file
        self._out = open(bin_file, "wb")
        self.sequence_lengths: list[int] = []
        self.document_indices: list[int] = [0]
        if self.dtype.kind in "ui":
            info = np.iinfo(self.dtype)
            self._range = (info.min, info.max)
        else:
            self._range = None

    def _write(self, tokens) -> int:
        arr = np.asarray(tokens)
        if arr.ndim != 1:
            arr = arr.reshape(-1)
        if self._range is not None and arr.size and arr.dtype != self.dtype:
            lo, hi = arr.min(), arr.max()
            if lo < self._range[0] or hi > self._range[1]:
                raise IndexedDatasetError(
                    f"token ids in [{lo}, {hi}] do not fit the dataset dtype {self.dtype.name}; "
                    "choose the dtype from the tokenizer's vocab size (optimal_dtype)"
                )
        with naming(self.bin_file):
            self._out.write(np.ascontiguousarray(arr, dtype=self.dtype.newbyteorder("<")).tobytes())
        return int(arr.size)

    def add_item(self, tokens) -> None:
        self.sequence_lengths.append(self._write(tokens))

    def end_document(self) -> None:
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, tokens, lengths: Sequence[int] | None = None) -> None:
        """Append one document. `lengths` splits it into several sequences (default: one
        sequence, or none for an empty document, as Megatron's preprocessing writes it)."""
        n = self._write(tokens)
        if lengths is None:
            lengths = [n] if n else []
        elif sum(lengths) != n:
            raise IndexedDatasetError(f"sequence lengths {list(lengths)} do not sum to the {n} tokens given")
        self.sequence_lengths.extend(int(x) for x in lengths)
        self.document_indices.append(len(self.sequence_lengths))

    def add_documents(self, tokens, doc_lengths) -> None:
        """Append many documents at once: `tokens` concatenated, split by `doc_lengths`.

        Each non-empty document is one sequence; an empty one has no sequence at all (its
        document index repeats the previous one), which is what Megatron's preprocessing
        writes for an empty text.
        """
        doc_lengths = np.asarray(doc_lengths, dtype=np.int64)
        n = self._write(tokens)
        if int(doc_lengths.sum()) != n:
            raise IndexedDatasetError(f"document lengths sum to {int(doc_lengths.sum())}, not the {n} tokens given")
        nonempty = doc_lengths > 0
        base = len(self.sequence_lengths)
        self.sequence_lengths.extend(doc_lengths[nonempty].tolist())
        self.document_indices.extend((base + np.cumsum(nonempty)).tolist())

    def finalize(self, idx_file: str) -> None:
        with naming(self.bin_file):
            self._out.close()
        with naming(idx_file), open(idx_file, "wb") as f:
            f.write(encode_index(self.sequence_lengths, self.document_indices, self.dtype))

    def abort(self) -> None:
        with contextlib.suppress(OSError):  # a full disk's unwritten bytes: the file is removed anyway
            self._out.close()


def write_indexed_dataset(prefix: str, documents: Iterable, dtype=np.uint16) -> str:
    """Write one-sequence documents to `<prefix>.bin/.idx`; returns the prefix."""
    builder = IndexedDatasetBuilder(bin_path(prefix), dtype)
    for doc in documents:
        builder.add_document(doc)
    builder.finalize(idx_path(prefix))
    return prefix
