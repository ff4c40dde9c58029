"""The analytic model of `mlm_jax.plan` (mlm_jax/plan/analytic.py) against figures computed by
hand from the formulas (the derivations are written beside each number, not computed by the
module), and `python -m mlm_jax.plan --search` on a small model without compiling. Pure Python:
no jax is imported by the model or the search."""

from __future__ import annotations

import dataclasses

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlm_jax.arguments import parse_args
from mlm_jax.plan import analytic
from mlm_jax.validation import finalize

ROOT = Path(__file__).resolve().parent.parent

GPT_1P3B = ("--bf16 --use-distributed-optimizer --num-layers 24 --hidden-size 2048 --num-attention-heads 16 "
            "--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 8 --global-batch-size 256 "
            "--hidden-dropout 0 --attention-dropout 0 --vocab-size 50257 --mock-data")
SMALL_LLAMA = ("--bf16 --num-layers 8 --hidden-size 1024 --num-attention-heads 8 --group-query-attention "
               "--num-query-groups 4 --swiglu --normalization RMSNorm --disable-bias-linear "
               "--position-embedding-type rope --untie-embeddings-and-output-weights --seq-length 1024 "
               "--max-position-embeddings 1024 --vocab-size 32000 --global-batch-size 8 --hidden-dropout 0 "
               "--attention-dropout 0 --mock-data")


def _layout(argv: str, gpus: int):
    cfg = finalize(parse_args(argv.split()), gpus)
    return cfg, analytic.layout_of(cfg, gpus)


def test_the_model_imports_no_jax():
    code = ("import sys; import mlm_jax.plan.analytic, mlm_jax.plan.search; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if m.startswith('jax'))")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]


def test_gpt_1p3b_dp8_zero_by_hand():
    """README GPT 1.3B on 8 GPUs, dp8, ZeRO, micro 8, no recompute, no dropout (fused attention).

    h 2048, 24 layers, 16 heads of 128, f 8192, biases, LayerNorm, vocab 50257 padded to 50304.
    Layer: QKV 2048*48*128 + its bias 48*128 + out 16*128*2048 = 16,783,360; MLP 2*2048*8192 +
    fc1 bias 8192 = 33,562,624; two LayerNorms 4*2048 and two output biases 2*2048 = 12,288:
    50,358,272 per layer, 1,208,598,528 for 24. Embedding 50304*2048 = 103,022,592, positions
    2048*2048 = 4,194,304, final norm 4,096: N = 1,315,819,520."""
    cfg, L = _layout(GPT_1P3B, 8)
    assert (L.dp, L.tp, L.pp, L.zero, L.microbatches) == (8, 1, 1, True, 4)
    assert analytic.total_params(cfg.model) == 1_315_819_520
    mem = analytic.memory(cfg, L)
    N = 1_315_819_520
    assert mem["parameters"] == 4 * N / 8 == 657_909_760  # fp32 master, ZeRO over data
    assert mem["optimizer_state"] == 8 * N / 8 == 1_315_819_520  # two fp32 moments
    assert mem["compute_copy"] == 2 * N == 2_631_639_040  # the gathered bf16 weights
    assert mem["gradients"] == 4 * N == 5_263_278_080  # the fp32 accumulator
    assert mem["microbatch_gradients"] == 2 * N  # one microbatch's, bf16
    # Per token and layer: norms' inputs and outputs 8h + their mean and 1/std 2*8 = 16,400;
    # Q, K, V, output 8h = 16,384; softmax statistics 4a = 64; GELU input 2f + fc2 input 2f = 32,768:
    # 65,616 bytes (Korthikanti's 34h less the two dropout masks, + 80); 16,384 tokens, 24 layers.
    assert analytic.layer_activation_bytes(cfg, L) == 16_384 * 65_616 == 1_075_052_544
    assert mem["activations"] == 24 * 1_075_052_544 == 25_801_261_056
    # fp32 logits and their gradient, of one of the fused loss's row chunks: 8*2048*50304 = 824M
    # logits halved until <= 2^27 = 134M: 8 chunks.
    assert analytic.loss_chunks(8, 2048, 50_304) == 8
    assert mem["logits"] == 8 * 16_384 * 50_304 / 8 == 824_180_736
    assert mem["total"] == 36_494_088_192 + 2 * N == 39_125_727_232
    comm = analytic.communication(cfg, L)
    assert comm == {"data": 6 * N * 7 / 8}  # fp32 reduce-scatter + bf16 all-gather, ring: 6,908,052,480
    assert analytic.bubble(L) == 0


def test_korthikanti_eq2_tensor_parallel_unfused_with_dropout():
    """GPT-3 175B's layer (h 12288, 96 heads, s 2048), t 8 without sequence parallelism, dropout 0.1
    (unfused attention): Korthikanti et al. eq. 2, s*b*h*(10 + 24/t + 5*a*s/(h*t)) =
    2048*12288*(10 + 3 + 10) = 578,813,952 bytes, plus the norms' statistics 16 per row (32,768)."""
    argv = ("--fp16 --num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 "
            "--max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 1536 --vocab-size 50257 "
            "--mock-data --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16")
    cfg, L = _layout(argv, 1024)
    assert not analytic.fused_attention(cfg, L)
    assert analytic.layer_activation_bytes(cfg, L) == 2048 * 12288 * 23 + 16 * 2048 == 578_846_720
    # Sequence parallelism divides every term by t (eq. 4): 2048*12288*(34 + 5*96*2048/12288)/8 + 2*1024*... :
    cfg_sp, L_sp = _layout(argv + " --sequence-parallel", 1024)
    assert analytic.layer_activation_bytes(cfg_sp, L_sp) == 2048 * (12288 * 34 + 16 + 5 * 96 * 2048) / 8
    # Selective recompute drops exactly the 5*a*s term (Korthikanti section 5).
    cfg_sel, L_sel = _layout(argv + " --sequence-parallel --recompute-granularity selective", 1024)
    assert analytic.layer_activation_bytes(cfg_sel, L_sel) == 2048 * (12288 * 34 + 16) / 8


def test_small_llama_tp2_sp_pp2_dp2_zero_full_recompute_by_hand():
    """8 layers, h 1024, 8 heads of 128, 4 query groups, SwiGLU f = 64*ceil(2730/64) = 2752, RMSNorm,
    no biases, untied, rope, vocab 32000 (a multiple of 128*2); tp2 SP, pp2 (1F1B, 4 microbatches of
    1), dp2 ZeRO, full recompute (uniform, 1 layer).

    Layer: QKV 1024*(8+8)*128 = 2,097,152, out 1,048,576, MLP 3*1024*2752 = 8,454,144: 11,599,872
    split over tensor; two RMSNorms 2,048 whole. A stage's 4 layers per device: 4*5,799,936 +
    4*2,048 = 23,207,936. Embedding and head 2*32000*1024 = 65,536,000 (/2 over tensor) and the
    final norm 1,024: stored over pipe, 16,384,512; computed: the embedding whole, 16,384,000, the
    head's block over pipe, 8,192,000, the norm: 24,577,024. Compute 47,784,960; stored 39,592,448,
    ZeRO /2: 19,796,224."""
    cfg, L = _layout(SMALL_LLAMA + " --tensor-model-parallel-size 2 --sequence-parallel "
                     "--pipeline-model-parallel-size 2 --use-distributed-optimizer --micro-batch-size 1 "
                     "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1", 8)
    assert (L.tp, L.pp, L.dp, L.microbatches, L.recompute) == (2, 2, 2, 4, "full")
    assert cfg.model.ffn_size == 2752 and cfg.model.vocab == 32000
    mem = analytic.memory(cfg, L)
    assert analytic.param_counts(cfg.model, L) == {"compute": 47_784_960, "stored": 39_592_448, "expert": 0,
                                                   "layers": 23_207_936}
    assert mem["parameters"] == 4 * 19_796_224 == 79_184_896
    assert mem["optimizer_state"] == 8 * 19_796_224 == 158_369_792
    assert mem["compute_copy"] == 2 * 47_784_960 and mem["gradients"] == 4 * 47_784_960
    assert mem["microbatch_gradients"] == 2 * 47_784_960  # the pipeline's per-tick gradients, bf16 under ZeRO
    # Per token and layer (all /2 with SP): norms 8h + 16 = 8,208; Q 2,048, K and V 2,048, output
    # 2,048; statistics 4*8 = 32; SwiGLU input 4f = 11,008 and fc2 input 2f = 5,504: 30,896 / 2 =
    # 15,448, x 1,024 tokens = 15,818,752. A layer input: 2*1024*1024/2 = 1,048,576.
    assert analytic.layer_activation_bytes(cfg, L) == 15_818_752
    # 1F1B, P 2: stage 1 stashes 2*(P-1-1)+1 = 1 input (stage 0's input is the tokens); the one
    # vjp alive holds the unit's 4 layer inputs (full recompute) and one layer's activations, but
    # that layer's exist only after the head's logits (larger) are freed.
    assert analytic.stash_slots("1f1b", 2, 4, 1) == 1
    assert mem["activations"] == 1_048_576 + 4 * 1_048_576 == 5_242_880
    assert mem["logits"] == 8 * 1024 * 32000 / 2 / 2 == 65_536_000  # the head's block: /t /p
    assert mem["total"] == 79_184_896 + 158_369_792 + (2 + 4 + 2) * 47_784_960 + 5_242_880 + 65_536_000 == 690_613_248
    comm = analytic.communication(cfg, L)
    act = 2 * 1024 * 1024  # one microbatch's [s, h] in bf16
    # The two-slot 1F1B table at P 2, m 4: 1 forward-only tick, then 5 with both slots (the
    # one-tick cooldown joined): 6 ticks with a forward slot, 5 with a backward slot.
    # tensor, in all-gather or reduce-scatter halves of act*(t-1)/t: a forward slot 4 a layer; a
    # backward slot the stage recompute's 4, the backward's 4 and full recompute's 3; 4 layers
    # a stage; the head and embedding 9 a backward tick, and 2 once:
    # 4*(4*6 + 11*5) + 9*5 + 2 = 363 halves (the compiled program: 363.2; full recompute's
    # gathers are also SP's second gathers for the backward, so none more).
    assert comm["tensor"] == (4 * (4 * 6 + 11 * 5) + 9 * 5 + 2) * act / 2 == 380_633_088
    # pipe: 11 sends of act/t; the head's sums over pipe on the 5 backward ticks, fp32 output
    # and bf16 gradient all-reduced, 2*(2 + 1)*act/t*(1/2) each; the
    # embedding (untied: the input table, /t) and the final norm, 16,385,024 replicated over
    # pipe, their fp32 gradient reduce-scattered over pipe: 4*16,385,024/2.
    assert comm["pipe"] == 11 * act / 2 + 5 * 6 * act / 2 / 2 + 4 * 16_385_024 / 2 == 60_033_024
    # data: the rest of the stage (47,784,960 - 16,385,024, the head's vocab block included),
    # fp32 reduce-scatter + bf16 gather, and the embedding's pipe shard in fp32; the embedding
    # gathered over pipe and data in bf16.
    assert comm["data"] == (6 * 31_399_936 + 4 * 16_385_024 / 2) / 2 == 110_584_832
    assert comm["pipe+data"] == 2 * 16_385_024 * 3 / 4 == 24_577_536


@pytest.mark.parametrize("schedule,P,m,V,slots", [
    # The stash slots benchmarks/RESULTS.md reports for the compiled pipeline (benchmarks/pipeline.py).
    ("gpipe", 4, 4, 1, 4), ("gpipe", 4, 8, 1, 8), ("1f1b", 4, 4, 1, 4), ("1f1b", 4, 16, 1, 5),
    ("interleaved", 4, 4, 2, 8), ("interleaved", 4, 16, 2, 9),
])
def test_stash_slots_are_the_runtime_s(schedule, P, m, V, slots):
    assert analytic.stash_slots(schedule, P, m, V) == slots


def test_megatron_in_flight_microbatches():
    assert [analytic.megatron_in_flight("1f1b", 4, 8, 1, s) for s in range(4)] == [4, 3, 2, 1]
    assert analytic.megatron_in_flight("1f1b", 4, 2, 1, 0) == 2
    assert analytic.megatron_in_flight("gpipe", 4, 8, 1, 3) == 8
    # Korthikanti 4.2.3: the first stage holds p*(1 + (p-1)/(p*v)) stages' worth = v*p + p - 1 chunks.
    for P, V in ((4, 2), (8, 3), (16, 4)):
        assert analytic.megatron_in_flight("interleaved", P, 64, V, 0) == V * P * (1 + (P - 1) / (P * V))


def test_bubble_is_narayanan_s():
    L = analytic.Layout(pp=4, microbatches=8, vp=2)
    assert analytic.bubble(L) == 3 / 19  # (p-1)/(m*v + p-1)
    assert analytic.bubble(analytic.Layout(pp=8, microbatches=24)) == 7 / 31


def test_axis_spans_nodes():
    L = analytic.Layout(tp=8, pp=2, dp=4)
    assert not analytic.axis_spans_nodes(L, "tensor", 8)
    assert analytic.axis_spans_nodes(L, "data", 8) and analytic.axis_spans_nodes(L, "pipe", 8)
    assert not analytic.axis_spans_nodes(analytic.Layout(tp=2, dp=4), "data", 8)


def test_step_flops_is_narayanan_s_for_a_gpt():
    """72*B*s*L*h^2*(1 + s/(6h) + V/(12hL)) for f = 4h and a = g (biases, norms not counted)."""
    cfg, L = _layout(GPT_1P3B, 8)
    B, s, Ln, h, V = 256, 2048, 24, 2048, 50304
    assert analytic.step_flops(cfg, L) == pytest.approx(72 * B * s * Ln * h * h * (1 + s / (6 * h) + V / (12 * h * Ln)),
                                                        rel=1e-12)
    assert analytic.executed_flops(cfg, analytic.Layout(recompute="full")) == pytest.approx(
        96 * B * s * Ln * h * h * (1 + s / (6 * h) + V / (12 * h * Ln)), rel=1e-12)


SMALL_MOE = SMALL_LLAMA + " --num-experts 8 --moe-router-topk 2 --ffn-hidden-size 2048 --micro-batch-size 1"


@pytest.mark.parametrize("layout", ["--expert-model-parallel-size 1", "--expert-model-parallel-size 4"])
def test_dropless_experts_execute_the_model_s_flops_with_the_grouped_kernel(layout):
    """The grouped matmul kernel (the default on GPUs) runs each (token, choice) through its own
    expert only: executed FLOPs are the model's, dropless or padded to capacity. Without it, XLA's
    GPU compiler runs `ragged_dot` densely over a rank's E/ep experts, on rows padded to ep x T*K:
    each (token, choice) through all E = 8 experts' SwiGLU MLPs, 3 x 2 x (h*2f + f*h) FLOPs each."""
    cfg, L = _layout(f"{SMALL_MOE} {layout}", 8)
    assert cfg.model.moe_grouped_gemm
    assert analytic.executed_flops(cfg, L) == pytest.approx(analytic.step_flops(cfg, L), rel=1e-12)
    B, s, Ln, h, f, k, E = 8, 1024, 8, 1024, 2048, 2, 8
    extra = 3 * (E - 1) * k * 2 * (h * 2 * f + f * h) * Ln * B * s
    xla = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe_grouped_gemm=False))
    assert analytic.executed_flops(xla, L) == pytest.approx(analytic.step_flops(cfg, L) + extra, rel=1e-12)
    padded, L = _layout(f"{SMALL_MOE} {layout} --moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity", 8)
    assert analytic.executed_flops(padded, L) == pytest.approx(analytic.step_flops(padded, L), rel=1e-12)


def test_step_flops_are_the_run_log_s_for_a_deepseek_shaped_moe():
    """The planner's model FLOPs (`step_flops`, Megatron's full-square attention) are those the
    run logs and MFU uses (`metrics.flops_per_token`, causal=False) for a MoE with a dense first
    layer, a shared expert and a multi-token-prediction depth. The shared expert was missing
    from the planner's count. fp8 (`fp8_flops`): every projection, the shared and the routed
    experts (the grouped kernels multiply fp8) and the MTP depth's layer, not the router,
    attention, the MTP projection or the heads."""
    from mlm_jax.metrics import flops_per_token

    flags = (f"{SMALL_MOE} --moe-shared-expert-intermediate-size 512 --moe-layer-freq [0]+[1]*7 "
             "--mtp-num-layers 1 --bf16 --fp8-format hybrid")
    cfg, L = _layout(flags, 8)
    m, s, B = cfg.model, 1024, 8
    assert analytic.step_flops(cfg, L) == pytest.approx(flops_per_token(m, s, causal=False) * B * s, rel=1e-12)
    h, f, k, sh = 1024, 2048, 2, 512
    mlp = lambda ffn: 2 * (h * 2 * ffn + ffn * h)  # noqa: E731 (SwiGLU)
    per_layer = 2 * m.attention_weights
    fp8 = 3 * (9 * per_layer + mlp(m.ffn_size) + 8 * (k * mlp(f) + mlp(sh))) * B * s  # MTP's layer: a MoE one
    assert analytic.fp8_flops(cfg, L) == pytest.approx(fp8, rel=1e-12)


def test_the_winner_s_command_line_parses_without_data_parallelism():
    """A layout with no data parallelism (tp2 x pp16 x cp2 on 64 GPUs) has no distributed
    optimizer, so the user's --overlap-param-gather (which needs it) is left out of its command
    line: the line the search prints must be one `mlm_jax.train` accepts."""
    from mlm_jax.plan import search

    base = SMALL_LLAMA.split() + ["--use-distributed-optimizer", "--overlap-param-gather"]
    for L in (analytic.Layout(tp=2, pp=4, cp=1, dp=1, zero=False, micro=1, microbatches=8),
              analytic.Layout(tp=2, pp=2, dp=2, zero=True, micro=1, microbatches=2)):
        argv = search.train_argv(base, L)
        assert ("--overlap-param-gather" in argv) == L.zero
        cfg = finalize(parse_args(argv), L.tp * L.pp * L.dp)
        assert cfg.parallel.use_distributed_optimizer == L.zero


def _plan(tmp_path, *args):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "mlm_jax.plan", *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)


def test_search_cli_ranks_layouts_without_compiling(tmp_path):
    p = _plan(tmp_path, "--search", "--confirm", "0", "--gpus", "16", "--gpus-per-node", "8", "--top", "5",
              "--json", "search.json", *SMALL_LLAMA.replace("--global-batch-size 8", "--global-batch-size 64").split())
    assert p.returncode == 0, p.stderr[-3000:]
    assert "valid layouts on 16 x NVIDIA H100" in p.stdout and "python -m mlm_jax.train" in p.stdout, p.stdout
    r = json.loads((tmp_path / "search.json").read_text())
    assert r["valid_layouts"] > 20 and len(r["top"]) == 5
    steps = [row["step_seconds"] for row in r["top"] if row["fits"]]
    assert steps == sorted(steps) and r["best"] == r["top"][0]
    for row in r["top"]:
        lay = row["layout"]
        assert lay["tp"] <= 8 and lay["tp"] * lay["pp"] * lay["cp"] * lay["dp"] == 16
        assert 8 % lay["tp"] == 0 and 8 % lay["pp"] == 0 and 64 % (lay["dp"] * lay["micro"]) == 0
        assert lay["microbatches"] == 64 // (lay["dp"] * lay["micro"])
    # The winner's command line parses and finalizes to the winner's layout.
    argv = r["best"]["train_argv"]
    cfg = finalize(parse_args(argv), 16)
    assert analytic.layout_of(cfg, 16) == analytic.Layout(**r["best"]["layout"])
    assert argv.count("--micro-batch-size") == 1


def test_search_cli_errors_name_the_flag(tmp_path):
    p = _plan(tmp_path, "--search", "--confirm", "0", "--top", "0", *SMALL_LLAMA.split())
    assert p.returncode == 2 and "error: --top 0: must be 1 or more" in p.stderr, p.stderr[-2000:]
    p = _plan(tmp_path, "--search", "--confirm", "0", "--gpus", "8", "--efficiency", "1.5", *SMALL_LLAMA.split())
    assert p.returncode == 2 and "--efficiency 1.5" in p.stderr, p.stderr[-2000:]
    p = _plan(tmp_path, "--search", "--confirm", "0", "--confirm-timeout", "0", *SMALL_LLAMA.split())
    assert p.returncode == 2 and "error: --confirm-timeout 0.0: must be a positive number of seconds" in p.stderr
    # Nothing fits: a 4096-wide, 64-layer model with sequences of 32k on one GPU.
    big = SMALL_LLAMA.replace("--hidden-size 1024", "--hidden-size 4096").replace("--num-layers 8", "--num-layers 64") \
        .replace("--seq-length 1024", "--seq-length 32768").replace("--max-position-embeddings 1024",
                                                                   "--max-position-embeddings 32768")
    p = _plan(tmp_path, "--search", "--confirm", "0", "--gpus", "1", *big.split())
    assert p.returncode == 1 and "no layout fits" in p.stderr, p.stderr[-2000:]


def test_the_fused_loss_chunks_its_logits_for_the_traced_platform():
    """A deviceless GPU compile runs in a CPU process: the loss must split its logits as the GPU
    run does (2^27 per chunk), not as a CPU's (2^21), or the plan's memory is not the GPU's."""
    from mlm_jax.models import gpt
    from mlm_jax.sharding import trace

    # b 4, s 2048, V 50304: 412M logits; a GPU halves the rows until <= 2^27 (4 chunks), a CPU
    # until <= 2^21 or 64 rows per chunk (32 chunks).
    with trace.using(platform="cuda"):
        assert gpt._row_chunks(4, 2048, 50304) == 4
    with trace.using(platform="cpu"):
        assert gpt._row_chunks(4, 2048, 50304) == 32


def test_fp8_products_run_at_twice_the_bf16_rate():
    """--fp8-format: the projections' executed FLOPs (QKV 2048*48*128 + output 16*128*2048 + MLP
    2*2048*8192 = 50,331,648 weights a layer; 6 FLOPs each per token, 24 layers, 524,288 tokens)
    cost half their bf16 time; --first-last-layers-bf16 leaves its layers' out; the rest (attention
    scores, the head) is unchanged."""
    cfg, L = _layout(GPT_1P3B, 8)
    fp8_cfg, _ = _layout(GPT_1P3B + " --fp8-format hybrid", 8)
    assert analytic.fp8_flops(cfg, L) == 0
    assert analytic.fp8_flops(fp8_cfg, L) == 6 * 50_331_648 * 24 * 256 * 2048
    kept, _ = _layout(GPT_1P3B + " --fp8-format hybrid --first-last-layers-bf16 --num-layers-at-end-in-bf16 2", 8)
    assert analytic.fp8_flops(kept, L) == 6 * 50_331_648 * 21 * 256 * 2048
    hw = analytic.hardware(__import__("mlm_jax.plan.targets", fromlist=["gpu"]).gpu("h100"))
    bf16, fp8 = (analytic.predict(c, L, hw, 8, 8)["step_seconds"] for c in (cfg, fp8_cfg))
    saved = analytic.fp8_flops(fp8_cfg, L) / 2 / 8 / (hw.bf16_flops * hw.efficiency)
    assert fp8 == pytest.approx(bf16 - saved, rel=1e-9)


LLAMA3_8B = ("--bf16 --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 "
             "--group-query-attention --num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
             "--position-embedding-type rope --swiglu --normalization RMSNorm --untie-embeddings-and-output-weights "
             "--disable-bias-linear --global-batch-size 8 --vocab-size 128256 --mock-data --hidden-dropout 0 "
             "--attention-dropout 0")


def test_fsdp_memory_terms_and_the_search_picks_it_where_zero1_does_not_fit():
    """FSDP (optim_grads_params) holds the layers' compute copy two layers at a time and their
    gradient accumulator shard-sized (the state as ZeRO-1's); Llama-3 8B at seq 8192 on 8 H100
    without recompute: dp8 ZeRO-1 is predicted not to fit, dp8 FSDP to fit, and the search ranks
    it first; its command line parses back to it."""
    from mlm_jax.plan import search

    zero1, L1 = _layout(LLAMA3_8B + " --use-distributed-optimizer --micro-batch-size 1", 8)
    fsdp, L3 = _layout(LLAMA3_8B + " --use-megatron-fsdp --micro-batch-size 1", 8)
    assert L1.fsdp is None and L3.fsdp == "optim_grads_params" and L3.zero
    a, b = analytic.memory(zero1, L1), analytic.memory(fsdp, L3)
    n = analytic.param_counts(fsdp.model, L3)
    assert (a["parameters"], a["optimizer_state"]) == (b["parameters"], b["optimizer_state"])
    assert b["compute_copy"] == pytest.approx(2 * (n["compute"] - n["layers"] + 2 * n["layers"] / 32))
    assert b["gradients"] == pytest.approx(4 * n["layers"] / 8)  # one microbatch: no accumulator besides
    hw = analytic.hardware(__import__("mlm_jax.plan.targets", fromlist=["gpu"]).gpu("h100"))
    usable = 71.2 * analytic.GIB
    assert a["total"] > usable > b["total"]
    rows = search.search(fsdp, 8, 8, hw, usable)
    best = rows[0]["layout"]
    assert best.fsdp == "optim_grads_params" and rows[0]["fits"], search.describe(best)
    cfg = finalize(parse_args(search.train_argv(LLAMA3_8B.split(), best)), 8)
    assert analytic.layout_of(cfg, 8) == best


def test_a_model_no_layout_fits_says_only_more_gpus_help_and_how_many():
    """Issue "reliability, round three": `plan --search` of a model whose state alone overflows
    every layout (GPT-3 175B on 8 A100s) suggested a smaller batch or sequence; it says only more
    GPUs would fit it, and about how many (where the search finds a fitting layout)."""
    from mlm_jax.plan import search
    from mlm_jax.plan.__main__ import _what_would_fit

    cfg = finalize(parse_args(SMALL_LLAMA.replace("--global-batch-size 8", "--global-batch-size 64").split()), 1)
    hw = analytic.hardware(__import__("mlm_jax.plan.targets", fromlist=["gpu"]).gpu("h100"))
    usable = int(0.5 * analytic.GIB)  # a small "GPU": the ~2.4 GiB of fp32 state needs several
    rows = search.search(cfg, 1, 8, hw, usable)
    assert rows and not any(r["fits"] for r in rows)
    text = _what_would_fit(cfg, rows, 1, 8, hw, usable)
    assert text.startswith("the parameters and optimizer state alone overflow every layout, so only more GPUs"), text
    assert "a smaller batch or sequence would not" in text
    more = int(text.split("(about ")[1].split(":")[0])
    assert any(r["fits"] for r in search.search(cfg, more, 8, hw, usable))
    assert not any(r["fits"] for r in search.search(cfg, more // 2, 8, hw, usable))


def test_the_suggestions_for_a_step_that_does_not_fit_name_what_applies():
    """The one `error:` line's suggestions for Megatron's DeepSeek-V3 layout (FSDP over 256 GPUs,
    EP 8, dense first layers): the receive buffers' bound (the worst case is 8 x a balanced
    load) and twice the GPUs (the state is split over the data ranks); no pipeline (refused for
    a mixed dense/MoE stack). Without experts or FSDP neither of those, and the pipeline."""
    from mlm_jax.plan.check import suggestions

    moe = ("--bf16 --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256 "
           "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 512 --vocab-size 1000 "
           "--mock-data --num-experts 16 --moe-router-topk 2 --moe-layer-freq ([0]*1+[1]*3) "
           "--expert-model-parallel-size 8 --use-megatron-fsdp --use-distributed-optimizer")
    said = suggestions(finalize(parse_args(moe.split()), 256), 256, 8)
    assert "--moe-receive-buffer-factor 2" in said and "--gpus 512" in said, said
    assert not any(s.startswith("--pipeline-model-parallel-size") for s in said), said
    bounded = suggestions(finalize(parse_args([*moe.split(), "--moe-receive-buffer-factor", "1.5"]), 256), 256, 8)
    assert not any(s.startswith("--moe-receive-buffer-factor") for s in bounded), bounded
    said = suggestions(finalize(parse_args(GPT_1P3B.split()), 8), 8, 8)
    assert "--pipeline-model-parallel-size 2" in said and not any(s.startswith(("--gpus", "--moe")) for s in said)
