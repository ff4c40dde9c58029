"""Data pipeline figures: preprocessing throughput and GPT index-building time.

    python benchmarks/data.py [--mb 8] [--workers 1 2] [--tokens 1e8 1e9] [--out runs/benchmarks/data.json]

1. Preprocessing: a JSON-lines corpus of `--mb` MB (Python stdlib source, cut into ~1 KB
   documents) through `mlm_jax.data.preprocess` with a byte-level BPE (vocab 8192, trained on
   the corpus) and the default lossless SentencePiece tokenizer; MB/s in total and per worker.
2. Index building: synthetic document lengths (lognormal, mean ~1000 tokens) totalling 1e8 and
   1e9 tokens, written as a real .idx beside a sparse .bin, then Megatron's document, sample
   and shuffle indices built by `GPTDataset` (one epoch; seq 2048 and 128), including opening
   and validating the index; and the blending indices for 1e6 samples.

Prints a table and writes JSON. Figures are wall-clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlm_jax.data.blended import build_blending_indices  # noqa: E402
from mlm_jax.data.default_corpus import build_default_corpus, gather_stdlib_sources, split_source  # noqa: E402
from mlm_jax.data.gpt_dataset import GPTDataset  # noqa: E402
from mlm_jax.data.indexed_dataset import IndexedDataset, encode_index  # noqa: E402
from mlm_jax.data.preprocess import preprocess  # noqa: E402


def make_jsonl(path: str, mb: float) -> float:
    pieces = [p for _, text in gather_stdlib_sources() for p in split_source(text)]
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        while written < mb * 1e6:
            for p in pieces:
                line = json.dumps({"text": p}) + "\n"
                f.write(line)
                written += len(line.encode("utf-8"))
                if written >= mb * 1e6:
                    break
    return written / 1e6


def bench_preprocess(tmp: str, mb: float, workers_list: list[int]) -> list[dict]:
    from tokenizers import ByteLevelBPETokenizer

    src = os.path.join(tmp, "corpus.jsonl")
    size = make_jsonl(src, mb)
    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator([p for _, t in gather_stdlib_sources(2_000_000) for p in split_source(t)],
                            vocab_size=8192, min_frequency=2, special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(tmp)
    _, sp_tok = build_default_corpus(cache_dir=os.path.join(tmp, "cache"))
    tokenizers = {
        "GPT2BPETokenizer (vocab 8192)": dict(tokenizer_type="GPT2BPETokenizer",
                                              vocab_file=os.path.join(tmp, "vocab.json"),
                                              merge_file=os.path.join(tmp, "merges.txt")),
        "GPTSentencePieceTokenizer (8192)": dict(tokenizer_type="GPTSentencePieceTokenizer",
                                                 tokenizer_model=sp_tok.model_file),
    }
    rows = []
    for name, kw in tokenizers.items():
        for w in workers_list:
            s = preprocess(src, os.path.join(tmp, f"out_w{w}"), kw, ["text"], append_eod=True, workers=w,
                           progress=False)
            rows.append({"tokenizer": name, "workers": w, "mb": round(size, 2), "seconds": round(s["seconds"], 2),
                         "mb_per_s": round(s["mb_per_s"], 2), "mb_per_s_per_worker": round(s["mb_per_s"] / w, 2),
                         "docs_per_s": round(s["docs_per_s"]), "tokens": s["tokens"]["text"]})
            print(f"preprocess  {name:34s} workers={w}  {rows[-1]['mb_per_s']:6.2f} MB/s "
                  f"({rows[-1]['mb_per_s_per_worker']:.2f} MB/s per worker, {rows[-1]['docs_per_s']} docs/s)",
                  flush=True)
    return rows


def synthetic_prefix(tmp: str, tokens: int, seed: int = 0) -> tuple[str, int]:
    rng = np.random.default_rng(seed)
    lengths = []
    total = 0
    while total < tokens:
        chunk = np.clip(rng.lognormal(mean=6.4, sigma=1.0, size=1 << 20), 1, 1 << 20).astype(np.int64)
        lengths.append(chunk)
        total += int(chunk.sum())
    lengths = np.concatenate(lengths)
    cut = int(np.searchsorted(np.cumsum(lengths), tokens)) + 1
    lengths = lengths[:cut]
    lengths[-1] -= int(lengths.sum()) - tokens
    lengths = lengths[lengths > 0]
    prefix = os.path.join(tmp, f"synthetic_{tokens:.0e}")
    with open(prefix + ".idx", "wb") as f:
        f.write(encode_index(lengths, np.arange(len(lengths) + 1), np.uint16))
    with open(prefix + ".bin", "wb") as f:
        f.truncate(int(lengths.sum()) * 2)  # sparse: index building never reads tokens
    return prefix, len(lengths)


def bench_indices(tmp: str, token_counts: list[float], seqs: list[int]) -> list[dict]:
    rows = []
    for tokens in token_counts:
        tokens = int(tokens)
        prefix, docs = synthetic_prefix(tmp, tokens)
        for seq in seqs:
            t0 = time.perf_counter()
            low = IndexedDataset(prefix)
            t_open = time.perf_counter() - t0
            num_samples = (tokens - 1) // seq
            t0 = time.perf_counter()
            ds = GPTDataset(low, np.arange(len(low), dtype=np.int32), num_samples, seq, seed=1234,
                            cache_dir=os.path.join(tmp, "idxcache"))
            t_build = time.perf_counter() - t0
            t0 = time.perf_counter()
            GPTDataset(low, np.arange(len(low), dtype=np.int32), num_samples, seq, seed=1234,
                       cache_dir=os.path.join(tmp, "idxcache"))
            t_cached = time.perf_counter() - t0
            rows.append({"tokens": tokens, "documents": docs, "seq_length": seq, "samples": len(ds),
                         "open_validate_s": round(t_open, 3), "build_and_save_s": round(t_build, 3),
                         "load_cached_s": round(t_cached, 3)})
            print(f"indices     {tokens:.0e} tokens, {docs} docs, seq {seq:5d}: {len(ds):9d} samples, "
                  f"open {t_open:.2f} s, build+save {t_build:.2f} s, cached load {t_cached:.3f} s", flush=True)
        os.unlink(prefix + ".bin")
    t0 = time.perf_counter()
    build_blending_indices([0.3, 0.7], 1_000_000)
    t2 = time.perf_counter() - t0
    t0 = time.perf_counter()
    build_blending_indices([0.1] * 10, 1_000_000)
    t10 = time.perf_counter() - t0
    print(f"blending    1e6 samples: {t2:.2f} s over 2 datasets, {t10:.2f} s over 10", flush=True)
    rows.append({"blending_1e6_samples_2_datasets_s": round(t2, 3), "blending_1e6_samples_10_datasets_s": round(t10, 3)})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mb", type=float, default=8.0)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--tokens", type=float, nargs="+", default=[1e8, 1e9])
    p.add_argument("--seq-lengths", type=int, nargs="+", default=[2048, 128])
    p.add_argument("--out", default="runs/benchmarks/data.json")
    args = p.parse_args()
    result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}}
    with tempfile.TemporaryDirectory() as tmp:
        result["preprocess"] = bench_preprocess(tmp, args.mb, args.workers)
        result["indices"] = bench_indices(tmp, args.tokens, args.seq_lengths)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
