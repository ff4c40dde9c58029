"""Megatron's Llama2Tokenizer, Llama3Tokenizer and TikTokenizer from tiny local files the tests
write themselves (a SentencePiece model trained here, a tiktoken BPE ranks file, a Megatron
TikTokenizer JSON): round trip, special tokens, EOD, vocab size, the flags, preprocessing,
checkpoint records, and a missing file as one line naming the flag and the file."""

import base64
import glob
import json
import os
import subprocess
import sys

import pytest

from mlm_jax.arguments import parse_args
from mlm_jax.checkpoint.format import load_tokenizer, tokenizer_record
from mlm_jax.data.indexed_dataset import IndexedDataset
from mlm_jax.data.preprocess import preprocess
from mlm_jax.data.tokenizers import TokenizerError, TokenizerFileNotFound, build_tokenizer, make_tokenizer, \
    train_sentencepiece

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXTS = ["the cat sat on the mat", "then they went there", "Unicode: café, naïve, 東京 ✓", "  two  spaces\nline\n"]
MERGES = [b"th", b"the", b" t", b" the", b"at", b" c", b" cat", b"he", b"en", b" s", b"on", b"aB"]


def ranks_json(path, merges=MERGES) -> str:
    """Megatron's TikTokenizer vocab: a JSON list of {rank, token_bytes, token_str}, the 256
    bytes first."""
    every = [bytes([i]) for i in range(256)] + list(merges)
    json.dump([{"rank": i, "token_bytes": base64.b64encode(t).decode(), "token_str": t.decode("utf-8", "replace")}
               for i, t in enumerate(every)], open(path, "w"))
    return str(path)


def bpe_file(path, merges=MERGES) -> str:
    """A tiktoken BPE ranks file as Llama-3's tokenizer.model: "base64 rank" per line."""
    every = [bytes([i]) for i in range(256)] + list(merges)
    with open(path, "wb") as f:
        for i, t in enumerate(every):
            f.write(base64.b64encode(t) + b" " + str(i).encode() + b"\n")
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    corpus = d / "corpus.txt"
    corpus.write_text("\n".join(TEXTS * 5), encoding="utf-8")
    sp = train_sentencepiece([str(corpus)], str(d / "sp"), 300, num_threads=1)
    return {"sp": sp, "json": ranks_json(d / "vocab.json"), "bpe": bpe_file(d / "tokenizer.model"), "dir": d}


# ------------------------------------------------------------------ Llama2Tokenizer


def test_llama2_tokenizer_puts_bos_first_and_uses_eos_as_eod(files):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=files["sp"])
    tok = make_tokenizer("Llama2Tokenizer", tokenizer_model=files["sp"])
    assert tok.vocab_size == len(sp) == 300
    assert (tok.bos, tok.eod) == (sp.bos_id(), sp.eos_id()) == (1, 2)
    for text in TEXTS:
        ids = tok.tokenize(text)
        assert ids == [1] + sp.encode_as_ids(text)  # Megatron: bos=True, eos=False
        assert tok.detokenize(ids) == text
    assert tok.tokenize_batch(TEXTS) == [tok.tokenize(t) for t in TEXTS]


# ------------------------------------------------------------------ TikTokenizer


def test_tiktokenizer_ids_special_tokens_eod_and_round_trip(files):
    tok = make_tokenizer("TikTokenizer", tokenizer_model=files["json"], tiktoken_num_special_tokens=10)
    n = 256 + len(MERGES)
    assert tok.vocab_size == 10 + n
    assert (tok.bos, tok.eod) == (1, 2)  # <s>, </s> in Megatron's default special-token order
    assert tok.tokenize("the") == [10 + 256 + MERGES.index(b"the")]  # rank r is id N + r
    assert tok.tokenize("A") == [10 + ord("A")]
    assert tok.tokenize("the</s><pad>") == [10 + 256 + MERGES.index(b"the"), 2, 4]  # special text recognised
    assert tok.tokenize("<SPECIAL_9>") == [9]
    for text in TEXTS:
        ids = tok.tokenize(text)
        assert all(10 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    default = make_tokenizer("TikTokenizer", tokenizer_model=files["json"])
    assert default.vocab_size == 1000 + n and default.eod == 2  # Megatron's 1000 special ids by default
    assert default.tokenize("the cat") == [i - 10 + 1000 for i in tok.tokenize("the cat")]


def test_tiktokenizer_patterns_and_custom_special_tokens(files):
    custom = ["<s>", "<unk>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<tool>"]
    tok = make_tokenizer("TikTokenizer", tokenizer_model=files["json"], tiktoken_num_special_tokens=9,
                         tokenizer_special_tokens=custom, tiktoken_pattern="v1")
    assert (tok.bos, tok.eod) == (0, 2) and tok.tokenize("<tool>") == [7] and tok.tokenize("<SPECIAL_8>") == [8]
    for text in TEXTS:
        assert tok.detokenize(tok.tokenize(text)) == text
    v1, v2 = (make_tokenizer("TikTokenizer", tokenizer_model=files["json"], tiktoken_pattern=p) for p in ("v1", "v2"))
    # v1 keeps a letter run "aB" as one piece (so the merge applies); v2 splits before an upper-case letter.
    assert v1.tokenize("aB") == [1000 + 256 + MERGES.index(b"aB")]
    assert v2.tokenize("aB") == [1000 + ord("a"), 1000 + ord("B")]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokenizer_special_tokens=["<s>", "</s>"]), "--tokenizer-special-tokens must be unique and include "
                                                      "<unk> <s> </s> <mask> <pad> <cls> <sep> (missing <unk> <mask>"),
    (dict(tiktoken_num_special_tokens=3), "--tiktoken-num-special-tokens 3 must hold the 7 special tokens"),
    (dict(tiktoken_pattern="v3"), "--tiktoken-pattern 'v3': choose one of v1, v2"),
])
def test_tiktokenizer_bad_options_name_the_flag(files, kwargs, message):
    with pytest.raises(TokenizerError) as e:
        make_tokenizer("TikTokenizer", tokenizer_model=files["json"], **kwargs)
    assert str(e.value).startswith(message), str(e.value)


def test_tiktokenizer_bad_vocab_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"a": 1}))
    with pytest.raises(TokenizerError, match=f"--tokenizer-model {bad}: expected a JSON list"):
        make_tokenizer("TikTokenizer", tokenizer_model=str(bad))
    entries = json.load(open(ranks_json(tmp_path / "v.json")))
    entries[3]["rank"] = 7
    json.dump(entries, open(bad, "w"))
    with pytest.raises(TokenizerError, match=r"entry 3 must be \{\"rank\": 3"):
        make_tokenizer("TikTokenizer", tokenizer_model=str(bad))


# ------------------------------------------------------------------ Llama3Tokenizer


def test_llama3_tokenizer_special_tokens_after_the_ranks(files):
    tok = make_tokenizer("Llama3Tokenizer", tokenizer_model=files["bpe"])
    base = 256 + len(MERGES)
    assert tok.vocab_size == base + 256
    assert (tok.bos, tok.eod) == (base, base + 1)  # <|begin_of_text|>, <|end_of_text|>
    assert tok.tokenize("the cat") == [256 + MERGES.index(b"the"), 256 + MERGES.index(b" cat")]  # no bos added
    assert tok.tokenize("<|begin_of_text|>the<|eot_id|>") == [base, 256 + MERGES.index(b"the"), base + 9]
    assert tok.tokenize("<|reserved_special_token_250|>") == [base + 255]
    for text in TEXTS:
        assert tok.detokenize(tok.tokenize(text)) == text


def test_llama3_tokenizer_refuses_a_json_or_broken_file(files, tmp_path):
    with pytest.raises(TokenizerError, match="a JSON file; Llama3Tokenizer reads Llama-3's tiktoken tokenizer.model"):
        make_tokenizer("Llama3Tokenizer", tokenizer_model=files["json"])
    bad = tmp_path / "tokenizer.model"
    bad.write_bytes(open(files["bpe"], "rb").read() + b"not base64 here\n")
    with pytest.raises(TokenizerError, match=f"--tokenizer-model {bad} line {256 + len(MERGES) + 1}: expected"):
        make_tokenizer("Llama3Tokenizer", tokenizer_model=str(bad))


# ------------------------------------------------------------------ flags, preprocessing, checkpoints


@pytest.mark.parametrize("kind", ["Llama2Tokenizer", "Llama3Tokenizer", "TikTokenizer"])
def test_missing_file_names_the_flag_and_file(tmp_path, kind):
    with pytest.raises(TokenizerFileNotFound) as e:
        make_tokenizer(kind, tokenizer_model=str(tmp_path / "nope"))
    assert str(e.value) == f"--tokenizer-model {tmp_path / 'nope'}: no such file (needed by --tokenizer-type {kind})"
    with pytest.raises(TokenizerError, match=f"--tokenizer-type {kind} needs --tokenizer-model"):
        make_tokenizer(kind)


def test_training_flags_build_the_tokenizers(files):
    cfg = parse_args(["--tokenizer-type", "TikTokenizer", "--tokenizer-model", files["json"],
                      "--tiktoken-pattern", "v1", "--tiktoken-num-special-tokens", "20",
                      "--tiktoken-special-tokens", "<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<x>"])
    assert cfg.data.tokenizer_special_tokens == ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>", "<x>")
    tok = build_tokenizer(cfg.data)
    assert tok.vocab_size == 20 + 256 + len(MERGES) and tok.tokenize("<x>") == [7] and tok.pattern == "v1"
    for kind, key in (("Llama2Tokenizer", "sp"), ("Llama3Tokenizer", "bpe")):
        data = parse_args(["--tokenizer-type", kind, "--tokenizer-model", files[key]]).data
        assert build_tokenizer(data).tokenizer_type == kind


@pytest.mark.parametrize("kind, key, extra", [
    ("Llama2Tokenizer", "sp", []), ("Llama3Tokenizer", "bpe", []),
    ("TikTokenizer", "json", ["--tiktoken-num-special-tokens", "16"]),
])
def test_preprocess_and_checkpoint_record(files, tmp_path, kind, key, extra):
    """Preprocessing writes each document's tokens plus EOD; the checkpoint's tokenizer record
    (what generate and --use-checkpoint-args rebuild from) gives the same tokenizer back."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS), encoding="utf-8")
    kwargs = dict(tokenizer_type=kind, tokenizer_model=files[key], vocab_file=None, merge_file=None, vocab_size=None,
                  tiktoken_pattern="v2", tiktoken_num_special_tokens=16 if extra else 1000,
                  tokenizer_special_tokens=None)
    preprocess(str(src), str(tmp_path / "out"), kwargs, append_eod=True, progress=False)
    tok = make_tokenizer(**kwargs)
    [bin_file] = glob.glob(str(tmp_path / "out*.bin"))
    ds = IndexedDataset(bin_file[:-4])
    assert [list(ds[i]) for i in range(len(ds))] == [tok.tokenize(t) + [tok.eod] for t in TEXTS]

    record, blobs = tokenizer_record(tok)
    ckpt = tmp_path / "ckpt"
    (ckpt / "tokenizer").mkdir(parents=True)
    for name, data in blobs.items():
        (ckpt / "tokenizer" / name).write_bytes(data)
    record = json.loads(json.dumps(record))  # as stored in the checkpoint's JSON metadata
    back = load_tokenizer(str(ckpt), record)
    assert (back.tokenizer_type, back.vocab_size, back.eod) == (kind, tok.vocab_size, tok.eod)
    assert [back.tokenize(t) for t in TEXTS] == [tok.tokenize(t) for t in TEXTS]


def test_preprocess_cli_missing_tokenizer_file_is_one_line(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "hi"}\n')
    env = {k: v for k, v in os.environ.items() if k != "MLM_JAX_DEBUG"}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    p = subprocess.run([sys.executable, "-m", "mlm_jax.data.preprocess", "--input", str(src), "--output-prefix",
                        str(tmp_path / "o"), "--no-progress", "--tokenizer-type", "TikTokenizer", "--tokenizer-model",
                        str(tmp_path / "vocab.json")], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last == f"error: --tokenizer-model {tmp_path / 'vocab.json'}: no such file (needed by --tokenizer-type " \
                   "TikTokenizer)", p.stderr
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"] and src.read_text() == '{"text": "hi"}\n'
