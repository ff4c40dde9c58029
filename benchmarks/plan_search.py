"""`python -m mlm_jax.plan --search` on the full-size models: GPT-3 175B on 1024 H100, Llama-3 8B
and 70B and Mixtral 8x7B on 64 H100; the chosen layout beside the layout of Megatron's script (or
NVIDIA's recipe), each with predicted GiB per device and, compiled deviceless, compiled GiB.

    python benchmarks/plan_search.py [--cases ...] [--confirm 1] [--out runs/benchmarks]

One `--search` process per case (it compiles its best `--confirm` layouts itself), and one
`python -m mlm_jax.plan` for the reference layout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent))

from gpu_compile import bench_parser, out_dir, plan_config, run_plan, script_args  # noqa: E402

LLAMA3_8B = script_args("llama3_8b_bf16")
# Llama-3 70B: the 8B script's flags at the 70B sizes (Meta's config: 80 layers, h 8192, f 28672,
# 64 heads, 8 groups), global batch 256 as NVIDIA's 64-GPU recipe.
LLAMA3_70B = script_args("llama3_8b_bf16", {"--num-layers": "80", "--hidden-size": "8192",
                                             "--ffn-hidden-size": "28672", "--num-attention-heads": "64",
                                             "--global-batch-size": "256"})

# name -> (what, GPUs, argv, reference layout (what, flags replacing the argv's layout flags))
CASES = {
    "gpt3_175b": ("GPT-3 175B (Megatron's script, fp16)", 1024, script_args("pretrain_gpt3_175B"),
                  ("Megatron's script: tp8 pp16, micro 1", [])),
    "llama3_8b": ("Llama-3 8B (Megatron's script, bf16, seq 8192, global batch 128)", 64, LLAMA3_8B,
                  ("Megatron's script: tp1 cp1 (dp64), micro 1", [])),
    "llama3_70b": ("Llama-3 70B (the 8B script at 70B sizes, global batch 256)", 64, LLAMA3_70B,
                   # NVIDIA's Megatron-Bridge perf recipe llama3_70b_pretrain_64gpu_h100_bf16 (its
                   # docs: "TP=4 PP=4 CP=2, GBS=256"); a2a: the script's --attention-backend fused
                   # with context parallelism needs it in mlm_jax (the p2p ring runs XLA attention).
                   ("NVIDIA's recipe: tp4 pp4 cp2 SP (cp a2a)",
                    ["--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "4",
                     "--context-parallel-size", "2", "--cp-comm-type", "a2a", "--sequence-parallel"])),
    "mixtral_8x7b": ("Mixtral 8x7B (Megatron's script)", 64, script_args("mixtral_8x7b"),
                     ("Megatron's script: pp4 ep8, micro 1", [])),
}


def _replace_layout(argv: list[str], flags: list[str]) -> list[str]:
    if not flags:
        return argv
    from mlm_jax.plan.search import LAYOUT_FLAGS

    out, i = [], 0
    given = {f for f in flags if f.startswith("--")}
    while i < len(argv):
        if argv[i] in given:
            i += 1 + (LAYOUT_FLAGS.get(argv[i], False) and i + 1 < len(argv) and not argv[i + 1].startswith("--"))
            continue
        out.append(argv[i])
        i += 1
    return out + flags


def main() -> int:
    ap = bench_parser(__doc__, CASES)
    ap.add_argument("--confirm", type=int, default=1)
    a = ap.parse_args()
    out = out_dir(a)
    from mlm_jax.plan import analytic
    from mlm_jax.plan.search import describe
    from mlm_jax.plan.targets import gpu

    rows = []
    for name in a.cases.split(","):
        what, gpus, argv, (ref_what, ref_flags) = CASES[name]
        p, r = run_plan(["--search", "--gpu", a.gpu, "--gpus", str(gpus), "--confirm", str(a.confirm), *argv],
                        out / f"search_{name}_{a.gpu}.json")
        print(p.stdout, flush=True)
        r = r or {}
        ref_argv = _replace_layout(argv, ref_flags)
        cfg = plan_config(ref_argv, gpus)
        ref = analytic.layout_of(cfg, gpus)
        _, ref_r = run_plan(["--gpu", a.gpu, "--gpus", str(gpus), *ref_argv], out / f"search_{name}_reference_{a.gpu}.json")
        ref_compiled = ref_r["per_device_bytes"]["total"] if ref_r else None
        hw = analytic.hardware(gpu(a.gpu))
        ref_pred = analytic.predict(cfg, ref, hw, gpus, 8)
        row = {"case": name, "what": what, "gpus": gpus, "search": r,
               "reference": {"what": ref_what, "layout": describe(ref), "micro": ref.micro,
                             "recompute": ref.recompute, "predicted_bytes": ref_pred["memory"]["total"],
                             "compiled_bytes": ref_compiled, "tokens_per_second": ref_pred["tokens_per_second"],
                             "mfu": ref_pred["mfu"]}}
        rows.append(row)
        best = r.get("best") or {}  # the first predicted to fit whose compile did not say otherwise
        comp = best.get("compiled", {}).get("compiled_bytes")
        print(f"== {name}: chosen {best.get('describe')} micro {best.get('layout', {}).get('micro')} "
              f"recompute {best.get('layout', {}).get('recompute')}: predicted "
              f"{best.get('predicted_bytes', {}).get('total', 0) / 2**30:.2f} GiB, compiled "
              f"{comp / 2**30 if comp else float('nan'):.2f} GiB, {best.get('tokens_per_second', 0):,.0f} tokens/s "
              f"predicted; reference {ref_what}: predicted {ref_pred['memory']['total'] / 2**30:.2f} GiB, compiled "
              f"{ref_compiled / 2**30 if ref_compiled else float('nan'):.2f} GiB, "
              f"{ref_pred['tokens_per_second']:,.0f} tokens/s predicted", flush=True)
    (out / f"plan_search_{a.gpu}.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
