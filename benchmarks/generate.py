"""Generation speed: prefill and decode tokens/s with the KV cache (mlm_jax.generate.Decoder)
against decoding without one (every new token re-runs the full forward over a fixed window),
for batch 1 and 16 on the present devices.

    python benchmarks/generate.py [--prompt 128] [--new 64] [--repeats 3] [--out runs/benchmarks]

Prefill tokens/s = batch x prompt / (time of a call with no new tokens). Decode tokens/s =
batch x new / (time with `new` tokens - the prefill time). Without the cache a step costs one
full forward of [batch, prompt + new] tokens (the fixed window one compile needs); its decode
tokens/s = batch / step time. Compiles are excluded (each shape runs once before timing). The
model is the default run's (tiny_gpt: 4 layers, d=256, vocab 8192), parameters on one device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import numpy as np
from flax import nnx

from mlm_jax.config import Config, padded_vocab_size
from mlm_jax.generate import Decoder
from mlm_jax.models.presets import tiny_gpt
from mlm_jax.models.build import abstract_model, init_params


def _best(fn, repeats: int) -> float:
    fn()  # compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(batch: int, prompt: int, new: int, repeats: int, decoder: Decoder, forward, params) -> dict:
    rng = np.random.default_rng(batch)
    prompts = [list(map(int, rng.integers(0, decoder.vocab, prompt))) for _ in range(batch)]
    prefill = _best(lambda: decoder(prompts, 0), repeats)
    full = _best(lambda: decoder(prompts, new), repeats)
    window = np.asarray(rng.integers(0, decoder.vocab, (batch, prompt + new)), np.int32)
    step = _best(lambda: jax.block_until_ready(forward(params, window)), repeats)
    return {"batch": batch, "prompt": prompt, "new": new,
            "prefill_tokens_per_s": batch * prompt / prefill,
            "decode_tokens_per_s": batch * new / max(full - prefill, 1e-9),
            "no_cache_decode_tokens_per_s": batch / step,
            "cached_ms_per_token_step": (full - prefill) / new * 1e3, "no_cache_ms_per_step": step * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/benchmarks")
    args = p.parse_args()
    m = tiny_gpt(vocab_size=8192, max_position_embeddings=max(256, args.prompt + args.new))
    m = dataclasses.replace(m, padded_vocab_size=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1))
    cfg = Config(model=m)
    graphdef, _, _ = abstract_model(cfg)
    params = jax.device_put(init_params(cfg, 0), jax.devices()[0])
    decoder = Decoder(graphdef, params, m.vocab_size)
    forward = jax.jit(lambda prm, t: nnx.merge(graphdef, prm)(t))
    rows = [measure(int(b), args.prompt, args.new, args.repeats, decoder, forward, params)
            for b in args.batches.split(",")]
    device = f"{jax.devices()[0].platform} ({jax.devices()[0].device_kind})"
    print(f"device: {device}; tiny_gpt, prompt {args.prompt}, {args.new} new tokens, best of {args.repeats}")
    print("| batch | prefill tokens/s | decode tokens/s (cache) | decode tokens/s (no cache) | speed-up |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['prefill_tokens_per_s']:,.0f} | {r['decode_tokens_per_s']:,.0f} | "
              f"{r['no_cache_decode_tokens_per_s']:,.0f} | "
              f"{r['decode_tokens_per_s'] / r['no_cache_decode_tokens_per_s']:.1f}x |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "generate.json"), "w") as f:
        json.dump({"device": device, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
