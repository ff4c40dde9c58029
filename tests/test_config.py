"""Flag parsing and config validation: every refusal names the values and the rule."""

import pytest

from mlm_jax.arguments import FLAGS, parse_args
from mlm_jax.config import ConfigError, padded_vocab_size
from mlm_jax.validation import finalize


def config_error(argv, world=8) -> str:
    with pytest.raises(ConfigError) as e:
        finalize(parse_args(argv), world)
    return str(e.value)


def test_megatron_flags_map_onto_the_config():
    cfg = parse_args([
        "--num-layers", "6", "--hidden-size", "96", "--num-attention-heads", "6",
        "--group-query-attention", "--num-query-groups", "2", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--rotary-base", "500000", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--tensor-model-parallel-size", "2",
        "--sequence-parallel", "--use-distributed-optimizer", "--lr", "3e-4", "--min-lr", "3e-5",
        "--lr-decay-style", "WSD", "--micro-batch-size", "2", "--global-batch-size", "32",
        "--data-path", "0.3", "a", "0.7", "b", "--no-check-for-nan-in-loss-and-grad", "--bf16",
        "--recompute-granularity", "selective",
    ])
    m, p, o, d, t = cfg.model, cfg.parallel, cfg.optim, cfg.data, cfg.train
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups) == (6, 96, 6, 2)
    assert m.swiglu and m.normalization == "RMSNorm" and m.position_embedding_type == "rope"
    assert m.rotary_base == 500000.0 and not m.add_bias_linear and m.untie_embeddings_and_output_weights
    assert m.bf16 and m.recompute_granularity == "selective"
    assert p.tensor_model_parallel_size == 2 and p.sequence_parallel and p.use_distributed_optimizer
    assert (o.lr, o.min_lr, o.lr_decay_style) == (3e-4, 3e-5, "WSD")
    assert (t.micro_batch_size, t.global_batch_size) == (2, 32)
    assert d.data_path == ("0.3", "a", "0.7", "b")
    assert t.check_for_nan_in_loss_and_grad is False


def test_every_flag_in_the_table_parses():
    for flag, _, _, kind, _ in FLAGS:
        argv = [flag] if kind in ("true", "false") else [flag, {"int": "2", "float": "0.5", "list": "x", "pattern": "2"}.get(kind, "")]
        if kind == "str":
            continue  # choices are checked separately
        if flag == "--num-query-groups":
            argv.append("--group-query-attention")
        if flag in ("--overlap-param-gather", "--num-distributed-optimizer-instances"):  # Megatron's rule: only
            # with the distributed optimizer
            argv.append("--use-distributed-optimizer")
        if flag == "--fp8-param-gather":  # with fp8 and the distributed optimizer (as in Megatron-LM)
            argv += ["--bf16", "--fp8-format", "hybrid", "--use-distributed-optimizer"]
        if kind == "int3":  # --rampup-batch-size START INCR SAMPLES
            argv = [flag, "8", "8", "32"]
        parse_args(argv)


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag, *_ in FLAGS)


def test_unknown_flag_is_an_error_naming_it(capsys):
    # One line naming the flag and the closest known one, no usage screen (exit 2 via mlm_jax.cli).
    with pytest.raises(ConfigError) as e:
        parse_args(["--num-layerz", "4"])
    assert str(e.value) == "unknown flag --num-layerz; did you mean --num-layers?"
    assert capsys.readouterr().err == ""


def test_fp16_parses_and_excludes_bf16():
    assert parse_args(["--fp16"]).model.fp16  # mlm_jax/loss_scale.py; the rest in tests/test_fp16.py
    with pytest.raises(ConfigError, match="^--fp16 and --bf16 exclude each other"):
        finalize(parse_args(["--fp16", "--bf16"]), 8)


def test_bad_choice_names_flag_and_choices():
    with pytest.raises(ConfigError, match="--normalization 'BatchNorm': choose one of LayerNorm, RMSNorm"):
        parse_args(["--normalization", "BatchNorm"])


@pytest.mark.parametrize("argv, message", [
    (["--num-attention-heads", "6", "--hidden-size", "96", "--tensor-model-parallel-size", "4"],
     "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
    (["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"],
     "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    (["--group-query-attention", "--num-query-groups", "3"],
     "--num-attention-heads 4 is not divisible by --num-query-groups 3"),
    (["--micro-batch-size", "2", "--global-batch-size", "20"],
     "--global-batch-size 20 is not divisible by --micro-batch-size 2 x data-parallel size 8 = 16"),
    (["--tensor-model-parallel-size", "3"],
     "device count 8 is not divisible by tensor (3) x pipeline (1) x context (1) = 3"),
    (["--hidden-size", "100", "--num-attention-heads", "3"],
     "--hidden-size 100 is not divisible by --num-attention-heads 3"),
    (["--seq-length", "512", "--max-position-embeddings", "256"],
     "--seq-length 512 exceeds --max-position-embeddings 256"),
    (["--num-layers", "0"], "--num-layers must be a positive number, got 0"),
    (["--context-parallel-size", "2", "--seq-length", "30"],
     "--seq-length 30 is not divisible by 2 x --context-parallel-size 2 = 4"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--num-attention-heads", "3", "--hidden-size", "60"],
     "--cp-comm-type a2a needs --num-attention-heads 3 divisible by --context-parallel-size 2"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 needs --num-experts"),
    (["--num-experts", "8", "--moe-router-topk", "9"], "--moe-router-topk 9 must be between 1 and --num-experts 8"),
    (["--hidden-dropout", "1.5"], "--hidden-dropout must be in [0, 1), got 1.5"),
    (["--lr", "1e-4", "--min-lr", "1e-3"], "need 0 <= --min-lr (0.001) <= --lr (0.0001)"),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "127",
      "--max-position-embeddings", "128"],
     "--sequence-parallel needs --seq-length 127 divisible by --tensor-model-parallel-size 2"),
])
def test_validation_errors_name_values_and_rule(argv, message):
    assert message in config_error(argv)


def test_query_groups_need_the_gqa_switch():
    with pytest.raises(ConfigError, match="--num-query-groups needs --group-query-attention"):
        parse_args(["--num-query-groups", "2"])


def test_yaml_config_with_flags_overriding(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("num-layers: 6\nhidden_size: 96\nswiglu: true\ndata-path: [0.5, a, 0.5, b]\nlr: 2e-4\n")
    cfg = parse_args(["--config", str(path), "--num-layers", "8"])
    assert cfg.model.num_layers == 8  # the flag wins
    assert cfg.model.hidden_size == 96 and cfg.model.swiglu and cfg.optim.lr == 2e-4
    assert cfg.data.data_path == ("0.5", "a", "0.5", "b")


@pytest.mark.parametrize("text, message", [
    ("num-layerz: 4\n", "unknown key 'num-layerz'"),
    ("num-layers: four\n", "num-layers: 'four' is not a valid int"),
    ("swiglu: 3\n", "swiglu is a switch; give true or false"),
    ("- a\n- b\n", "expected a mapping of flag: value"),
    ("num-layers: 2.5\n", "num-layers: 2.5 is not an integer"),  # never rounded to 2
    ("num-layers: true\n", "num-layers takes one value, got True"),
    ("hidden-size:\n", "hidden-size has no value"),  # never silently the default
    ("lr: [1, 2]\n", "lr takes one value"),
    ("data-path: [a, null]\n", "data-path needs one or more plain values"),
    ("lr: fast\n", "lr: 'fast' is not a valid float"),
])
def test_bad_yaml_is_named(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        parse_args(["--config", str(path)])
    assert str(path) in str(e.value) and message in str(e.value)


def test_missing_yaml_is_named():
    with pytest.raises(ConfigError, match="--config /no/such.yaml: no such file"):
        parse_args(["--config", "/no/such.yaml"])


def test_vocab_is_padded_like_megatron():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 8) == 51200
    cfg = finalize(parse_args(["--vocab-size", "500", "--tensor-model-parallel-size", "8",
                                "--num-attention-heads", "8"]), 8)
    assert cfg.model.padded_vocab_size == 1024


def test_negative_numbers_are_values_and_refused_by_rule():
    # argparse alone reads `-1e-3` as a flag ("expected one argument"); here it is --lr's value.
    cfg = parse_args(["--lr", "-1e-3", "--min-lr", "-1e-5"])
    assert cfg.optim.lr == -1e-3 and cfg.optim.min_lr == -1e-5
    assert config_error(["--lr", "-1e-3"]) == "--lr must be >= 0, got -0.001"
    assert parse_args(["--seed", "-3"]).train.seed == -3
    assert parse_args(["--data-path", "x", "--split", "-5,3,2"]).data.split == "-5,3,2"


@pytest.mark.parametrize("argv, message", [
    (["--min-lr", "-1e-5"], "--min-lr must be >= 0, got -1e-05"),
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--lr", "inf", "--min-lr", "0"], "--lr must be a finite number >= 0, got inf"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
    (["--clip-grad", "-1"], "--clip-grad must be >= 0, got -1.0"),
    (["--adam-eps", "0"], "--adam-eps must be > 0, got 0.0"),
    (["--adam-beta1", "nan"], "--adam-beta1 nan and --adam-beta2 0.999 must be in [0, 1)"),
    (["--norm-epsilon", "-1e-5"], "--norm-epsilon must be > 0, got -1e-05"),
    (["--init-method-std", "-0.02"], "--init-method-std must be >= 0, got -0.02"),
    (["--rotary-base", "0"], "--rotary-base must be > 0, got 0.0"),
    (["--lr-decay-iters", "-5"], "--lr-decay-iters must be > 0, got -5"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--seed", str(2**32)], "--seed must be below 2**32"),
    (["--sample-tokens", "-1"], "--sample-tokens must be >= 0, got -1"),
    (["--peak-flops-per-device", "0"], "--peak-flops-per-device must be > 0, got 0.0"),
    (["--kv-channels", "-8"], "--kv-channels must be > 0, got -8"),
    (["--hidden-dropout", "-0.1"], "--hidden-dropout must be in [0, 1), got -0.1"),
    (["--split", "90,x"], "--split '90,x': expected up to three comma-separated weights >= 0"),
    (["--split", "1,2,3,4"], "--split '1,2,3,4'"),
])
def test_numeric_flags_are_refused_with_their_rule(argv, message):
    assert message in config_error(argv)


@pytest.mark.parametrize("argv, message", [
    (["--num-layers", "2.5"], "argument --num-layers: invalid int value: '2.5'"),
    (["--lr"], "argument --lr: expected one argument"),
    (["--save-intervall", "5"], "unknown flag --save-intervall; did you mean --save-interval?"),
    (["--frobnicate"], "unknown flag --frobnicate (see --help for the flags)"),
    (["--num-layers", "2", "3"], "unexpected value '3': every value follows its flag (see --help)"),
    (["--num-layer", "2"], "unknown flag --num-layer; did you mean --num-layers?"),  # no abbreviations
])
def test_flag_errors_are_one_line_naming_the_flag(argv, message, capsys):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert str(e.value) == message
    assert capsys.readouterr().err == ""  # no usage screen


def test_yaml_takes_megatrons_accepted_and_refused_flags(tmp_path):
    """The flags mlm_jax accepts for Megatron's scripts map the same from --config YAML."""
    path = tmp_path / "megatron.yaml"
    path.write_text("overlap-grad-reduce: true\ndistributed-timeout-minutes: 2\n"
                    "use-rotary-position-embeddings: true\nckpt-format: torch_dist\n")
    cfg = parse_args(["--config", str(path)])
    assert cfg.distributed.coordinator_timeout == 120.0 and cfg.model.position_embedding_type == "rope"
    path.write_text("fp8-format: hybrid\nfp8-recipe: tensorwise\n")
    with pytest.raises(ConfigError, match=r"^--fp8-format needs --bf16"):
        parse_args(["--config", str(path)])
    path.write_text("fp8-param-gather: true\n")
    with pytest.raises(ConfigError, match="^--fp8-param-gather needs --fp8-format"):
        parse_args(["--config", str(path)])
