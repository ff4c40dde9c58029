"""Tokenize a JSON-lines corpus into Megatron indexed datasets (Megatron's preprocess_data.py).

    python -m mlm_jax.data.preprocess --input docs.jsonl --output-prefix out --json-keys text \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 4

writes `out_text_document.bin/.idx` (one pair per JSON key), byte-identical to what
Megatron-LM's tools/preprocess_data.py writes for the same tokenizer, and identical for any
`--workers`. Each line is one document; with `--append-eod` its last sequence ends with EOD
(an empty text stays an empty document, as in Megatron). A bad line (invalid JSON or UTF-8,
not an object, missing key, non-string value) stops the run with its line number, or with
`--skip-bad-lines` is counted, reported and skipped for every key. Outputs are written under
temporary names and renamed only when complete, so a stopped run never leaves a pair that
looks finished.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from mlm_jax.data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from mlm_jax.data.tokenizers import make_tokenizer

LINES_PER_TASK = 256
MAX_REPORTED_BAD_LINES = 20


class BadLineError(ValueError):
    """A line of the input that cannot be used; the message names its line number."""


@dataclass
class ChunkResult:
    """One task's output: per key the tokens and per-document lengths; bad lines by number."""

    first_line: int
    num_lines: int
    nbytes: int
    tokens: dict[str, np.ndarray] = field(default_factory=dict)
    doc_lengths: dict[str, list[int]] = field(default_factory=dict)
    bad: list[tuple[int, str]] = field(default_factory=list)


_worker_state: dict = {}


def _init_worker(tokenizer_kwargs: dict, json_keys: list[str], append_eod: bool) -> None:
    _worker_state["tokenizer"] = make_tokenizer(**tokenizer_kwargs)
    _worker_state["keys"] = json_keys
    _worker_state["append_eod"] = append_eod


def _parse_line(raw: bytes, keys: list[str]) -> list[str]:
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadLineError(f"invalid UTF-8 ({e.reason} at byte {e.start})") from None
    if not line.strip():
        raise BadLineError("empty line")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise BadLineError(f"invalid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise BadLineError(f"a JSON {type(obj).__name__}, not an object")
    texts = []
    for key in keys:
        if key not in obj:
            raise BadLineError(f"missing key {key!r}")
        if not isinstance(obj[key], str):
            raise BadLineError(f"key {key!r} is a JSON {type(obj[key]).__name__}, not a string")
        texts.append(obj[key])
    return texts


def _encode_chunk(task: tuple[int, list[bytes]]) -> ChunkResult:
    first_line, lines = task
    tok, keys, append_eod = _worker_state["tokenizer"], _worker_state["keys"], _worker_state["append_eod"]
    result = ChunkResult(first_line, len(lines), sum(len(x) for x in lines))
    good: list[list[str]] = []
    for n, raw in enumerate(lines):
        try:
            good.append(_parse_line(raw, keys))
        except BadLineError as e:
            result.bad.append((first_line + n, str(e)))
    for k, key in enumerate(keys):
        parts, lengths = [], []
        for texts in good:
            ids = tok.tokenize(texts[k]) if texts[k] else []
            if ids and append_eod:
                ids = [*ids, tok.eod]
            parts.append(ids)
            lengths.append(len(ids))
        flat = np.fromiter((t for p in parts for t in p), dtype=np.int64, count=sum(lengths))
        result.tokens[key] = flat
        result.doc_lengths[key] = lengths
    return result


def _read_tasks(path: str, lines_per_task: int):
    with open(path, "rb") as f:
        line_no, batch = 1, []
        for raw in f:
            batch.append(raw)
            if len(batch) == lines_per_task:
                yield line_no, batch
                line_no += len(batch)
                batch = []
        if batch:
            yield line_no, batch


def _ordered_results(tasks, workers: int, init_args: tuple):
    """Results in input order; at most 2 tasks per worker in flight, so memory stays bounded."""
    if workers <= 1:
        _init_worker(*init_args)
        for task in tasks:
            yield _encode_chunk(task)
        return
    ctx = multiprocessing.get_context("spawn")
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    try:
        pool = ctx.Pool(workers, initializer=_init_worker, initargs=init_args)
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    try:
        pending = collections.deque()
        for task in tasks:
            pending.append(pool.apply_async(_encode_chunk, (task,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


def preprocess(
    input_path: str,
    output_prefix: str,
    tokenizer_kwargs: dict,
    json_keys: list[str] = ("text",),
    append_eod: bool = False,
    workers: int = 1,
    skip_bad_lines: bool = False,
    progress: bool = True,
    lines_per_task: int = LINES_PER_TASK,
) -> dict:
    """Run the preprocessing; returns a summary dict. Raises BadLineError on a bad line
    (unless `skip_bad_lines`), after removing the partial outputs."""
    json_keys = list(json_keys)
    if not os.path.isfile(input_path):
        raise FileNotFoundError(f"--input {input_path}: no such file")
    tokenizer = make_tokenizer(**tokenizer_kwargs)
    dtype = optimal_dtype(tokenizer.vocab_size)
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    os.makedirs(out_dir, exist_ok=True)
    finals = {k: output_prefix_for(output_prefix, k) for k in json_keys}
    tmp_tag = f".tmp-{os.getpid()}"
    temps = {k: (finals[k] + tmp_tag + ".bin", finals[k] + tmp_tag + ".idx") for k in json_keys}
    builders = {k: IndexedDatasetBuilder(temps[k][0], dtype) for k in json_keys}
    total_bytes = os.path.getsize(input_path)

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000, desc="preprocess",
                   file=sys.stderr, dynamic_ncols=True)
    t0 = time.perf_counter()
    docs = lines = nbytes = 0
    bad: list[tuple[int, str]] = []
    tokens = {k: 0 for k in json_keys}
    finished = False
    try:
        tasks = _read_tasks(input_path, lines_per_task)
        ordered_results = _ordered_results(tasks, workers, (tokenizer_kwargs, json_keys, append_eod))
        # closing(): on a bad line the pool is terminated now, not whenever the generator is collected.
        with contextlib.closing(ordered_results) as ordered:
            for res in ordered:
                if res.bad and not skip_bad_lines:
                    line_no, reason = res.bad[0]
                    raise BadLineError(
                        f"{input_path} line {line_no}: {reason}; fix the line or pass --skip-bad-lines"
                    )
                bad.extend(res.bad)
                for k in json_keys:
                    builders[k].add_documents(res.tokens[k], res.doc_lengths[k])
                    tokens[k] += int(res.tokens[k].size)
                docs += res.num_lines - len(res.bad)
                lines += res.num_lines
                nbytes += res.nbytes
                if bar is not None:
                    bar.update(res.nbytes)
                    elapsed = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix_str(f"{docs / elapsed:,.0f} docs/s", refresh=False)
        for k in json_keys:
            builders[k].finalize(temps[k][1])
        # Rename the .bin first and the .idx last: an .idx only ever appears beside its full .bin.
        for k in json_keys:
            if os.path.exists(finals[k] + ".idx"):
                os.unlink(finals[k] + ".idx")
            os.replace(temps[k][0], finals[k] + ".bin")
            os.replace(temps[k][1], finals[k] + ".idx")
        finished = True
    finally:
        if bar is not None:
            bar.close()
        if not finished:
            for k in json_keys:
                builders[k].abort()
                for p in temps[k]:
                    if os.path.exists(p):
                        os.unlink(p)
    elapsed = time.perf_counter() - t0
    return {
        "input": input_path,
        "outputs": {k: finals[k] for k in json_keys},
        "lines": lines,
        "documents": docs,
        "bad_lines": len(bad),
        "bad_line_examples": bad[:MAX_REPORTED_BAD_LINES],
        "tokens": tokens,
        "dtype": np.dtype(dtype).name,
        "seconds": elapsed,
        "docs_per_s": docs / max(elapsed, 1e-9),
        "mb_per_s": nbytes / 1e6 / max(elapsed, 1e-9),
        "workers": workers,
    }


def add_tokenizer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")


def tokenizer_kwargs_from(args) -> dict:
    return dict(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlm_jax.data.preprocess", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, help="JSON-lines file, one document per line")
    p.add_argument("--output-prefix", required=True)
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--append-eod", action="store_true")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--skip-bad-lines", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    add_tokenizer_args(p)
    args = p.parse_args(argv)
    if args.tokenizer_type is None:
        p.error("--tokenizer-type is required")
    if args.workers < 1:
        p.error("--workers must be at least 1")
    try:
        s = preprocess(args.input, args.output_prefix, tokenizer_kwargs_from(args), args.json_keys,
                       args.append_eod, args.workers, args.skip_bad_lines, not args.no_progress)
    except (BadLineError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        print("no output written", file=sys.stderr)
        return 1
    for line_no, reason in s["bad_line_examples"]:
        print(f"skipped line {line_no}: {reason}", file=sys.stderr)
    if s["bad_lines"] > len(s["bad_line_examples"]):
        print(f"... and {s['bad_lines'] - len(s['bad_line_examples'])} more bad lines", file=sys.stderr)
    print(f"processed {s['documents']} documents ({s['lines']} lines, {s['bad_lines']} bad lines skipped) "
          f"in {s['seconds']:.1f} s: {s['docs_per_s']:,.0f} docs/s, {s['mb_per_s']:.2f} MB/s "
          f"with {s['workers']} worker(s)")
    for k, prefix in s["outputs"].items():
        print(f"  {k}: {s['tokens'][k]} tokens ({s['dtype']}) -> {prefix}.bin / {prefix}.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
