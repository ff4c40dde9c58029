"""Bad data input is one named usage error: --split, token ids beyond the vocab, tokenizer files,
empty or unusable preprocessing input; damaged cache entries are rebuilt, never trusted."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import pytest

from mlm_jax.config import DataConfig
from mlm_jax.data import preprocess as pp
from mlm_jax.data.blended import BlendedDataset
from mlm_jax.data.builder import build_datasets
from mlm_jax.data.gpt_dataset import DatasetError, GPTDataset, build_gpt_splits, parse_split, split_indices
from mlm_jax.data.indexed_dataset import IndexedDataset, MissingDatasetError, write_indexed_dataset
from mlm_jax.data.tokenizers import TokenizerError, make_tokenizer
from mlm_jax.data.vocab_check import VocabularyError, check_token_ids
from mlm_jax.errors import UsageError

from .conftest import random_documents, write_jsonl


# ----------------------------------------------------------------------------- --split


@pytest.mark.parametrize("split,shown", [
    ("90,x", "'x' is not a number"),
    ("1,2,3,4", "up to three"),
    ("-1,2,3", "got -1"),
    ("nan,1", "got nan"),
    ("", "up to three"),
    ("9 0,1", "'9 0' is not a number"),
])
def test_bad_split_is_refused_naming_it(split, shown):
    with pytest.raises(DatasetError) as info:
        parse_split(split)
    assert isinstance(info.value, UsageError)
    assert f"--split {split!r}" in str(info.value) and shown in str(info.value)


def test_valid_splits_keep_megatron_normalisation():
    assert parse_split("969,30,1") == [0.969, 0.03, 0.001]
    assert parse_split("90/10") == [0.9, 0.1, 0.0]
    assert parse_split(" 1 ") == [1.0, 0.0, 0.0]
    with pytest.raises(DatasetError, match="must not all be zero"):
        parse_split("0,0,0")


# ----------------------------------------------------------------------------- vocab check


def write_ids(prefix, max_id, n=30):
    docs = random_documents(n, seed=1, max_len=40, vocab=max_id)
    docs[3] = np.array([max_id, 1, 2])  # the largest id, once
    return write_indexed_dataset(str(prefix), docs, dtype=np.uint16)


def test_token_id_beyond_the_vocab_is_an_error_naming_file_id_and_vocab(tmp_path):
    prefix = write_ids(tmp_path / "d", 999)
    cfg = DataConfig(data_path=(prefix,), split="1", tokenizer_type="NullTokenizer")
    with pytest.raises(VocabularyError) as info:
        build_datasets(cfg, 16, 1, (10, 0, 0), vocab_size=500)
    msg = str(info.value)
    # NullTokenizer --vocab-size 500: the model's vocab is 501 (EOD = 500).
    assert f"{prefix}.bin" in msg and "token ids up to 999" in msg and "vocab has 501 tokens" in msg
    assert isinstance(info.value, UsageError)
    # Ids up to EOD (= --vocab-size) fit.
    assert len(build_datasets(cfg, 16, 1, (10, 0, 0), vocab_size=999).train) >= 10


def test_vocab_check_uses_the_model_vocab_without_a_tokenizer(tmp_path):
    prefix = write_ids(tmp_path / "d", 300)
    low = IndexedDataset(prefix)
    with pytest.raises(VocabularyError, match="ids 0..299, --vocab-size 300"):
        check_token_ids(low, 300, None, "--vocab-size 300")
    check_token_ids(low, 301, None, "--vocab-size 301")


def test_token_range_is_cached_and_rescanned_when_the_bin_changes(tmp_path):
    prefix = write_ids(tmp_path / "d", 999)
    cache = tmp_path / "cache"
    low = IndexedDataset(prefix)
    with pytest.raises(VocabularyError):
        check_token_ids(low, 500, str(cache), "x")
    (entry,) = glob.glob(str(cache / "*-TokenRange.json"))
    assert json.load(open(entry))["max"] == 999
    # The cached value is what is used (a forged entry passes), so the .bin is scanned once...
    json.dump({"min": 0, "max": 3}, open(entry, "w"))
    check_token_ids(low, 500, str(cache), "x")
    # ... until the .bin changes: a rewritten dataset is scanned again.
    prefix = write_ids(tmp_path / "d", 700, n=31)
    with pytest.raises(VocabularyError, match="token ids up to 700"):
        check_token_ids(IndexedDataset(prefix), 500, str(cache), "x")


def test_damaged_token_range_cache_is_rescanned(tmp_path):
    prefix = write_ids(tmp_path / "d", 999)
    cache = tmp_path / "cache"
    check_token_ids(IndexedDataset(prefix), 1000, str(cache), "x")
    (entry,) = glob.glob(str(cache / "*-TokenRange.json"))
    open(entry, "w").write("{not json")
    with pytest.raises(VocabularyError, match="token ids up to 999"):
        check_token_ids(IndexedDataset(prefix), 500, str(cache), "x")
    assert json.load(open(entry))["max"] == 999  # rewritten


# ----------------------------------------------------------------------------- cache repair


def test_damaged_index_cache_is_rebuilt(tmp_path):
    prefix = write_indexed_dataset(str(tmp_path / "d"), random_documents(50, max_len=30))
    low = IndexedDataset(prefix)
    cache = str(tmp_path / "cache")
    first = GPTDataset(low, split_indices((0.0, 1.0), len(low)), 40, 16, 3, "train", cache)
    assert first.built_anew
    expected = [first[i].tolist() for i in range(len(first))]
    # Truncated .npy (a crash outside our atomic writes, a full disk): rebuilt, same samples.
    path = first.cache_files["sample_index"]
    open(path, "r+b").truncate(40)
    again = GPTDataset(low, split_indices((0.0, 1.0), len(low)), 40, 16, 3, "train", cache)
    assert again.built_anew and [again[i].tolist() for i in range(len(again))] == expected
    # A readable entry of the wrong shape is not trusted either.
    np.save(first.cache_files["shuffle_index"], np.arange(3, dtype=np.uint32))
    third = GPTDataset(low, split_indices((0.0, 1.0), len(low)), 40, 16, 3, "train", cache)
    assert third.built_anew and [third[i].tolist() for i in range(len(third))] == expected
    fourth = GPTDataset(low, split_indices((0.0, 1.0), len(low)), 40, 16, 3, "train", cache)
    assert not fourth.built_anew  # the repaired entry is used


def test_damaged_blend_cache_is_rebuilt(tmp_path):
    a = build_gpt_splits(write_indexed_dataset(str(tmp_path / "a"), random_documents(40)), [(0, 1), None, None],
                         [20, 0, 0], 8, 1, str(tmp_path / "c"))[0]
    b = build_gpt_splits(write_indexed_dataset(str(tmp_path / "b"), random_documents(40, seed=2)),
                         [(0, 1), None, None], [20, 0, 0], 8, 1, str(tmp_path / "c"))[0]
    cache = str(tmp_path / "blend")
    good = BlendedDataset([a, b], [0.5, 0.5], 30, cache)
    expected = good.dataset_index.tolist()
    for f in glob.glob(os.path.join(cache, "*-dataset_index.npy")):
        np.save(f, np.full(30, 7, dtype=np.int16))  # names a dataset that does not exist
    assert BlendedDataset([a, b], [0.5, 0.5], 30, cache).dataset_index.tolist() == expected


# ----------------------------------------------------------------------------- files


def test_missing_dataset_is_a_usage_error_and_a_file_not_found(tmp_path):
    with pytest.raises(MissingDatasetError) as info:
        IndexedDataset(str(tmp_path / "nope"))
    assert isinstance(info.value, UsageError) and isinstance(info.value, FileNotFoundError)
    assert str(tmp_path / "nope.idx") in str(info.value)


def test_vocab_json_that_is_not_json_names_file_and_line(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text('{"a": 0,\n  "b": 1\n  oops}')
    merges.write_text("#version: 0.2\na b\n")
    with pytest.raises(TokenizerError) as info:
        make_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    assert f"--vocab-file {vocab}: not valid JSON at line 3" in str(info.value)
    vocab.write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="expected a JSON object of token -> integer id"):
        make_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))


def test_garbage_merges_name_file_and_line(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}))
    merges.write_text("#version: 0.2\na b\nthree tokens here\n")
    with pytest.raises(TokenizerError, match=f"--merge-file {merges} line 3: expected two tokens"):
        make_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))
    merges.write_bytes(b"\xff\xfe binary")
    with pytest.raises(TokenizerError, match="not UTF-8"):
        make_tokenizer("GPT2BPETokenizer", vocab_file=str(vocab), merge_file=str(merges))


def test_sentencepiece_path_that_is_not_a_model(tmp_path):
    fake = tmp_path / "tok.model"
    fake.write_text("this is not a protobuf")
    for kind in ("GPTSentencePieceTokenizer", "SentencePieceTokenizer"):
        with pytest.raises(TokenizerError, match=f"--tokenizer-model {fake}: not a SentencePiece model"):
            make_tokenizer(kind, tokenizer_model=str(fake))


def test_huggingface_garbage_files_are_named(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{ nope")
    with pytest.raises(TokenizerError, match=f"--tokenizer-model {bad}: not valid JSON at line 1"):
        make_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    bad.write_text('{"version": "1.0"}')
    with pytest.raises(TokenizerError, match="not a tokenizers tokenizer.json"):
        make_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))


def test_missing_tokenizer_file_is_a_usage_error(tmp_path):
    with pytest.raises(TokenizerError) as info:
        make_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "nope.model"))
    assert isinstance(info.value, FileNotFoundError) and "nope.model: no such file" in str(info.value)


def test_null_tokenizer_refuses_words_and_ids_beyond_its_vocab():
    tok = make_tokenizer("NullTokenizer", vocab_size=100)
    with pytest.raises(TokenizerError, match="'hello' is not one"):
        tok.tokenize("1 2 hello")
    with pytest.raises(TokenizerError, match=r"token id 100 is outside \[0, 100\) for --vocab-size 100"):
        tok.tokenize("1 100")
    with pytest.raises(TokenizerError, match="token id -1"):
        tok.tokenize("-1 3")
    assert tok.tokenize("0 99") == [0, 99]


# ----------------------------------------------------------------------------- preprocessing input

NULL = dict(tokenizer_type="NullTokenizer", vocab_size=100)


@pytest.mark.parametrize("workers", [1, 2])
def test_null_tokenizer_words_name_the_line(tmp_path, workers):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}, {"text": "4 5"}, {"text": "6 seven"}])
    with pytest.raises(pp.BadLineError) as info:
        pp.preprocess(src, str(tmp_path / "out"), NULL, workers=workers, progress=False, lines_per_task=1)
    assert f"{src} line 3: key 'text': NullTokenizer reads space-separated integer token ids; 'seven'" in str(info.value)
    assert glob.glob(str(tmp_path / "out*")) == []


def test_null_tokenizer_id_beyond_vocab_size_names_the_line(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 3"}, {"text": "4 500"}])
    with pytest.raises(pp.BadLineError, match="line 2: key 'text': NullTokenizer: token id 500 is outside"):
        pp.preprocess(src, str(tmp_path / "out"), NULL, progress=False)
    s = pp.preprocess(src, str(tmp_path / "out"), NULL, skip_bad_lines=True, progress=False)
    assert s["documents"] == 1 and s["bad_lines"] == 1


@pytest.mark.parametrize("lines,shown", [
    ([], "no documents (0 lines)"),
    (["", "  "], "no documents (2 lines, all 2 skipped as bad)"),
    (['{"text": ""}', '{"text": ""}'], "key 'text' has no tokens in any of the 2 documents"),
])
def test_empty_input_is_an_error_not_an_empty_dataset(tmp_path, lines, shown):
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    with pytest.raises(pp.InputError) as info:
        pp.preprocess(src, str(tmp_path / "out"), NULL, skip_bad_lines=True, progress=False)
    assert f"--input {src}: {shown}" in str(info.value) and "no output written" in str(info.value)
    assert glob.glob(str(tmp_path / "out*")) == []


def test_failed_run_keeps_an_earlier_complete_output(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "1 2 3"}, {"text": "4 5"}])
    pp.preprocess(good, str(tmp_path / "out"), NULL, progress=False)
    before = {p: open(p, "rb").read() for p in glob.glob(str(tmp_path / "out*"))}
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "1 2 3"}, {"text": "x"}])
    with pytest.raises(pp.BadLineError):
        pp.preprocess(bad, str(tmp_path / "out"), NULL, progress=False)
    assert {p: open(p, "rb").read() for p in glob.glob(str(tmp_path / "out*"))} == before


def test_damaged_default_corpus_cache_is_rebuilt(tmp_path):
    """The default corpus's cached tokenizer and dataset are files the user never named: a
    damaged one is built again, not reported as a bad --tokenizer-model."""
    from mlm_jax.data.default_corpus import build_default_corpus

    prefix, tok = build_default_corpus(cache_dir=str(tmp_path), max_bytes=60_000, vocab_size=500)
    n = len(IndexedDataset(prefix))
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"NOTMAGIC!")
    again, tok2 = build_default_corpus(cache_dir=str(tmp_path), max_bytes=60_000, vocab_size=500)
    assert again == prefix and len(IndexedDataset(again)) == n
    stamp = os.stat(prefix + ".bin").st_mtime_ns
    # A damaged tokenizer is trained again, and the data it tokenized is rebuilt with it.
    open(tok.model_file, "wb").write(b"garbage, not a SentencePiece model")
    again, tok3 = build_default_corpus(cache_dir=str(tmp_path), max_bytes=60_000, vocab_size=500)
    ds = IndexedDataset(again)
    assert len(ds) == n and tok3.vocab_size == 500 and ds[0][-1] == tok3.eod
    assert os.stat(prefix + ".bin").st_mtime_ns != stamp


def test_unwritable_data_cache_path_is_named(tmp_path):
    prefix = write_indexed_dataset(str(tmp_path / "d"), random_documents(30))
    (tmp_path / "afile").write_text("keep")
    cfg = DataConfig(data_path=(prefix,), split="1", tokenizer_type="NullTokenizer",
                     data_cache_path=str(tmp_path / "afile" / "cache"))
    with pytest.raises(DatasetError, match="afile/cache .*--data-cache-path"):
        build_datasets(cfg, 16, 1, (10, 0, 0), vocab_size=1000)
    assert (tmp_path / "afile").read_text() == "keep"
