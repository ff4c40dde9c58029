"""The GPU-compile tier: every layout of the equivalence suite compiled for 8 H100s on this
CPU-only machine (deviceless, jax's CUDA plugin; `pip install -e ".[gpu-compile]"`), through the
same path as `python -m mlm_jax.plan`, and what each compiled program shows asserted:

- it compiles (today's main failed every data-parallel layout under the default attention
  backend inside jax's cuDNN partitioner);
- cuDNN's fused attention wherever the flags allow it (bf16/fp16, no attention dropout, no
  document mask; with context parallelism every comm type), XLA attention elsewhere;
- no matmul with an fp32 operand in a bf16 dense step;
- ZeRO's parameter all-gather sends bf16 under --bf16;
- the data-parallel gradient reduction runs once, outside every loop; with --overlap-grad-reduce
  inside the last microbatch's backward, layer by layer, overlapping compute;
- collectives run asynchronously beside compute in every layout, each kind somewhere (XLA runs
  synchronously those it finds nothing to overlap); the data-parallel ones overlap compute.

The expert-parallel alltoall dispatcher sends a rank's routed rows by ragged all-to-alls, not
blocks padded to the worst case.

Beside the layouts: the MoE grouped matmul's Pallas kernels compile to Triton custom calls that
execute close to the useful FLOPs (XLA's own ragged_dot runs G times them).

The compiles run in worker processes started with the XLA flags a GPU run sets (the suite's own
XLA_FLAGS are for the CPU); skipped, with the reason, only when the CUDA plugin is absent.
`MLM_JAX_GPU_LAYOUTS=smoke` compiles one layout of each family (`SMOKE`) instead of all: CI's
second tier (the newest jax) runs that; the README's test command runs every layout.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mlm_jax.plan.targets import plugin_missing

pytestmark = pytest.mark.skipif(plugin_missing() is not None, reason=str(plugin_missing()))

TINY = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 1000 --num-layers 2 --hidden-size 256 "
        "--num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 --micro-batch-size 2 "
        "--global-batch-size 32 --hidden-dropout 0 --attention-dropout 0 --train-iters 10 --lr 1e-4")
BF16 = TINY + " --bf16"
LLAMA = " --normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear " \
        "--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 2"
# A MoE's layouts at seq 1024: 4096 (token, choice) rows a device a microbatch, so that the grouped
# kernel's row tiles (128 rows; one more at each expert's edge) are a small share of its work.
FP8 = " --fp8-format hybrid"  # Megatron's default recipe: delayed scaling
# DeepSeek-V3's head widths: query/key 128 + 64 = 192 (cuDNN takes them on Hopper), value 128
MLA = (" --multi-latent-attention --q-lora-rank 64 --kv-lora-rank 32 --qk-head-dim 128 --qk-pos-emb-head-dim 64 "
       "--v-head-dim 128 --qk-layernorm --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0")
DEEPSEEK_ROUTER = (" --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-num-groups 2 "
                   "--moe-router-group-topk 1 --moe-router-topk-scaling-factor 2.5 --moe-shared-expert-intermediate-size 512")
MOE = " --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --seq-length 1024 --max-position-embeddings 1024"

# name -> (flags, cuDNN attention expected)
LAYOUTS = {
    "dp8": (BF16, True),
    "dp8_zero": (BF16 + " --use-distributed-optimizer", True),
    "dp8_zero_grad_bf16": (BF16 + " --use-distributed-optimizer --grad-reduce-in-bf16", True),
    "tp2_dp4": (BF16 + " --tensor-model-parallel-size 2", True),
    "tp2_sp_dp4_zero": (BF16 + " --tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer", True),
    "tp8_sp": (BF16 + " --tensor-model-parallel-size 8 --sequence-parallel", True),
    "cp2_p2p": (BF16 + " --context-parallel-size 2 --cp-comm-type p2p --tensor-model-parallel-size 2", True),
    "cp2_allgather": (BF16 + " --context-parallel-size 2 --cp-comm-type allgather --use-distributed-optimizer", True),
    "cp2_p2p_pp2": (BF16 + " --context-parallel-size 2 --cp-comm-type p2p --pipeline-model-parallel-size 2 "
                    "--num-layers 4", True),
    "cp2_a2a": (BF16 + " --context-parallel-size 2 --cp-comm-type a2a --tensor-model-parallel-size 2", True),
    "cp2_a2a_pp2_flash": (BF16 + " --context-parallel-size 2 --cp-comm-type a2a --attention-backend flash "
                          "--pipeline-model-parallel-size 2 --num-layers 4", True),
    "pp2_gpipe": (BF16 + " --pipeline-model-parallel-size 2 --pipeline-schedule gpipe --num-layers 4", True),
    "pp2_1f1b_tp2": (BF16 + " --pipeline-model-parallel-size 2 --pipeline-schedule 1f1b --tensor-model-parallel-size 2"
                     " --sequence-parallel --num-layers 4", True),
    "pp2_interleaved_zero": (BF16 + " --pipeline-model-parallel-size 2 --num-layers 4 "
                             "--num-layers-per-virtual-pipeline-stage 1 --use-distributed-optimizer", True),
    "ep4_alltoall": (BF16 + MOE + " --expert-model-parallel-size 4 --moe-token-dispatcher-type alltoall", True),
    "ep2_allgather_tp2": (BF16 + MOE + " --expert-model-parallel-size 2 --moe-token-dispatcher-type allgather"
                          " --tensor-model-parallel-size 2 --sequence-parallel", True),
    "ep2_pp2": (BF16 + MOE + " --expert-model-parallel-size 2 --pipeline-model-parallel-size 2 --num-layers 4", True),
    "ep4_alltoall_capacity": (BF16 + MOE + " --expert-model-parallel-size 4 --moe-expert-capacity-factor 1.0", True),
    "dp8_moe": (BF16 + MOE, True),
    "pp2_tp2_moe": (BF16 + MOE + " --pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 --num-layers 4",
                    True),
    "fp16": (TINY + " --fp16 --use-distributed-optimizer", True),
    "fp32": (TINY, False),
    "dropout": (BF16 + " --attention-dropout 0.1 --hidden-dropout 0.1", False),
    "recompute_full_uniform": (BF16 + " --recompute-granularity full --recompute-method uniform "
                               "--recompute-num-layers 1", True),
    "recompute_full_block": (BF16 + " --recompute-granularity full --recompute-method block "
                             "--recompute-num-layers 1", True),
    "recompute_selective": (BF16 + " --recompute-granularity selective", True),
    "recompute_dots": (BF16 + " --recompute-granularity dots", True),
    "recompute_offload": (BF16 + " --recompute-granularity offload", True),  # host memory spaces: GPUs only
    "documents": (BF16 + " --reset-attention-mask --reset-position-ids --eod-mask-loss", False),
    "llama_tp2_zero": (BF16 + LLAMA + " --tensor-model-parallel-size 2 --sequence-parallel "
                       "--use-distributed-optimizer", True),
    "flash_llama_dp8": (BF16 + LLAMA + " --attention-backend flash", True),
    # 4 layers: the layer loop runs 3 times (XLA peels one iteration off to pipeline the reduction)
    "dp8_zero_overlap": (BF16 + " --use-distributed-optimizer --overlap-grad-reduce --num-layers 4", True),
    "dp8_grad_bf16_overlap": (BF16 + " --grad-reduce-in-bf16 --overlap-grad-reduce --num-layers 4", True),
    "tp2_sp_dp4_zero_overlap": (BF16 + " --tensor-model-parallel-size 2 --sequence-parallel "
                                "--use-distributed-optimizer --overlap-grad-reduce --num-layers 4", True),
    "fp8_param_gather_dp8_zero": (BF16 + FP8 + " --use-distributed-optimizer --fp8-param-gather", True),
    "fp8_llama_pp2_1f1b_tp2_sp": (BF16 + FP8 + LLAMA + " --pipeline-model-parallel-size 2 --pipeline-schedule 1f1b "
                                  "--tensor-model-parallel-size 2 --sequence-parallel --num-layers 4 "
                                  "--fp8-amax-history-len 16 --fp8-amax-compute-algo max", True),
    "fp8_tensorwise_cp2_p2p_tp2_dots": (BF16 + FP8 + " --fp8-recipe tensorwise --context-parallel-size 2 --cp-comm-type p2p "
                                        "--tensor-model-parallel-size 2 --recompute-granularity dots", True),
    # The experts' products fp8 too: the dropless grouped kernels (fp8 wgmma)
    "fp8_tensorwise_ep4": (BF16 + FP8 + MOE + " --fp8-recipe tensorwise --expert-model-parallel-size 4", True),
    # Megatron-FSDP: 4 layers, each gathered and reduce-scattered inside the layer loop
    "fsdp_params_dp8": (BF16 + " --use-megatron-fsdp --num-layers 4", True),
    "fsdp_params_tp2_sp_dp4": (BF16 + " --use-megatron-fsdp --tensor-model-parallel-size 2 --sequence-parallel "
                               "--num-layers 4", True),
    "fsdp_grads_dp8": (BF16 + " --use-megatron-fsdp --data-parallel-sharding-strategy optim_grads --num-layers 4", True),
    # Hybrid sharding: 2 instances of 4 data ranks
    "zero1_dp8_instances2": (BF16 + " --use-distributed-optimizer --num-distributed-optimizer-instances 2", True),
    "fsdp_params_dp8_instances2": (BF16 + " --use-megatron-fsdp --num-distributed-optimizer-instances 2 --num-layers 4",
                                   True),
    # DeepSeek-V3's shape: multi-latent attention (cuDNN, 192-wide heads, the values padded to 192), a dense
    # first layer, then MoE layers of sigmoid, group-limited routing with the expert bias and a shared
    # expert, and one multi-token prediction depth; in fp8 (delayed scaling), the experts too; the
    # dispatch's receive buffers 1.5 x a balanced load (the worst case: 2 x)
    "mla_moe_mtp_fp8_ep2_tp2_sp_zero": (BF16 + FP8 + MLA + MOE + DEEPSEEK_ROUTER + " --moe-receive-buffer-factor 1.5"
                                        " --expert-model-parallel-size 2 "
                                    "--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer "
                                    "--num-layers 3 --moe-layer-freq [0,1,1] --mtp-num-layers 1", True),
}
# One layout of each family, with the ones the tests below name: `MLM_JAX_GPU_LAYOUTS=smoke`.
SMOKE = ("dp8_zero", "tp2_sp_dp4_zero", "cp2_p2p", "cp2_a2a_pp2_flash", "pp2_1f1b_tp2", "pp2_interleaved_zero",
         "ep4_alltoall", "ep2_allgather_tp2", "pp2_tp2_moe", "fp16", "fp32", "recompute_full_block", "recompute_dots",
         "documents", "llama_tp2_zero", "tp2_sp_dp4_zero_overlap", "fp8_llama_pp2_1f1b_tp2_sp", "fp8_tensorwise_ep4",
         "fsdp_params_tp2_sp_dp4", "fsdp_params_dp8_instances2", "mla_moe_mtp_fp8_ep2_tp2_sp_zero")
if os.environ.get("MLM_JAX_GPU_LAYOUTS", "all") not in ("all", "smoke"):
    raise ValueError(f"MLM_JAX_GPU_LAYOUTS={os.environ['MLM_JAX_GPU_LAYOUTS']!r}: choose all or smoke")
if os.environ.get("MLM_JAX_GPU_LAYOUTS") == "smoke":
    LAYOUTS = {n: LAYOUTS[n] for n in SMOKE}
HYBRID = [n for n in LAYOUTS if "--num-distributed-optimizer-instances" in LAYOUTS[n][0]]
FP8_LAYOUTS = [n for n in LAYOUTS if "--fp8-format" in LAYOUTS[n][0]]
FSDP = [n for n in LAYOUTS if "--use-megatron-fsdp" in LAYOUTS[n][0]]
OVERLAP = [n for n in LAYOUTS if "--overlap-grad-reduce" in LAYOUTS[n][0]]
DENSE = [n for n in LAYOUTS if "--num-experts" not in LAYOUTS[n][0] and LAYOUTS[n][0].startswith(BF16)]
MIB = 2**20


def _worker_jobs(lanes: int = 2) -> list[list[list[str]]]:
    """The layouts as worker processes in `lanes` parallel lanes (one per core): XLA reads its
    flags once per process, so each process compiles layouts whose GPU runs set the same flags
    (`xla_flags.gpu_flags`: under --sequence-parallel the pipelined all-gather is left out)."""
    from mlm_jax.arguments import parse_args
    from mlm_jax.xla_flags import gpu_flags

    groups: dict[tuple, list[str]] = {}
    for name, (flags, _) in LAYOUTS.items():
        groups.setdefault(tuple(gpu_flags(parse_args(shlex.split(flags)).parallel)), []).append(name)
    jobs: list[list[list[str]]] = [[] for _ in range(lanes)]
    for group in sorted(groups.values(), key=len, reverse=True):
        for part in (group[i::lanes] for i in range(min(lanes, len(group)))):
            min(jobs, key=lambda lane: sum(map(len, lane))).append(part)
    return jobs


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict:
    """Every layout's plan report, compiled by worker processes in two lanes (one per core); the
    processes of a lane run one after another and share XLA's GPU kernel cache (ptxas then
    assembles a kernel that an earlier layout already had once: about 30% of the tier's CPU
    time; the compiled HLO, which is what is checked here, does not depend on it)."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(root)
    tmp = tmp_path_factory.mktemp("gpu")

    def lane(i: int, parts: list[list[str]]) -> list[Path]:
        outs = []
        for j, names in enumerate(parts):
            out = tmp / f"plans{i}_{j}.json"
            p = subprocess.run([sys.executable, "-m", "tests.gpu_compile_worker", str(out),
                                f"--kernel-cache={tmp / f'kernels{i}.bin'}",
                                *[f"{n}={LAYOUTS[n][0]}" for n in names]],
                               cwd=root, env=env, capture_output=True, text=True, timeout=1800)
            assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
            outs.append(out)
        return outs

    jobs = _worker_jobs()
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        lanes = list(pool.map(lane, range(len(jobs)), jobs))
    results = {}
    for out in (o for outs in lanes for o in outs):
        results.update(json.loads(out.read_text()))
    assert sorted(results) == sorted(LAYOUTS)
    return results


def _plan(plans, name) -> dict:
    r = plans[name]
    assert "error" not in r, f"{name} does not compile for H100: {r['error']}"
    return r


def _collectives(r, *, axis=None, kinds=None, min_bytes=0):
    return [c for c in r["collective_list"]
            if (axis is None or axis in c["axes"]) and (kinds is None or c["kind"] in kinds)
            and c["bytes"] >= min_bytes]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiles_and_attention_backend(plans, name):
    r = _plan(plans, name)
    cudnn = LAYOUTS[name][1]
    assert (r["attention_backend"] == "cudnn") == cudnn, (name, r["attention_backend"], r["cudnn_attention_calls"])
    if cudnn:  # the forward kernel and its backward (allgather's with the mask as a bias: ScaleBias)
        calls = r["cudnn_attention_calls"]
        assert sum(n for k, n in calls.items() if k.endswith("Softmax")) >= 1, calls
        assert sum(n for k, n in calls.items() if k.endswith("SoftmaxBackward")) >= 1, calls
    assert r["per_device_bytes"]["total"] > r["per_device_bytes"]["parameters"] > 0


@pytest.mark.parametrize("name", DENSE)
def test_bf16_dense_step_has_no_fp32_matmul(plans, name):
    r = _plan(plans, name)
    assert r["matmul_dtypes"], name
    fp32 = {k: n for k, n in r["matmul_dtypes"].items() if "f32" in k}
    assert not fp32, (name, r["matmul_dtypes"])


def _fmha_runs(r, suffix: str) -> int:
    return sum(n for k, n in r["cudnn_attention_runs"].items() if k.endswith(suffix))


# The layouts whose attention runs in the layer loop itself: not the pipeline's (each stage's
# forward is recomputed for its backward by design, pipeline/runtime.py), not context
# parallelism's (its ring or gathered blocks run in branches and loops of their own, and
# allgather/a2a recompute theirs inside the backward's shard_map by design, parallel/context.py).
LAYER_LOOP_ATTENTION = [n for n in LAYOUTS if LAYOUTS[n][1] and "pp" not in n and "cp" not in n]


@pytest.mark.parametrize("name", LAYER_LOOP_ATTENTION)
def test_attention_forward_runs_once_short_of_full_recompute(plans, name):
    """As many cuDNN forward kernels as backward kernels run in a step for every recompute policy
    short of `full` (none, selective, dots, offload: recompute.keep_attention); under full, one
    more for each recomputed layer (uniform: all 2 of them; block: the first 1). On today's main
    `dots` and `offload` ran the forward twice."""
    r = _plan(plans, name)
    forward, backward = _fmha_runs(r, "Softmax"), _fmha_runs(r, "SoftmaxBackward")
    per_backward = {"recompute_full_uniform": 2, "recompute_full_block": 1.5}.get(name, 1)
    assert backward >= 1 and forward == per_backward * backward, r["cudnn_attention_runs"]


ZERO = [n for n in LAYOUTS if "zero" in n or n == "fp16"]


@pytest.mark.parametrize("name", ZERO)
def test_zero_gathers_parameters_in_the_compute_dtype(plans, name):
    """Megatron's distributed optimizer gathers its bf16 parameter copy: so do we. What stays
    fp32 are the parameters applied in fp32 (norm scales), a few KiB."""
    r = _plan(plans, name)
    low = "f16" if "--fp16" in LAYOUTS[name][0] else "bf16"
    gathers = _collectives(r, axis="data", kinds=("all-gather",), min_bytes=64 * 1024)
    assert gathers, name
    total = sum(c["bytes"] for c in gathers)
    if "--fp8-param-gather" in LAYOUTS[name][0]:
        # the projections' weights in e4m3 (most of the bytes), the embedding and head in bf16
        fp8_bytes = sum(c["bytes_by_dtype"].get("f8e4m3fn", 0) for c in gathers)
        assert fp8_bytes >= 0.4 * total and fp8_bytes + sum(c["bytes_by_dtype"].get(low, 0) for c in gathers) >= 0.98 * total, \
            [c["bytes_by_dtype"] for c in gathers]
        return
    assert sum(c["bytes_by_dtype"].get(low, 0) for c in gathers) >= 0.98 * total, \
        [c["bytes_by_dtype"] for c in gathers]


@pytest.mark.parametrize("name", [n for n in LAYOUTS if ("dp" in n or "zero" in n or n in ("fp16", "fp32", "dropout"))
                                  and n not in OVERLAP + FSDP])
def test_gradient_reduction_once_outside_loops(plans, name):
    r = _plan(plans, name)
    grads = _collectives(r, axis="data", kinds=("all-reduce", "reduce-scatter"), min_bytes=64 * 1024)
    assert grads, name
    assert not [c for c in grads if c["in_loop"]], [(c["kind"], c["bytes"], c["op_name"]) for c in grads if c["in_loop"]]
    # Each parameter's gradient is reduced once: the bytes moved are the fp32 (or bf16) gradients,
    # not a multiple of them (a reduction per microbatch would multiply them by 8).
    params = r["per_device_bytes"]["parameters"] * (r["mesh"]["data"] if "zero" in name or name == "fp16" else 1)
    assert sum(c["bytes"] for c in grads) <= 1.05 * params, (sum(c["bytes"] for c in grads), params)
    if "grad_bf16" in name:
        assert all(c["dtypes"] == ["bf16"] for c in grads), [c["dtypes"] for c in grads]


@pytest.mark.parametrize("name", OVERLAP)
def test_overlap_grad_reduce_reduces_each_layer_in_the_backward_overlapping_compute(plans, name):
    """--overlap-grad-reduce: the layers' gradients reduce-scattered inside the layer loop of the
    last microbatch's backward (a conditional's branch in the microbatch loop), every gradient
    reduction overlapping compute; nothing reduced per microbatch. Without the flag the same
    layout reduces once after the loop (test above), overlapping only the optimizer's update."""
    r = _plan(plans, name)
    grads = _collectives(r, axis="data", kinds=("all-reduce", "reduce-scatter"), min_bytes=64 * 1024)
    # In the layer loop: run more often than the branch's microbatch loop alone would run them.
    microbatches = 32 // (2 * r["mesh"]["data"] * r["mesh"].get("replica", 1))  # global batch / (micro batch x dp)
    in_layers = [c for c in grads if c["in_branch"] and c["runs"] > microbatches]
    zero = "--use-distributed-optimizer" in LAYOUTS[name][0]
    kind = "reduce-scatter" if zero else "all-reduce"  # into ZeRO's shards, or whole
    assert in_layers and all(c["kind"] == kind and c["overlapped"] for c in in_layers), grads
    assert not [c for c in grads if c["in_loop"] and not c["in_branch"]], grads
    reduction = r["data_parallel"]["gradient reduction"]
    assert reduction["overlapped"] == reduction["count"] >= 2, reduction
    # Each parameter reduced once per step: one execution of the branch's reductions moves at
    # most the parameters' fp32 gradients (the layer loop's one layer each).
    params = r["per_device_bytes"]["parameters"] * (r["mesh"]["data"] if zero else 1)
    if "--grad-reduce-in-bf16" in LAYOUTS[name][0]:  # half the bytes, in bf16 on the wire
        params //= 2
        assert all(c["dtypes"] == ["bf16"] for c in grads), [c["dtypes"] for c in grads]
    assert sum(c["bytes"] for c in grads if c["in_branch"]) <= 1.05 * params, (grads, params)


# One layer's weights of the tiny model in bf16 (h 256, MLP 1024: 12 h^2, and its biases and
# norms): a per-layer gather carries at most two layers' (3.2 MiB); the 4 layers' stack 6.3 MiB.
LAYER_BF16_BYTES = 2 * (12 * 256**2 + 13 * 256)


@pytest.mark.parametrize("name", FSDP)
def test_fsdp_gathers_and_reduce_scatters_one_layer_at_a_time_inside_the_layer_loop(plans, name):
    """--use-megatron-fsdp: the layers' weights all-gathered over `data` in bf16 inside the layer
    loop, a layer (or two combined) at a time, never the stack; under optim_grads_params again
    in the backward (the gathered bytes of a step twice the forward's); their gradients
    reduce-scattered inside the loop; no data-parallel gradient all-reduced whole; the gathers
    and most of the loop's reductions asynchronous beside compute."""
    r = _plan(plans, name)
    tp = r["mesh"].get("tensor", 1)
    gathers = _collectives(r, axis="data", kinds=("all-gather",), min_bytes=64 * 1024)
    assert max(c["bytes"] for c in gathers) <= 2.05 * LAYER_BF16_BYTES / tp, [(c["bytes"], c["op_name"]) for c in gathers]
    in_loop = [c for c in gathers if c["in_loop"]]
    assert sum(c["bytes_by_dtype"].get("bf16", 0) for c in in_loop) >= 0.98 * sum(c["bytes"] for c in in_loop)
    # Bytes gathered a step: each layer once per microbatch (4 layers), twice under
    # optim_grads_params; the embedding's gather besides.
    gathered = sum(c["bytes"] * c["runs"] for c in gathers)
    microbatches = 32 // (2 * r["mesh"]["data"] * r["mesh"].get("replica", 1))  # global batch / (micro batch x dp)
    forward = microbatches * 4 * LAYER_BF16_BYTES / tp
    assert (1.9 * forward if "fsdp_params" in name else 0.95 * forward) <= gathered, (gathered, forward)
    assert gathered <= (2.2 if "fsdp_params" in name else 1.2) * forward, (gathered, forward)
    scattered = _collectives(r, axis="data", kinds=("reduce-scatter",), min_bytes=64 * 1024)
    assert sum(c["runs"] for c in scattered if c["in_loop"]) >= 4, scattered
    assert not _collectives(r, axis="data", kinds=("all-reduce",), min_bytes=64 * 1024)
    assert all(c["is_async"] and c["overlapped"] for c in gathers), [(c["bytes"], c["is_async"], c["overlapped"])
                                                                     for c in gathers]
    # The loop's reductions overlap the backward, but the last layer's of a microbatch, which
    # has no compute left beside it (XLA runs it synchronously).
    looped = [c for c in scattered if c["in_loop"]]
    overlapped = sum(c["runs"] for c in looped if c["is_async"] and c["overlapped"])
    assert overlapped >= 0.6 * sum(c["runs"] for c in looped), [
        (c["bytes"], c["runs"], c["is_async"], c["overlapped"]) for c in looped]


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_sharding_reduces_within_an_instance_then_across(plans, name):
    """--num-distributed-optimizer-instances 2 over 8 ranks: the gradients reduce-scattered over
    `data` (each instance's 4 ranks; per layer inside the loop under FSDP), then each rank's
    quarter share all-reduced over `replica`; nothing gathered over `replica` (each instance
    holds the whole sharded state) and no gradient all-reduced whole (but the few-KiB vectors no
    dim of which splits over `data`, as in every FSDP layout). The bytes sent over each axis are
    the analytic model's."""
    from mlm_jax.arguments import parse_args
    from mlm_jax.plan import analytic
    from mlm_jax.validation import finalize

    r = _plan(plans, name)
    assert r["mesh"]["replica"] == 2 and r["mesh"]["data"] == 4, r["mesh"]
    across = [c for c in r["collective_list"] if "replica" in c["axes"] and c["bytes"] >= 64 * 1024]
    assert across and all(c["axes"] == ["replica"] and c["kind"] == "all-reduce" for c in across), across
    scattered = sum(c["bytes"] * c["runs"] for c in _collectives(r, axis="data", kinds=("reduce-scatter",)))
    shares = sum(c["bytes"] * c["runs"] for c in across)
    assert 0.24 * scattered <= shares <= 0.26 * scattered, (shares, scattered)
    assert not _collectives(r, axis="data", kinds=("all-reduce",), min_bytes=64 * 1024)
    if "fsdp" in name:
        assert any(c["in_loop"] for c in across), across
    cfg = finalize(parse_args(shlex.split(LAYOUTS[name][0])), 8)
    predicted, sent = analytic.communication(cfg, analytic.layout_of(cfg, 8)), r["sent_bytes_per_axis"]
    assert abs(predicted["replica"] / sent["replica"] - 1) < 0.02, (predicted, sent)
    assert abs(predicted["data"] / sent["data"] - 1) < 0.05, (predicted, sent)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_collectives_run_async_beside_compute(plans, name):
    """XLA runs a collective asynchronously where its scheduler finds compute to put beside it,
    synchronously where it finds none (`"is_sync":true`: e.g. the loss's few-byte all-reduce after
    the backward): in every layout some run async, overlapping compute. (jax 0.10's XLA kept its
    synchronous collectives as start/done pairs, which `mlm_jax.plan` read as async until jax
    0.12's wrote them as plain instructions.)"""
    r = _plan(plans, name)
    assert r["collectives_total"] > 0
    assert r["collectives_async"] >= r["collectives_overlapped"] > 0, r["collective_list"]


def test_every_kind_of_collective_runs_async_somewhere(plans):
    """XLA turns async collectives off kind by kind (--xla_gpu_disable_async_collectives): every
    kind the layouts use runs async in one of them."""
    used, run_async = set(), set()
    for name in LAYOUTS:
        for c in _plan(plans, name)["collective_list"]:
            used.add(c["kind"])
            if c["is_async"]:
                run_async.add(c["kind"])
    assert used == run_async == {"all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
                                 "collective-permute"}


@pytest.mark.parametrize("name", [n for n in ("ep4_alltoall", "ep2_pp2") if n in LAYOUTS])
def test_expert_dispatch_sends_the_routed_rows_by_ragged_all_to_all(plans, name):
    """The alltoall dispatcher on H100 (parallel/experts.py): per MoE layer and microbatch, four
    ragged all-to-alls over `expert` (the dispatch and the return in the forward and their
    backward, the reverse exchanges: the dispatch keeps what it received and returned, so none
    runs again for the backward), each sending a rank's T*K
    routed rows, T*K*d*2 bytes in bf16 (gpu_hlo counts the rows sent), every one async; no
    all-to-all of token rows, only the counts' and offsets' (int32, [ep, 2, E/ep] and [ep, E/ep]).
    Before, the dispatch sent every destination a block padded to T*K rows: ep times the bytes
    (ep4_alltoall: 48.1 MiB a step over `expert`, now 12.0). In the pipeline's per-rank schedule
    (ep2_pp2) too, where every tick runs its slots' layers: a multiple of the same rows."""
    from mlm_jax.arguments import parse_args
    from mlm_jax.pipeline import lockstep
    from mlm_jax.plan import analytic
    from mlm_jax.validation import finalize

    r = _plan(plans, name)
    cfg = finalize(parse_args(shlex.split(LAYOUTS[name][0])), 8)
    L = analytic.layout_of(cfg, 8)
    m = cfg.model
    rows = L.micro * cfg.train.seq_length * m.moe_router_topk  # T*K: a rank's routed rows
    sent = rows * m.hidden_size * 2
    ragged = _collectives(r, axis="expert", kinds=("ragged-all-to-all",))
    assert ragged and all(c["bytes"] == sent and c["dtypes"] == ["bf16"] and c["is_async"] for c in ragged), ragged
    # Every layer is a MoE layer here. A pipeline runs a forward slot's layers (2 exchanges) and
    # a backward slot's (recompute and backward: 4) on every tick of its phases, idle or not.
    if L.pp == 1:
        exchanges = 4 * m.num_layers * L.microbatches
        assert len(ragged) == 4, ragged
    else:
        phases = lockstep.phases(lockstep.two_slot(L.schedule or "1f1b", L.pp, L.microbatches, L.vp))
        chunk = m.num_layers // (L.pp * L.vp)
        exchanges = chunk * sum(2 * p.ticks * p.forward + 4 * p.ticks * p.backward for p in phases)
    assert sum(c["bytes"] * c["runs"] for c in ragged) == exchanges * sent, (ragged, exchanges)
    small = _collectives(r, axis="expert", kinds=("all-to-all",))
    assert small and all(c["bytes"] <= 2 * 4 * m.num_experts for c in small), small  # int32 counts, offsets


@pytest.mark.parametrize("name", ZERO)
def test_zero_gather_overlaps_compute(plans, name):
    r = _plan(plans, name)
    gathers = r["data_parallel"]["ZeRO parameter gather"]
    assert gathers["overlapped"] == gathers["count"] >= 1, gathers


def test_plan_reports_what_the_schedule_shows(plans):
    """The report's overlap counts are those of the collective list (compute between start and
    done); the once-per-step gradient reduction is there in every data-parallel layout."""
    for name in LAYOUTS:
        r = _plan(plans, name)
        assert r["collectives_overlapped"] == sum(c["overlapped"] for c in r["collective_list"])
        if r["mesh"]["data"] > 1:
            assert r["data_parallel"]["gradient reduction"]["count"] >= 1, name


def test_moe_in_a_tensor_parallel_pipeline_keeps_its_experts_split(plans):
    """pp2 x tp2 (dp2), no expert parallelism: each tensor rank runs its f shard of every expert
    through the grouped-matmul kernels on its own operands (a shard_map manual over `tensor`:
    GSPMD cannot partition the kernels' custom calls and would gather the weights for them), so
    no all-gather over `tensor` carries a layer's experts, and the step fits. The stages held
    every layer's experts whole before (temporaries, jax 0.10.2: 79.5 MiB, now 40.3; 0.12: 103.8, now 68.1)."""
    r = _plan(plans, "pp2_tp2_moe")
    assert r["fits"]
    experts, hidden, ffn, tp = 4, 256, 1024, 2
    share = experts * hidden * ffn // tp * 2  # one layer's w1 on a device, bf16
    gathered = _collectives(r, axis="tensor", kinds=("all-gather",), min_bytes=share)
    assert not gathered, [(c["bytes"], c["op_name"]) for c in gathered]


@pytest.mark.parametrize("name", FP8_LAYOUTS)
def test_fp8_projections_are_fp8_gemms(plans, name):
    """--fp8-format hybrid (delayed or tensorwise): the forward multiplies e4m3 x e4m3, the gradients e5m2 with e4m3, no
    product of them upcast (Triton's GEMMs upcast e5m2 x e4m3 to f16; GPU runs keep them off;
    the experts' grouped kernels are checked in their PTX: `test_fp8_experts_multiply_on_fp8_wgmma`),
    fp8 FLOPs are at least every product the planner counts as fp8 (`analytic.fp8_flops`: every
    projection's forward and two backward products, MLA's included, and a MoE layer's shared and
    routed experts'), and at least 80 % of the GEMMs' FLOPs (the issue's bar; the LM head is the
    rest). With attention's FLOPs (bf16, cuDNN) the fp8 share is lower: at these tiny sizes a
    quarter of the step or more."""
    from mlm_jax.arguments import parse_args
    from mlm_jax.plan import analytic
    from mlm_jax.validation import finalize

    r = _plan(plans, name)
    types = {tuple(k.split(" x ")) for k in r["matmul_dtypes"]}
    assert ("f8e4m3fn", "f8e4m3fn") in types, r["matmul_dtypes"]
    assert any("f8e5m2" in t and "f8e4m3fn" in t for t in types), r["matmul_dtypes"]
    assert not any("f16" in t for t in types), r["matmul_dtypes"]
    cfg = finalize(parse_args(shlex.split(LAYOUTS[name][0])), 8)
    t = r["step_time"]
    assert t["fp8_matmul_flops"] >= analytic.fp8_flops(cfg, analytic.layout_of(cfg, 8)) * (1 - 0.0015), \
        (t["fp8_matmul_flops"], analytic.fp8_flops(cfg, analytic.layout_of(cfg, 8)))
    assert t["fp8_gemm_flops_share"] >= 0.8 and 0 < t["fp8_matmul_flops_share"] < 1, t


# --------------------------------------------------------------------------- the compiler and the targets

def _gpu_process(script: str, timeout=900, xla_flags: str = "") -> dict:
    """Run `script` in a process started with the XLA flags a GPU run sets (`xla_flags.apply`
    before jax starts, as `mlm_jax.plan` does) after `xla_flags`; it prints one JSON line last."""
    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if xla_flags:
        env["XLA_FLAGS"] = xla_flags
    env["PYTHONPATH"] = str(root)
    preamble = ("import json, re\nfrom mlm_jax import xla_flags\nfrom mlm_jax.arguments import parse_args\n"
                "xla_flags.apply(parse_args([]).parallel, gpu=True)\nimport jax, jax.numpy as jnp\n"
                "jax.config.update('jax_platforms', 'cpu')\n")
    p = subprocess.run([sys.executable, "-c", preamble + script], cwd=root, env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


_MATMULS = r'custom_call_target="__cublas\$(?:lt\$matmul|gemm)[^"]*"|= [^=]* dot\('


def test_xla_adds_no_recompute_of_its_own_near_the_memory_limit():
    """A GPU run keeps XLA's rematerialization pass off (xla_flags.NO_COMPILER_RECOMPUTE): the
    same `dots` step compiled for an H100 whose memory it nearly fills runs exactly the matmuls
    it runs on a full H100. Without the flag, jax 0.12's XLA duplicated 2 of the 15 (0.10's did
    not), and its temporaries were larger, not smaller (490.6 MiB against 474.6)."""
    got = _gpu_process(f"""
from jax.experimental import topologies
from mlm_jax.plan.compile import compile_step
from mlm_jax.plan.targets import gpu, target_text
from mlm_jax.validation import finalize
flags = {(TINY + " --bf16 --recompute-granularity dots --num-layers 4 --hidden-size 512 --seq-length 1024 "
          "--max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 64").split()!r}
cfg = finalize(parse_args(flags), 8)
out = {{}}
for memory in (84942979072, 400000000):
    text = re.sub(r"device_memory_size: \\d+", f"device_memory_size: {{memory}}", target_text(gpu("h100")))
    devs = list(topologies.get_topology_desc(platform="cuda", target_config=text, topology="1x1x8").devices)
    c = compile_step(cfg, devs)
    out[memory] = [len(re.findall({_MATMULS!r}, c.text)), c.compiled.memory_analysis().temp_size_in_bytes]
print(json.dumps(out))
""")
    (full, _), (tight, tight_temp) = got["84942979072"], got["400000000"]
    assert full > 0 and tight == full, got
    assert tight_temp > 400_000_000 * 0.9, got  # the step did come near the small memory


def test_fp8_experts_multiply_on_fp8_wgmma(tmp_path):
    """The dropless experts' three fp8 products (models/fp8.py `grouped`: the forward e4m3 x e4m3,
    the input gradient e5m2 x e4m3, the weight gradient e4m3 x e5m2) compile, in the grouped
    kernels' PTX for an H100, to Hopper's fp8 wgmma with fp32 accumulation, and nothing to the
    f16 `mma.sync` that Pallas's own dot lowering falls back to for fp8 (kernels/tile_dot.py).
    (jax 0.12's XLA writes the kernels' PTX only where an emitter pattern is given.)"""
    got = _gpu_process("""
import glob
from jax.sharding import Mesh, SingleDeviceSharding
from mlm_jax import platform
from mlm_jax.models import fp8
from mlm_jax.plan.targets import devices, gpu
from mlm_jax.sharding import trace
dev = devices(gpu("h100"), 1, 1)[0]
one = SingleDeviceSharding(dev)
x = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16, sharding=one)
w = jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16, sharding=one)
sizes = jax.ShapeDtypeStruct((4,), jnp.int32, sharding=one)
def loss(x, w, sizes):
    return jnp.sum(fp8.grouped(x, w, sizes, fp8.Recipe()).astype(jnp.float32))
with jax.set_mesh(Mesh([dev], ("x",))), trace.using(platform=platform.CUDA):
    jax.jit(jax.value_and_grad(loss, (0, 1))).lower(x, w, sizes).compile()
ptx = "".join(open(f).read() for f in glob.glob(sys.argv[1] + "/*.ptx"))
print(json.dumps(sorted(set(re.findall(r"wgmma\\.mma_async\\S*|mma\\.sync\\S*", ptx)))))
""".replace("sys.argv[1]", repr(str(tmp_path))), xla_flags=f"--xla_dump_to={tmp_path} --xla_gpu_dump_llvmir --xla_dump_emitter_re=.*")
    kinds = {re.sub(r"\.m64n\d+k\d+", "", k) for k in got}
    assert kinds == {f"wgmma.mma_async.sync.aligned.f32.{a}.{b}" for a, b in
                     (("e4m3", "e4m3"), ("e5m2", "e4m3"), ("e4m3", "e5m2"))}, got


def test_targets_describe_the_installed_cudnn_and_cuda():
    """Every target tells XLA the cuDNN and CUDA runtime of the wheels installed here (XLA gates
    features on both), and with CUDA 12 an fp8 matmul compiles to cuBLASLt's fp8 GEMM. The
    targets used to claim cuDNN 9.10 and no CUDA runtime: XLA assumed CUDA < 12 and upcast fp8."""
    from importlib import metadata

    from mlm_jax.plan.targets import GPUS, target_text

    cudnn = metadata.version("nvidia-cudnn-cu12").split(".")[:2]
    nvcc = metadata.version("nvidia-cuda-nvcc-cu12").split(".")[:2]
    for name, target in GPUS.items():
        text = target_text(target)
        assert f"dnn_version_info {{\n  major: {cudnn[0]}\n  minor: {cudnn[1]}\n}}" in text, name
        assert f"runtime_version {{\n  major: {nvcc[0]}\n  minor: {nvcc[1]}\n}}" in text, name
        with open(target.target_file) as f:  # the files' own, for machines without the wheels
            assert "runtime_version {" in f.read(), name
    got = _gpu_process("""
from jax.sharding import SingleDeviceSharding
from mlm_jax.plan.targets import devices, gpu
dev = devices(gpu("h100"), 1, 1)[0]
a = jax.ShapeDtypeStruct((256, 512), jnp.float8_e4m3fn, sharding=SingleDeviceSharding(dev))
b = jax.ShapeDtypeStruct((512, 256), jnp.float8_e4m3fn, sharding=SingleDeviceSharding(dev))
f = lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.bfloat16)
print(json.dumps(sorted(set(re.findall(r'custom_call_target="([^"]*)"', jax.jit(f).lower(a, b).compile().as_text())))))
""")
    assert got == ["__cublas$lt$matmul$f8"], got


# --------------------------------------------------------------------------- the MoE grouped matmul

def test_grouped_matmul_compiles_to_triton_kernels_doing_the_useful_work():
    """`mlm_jax.kernels.grouped_matmul`'s value and gradients at Mixtral's expert sizes (R = 2 x
    4096 rows, G = 8 experts, k = 4096, n = 14336, bf16) compile for an H100 to its three Pallas
    kernels as Triton custom calls: no dot anywhere, so none over all G experts as XLA's
    ragged_dot expansion runs (a masked [R, G, k] copy of the rows: G times the useful FLOPs), no
    buffer with both an R and a G dim. The kernels' grids bound the FLOPs they execute: every
    program of the row-wise kernels a whole [tm, tn] tile through the whole contraction, the
    weight gradient's ceil(size_g / tk) row steps per group; at most 1.25 x the useful 3 x 2 R k n
    (1.094 x here: the forward and input gradient 71 row tiles for 64 rows' worth, group edges
    inside tiles; the weight gradient up to tk - 1 rows more per group)."""
    R, G, k, n = 2 * 4096, 8, 4096, 14336
    got = _gpu_process(f"""
import numpy as np
from jax.sharding import Mesh, SingleDeviceSharding
from mlm_jax import platform
from mlm_jax.kernels import grouped_matmul
from mlm_jax.plan.targets import devices, gpu
from mlm_jax.sharding import trace
dev = devices(gpu("h100"), 1, 1)[0]
on = SingleDeviceSharding(dev)
x = jax.ShapeDtypeStruct(({R}, {k}), jnp.bfloat16, sharding=on)
w = jax.ShapeDtypeStruct(({G}, {k}, {n}), jnp.bfloat16, sharding=on)
sizes = jax.ShapeDtypeStruct(({G},), jnp.int32, sharding=on)
loss = lambda x, w, sizes: grouped_matmul(x, w, sizes).astype(jnp.float32).sum()
# Lowered in the compile-only devices' mesh, as a step is (parallelize): jax 0.12's Triton
# lowering asks it which GPU it compiles for (the default device here is a CPU).
with jax.set_mesh(Mesh(np.array([dev]), ("x",))), trace.using(platform=platform.CUDA):
    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w, sizes).compile().as_text()
kernels = []
for line in text.splitlines():
    if 'custom_call_target="__gpu$xla.gpu.triton"' in line:
        grid = [int(g) for g in re.findall(r"grid_[xyz] = (\\d+)", line)]
        kernels.append([re.search(r'name = "([^"]+)"', line).group(1), int(np.prod(grid))])
shapes = sorted({{s for s in re.findall(r"\\w+\\[([\\d,]+)\\]", text)}})
print(json.dumps({{"kernels": kernels, "matmuls": len(re.findall({_MATMULS!r}, text)), "shapes": shapes}}))
""")
    from mlm_jax.kernels import Tiles

    t = Tiles()
    programs = dict(got["kernels"])
    assert sorted(programs) == ["grouped_matmul", "grouped_matmul_dw", "grouped_matmul_wt"], got["kernels"]
    assert got["matmuls"] == 0, got["matmuls"]
    assert not [s for s in got["shapes"] if {R, G} <= {int(d) for d in s.split(",")}], got["shapes"]
    assert programs["grouped_matmul"] == (-(-R // t.tm) + G - 1) * -(-n // t.tn)
    tile = 2 * t.tm * t.tn
    executed = (programs["grouped_matmul"] * tile * k + programs["grouped_matmul_wt"] * tile * n
                + programs["grouped_matmul_dw"] // G * tile * (R + G * (t.tk - 1)))
    useful = 3 * 2 * R * k * n
    assert useful < executed <= 1.25 * useful, executed / useful


# --------------------------------------------------------------------------- the step time

def _ratio_band(name: str) -> tuple[float, float]:
    """The executed matmul FLOPs / model FLOPs a layout's program should show (the report's
    ratio: the matmul and attention kernels' FLOPs, per device times the 8 devices, against
    `metrics.flops_per_token`'s model: causal attention's `A = 2*s*a*d` per token and layer in
    the forward, 2A in the backward), as a (low, high) band, worked out from the config:

    - cuDNN attention's backward recomputes the scores: +0.5 A (step_time's convention); XLA
      attention computes the masked half too (2A forward, 4A backward) and recomputes the
      probabilities in its backward like a flash kernel (+A): +4 A in all;
    - full recompute runs each rematerialized group's forward again except its last matmul,
      whose output the backward does not need (XLA drops it: fc2 of the group's last layer);
      dots, selective (fused attention keeps no scores) and offload recompute no matmul;
    - a pipeline runs its phases' slots on every stage, masked or not (mlm_jax/pipeline/lockstep.py):
      F forward-slot and B backward-slot ticks of one chunk each, a backward slot recomputing
      its chunk's forward and computing 1/P of the head (forward and backward) on every stage,
      against m microbatches through V chunks: layers (F + B)/(mV) forwards and B/(mV)
      backwards, the head B/m times;
    - context parallelism's ring may compute masked blocks whole and run attention's forward
      again in its backward: up to 12 A more (attention at most five times its model count).

    Exact figures within 0.15% (the program has no other matmul); with context parallelism the
    band runs from the figure without it to those 12 A more."""
    from mlm_jax.arguments import parse_args
    from mlm_jax.metrics import flops_per_token
    from mlm_jax.plan import analytic
    from mlm_jax.validation import finalize

    cfg = finalize(parse_args(shlex.split(LAYOUTS[name][0])), 8)
    m, L = cfg.model, analytic.layout_of(cfg, 8)
    s, h, a, g, d = cfg.train.seq_length, m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim
    model = flops_per_token(m, s)  # per token: 3 x (layers' forward + head)
    head = 2 * h * m.vocab
    attention = 2 * s * a * d * m.num_layers  # A, all layers
    cudnn = LAYOUTS[name][1]
    forward = model / 3 - head + (0 if cudnn else attention)  # the layers' forward as executed
    backward = 2 * (model / 3 - head) + (0.5 if cudnn else 3) * attention
    if m.recompute_granularity == "full":
        k = m.recompute_num_layers or 1
        layers = min(k, m.num_layers) if m.recompute_method == "block" else m.num_layers
        last = layers if m.recompute_method == "block" else -(-m.num_layers // k)  # groups' last fc2
        layer = 2 * (h * (a + 2 * g) * d + a * d * h + h * analytic.f_gate(m) + m.ffn_size * h)
        backward += layers * layer - last * 2 * m.ffn_size * h + layers / m.num_layers * attention * (1 if cudnn else 2)
    runs = _pipeline_runs(L)
    expected = (runs["forward"] * forward + runs["backward"] * backward + runs["head"] * 3 * head) / model
    if L.cp > 1:
        return expected * (1 - 0.0015), expected + 12 * attention * runs["backward"] / model
    return expected * (1 - 0.0015), expected * (1 + 0.0015)


def _pipeline_runs(L) -> dict:
    """How many times a layout's program runs each layer's forward and backward and the head, per
    microbatch and chunk: once without a pipeline; with one, its phases' slots on every stage
    (`_ratio_band`)."""
    from mlm_jax.pipeline import lockstep

    if L.pp == 1:
        return {"forward": 1.0, "backward": 1.0, "head": 1.0}
    table = lockstep.two_slot(L.schedule or ("interleaved" if L.vp > 1 else "1f1b"), L.pp, L.microbatches, L.vp)
    ticks = lockstep.phases(table)
    f_ticks = sum(p.ticks for p in ticks if p.forward)
    b_ticks = sum(p.ticks for p in ticks if p.backward)
    units = L.microbatches * L.vp
    return {"forward": (f_ticks + b_ticks) / units, "backward": b_ticks / units, "head": b_ticks / L.microbatches}


# (padded to capacity the experts are batched matmuls, not the grouped kernel)
MOE_LAYOUTS = [n for n in LAYOUTS if "--num-experts" in LAYOUTS[n][0]
               and "--moe-pad-expert-input-to-capacity" not in LAYOUTS[n][0]]


@pytest.mark.parametrize("name", MOE_LAYOUTS)
def test_experts_run_the_grouped_kernel_at_the_model_s_flops(plans, name):
    """Every MoE layout (expert parallelism with each dispatcher, the pipeline, capacity and
    dropless, none) runs its experts through the grouped matmul kernel (kernels.grouped_matmul:
    each product's forward, input gradient and weight gradient, so at least 6 calls), not XLA's
    ragged_dot, which runs dense over a rank's experts; and the weights' matmuls execute at most
    1.25 x 6NT (active parameters; the estimate costs the kernel at the rows a balanced routing
    gives a device), times what a pipeline's slots run (`_pipeline_runs`: forward, backward)."""
    from mlm_jax.arguments import parse_args
    from mlm_jax.plan import analytic
    from mlm_jax.validation import finalize

    r = _plan(plans, name)
    assert r["grouped_matmul_kernels"] >= 6, r["grouped_matmul_kernels"]
    runs = _pipeline_runs(analytic.layout_of(finalize(parse_args(shlex.split(LAYOUTS[name][0])), 8), 8))
    bound = 1.25 * (runs["forward"] + 2 * runs["backward"]) / 3
    assert r["step_time"]["executed_gemm_flops_ratio"] <= bound, (r["step_time"]["executed_gemm_flops_ratio"], bound)


@pytest.mark.parametrize("name", DENSE)
def test_step_time_estimate_and_executed_flops(plans, name):
    """The plan's estimated step time is there, and the program's matmuls and attention execute
    what the layout should (`_ratio_band`): not the attention forward twice under
    --recompute-granularity dots (it keeps the attention's output and statistics), not a
    microbatch's work twice."""
    t = _plan(plans, name)["step_time"]
    assert t["seconds"] > 0 and t["tokens_per_second"] > 0 and 0 < t["mfu"] < 1, t
    top = [k["seconds"] for k in t["top_kernels"]]
    assert t["compute_seconds"] <= t["seconds"] and len(top) == 10 and top == sorted(top, reverse=True), t
    low, high = _ratio_band(name)
    assert low <= t["executed_matmul_flops_ratio"] <= high, (t["executed_matmul_flops_ratio"], low, high)


# --------------------------------------------------------------------------- the command

def _plan_cli(tmp_path, *args, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    root = Path(__file__).resolve().parent.parent
    env["PYTHONPATH"] = str(root)
    return subprocess.run([sys.executable, "-m", "mlm_jax.plan", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=tmp_path, env=env)


def _error_lines(p):
    return [line for line in p.stderr.splitlines() if line.startswith("error:")]


def test_plan_cli_reports_and_writes_json_and_hlo(tmp_path):
    p = _plan_cli(tmp_path, "--gpu", "h200", "--gpus", "8", "--json", "plan.json", "--dump-hlo", "step.hlo",
                  *BF16.split(), "--tensor-model-parallel-size", "2", "--use-distributed-optimizer")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "fits" in p.stdout and "attention: cudnn" in p.stdout and "NVIDIA H200" in p.stdout, p.stdout
    r = json.loads((tmp_path / "plan.json").read_text())
    for key in ("fits", "device_memory_bytes", "per_device_bytes", "attention_backend", "collectives",
                "compile_seconds"):
        assert key in r, key
    assert r["fits"] is True and r["device_memory_bytes"] == 150_754_820_096
    b = r["per_device_bytes"]
    assert b["total"] == b["arguments"] + b["outputs"] - b["aliased"] + b["temp"] and b["temp"] > 0
    assert set(r["collectives"]) >= {"tensor", "data"} and r["mesh"]["tensor"] == 2
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in r["xla_flags"]
    hlo = (tmp_path / "step.hlo").read_text()
    assert "__cudnn$fmhaSoftmax" in hlo and "is_scheduled=true" in hlo
    assert "step time: estimated from the compiled program" in p.stdout and "analytic model" in p.stdout, p.stdout
    assert "executed matmul FLOPs / model FLOPs: 1.0" in p.stdout and "top kernels" in p.stdout, p.stdout
    t = r["step_time"]
    assert t["seconds"] > 0 and t["analytic"]["seconds"] > 0 and len(t["top_kernels"]) == 10


def test_plan_cli_exit_1_when_it_does_not_fit(tmp_path):
    p = _plan_cli(tmp_path, "--gpus", "8", *TINY.replace("--hidden-size 256", "--hidden-size 8192")
                  .replace("--num-attention-heads 8", "--num-attention-heads 64")
                  .replace("--seq-length 256", "--seq-length 8192")
                  .replace("--max-position-embeddings 256", "--max-position-embeddings 8192")
                  .replace("--micro-batch-size 2", "--micro-batch-size 16").replace("--global-batch-size 32", "--global-batch-size 128").split(), "--bf16")
    assert p.returncode == 1, p.stderr[-3000:]
    lines = _error_lines(p)
    assert len(lines) == 1 and "GiB more than the" in lines[0] and "--recompute-granularity full" in lines[0], p.stderr
    assert "does NOT fit" in p.stdout and "Traceback" not in p.stderr


@pytest.mark.parametrize("args,message", [
    (["--gpu", "v100"], "--gpu 'v100': choose one of h100, h200, a100, b200"),
    (["--gpus", "12", "--gpus-per-node", "8"], "--gpus 12 is not a multiple of --gpus-per-node 8"),
    (["--gpus", "0"], "--gpus 0 / --gpus-per-node 8: both must be >= 1"),
    (["--gpus", "8", "--no-such-flag"], "--no-such-flag"),
    (["--gpus", "8", "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "nowhere/llama"],
     "give --vocab-size N"),
])
def test_plan_cli_bad_flags_exit_2_naming_them(tmp_path, args, message):
    p = _plan_cli(tmp_path, *args, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = _error_lines(p)
    assert len(lines) == 1 and message in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_compile_only_devices_are_nvidia_for_every_platform_decision():
    """The mesh's devices decide (a deviceless compile runs in a CPU process)."""
    import jax

    from mlm_jax import platform
    from mlm_jax.plan.targets import GPUS, devices
    from mlm_jax.sharding import trace

    for name, target in GPUS.items():
        devs = devices(target, 2, 2)
        assert devs[0].device_kind == target.description, name
        assert platform.device_platform(devs[0]) == platform.CUDA
    assert platform.device_platform(jax.devices()[0]) == platform.CPU
    assert platform.current() == platform.CPU
    with trace.using(platform=platform.CUDA):
        assert platform.current() == platform.CUDA


def test_no_fp32_copy_of_the_weights_lives_through_the_microbatch_loop():
    """The once-per-step path gathers the weights in bf16 and differentiates that copy (its
    gradients accumulated in fp32): the only fp32 array shaped like the stacked QKV weight in any
    loop's state is the gradient accumulator. Before, an fp32 copy of every weight (and its fp32
    gradient) lived through the loop too: 4 such arrays, 51.9 vs 41.3 MiB of temporaries here."""
    import re

    from mlm_jax.arguments import parse_args
    from mlm_jax.plan.compile import compile_step
    from mlm_jax.plan.targets import devices, gpu
    from mlm_jax.validation import finalize

    cfg = finalize(parse_args((BF16 + " --use-distributed-optimizer").split()), 8)
    c = compile_step(cfg, devices(gpu("h100"), 8))
    qkv = "[2,256,8,3,32]"  # [layers, embed, kv groups, r + 2, head dim] (dp8: whole on a device)
    loops = [line for line in c.text.splitlines() if re.match(r"^\s*%while[.\d]* = ", line)]
    assert loops
    assert sum(line.count(f"f32{qkv}") for line in loops) == 1, [line.count(f"f32{qkv}") for line in loops]
    assert sum(line.count(f"bf16{qkv}") for line in loops) >= 1
