"""The corpus a run uses when given no data: the installed Python standard library's source.

Real text with real structure, present on every machine, nothing downloaded. The `.py` files
under `sysconfig`'s stdlib path are taken in sorted relative-path order (tests, generated
tables and bundled third-party code left out) until the size cap. Each file is cut into
documents before top-level or class-level `def`/`class`/decorator lines, at least
`DOC_MIN_BYTES` each (a few hundred tokens), so the
corpus has thousands of documents and `--split 969,30,1` leaves every split some.
A lossless SentencePiece BPE tokenizer is trained on it, and the tokenized documents (each
followed by EOD) are written as a Megatron indexed dataset. Everything is cached under
`<cache>/default_corpus/<md5 of the corpus and settings>/`, where `<cache>` is
`$MLM_JAX_CACHE` or `~/.cache/mlm_jax`; a first build takes a few seconds.

The stdlib differs between Python versions, so so does this corpus; the cache key follows it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import sys
import sysconfig
import tempfile
import time

import numpy as np

from mlm_jax.data import cache as _cache
from mlm_jax.data.indexed_dataset import (IndexedDataset, IndexedDatasetBuilder, bin_path, exists, idx_path,
                                          optimal_dtype)
from mlm_jax.data.tokenizers import GPTSentencePieceTokenizer, train_sentencepiece
from mlm_jax.errors import UsageError

DEFAULT_MAX_BYTES = 4_000_000
DEFAULT_VOCAB_SIZE = 4096  # small: the LM head dominates a tiny model's FLOPs
DOC_MIN_BYTES = 1000
DATASET_NAME = "stdlib_text_document"
# Top-level and class-level definitions (one indent) are where a document may start.
_CUT_BEFORE = tuple(indent + kw for indent in ("", "    ") for kw in ("def ", "class ", "async def ", "@"))
# Generated tables, long string blobs, test suites and bundled packages: not representative code.
_EXCLUDED_DIRS = {
    "site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo",
    "encodings", "pydoc_data", "ensurepip", "__pycache__", "tkinter",
}


def _log(msg: str) -> None:
    print(f"[default corpus] {msg}", file=sys.stderr, flush=True)


def _drop_if_damaged(path: str, load) -> bool:
    """Remove a cache entry that exists but cannot be loaded, so it is built again (the user
    never named these files, so an error about them would not help); True if removed."""
    if not os.path.exists(path):
        return False
    try:
        load()
    except UsageError as e:
        _log(f"cached {path} is damaged ({e}); building it again")
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
        return True
    return False


def gather_stdlib_sources(max_bytes: int = DEFAULT_MAX_BYTES) -> list[tuple[str, str]]:
    """(relative path, text) of stdlib .py files in sorted order, up to `max_bytes` of UTF-8."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _EXCLUDED_DIRS and not d.startswith("config-")]
        paths.extend(os.path.relpath(os.path.join(directory, f), root) for f in files if f.endswith(".py"))
    out, total = [], 0
    for rel in sorted(paths):
        try:
            with open(os.path.join(root, rel), "rb") as f:
                raw = f.read()
            text = raw.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if total + len(raw) > max_bytes:
            break
        out.append((rel, text))
        total += len(raw)
    if not out:
        raise RuntimeError(f"no Python sources found under the stdlib path {root}")
    return out


def split_source(text: str, min_bytes: int = DOC_MIN_BYTES) -> list[str]:
    """Cut a module before (class-level or top-level) definitions into pieces of at least `min_bytes`
    (the last may be shorter); the pieces concatenate back to `text` exactly."""
    pieces, current, size = [], [], 0
    for line in text.splitlines(keepends=True):
        if size >= min_bytes and line.startswith(_CUT_BEFORE):
            pieces.append("".join(current))
            current, size = [], 0
        current.append(line)
        size += len(line.encode("utf-8"))
    if current:
        pieces.append("".join(current))
    return pieces


def _files_md5(paths: list[str]) -> str:
    h = hashlib.md5()
    for p in paths:
        with open(p, "rb") as f:
            h.update(hashlib.md5(f.read()).digest())
    return h.hexdigest()


@functools.lru_cache(maxsize=2)
def _sources(cache_dir: str, max_bytes: int, vocab_size: int) -> tuple[tuple, str, int]:
    """(the stdlib sources, the corpus's cache folder, their UTF-8 bytes), read once per process:
    a run asks for the corpus's own tokenizer before it asks for the corpus."""
    docs = tuple(gather_stdlib_sources(max_bytes))
    return docs, _corpus_root(cache_dir, docs, max_bytes, vocab_size), sum(len(t.encode("utf-8")) for _, t in docs)


def own_tokenizer(cache_dir: str | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                  vocab_size: int = DEFAULT_VOCAB_SIZE):
    """The corpus's own lossless SentencePiece tokenizer (a GPTSentencePieceTokenizer, EOD = its
    eos id), trained on first use and then loaded from the cache; the corpus itself is not built."""
    docs, root, nbytes = _sources(cache_dir or _cache.default_cache_dir(), max_bytes, vocab_size)
    return _own_tokenizer(root, docs, nbytes, vocab_size)


def build_default_corpus(
    cache_dir: str | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    tokenizer=None,
) -> tuple[str, object]:
    """Build (or load from cache) the default corpus; returns (dataset prefix, tokenizer).

    With `tokenizer` None, the corpus's own tokenizer (`own_tokenizer`) is trained or loaded;
    otherwise the given tokenizer tokenizes the corpus.
    """
    docs, root, nbytes = _sources(cache_dir or _cache.default_cache_dir(), max_bytes, vocab_size)
    if tokenizer is None:
        tokenizer = _own_tokenizer(root, docs, nbytes, vocab_size)
        tok_key = "own"
    else:
        _, tok_key = _cache.describe(
            {"type": tokenizer.tokenizer_type, "files": _files_md5(tokenizer.files()),
             "vocab_size": tokenizer.vocab_size, "eod": tokenizer.eod}
        )
    data_dir = os.path.join(root, f"data-{tok_key}")
    prefix = os.path.join(data_dir, DATASET_NAME)
    if exists(prefix):
        _drop_if_damaged(data_dir, lambda: IndexedDataset(prefix))
    if not exists(prefix):
        _write_dataset(root, data_dir, docs, nbytes, tokenizer)
    return prefix, tokenizer


def _corpus_root(cache_dir: str, docs, max_bytes: int, vocab_size: int) -> str:
    """The cache folder of this corpus: keyed by the sources' content and every build setting."""
    content = hashlib.md5()
    for rel, text in docs:
        content.update(rel.encode() + b"\0" + text.encode("utf-8") + b"\0")
    _, corpus_key = _cache.describe(
        {"corpus": content.hexdigest(), "max_bytes": max_bytes, "vocab_size": vocab_size,
         "doc_min_bytes": DOC_MIN_BYTES, "cut_before": _CUT_BEFORE, "format": 2}
    )
    return os.path.join(cache_dir, "default_corpus", corpus_key)


def _own_tokenizer(root: str, docs, nbytes: int, vocab_size: int):
    """The corpus's own SentencePiece tokenizer, trained into `root` unless a sound one is there."""
    model = os.path.join(root, "tokenizer.model")
    if _drop_if_damaged(model, lambda: GPTSentencePieceTokenizer(model)):
        # Data tokenized by the old model must not outlive it.
        shutil.rmtree(os.path.join(root, "data-own"), ignore_errors=True)
    if not os.path.isfile(model):
        _log(f"{len(docs)} stdlib files, {nbytes / 1e6:.1f} MB, from {sysconfig.get_paths()['stdlib']}")
        _log(f"training a lossless SentencePiece BPE tokenizer (vocab {vocab_size})...")
        t0 = time.perf_counter()
        os.makedirs(root, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as tmp:
            lines = (line for _, text in docs for line in text.split("\n"))
            trained = train_sentencepiece(None, os.path.join(tmp, "tokenizer"), vocab_size, sentences=lines)
            os.replace(trained, model)
        _log(f"tokenizer trained in {time.perf_counter() - t0:.1f} s -> {model}")
    return GPTSentencePieceTokenizer(model)


def _write_dataset(root: str, data_dir: str, docs, nbytes: int, tokenizer) -> None:
    """Tokenize the documents into a temporary folder, then rename it to `data_dir` in one step
    (a reader never sees a half-written dataset)."""
    prefix = os.path.join(data_dir, DATASET_NAME)
    texts = [piece for _, text in docs for piece in split_source(text)]
    _log(f"tokenizing {len(texts)} documents from {len(docs)} files ({nbytes / 1e6:.1f} MB)...")
    t0 = time.perf_counter()
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=root, prefix=".tmp-data-")
    try:
        tmp_prefix = os.path.join(tmp, DATASET_NAME)
        n_tokens = _tokenize_into(tmp_prefix, texts, tokenizer)
        with open(os.path.join(tmp, "manifest.json"), "w") as f:
            json.dump({"files": [rel for rel, _ in docs], "tokens": n_tokens,
                       "tokenizer_type": tokenizer.tokenizer_type, "python": sys.version}, f, indent=1)
        try:
            os.replace(tmp, data_dir)
        except OSError:  # another process finished first; its copy is identical
            if not exists(prefix):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _log(f"{n_tokens} tokens written in {time.perf_counter() - t0:.1f} s -> {prefix}.bin/.idx")


def _tokenize_into(prefix: str, texts: list[str], tokenizer) -> int:
    """Write `texts` as documents (each ended by EOD) to prefix.bin/.idx; returns the token count."""
    builder = IndexedDatasetBuilder(bin_path(prefix), optimal_dtype(tokenizer.vocab_size))
    n_tokens = 0
    step = 64
    for beg in range(0, len(texts), step):
        ids = tokenizer.tokenize_batch(texts[beg : beg + step])
        lengths = [len(x) + 1 for x in ids]
        flat = np.fromiter(
            (t for x in ids for t in (*x, tokenizer.eod)), dtype=np.int64, count=sum(lengths)
        )
        builder.add_documents(flat, lengths)
        n_tokens += int(flat.size)
    builder.finalize(idx_path(prefix))
    return n_tokens
