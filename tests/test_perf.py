"""Performance properties that are not timings: the MFU denominator, bf16 steps without fp32
matmuls, and the recompute policies (same gradients, less memory).

The reduce-once gradient check lives in test_compiled.py (it shares that file's compiled steps).
"""

from __future__ import annotations

import collections
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlm_jax import metrics
from mlm_jax.config import ConfigError, ParallelConfig
from mlm_jax.instruments import Throughput
from mlm_jax.models.recompute import check_offload_platform
from tests.parallel_util import build, count_eqns, fixed_batch, place

ONE = jax.devices()[:1]


# ------------------------------------------------------------------ MFU


@pytest.mark.parametrize("kind, dtype, peak", [
    ("NVIDIA H200", jnp.bfloat16, 989.4e12),
    ("NVIDIA H100 80GB HBM3", jnp.bfloat16, 989.4e12),
    ("NVIDIA H100 80GB HBM3", jnp.float32, 494.7e12),  # TF32 dense
    ("NVIDIA H100 PCIe", jnp.bfloat16, 756e12),
    ("NVIDIA A100-SXM4-80GB", jnp.float16, 312e12),
    ("NVIDIA A100-SXM4-40GB", jnp.float32, 156e12),
    ("NVIDIA B200", jnp.bfloat16, 2250e12),
])
def test_known_accelerators_use_the_datasheet_dense_peak(monkeypatch, kind, dtype, peak):
    monkeypatch.setattr(metrics.jax, "devices", lambda *a: [types.SimpleNamespace(device_kind=kind, platform="gpu")])
    got, source = metrics.device_peak(mesh=None, dtype=dtype)  # no measurement: the mesh is unused
    assert got == peak and source == f"datasheet {kind}"


def test_a_process_measures_a_device_set_s_peak_once():
    """train() called again in one process (a notebook, a sweep) reuses its devices' measured
    peak (a second measurement would not give the same float); other devices measure their own."""
    one = jax.make_mesh((1,), ("x",), devices=ONE, axis_types=(jax.sharding.AxisType.Auto,))
    first = metrics.device_peak(one, jnp.float32)
    assert first[1] == "measured" and metrics.device_peak(one, jnp.float32) == first
    other = jax.make_mesh((1,), ("x",), devices=jax.devices()[1:2], axis_types=(jax.sharding.AxisType.Auto,))
    assert metrics.device_peak(other, jnp.float32)[0] != first[0]


def test_unknown_devices_measure_a_sustained_matmul_loop():
    """Elsewhere the peak is measured over one compiled chain of matmuls long enough to dwarf
    dispatch: the chain grows until one call takes min_seconds."""
    mesh = jax.make_mesh((1,), ("x",), devices=ONE, axis_types=(jax.sharding.AxisType.Auto,))
    assert metrics.datasheet_peak(jax.devices()[0].device_kind, jnp.float32) is None
    peak = metrics.measure_matmul_peak(mesh, jnp.float32, n=128, reps=1, min_seconds=0.05)
    assert 1e6 < peak < 1e14


def test_mfu_is_the_achieved_model_rate_over_the_peak():
    th = Throughput(tokens_per_iter=1000, flops_causal=6e9, flops_full=7e9, devices=2, peak=1e12,
                    peak_source="datasheet NVIDIA H200")
    fig = th.figures(step_s=10.0)
    assert fig["tokens_per_sec"] == 100.0
    assert fig["mfu"] == pytest.approx(100 * 6e9 / 2 / 1e12)
    assert fig["mfu_megatron_full_attention"] == pytest.approx(100 * 7e9 / 2 / 1e12)


# ------------------------------------------------------------------ bf16: no fp32 x fp32 matmul


def _dot_types(text: str) -> collections.Counter:
    """(lhs, rhs, result) element types of every dot_general in a StableHLO module."""
    found = collections.Counter()
    for line in text.splitlines():
        if "stablehlo.dot_general" in line:
            m = re.search(r": \(tensor<[^>]*x(\w+)>, tensor<[^>]*x(\w+)>\) -> tensor<[^>]*x(\w+)>", line)
            found[m.groups()] += 1
    return found


@pytest.mark.parametrize("pp", [1, 2])
def test_a_bf16_step_has_no_fp32_matmul(pp):
    """Under --bf16 every matmul, forward and backward (attention scores, LM head included),
    takes bf16 operands; the fp32 ones accumulate in fp32 (preferred_element_type). Also
    pipelined (dp4 x pp2), where the head is split over `pipe`."""
    pz = (build(ParallelConfig(), 4, devices=ONE, bf16=True) if pp == 1 else
          build(ParallelConfig(pipeline_model_parallel_size=pp), 1, bf16=True))
    state = pz.init(0)
    text = pz.train_step.lower(state, place(pz, fixed_batch()), jax.random.key(0)).as_text()
    types_ = _dot_types(text)
    assert sum(types_.values()) >= 18, types_  # 2 layers x (4 projections + 2 score matmuls) x 3 + head
    assert all(lhs == rhs == "bf16" for lhs, rhs, _ in types_), types_


def test_the_embedding_is_looked_up_in_fp32_then_cast():
    pz = build(ParallelConfig(), 4, devices=ONE, bf16=True)
    state = pz.init(0)
    text = pz.train_step.lower(state, place(pz, fixed_batch()), jax.random.key(0)).as_text()
    gathers = [line for line in text.splitlines() if '"stablehlo.gather"' in line or "stablehlo.gather" in line]
    scatters = [line for line in text.splitlines() if "stablehlo.scatter" in line]
    assert gathers and all("512x64xf32" in g for g in gathers if "512x64" in g), gathers
    assert scatters and all("bf16" not in s.split("->")[-1] for s in scatters if "512x64" in s), scatters


# ------------------------------------------------------------------ recompute policies

RECOMPUTE = {
    "none": {},
    "full": dict(recompute_granularity="full"),
    "full_uniform_2": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    "full_uniform_3": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=3),
    "full_block_1": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    "full_block_3": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=3),
    "dots": dict(recompute_granularity="dots"),
    "selective_mlp_layernorm": dict(recompute_granularity="selective", recompute_modules=("mlp", "layernorm")),
}
LAYERS = 4


@pytest.fixture(scope="module")
def recompute_runs():
    """(loss, grads, temp bytes of the compiled gradient step) per policy, one device; a wide
    MLP and one 16-row microbatch make activations, not weights, the bulk of the memory."""
    out = {}
    for name, extra in RECOMPUTE.items():
        pz = build(ParallelConfig(), 16, devices=ONE, num_layers=LAYERS, ffn_hidden_size=512, **extra)
        params = pz.init(0)["params"]
        args = (params, place(pz, fixed_batch()), jax.random.key(0))
        loss, grads = pz.loss_and_grads(*args)
        temp = pz.loss_and_grads.lower(*args).compile().memory_analysis().temp_size_in_bytes
        out[name] = (float(loss), jax.tree.map(np.asarray, grads), temp)
    return out


@pytest.mark.parametrize("name", [n for n in RECOMPUTE if n != "none"])
def test_recompute_gives_the_gradients_of_no_recompute(recompute_runs, name):
    ref_loss, ref_grads, _ = recompute_runs["none"]
    loss, grads, _ = recompute_runs[name]
    assert abs(loss - ref_loss) <= 1e-6
    for (path, r), g in zip(jax.tree_util.tree_leaves_with_path(ref_grads), jax.tree.leaves(grads)):
        err = float(np.max(np.abs(r - g)))
        assert err <= 1e-6 * max(1.0, float(np.max(np.abs(r)))), (jax.tree_util.keystr(path), err)


def _batched_products(jaxpr) -> int:
    """dot_generals with batch dims (the attention's products: no projection has any), nested
    jaxprs included."""
    return count_eqns(jaxpr, lambda e: (e.primitive.name == "dot_general"
                                        and bool(e.params["dimension_numbers"][1][0])))


def test_attention_forward_runs_once_short_of_full_recompute():
    """`dots` keeps the attention's output and log-sum-exp (recompute.keep_attention), so the
    gradient step runs exactly the attention products of no recompute (forward once, the
    backward's own); full recompute runs the forward a second time. On today's main `dots` ran
    as many as `full`: the attention forward again inside the backward."""
    counts = {}
    for name, extra in (("none", {}), ("selective", dict(recompute_granularity="selective")),
                        ("dots", dict(recompute_granularity="dots")), ("full", dict(recompute_granularity="full"))):
        pz = build(ParallelConfig(), 4, devices=ONE, num_layers=2, **extra)
        params = pz.init(0)["params"]
        traced = pz.loss_and_grads.trace(params, place(pz, fixed_batch()), jax.random.key(0))
        counts[name] = _batched_products(traced.jaxpr.jaxpr)
    assert counts["none"] > 0 and counts["dots"] == counts["selective"] == counts["none"] < counts["full"], counts


def test_recompute_policies_lower_the_compiled_memory(recompute_runs):
    """XLA's memory analysis of the gradient step: keeping less costs less. Uniform groups of
    k layers keep n/k layer inputs but hold k layers' activations while a group is recomputed:
    between full (k = 1) and none here, where a layer's input is small next to its activations."""
    temp = {name: run[2] for name, run in recompute_runs.items()}
    assert temp["full"] < temp["dots"] < temp["none"], temp
    assert temp["full"] <= temp["full_uniform_2"] < temp["none"], temp
    # Block: the more layers checkpointed, the less kept (all of them: full).
    assert temp["full"] <= temp["full_block_3"] < temp["full_block_1"], temp
    assert temp["full_block_3"] < temp["none"], temp
    # --recompute-modules mlp layernorm: the MLP's hidden values and the norms' outputs not kept
    assert temp["full"] < temp["selective_mlp_layernorm"] < temp["none"], temp


def test_offload_is_refused_on_cpu_and_allowed_on_gpu():
    from mlm_jax.config import ModelConfig

    cfg = ModelConfig(recompute_granularity="offload")
    with pytest.raises(ConfigError, match="--recompute-granularity offload .* cpu backend"):
        check_offload_platform(cfg, "cpu")
    check_offload_platform(cfg, "gpu")  # no error
    check_offload_platform(ModelConfig(recompute_granularity="dots"), "cpu")


@pytest.mark.parametrize("argv, message", [
    (["--recompute-method", "block"], "--recompute-method block needs --recompute-granularity full"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "2"],
     "--recompute-num-layers needs --recompute-method"),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "0"],
     "--recompute-num-layers 0: must be 1 or more"),
    (["--recompute-granularity", "everything"], "--recompute-granularity 'everything': choose one of"),
    (["--recompute-modules", "mlp", "layernorm"], "--recompute-modules mlp layernorm needs --recompute-granularity "
                                                 "selective, as in Megatron-LM (got None)"),
    (["--recompute-granularity", "selective", "--recompute-modules", "attention"],
     "--recompute-modules 'attention': choose from core_attn, moe_act"),
])
def test_recompute_flag_errors_name_the_flag(argv, message):
    from mlm_jax.arguments import parse_args
    from mlm_jax.validation import finalize

    with pytest.raises(ConfigError) as err:
        finalize(parse_args(["--mock-data"] + argv), 1)
    assert message in str(err.value), str(err.value)


# ------------------------------------------------------------------ benchmarks/gpu.py, smoke mode


def test_gpu_benchmark_smoke_configuration_runs_and_reports_every_figure():
    """`benchmarks/gpu.py --smoke` on this CPU: one configuration in process (the script runs each
    in a subprocess the same way), every figure of the table present and sane."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu.py")
    spec = importlib.util.spec_from_file_location("gpu_bench", path)
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    row = gpu.run_one("tiny", "full", smoke=True, micro=2, steps=1)
    assert row["attention_backend"] == "xla" and row["recompute"] == "full"
    assert row["tokens_per_sec"] > 0 and 0 < row["mfu"] < row["mfu_megatron_full_attention"] <= 1
    assert row["peak_memory_gib"] > 0 and row["attention_ms_per_step"] > 0 and np.isfinite(row["lm_loss"])
    assert "| tiny | full |" in gpu.table([row])
    # No target description for a CPU: the compiled program's estimate is skipped, with a note.
    assert row["estimate_note"] == f"not applicable: no target description for device {row['device']!r}"
    assert "estimated_step_ms" not in row and "| n/a | n/a |" in gpu.table([row])
    assert gpu.flags("1.3b", "off", smoke=False, micro=8)[:6] == [
        "--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16"]
    # The MoE kernel check: the Pallas kernel (interpret mode here) against ragged_dot, equal.
    moe = gpu.check_grouped_matmul(smoke=True)
    assert moe["ok"] and moe["pallas_ms"] > 0 and moe["xla_ms"] > 0 and sum(moe["group_sizes"]) == moe["rows"], moe


# ------------------------------------------------------------------ the throughput window


def test_evaluation_and_checkpoint_time_stay_out_of_the_throughput_window():
    """Tokens/s and MFU come from the window's step time less what evaluation and saving took
    (Megatron's timers); the eval and checkpoint timers still record it."""
    import time as _time

    from mlm_jax.config import InstrumentsConfig
    from mlm_jax.instruments import Instruments
    from mlm_jax.loop import Loop

    loop = Loop.__new__(Loop)  # only the window bookkeeping: no model, data or saver
    loop.inst = Instruments(InstrumentsConfig())
    loop._new_window()
    loop.window_start -= 1.0  # two iterations took 1 s of training ...
    loop.window_iters = 2
    with loop.excluded("eval"):  # ... then an evaluation and a save took 0.3 s more
        _time.sleep(0.2)
    with loop.excluded("checkpoint"):
        _time.sleep(0.1)
    assert loop.window_excluded >= 0.3
    assert 0.5 <= loop.window_step_s() < 0.5 + 0.1  # not (1 + 0.3) / 2
    assert loop.inst.current["eval"] >= 0.2 and loop.inst.current["checkpoint"] >= 0.1
