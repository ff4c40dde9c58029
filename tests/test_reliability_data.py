"""Issue 9, data and configuration side: every bad input ends as ONE `error:` line naming the
flag, file or value, exit 2 (usage) or 1 (a stopped run), no traceback, nothing on disk lost.

Each case runs the real command line in a subprocess (one CPU device, no jax for the data tools).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from mlm_jax.data.indexed_dataset import write_indexed_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The brief's tiny model (`T`), on one CPU device.
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--vocab-size", "256", "--train-iters", "2"]


def cli_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MLM_JAX_DEBUG", "XLA_FLAGS")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", MLM_JAX_CPU_DEVICES="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=1", MLM_JAX_CACHE=str(tmp_path / "cache"))
    return env


def run(module: str, args, tmp_path, timeout: float = 180) -> tuple[int, str]:
    p = subprocess.run([sys.executable, "-m", module, *map(str, args)], cwd=tmp_path, env=cli_env(tmp_path),
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stderr


def assert_one_error(rc: int, err: str, code: int, *named: str) -> str:
    """Exit `code`, no traceback, and the last line is `error: ...` naming every `named`."""
    assert rc == code, err
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: "), err
    for text in named:
        assert text in last, (text, last)
    return last


def snapshot(folder) -> dict[str, str]:
    out = {}
    for path in glob.glob(os.path.join(folder, "**", "*"), recursive=True):
        if os.path.isfile(path):
            out[path] = hashlib.md5(open(path, "rb").read()).hexdigest()
    return out


def assert_nothing_lost(before: dict, folder) -> None:
    after = snapshot(folder)
    for path, digest in before.items():
        assert after.get(path) == digest, f"{path} was lost or overwritten"


def jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


# ----------------------------------------------------------------------------- preprocessing

PRE = "mlm_jax.data.preprocess"
NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--no-progress"]


def preprocess_args(src, prefix, *extra):
    return ["--input", src, "--output-prefix", prefix, *NULL, *extra]


@pytest.fixture
def earlier_output(tmp_path):
    """A complete earlier preprocessing output under out/o, which no failed run may touch."""
    src = jsonl(tmp_path / "good.jsonl", [{"text": "1 2 3"}, {"text": "4 5 6 7"}])
    rc, err = run(PRE, preprocess_args(src, tmp_path / "out" / "o"), tmp_path)
    assert rc == 0, err
    return snapshot(tmp_path / "out")


def test_a_full_disk_in_preprocess_names_the_file(tmp_path, capsys, earlier_output):
    """[Errno 28] from a write (here the output's temp .bin is /dev/full, a device every write
    to which fails so) names the file it was writing; the earlier output stays. In-process: the
    temp name carries the process id."""
    from mlm_jax.data import preprocess

    src = jsonl(tmp_path / "big.jsonl", [{"text": " ".join(str(i % 90) for i in range(5000))}] * 20)
    prefix = str(tmp_path / "out" / "o")
    temp = preprocess.output_prefix_for(prefix, "text") + f".tmp-{os.getpid()}.bin"
    os.symlink("/dev/full", temp)
    rc = preprocess.main(preprocess_args(src, prefix))
    assert_one_error(rc, capsys.readouterr().err, 1, "No space left on device", temp)
    assert_nothing_lost(earlier_output, tmp_path / "out")


def test_a_full_disk_under_the_run_names_the_file(tmp_path):
    """The run's metrics file on a full disk (/dev/full): exit 1, one line naming the file."""
    full = tmp_path / "metrics.jsonl"
    os.symlink("/dev/full", full)
    rc, err = run("mlm_jax.train", TINY + ["--mock-data", "--tokenizer-type", "NullTokenizer", "--run-dir",
                                           tmp_path / "run", "--metrics-file", full], tmp_path, timeout=300)
    assert_one_error(rc, err, 1, "No space left on device", str(full))


def test_preprocess_missing_input(tmp_path, earlier_output):
    rc, err = run(PRE, preprocess_args(tmp_path / "nope.jsonl", tmp_path / "out" / "o"), tmp_path)
    assert_one_error(rc, err, 2, "--input", "nope.jsonl: no such file")
    assert_nothing_lost(earlier_output, tmp_path / "out")


def test_preprocess_null_tokenizer_on_words_names_file_and_line(tmp_path, earlier_output):
    src = jsonl(tmp_path / "words.jsonl", [{"text": "1 2"}, {"text": "hello world"}])
    rc, err = run(PRE, preprocess_args(src, tmp_path / "out" / "o"), tmp_path)
    assert_one_error(rc, err, 2, f"{src} line 2", "'hello' is not one", "no output written")
    assert_nothing_lost(earlier_output, tmp_path / "out")
    assert glob.glob(str(tmp_path / "out" / "*.tmp-*")) == []


def test_preprocess_a_lone_surrogate_names_the_line_and_skips_with_the_flag(tmp_path):
    """Issue "reliability, round three": a JSONL line whose text holds a lone surrogate escape
    (`\\udcff`) ended in the tokenizer's `TypeError` without a line number, and
    --skip-bad-lines did not skip it."""
    src = jsonl(tmp_path / "s.jsonl", ['{"text": "1 2"}', '{"text": "3 \\udcff 4"}', '{"text": "5 6"}'])
    rc, err = run(PRE, preprocess_args(src, tmp_path / "o"), tmp_path)
    assert_one_error(rc, err, 2, f"{src} line 2", "lone surrogate", "--skip-bad-lines")
    rc, err = run(PRE, preprocess_args(src, tmp_path / "o", "--skip-bad-lines"), tmp_path)
    assert rc == 0, err
    assert "1 bad line" in err or "skipped" in err, err


def test_generate_refuses_a_prompt_that_is_not_utf8(tmp_path):
    """A non-UTF-8 --prompt (bytes on the command line) is refused naming the flag."""
    p = subprocess.run([sys.executable.encode(), b"-m", b"mlm_jax.generate", b"--load", str(tmp_path).encode(),
                        b"--prompt", b"caf\xe9"], cwd=tmp_path, env=cli_env(tmp_path), capture_output=True,
                       timeout=120)
    err = p.stderr.decode("utf-8", "replace")
    assert_one_error(p.returncode, err, 2, "--prompt: not UTF-8 text (byte 0xe9 at character 3)")


def test_preprocess_null_tokenizer_id_beyond_vocab_size(tmp_path):
    src = jsonl(tmp_path / "ids.jsonl", [{"text": "1 2"}, {"text": "3 100"}])
    rc, err = run(PRE, preprocess_args(src, tmp_path / "o"), tmp_path)
    assert_one_error(rc, err, 2, f"{src} line 2", "token id 100", "--vocab-size 100")
    assert glob.glob(str(tmp_path / "o*")) == []


@pytest.mark.parametrize("lines,shown", [
    ([], "no documents (0 lines)"),
    (["", "{oops"], "all 2 skipped as bad"),
    (['{"text": ""}'], "has no tokens"),
])
def test_preprocess_empty_input_is_an_error(tmp_path, earlier_output, lines, shown):
    src = jsonl(tmp_path / "empty.jsonl", lines)
    rc, err = run(PRE, preprocess_args(src, tmp_path / "out" / "o", "--skip-bad-lines"), tmp_path)
    assert_one_error(rc, err, 2, f"--input {src}", shown)
    assert_nothing_lost(earlier_output, tmp_path / "out")


def test_preprocess_output_prefix_under_a_file(tmp_path):
    src = jsonl(tmp_path / "in.jsonl", [{"text": "1 2"}])
    (tmp_path / "afile").write_text("keep me")
    rc, err = run(PRE, preprocess_args(src, tmp_path / "afile" / "o"), tmp_path)
    assert_one_error(rc, err, 2, "--output-prefix", "afile")
    assert (tmp_path / "afile").read_text() == "keep me"


def test_preprocess_unknown_flag_is_one_line_with_the_closest(tmp_path):
    rc, err = run(PRE, ["--input", "x", "--output-prefix", "y", "--tokenizer-typ", "NullTokenizer"], tmp_path)
    assert_one_error(rc, err, 2, "unknown flag --tokenizer-typ", "did you mean --tokenizer-type?")
    assert len(err.strip().splitlines()) == 1  # no usage screen


def test_preprocess_bad_flag_value(tmp_path):
    rc, err = run(PRE, ["--input", "x", "--output-prefix", "y", "--workers", "two"], tmp_path)
    assert_one_error(rc, err, 2, "--workers", "'two'")


def gpt2_args(vocab, merges):
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]


def test_preprocess_vocab_json_not_json(tmp_path):
    src = jsonl(tmp_path / "in.jsonl", [{"text": "hi"}])
    (tmp_path / "vocab.json").write_text('{"a": 0,\n garbage')
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b\n")
    rc, err = run(PRE, ["--input", src, "--output-prefix", tmp_path / "o", "--no-progress",
                        *gpt2_args(tmp_path / "vocab.json", tmp_path / "merges.txt")], tmp_path)
    assert_one_error(rc, err, 2, f"--vocab-file {tmp_path / 'vocab.json'}", "not valid JSON at line 2")


def test_preprocess_garbage_merges(tmp_path):
    src = jsonl(tmp_path / "in.jsonl", [{"text": "hi"}])
    (tmp_path / "vocab.json").write_text(json.dumps({"a": 0, "b": 1, "<|endoftext|>": 2}))
    (tmp_path / "merges.txt").write_text("#version: 0.2\na b c d\n")
    rc, err = run(PRE, ["--input", src, "--output-prefix", tmp_path / "o", "--no-progress",
                        *gpt2_args(tmp_path / "vocab.json", tmp_path / "merges.txt")], tmp_path)
    assert_one_error(rc, err, 2, f"--merge-file {tmp_path / 'merges.txt'} line 2")


def test_preprocess_sentencepiece_path_not_a_model(tmp_path):
    src = jsonl(tmp_path / "in.jsonl", [{"text": "hi"}])
    (tmp_path / "tok.model").write_text("not a model")
    rc, err = run(PRE, ["--input", src, "--output-prefix", tmp_path / "o", "--no-progress", "--tokenizer-type",
                        "GPTSentencePieceTokenizer", "--tokenizer-model", tmp_path / "tok.model"], tmp_path)
    assert_one_error(rc, err, 2, f"--tokenizer-model {tmp_path / 'tok.model'}", "not a SentencePiece model")


def test_preprocess_missing_tokenizer_file(tmp_path):
    src = jsonl(tmp_path / "in.jsonl", [{"text": "hi"}])
    rc, err = run(PRE, ["--input", src, "--output-prefix", tmp_path / "o", "--no-progress", "--tokenizer-type",
                        "HuggingFaceTokenizer", "--tokenizer-model", tmp_path / "nope"], tmp_path)
    assert_one_error(rc, err, 2, f"--tokenizer-model {tmp_path / 'nope'}", "no tokenizer.json")


def big_input(path, lines=300_000) -> str:
    row = np.arange(40) % 97
    with open(path, "w") as f:
        for i in range(lines):
            f.write('{"text": "' + " ".join(map(str, (row + i) % 97)) + '"}\n')
    return str(path)


@pytest.mark.parametrize("sig,workers", [(signal.SIGINT, 1), (signal.SIGINT, 2), (signal.SIGTERM, 1),
                                         (signal.SIGTERM, 2)], ids=["int-1", "int-2", "term-1", "term-2"])
def test_interrupted_preprocessing_leaves_no_temporary_files(tmp_path, earlier_output, sig, workers):
    """Ctrl-C or SIGTERM mid-run: exit 130 / 1 with one line, no `.tmp-PID` orphans, and the
    earlier complete output untouched."""
    src = big_input(tmp_path / "big.jsonl")
    args = preprocess_args(src, tmp_path / "out" / "o", "--workers", workers)
    p = subprocess.Popen([sys.executable, "-m", PRE, *map(str, args)],
                         cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    deadline = time.time() + 60
    while not glob.glob(str(tmp_path / "out" / "*.tmp-*.bin")) and time.time() < deadline and p.poll() is None:
        time.sleep(0.02)
    assert p.poll() is None, "preprocessing ended before it could be interrupted"
    time.sleep(0.3)  # mid-run: workers started, tokens being written
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert_one_error(p.returncode, err, 130, "interrupted")
    else:
        assert_one_error(p.returncode, err, 1, "stopped by SIGTERM", "no output written")
    assert glob.glob(str(tmp_path / "out" / "*.tmp-*")) == []
    assert_nothing_lost(earlier_output, tmp_path / "out")


def _workers_of(pid: int) -> list[int]:
    """The pids of `pid`'s spawned multiprocessing workers (Linux /proc)."""
    found = []
    for child in open(f"/proc/{pid}/task/{pid}/children").read().split():
        with contextlib.suppress(FileNotFoundError):
            if b"spawn_main" in open(f"/proc/{child}/cmdline", "rb").read():
                found.append(int(child))
    return found


def test_preprocessing_worker_killed_is_named(tmp_path, earlier_output):
    """A worker killed from outside (the kernel's OOM killer) stops the run with one line naming
    it and its exit code, at once, with no temporaries left and earlier output untouched."""
    src = big_input(tmp_path / "big.jsonl")
    args = preprocess_args(src, tmp_path / "out" / "o", "--workers", 2)
    p = subprocess.Popen([sys.executable, "-m", PRE, *map(str, args)],
                         cwd=tmp_path, env=cli_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    deadline = time.time() + 60
    workers = []
    while len(workers) < 2 and time.time() < deadline and p.poll() is None:
        time.sleep(0.02)
        workers = _workers_of(p.pid)
    time.sleep(0.3)  # mid-run: workers started, tokens being written
    assert p.poll() is None and len(workers) == 2, "preprocessing ended before a worker could be killed"
    os.kill(workers[0], signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert_one_error(p.returncode, err, 1, "preprocessing worker", "stopped unexpectedly", "exit code -9",
                     "no output written")
    assert glob.glob(str(tmp_path / "out" / "*.tmp-*")) == []
    assert_nothing_lost(earlier_output, tmp_path / "out")


# ----------------------------------------------------------------------------- inspect, train_tokenizer

INSPECT = "mlm_jax.data.inspect"


def small_dataset(tmp_path, max_id=50) -> str:
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, max_id, size=60) for _ in range(40)]
    docs[0][0] = max_id
    return write_indexed_dataset(str(tmp_path / "d"), docs, dtype=np.uint16)


def test_inspect_missing_data_path(tmp_path):
    rc, err = run(INSPECT, ["--data-path", tmp_path / "nope", "--seq-length", "8", "--train-samples", "4",
                            "--show", "0:1"], tmp_path)
    assert_one_error(rc, err, 2, str(tmp_path / "nope.idx"), "missing")


def test_a_bin_linked_to_a_device_file_is_not_a_regular_file(tmp_path):
    """Issue "reliability, round three": a `.bin` symlinked to /dev/zero was called missing."""
    prefix = small_dataset(tmp_path)
    os.unlink(prefix + ".bin")
    os.symlink("/dev/zero", prefix + ".bin")
    rc, err = run(INSPECT, ["--data-path", prefix, "--seq-length", "8", "--train-samples", "4", "--show", "0:1"],
                  tmp_path)
    line = assert_one_error(rc, err, 2, f"{prefix}.bin", "not a regular file", "/dev/zero")
    assert "missing" not in line


def test_inspect_truncated_bin(tmp_path):
    prefix = small_dataset(tmp_path)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(100)
    before = snapshot(tmp_path)
    rc, err = run(INSPECT, ["--data-path", prefix, "--seq-length", "8", "--train-samples", "4", "--show", "0:1"],
                  tmp_path)
    assert_one_error(rc, err, 2, f"{prefix}.bin", "does not match its index")
    assert_nothing_lost(before, tmp_path)


def test_inspect_bad_idx(tmp_path):
    prefix = small_dataset(tmp_path)
    with open(prefix + ".idx", "r+b") as f:
        f.write(b"GARBAGE!!")
    rc, err = run(INSPECT, ["--data-path", prefix, "--seq-length", "8", "--train-samples", "4", "--show", "0:1"],
                  tmp_path)
    assert_one_error(rc, err, 2, f"{prefix}.idx", "bad magic")


def test_inspect_bad_split(tmp_path):
    prefix = small_dataset(tmp_path)
    rc, err = run(INSPECT, ["--data-path", prefix, "--split", "1,2,3,4", "--seq-length", "8", "--train-samples",
                            "4", "--show", "0:1"], tmp_path)
    assert_one_error(rc, err, 2, "--split '1,2,3,4'")


def test_inspect_ids_beyond_the_vocab(tmp_path):
    prefix = small_dataset(tmp_path, max_id=300)
    rc, err = run(INSPECT, ["--data-path", prefix, "--seq-length", "8", "--train-samples", "4", "--show", "0:1",
                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "200"], tmp_path)
    assert_one_error(rc, err, 2, f"{prefix}.bin", "token ids up to 300", "vocab has 201 tokens")


def test_inspect_rebuilds_a_damaged_index_cache(tmp_path):
    """Bad metadata: a truncated cached sample index (or a garbage token-range entry) is rebuilt
    and the same samples are shown, never a traceback or other samples."""
    prefix = small_dataset(tmp_path)
    args = ["--data-path", prefix, "--split", "1", "--seq-length", "8", "--train-samples", "6", "--show", "0:6",
            "--json", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    p = subprocess.run([sys.executable, "-m", INSPECT, *args], cwd=tmp_path, env=cli_env(tmp_path),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    indices = glob.glob(prefix + "/cache/GPTDataset_indices/*-sample_index.npy")
    ranges = glob.glob(prefix + "/cache/GPTDataset_indices/*-TokenRange.json")
    assert indices and ranges
    for path in indices:
        open(path, "r+b").truncate(20)
    for path in ranges:
        open(path, "w").write("garbage")
    again = subprocess.run([sys.executable, "-m", INSPECT, *args], cwd=tmp_path, env=cli_env(tmp_path),
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "Traceback" not in again.stderr, again.stderr
    assert json.loads(again.stdout) == json.loads(p.stdout)


def test_train_tokenizer_missing_input(tmp_path):
    rc, err = run("mlm_jax.data.train_tokenizer", ["--input", tmp_path / "nope.txt", "--model-prefix",
                                                   tmp_path / "tok", "--vocab-size", "100"], tmp_path)
    assert_one_error(rc, err, 2, "--input", "nope.txt: no such file")
    assert not os.path.exists(tmp_path / "tok.model")


def test_train_tokenizer_model_prefix_under_a_file(tmp_path):
    (tmp_path / "in.txt").write_text("hello world\n" * 50)
    (tmp_path / "afile").write_text("keep")
    rc, err = run("mlm_jax.data.train_tokenizer", ["--input", tmp_path / "in.txt", "--model-prefix",
                                                   tmp_path / "afile" / "tok", "--vocab-size", "20"], tmp_path)
    assert_one_error(rc, err, 2, f"--model-prefix {tmp_path / 'afile' / 'tok'}")
    assert (tmp_path / "afile").read_text() == "keep"


def test_train_tokenizer_never_overwrites_a_model_unless_asked(tmp_path):
    """Issue "reliability, round three": `--model-prefix P` where P.model exists was overwritten
    silently (a dataset made with the old model then failed on its vocab). Refused unless
    --overwrite; with it, the new model replaces both files."""
    (tmp_path / "in.txt").write_text("hello world, the quick brown fox\n" * 50)
    args = ["--input", tmp_path / "in.txt", "--model-prefix", tmp_path / "tok", "--vocab-size", "300"]
    rc, err = run("mlm_jax.data.train_tokenizer", args, tmp_path)
    assert rc == 0, err
    first = (tmp_path / "tok.model").read_bytes()
    rc, err = run("mlm_jax.data.train_tokenizer", args[:-1] + ["310"], tmp_path)
    assert_one_error(rc, err, 2, f"--model-prefix {tmp_path / 'tok'}", f"{tmp_path / 'tok.model'} exists", "--overwrite")
    assert (tmp_path / "tok.model").read_bytes() == first
    rc, err = run("mlm_jax.data.train_tokenizer", args[:-1] + ["310", "--overwrite"], tmp_path)
    assert rc == 0, err
    assert (tmp_path / "tok.model").read_bytes() != first
    assert sorted(os.listdir(tmp_path)) == ["in.txt", "tok.model", "tok.vocab"]  # no temporary left


# ----------------------------------------------------------------------------- python -m mlm_jax.train: flags

TRAIN = "mlm_jax.train"
MOCK = ["--mock-data", *TINY]


def test_train_negative_lr_parses_and_is_refused_with_the_rule(tmp_path):
    rc, err = run(TRAIN, [*MOCK, "--lr", "-1e-3"], tmp_path)
    assert_one_error(rc, err, 2, "--lr must be >= 0, got -0.001")


def test_train_yaml_fractional_int(tmp_path):
    (tmp_path / "c.yaml").write_text("num-layers: 2.5\n")
    rc, err = run(TRAIN, [*MOCK, "--config", "c.yaml"], tmp_path)
    assert_one_error(rc, err, 2, "--config c.yaml", "num-layers", "2.5 is not an integer")


def test_train_yaml_null_value(tmp_path):
    (tmp_path / "c.yaml").write_text("hidden-size:\n")
    rc, err = run(TRAIN, [*MOCK, "--config", "c.yaml"], tmp_path)
    assert_one_error(rc, err, 2, "--config c.yaml", "hidden-size has no value")


def test_train_unknown_flag_is_one_line(tmp_path):
    rc, err = run(TRAIN, [*MOCK, "--nm-layers", "3"], tmp_path)
    assert_one_error(rc, err, 2, "unknown flag --nm-layers; did you mean --num-layers?")
    assert len(err.strip().splitlines()) == 1


def test_train_bad_flag_value_is_one_line(tmp_path):
    rc, err = run(TRAIN, [*MOCK, "--num-layers", "two"], tmp_path)
    assert_one_error(rc, err, 2, "--num-layers", "'two'")
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("split", ["90,x", "1,2,3,4", "-5,3,2"])
def test_train_bad_split(tmp_path, split):
    rc, err = run(TRAIN, [*MOCK, "--split", split], tmp_path)
    assert_one_error(rc, err, 2, f"--split {split!r}")


# ----------------------------------------------------------------------------- python -m mlm_jax.train: data
# These need train.py's main to end through `mlm_jax.cli` (the train/checkpoint helper's change):
# the data module raises UsageErrors with the right message; main must print them as one line.


def test_train_missing_data_path(tmp_path):
    rc, err = run(TRAIN, [*TINY, "--data-path", tmp_path / "nope", "--tokenizer-type", "NullTokenizer"], tmp_path)
    assert_one_error(rc, err, 2, str(tmp_path / "nope"), "missing")


def test_train_token_ids_beyond_the_vocab(tmp_path):
    prefix = small_dataset(tmp_path, max_id=1000)
    before = snapshot(tmp_path)
    rc, err = run(TRAIN, [*TINY, "--data-path", prefix, "--split", "1", "--tokenizer-type", "NullTokenizer",
                          "--run-dir", tmp_path / "run"], tmp_path)
    assert_one_error(rc, err, 2, f"{prefix}.bin", "token ids up to 1000", "vocab has 257 tokens")
    assert_nothing_lost(before, tmp_path)


def test_train_truncated_bin(tmp_path):
    prefix = small_dataset(tmp_path)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(64)
    rc, err = run(TRAIN, [*TINY, "--data-path", prefix, "--split", "1", "--tokenizer-type", "NullTokenizer"],
                  tmp_path)
    assert_one_error(rc, err, 2, f"{prefix}.bin", "does not match its index")


def test_train_bad_tokenizer_file(tmp_path):
    prefix = small_dataset(tmp_path)
    (tmp_path / "vocab.json").write_text("not json at all")
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    rc, err = run(TRAIN, [*TINY, "--data-path", prefix, "--split", "1",
                          *gpt2_args(tmp_path / "vocab.json", tmp_path / "merges.txt")], tmp_path)
    assert_one_error(rc, err, 2, f"--vocab-file {tmp_path / 'vocab.json'}", "not valid JSON at line 1")



def test_mock_data_with_an_end_of_document_id_of_0(tmp_path):
    """Issue "reliability, round three": --mock-data with a GPT-2 BPE vocabulary whose
    `<|endoftext|>` is id 0 was refused ("at least 3 tokens, got eod 0"); it trains, the mock
    tokens stepping over id 0."""
    from mlm_jax.data.gpt_dataset import MockLowLevelDataset

    low = MockLowLevelDataset(0, 50)
    for i in range(20):
        doc = low.get(i)
        assert doc[-1] == 0 and (doc[:-1] > 0).all() and (doc < 50).all()
    vocab = {"<|endoftext|>": 0, **{chr(c): i + 1 for i, c in enumerate(range(ord("a"), ord("z") + 1))}}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    rc, err = run(TRAIN, [*MOCK, "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", tmp_path / "vocab.json",
                          "--merge-file", tmp_path / "merges.txt", "--train-iters", "1", "--run-dir", tmp_path / "r"],
                  tmp_path)
    assert rc == 0, err[-3000:]


def test_megatron_s_default_split_trains_on_a_small_corpus(tmp_path):
    """Issue "reliability, round three": `--split 969,30,1` on a 40-document corpus was refused
    because the 1 % test split held no document; training never reads the test split, so it
    trains (an empty split that nothing reads is no error)."""
    prefix = small_dataset(tmp_path)
    rc, err = run(TRAIN, [*TINY, "--data-path", prefix, "--split", "969,30,1", "--tokenizer-type", "NullTokenizer",
                          "--vocab-size", "100", "--train-iters", "2", "--run-dir", tmp_path / "run"], tmp_path)
    assert rc == 0, err[-3000:]


def test_a_resumed_run_whose_validation_data_is_used_up_says_so(tmp_path):
    """Issue "reliability, round three": a resumed run whose validation data was used up ended
    with `done: no validation` and no reason. The validation data is sized for the run's own
    evaluations from iteration 0; a first run that evaluated far more has read past what the
    resumed run's flags size: one line says so when it happens, and the last line why."""
    prefix = small_dataset(tmp_path)
    common = [*TINY, "--data-path", prefix, "--split", "50,50,0", "--tokenizer-type", "NullTokenizer",
              "--vocab-size", "100", "--save", tmp_path / "ck", "--eval-iters"]
    rc, err = run(TRAIN, common + ["10", "--eval-interval", "1", "--train-iters", "3", "--run-dir", tmp_path / "r1"],
                  tmp_path)
    assert rc == 0, err[-3000:]
    p = subprocess.run([sys.executable, "-m", TRAIN, *map(str, common + [
        "1", "--eval-interval", "5", "--train-iters", "5", "--load", tmp_path / "ck", "--run-dir", tmp_path / "r2"])],
        cwd=tmp_path, env=cli_env(tmp_path), capture_output=True, text=True, timeout=180)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "> validation at iteration 5: the validation data is used up" in out, out[-3000:]
    assert "> done: no validation (the validation data was used up at iteration 5)" in out, out[-3000:]
