"""The inspect command, and the default corpus (stdlib source, lossless tokenizer, cached)."""

from __future__ import annotations

import json
import os

import numpy as np

from mlm_jax.config import DataConfig
from mlm_jax.data import inspect as inspect_cli
from mlm_jax.data.builder import build_datasets
from mlm_jax.data.default_corpus import (DEFAULT_VOCAB_SIZE, build_default_corpus, gather_stdlib_sources,
                                         split_source)
from mlm_jax.data.indexed_dataset import IndexedDataset
from mlm_jax.data.preprocess import preprocess

from .conftest import SAMPLE_TEXTS, write_jsonl


def test_inspect_prints_training_order(tmp_path, spm_model, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t * (1 + i % 4)} for i, t in enumerate(SAMPLE_TEXTS * 3)])
    tok = dict(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=spm_model)
    preprocess(src, str(tmp_path / "c"), tok, ["text"], append_eod=True, progress=False)
    prefix = str(tmp_path / "c_text_document")
    args = ["--data-path", prefix, "--split", "90,10,0", "--seq-length", "32", "--seed", "7",
            "--train-samples", "40"]
    assert inspect_cli.main(args + ["--show", "3:6", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    cfg = DataConfig(data_path=(prefix,), split="90,10,0", **tok)
    train = build_datasets(cfg, 32, 7, (40, 0, 0)).train
    assert shown == [train[i].tolist() for i in (3, 4, 5)]
    assert inspect_cli.main(args + ["--show", "0:1", "--global-batch-size", "4", "--tokenizer-type",
                                    "GPTSentencePieceTokenizer", "--tokenizer-model", spm_model]) == 0
    out = capsys.readouterr().out
    assert "=== sample 0, iteration 0: 33 tokens ===" in out
    tokenizer = build_datasets(cfg, 32, 7, (40, 0, 0)).tokenizer
    assert out.split("--- text ---\n", 1)[1] == tokenizer.detokenize(train[0]) + "\n"
    assert " ".join(map(str, train[0].tolist())) in out
    assert inspect_cli.main(args + ["--show", "0:100000"]) == 2  # a usage error
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --show 0:100000 but the train split has 140 samples"


def test_default_corpus_is_lossless_and_cached(tmp_path):
    prefix, tok = build_default_corpus(cache_dir=str(tmp_path), max_bytes=150_000, vocab_size=1000)
    files = gather_stdlib_sources(150_000)
    assert sum(len(t.encode()) for _, t in files) <= 150_000
    pieces = [p for _, text in files for p in split_source(text)]
    for _, text in files:
        assert "".join(split_source(text)) == text
    ds = IndexedDataset(prefix)
    assert len(ds) == len(pieces) > len(files) and tok.vocab_size == 1000
    for i in range(len(ds)):
        assert ds[i][-1] == tok.eod
        assert tok.detokenize(ds[i][:-1]) == pieces[i]
    stamp = os.stat(prefix + ".bin").st_mtime_ns
    again, _ = build_default_corpus(cache_dir=str(tmp_path), max_bytes=150_000, vocab_size=1000)
    assert again == prefix and os.stat(prefix + ".bin").st_mtime_ns == stamp


def test_default_run_data():
    """No data flags: the stdlib corpus, split and sampled like any other data."""
    data = build_datasets(DataConfig(), 128, 1234, (64, 16, 16))
    assert data.tokenizer.vocab_size == DEFAULT_VOCAB_SIZE == 4096
    assert len(data.train) >= 64 and data.train[0].shape == (129,)
    assert data.valid is not None and data.test is not None
    assert np.all(np.asarray(data.train[5]) < DEFAULT_VOCAB_SIZE)
    # Documents are pieces of modules a few hundred tokens long, so samples often cross an EOD.
    assert sum(bool((data.train[i] == data.tokenizer.eod).any()) for i in range(64)) >= 8
