"""Sample-based training and batch-size ramp-up (mlm_jax/batch_schedule.py, optim.lr_for):
Megatron's calculator and scheduler, ported here from Megatron-LM's source, against ours; a
ramp-up run against the same batches stepped by hand; dp2 and pp2 against one device; an
exact resume mid-ramp; Megatron's refusals."""

import dataclasses
import math

import jax
import numpy as np
import pytest

from mlm_jax import checkpoint as ckpt
from mlm_jax.arguments import parse_args
from mlm_jax.batch_schedule import BatchSchedule, RunPlan, ScheduleError, from_config, parse_step_schedule
from mlm_jax.config import ConfigError, OptimConfig, ParallelConfig
from mlm_jax.optim import lr_at, lr_for
from mlm_jax.build import parallelize
from mlm_jax.sharding import make_mesh
from mlm_jax.train import main
from tests.tiny_flags import NO_DROPOUT, tiny, train_run
from mlm_jax.validation import finalize
from tests.parallel_util import SEQ, VOCAB, tiny_config


# --------------------------------------------------------------------------- Megatron, ported


def megatron_rampup_batch(start, incr, ramp_samples, gbs, consumed):
    """RampupBatchsizeNumMicroBatchesCalculator.update (Megatron-LM before 532ad926b4)."""
    per_increment = ramp_samples / ((gbs - start) // incr)
    if consumed > ramp_samples:
        return gbs
    current = start + int(consumed / per_increment) * incr
    assert current <= gbs
    return current


def megatron_rampup_train_iters(start, incr, ramp_samples, gbs, train_samples):
    """training.update_train_iters with --rampup-batch-size (Megatron-LM before 532ad926b4)."""
    iterations, consumed = 0, 0
    while consumed <= ramp_samples and consumed <= train_samples:
        consumed += megatron_rampup_batch(start, incr, ramp_samples, gbs, consumed)
        iterations += 1
    if train_samples > consumed:
        iterations += (train_samples - consumed) // gbs
    return iterations


def megatron_step_batch(schedule, consumed):
    """StepBatchsizeNumMicroBatchesCalculator._get_batch_size_for_samples."""
    size = schedule[0][1]
    for threshold, bs in schedule:
        if consumed >= threshold:
            size = bs
        else:
            break
    return size


def megatron_get_lr(num_steps, init_lr, max_lr, min_lr, warmup, decay, style):
    """OptimizerParamScheduler.get_lr (linear and cosine), in float64."""
    if warmup > 0 and num_steps <= warmup:
        return init_lr + (max_lr - init_lr) * float(num_steps) / float(warmup)
    if style == "constant":
        return max_lr
    if num_steps > decay:
        return min_lr
    ratio = float(num_steps - warmup) / float(decay - warmup)
    coeff = 1.0 - ratio if style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (max_lr - min_lr)


# --------------------------------------------------------------------------- 1. the calculator


@pytest.mark.parametrize("start,incr,ramp,gbs,micro,dp", [
    (16, 16, 5859375, 1536, 1, 16), (32, 32, 65324160, 128, 2, 16), (8, 8, 32, 24, 1, 8),
    (4, 2, 100, 20, 1, 2), (3, 3, 7, 12, 3, 1)])
def test_rampup_equals_megatron(start, incr, ramp, gbs, micro, dp):
    s = BatchSchedule(gbs, micro, dp, rampup=(start, incr, ramp))
    consumed = 0
    steps = s.walk()
    for _ in range(2000):
        first, size = next(steps)
        assert first == consumed
        assert size == megatron_rampup_batch(start, incr, ramp, gbs, consumed), consumed
        assert s.num_microbatches(consumed) == size // (micro * dp)
        consumed += size
    for train_samples in (0, 1, start, ramp - 1, ramp, ramp + 1, 3 * ramp + 7, ramp + 5 * gbs):
        assert s.train_iters(train_samples) == megatron_rampup_train_iters(start, incr, ramp, gbs, train_samples)


def test_step_schedule_equals_megatron_thresholds_in_tokens():
    text = "0:16 2.4B:320 4.8B:624, 7.2B:928 9.6B:1232 12B:1536"
    steps = parse_step_schedule(text, 2048)
    assert steps == ((0, 16), (2_400_000_000 // 2048, 320), (4_800_000_000 // 2048, 624),
                     (7_200_000_000 // 2048, 928), (9_600_000_000 // 2048, 1232), (12_000_000_000 // 2048, 1536))
    assert parse_step_schedule("100:8 0:4", None) == ((0, 4), (100, 8))  # samples without a seq length
    s = BatchSchedule(16, 1, 16, steps=steps)
    consumed, iterations, train_samples = 0, 0, 6_000_000
    for first, size in s.walk():
        if first >= train_samples:
            break
        assert first == consumed and size == megatron_step_batch(steps, consumed)
        consumed, iterations = consumed + size, iterations + 1
    assert s.train_iters(train_samples) == iterations  # Megatron: every iteration starting below


def test_run_plan_resumes_from_consumed_samples():
    s = BatchSchedule(24, 1, 8, rampup=(8, 8, 32))
    whole = RunPlan(s, 0, 0, 10)
    assert whole.sizes == [8, 8, 16, 24, 24, 24, 24, 24, 24, 24]
    assert [whole.consumed(i) for i in range(0, 5)] == [0, 8, 16, 32, 56]
    later = RunPlan(s, 2, 16, 10)
    assert later.sizes == whole.sizes[2:] and later.firsts == whole.firsts[2:]
    assert later.consumed(2) == 16 and later.batch_size(3) == 16 and later.first_sample(4) == 32


@pytest.mark.parametrize("schedule,message", [
    (dict(rampup=(8, 6, 32)), "expected global batch size interval (16) to be divisible by global batch size "
                              "increment (6)"),
    (dict(rampup=(32, 8, 32)), "expected global batch size to be greater than or equal to start batch size"),
    (dict(rampup=(0, 8, 32)), "start batch size should be positive, got 0"),
    (dict(rampup=(24, 8, 32)), "nothing to ramp up"),
])
def test_rampup_refusals_with_megatrons_reasons(schedule, message):
    with pytest.raises(ScheduleError) as e:
        BatchSchedule(24, 1, 8, **schedule)
    assert message in str(e.value) and "--rampup-batch-size" in str(e.value)


def test_size_not_divisible_by_micro_times_dp_is_refused():
    s = BatchSchedule(24, 2, 2, rampup=(6, 6, 32))
    with pytest.raises(ScheduleError, match=r"current global batch size \(6\) is not divisible by "
                                            r"micro-batch-size \(2\) times data parallel size \(2\)"):
        s.check_sizes(RunPlan(s, 0, 0, 5).sizes)
    for text, message in [("8:4", "first schedule entry must have threshold 0, got 8"),
                          ("0:4 0:8", "strictly increasing"), ("0:4 x", 'invalid schedule entry "x"'),
                          ("0:-4", "batch size must be positive"), ("0:4 1Q:8", "is not a number")]:
        with pytest.raises(ScheduleError, match=message):
            parse_step_schedule(text, None)


# --------------------------------------------------------------------------- 2. the LR from samples


def _cfg(optim, train):
    cfg = tiny_config(ParallelConfig(), 1)
    return finalize(cfg.replace(optim=dataclasses.replace(cfg.optim, **optim),
                                train=dataclasses.replace(cfg.train, **train)), 8)


@pytest.mark.parametrize("style", ["linear", "cosine", "WSD", "constant"])
def test_iteration_flags_bit_identical_and_samples_equal(style):
    """Iteration-based flags at a constant batch: the sample counter gives exactly today's LR
    (lr_at at the iteration count); the same schedule in samples gives the same values."""
    gbs, iters = 16, 40
    base = dict(lr=1e-3, min_lr=1e-5, lr_decay_style=style)
    by_iters = _cfg({**base, "lr_warmup_iters": 5, "lr_decay_iters": 30, "lr_wsd_decay_iters": 8},
                    dict(global_batch_size=gbs, train_iters=iters))
    by_samples = _cfg({**base, "lr_warmup_samples": 5 * gbs, "lr_decay_samples": 30 * gbs,
                       "lr_wsd_decay_samples": 8 * gbs}, dict(global_batch_size=gbs, train_samples=iters * gbs))
    assert by_samples.train.train_iters == iters
    for k in range(iters + 1):
        today = np.asarray(lr_at(by_iters.optim, iters, k))
        assert np.asarray(lr_for(by_iters, np.int32(k * gbs))).tobytes() == today.tobytes(), k
        np.testing.assert_allclose(lr_for(by_samples, np.int32(k * gbs)), today, rtol=2e-6, atol=1e-12)


def test_warmup_fraction_and_warmup_init_hand_computed():
    cfg = _cfg(dict(lr=1e-3, min_lr=1e-4, lr_decay_style="linear", lr_warmup_fraction=0.25,
                    lr_warmup_init=2e-4, lr_decay_samples=800), dict(global_batch_size=16, train_samples=1000))
    # warmup = 0.25 x 800 = 200 samples from 2e-4; linear decay 200 -> 800 samples; min after.
    for samples, want in [(0, 2e-4), (100, 2e-4 + 8e-4 * 0.5), (200, 1e-3), (500, 1e-4 + 9e-4 * 0.5),
                          (800, 1e-4), (960, 1e-4)]:
        np.testing.assert_allclose(lr_for(cfg, np.int32(samples)), want, rtol=1e-6)
    it = _cfg(dict(lr=1e-3, min_lr=0.0, lr_decay_style="cosine", lr_warmup_fraction=0.1),
              dict(global_batch_size=16, train_iters=50))
    for k, want in [(0, 0.0), (2, 4e-4), (5, 1e-3), (50, 0.0)]:  # warmup 5 of 50 iterations
        np.testing.assert_allclose(lr_for(it, np.int32(16 * k)), want, rtol=1e-6, atol=1e-12)
    np.testing.assert_allclose(lr_for(it, np.int32(16 * 27) + 8),  # 27.5 iterations: mid-decay
                               0.5 * 1e-3 * (math.cos(math.pi * 22.5 / 45) + 1), rtol=1e-6)


# --------------------------------------------------------------------------- 3-5. runs


TINY = tiny("--micro-batch-size", "1", *NO_DROPOUT, "--eval-iters", "1", "--eval-interval", "100",
            "--log-interval", "1", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
            "--peak-flops-per-device", "1e9")
# 8 devices, dp8: batches 8, 8, 16, 24, 24, 24, 24 (ramp 8 -> 24 by 8 over 32 samples, then
# (136 - 56) // 24 = 3 whole batches of 24).
RAMP = ["--global-batch-size", "24", "--rampup-batch-size", "8", "8", "32", "--train-samples", "136",
        "--lr-warmup-samples", "20"]
SIZES = [8, 8, 16, 24, 24, 24, 24]


def run(tmp, name, extra):
    summary, records, log = train_run(TINY + RAMP + extra, tmp / name)
    return summary, [r for r in records if "lm_loss" in r], log


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("ramp")


@pytest.fixture(scope="module")
def straight(tmp):
    return run(tmp, "straight", ["--save", str(tmp / "S"), "--save-interval", "2"])


def test_ramp_run_logs_megatrons_batches_and_lr(straight):
    summary, records, log = straight
    assert summary["iterations"] == 7 == megatron_rampup_train_iters(8, 8, 32, 24, 136)
    assert [r["global_batch_size"] for r in records] == SIZES
    assert [r["consumed_samples"] for r in records] == list(np.cumsum(SIZES))
    consumed_before = [0, *np.cumsum(SIZES)[:-1]]
    want = [megatron_get_lr(c, 0.0, 1e-3, 1e-4, 20, 136, "cosine") for c in consumed_before]
    np.testing.assert_allclose([r["lr"] for r in records], want, rtol=1e-6)
    assert "ramping up batch size from 8 to 16 at iteration 3 (2 microbatch(es), 16 consumed samples)" in log
    from mlm_jax.instruments import iteration_line  # the console line the run printed for iteration 3

    assert "consumed samples:           32 |" in iteration_line(records[2], 7, records[2]["global_batch_size"])
    assert "global batch size:    16 |" in iteration_line(records[2], 7, records[2]["global_batch_size"])


def test_ramp_run_equals_the_same_batches_by_hand(straight, tmp):
    """The loader and loop against hand-assembled batches of the planned sizes, stepped through
    the train step directly: identical losses and final parameters."""
    from mlm_jax.batch_layout import batch_layout
    from mlm_jax.batch_schedule import for_layout
    from mlm_jax.data import make_batch
    from mlm_jax.train import build_data

    summary, records, _ = straight
    cfg = finalize(parse_args(TINY + RAMP), jax.device_count())
    pz = parallelize(cfg, make_mesh(cfg.parallel))
    data = build_data(cfg, for_layout(cfg, batch_layout(cfg, pz.mesh)), None, log=lambda *_: None)
    eod = data.tokenizer.eod if data.tokenizer is not None else VOCAB - 1
    state, key = pz.init(cfg.train.seed), jax.random.key(cfg.train.seed)
    consumed, losses = 0, []
    for iteration, size in enumerate(SIZES, start=1):
        samples = np.stack([np.asarray(data.train[i]) for i in range(consumed, consumed + size)])
        full = make_batch(samples, eod=eod)
        batch = {k: jax.device_put(full[k].reshape(size // 8, 8, SEQ), pz.batch_sharding())
                 for k in ("tokens", "labels", "loss_mask", "position_ids")}
        state, metrics = pz.train_step(state, batch, jax.random.fold_in(key, iteration))
        losses.append(float(metrics["lm_loss"]))
        consumed += size
    assert losses == [r["lm_loss"] for r in records]  # bit for bit
    assert int(state["schedule_samples"]) == sum(SIZES) and int(state["step"]) == 7
    final = ckpt.restore_host_params(ckpt.find_checkpoint(str(tmp / "S"), 7))
    for a, b in zip(jax.tree.leaves(final), jax.tree.leaves(pz.plain(state["params"]))):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_resume_mid_ramp_is_exact(straight, tmp):
    """Saved at iteration 2 (16 samples, batch 8 -> 16 next), resumed: iterations 3-7 and the
    final parameters are bit-identical to the straight run."""
    _, records, _ = straight
    summary, resumed, log = run(tmp, "resumed", ["--load", str(tmp / "S"), "--ckpt-step", "2",
                                                 "--save", str(tmp / "R")])
    assert "iteration 2, 16 consumed samples" in log
    assert [r["iteration"] for r in resumed] == [3, 4, 5, 6, 7]
    assert [r["lm_loss"] for r in resumed] == [r["lm_loss"] for r in records[2:]]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in records[2:]]
    assert [r["consumed_samples"] for r in resumed] == [r["consumed_samples"] for r in records[2:]]
    a = ckpt.restore_host_params(ckpt.find_checkpoint(str(tmp / "S"), 7))
    b = ckpt.restore_host_params(ckpt.find_checkpoint(str(tmp / "R"), 7))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)
    meta = ckpt.find_checkpoint(str(tmp / "R"), 7).meta
    assert (meta["consumed_samples"], meta["schedule_samples"]) == (sum(SIZES), sum(SIZES))


def test_old_checkpoint_without_counter_derives_it(straight, tmp):
    """A checkpoint from before the sample counter: optimizer steps x its global batch."""
    from mlm_jax.checkpoint.restore import schedule_samples

    found = ckpt.find_checkpoint(str(tmp / "S"), 4)
    assert found.meta["schedule_samples"] == 56
    old = {k: v for k, v in found.meta.items() if k != "schedule_samples"}
    assert schedule_samples(old, found.config) == 4 * 24  # a constant batch of 24 all along


# --------------------------------------------------------------------------- 4. dp2, pp2


@pytest.mark.parametrize("layout", ["dp2", "pp2"])
def test_ramp_under_dp2_and_pp2_equals_one_device(layout):
    """Batches 2, 4, 6 (micro 1): one compiled step per size; the losses and LR of dp2 (1, 2, 3
    microbatches) and pp2 (2, 4, 6) equal one device's."""
    parallel = ParallelConfig(pipeline_model_parallel_size=2) if layout == "pp2" else ParallelConfig()
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, (12, SEQ + 1)).astype(np.int32)

    def losses(parallel, devices):
        cfg = tiny_config(parallel, 1)
        cfg = finalize(cfg.replace(
            optim=OptimConfig(lr=1e-3, min_lr=1e-4, lr_decay_style="linear", lr_warmup_samples=3),
            train=dataclasses.replace(cfg.train, global_batch_size=6, rampup_batch_size=(2, 2, 4),
                                      train_samples=12, train_iters=1)), len(devices))
        pz = parallelize(cfg, make_mesh(cfg.parallel, devices))
        state, out = pz.init(0), []
        plan = RunPlan(from_config(cfg, pz.mesh.shape["data"]), 0, 0, cfg.train.train_iters)
        assert plan.sizes == [2, 4, 6]
        for i, size in enumerate(plan.sizes, start=1):
            rows = tokens[plan.first_sample(i): plan.first_sample(i) + size]
            batch = {"tokens": rows[:, :-1], "labels": rows[:, 1:], "loss_mask": np.ones((size, SEQ), np.float32),
                     "position_ids": np.broadcast_to(np.arange(SEQ, dtype=np.int32), (size, SEQ))}
            shape = pz.batch_shape(size)
            batch = {k: jax.device_put(np.ascontiguousarray(v).reshape(shape), pz.batch_sharding())
                     for k, v in batch.items()}
            state, m = pz.train_step(state, batch, jax.random.key(i))
            out.append((float(m["lm_loss"]), float(m["lr"])))
        return out

    one = losses(ParallelConfig(), jax.devices()[:1])
    two = losses(parallel, jax.devices()[:2])
    assert all(math.isfinite(loss) for loss, _ in two)
    np.testing.assert_allclose(two, one, rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose([lr for _, lr in one], [0.0, 1e-3 * 2 / 3, 1e-4 + 9e-4 * 2 / 3], rtol=1e-6)


# --------------------------------------------------------------------------- 6. refusals


@pytest.mark.parametrize("flags,message", [
    (["--train-iters", "10", "--train-samples", "100"], "--train-iters with --train-samples: give one"),
    (["--train-iters", "10", "--global-batch-size", "16", "--rampup-batch-size", "8", "8", "32"],
     "--rampup-batch-size with --train-iters: expected no batch-size rampup for iteration-based training"),
    (["--global-batch-size", "16", "--step-batch-size-schedule", "0:8 100:16"],
     "Cannot specify both --step-batch-size-schedule and --global-batch-size"),
])
def test_flag_mixes_refused_by_the_parser(flags, message):
    with pytest.raises(ConfigError) as e:
        parse_args(TINY + flags)
    assert message in str(e.value)


@pytest.mark.parametrize("flags,message", [
    (["--train-samples", "100", "--lr-decay-iters", "5"], "--lr-decay-iters with --train-samples: expected "
                                                          "sample-based learning rate decay"),
    (["--train-samples", "100", "--lr-warmup-iters", "5"], "expected sample-based learning rate warmup"),
    (["--train-iters", "10", "--lr-decay-samples", "50"], "expected iteration-based learning rate decay"),
    (["--train-iters", "10", "--lr-warmup-samples", "50"], "expected iteration-based learning rate warmup"),
    (["--train-iters", "10", "--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"],
     "can only specify one of lr-warmup-fraction and lr-warmup-iters"),
    (["--train-samples", "100", "--lr-warmup-fraction", "0.1", "--lr-warmup-samples", "2"],
     "can only specify one of lr-warmup-fraction and lr-warmup-samples"),
    (["--global-batch-size", "16", "--rampup-batch-size", "8", "8", "32"],
     "--rampup-batch-size with --train-iters: expected no batch-size rampup"),  # no --train-samples
    (["--train-samples", "100", "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "32"],
     "current global batch size (4) is not divisible by micro-batch-size (1) times data parallel size (8)"),
    (["--train-samples", "100", "--rampup-batch-size", "4", "4", "32", "--step-batch-size-schedule", "0:8"],
     "--rampup-batch-size with --step-batch-size-schedule: give one"),
    (["--train-samples", "0"], "--train-samples must be a positive number, got 0"),
    (["--train-samples", "100", "--lr-warmup-init", "1", "--lr", "0.1"], "--lr-warmup-init 1.0 must be between 0"),
])
def test_bad_combinations_refused_by_validation(flags, message):
    with pytest.raises(ConfigError) as e:
        finalize(parse_args(TINY + flags), 8)
    assert message in str(e.value)


def test_cli_refusal_is_one_line_exit_2(tmp_path, capsys):
    run_dir = tmp_path / "never"
    argv = TINY + ["--run-dir", str(run_dir), "--train-iters", "10", "--global-batch-size", "16",
                   "--rampup-batch-size", "8", "8", "32"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rampup-batch-size with --train-iters" in err[0]
    assert "Traceback" not in err[0] and not run_dir.exists()
