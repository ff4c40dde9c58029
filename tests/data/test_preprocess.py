"""Preprocessing: Megatron's exact bytes, identical for 1 and N workers, bad lines, no partial outputs."""

from __future__ import annotations

import glob
import json
import struct

import numpy as np
import pytest

from mlm_jax.data import preprocess as pp
from mlm_jax.data.indexed_dataset import IndexedDataset
from mlm_jax.data.tokenizers import make_tokenizer

from .conftest import SAMPLE_TEXTS, write_jsonl


def records(n=40):
    out = []
    for i in range(n):
        text = SAMPLE_TEXTS[i % len(SAMPLE_TEXTS)] * (1 + i % 3)
        out.append({"text": "" if i == 7 else text, "title": f"doc {i} ✓", "id": i})
    return out


def gpt2_kwargs(gpt2_files):
    return dict(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1])


def read_bytes(prefix):
    return open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()


def test_output_is_megatron_bytes(tmp_path, gpt2_files):
    recs = records()
    src = write_jsonl(tmp_path / "in.jsonl", recs)
    s = pp.preprocess(src, str(tmp_path / "out"), gpt2_kwargs(gpt2_files), ["text"], append_eod=True,
                      progress=False)
    assert s["documents"] == len(recs) and s["bad_lines"] == 0
    # Expected files, built independently: each non-empty text is tokens + EOD; empty text is a
    # document with no sequence (Megatron's encode drops empty sentences; add_document records it).
    tok = make_tokenizer(**gpt2_kwargs(gpt2_files))
    seqs = [tok.tokenize(r["text"]) + [tok.eod] for r in recs if r["text"]]
    bin_ = b"".join(struct.pack(f"<{len(x)}H", *x) for x in seqs)
    lengths = [len(x) for x in seqs]
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1] * 2]).tolist()
    docs = [0]
    for r in recs:
        docs.append(docs[-1] + (1 if r["text"] else 0))
    idx = b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(seqs), len(docs))
    idx += struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(docs)}q", *docs)
    assert read_bytes(str(tmp_path / "out_text_document")) == (bin_, idx)


def test_one_and_several_workers_write_identical_files(tmp_path, gpt2_files):
    src = write_jsonl(tmp_path / "in.jsonl", records(60))
    kw = gpt2_kwargs(gpt2_files)
    pp.preprocess(src, str(tmp_path / "w1"), kw, ["text", "title"], True, workers=1, progress=False,
                  lines_per_task=7)
    pp.preprocess(src, str(tmp_path / "w3"), kw, ["text", "title"], True, workers=3, progress=False,
                  lines_per_task=7)
    for key in ("text", "title"):
        assert read_bytes(str(tmp_path / f"w1_{key}_document")) == read_bytes(str(tmp_path / f"w3_{key}_document"))
    titles = IndexedDataset(str(tmp_path / "w3_title_document"))
    tok = make_tokenizer(**kw)
    assert tok.detokenize(titles[12][:-1]) == "doc 12 ✓"


BAD = [
    ("{not json", "invalid JSON"),
    ('["a list"]', "a JSON list, not an object"),
    ('{"txt": "wrong key"}', "missing key 'text'"),
    ('{"text": 5}', "key 'text' is a JSON int, not a string"),
    ("", "empty line"),
]


@pytest.mark.parametrize("line,reason", BAD)
def test_bad_line_stops_the_run_without_outputs(tmp_path, gpt2_files, line, reason):
    lines = [json.dumps(r) for r in records(6)]
    lines.insert(3, line)  # line 4
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    with pytest.raises(pp.BadLineError) as info:
        pp.preprocess(src, str(tmp_path / "out"), gpt2_kwargs(gpt2_files), ["text"], True, progress=False,
                      lines_per_task=2)
    assert "line 4" in str(info.value) and reason in str(info.value) and "--skip-bad-lines" in str(info.value)
    assert glob.glob(str(tmp_path / "out*")) == []


def test_invalid_utf8_is_a_bad_line(tmp_path, gpt2_files):
    src = tmp_path / "in.jsonl"
    src.write_bytes(b'{"text": "ok"}\n{"text": "\xff\xfe"}\n')
    with pytest.raises(pp.BadLineError, match="line 2: invalid UTF-8"):
        pp.preprocess(str(src), str(tmp_path / "out"), gpt2_kwargs(gpt2_files), ["text"], workers=2,
                      progress=False, lines_per_task=1)
    assert glob.glob(str(tmp_path / "out*")) == []


def test_skip_bad_lines_counts_and_skips(tmp_path, gpt2_files):
    good = records(10)
    lines = [json.dumps(r) for r in good]
    for pos, (line, _) in zip((1, 4, 9), BAD):
        lines.insert(pos, line)
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    for workers in (1, 2):
        s = pp.preprocess(src, str(tmp_path / f"out{workers}"), gpt2_kwargs(gpt2_files), ["text", "title"], True,
                          workers=workers, skip_bad_lines=True, progress=False, lines_per_task=3)
        assert s["bad_lines"] == 3 and s["documents"] == 10
        assert [n for n, _ in s["bad_line_examples"]] == [2, 5, 10]
        assert IndexedDataset(str(tmp_path / f"out{workers}_title_document")).num_documents == 10
    assert read_bytes(str(tmp_path / "out1_text_document")) == read_bytes(str(tmp_path / "out2_text_document"))


def test_cli_reports_bad_line_and_summary(tmp_path, gpt2_files, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [json.dumps(r) for r in records(3)] + ["oops"])
    base = ["--input", src, "--output-prefix", str(tmp_path / "o"), "--tokenizer-type", "GPT2BPETokenizer",
            "--vocab-file", gpt2_files[0], "--merge-file", gpt2_files[1], "--append-eod", "--no-progress"]
    assert pp.main(base) == 2  # a usage error: one line naming the file and line
    err = capsys.readouterr().err
    assert "line 4: invalid JSON" in err and "no output written" in err and err.startswith("error: ")
    assert pp.main(base + ["--skip-bad-lines"]) == 0
    captured = capsys.readouterr()
    assert "skipped line 4: invalid JSON" in captured.err
    assert "processed 3 documents (4 lines, 1 bad lines skipped)" in captured.out and "MB/s" in captured.out


def test_int32_tokens_for_large_vocab(tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 70000"}, {"text": "65535"}])
    pp.preprocess(src, str(tmp_path / "o"), dict(tokenizer_type="NullTokenizer", vocab_size=80000), ["text"],
                  append_eod=True, progress=False)
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert ds.dtype == np.int32
    assert ds[0].tolist() == [1, 2, 70000, 80000] and ds[1].tolist() == [65535, 80000]
