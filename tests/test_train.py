"""The training entry point end to end on the fake 8-device mesh, with mock data."""

import json
import os

import pytest

from mlm_jax.loop import TrainingStopped
from mlm_jax.train import main
from tests.tiny_flags import NO_DROPOUT, tiny, train_run

TINY = tiny("--micro-batch-size", "1", "--global-batch-size", "16", *NO_DROPOUT, "--eval-iters", "1",
            "--lr", "1e-3", "--lr-warmup-iters", "0")


def run(tmp_path, name, extra, iters=4, eval_at_start=True):
    run_dir = tmp_path / name
    argv = TINY + ["--train-iters", str(iters), "--log-interval", "1", "--eval-interval", "2"]
    argv += ["--eval-at-start"] if eval_at_start else []
    summary, records, _ = train_run(argv + ["--tensorboard-dir", str(run_dir / "tb")] + extra, run_dir)
    return summary, records


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    return {
        "dp8": run(tmp, "dp8", []),
        "dp2_tp4_sp": run(tmp, "dp2_tp4_sp", ["--tensor-model-parallel-size", "4", "--sequence-parallel",
                                              "--micro-batch-size", "2"], eval_at_start=False),
    }


def test_metrics_file_and_tensorboard(runs):
    summary, records = runs["dp8"]
    train_records = [r for r in records if "lm_loss" in r]
    assert [r["iteration"] for r in train_records] == [1, 2, 3, 4]
    for r in train_records:
        for key in ("iteration", "lm_loss", "lr", "grad_norm", "tokens_per_sec", "step_time_ms", "mfu",
                    "mfu_megatron_full_attention", "mfu_peak_source", "data_wait_ms", "consumed_samples"):
            assert key in r, key
        assert r["mfu_peak_source"] == "measured" and r["mfu"] > 0
    valid = [r for r in records if "valid_lm_loss" in r]
    assert [r["iteration"] for r in valid] == [0, 2, 4]
    assert train_records[-1]["lm_loss"] < train_records[0]["lm_loss"]
    tb = os.path.join(summary["run_dir"], "tb")
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(tb))
    assert json.load(open(os.path.join(summary["run_dir"], "config.json")))["model"]["num_layers"] == 2


def test_no_validation_before_the_first_step_unless_asked(runs):
    """Megatron-LM validates on --eval-interval and at the end, not before the first step;
    --eval-at-start (the default run's setting) adds that pass."""
    valid = [r["iteration"] for r in runs["dp2_tp4_sp"][1] if "valid_lm_loss" in r]
    assert valid == [2, 4]


def test_same_seed_same_curve_whatever_the_layout(runs):
    """Init and data order do not depend on the mesh: the curves agree to fp32 reordering noise."""
    a = [r["lm_loss"] for r in runs["dp8"][1] if "lm_loss" in r]
    b = [r["lm_loss"] for r in runs["dp2_tp4_sp"][1] if "lm_loss" in r]
    assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5, (a, b)


def test_nan_stops_training_naming_the_iteration(tmp_path, capsys):
    # An absurd learning rate overflows the parameters after the first update.
    with pytest.raises(TrainingStopped, match=r"iteration \d: loss .* is NaN/Inf; stopping"):
        run(tmp_path, "nan", ["--lr", "1e38", "--clip-grad", "0", "--weight-decay", "0"], iters=3)


def test_cli_exit_codes(tmp_path, capsys):
    assert main(["--num-layers", "0"]) == 2
    assert "error: --num-layers must be a positive number, got 0" in capsys.readouterr().err
