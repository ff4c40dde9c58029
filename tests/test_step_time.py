"""The step-time estimate read from a compiled GPU program (mlm_jax/plan/step_time.py) on small
hand-written scheduled HLO modules: a matmul's FLOPs and time, a fusion's bytes, a while loop's
trip count, an async collective hidden by compute or exposed, a conditional's costed branch,
cuDNN attention's FLOPs. Every expected figure is worked out by hand from the H100 target
(989 TFLOP/s dense bf16, 67 TFLOP/s fp32, 3,352,320,000,000 B/s HBM in mlm_jax/targets/h100.txtpb;
NVLink 450 GB/s, network 50 GB/s per GPU) and the stated 3 us per kernel. Pure Python: nothing
is compiled."""

from __future__ import annotations

import math

import pytest

from mlm_jax.plan import step_time
from mlm_jax.plan.targets import GPUS

H100 = GPUS["h100"]
PEAK = 989e12  # bf16, FLOP/s
HBM = 3_352_320_000_000  # B/s
LAUNCH = 3e-6
NVLINK, NETWORK = 450e9, 50e9


def module(*computations: str, entry: str) -> str:
    return "HloModule m, is_scheduled=true\n\n" + "\n\n".join(computations) + "\n\n" + entry + "\n"


def estimate(text: str, mesh: dict | None = None, per_node: int = 8) -> step_time.Estimate:
    return step_time.estimate(text, H100, mesh or {"data": 8}, per_node)


def kernel(est: step_time.Estimate, name: str) -> step_time.Kernel:
    return next(k for k in est.kernels if k.name == name)


def gemm(name: str, m: int, k: int, n: int, dtype: str = "bf16", out: str = "bf16", precision: str = "DEFAULT") -> str:
    """A cuBLASLt GEMM [m, k] x [k, n] as XLA writes it: a (result, workspace) tuple."""
    return (f'  %{name} = ({out}[{m},{n}]{{1,0}}, s8[4194304]{{0}}) custom-call(%{name}_a, %{name}_b), '
            f'custom_call_target="__cublas$lt$matmul", metadata={{op_name="jit(train_step)/{name}/dot_general"}}, '
            f'backend_config={{"gemm_backend_config":{{"dot_dimension_numbers":{{"lhs_contracting_dimensions":["1"],'
            f'"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}},'
            f'"precision_config":{{"operand_precision":["{precision}","{precision}"],"algorithm":"ALG_UNSET"}}}}}}')


def gemm_entry(m: int, k: int, n: int, dtype: str = "bf16", out: str = "bf16", precision: str = "DEFAULT") -> str:
    return (f"ENTRY %main (a: {dtype}[{m},{k}], b: {dtype}[{k},{n}]) -> {out}[{m},{n}] {{\n"
            f"  %g_a = {dtype}[{m},{k}]{{1,0}} parameter(0)\n"
            f"  %g_b = {dtype}[{k},{n}]{{1,0}} parameter(1)\n"
            + gemm("g", m, k, n, dtype, out, precision) + "\n"
            f"  ROOT %r = {out}[{m},{n}]{{1,0}} get-tuple-element(%g), index=0\n}}")


def test_cublas_gemm_flops_and_time_at_the_bf16_peak():
    # [8192, 4096] x [4096, 8192] bf16: 2 * 8192 * 8192 * 4096 = 549,755,813,888 FLOPs, 555.9 us at
    # 989 TFLOP/s; its bytes (64 + 64 MiB read, 128 MiB written: 268,435,456) take 80.1 us at HBM speed.
    est = estimate(module(entry=gemm_entry(8192, 4096, 8192)))
    k = kernel(est, "g")
    assert k.kind == "matmul" and k.runs == 1
    assert k.flops == 549_755_813_888
    assert k.bytes == 268_435_456  # cuBLAS's 4 MiB workspace is not traffic
    assert k.seconds == pytest.approx(549_755_813_888 / PEAK + LAUNCH, rel=1e-12)
    assert est.seconds == pytest.approx(k.seconds, rel=1e-12)
    assert est.matmul_flops == 549_755_813_888


@pytest.mark.parametrize("dtype,out,precision,peak", [
    ("f32", "f32", "DEFAULT", PEAK / 2),  # XLA:GPU runs fp32 GEMMs on TF32 tensor cores
    ("f32", "f32", "HIGHEST", 67e12),  # true fp32: the CUDA cores
    ("f8e4m3fn", "bf16", "DEFAULT", 2 * PEAK),
])
def test_gemm_peak_follows_the_operand_types(dtype, out, precision, peak):
    est = estimate(module(entry=gemm_entry(8192, 8192, 8192, dtype, out, precision)))
    flops = 2 * 8192**3
    assert kernel(est, "g").flops == flops
    assert kernel(est, "g").seconds == pytest.approx(flops / peak + LAUNCH, rel=1e-12)


def test_a_small_gemm_is_memory_bound():
    # [16, 4096] x [4096, 4096]: 536,870,912 FLOPs (0.54 us) but 32 MiB of weights (10.0 us).
    est = estimate(module(entry=gemm_entry(16, 4096, 4096)))
    nbytes = 16 * 4096 * 2 + 4096 * 4096 * 2 + 16 * 4096 * 2
    assert kernel(est, "g").seconds == pytest.approx(nbytes / HBM + LAUNCH, rel=1e-12)


FUSED_DOT = """%fused_dot (param_0.1: bf16[2,512,1024], param_1.1: bf16[1024,768]) -> bf16[2,512,768] {
  %param_0.1 = bf16[2,512,1024]{2,1,0} parameter(0)
  %param_1.1 = bf16[1024,768]{1,0} parameter(1)
  ROOT %dot.1 = bf16[2,512,768]{2,1,0} dot(%param_0.1, %param_1.1), lhs_contracting_dims={2}, rhs_contracting_dims={0}
}"""


def test_dot_in_a_triton_gemm_fusion():
    entry = """ENTRY %main (x: bf16[2,512,1024], w: bf16[1024,768]) -> bf16[2,512,768] {
  %x = bf16[2,512,1024]{2,1,0} parameter(0)
  %w = bf16[1024,768]{1,0} parameter(1)
  ROOT %gemm_fusion = bf16[2,512,768]{2,1,0} fusion(%x, %w), kind=kCustom, calls=%fused_dot, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
}"""
    est = estimate(module(FUSED_DOT, entry=entry))
    k = kernel(est, "gemm_fusion")
    # 2 * (2 * 512 * 768) * 1024 = 1,610,612,736 FLOPs: 1.63 us at the peak; its bytes
    # (2 MiB + 1.5 MiB read, 1.5 MiB written = 5,242,880) take 1.56 us.
    assert k.kind == "matmul" and k.flops == 1_610_612_736
    assert k.bytes == 5_242_880
    assert k.seconds == pytest.approx(1_610_612_736 / PEAK + LAUNCH, rel=1e-12)


def test_gemm_inside_a_dynamic_slice_fusion():
    """Newer XLA wraps a cuBLAS call that reads one layer of a stacked buffer in a
    `__custom_fusion` (dynamic_slice_fusion): the GEMM counts, at the slice's bytes."""
    comp = """%dynamic-slice-fusion.1 (p0.1: bf16[4,1024,4096], p1.1: s32[], p2.1: bf16[4096,2048]) -> (bf16[1024,2048], s8[33554432]) {
  %p0.1 = bf16[4,1024,4096]{2,1,0} parameter(0)
  %p1.1 = s32[] parameter(1)
  %zero.1 = s32[] constant(0)
  %dynamic-slice.1 = bf16[1,1024,4096]{2,1,0} dynamic-slice(%p0.1, %p1.1, %zero.1, %zero.1), dynamic_slice_sizes={1,1024,4096}
  %bitcast.1 = bf16[1024,4096]{1,0} bitcast(%dynamic-slice.1)
  %p2.1 = bf16[4096,2048]{1,0} parameter(2)
""" + gemm("gemm.1", 1024, 4096, 2048).replace("%gemm.1_a, %gemm.1_b", "%bitcast.1, %p2.1").replace(
        "s8[4194304]", "s8[33554432]").replace("  %gemm.1 =", "  ROOT %gemm.1 =") + "\n}"
    entry = """ENTRY %main (x: bf16[4,1024,4096], i: s32[], w: bf16[4096,2048]) -> (bf16[1024,2048], s8[33554432]) {
  %x = bf16[4,1024,4096]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %w = bf16[4096,2048]{1,0} parameter(2)
  ROOT %dynamic_slice_fusion = (bf16[1024,2048]{1,0}, s8[33554432]{0}) fusion(%x, %i, %w), kind=kCustom, calls=%dynamic-slice-fusion.1, backend_config={"fusion_backend_config":{"kind":"__custom_fusion","custom_fusion_config":{"name":"dynamic_slice_fusion"}}}
}"""
    k = kernel(estimate(module(comp, entry=entry)), "dynamic_slice_fusion")
    # 2 * 1024 * 2048 * 4096 = 17,179,869,184 FLOPs; read: the slice 8 MiB, the index, the weight
    # 16 MiB; written: the 4 MiB product (not the 32 MiB workspace).
    assert k.kind == "matmul" and k.flops == 17_179_869_184
    assert k.bytes == 8 * 2**20 + 4 + 16 * 2**20 + 4 * 2**20
    assert k.op_name == "jit(train_step)/gemm.1/dot_general"  # the call's, the fusion having none
    assert k.seconds == pytest.approx(17_179_869_184 / PEAK + LAUNCH, rel=1e-12)


ADD = """%fused_add (param_0.2: f32[1024,1024], param_1.2: f32[1024,1024]) -> f32[1024,1024] {
  %param_0.2 = f32[1024,1024]{1,0} parameter(0)
  %param_1.2 = f32[1024,1024]{1,0} parameter(1)
  ROOT %add.2 = f32[1024,1024]{1,0} add(%param_0.2, %param_1.2)
}"""


def test_fusion_costs_its_bytes_at_hbm_bandwidth():
    entry = """ENTRY %main (p0: f32[1024,1024], p1: f32[1024,1024]) -> f32[1024,1024] {
  %p0 = f32[1024,1024]{1,0} parameter(0)
  %p1 = f32[1024,1024]{1,0} parameter(1)
  ROOT %add_fusion = f32[1024,1024]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%fused_add, metadata={op_name="jit(train_step)/add"}
}"""
    est = estimate(module(ADD, entry=entry))
    k = kernel(est, "add_fusion")
    assert k.kind == "fusion" and k.bytes == 3 * 4 * 2**20 and k.flops == 0
    assert k.seconds == pytest.approx(12 * 2**20 / HBM + LAUNCH, rel=1e-12)  # 3.75 us + 3 us
    assert k.op_name == "jit(train_step)/add"
    assert est.seconds == pytest.approx(k.seconds, rel=1e-12) and est.matmul_flops == 0


def test_fusion_that_slices_or_updates_a_stack_counts_the_slice():
    """The layer scan's stacked buffers: a dynamic-slice reads one layer's slice, an in-place
    dynamic-update-slice writes one, not the whole [32, ...] stack."""
    comps = """%fused_ds (param_0.3: bf16[32,4096,4096], param_1.3: s32[]) -> bf16[1,4096,4096] {
  %param_0.3 = bf16[32,4096,4096]{2,1,0} parameter(0)
  %param_1.3 = s32[] parameter(1)
  %zero.3 = s32[] constant(0)
  ROOT %ds.3 = bf16[1,4096,4096]{2,1,0} dynamic-slice(%param_0.3, %param_1.3, %zero.3, %zero.3), dynamic_slice_sizes={1,4096,4096}
}

%fused_dus (param_0.4: bf16[32,4096,4096], param_1.4: bf16[1,4096,4096], param_2.4: s32[]) -> bf16[32,4096,4096] {
  %param_0.4 = bf16[32,4096,4096]{2,1,0} parameter(0)
  %param_1.4 = bf16[1,4096,4096]{2,1,0} parameter(1)
  %param_2.4 = s32[] parameter(2)
  %zero.4 = s32[] constant(0)
  ROOT %dus.4 = bf16[32,4096,4096]{2,1,0} dynamic-update-slice(%param_0.4, %param_1.4, %param_2.4, %zero.4, %zero.4)
}"""
    entry = """ENTRY %main (s: bf16[32,4096,4096], u: bf16[1,4096,4096], i: s32[]) -> (bf16[1,4096,4096], bf16[32,4096,4096]) {
  %s = bf16[32,4096,4096]{2,1,0} parameter(0)
  %u = bf16[1,4096,4096]{2,1,0} parameter(1)
  %i = s32[] parameter(2)
  %slice_fusion = bf16[1,4096,4096]{2,1,0} fusion(%s, %i), kind=kLoop, calls=%fused_ds
  %update_fusion = bf16[32,4096,4096]{2,1,0} fusion(%s, %u, %i), kind=kLoop, calls=%fused_dus
  ROOT %t = (bf16[1,4096,4096]{2,1,0}, bf16[32,4096,4096]{2,1,0}) tuple(%slice_fusion, %update_fusion)
}"""
    est = estimate(module(comps, entry=entry))
    layer = 4096 * 4096 * 2  # 32 MiB
    assert kernel(est, "slice_fusion").bytes == 2 * layer + 4  # the slice read and written, the index
    assert kernel(est, "update_fusion").bytes == 2 * layer + 4  # the update read and written in place


LOOP = """%fused_neg (param_0.5: f32[1024,1024]) -> f32[1024,1024] {
  %param_0.5 = f32[1024,1024]{1,0} parameter(0)
  ROOT %neg.5 = f32[1024,1024]{1,0} negate(%param_0.5)
}

%fused_inc (param_0.6: s32[]) -> s32[] {
  %param_0.6 = s32[] parameter(0)
  %one.6 = s32[] constant(1)
  ROOT %add.6 = s32[] add(%param_0.6, %one.6)
}

%fused_lt (param_0.7: s32[]) -> pred[] {
  %param_0.7 = s32[] parameter(0)
  %five.7 = s32[] constant(5)
  ROOT %lt.7 = pred[] compare(%param_0.7, %five.7), direction=LT
}

%body (bp: (s32[], f32[1024,1024])) -> (s32[], f32[1024,1024]) {
  %bp = (s32[], f32[1024,1024]{1,0}) parameter(0)
  %bi = s32[] get-tuple-element(%bp), index=0
  %bx = f32[1024,1024]{1,0} get-tuple-element(%bp), index=1
  %neg_fusion = f32[1024,1024]{1,0} fusion(%bx), kind=kLoop, calls=%fused_neg
  %inc_fusion = s32[] fusion(%bi), kind=kLoop, calls=%fused_inc
  ROOT %bt = (s32[], f32[1024,1024]{1,0}) tuple(%inc_fusion, %neg_fusion)
}

%cond (cp: (s32[], f32[1024,1024])) -> pred[] {
  %cp = (s32[], f32[1024,1024]{1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%cp), index=0
  ROOT %lt_fusion = pred[] fusion(%ci), kind=kLoop, calls=%fused_lt
}"""


def loop_entry(backend_config: str) -> str:
    return ("ENTRY %main (x: f32[1024,1024]) -> (s32[], f32[1024,1024]) {\n"
            "  %x = f32[1024,1024]{1,0} parameter(0)\n  %zero = s32[] constant(0)\n"
            "  %init = (s32[], f32[1024,1024]{1,0}) tuple(%zero, %x)\n"
            "  ROOT %loop = (s32[], f32[1024,1024]{1,0}) while(%init), condition=%cond, body=%body, "
            f"backend_config={backend_config}\n}}")


def test_while_loop_multiplies_by_its_trip_count():
    est = estimate(module(LOOP, entry=loop_entry('{"known_trip_count":{"n":"5"}}')))
    neg = 8 * 2**20 / HBM + LAUNCH  # 4 MiB read, 4 MiB written: 2.50 us + 3 us
    inc = 8 / HBM + LAUNCH  # a scalar read and written: the launch
    lt = 5 / HBM + LAUNCH
    assert kernel(est, "neg_fusion").runs == 5 and kernel(est, "inc_fusion").runs == 5
    assert kernel(est, "lt_fusion").runs == 6  # the condition once more, to leave the loop
    assert est.seconds == pytest.approx(5 * (neg + inc) + 6 * lt, rel=1e-12)


def test_while_loop_without_known_trip_count_counts_its_induction_variable():
    # `i < 5` from 0, read from the condition's compare against a constant.
    entry = loop_entry('{"known_induction_variable":{"tuple_index":"0"}}')
    assert kernel(estimate(module(LOOP, entry=entry)), "neg_fusion").runs == 5


SUM = """%sum (x.8: f32[], y.8: f32[]) -> f32[] {
  %x.8 = f32[] parameter(0)
  %y.8 = f32[] parameter(1)
  ROOT %add.8 = f32[] add(%x.8, %y.8)
}"""

BIG = """%fused_big (param_0.9: f32[16384,16384]) -> f32[16384,16384] {
  %param_0.9 = f32[16384,16384]{1,0} parameter(0)
  ROOT %neg.9 = f32[16384,16384]{1,0} negate(%param_0.9)
}"""


def collective_entry(order: list[str], groups: str = "{{0,1,2,3,4,5,6,7}}") -> str:
    lines = {
        "start": f"  %ar-start = f32[8388608]{{0}} all-reduce-start(%g), channel_id=1, replica_groups={groups}, "
                 "use_global_device_ids=true, to_apply=%sum, metadata={op_name=\"jit(train_step)/psum\"}",
        "compute": "  %big_fusion = f32[16384,16384]{1,0} fusion(%x), kind=kLoop, calls=%fused_big",
        "done": "  %ar-done = f32[8388608]{0} all-reduce-done(%ar-start)",
    }
    return ("ENTRY %main (g: f32[8388608], x: f32[16384,16384]) -> (f32[8388608], f32[16384,16384]) {\n"
            "  %g = f32[8388608]{0} parameter(0)\n  %x = f32[16384,16384]{1,0} parameter(1)\n"
            + "\n".join(lines[k] for k in order)
            + "\n  ROOT %t = (f32[8388608]{0}, f32[16384,16384]{1,0}) tuple(%ar-done, %big_fusion)\n}")


# An all-reduce of 32 MiB over 8 GPUs sends 2 * 7/8 * 32 MiB = 58,720,256 bytes: 130.5 us on
# NVLink (+ 3 us); the fusion reads and writes 1 GiB each: 640.6 us (+ 3 us).
SENT = 2 * 7 / 8 * 32 * 2**20
BIG_S = 2 * 2**30 / HBM + LAUNCH


def test_async_collective_hidden_by_the_compute_between_start_and_done():
    est = estimate(module(SUM, BIG, entry=collective_entry(["start", "compute", "done"])))
    k = kernel(est, "ar-start")
    assert k.kind == "all-reduce" and k.bytes == SENT and k.runs == 1
    assert k.duration == pytest.approx(SENT / NVLINK + LAUNCH, rel=1e-12)
    assert k.seconds == 0.0  # nothing of it exposed
    assert est.seconds == pytest.approx(BIG_S, rel=1e-12)
    assert est.exposed_seconds == 0.0 and est.collective_seconds == pytest.approx(k.duration, rel=1e-12)


def test_async_collective_with_nothing_between_start_and_done_is_exposed():
    est = estimate(module(SUM, BIG, entry=collective_entry(["start", "done", "compute"])))
    exposed = SENT / NVLINK + LAUNCH
    assert kernel(est, "ar-start").seconds == pytest.approx(exposed, rel=1e-12)
    assert est.seconds == pytest.approx(BIG_S + exposed, rel=1e-12)
    assert est.exposed_seconds == pytest.approx(exposed, rel=1e-12)


def test_a_ragged_all_to_all_costs_the_rows_it_sends():
    """An expert dispatch and its return (ep4 x dp2, tests/test_gpu_hlo.py's RAGGED): each sends
    3/4 of a rank's 1024 rows x 256 in bf16 (a quarter stays on the rank), at NVLink's
    bandwidth: not the return's operand, the receive buffer of 4 x 1024 rows."""
    from tests.test_gpu_hlo import RAGGED

    est = step_time.estimate(RAGGED, H100, {"data": 2, "expert": 4})
    for name in ("ragged-all-to-all-start", "ragged-all-to-all-start.1"):
        k = kernel(est, name)
        assert k.kind == "ragged-all-to-all" and k.bytes == 3 / 4 * 1024 * 256 * 2, (name, k)
        assert k.duration == pytest.approx(k.bytes / NVLINK + LAUNCH, rel=1e-12)


def test_collective_across_nodes_runs_at_the_network_bandwidth():
    """Sixteen GPUs, eight to a node: the all-reduce's group spans two nodes. Sent 2 * 15/16 of
    32 MiB = 62,914,560 bytes at 50 GB/s: 1,258 us, of which the fusion hides 643.6 us."""
    groups = "{{0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15}}"
    est = estimate(module(SUM, BIG, entry=collective_entry(["start", "compute", "done"], groups)), {"data": 16})
    sent = 2 * 15 / 16 * 32 * 2**20
    assert kernel(est, "ar-start").bytes == sent
    assert est.seconds == pytest.approx(sent / NETWORK + LAUNCH, rel=1e-12)  # the wait ends with the transfer
    assert kernel(est, "ar-start").seconds == pytest.approx(sent / NETWORK + LAUNCH - BIG_S, rel=1e-12)


def test_conditional_costs_its_most_expensive_branch():
    comps = ADD + "\n\n" + """%fused_copy (param_0.10: f32[1024,1024]) -> f32[1024,1024] {
  %param_0.10 = f32[1024,1024]{1,0} parameter(0)
  ROOT %neg.10 = f32[1024,1024]{1,0} negate(%param_0.10)
}

%cheap (c0: f32[1024,1024]) -> f32[1024,1024] {
  %c0 = f32[1024,1024]{1,0} parameter(0)
  ROOT %cheap_fusion = f32[1024,1024]{1,0} fusion(%c0), kind=kLoop, calls=%fused_copy
}

%dear (d0: f32[1024,1024]) -> f32[1024,1024] {
  %d0 = f32[1024,1024]{1,0} parameter(0)
  %dear_fusion.1 = f32[1024,1024]{1,0} fusion(%d0, %d0), kind=kLoop, calls=%fused_add
  ROOT %dear_fusion.2 = f32[1024,1024]{1,0} fusion(%dear_fusion.1, %d0), kind=kLoop, calls=%fused_add
}"""
    entry = """ENTRY %main (i: s32[], x: f32[1024,1024]) -> f32[1024,1024] {
  %i = s32[] parameter(0)
  %x = f32[1024,1024]{1,0} parameter(1)
  ROOT %cond = f32[1024,1024]{1,0} conditional(%i, %x, %x), branch_computations={%cheap, %dear}
}"""
    est = estimate(module(comps, entry=entry))
    add = 12 * 2**20 / HBM + LAUNCH
    assert est.seconds == pytest.approx(2 * add, rel=1e-12)
    assert kernel(est, "dear_fusion.1").runs == kernel(est, "dear_fusion.2").runs == 1
    assert "cheap_fusion" not in {k.name for k in est.kernels}  # the branch not costed runs 0 times


def attention(name: str, target: str, mask: str, operands: str) -> str:
    return (f'  %{name} = (bf16[2,16,1024,128]{{3,1,2,0}}, f32[2,16,1024]{{2,1,0}}, u8[0]{{0}}) custom-call({operands}), '
            f'custom_call_target="{target}", backend_config={{"cudnn_fmha_backend_config": {{"fmha_scale": 0.088, '
            f'"intermediate_tensor_shape": {{"element_type": "BF16", "dimensions": ["2", "16", "1024", "1024"]}}, '
            f'"is_flash_attention": true, "mask_type": "{mask}"}}}}')


@pytest.mark.parametrize("mask,factor", [("CAUSAL", 0.5), ("NO_MASK", 1.0)])
def test_cudnn_attention_flops(mask, factor):
    """q, k, v [b 2, s 1024, h 16, d 128]: the forward 4*b*h*s*t*d = 17,179,869,184 FLOPs (half
    when causal); the backward 2.5 times it, of which the scores' recompute is 0.5."""
    entry = ("ENTRY %main (q: bf16[2,1024,16,128], k: bf16[2,1024,16,128], v: bf16[2,1024,16,128], "
             "s: f32[2,16,1024], o: bf16[2,1024,16,128]) -> f32[2,16,1024] {\n"
             "  %q = bf16[2,1024,16,128]{3,2,1,0} parameter(0)\n  %k = bf16[2,1024,16,128]{3,2,1,0} parameter(1)\n"
             "  %v = bf16[2,1024,16,128]{3,2,1,0} parameter(2)\n  %s = f32[2,16,1024]{2,1,0} parameter(3)\n"
             "  %o = bf16[2,1024,16,128]{3,2,1,0} parameter(4)\n"
             + attention("fwd", "__cudnn$fmhaSoftmax", mask, "%q, %k, %v") + "\n"
             + attention("bwd", "__cudnn$fmhaSoftmaxBackward", mask, "%q, %k, %v, %s, %o, %o") + "\n"
             "  ROOT %r = f32[2,16,1024]{2,1,0} get-tuple-element(%fwd), index=1\n}")
    est = estimate(module(entry=entry))
    forward = 4 * 2 * 16 * 1024 * 1024 * 128 * factor
    assert kernel(est, "fwd").kind == "attention" and kernel(est, "fwd").flops == forward
    assert kernel(est, "bwd").flops == 2.5 * forward
    assert kernel(est, "fwd").seconds == pytest.approx(max(forward / PEAK, kernel(est, "fwd").bytes / HBM) + LAUNCH)
    assert est.matmul_flops == 3.5 * forward and est.attention_recompute_flops == 0.5 * forward


def test_not_an_hlo_module():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        estimate("not HLO")


def test_hbm_bandwidth_is_the_target_files():
    assert {n: g.memory_bandwidth for n, g in GPUS.items()} == {
        "h100": 3_352_320_000_000, "h200": 4_800_000_000_000, "a100": 2_039_000_000_000, "b200": 8_000_000_000_000}
    assert math.isclose(step_time.LAUNCH_SECONDS, LAUNCH)
