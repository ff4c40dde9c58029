"""The cost of crossing processes: the same 8-device training run as 1x8, 2x4 and 4x2
processes x CPU devices on this machine, each started by launch/local.sh.

Every configuration computes the same thing on the same 8 devices; only the number of processes
(and so which collectives go through gloo over loopback) changes. The figure is that overhead,
not a speed claim. Step time is the median over log windows after the first (compile) one, from
process 0's metrics file. Prints a table; writes JSON.

    python benchmarks/multihost.py [--iters 20] [--layouts dp8,dp2_tp4] [--out runs/benchmarks]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = {
    "dp8": [],
    "dp2_tp4": ["--tensor-model-parallel-size", "4"],
    "dp4_tp2_zero": ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer"],
}
SPLITS = [(1, 8), (2, 4), (4, 2)]  # processes x devices per process


def model_flags(iters: int, log_interval: int) -> list[str]:
    # A small GPT (2 layers, 128 wide, seq 128, vocab 4096) on mock data: small enough that the
    # collectives' fixed costs show, as they would for a larger model on faster devices.
    return ["--mock-data", "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "8",
            "--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "4096",
            "--micro-batch-size", "2", "--global-batch-size", "16", "--train-iters", str(iters),
            "--log-interval", str(log_interval), "--eval-interval", str(10 * iters), "--eval-iters", "1",
            "--no-progress-bar", "--sample-tokens", "0", "--no-final-checkpoint",
            "--peak-flops-per-device", "1e9", "--lr-warmup-iters", "0"]


def run(processes: int, devices: int, flags: list[str], workdir: str) -> dict:
    run_dir = os.path.join(workdir, f"{processes}x{devices}")
    env = dict(os.environ, PYTHON=sys.executable, LOG_DIR=os.path.join(run_dir, "logs"))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # every configuration compiles for itself
    t0 = time.perf_counter()
    p = subprocess.run(["bash", os.path.join(ROOT, "launch", "local.sh"), str(processes), str(devices)]
                       + flags + ["--run-dir", run_dir], env=env, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{processes}x{devices} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    train = [r for r in records if "lm_loss" in r][1:]  # the first window holds the compile step
    step_ms = statistics.median(r["step_time_ms"] for r in train)
    compile_s = float(re.search(r"first step \(compile \+ run\) took ([\d.]+) s", p.stdout).group(1))
    return {"processes": processes, "devices_per_process": devices, "step_ms": step_ms,
            "tokens_per_sec": statistics.median(r["tokens_per_sec"] for r in train),
            "step_ms_windows": [round(r["step_time_ms"], 1) for r in train],
            "first_step_s": compile_s, "wall_s": wall, "final_loss": train[-1]["lm_loss"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--log-interval", type=int, default=5)
    ap.add_argument("--layouts", default="dp8,dp2_tp4", help=f"comma-separated, from {', '.join(LAYOUTS)}")
    ap.add_argument("--out", default=os.path.join(ROOT, "runs", "benchmarks"))
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for layout in args.layouts.split(","):
            for processes, devices in SPLITS:
                r = run(processes, devices, model_flags(args.iters, args.log_interval) + LAYOUTS[layout],
                        workdir)
                r["layout"] = layout
                results.append(r)
                print(f"  {layout} {processes}x{devices}: {r['step_ms']:.1f} ms/step", file=sys.stderr, flush=True)
    print(f"\n{'layout':10s} {'procs x devs':>12s} {'step (ms)':>10s} {'tokens/s':>10s} {'vs 1x8':>7s} "
          f"{'1st step (s)':>12s} {'wall (s)':>9s} {'final loss':>10s}")
    for r in results:
        base = next(b for b in results if b["layout"] == r["layout"] and b["processes"] == 1)
        r["slowdown_vs_1_process"] = r["step_ms"] / base["step_ms"]
        print(f"{r['layout']:10s} {r['processes']:>7d} x {r['devices_per_process']:<2d} {r['step_ms']:10.1f} "
              f"{r['tokens_per_sec']:10,.0f} {r['slowdown_vs_1_process']:6.2f}x {r['first_step_s']:12.1f} "
              f"{r['wall_s']:9.1f} {r['final_loss']:10.5f}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "multihost.json")
    with open(path, "w") as f:
        json.dump({"iters": args.iters, "results": results, "cpu_count": os.cpu_count(),
                   "time": time.strftime("%Y-%m-%dT%H:%M:%S")}, f, indent=2)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
