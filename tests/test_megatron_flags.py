"""Megatron flags that are irrelevant on XLA (accepted, mapped as their help says), fp8
(refused by name), and --eval-iters 0 (no validation, as in Megatron-LM)."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from mlm_jax.arguments import ACCEPTED, REFUSED, parse_args
from mlm_jax.config import ConfigError
from mlm_jax.distributed import resolve
from mlm_jax.validation import finalize
from tests.tiny_flags import xla_flags_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Flags with no effect at all: the config must be exactly the one without them.
NO_EFFECT = [
    ["--distributed-backend", "nccl"], ["--distributed-backend", "gloo"],
    ["--use-mcore-models"], ["--transformer-impl", "local"], ["--transformer-impl", "transformer_engine"],
    ["--no-masked-softmax-fusion"], ["--attention-softmax-in-fp32"], ["--cross-entropy-loss-fusion"],
    ["--no-create-attention-mask-in-dataloader"], ["--log-throughput"], ["--calculate-per-token-loss"],
    ["--ckpt-format", "torch_dist"], ["--ckpt-format", "zarr"], ["--ckpt-format", "torch"],
    ["--ckpt-format", "fsdp_dtensor"], ["--ckpt-format", "torch_dcp"], ["--manual-gc"],
    ["--num-workers", "8"], ["--no-mmap-bin-files"], ["--empty-unused-memory-level", "0"],
    ["--empty-unused-memory-level", "2"], ["--fp8-interval", "1"], ["--keep-fp8-transpose-cache"],
    ["--moe-router-dtype", "fp32"], ["--cache-mla-latents"],
    # Megatron's DeepSeek-V3 script's
    ["--use-flash-attn"], ["--manual-gc-interval", "10"],
    ["--moe-flex-dispatcher-backend", "hybridep"], ["--moe-permute-fusion"], ["--auto-detect-ckpt-format"],
    ["--dist-ckpt-strictness", "log_all"], ["--log-timers-to-tensorboard"], ["--log-memory-to-tensorboard"],
    ["--log-validation-ppl-to-tensorboard"], ["--log-num-zeros-in-grad"], ["--log-params-norm"],
    ["--logging-level", "40"], ["--enable-experimental"], ["--no-gradient-accumulation-fusion"],
    ["--init-model-with-meta-device"], ["--fsdp-double-buffer"], ["--use-nccl-ub"],
    ["--megatron-fsdp-grad-comm-dtype", "fp32"], ["--megatron-fsdp-main-grads-dtype", "bf16"],
]

# Megatron's fp8/fp4 flags not built here: each refused in one line naming it, with the reason.
FP8_REFUSED = [["--tp-only-amax-red"], ["--fp8-dot-product-attention"],
               ["--fp8-multi-head-attention"], ["--fp8-output-proj"], ["--fp4-format", "e2m1"],
               ["--fp4-recipe", "nvfp4"], ["--fp4-param-gather"], ["--te-precision-config-file", "p.yaml"],
               ["--fp8-quantizer-factory", "a.b"], ["--fp4-quantizer-factory", "a.b"]]



@pytest.mark.parametrize("flag", NO_EFFECT, ids=lambda f: " ".join(f))
def test_accepted_flag_changes_nothing(flag):
    assert parse_args(flag) == parse_args([])


def test_every_accepted_flag_is_tested_and_in_help(capsys):
    tested = {f[0] for f in NO_EFFECT} | {"--distributed-timeout-minutes", "--use-rotary-position-embeddings",
                                          "--no-position-embedding"}
    # FSDP's (tests/test_fsdp.py: their mapping and refusals)
    tested |= {"--torch-fsdp2-no-reshard-after-forward", "--outer-dp-sharding-strategy"}
    tested |= {"--megatron-fsdp-grad-comm-dtype"}  # bf16: test_megatrons_deepseek_script_flags_that_carry_a_meaning
    tested |= {"--recompute-modules"}  # applied: tests/test_mla.py, tests/test_perf.py, test_megatron_examples.py
    assert tested == {flag for flag, _, _ in ACCEPTED}
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert all(flag in out for flag, _, _ in ACCEPTED) and "--fp8-format" in out


def test_overlap_param_gather_needs_the_distributed_optimizer():
    with pytest.raises(ConfigError) as e:
        parse_args(["--overlap-param-gather", "--overlap-grad-reduce"])
    assert str(e.value) == "--overlap-param-gather needs --use-distributed-optimizer (as in Megatron-LM)"
    cfg = parse_args(["--overlap-param-gather", "--overlap-grad-reduce", "--use-distributed-optimizer"])
    assert cfg.parallel.overlap_param_gather and cfg.parallel.overlap_grad_reduce  # XLA flags: xla_flags.py
    cleared = dataclasses.replace(cfg.parallel, overlap_param_gather=False, overlap_grad_reduce=False)
    assert cfg.replace(parallel=cleared) == parse_args(["--use-distributed-optimizer"])


def test_distributed_timeout_minutes_is_the_coordinator_timeout():
    cfg = parse_args(["--distributed-timeout-minutes", "3"])
    assert cfg.distributed.coordinator_timeout == 180.0
    assert resolve(cfg.distributed, env={}).timeout == 180.0
    given = parse_args(["--distributed-timeout-minutes", "3", "--coordinator-timeout", "45"])
    assert resolve(given.distributed, env={}).timeout == 45.0
    with pytest.raises(ConfigError, match="--distributed-timeout-minutes must be a positive number, got 0"):
        parse_args(["--distributed-timeout-minutes", "0"])


def test_rotary_flags():
    rope = parse_args(["--position-embedding-type", "rope"])
    assert parse_args(["--use-rotary-position-embeddings"]) == rope
    assert parse_args(["--use-rotary-position-embeddings", "--no-position-embedding"]) == rope
    assert parse_args(["--position-embedding-type", "rope", "--no-position-embedding"]) == rope
    with pytest.raises(ConfigError, match="--no-position-embedding needs rope positions"):
        parse_args(["--no-position-embedding"])
    with pytest.raises(ConfigError, match="--use-rotary-position-embeddings contradicts --position-embedding-type"
                                          " learned_absolute"):
        parse_args(["--use-rotary-position-embeddings", "--position-embedding-type", "learned_absolute"])
    assert parse_args(["--rotary-percent", "1.0"]) == parse_args([])
    # partial rotary is implemented (tests/test_megatron_flags_model.py)
    assert parse_args(["--position-embedding-type", "rope", "--rotary-percent", "0.5"]).model.rotary_percent == 0.5


@pytest.mark.parametrize("argv, message", [
    (["--distributed-backend", "mpi"], "--distributed-backend 'mpi': choose one of nccl, gloo"),
    (["--transformer-impl", "te"], "--transformer-impl 'te': choose one of local, transformer_engine"),
    (["--ckpt-format", "hdf5"], "--ckpt-format 'hdf5': choose one of torch_dist, zarr, torch, fsdp_dtensor, torch_dcp"),
    (["--empty-unused-memory-level", "3"], "--empty-unused-memory-level 3: choose one of 0, 1, 2"),
    (["--num-workers", "-1"], "--num-workers must be 0 or more, got -1"),
])
def test_bad_values_of_accepted_flags(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert str(e.value) == message


@pytest.mark.parametrize("flag", FP8_REFUSED, ids=lambda f: f[0])
def test_fp8_flags_not_built_are_refused_by_name(flag):
    with pytest.raises(ConfigError) as e:
        parse_args(["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"] + flag)
    assert str(e.value) == f"{flag[0]}: {REFUSED[flag[0]]}"
    assert set(REFUSED) == {f[0] for f in FP8_REFUSED} | {"--moe-router-force-load-balancing"}


def test_megatrons_deepseek_script_flags_that_carry_a_meaning():
    """--megatron-fsdp-grad-comm-dtype bf16 is --grad-reduce-in-bf16; --moe-token-dispatcher-type flex
    (DeepEP / HybridEP) runs the all-to-all dispatch; random routing for benchmarks is refused; a
    recompute module Megatron does not know is refused naming it."""
    assert parse_args(["--megatron-fsdp-grad-comm-dtype", "bf16"]).parallel.grad_reduce_in_bf16
    assert parse_args(["--moe-token-dispatcher-type", "flex"]).model.moe_token_dispatcher_type == "alltoall"
    with pytest.raises(ConfigError, match="--moe-router-force-load-balancing: random routing logits for benchmarks"):
        parse_args(["--moe-router-force-load-balancing"])
    with pytest.raises(ConfigError, match="--recompute-modules 'attn': choose from core_attn, moe_act"):
        parse_args(["--recompute-modules", "attn"])
    with pytest.raises(ConfigError, match="--megatron-fsdp-grad-comm-dtype 'fp16': choose one of bf16, fp32"):
        parse_args(["--megatron-fsdp-grad-comm-dtype", "fp16"])


def test_the_router_dtype_fp64_is_refused():
    with pytest.raises(ConfigError, match="--moe-router-dtype fp64: not built"):
        parse_args(["--moe-router-dtype", "fp64"])


@pytest.mark.parametrize("recipe,why", [
    ("blockwise", "--fp8-recipe blockwise: blockwise scaling is not built; use --fp8-recipe tensorwise"),
    ("mxfp8", "--fp8-recipe mxfp8: MXFP8 GEMMs need Blackwell GPUs"),
    ("custom", "--fp8-recipe custom: a Transformer Engine quantizer factory: not built"),
    ("rowwise", "--fp8-recipe 'rowwise': choose delayed or tensorwise"),
])
def test_fp8_recipes_not_built_are_refused(recipe, why):
    with pytest.raises(ConfigError) as e:
        parse_args(["--bf16", "--fp8-format", "hybrid"] + ([] if recipe is None else ["--fp8-recipe", recipe]))
    assert str(e.value).startswith(why), str(e.value)


@pytest.mark.parametrize("argv,message", [
    (["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
     "--fp8-format needs --bf16 (fp8 projections, bf16 everywhere else, as in Megatron-LM)"),
    (["--bf16", "--fp8-format", "e5m2", "--fp8-recipe", "tensorwise"], "--fp8-format 'e5m2': choose one of e4m3, hybrid"),
    (["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-margin", "-1"],
     "--fp8-margin must be 0 or more, got -1"),
    (["--bf16", "--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--num-layers-at-end-in-bf16", "-2"],
     "--num-layers-at-end-in-bf16 must be 0 or more, got -2"),
    (["--bf16", "--fp8-param-gather"], "--fp8-param-gather needs --fp8-format (the weights it gathers in fp8 feed fp8 products)"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-param-gather"],
     "--fp8-param-gather needs --use-distributed-optimizer (its parameter all-gather is what goes fp8; as in Megatron-LM)"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-amax-compute-algo", "mean"],
     "--fp8-amax-compute-algo 'mean': choose one of most_recent, max"),
    (["--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "0"], "--fp8-amax-history-len must be 1 or more, got 0"),
])
def test_bad_fp8_flags(argv, message):
    with pytest.raises(ConfigError) as e:
        parse_args(argv)
    assert str(e.value) == message


def test_fp8_flags_map_to_the_model():
    cfg = parse_args(["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-margin", "1",
                      "--no-fp8-wgrad", "--first-last-layers-bf16", "--num-layers-at-end-in-bf16", "2",
                      "--fp8-interval", "1"])
    m = cfg.model
    assert (m.fp8_format, m.fp8_recipe, m.fp8_margin, m.fp8_wgrad) == ("hybrid", "tensorwise", 1, False)
    assert (m.first_last_layers_bf16, m.num_layers_at_start_in_bf16, m.num_layers_at_end_in_bf16) == (True, 1, 2)
    # Megatron's default recipe, delayed, with its history flags.
    m = parse_args(["--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
                    "--fp8-amax-compute-algo", "max"]).model
    assert (m.fp8_recipe, m.fp8_amax_history_len, m.fp8_amax_compute_algo) == ("delayed", 1024, "max")
    # A recipe without a format is no fp8 (as in Megatron-LM); so is a plain run.
    assert parse_args(["--fp8-recipe", "tensorwise", "--fp8-amax-history-len", "8"]).model == parse_args([]).model
    assert parse_args([]).model.fp8_format is None


def test_eval_iters_must_not_be_negative():
    with pytest.raises(ConfigError, match=r"--eval-iters must be 0 \(no validation\) or more, got -1"):
        finalize(parse_args(["--eval-iters", "-1"]), 8)
    assert finalize(parse_args(["--eval-iters", "0"]), 8).train.eval_iters == 0


def cli(args, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("MLM_JAX_DEBUG", "XLA_FLAGS")}
    env.update(PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", MLM_JAX_CPU_DEVICES="1",
               XLA_FLAGS=xla_flags_for(1), MLM_JAX_CACHE=str(tmp_path / "cache"))
    return subprocess.run([sys.executable, "-m", "mlm_jax.train", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)


def test_fp8_flag_not_built_through_the_command_line(tmp_path):
    p = cli(["--mock-data", "--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
             "--fp8-recipe", "mxfp8"], tmp_path)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last == "error: --fp8-recipe mxfp8: MXFP8 GEMMs need Blackwell GPUs; use --fp8-recipe tensorwise on H100/H200", p.stderr
    assert not (tmp_path / "runs").exists()


def test_eval_iters_0_runs_without_validation(tmp_path):
    """Megatron's --eval-iters 0: no evaluation at all (not at the start, interval or end), with
    Megatron's other accepted flags on the same command line."""
    run_dir = tmp_path / "run"
    p = cli(["--mock-data", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2",
             "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "128",
             "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--log-interval", "1",
             "--eval-interval", "1", "--eval-iters", "0", "--no-progress-bar", "--sample-tokens", "0",
             "--no-final-checkpoint", "--run-dir", str(run_dir), "--overlap-grad-reduce", "--use-mcore-models",
             "--transformer-impl", "transformer_engine", "--ckpt-format", "torch_dist", "--log-throughput",
             "--distributed-timeout-minutes", "10"], tmp_path)
    assert p.returncode == 0, p.stderr
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["iteration"] for r in records if "lm_loss" in r] == [1, 2]
    assert not [r for r in records if "valid_lm_loss" in r], records
    out = p.stdout + p.stderr
    assert "validation loss" not in out and "> done: no validation;" in out, out


def test_megatron_defaults_for_what_a_script_leaves_out():
    """A run with data (a Megatron script) gets Megatron-LM's defaults; the no-flag default run
    on the embedded corpus keeps its own schedule and intervals, each overridable by its flag."""
    megatron = parse_args(["--mock-data"])
    assert (megatron.optim.min_lr, megatron.optim.lr_decay_style) == (0.0, "linear")
    assert (megatron.train.log_interval, megatron.train.eval_interval, megatron.train.eval_iters) == (100, 1000, 100)
    assert not megatron.train.eval_at_start
    assert (megatron.optim.adam_beta2, megatron.optim.weight_decay, megatron.model.hidden_dropout) == (0.999, 0.01, 0.1)
    default = parse_args([])
    assert (default.optim.min_lr, default.optim.lr_decay_style) == (1e-4, "cosine")
    assert (default.train.log_interval, default.train.eval_interval, default.train.eval_iters) == (10, 100, 10)
    assert default.train.eval_at_start
    tweaked = parse_args(["--log-interval", "5", "--min-lr", "0"])
    assert (tweaked.train.log_interval, tweaked.optim.min_lr, tweaked.train.eval_interval) == (5, 0.0, 100)


def test_vocab_and_merge_files_name_gpt2_bpe():
    """Megatron's GPT scripts give --vocab-file and --merge-file without --tokenizer-type: that
    pair is GPT-2's BPE; an explicit type wins."""
    assert parse_args(["--vocab-file", "v.json", "--merge-file", "m.txt"]).data.tokenizer_type == "GPT2BPETokenizer"
    given = parse_args(["--vocab-file", "v.json", "--merge-file", "m.txt", "--tokenizer-type", "HuggingFaceTokenizer"])
    assert given.data.tokenizer_type == "HuggingFaceTokenizer"
    assert parse_args(["--vocab-file", "v.json"]).data.tokenizer_type is None
