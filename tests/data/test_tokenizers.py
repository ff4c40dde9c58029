"""Tokenizers: lossless round trips, Megatron's vocab sizes and EOD ids, clear errors."""

from __future__ import annotations

import json
import os
import types

import pytest
import sentencepiece as spm

from mlm_jax.config import DataConfig
from mlm_jax.data import train_tokenizer
from mlm_jax.data.tokenizers import (
    TOKENIZER_TYPES,
    GPTSentencePieceTokenizer,
    TokenizerError,
    build_tokenizer,
    make_tokenizer,
)

from .conftest import SAMPLE_TEXTS

TRICKY = [
    "def f(x):\n    return x\n",
    "  two leading spaces\n\n\n\ttab\r\n",
    "non-ASCII: Ünïcödé ✓ 😀 漢字",
    "",
    "trailing   ",
]


def test_gpt_sentencepiece_is_lossless(spm_model):
    tok = build_tokenizer(DataConfig(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=spm_model))
    sp = spm.SentencePieceProcessor(model_file=spm_model)
    assert tok.vocab_size == len(sp) == 400
    assert tok.eod == sp.eos_id() == 2
    for text in TRICKY + SAMPLE_TEXTS[:5]:
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.files() == [spm_model]


def test_sentencepiece_tokenizer_megatron_special_tokens(spm_model):
    tok = make_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model)
    n = len(spm.SentencePieceProcessor(model_file=spm_model))
    # <CLS> <SEP> <EOD> <MASK> appended, then <PAD> (the model has no pad); bos/eos exist already.
    assert tok.vocab_size == n + 5
    assert tok.eod == n + 2
    ids = tok.tokenize("abc<EOD>def")
    assert ids.count(tok.eod) == 1
    assert ids[: ids.index(tok.eod)] == tok.sp.encode_as_ids("abc")
    assert tok.detokenize(ids) == "abc <EOD> def"
    assert tok.tokenize("<s>")[0] == tok.sp.bos_id()


def test_gpt2_bpe_round_trip_and_eod(gpt2_files):
    vocab, merges = gpt2_files
    tok = build_tokenizer(DataConfig(tokenizer_type="GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    with open(vocab) as f:
        table = json.load(f)
    assert tok.vocab_size == len(table)
    assert tok.eod == table["<|endoftext|>"]
    for text in TRICKY:
        assert tok.detokenize(tok.tokenize(text)) == text
    # Megatron's GPT-2 tokenizer registers no special tokens: the literal text is plain bytes.
    assert tok.eod not in tok.tokenize("a<|endoftext|>b")
    assert tok.files() == [vocab, merges]


def test_huggingface_tokenizer_folder_and_file(tmp_path, gpt2_files):
    from tokenizers import ByteLevelBPETokenizer

    vocab, merges = gpt2_files
    bpe = ByteLevelBPETokenizer(vocab, merges)
    bpe.add_special_tokens(["<|endoftext|>", "</s>"])
    folder = tmp_path / "hf"
    folder.mkdir()
    bpe.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "</s>"}}))
    by_folder = make_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(folder))
    assert by_folder.eod == bpe.token_to_id("</s>")
    assert by_folder.vocab_size == bpe.get_vocab_size(with_added_tokens=True)
    for text in TRICKY:
        assert by_folder.detokenize(by_folder.tokenize(text)) == text
    assert sorted(os.path.basename(f) for f in by_folder.files()) == ["tokenizer.json", "tokenizer_config.json"]
    # The file alone (no config): the usual eos spellings are looked up, '</s>' comes first.
    bare = tmp_path / "bare.json"
    bpe.save(str(bare))
    assert make_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(bare)).eod == bpe.token_to_id("</s>")


def test_huggingface_missing_path_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer.json.*never downloaded"):
        make_tokenizer("HuggingFaceTokenizer", tokenizer_model="gpt2")
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        make_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))


def test_null_tokenizer_megatron_rule():
    tok = make_tokenizer("NullTokenizer", vocab_size=1000)
    assert tok.eod == 1000 and tok.vocab_size == 1001 and tok.eod == tok.vocab_size - 1
    assert tok.tokenize("5 7  9") == [5, 7, 9]
    assert tok.detokenize([5, 7]) == "5 7"
    with pytest.raises(TokenizerError, match="--vocab-size"):
        make_tokenizer("NullTokenizer")


def test_unknown_type_names_valid_types():
    with pytest.raises(TokenizerError) as info:
        make_tokenizer("GPT3Tokenizer")
    for name in TOKENIZER_TYPES:
        assert name in str(info.value)


def test_missing_files_name_the_flag(tmp_path, gpt2_files):
    with pytest.raises(TokenizerError, match="needs --merge-file"):
        make_tokenizer("GPT2BPETokenizer", vocab_file=gpt2_files[0])
    with pytest.raises(FileNotFoundError, match="--vocab-file .*v.json: no such file"):
        make_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "v.json"), merge_file=gpt2_files[1])
    with pytest.raises(FileNotFoundError, match="--tokenizer-model .*nope.model"):
        make_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(tmp_path / "nope.model"))


def test_train_tokenizer_cli(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(SAMPLE_TEXTS * 3), encoding="utf-8")
    assert train_tokenizer.main(["--input", str(corpus), "--model-prefix", str(tmp_path / "m"),
                                 "--vocab-size", "350", "--num-threads", "1"]) == 0
    tok = GPTSentencePieceTokenizer(str(tmp_path / "m.model"))
    assert tok.vocab_size == 350
    assert "vocab 350" in capsys.readouterr().out
    for text in TRICKY:
        assert tok.detokenize(tok.tokenize(text)) == text


def test_lossy_default_would_fail_round_trip(tmp_path):
    """Guards the reason for the lossless settings: sentencepiece's defaults lose whitespace."""
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(SAMPLE_TEXTS * 3), encoding="utf-8")
    spm.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(tmp_path / "lossy"), vocab_size=80,
                                   minloglevel=2, num_threads=1)
    lossy = GPTSentencePieceTokenizer(str(tmp_path / "lossy.model"))
    text = TRICKY[1]
    assert lossy.detokenize(lossy.tokenize(text)) != text


def test_build_tokenizer_reads_data_config_fields(spm_model):
    cfg = types.SimpleNamespace(tokenizer_type="GPTSentencePieceTokenizer", tokenizer_model=spm_model,
                                vocab_file=None, merge_file=None)
    assert build_tokenizer(cfg).vocab_size == 400
