"""The analytic memory model (mlm_jax/plan/analytic.py) against deviceless GPU compiles: for each
case, the model's bytes per device term by term beside the compiled program's (`python -m
mlm_jax.plan --json`: arguments + outputs - aliased + temporaries; the state's parameter and
optimizer bytes exactly), one compile process per case.

    python benchmarks/plan_calibration.py [--cases a,b,...] [--gpu h100] [--out runs/benchmarks]

Cases: the README GPT 1.3B on 8 GPUs at dp8 ZeRO / tp2 SP dp4 ZeRO / pp2 dp4 ZeRO, recompute
off and full, and the full-size cases of benchmarks/gpu_compile.py.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

from gpu_compile import CASES as FULL_SIZE, README_GPT_1P3B, RECOMPUTE, bench_parser, out_dir, plan_config, run_plan  # noqa: E402

GPT = README_GPT_1P3B.format(micro=4).split()
GRID = {
    "gpt_dp8_zero": ("dp8 ZeRO", GPT),
    "gpt_dp8_zero_rc": ("dp8 ZeRO, full recompute", GPT + RECOMPUTE),
    "gpt_tp2_sp_dp4_zero": ("tp2 SP x dp4 ZeRO", GPT + ["--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "gpt_tp2_sp_dp4_zero_rc": ("tp2 SP x dp4 ZeRO, full recompute",
                               GPT + ["--tensor-model-parallel-size", "2", "--sequence-parallel"] + RECOMPUTE),
    "gpt_pp2_dp4_zero": ("pp2 (1F1B) x dp4 ZeRO", GPT + ["--pipeline-model-parallel-size", "2"]),
    "gpt_pp2_dp4_zero_rc": ("pp2 (1F1B) x dp4 ZeRO, full recompute",
                            GPT + ["--pipeline-model-parallel-size", "2"] + RECOMPUTE),
}
CASES = {name: (what, 8, 8, argv) for name, (what, argv) in GRID.items()}
CASES.update({name: (what, gpus, per_node, argv) for name, (what, gpus, per_node, argv) in FULL_SIZE.items()})


def predicted(argv: list[str], gpus: int) -> dict:
    from mlm_jax.plan import analytic

    cfg = plan_config(argv, gpus)
    return analytic.memory(cfg, analytic.layout_of(cfg, gpus))


def compiled(name: str, gpus: int, per_node: int, argv: list[str], gpu: str, out: Path) -> dict | None:
    args = ["--gpu", gpu, "--gpus", str(gpus), "--gpus-per-node", str(per_node), *argv]
    return run_plan(args, out / f"calibration_{name}_{gpu}.json")[1]


def main() -> int:
    a = bench_parser(__doc__, CASES).parse_args()
    out = out_dir(a)
    gib = 2**30
    rows = []
    print(f"{'case':<26} {'pred GiB':>8} {'compiled':>8} {'diff':>7}  {'state pred/comp':>15}  {'rest pred/comp':>15}")
    for name in a.cases.split(","):
        what, gpus, per_node, argv = CASES[name]
        p = predicted(argv, gpus)
        r = compiled(name, gpus, per_node, argv, a.gpu, out)
        row = {"case": name, "what": what, "gpus": gpus, "predicted": p}
        if r is None:
            print(f"{name:<26} {p['total'] / gib:>8.2f} {'failed':>8}", flush=True)
            rows.append(row)
            continue
        b = r["per_device_bytes"]
        state_pred = p["parameters"] + p["optimizer_state"]
        state_comp = b["parameters"] + b["optimizer_state"]
        row.update(compiled=b, diff=p["total"] / b["total"] - 1)
        rows.append(row)
        print(f"{name:<26} {p['total'] / gib:>8.2f} {b['total'] / gib:>8.2f} {row['diff']:>+7.1%}  "
              f"{state_pred / gib:>7.2f}/{state_comp / gib:<7.2f}  {(p['total'] - state_pred) / gib:>7.2f}/"
              f"{(b['total'] - state_comp) / gib:<7.2f}", flush=True)
    (out / f"plan_calibration_{a.gpu}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
