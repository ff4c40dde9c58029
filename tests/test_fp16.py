"""--fp16 with Megatron's loss scaling (mlm_jax/loss_scale.py): the scaler's rules, skipped
iterations step by step, fp16 against fp32 over 50 iterations, bit-exact resume, parallel layouts
against one device, and the flag errors."""

import dataclasses
import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlm_jax import checkpoint as ckpt
from mlm_jax import loss_scale as ls
from mlm_jax.arguments import parse_args
from mlm_jax.config import ParallelConfig
from mlm_jax.build import parallelize
from mlm_jax.sharding import make_mesh
from mlm_jax.loop import TrainingStopped
from mlm_jax.train import main, train
from tests.tiny_flags import NO_DROPOUT, tiny, train_run
from mlm_jax.validation import finalize
from tests.parallel_util import GLOBAL_BATCH, SEQ, VOCAB, place, tiny_config

# --------------------------------------------------------------------------- 1. the rules


def megatron_update(state: dict, found_inf: bool, window: int, hysteresis: int, min_scale: float) -> dict:
    """Megatron's DynamicGradScaler.update (megatron/core/optimizer/grad_scaler.py), in plain
    Python: the reference the logged scales are replayed against."""
    scale, growth, hyst = state["scale"], state["growth_tracker"], state["hysteresis_tracker"]
    if found_inf:
        growth, hyst = 0, hyst - 1
        if hyst <= 0:
            scale = max(scale * 0.5, min_scale)
    else:
        growth += 1
        if growth == window:
            growth, hyst, scale = 0, hysteresis, scale * 2.0
    return {"scale": scale, "growth_tracker": growth, "hysteresis_tracker": hyst}


# (found_inf, scale, growth tracker, hysteresis tracker after the step), from 64, min 8, window 3,
# hysteresis 2, worked out by hand from Megatron's rules.
SCRIPT = [
    (True, 64, 0, 1),    # first overflow: hysteresis 2 -> 1, no halving yet
    (False, 64, 1, 1),   # a clean step does not restore the hysteresis ...
    (True, 32, 0, 0),    # ... so the next overflow (not consecutive) halves
    (True, 16, 0, -1),   # out of hysteresis: every overflow halves
    (True, 8, 0, -2),
    (True, 8, 0, -3),    # floor: --min-loss-scale 8
    (False, 8, 1, -3),
    (False, 8, 2, -3),
    (False, 16, 0, 2),   # window (3) clean steps: double, hysteresis restored
    (True, 16, 0, 1),    # one overflow after growing: tolerated
    (False, 16, 1, 1),
    (False, 16, 2, 1),
    (False, 32, 0, 2),
]


def test_dynamic_scaler_follows_megatron_step_by_step():
    rules = ls.Scaler(initial=64.0, min_scale=8.0, window=3, hysteresis=2)
    step = jax.jit(rules.update)
    state = rules.init()
    ref = {"scale": 64.0, "growth_tracker": 0, "hysteresis_tracker": 2}
    assert ls.to_record(state) == ref
    for i, (found_inf, scale, growth, hyst) in enumerate(SCRIPT):
        state = step(state, jnp.asarray(found_inf))
        ref = megatron_update(ref, found_inf, 3, 2, 8.0)
        expected = {"scale": float(scale), "growth_tracker": growth, "hysteresis_tracker": hyst}
        assert ls.to_record(state) == expected == ref, (i, ls.to_record(state), expected, ref)
        assert state["scale"].dtype == jnp.float32 and state["growth_tracker"].dtype == jnp.int32


def test_static_scale_never_changes():
    rules = ls.Scaler(static=1024.0, window=1, hysteresis=1)
    state = rules.init()
    for found_inf in (True, True, False, True, False, False):
        state = rules.update(state, jnp.asarray(found_inf))
        assert ls.to_record(state) == {"scale": 1024.0, "growth_tracker": 0, "hysteresis_tracker": 1}
    # Round trip through a checkpoint's JSON record: exact.
    record = ls.to_record(ls.Scaler(initial=2.0**32).init())
    assert ls.to_record(ls.from_record(json.loads(json.dumps(record)))) == record


def test_unscale_finds_any_non_finite_gradient():
    grads = {"a": jnp.ones((3,), jnp.float32) * 8, "b": jnp.asarray([1.0, jnp.inf])}
    loss, out, found = ls.unscale(jnp.float32(16.0), grads, jnp.float32(8.0))
    assert bool(found) and float(loss) == 2.0 and np.array_equal(out["a"], np.ones(3))
    grads["b"] = jnp.asarray([jnp.nan, 0.0])
    assert bool(ls.unscale(jnp.float32(1.0), grads, jnp.float32(8.0))[2])
    grads["b"] = jnp.asarray([0.5, 0.0])
    assert not bool(ls.unscale(jnp.float32(1.0), grads, jnp.float32(8.0))[2])


# --------------------------------------------------------------------------- the Python API runs


def learnable_batch(seed: int) -> dict[str, np.ndarray]:
    """Arithmetic token sequences (next = previous + stride mod vocab): a curve that falls
    from ln(500) to ~2.3 in 50 steps, unlike uniform random tokens whose loss stays flat."""
    rng = np.random.default_rng(seed)
    start = rng.integers(0, VOCAB, (GLOBAL_BATCH, 1))
    stride = rng.integers(1, 4, (GLOBAL_BATCH, 1))
    tokens = (start + stride * np.arange(SEQ + 1)) % VOCAB
    return {"tokens": tokens[:, :-1].astype(np.int32), "labels": tokens[:, 1:].astype(np.int32),
            "loss_mask": np.ones((GLOBAL_BATCH, SEQ), np.float32),
            "position_ids": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (GLOBAL_BATCH, SEQ)).copy()}


@functools.cache  # one set of compiled programs per layout and loss-scale setting
def build(parallel: ParallelConfig, micro_batch: int, devices: int, fp16: bool = True, **optim):
    cfg = tiny_config(parallel, micro_batch, fp16=fp16)
    cfg = cfg.replace(optim=dataclasses.replace(cfg.optim, lr=3e-3, **optim))
    cfg = finalize(cfg, devices)
    return parallelize(cfg, make_mesh(cfg.parallel, jax.devices()[:devices]))


def host(tree):
    return jax.tree.map(np.asarray, tree)


# Forced overflows: 2**40 overflows fp16 gradients for certain (the tiny model's overflow edge
# is near 2**20). After 3 such steps the harness sets the scale to 2**12, far below the edge,
# so every layout takes the same (clean) decisions from there; --loss-scale-window 3 doubles
# it every 3 clean steps (2**15 at most in 12 steps).
FORCED = dict(initial_loss_scale=2.0**40, loss_scale_window=3)
STEPS, RESET_AT = 12, 3


@functools.cache
def trajectory(parallel: ParallelConfig, micro_batch: int, devices: int):
    """Per step: (record of loss/scale/skip, host state before, host state after), cached."""
    pz = build(parallel, micro_batch, devices, **FORCED)
    state = pz.init(0)
    steps = []
    for i in range(STEPS):
        if i == RESET_AT:
            scale = state[ls.KEY]["scale"]
            state[ls.KEY]["scale"] = jax.device_put(np.float32(2.0**12), scale.sharding)
        before = host({k: pz.plain(v) if k in ("params", "opt_state") else v for k, v in state.items()})
        state, m = pz.train_step(state, place(pz, learnable_batch(i)), jax.random.key(i))
        after = host({k: pz.plain(v) if k in ("params", "opt_state") else v for k, v in state.items()})
        steps.append(({"loss": float(m["lm_loss"]), "scale": float(m["loss_scale"]),
                       "skipped": int(m["skipped"]), "finite": bool(m["finite"])}, before, after))
    return steps


def _leaves_equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_overflow_skips_the_step_and_halves_the_scale():
    """Step by step on one device: a skipped step leaves params, optimizer state (Adam moments
    and count: the LR schedule) and step bitwise as they were; the scale follows the rules."""
    steps = trajectory(ParallelConfig(), 4, 1)
    records = [r for r, _, _ in steps]
    assert [r["skipped"] for r in records] == [1, 1, 1] + [0] * 9
    assert all(r["finite"] for r in records)  # an overflow is not a NaN stop
    # Hysteresis 2: the first overflow keeps 2**40, the next two halve it; after the harness's
    # 2**12, window 3 doubles it every 3 clean steps.
    assert [r["scale"] for r in records] == [2.0**40, 2.0**39, 2.0**38] + [2.0**12] * 2 + [2.0**13] * 3 + [
        2.0**14] * 3 + [2.0**15]
    for i, (r, before, after) in enumerate(steps):
        rest = lambda s: {k: v for k, v in s.items() if k != ls.KEY}  # noqa: E731
        if r["skipped"]:
            assert _leaves_equal(rest(before), rest(after)), f"step {i} skipped but the state moved"
        else:
            assert int(after["step"]) == int(before["step"]) + 1
            assert not _leaves_equal(before["params"], after["params"])
    assert int(steps[-1][2]["step"]) == STEPS - 3  # 3 skipped: the optimizer stepped 9 times
    assert records[-1]["loss"] < records[0]["loss"] - 0.3  # then training proceeds


def test_static_loss_scale_skips_but_never_moves():
    """--loss-scale 2**40: every step overflows and is skipped; the scale stays 2**40."""
    pz = build(ParallelConfig(), 4, 1, loss_scale=2.0**40, loss_scale_window=1)
    state = pz.init(0)
    init = host(state["params"])
    for i in range(3):
        state, m = pz.train_step(state, place(pz, learnable_batch(i)), jax.random.key(i))
        assert int(m["skipped"]) == 1 and float(m["loss_scale"]) == 2.0**40 and bool(m["finite"])
    assert int(state["step"]) == 0 and _leaves_equal(init, host(state["params"]))


@pytest.mark.parametrize("parallel,micro", [
    # dp2 x tp2 with ZeRO: gradients reduced once per step (reduce-scatter), params gathered in fp16
    (ParallelConfig(tensor_model_parallel_size=2, use_distributed_optimizer=True), 2),
    (ParallelConfig(pipeline_model_parallel_size=2), 2),  # pp2 x dp2: the pipeline's scaled loss
    # FSDP (optim_grads_params): each layer gathered in fp16, its scaled gradient reduce-scattered
    (ParallelConfig(tensor_model_parallel_size=2, use_megatron_fsdp=True, use_distributed_optimizer=True), 2),
], ids=["dp2_tp2_zero", "pp2_dp2", "dp2_tp2_fsdp"])
def test_parallel_layout_equals_one_device(parallel, micro):
    """Same skips and scales exactly; losses within 1e-3 (fp16 rounds activations to 11 bits:
    summing tensor-parallel partial products and microbatches in another order moves the loss
    by ~2e-4 here); the parameter updates within 5% in norm (Adam divides by the gradient's
    size, so an element whose fp16 gradient is ~0 may step either way: no elementwise bound)."""
    one, other = trajectory(ParallelConfig(), 4, 1), trajectory(parallel, micro, 4)
    for i, ((a, _, _), (b, _, _)) in enumerate(zip(one, other)):
        assert (a["skipped"], a["scale"]) == (b["skipped"], b["scale"]), i
        assert abs(a["loss"] - b["loss"]) < 1e-3, (i, a, b)
    init = one[0][1]["params"]
    for (_, _, a), (_, _, b) in ((one[-1], other[-1]),):
        da = np.concatenate([(x - y).ravel() for x, y in zip(jax.tree.leaves(a["params"]), jax.tree.leaves(init))])
        db = np.concatenate([(x - y).ravel() for x, y in zip(jax.tree.leaves(b["params"]), jax.tree.leaves(init))])
        assert np.linalg.norm(da - db) / np.linalg.norm(da) < 0.05
    # The skipped steps left every layout's parameters at the (layout-independent) init.
    assert _leaves_equal(one[RESET_AT][1]["params"], other[RESET_AT][1]["params"])


def test_fp16_curve_follows_fp32():
    """50 iterations, fp16 (scale 2**12, no overflow) against fp32 from the same init and data.
    Tolerance 2e-3 on every loss: fp16's unit roundoff is 2**-11 ~ 4.9e-4 per activation, while
    the master weights, Adam, norms, softmax and the loss stay fp32; measured max 3.4e-4 while
    the loss falls by ~3.9."""
    curves = {}
    for fp16 in (True, False):
        pz = build(ParallelConfig(), 4, 1, fp16=fp16, initial_loss_scale=2.0**12)
        state, losses = pz.init(0), []
        # Only a loss-scaled run carries a scaler: fp32/bf16 states (and checkpoints) are as before.
        assert (ls.KEY in state) == fp16 and set(state) - {ls.KEY} == {"params", "opt_state", "step", "schedule_samples"}
        for i in range(50):
            state, m = pz.train_step(state, place(pz, learnable_batch(i)), jax.random.key(i))
            losses.append(float(m["lm_loss"]))
            if fp16:
                assert int(m["skipped"]) == 0 and float(m["loss_scale"]) == 2.0**12
        curves[fp16] = losses
    assert curves[False][-1] < curves[False][0] - 3.0  # a real curve
    diffs = [abs(a - b) for a, b in zip(curves[True], curves[False])]
    assert max(diffs) < 2e-3, max(diffs)


# --------------------------------------------------------------------------- the command


TINY = tiny("--micro-batch-size", "1", "--global-batch-size", "16", *NO_DROPOUT, "--eval-iters", "1",
            "--eval-interval", "1000", "--lr", "1e-3", "--peak-flops-per-device", "1e12")
# 2**24 overflows this model's fp16 gradients for the first iterations; window 3 then grows the
# scale back into overflows: skips, halvings and doublings in 12 iterations.
FP16 = ["--fp16", "--initial-loss-scale", str(2**24), "--loss-scale-window", "3"]
ITERS, SAVED_AT = 12, 8  # at 8 (today) the scale has grown and overflowed once since: hysteresis 1


def run(tmp, name, extra, iters=ITERS):
    summary, records, _ = train_run(TINY + FP16 + ["--train-iters", str(iters)] + extra, tmp / name)
    return summary, {r["iteration"]: r for r in records if "lm_loss" in r}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp16")
    summary, records = run(tmp, "straight", ["--log-interval", "1", "--save", str(tmp / "S"),
                                             "--save-interval", str(SAVED_AT),
                                             "--tensorboard-dir", str(tmp / "tb")])
    return tmp, summary, records


def test_metrics_file_replays_megatron_rules(straight, capsys):
    """Every iteration's logged scale is Megatron's rule applied to the logged skips."""
    tmp, summary, records = straight
    assert sorted(records) == list(range(1, ITERS + 1))
    skips = [records[i]["skipped_iterations"] for i in range(1, ITERS + 1)]
    ref = {"scale": float(2**24), "growth_tracker": 0, "hysteresis_tracker": 2}
    scales = []
    for i, skipped in enumerate(skips, 1):
        ref = megatron_update(ref, bool(skipped), 3, 2, 1.0)
        scales.append(ref["scale"])
        assert records[i]["loss_scale"] == ref["scale"], (i, records[i], ref)
    assert skips[:2] == [1, 1] and 0 in skips  # forced overflows, then clean steps
    assert any(b < a for a, b in zip(scales, scales[1:])) and any(b > a for a, b in zip(scales, scales[1:]))
    assert records[ITERS]["lm_loss"] < records[1]["lm_loss"]
    # The checkpoint's scaler is the replayed state at that iteration.
    ref = {"scale": float(2**24), "growth_tracker": 0, "hysteresis_tracker": 2}
    for skipped in skips[:SAVED_AT]:
        ref = megatron_update(ref, bool(skipped), 3, 2, 1.0)
    meta = ckpt.find_checkpoint(str(tmp / "S"), step=SAVED_AT).meta
    assert meta["loss_scale"] == ref and meta["opt_step"] == SAVED_AT - sum(skips[:SAVED_AT])
    events = [f for f in os.listdir(tmp / "tb") if f.startswith("events.out.tfevents")]
    data = b"".join(open(tmp / "tb" / f, "rb").read() for f in events)
    assert b"loss_scale" in data and b"skipped_iterations" in data


def test_resume_is_bit_exact(straight):
    """Train 12 straight == train 8, save, resume to 12: losses, scales and params bitwise.
    The resumed run logs every 2nd iteration: its skip counts are the straight run's summed
    over each window (Megatron's "number of skipped iterations")."""
    tmp, _, records = straight
    saved = ckpt.find_checkpoint(str(tmp / "S"), step=SAVED_AT).meta["loss_scale"]
    assert saved != ls.to_record(ls.Scaler(initial=2.0**24).init())  # the resume must restore it
    _, resumed = run(tmp, "resumed", ["--load", str(tmp / "S"), "--ckpt-step", str(SAVED_AT),
                                      "--save", str(tmp / "R"), "--log-interval", "2"])
    assert sorted(resumed) == [10, 12]
    for i in (10, 12):
        assert resumed[i]["lm_loss"] == records[i]["lm_loss"] and resumed[i]["loss_scale"] == records[i]["loss_scale"]
        window = sum(records[j]["skipped_iterations"] for j in (i - 1, i))
        assert resumed[i]["skipped_iterations"] == window
    a, b = (ckpt.find_checkpoint(str(tmp / d), step=ITERS) for d in ("S", "R"))
    assert a.meta["loss_scale"] == b.meta["loss_scale"] and a.meta["opt_step"] == b.meta["opt_step"]
    for x, y in zip(jax.tree.leaves(ckpt.restore_host_params(a)), jax.tree.leaves(ckpt.restore_host_params(b))):
        np.testing.assert_array_equal(x, y)


def test_log_line_shows_scale_and_skips(straight):
    from mlm_jax.instruments import iteration_line

    _, _, records = straight
    # A skipped iteration's gradient norm is inf or NaN (the metrics file writes it as a string).
    first = {k: float(v) if v in ("inf", "nan") else v for k, v in records[1].items()}
    assert not np.isfinite(first["grad_norm"])
    line = iteration_line(first, ITERS, 16)
    assert "| lm loss: " in line and f"| loss scale: {2**24:.1f} | grad norm: " in line
    assert "| number of skipped iterations:   1 | tokens/s: " in line
    plain = {k: v for k, v in first.items() if k not in ("loss_scale", "skipped_iterations")}
    assert "loss scale" not in iteration_line(plain, ITERS, 16)  # fp32/bf16 lines unchanged


def test_checkpoint_without_scaler_resumes_fp16_from_the_initial_scale(tmp_path):
    """The format-1 fixture (fp32, before loss scaling existed) loads into an fp16 run (onto
    tp4 x dp2): the scaler starts at --initial-loss-scale (2**32), which overflows this model's
    first gradients: skipped, scale kept by the hysteresis."""
    from tests.test_checkpoint import FIXTURES, V1_FLAGS

    folder = tmp_path / "v1"
    shutil.copytree(os.path.join(FIXTURES, "checkpoint_v1"), folder)
    argv = V1_FLAGS + ["--micro-batch-size", "1", "--tensor-model-parallel-size", "4", "--fp16",
                       "--train-iters", "3", "--load", str(folder), "--run-dir", str(tmp_path / "run")]
    train(parse_args(argv), log=lambda *_: None)
    (last,) = [json.loads(x) for x in open(tmp_path / "run" / "metrics.jsonl") if '"lm_loss"' in x]
    assert last["iteration"] == 3 and last["loss_scale"] == 2.0**32 and last["skipped_iterations"] == 1


def test_nan_loss_still_stops_an_fp16_run(tmp_path):
    # An absurd learning rate overflows the parameters after the first clean update: a NaN loss.
    with pytest.raises(TrainingStopped, match=r"iteration \d+: loss .* is NaN/Inf; stopping"):
        train(parse_args(TINY + ["--fp16", "--initial-loss-scale", "4096", "--lr", "1e38", "--clip-grad", "0",
                                 "--weight-decay", "0", "--train-iters", "4", "--log-interval", "1",
                                 "--run-dir", str(tmp_path / "nan")]), log=lambda *_: None)


@pytest.mark.parametrize("argv,message", [
    (["--fp16", "--bf16"], "--fp16 and --bf16 exclude each other (as in Megatron-LM): choose one"),
    (["--fp16", "--loss-scale", "0"], "--loss-scale must be a positive number, got 0.0 (leave it out"),
    (["--fp16", "--loss-scale-window", "-5"], "--loss-scale-window must be > 0, got -5"),
    (["--fp16", "--hysteresis", "0"], "--hysteresis must be > 0, got 0"),
    (["--fp16", "--min-loss-scale", "0"], "--min-loss-scale must be > 0, got 0.0"),
    (["--fp16", "--initial-loss-scale", "-1"], "--initial-loss-scale must be > 0, got -1.0"),
    (["--fp16", "--initial-loss-scale", "2", "--min-loss-scale", "4"],
     "--min-loss-scale 4.0 must be <= --initial-loss-scale 2.0"),
    (["--fp16", "--hysteresis", "two"], "--hysteresis: invalid int value: 'two'"),
])
def test_bad_loss_scaling_flags_exit_2_naming_the_flag(tmp_path, capsys, argv, message):
    run_dir = tmp_path / "run"
    (tmp_path / "keep.txt").write_text("kept")
    assert main(TINY + argv + ["--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: {err.strip().split('error: ', 1)[1]}"]
    assert message in err and "Traceback" not in err
    assert not run_dir.exists() and (tmp_path / "keep.txt").read_text() == "kept"
