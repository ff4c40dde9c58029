"""fp8 against bf16 training curves on a CPU (docs/precision.md#fp8).

    python benchmarks/fp8_curve.py [--iters 300] [--json OUT]

Trains the default run's model (GPT: learned positions, LayerNorm, GELU) and a Llama-style one
(rope, RMSNorm, SwiGLU, grouped-query attention, untied, no biases) on the embedded corpus, each
three times: `--bf16`; `--bf16 --fp8-format hybrid --fp8-recipe tensorwise`; and Megatron's Llama-3 fp8
recipe `--bf16 --fp8-format hybrid` (delayed, `--fp8-amax-history-len 1024 --fp8-amax-compute-algo
max`); the same seed and data.
Prints each run's final validation loss, the fp8 run's gap to bf16's, and whether any step was
non-finite or skipped (the run stops on a NaN, so its last iteration tells); JSON with --json.
XLA:CPU multiplies the fp8 operands in fp32 after converting them: the numerics of an fp8 GEMM
(fp32 accumulation), not its speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

RECIPES = {
    "tensorwise": ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
    "delayed": ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max"],
}
MODELS = {
    "gpt": [],
    "llama": ["--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope", "--disable-bias-linear",
              "--untie-embeddings-and-output-weights", "--group-query-attention", "--num-query-groups", "2"],
}


def run(flags: list[str], iters: int, folder: str) -> dict:
    """One training run in `folder`: its last validation loss and last iteration."""
    cmd = [sys.executable, "-m", "mlm_jax.train", "--bf16", "--train-iters", str(iters), "--eval-interval",
           str(iters), "--sample-tokens", "0", "--no-progress-bar", "--run-dir", folder, *flags]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    records = [json.loads(line) for line in open(os.path.join(folder, "metrics.jsonl"))]
    valid = [r for r in records if "valid_lm_loss" in r]
    steps = [r for r in records if "lm_loss" in r]
    return {"valid_lm_loss": valid[-1]["valid_lm_loss"], "last_iteration": steps[-1]["iteration"],
            "skipped": sum(r.get("skipped_iterations", 0) for r in steps)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in MODELS.items():
            bf16 = run(flags, args.iters, os.path.join(tmp, f"{name}-bf16"))
            out[name] = {"bf16": bf16}
            for recipe, fp8 in RECIPES.items():
                got = run(flags + fp8, args.iters, os.path.join(tmp, f"{name}-{recipe}"))
                gap = got["valid_lm_loss"] / bf16["valid_lm_loss"] - 1
                out[name][recipe] = {**got, "relative_gap": gap}
                print(f"{name}: validation loss after {args.iters} iterations: bf16 {bf16['valid_lm_loss']:.4f}, "
                      f"fp8 hybrid {recipe} {got['valid_lm_loss']:.4f} ({gap:+.2%}); reached iteration "
                      f"{got['last_iteration']}, skipped {got['skipped']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
