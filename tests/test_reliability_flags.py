"""Bad flag values end with one `error:` line naming the flag and what would be valid, exit 2,
before any compile (issue: reliability of the flags): sizes of 0 that were divisors, NaN and
infinities, Megatron's short forms and other trainers' names of flags, a broken --config YAML,
--mock-data with --data-path, odd values of a few more flags; and --fp16 with a static
--loss-scale that overflows every step (a skipped step each, then a named error).

Most cases call the command's `main(argv)` in this process (exit code and stderr; they fail
before any model is built); one subprocess checks the real exit path, one the fp16 run.
"""

import subprocess
import sys

import pytest

from mlm_jax.arguments import parse_args
from mlm_jax.errors import ConfigError
from mlm_jax.train import main
from mlm_jax.validation import finalize
from tests.test_reliability import T, assert_named_error, env
from tests.tiny_flags import TINY


def named_error(argv, tmp_path, capsys, *names) -> str:
    """`main(argv)` exits 2 with one `error:` line naming each of `names`; returns the line."""
    (tmp_path / "keep.txt").write_text("kept")
    rc = main([*TINY, *argv, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    line = assert_named_error(rc, err, 2, *names)
    assert "Check failure" not in err and not (tmp_path / "run").exists()
    return line


@pytest.mark.parametrize("argv, message", [
    (["--make-vocab-size-divisible-by", "0"], "--make-vocab-size-divisible-by must be a positive number, got 0"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be a positive number, got 0"),
    (["--pipeline-model-parallel-size", "0"], "--pipeline-model-parallel-size must be a positive number, got 0"),
    (["--context-parallel-size", "0"], "--context-parallel-size must be a positive number, got 0"),
    (["--global-batch-size", "0"], "--global-batch-size must be a positive number, got 0"),
    (["--global-batch-size", "-8"], "--global-batch-size must be a positive number, got -8"),
    (["--micro-batch-size", "0"], "--micro-batch-size must be a positive number, got 0"),
    (["--num-attention-heads", "0"], "--num-attention-heads must be a positive number, got 0"),
    (["--hidden-size", "0"], "--hidden-size must be a positive number, got 0"),
    (["--seq-length", "0"], "--seq-length must be a positive number, got 0"),
    (["--group-query-attention", "--num-query-groups", "0"], "--num-query-groups must be > 0, got 0"),
    (["--eval-interval", "0"], "--eval-interval must be a positive number, got 0"),
    (["--save-interval", "0"], "--save-interval must be a positive number, got 0"),
    (["--log-interval", "0"], "--log-interval must be a positive number, got 0"),
    (["--num-layers", "-1"], "--num-layers must be a positive number, got -1"),
    (["--num-experts", "-1"], "--num-experts must be a positive number, got -1 (leave it out for a dense model)"),
])
def test_zero_and_negative_sizes_name_the_flag(argv, message, tmp_path, capsys):
    assert message in named_error(argv, tmp_path, capsys, argv[-2])


def test_virtual_pipeline_layers_zero_names_the_flag():
    cfg = parse_args([*TINY, "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "0"])
    with pytest.raises(ConfigError, match=r"^--num-layers-per-virtual-pipeline-stage must be >= 1, got 0$"):
        finalize(cfg, 2)


@pytest.mark.parametrize("argv, message", [
    (["--lr", "inf"], "--lr must be a finite number >= 0, got inf"),
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--min-lr", "inf"], "--min-lr must be a finite number >= 0, got inf"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan"),
    (["--clip-grad", "inf"], "--clip-grad must be a finite number >= 0, got inf"),
    (["--adam-eps", "nan"], "--adam-eps must be a finite number > 0, got nan"),
    (["--init-method-std", "inf"], "--init-method-std must be a finite number >= 0, got inf"),
    (["--norm-epsilon", "nan"], "--norm-epsilon must be a finite number > 0, got nan"),
    (["--fp16", "--loss-scale", "inf"], "--loss-scale must be a finite positive number, got inf (leave it out"),
    (["--fp16", "--initial-loss-scale", "inf"], "--initial-loss-scale must be a finite number > 0, got inf"),
    (["--adam-beta2", "inf"], "--adam-beta2 inf must be in [0, 1)"),
    (["--hidden-dropout", "nan"], "--hidden-dropout must be in [0, 1), got nan"),
    # float flags that no other rule bounds
    (["--moe-aux-loss-coeff", "nan"], "--moe-aux-loss-coeff must be a finite number, got nan"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "nan"],
     "--moe-expert-capacity-factor must be a finite number, got nan"),
    (["--exit-duration-in-mins", "inf"], "--exit-duration-in-mins must be a finite number, got inf"),
    (["--peer-timeout", "nan"], "--peer-timeout must be a finite number > 0 (seconds), got nan"),
    (["--coordinator-timeout", "inf"], "--coordinator-timeout must be a finite number > 0 (seconds), got inf"),
    (["--slow-iteration-factor", "inf"], "--slow-iteration-factor must be a finite number, got inf"),
])
def test_nan_and_infinity_say_finite(argv, message, tmp_path, capsys):
    assert message in named_error(argv, tmp_path, capsys, argv[-2])


@pytest.mark.parametrize("alias, flag", [
    ("--tp", "--tensor-model-parallel-size"), ("--pp", "--pipeline-model-parallel-size"),
    ("--cp", "--context-parallel-size"), ("--ep", "--expert-model-parallel-size"),
    ("--vpp", "--num-virtual-stages-per-pipeline-rank"), ("--sp", "--sequence-parallel"),
    ("--mbs", "--micro-batch-size"), ("--batch-size", "--micro-batch-size"), ("--gbs", "--global-batch-size"),
    ("--lr-warmup", "--lr-warmup-iters"), ("--seq-len", "--seq-length"), ("--layers", "--num-layers"),
    ("--hidden", "--hidden-size"), ("--heads", "--num-attention-heads"), ("--steps", "--train-iters"),
    ("--max-steps", "--train-iters"), ("--iters", "--train-iters"), ("--learning-rate", "--lr"),
    ("--tensor", "--tensor-model-parallel-size"),  # a flag it begins
    ("--hidden-sze", "--hidden-size"), ("--num-layerz", "--num-layers"),  # near misses
])
def test_short_forms_and_aliases_suggest_the_real_flag(alias, flag):
    with pytest.raises(ConfigError) as e:
        parse_args([alias, "2"])
    assert str(e.value) == f"unknown flag {alias}; did you mean {flag}?"


@pytest.mark.parametrize("name, message", [
    ("--dp", "unknown flag --dp: the data-parallel size is no flag: it is derived, device count / "
             "(tensor x pipeline x context parallel sizes)"),
    ("--epochs", "unknown flag --epochs: epochs are not supported: give --train-iters or --train-samples"),
    ("--moe", "unknown flag --moe; did you mean one of --moe-layer-freq, --moe-router-topk, --moe-z-loss-coeff?"),
    ("--hlep", "unknown flag --hlep; did you mean --help?"),
    ("--frobnicate", "unknown flag --frobnicate (see --help for the flags)"),
])
def test_flags_that_are_no_flag_say_what_to_do(name, message):
    with pytest.raises(ConfigError) as e:
        parse_args([name, "2"])
    assert str(e.value) == message


def test_unknown_flag_exits_2_from_the_command(tmp_path):
    p = subprocess.run([sys.executable, "-m", "mlm_jax.train", "--tp", "2"], cwd=tmp_path, env=env(),
                       capture_output=True, text=True, timeout=120)
    out = p.stdout + p.stderr
    assert assert_named_error(p.returncode, out, 2) == "error: unknown flag --tp; did you mean --tensor-model-parallel-size?"
    assert out.strip().count("\n") == 0, out  # one line, no usage screen


@pytest.mark.parametrize("text, where", [
    ("num-layers: 2\nhidden-size: [64\nlr: 1e-3\n",
     "not valid YAML: line 3, column 3: expected ',' or ']', but got ':' (while parsing a flow sequence "
     "started at line 2, column 14)"),
    ("num-layers: 2\n hidden-size: 64\n", "not valid YAML: line 2, column 13: mapping values are not allowed here"),
    ('lr: "1e-3\n', "not valid YAML: line 2, column 1: found unexpected end of stream (while scanning a quoted "
                    "scalar started at line 1, column 5)"),
])
def test_broken_yaml_is_one_line_naming_file_line_and_column(text, where, tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    line = named_error(["--config", str(path)], tmp_path, capsys, str(path))
    assert line == f"error: --config {path}: {where}"


def test_binary_yaml_is_named(tmp_path, capsys):
    path = tmp_path / "weights.yaml"
    path.write_bytes(b"\xff\xfe\x00\x81" * 8)
    line = named_error(["--config", str(path)], tmp_path, capsys, str(path))
    assert line.endswith("not a text file (byte 0 is not utf-8); give a YAML file of flag: value")


@pytest.mark.parametrize("flag", ["--data-path", "--train-data-path"])
def test_mock_data_with_a_data_path_is_refused_naming_both(flag, tmp_path, capsys):
    line = named_error([flag, str(tmp_path / "nonexistent")], tmp_path, capsys)
    assert line == (f"error: --mock-data with {flag}: give one; --mock-data trains on synthetic tokens and would "
                    f"ignore {flag} (drop --mock-data to train on the data, or drop {flag})")


@pytest.mark.parametrize("argv, message", [
    (["--num-layers", "abc"], "argument --num-layers: invalid int value: 'abc'"),
    (["--seq-length", "1.5"], "argument --seq-length: invalid int value: '1.5'"),
    (["--split", "abc"], "--split 'abc': expected up to three comma-separated weights >= 0, e.g. 969,30,1"),
    (["--split", "nan,1"], "--split 'nan,1': expected up to three comma-separated weights >= 0"),
    (["--lr-decay-style", "foo"], "--lr-decay-style 'foo': choose one of constant, linear, cosine, WSD"),
    (["--tokenizer-type", "Foo"], "unknown --tokenizer-type 'Foo'; valid types: GPT2BPETokenizer,"),
])
def test_odd_values_name_the_flag(argv, message, tmp_path, capsys):
    assert message in named_error(argv, tmp_path, capsys)


@pytest.mark.parametrize("weights", [["nan", "a"], ["inf", "a"], ["-1", "a"]])
def test_odd_data_path_weights_are_named(weights, tmp_path, capsys):
    argv = [a for a in TINY if a != "--mock-data"] + ["--tokenizer-type", "NullTokenizer", "--data-path", *weights,
                                                      "--run-dir", str(tmp_path / "run")]
    rc = main(argv)
    err = capsys.readouterr().err
    line = assert_named_error(rc, err, 2, "data path weights", "must be finite, non-negative and not all zero")
    assert "ValueError" not in line


def test_static_loss_scale_that_overflows_skips_then_stops_naming_it(tmp_path):
    """--loss-scale 1e38 overflows every step (the fp32 loss x scale too): each step is skipped
    (logged as such, never a NaN stop), and after 3 in a row the run stops naming the flag."""
    p = subprocess.run([sys.executable, "-m", "mlm_jax.train", *T, "--fp16", "--loss-scale", "1e38",
                        "--train-iters", "10", "--log-interval", "1", "--run-dir", str(tmp_path / "run")],
                       cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    line = assert_named_error(p.returncode, out, 2, "--loss-scale 1e+38")
    assert line == ("error: --loss-scale 1e+38: the scaled gradients overflowed 3 steps in a row (iterations 1..3 "
                    "skipped); give a smaller --loss-scale, or leave it out for dynamic loss scaling")
    assert "NaN/Inf; stopping" not in out and "Check failure" not in out
    logged = [x for x in out.splitlines() if x.lstrip().startswith("iteration ")]
    assert len(logged) == 2 and all("number of skipped iterations:   1" in x for x in logged), logged
