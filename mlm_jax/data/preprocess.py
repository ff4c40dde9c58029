"""Tokenize a JSON-lines corpus into Megatron indexed datasets (Megatron's preprocess_data.py).

    python -m mlm_jax.data.preprocess --input docs.jsonl --output-prefix out --json-keys text \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 4

writes `out_text_document.bin/.idx` (one pair per JSON key), byte-identical to what
Megatron-LM's tools/preprocess_data.py writes for the same tokenizer, and identical for any
`--workers`. Each line is one document; with `--append-eod` its last sequence ends with EOD
(an empty text stays an empty document, as in Megatron). A bad line (invalid JSON or UTF-8,
not an object, missing key, non-string value) stops the run with its line number, or with
`--skip-bad-lines` is counted, reported and skipped for every key; with NullTokenizer a word or
an id outside [0, --vocab-size) is a bad line. An input with no documents, or no tokens for a
key, is an error rather than an empty dataset. Outputs are written under temporary names,
renamed only when complete and removed on any failure, Ctrl-C (exit 130) or SIGTERM (exit 1;
both stop at once, killing the workers mid-document rather than waiting for their tasks),
so a stopped run leaves neither a pair that looks finished nor temporary files, and an
earlier complete output stays as it was. Usage errors exit 2 with one `error:` line.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from mlm_jax import errors
from mlm_jax.cli import cli
from mlm_jax.data.indexed_dataset import IndexedDatasetBuilder, optimal_dtype
from mlm_jax.data.tokenizers import TokenizerError, make_tokenizer
from mlm_jax.paths import not_there, writable_dir

LINES_PER_TASK = 256
MAX_REPORTED_BAD_LINES = 20


class BadLineError(errors.UsageError):
    """A line of the input that cannot be used; the message names its line number."""


class InputError(errors.UsageError):
    """An --input or --output-prefix that cannot be used, or an input with nothing to write."""


class PreprocessStopped(errors.RunFailure):
    """SIGTERM during preprocessing; the temporary outputs were removed."""


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


def _init_pool_worker(*args) -> None:
    # Ctrl-C (and a scheduler's SIGTERM) can reach the whole process group: only the parent
    # handles them (and kills the pool), so workers print no tracebacks of their own and the
    # parent's error is not replaced by a broken pool's.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker
    _init_worker(*args)


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
        try:
            obj[key].encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate escape (\udcff): no text a tokenizer reads
            raise BadLineError(f"key {key!r} holds a lone surrogate ({obj[key][e.start]!r} at character "
                               f"{e.start}), not text") from None
        texts.append(obj[key])
    return texts


def _encode_text(tok, key: str, text: str, append_eod: bool) -> list[int]:
    try:
        ids = tok.tokenize(text) if text else []
    except TokenizerError as e:  # e.g. NullTokenizer given words, or an id beyond --vocab-size
        raise BadLineError(f"key {key!r}: {e}") from None
    return [*ids, tok.eod] if ids and append_eod else ids


def _encode_chunk(task: tuple[int, list[bytes]]) -> ChunkResult:
    first_line, lines = task
    tok, keys, append_eod = _worker_state["tokenizer"], _worker_state["keys"], _worker_state["append_eod"]
    result = ChunkResult(first_line, len(lines), sum(len(x) for x in lines))
    good: list[list[list[int]]] = []  # [line][key] -> token ids
    for n, raw in enumerate(lines):
        try:
            texts = _parse_line(raw, keys)
            good.append([_encode_text(tok, key, text, append_eod) for key, text in zip(keys, texts)])
        except BadLineError as e:
            result.bad.append((first_line + n, str(e)))
    for k, key in enumerate(keys):
        lengths = [len(ids[k]) for ids in good]
        result.tokens[key] = np.fromiter((t for ids in good for t in ids[k]), dtype=np.int64, count=sum(lengths))
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


def _worker_main(conn, init_args: tuple) -> None:
    """One worker: a thread receives tasks as soon as they are sent (so the parent's send never
    waits on this worker's send of a result: no deadlock on full pipes), the main thread encodes
    them in order and sends each result back, or the exception it raised."""
    _init_pool_worker(*init_args)
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def receive() -> None:
        try:
            while True:
                task = conn.recv()
                inbox.put(task)
                if task is None:
                    return
        except (EOFError, OSError):  # the parent closed the pipe
            inbox.put(None)

    threading.Thread(target=receive, daemon=True).start()
    while (task := inbox.get()) is not None:
        try:
            reply = (True, _encode_chunk(task))
        except Exception as e:  # noqa: BLE001 - sent to the parent, which raises it
            reply = (False, e)
        try:
            conn.send(reply)
        except (BrokenPipeError, EOFError, OSError):
            return
        except Exception as e:  # noqa: BLE001 - an exception that does not pickle
            conn.send((False, RuntimeError(f"{type(e).__name__}: {e}")))


class _Workers:
    """`n` worker processes the parent owns, one pipe each; task i goes to worker i mod n, so
    results come back in input order by reading the workers in turn.

    Not `concurrent.futures` nor `multiprocessing.Pool`: stopped early (a bad line, Ctrl-C,
    SIGTERM) their workers must be killed at once (one huge document holds a worker for
    minutes, longer than a scheduler waits between SIGTERM and SIGKILL), and a worker killed
    while sending a result leaves the executor's manager thread blocked on the half-sent message,
    which the interpreter then waits for at exit (a hang seen here); Pool can deadlock in
    `terminate()` on the queue lock an idle worker holds. Here only the parent's main thread
    reads, so killing the workers and closing the pipes is the whole cleanup.
    """

    def __init__(self, n: int, init_args: tuple):
        ctx = multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        try:
            for _ in range(n):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_worker_main, args=(child, init_args), daemon=True)
                proc.start()
                child.close()
                self.procs.append(proc)
                self.conns.append(parent)
        except BaseException:
            self.kill()
            raise

    def _died(self, w: int) -> errors.RunFailure:
        proc = self.procs[w]
        proc.join(1)
        return errors.RunFailure(f"preprocessing worker {w + 1} of {len(self.procs)} stopped unexpectedly "
                                 f"(exit code {proc.exitcode}; killed for lack of memory? try fewer --workers); "
                                 "no output written")

    def send(self, w: int, task) -> None:
        try:
            self.conns[w].send(task)
        except (BrokenPipeError, OSError):
            raise self._died(w) from None

    def receive(self, w: int):
        try:
            ok, value = self.conns[w].recv()
        except (EOFError, OSError):
            raise self._died(w) from None
        if not ok:
            raise value
        return value

    def close(self) -> None:
        """Finished: tell each worker to stop, give it a moment, then kill what is left."""
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self.procs:
            proc.join(5)
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(Exception):  # already gone
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(Exception):
                proc.join(5)
                proc.close()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


def _ordered_results(tasks, workers: int, init_args: tuple):
    """Results in input order; at most 2 tasks per worker in flight, so memory stays bounded."""
    if workers <= 1:
        _init_worker(*init_args)
        for task in tasks:
            yield _encode_chunk(task)
        return
    pool = _Workers(workers, init_args)
    finished = False
    try:
        in_flight: collections.deque[int] = collections.deque()
        for i, task in enumerate(tasks):
            pool.send(i % workers, task)
            in_flight.append(i % workers)
            if len(in_flight) >= 2 * workers:
                yield pool.receive(in_flight.popleft())
        while in_flight:
            yield pool.receive(in_flight.popleft())
        finished = True
    finally:
        if finished:
            pool.close()
        else:
            pool.kill()


def output_prefix_for(output_prefix: str, key: str) -> str:
    return f"{output_prefix}_{key}_document"


class _Outputs:
    """The .bin/.idx pair of every key, written under `<final>.tmp-<pid>` names and renamed only
    by `commit`; leaving the `with` block any other way (error, Ctrl-C, SIGTERM) removes them,
    so a stopped run leaves neither orphans nor a pair that looks finished, and an earlier
    complete output stays as it was."""

    def __init__(self, output_prefix: str, json_keys: list[str], dtype):
        self.keys, self.dtype = json_keys, dtype
        self.finals = {k: output_prefix_for(output_prefix, k) for k in json_keys}
        tag = f".tmp-{os.getpid()}"
        self.temps = {k: (self.finals[k] + tag + ".bin", self.finals[k] + tag + ".idx") for k in json_keys}
        self.builders: dict[str, IndexedDatasetBuilder] = {}
        self.committed = False

    def __enter__(self) -> "_Outputs":
        try:
            for k in self.keys:
                self.builders[k] = IndexedDatasetBuilder(self.temps[k][0], self.dtype)
        except BaseException:
            self._discard()
            raise
        return self

    def add(self, res: ChunkResult) -> None:
        for k in self.keys:
            self.builders[k].add_documents(res.tokens[k], res.doc_lengths[k])

    def commit(self) -> None:
        for k in self.keys:
            self.builders[k].finalize(self.temps[k][1])
        # Rename the .bin first and the .idx last: an .idx only ever appears beside its full .bin.
        for k in self.keys:
            if os.path.exists(self.finals[k] + ".idx"):
                os.unlink(self.finals[k] + ".idx")
            os.replace(self.temps[k][0], self.finals[k] + ".bin")
            os.replace(self.temps[k][1], self.finals[k] + ".idx")
        self.committed = True

    def _discard(self) -> None:
        for k in self.keys:
            if k in self.builders:
                self.builders[k].abort()
            for p in self.temps[k]:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(p)

    def __exit__(self, *exc) -> None:
        if not self.committed:
            self._discard()


@contextlib.contextmanager
def _sigterm_raises():
    """SIGTERM (a job scheduler's stop) raises PreprocessStopped, so cleanup runs as for Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise PreprocessStopped("preprocessing stopped by SIGTERM; no output written")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check_paths(input_path: str, output_prefix: str) -> None:
    why = not_there(input_path, "file")
    if why:
        raise InputError(f"--input {input_path}: {why}; give a JSON-lines file, one document per line")
    if not os.access(input_path, os.R_OK):
        raise InputError(f"--input {input_path}: not readable")
    out_dir = os.path.dirname(os.path.abspath(output_prefix))
    try:  # a real write, as training's output paths: os.access says yes to root on a read-only folder
        writable_dir(out_dir, "--output-prefix", output_prefix)
    except errors.UsageError as e:
        raise InputError(str(e)) from None
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise InputError(f"--output-prefix {output_prefix}: cannot create the folder {out_dir} ({e.strerror or e})") from None


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
    (unless `skip_bad_lines`) and InputError when there is nothing to write (no documents,
    or no tokens for a key); in every failure no output is written and none is left behind."""
    json_keys = list(json_keys)
    _check_paths(input_path, output_prefix)
    tokenizer = make_tokenizer(**tokenizer_kwargs)
    dtype = optimal_dtype(tokenizer.vocab_size)
    t0 = time.perf_counter()
    with _sigterm_raises(), _Outputs(output_prefix, json_keys, dtype) as outputs:
        stats = _run(input_path, outputs, tokenizer_kwargs, append_eod, workers, skip_bad_lines,
                     progress, lines_per_task)
        _check_not_empty(input_path, stats)
        outputs.commit()
    elapsed = time.perf_counter() - t0
    docs, bad = stats["documents"], stats["bad"]
    return {
        "input": input_path,
        "outputs": dict(outputs.finals),
        "lines": stats["lines"],
        "documents": docs,
        "bad_lines": len(bad),
        "bad_line_examples": bad[:MAX_REPORTED_BAD_LINES],
        "tokens": stats["tokens"],
        "dtype": np.dtype(dtype).name,
        "seconds": elapsed,
        "docs_per_s": docs / max(elapsed, 1e-9),
        "mb_per_s": stats["bytes"] / 1e6 / max(elapsed, 1e-9),
        "workers": workers,
    }


def _run(input_path, outputs: _Outputs, tokenizer_kwargs, append_eod, workers, skip_bad_lines, progress,
         lines_per_task) -> dict:
    """Tokenize every line into `outputs`; the counts of lines, documents, tokens and bad lines."""
    keys = outputs.keys
    stats = {"lines": 0, "documents": 0, "bytes": 0, "bad": [], "tokens": {k: 0 for k in keys}}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=os.path.getsize(input_path), unit="B", unit_scale=True, unit_divisor=1000,
                   desc="preprocess", file=sys.stderr, dynamic_ncols=True)
    t0 = time.perf_counter()
    tasks = _read_tasks(input_path, lines_per_task)
    ordered_results = _ordered_results(tasks, workers, (tokenizer_kwargs, keys, append_eod))
    # closing(): on a bad line the pool is terminated now, not whenever the generator is collected.
    with contextlib.closing(ordered_results) as ordered, (bar if bar is not None else contextlib.nullcontext()):
        for res in ordered:
            if res.bad and not skip_bad_lines:
                line_no, reason = res.bad[0]
                raise BadLineError(f"{input_path} line {line_no}: {reason}; fix the line or pass --skip-bad-lines; "
                                   "no output written")
            stats["bad"].extend(res.bad)
            outputs.add(res)
            for k in keys:
                stats["tokens"][k] += int(res.tokens[k].size)
            stats["documents"] += res.num_lines - len(res.bad)
            stats["lines"] += res.num_lines
            stats["bytes"] += res.nbytes
            if bar is not None:
                bar.update(res.nbytes)
                bar.set_postfix_str(f"{stats['documents'] / max(time.perf_counter() - t0, 1e-9):,.0f} docs/s",
                                    refresh=False)
    return stats


def _check_not_empty(input_path: str, stats: dict) -> None:
    """An empty dataset would only fail later, at training; refuse it here, naming the input."""
    if stats["documents"] == 0:
        skipped = f", all {len(stats['bad'])} skipped as bad" if stats["bad"] else ""
        raise InputError(f"--input {input_path}: no documents ({stats['lines']} lines{skipped}); no output written")
    for key, count in stats["tokens"].items():
        if count == 0:
            raise InputError(
                f"--input {input_path}: key {key!r} has no tokens in any of the {stats['documents']} "
                "documents (every text is empty); no output written"
            )


def add_tokenizer_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", default=None)
    g.add_argument("--tokenizer-model", default=None)
    g.add_argument("--vocab-file", default=None)
    g.add_argument("--merge-file", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="NullTokenizer only")
    g.add_argument("--tiktoken-pattern", default="v2", choices=("v1", "v2"), help="TikTokenizer's split pattern")
    g.add_argument("--tiktoken-num-special-tokens", type=int, default=1000,
                   help="TikTokenizer: ids reserved for special tokens before the ranks")
    g.add_argument("--tokenizer-special-tokens", "--tiktoken-special-tokens", dest="tokenizer_special_tokens",
                   nargs="+", default=None, help="TikTokenizer's named special tokens")


def tokenizer_kwargs_from(args) -> dict:
    return dict(
        tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        vocab_size=args.vocab_size,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        tokenizer_special_tokens=args.tokenizer_special_tokens,
    )


@cli
def main(argv: list[str] | None = None) -> int:
    from mlm_jax.arguments import ArgumentParser

    p = ArgumentParser(prog="python -m mlm_jax.data.preprocess", description=__doc__,
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
        p.error(f"--workers must be at least 1, got {args.workers}")
    s = preprocess(args.input, args.output_prefix, tokenizer_kwargs_from(args), args.json_keys,
                   args.append_eod, args.workers, args.skip_bad_lines, not args.no_progress)
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
