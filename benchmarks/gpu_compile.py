"""Full-size deviceless GPU compiles: the README's GPU example and Megatron-LM's example scripts
at their real sizes and GPU counts, each through `python -m mlm_jax.plan` (the exact train step
of `mlm_jax.train`), one process per case. Prints a table (model, GPUs, layout, GiB per device,
fits, compile s, the estimated and analytic step times, executed matmul FLOPs against the model's
and the weights' matmuls against 6NT, cuDNN forward/backward kernel runs) and writes the plans'
JSON (the top kernels among them).

    python benchmarks/gpu_compile.py [--cases gpt_1p3b,llama3_8b,...] [--gpu h100] [--out runs/benchmarks]

Needs the compile-only CUDA wheels (pip install -e ".[gpu-compile]"); no GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "tests" / "megatron_examples"

README_GPT_1P3B = (
    "--bf16 --use-distributed-optimizer --num-layers 24 --hidden-size 2048 --num-attention-heads 16 "
    "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size {micro} --global-batch-size 256 "
    "--hidden-dropout 0 --attention-dropout 0 --train-iters 10000 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 500 "
    "--data-path my_corpus_text_document --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json "
    "--merge-file merges.txt")

# Megatron's scripts' own variable values (examples/llama/train_llama3_8b_h100_fp8.sh: TP 1, CP 1,
# micro 1, global 128, 32 layers, seq 8192 on one node of 8; the paths are placeholders: nothing
# is read or written by a plan).
SCRIPT_VARIABLES = {
    "NUM_LAYERS": "32", "SEQ_LENGTH": "8192", "MAX_POSITION_EMBEDDINGS": "8192", "MICRO_BATCH_SIZE": "1",
    "GLOBAL_BATCH_SIZE": "128", "TP_SIZE": "1", "CP_SIZE": "1", "DATA_CACHE_PATH": "/tmp/mlm_jax_plan_cache",
    "CHECKPOINT_PATH": "/tmp/mlm_jax_plan_ckpt", "TENSORBOARD_LOGS_PATH": "/tmp/mlm_jax_plan_tb",
    "DATASET": "my_corpus_text_document", "DATA_PATH": "my_corpus_text_document",
    "TOKENIZER_MODEL": "tokenizer.model", "VOCAB_FILE": "vocab.json", "MERGE_FILE": "merges.txt",
}
PLACEHOLDERS = {"<PATH TO gpt-vocab.json>": "vocab.json", "<PATH TO gpt-merges.txt>": "merges.txt",
                "<PATH TO CHECKPOINTS DIRECTORY>": "/tmp/mlm_jax_plan_ckpt",
                "<TENSORBOARD DIRECTORY>": "/tmp/mlm_jax_plan_tb"}
# Flags a plan leaves out: they name files and folders of the cluster (a plan reads none) or
# start work a compile does not do.
DROP = {"--save", "--load", "--tensorboard-dir", "--data-cache-path", "--profile", "--profile-step-start",
        "--profile-step-end"}


def script_args(name: str, overrides: dict[str, str] | None = None) -> list[str]:
    """A Megatron example script's flags (tests/megatron_examples/NAME.args), variables filled in."""
    overrides = overrides or {}
    argv: list[str] = []
    for line in (EXAMPLES / f"{name}.args").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        for placeholder, value in PLACEHOLDERS.items():
            line = line.replace(placeholder, value)
        line = re.sub(r"\$\{?(\w+)\}?", lambda m: SCRIPT_VARIABLES[m.group(1)], line)
        flag, *values = shlex.split(line)
        if flag in DROP:
            continue
        if flag in overrides:
            values = overrides[flag].split()
        argv += [flag, *values]
    return argv


LLAMA3_8B_DOTS = (
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope --swiglu "
    "--normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 "
    "--global-batch-size 8 --bf16 --use-distributed-optimizer --recompute-granularity dots --vocab-size 128256 "
    "--mock-data --tokenizer-type NullTokenizer --attention-dropout 0 --hidden-dropout 0 --lr 1e-4 --train-iters 10")

# Llama-3 70B's shape on 64 H100: tp8 + SP within a node, FSDP (optim_grads_params) over the 8 nodes.
LLAMA3_70B_FSDP_TP8 = (
    "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 --group-query-attention "
    "--num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope --swiglu "
    "--normalization RMSNorm --untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 "
    "--global-batch-size 64 --bf16 --use-megatron-fsdp --tensor-model-parallel-size 8 --sequence-parallel "
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1 --vocab-size 128256 "
    "--mock-data --tokenizer-type NullTokenizer --attention-dropout 0 --hidden-dropout 0 --lr 1e-4 --train-iters 10")

RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
# Megatron's Llama-3 8B fp8 recipe (tests/megatron_examples/llama3_8b_fp8.args)
FP8_MEGATRON = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
                "--fp8-param-gather"]

# name -> (what, GPUs, GPUs per node, argv)
# Issue 49's comparison with MaxText's compiled Mixtral step: Megatron's Mixtral 8x7B shape on 8 GPUs
# (seq 4096, bf16, ZeRO), the experts with and without expert parallelism.
MIXTRAL_8GPU = (
    "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --seq-length 4096 --max-position-embeddings 32768 --position-embedding-type rope "
    "--rotary-base 1000000 --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights "
    "--disable-bias-linear --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm "
    "--vocab-size 32000 --bf16 --use-distributed-optimizer --mock-data --tokenizer-type NullTokenizer "
    "--attention-dropout 0 --hidden-dropout 0 --lr 1e-4 --train-iters 10")
CAPACITY = " --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity"

CASES = {
    "gpt_1p3b": ("README GPT 1.3B (dp8, ZeRO, micro 8)", 8, 8, README_GPT_1P3B.format(micro=8).split()),
    "gpt_1p3b_micro4": ("README GPT 1.3B (dp8, ZeRO, micro 4)", 8, 8, README_GPT_1P3B.format(micro=4).split()),
    "gpt_1p3b_overlap": ("README GPT 1.3B + --overlap-grad-reduce (micro 8)", 8, 8,
                         README_GPT_1P3B.format(micro=8).split() + ["--overlap-grad-reduce"]),
    "gpt_1p3b_micro4_overlap": ("README GPT 1.3B + --overlap-grad-reduce (micro 4)", 8, 8,
                                README_GPT_1P3B.format(micro=4).split() + ["--overlap-grad-reduce"]),
    "llama3_8b": ("Megatron Llama-3 8B script as written (seq 8192, dp8 ZeRO, fused attention)", 8, 8,
                  script_args("llama3_8b_bf16")),
    "llama3_8b_recompute": ("the same + full recompute (the plan's first suggestion)", 8, 8,
                            script_args("llama3_8b_bf16") + RECOMPUTE),
    "llama3_8b_tp2_recompute": ("the same + full recompute, TP 2 (dp4)", 8, 8,
                                script_args("llama3_8b_bf16", {"--tensor-model-parallel-size": "2"}) + RECOMPUTE),
    "mixtral_8x7b": ("Megatron Mixtral 8x7B script (pp4 x ep8), 64 GPUs", 64, 8, script_args("mixtral_8x7b")),
    "mixtral_8x7b_recompute": ("the same + full recompute", 64, 8, script_args("mixtral_8x7b") + RECOMPUTE),
    "gpt3_175b": ("Megatron GPT-3 175B script (tp8 x pp16, fp16), 1024 GPUs", 1024, 8,
                  script_args("pretrain_gpt3_175B")),
    # Issue 48's comparison with MaxText's compiled step: Llama-3 8B, dp8 ZeRO, micro 1 (one
    # microbatch a step: no fp32 gradient accumulator), `dots` (the nearest to MaxText's
    # minimal_with_context remat policy).
    "llama3_8b_dots": ("Llama-3 8B, dp8 ZeRO, micro 1, global 8, --recompute-granularity dots", 8, 8,
                       LLAMA3_8B_DOTS.split()),
    "mixtral_ep8": ("Mixtral 8x7B shape, ep8 alltoall, dropless, micro 1", 8, 8,
                    (MIXTRAL_8GPU + " --expert-model-parallel-size 8 --micro-batch-size 1 --global-batch-size 8").split()),
    "mixtral_dp8": ("Mixtral 8x7B shape, dp8 (no EP), dropless, micro 1", 8, 8,
                    (MIXTRAL_8GPU + " --micro-batch-size 1 --global-batch-size 8").split()),
    "mixtral_dp8_micro12_capacity": ("Mixtral 8x7B shape, dp8, micro 12, capacity 1.0 padded (issue 49's)", 8, 8,
                                     (MIXTRAL_8GPU + CAPACITY + " --micro-batch-size 12 --global-batch-size 96").split()),
    "mixtral_dp8_micro12_capacity_full": ("the same + full recompute", 8, 8,
                                          (MIXTRAL_8GPU + CAPACITY + " --micro-batch-size 12 --global-batch-size 96").split()
                                          + RECOMPUTE),
    "mixtral_ep8_micro12_capacity": ("Mixtral 8x7B shape, ep8, micro 12, capacity 1.0 padded", 8, 8,
                                     (MIXTRAL_8GPU + CAPACITY + " --expert-model-parallel-size 8 --micro-batch-size 12 "
                                      "--global-batch-size 96").split()),
    # Issue 50: fp8 (hybrid) against the bf16 rows above, same shapes.
    "gpt_1p3b_fp8": ("README GPT 1.3B (dp8, ZeRO, micro 8) + fp8, delayed, --fp8-param-gather", 8, 8,
                     README_GPT_1P3B.format(micro=8).split() + FP8_MEGATRON),
    "llama3_8b_dots_fp8_tensorwise": ("Llama-3 8B dots (above) + fp8 tensorwise", 8, 8,
                                      LLAMA3_8B_DOTS.split() + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]),
    "llama3_8b_dots_fp8": ("Llama-3 8B dots (above) + Megatron's fp8 recipe (delayed, history 1024, max, "
                           "--fp8-param-gather)", 8, 8, LLAMA3_8B_DOTS.split() + FP8_MEGATRON),
    "mixtral_ep8_micro12_capacity_fp8": ("Mixtral 8x7B shape, ep8, micro 12, capacity 1.0 padded (above) + fp8 "
                                         "tensorwise (the experts too)", 8, 8,
                                         (MIXTRAL_8GPU + CAPACITY + " --expert-model-parallel-size 8 --micro-batch-size 12 "
                                          "--global-batch-size 96 --fp8-format hybrid --fp8-recipe tensorwise").split()),
    "mixtral_ep8_fp8": ("Mixtral 8x7B shape, ep8 alltoall, dropless, micro 1 (above) + fp8 tensorwise (the grouped "
                        "kernels' fp8 wgmma)", 8, 8,
                        (MIXTRAL_8GPU + " --expert-model-parallel-size 8 --micro-batch-size 1 --global-batch-size 8 "
                         "--fp8-format hybrid --fp8-recipe tensorwise").split()),
    # Issue 51: sharded data parallelism (Megatron-FSDP) against the ZeRO-1 row above, same shapes.
    "llama3_8b_dots_fsdp": ("Llama-3 8B dots (above) with --use-megatron-fsdp (optim_grads_params)", 8, 8,
                            LLAMA3_8B_DOTS.split() + ["--use-megatron-fsdp"]),
    "llama3_8b_dots_fsdp_grads": ("Llama-3 8B dots (above) with --use-megatron-fsdp --data-parallel-sharding-strategy "
                                  "optim_grads", 8, 8, LLAMA3_8B_DOTS.split() + ["--use-megatron-fsdp",
                                  "--data-parallel-sharding-strategy", "optim_grads"]),
    "llama3_70b_fsdp_tp8": ("Llama-3 70B shape, tp8 SP x FSDP 8 (optim_grads_params), full recompute, micro 1, "
                            "global 64", 64, 8, LLAMA3_70B_FSDP_TP8.split()),
    "llama3_70b_fsdp_tp8_micro8": ("the same FSDP layout at micro 8 (one microbatch a step: one gather of each layer "
                                   "forward and backward)", 64, 8,
                                   LLAMA3_70B_FSDP_TP8.replace("--micro-batch-size 1", "--micro-batch-size 8").split()),
    "llama3_70b_zero1_tp8": ("the same with --use-distributed-optimizer (ZeRO-1) instead of FSDP", 64, 8,
                             LLAMA3_70B_FSDP_TP8.replace("--use-megatron-fsdp", "--use-distributed-optimizer").split()),
    "llama3_8b_fp8": ("Megatron Llama-3 8B fp8 script as written (seq 8192, dp8 ZeRO, fused attention)", 8, 8,
                      script_args("llama3_8b_fp8")),
}


def run_plan(args: list[str], json_path: Path) -> tuple[subprocess.CompletedProcess, dict | None]:
    """`python -m mlm_jax.plan ARGS --json JSON_PATH` from the repository root: the process and
    its JSON report (None when it wrote none). The benchmarks' one way of running a plan."""
    json_path.unlink(missing_ok=True)
    p = subprocess.run([sys.executable, "-m", "mlm_jax.plan", *args, "--json", str(json_path)],
                       capture_output=True, text=True, cwd=ROOT)
    return p, (json.loads(json_path.read_text()) if json_path.exists() else None)


def plan_config(argv: list[str], gpus: int):
    """The finalized config `python -m mlm_jax.plan` builds from these training flags."""
    from mlm_jax.arguments import parse_args
    from mlm_jax.plan.__main__ import _with_vocab
    from mlm_jax.validation import finalize

    return finalize(_with_vocab(parse_args(argv), argv), gpus)


def run_case(name: str, gpu: str, out: Path) -> dict:
    what, gpus, per_node, argv = CASES[name]
    args = ["--gpu", gpu, "--gpus", str(gpus), "--gpus-per-node", str(per_node), *argv]
    t0 = time.perf_counter()
    p, r = run_plan(args, out / f"plan_{name}_{gpu}.json")
    wall = time.perf_counter() - t0
    row = {"case": name, "what": what, "gpus": gpus, "exit": p.returncode, "wall_seconds": round(wall, 1),
           "command": " ".join(["python -m mlm_jax.plan", *args])}
    if r is not None and p.returncode in (0, 1):
        row.update(layout=" x ".join(f"{k}{v}" for k, v in r["mesh"].items() if v > 1),
                   gib=r["per_device_bytes"]["total"] / 2**30, usable_gib=r["usable_bytes"] / 2**30,
                   fits=r["fits"], compile_seconds=r["compile_seconds"], attention=r["attention_backend"])
        t = r["step_time"]
        runs = r["cudnn_attention_runs"]
        row.update(estimated_ms=1000 * t["seconds"], estimated_mfu=t["mfu"], analytic_ms=1000 * t["analytic"]["seconds"],
                   executed_ratio=t["executed_matmul_flops_ratio"], gemm_ratio=t["executed_gemm_flops_ratio"],
                   fp8_share=t.get("fp8_matmul_flops_share", 0.0), fp8_gemm_share=t.get("fp8_gemm_flops_share", 0.0),
                   cudnn_fwd_bwd=(f"{sum(n for k, n in runs.items() if k.endswith('Softmax'))}/"
                                  f"{sum(n for k, n in runs.items() if k.endswith('SoftmaxBackward'))}"),
                   top_kernels=t["top_kernels"])
        reduction = r["data_parallel"].get("gradient reduction")
        if reduction:  # the data-parallel gradient reduction's collectives: overlapped / all
            row["grad_reduce_overlap"] = f"{reduction['overlapped']}/{reduction['count']}"
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    if errors:
        row["error"] = errors[-1]
    return row


def bench_parser(doc: str, cases) -> argparse.ArgumentParser:
    """The plan benchmarks' common flags: --cases, --gpu, --out."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(cases))
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--out", default="runs/benchmarks")
    return ap


def out_dir(a: argparse.Namespace) -> Path:
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    return out


def main() -> int:
    a = bench_parser(__doc__, CASES).parse_args()
    out = out_dir(a)
    rows = []
    print(f"{'case':<24} {'GPUs':>5} {'layout':<28} {'GiB/device':>11} {'fits':>5} {'compile s':>9} "
          f"{'dp grads overlapped':>19} {'est. ms':>9} {'analytic ms':>11} {'est. MFU':>8} {'FLOPs/model':>11} "
          f"{'GEMM/6NT':>8} {'fp8':>5} {'fp8 GEMM':>8} {'cuDNN f/b':>9}  attention")
    for name in a.cases.split(","):
        row = run_case(name, a.gpu, out)
        rows.append(row)
        if "gib" in row:
            print(f"{name:<24} {row['gpus']:>5} {row['layout']:<28} {row['gib']:>11.2f} {str(row['fits']):>5} "
                  f"{row['compile_seconds']:>9.1f} {row.get('grad_reduce_overlap', '-'):>19} {row['estimated_ms']:>9.1f} "
                  f"{row['analytic_ms']:>11.1f} {row['estimated_mfu']:>8.1%} {row['executed_ratio']:>11.3f} "
                  f"{row['gemm_ratio']:>8.3f} {row['fp8_share']:>5.1%} {row['fp8_gemm_share']:>8.1%} {row['cudnn_fwd_bwd']:>9}  "
                  f"{row['attention']}",
                  flush=True)
        else:
            print(f"{name:<24} {row['gpus']:>5} failed (exit {row['exit']}): {row.get('error', '')}", flush=True)
    (out / f"gpu_compile_{a.gpu}.json").write_text(json.dumps(rows, indent=1))
    print(f"> {out / f'gpu_compile_{a.gpu}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
