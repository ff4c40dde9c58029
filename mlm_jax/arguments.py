"""Megatron-LM's flag names -> the typed config, in one table.

An unknown flag is an error naming it (argparse), a flag we accept but cannot serve yet is an
error from config validation naming it, and `--config FILE.yaml` supplies defaults (flag names
as keys) that flags on the command line override.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Sequence

import yaml

from mlm_jax.config import (CheckpointConfig, Config, ConfigError, DataConfig, DistributedConfig,
                            InstrumentsConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig)

SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "optim": OptimConfig,
            "data": DataConfig, "train": TrainConfig, "checkpoint": CheckpointConfig,
            "distributed": DistributedConfig, "instruments": InstrumentsConfig}

# kinds: int, float, str, list (one or more values), true (flag sets True), false (flag sets False)
# (flag, section, field, kind, help)
FLAGS: list[tuple[str, str, str, str, str]] = [
    # model
    ("--num-layers", "model", "num_layers", "int", "transformer layers"),
    ("--hidden-size", "model", "hidden_size", "int", "model width"),
    ("--ffn-hidden-size", "model", "ffn_hidden_size", "int", "MLP width (default 4h; SwiGLU: 8h/3 rounded to 64)"),
    ("--num-attention-heads", "model", "num_attention_heads", "int", "query heads"),
    ("--num-query-groups", "model", "num_query_groups", "int", "key/value groups (with --group-query-attention)"),
    ("--kv-channels", "model", "kv_channels", "int", "head dim (default hidden / heads)"),
    ("--vocab-size", "model", "vocab_size", "int", "vocab size (mock data, NullTokenizer)"),
    ("--make-vocab-size-divisible-by", "model", "make_vocab_size_divisible_by", "int", "pad vocab to a multiple of this x tensor-parallel size"),
    ("--max-position-embeddings", "model", "max_position_embeddings", "int", "learned positions table size"),
    ("--position-embedding-type", "model", "position_embedding_type", "str", "learned_absolute | rope"),
    ("--rotary-base", "model", "rotary_base", "float", "RoPE base"),
    ("--normalization", "model", "normalization", "str", "LayerNorm | RMSNorm"),
    ("--norm-epsilon", "model", "norm_epsilon", "float", "norm epsilon"),
    ("--swiglu", "model", "swiglu", "true", "SwiGLU MLP"),
    ("--openai-gelu", "model", "openai_gelu", "true", "tanh-approximated GELU"),
    ("--untie-embeddings-and-output-weights", "model", "untie_embeddings_and_output_weights", "true", "separate LM head"),
    ("--disable-bias-linear", "model", "add_bias_linear", "false", "no biases in linear layers"),
    ("--hidden-dropout", "model", "hidden_dropout", "float", "dropout on the residual stream"),
    ("--attention-dropout", "model", "attention_dropout", "float", "dropout on attention probabilities"),
    ("--init-method-std", "model", "init_method_std", "float", "init std (output layers / sqrt(2 L))"),
    ("--recompute-granularity", "model", "recompute_granularity", "str",
     "full | selective | dots (mlm_jax: keep matmul outputs, recompute the rest) | offload (mlm_jax: dots, kept on the host; GPU)"),
    ("--recompute-method", "model", "recompute_method", "str", "uniform | block (with full granularity)"),
    ("--recompute-num-layers", "model", "recompute_num_layers", "int", "uniform: layers per recomputed group; block: layers recomputed per stage"),
    ("--bf16", "model", "bf16", "true", "bf16 compute, fp32 master params and optimizer state"),
    ("--attention-backend", "model", "attention_backend", "str", "auto | flash | fused | unfused | local (flash/fused: cuDNN; unfused/local: XLA)"),
    # parallel
    ("--tensor-model-parallel-size", "parallel", "tensor_model_parallel_size", "int", "tensor parallel size"),
    ("--pipeline-model-parallel-size", "parallel", "pipeline_model_parallel_size", "int", "pipeline parallel size"),
    ("--context-parallel-size", "parallel", "context_parallel_size", "int", "context parallel size"),
    ("--expert-model-parallel-size", "parallel", "expert_model_parallel_size", "int", "expert parallel size"),
    ("--num-experts", "parallel", "num_experts", "int", "MoE experts"),
    ("--sequence-parallel", "parallel", "sequence_parallel", "true", "shard activations on seq over tensor"),
    ("--use-distributed-optimizer", "parallel", "use_distributed_optimizer", "true", "ZeRO-1: master params and Adam moments sharded over data"),
    ("--pipeline-schedule", "parallel", "pipeline_schedule", "str", "gpipe | 1f1b | interleaved"),
    ("--num-virtual-stages-per-pipeline-rank", "parallel", "virtual_pipeline_model_parallel_size", "int", "interleaved chunks per rank"),
    ("--num-layers-per-virtual-pipeline-stage", "parallel", "num_layers_per_virtual_pipeline_stage", "int", "layers per interleaved chunk"),
    ("--decoder-first-pipeline-num-layers", "parallel", "decoder_first_pipeline_num_layers", "int", "layers on the first stage"),
    ("--decoder-last-pipeline-num-layers", "parallel", "decoder_last_pipeline_num_layers", "int", "layers on the last stage"),
    # optimizer
    ("--lr", "optim", "lr", "float", "peak learning rate"),
    ("--min-lr", "optim", "min_lr", "float", "final learning rate"),
    ("--lr-decay-style", "optim", "lr_decay_style", "str", "constant | linear | cosine | WSD"),
    ("--lr-warmup-iters", "optim", "lr_warmup_iters", "int", "linear warmup iterations"),
    ("--lr-decay-iters", "optim", "lr_decay_iters", "int", "decay length (default --train-iters)"),
    ("--lr-wsd-decay-iters", "optim", "lr_wsd_decay_iters", "int", "WSD: final anneal length"),
    ("--lr-wsd-decay-style", "optim", "lr_wsd_decay_style", "str", "WSD anneal: linear | cosine | exponential"),
    ("--weight-decay", "optim", "weight_decay", "float", "AdamW decay (not on biases and norms)"),
    ("--clip-grad", "optim", "clip_grad", "float", "global gradient-norm clip (0: off)"),
    ("--adam-beta1", "optim", "adam_beta1", "float", "Adam beta1"),
    ("--adam-beta2", "optim", "adam_beta2", "float", "Adam beta2"),
    ("--adam-eps", "optim", "adam_eps", "float", "Adam epsilon"),
    # data
    ("--data-path", "data", "data_path", "list", "[weight] prefix ... of .bin/.idx datasets"),
    ("--train-data-path", "data", "train_data_path", "list", "training datasets"),
    ("--valid-data-path", "data", "valid_data_path", "list", "validation datasets"),
    ("--test-data-path", "data", "test_data_path", "list", "test datasets"),
    ("--split", "data", "split", "str", "train,valid,test proportions of --data-path"),
    ("--data-cache-path", "data", "data_cache_path", "str", "where sample indices are cached"),
    ("--mock-data", "data", "mock_data", "true", "deterministic synthetic documents"),
    ("--tokenizer-type", "data", "tokenizer_type", "str", "GPT2BPETokenizer | SentencePieceTokenizer | GPTSentencePieceTokenizer | HuggingFaceTokenizer | NullTokenizer"),
    ("--tokenizer-model", "data", "tokenizer_model", "str", "SentencePiece model or Hugging Face tokenizer path"),
    ("--vocab-file", "data", "vocab_file", "str", "GPT-2 vocab.json"),
    ("--merge-file", "data", "merge_file", "str", "GPT-2 merges.txt"),
    ("--eod-mask-loss", "data", "eod_mask_loss", "true", "no loss on end-of-document tokens"),
    ("--reset-position-ids", "data", "reset_position_ids", "true", "positions restart after each EOD"),
    ("--reset-attention-mask", "data", "reset_attention_mask", "true", "attend within documents only"),
    # training
    ("--micro-batch-size", "train", "micro_batch_size", "int", "samples per data-parallel rank per microbatch"),
    ("--global-batch-size", "train", "global_batch_size", "int", "samples per step (gradient accumulation)"),
    ("--seq-length", "train", "seq_length", "int", "tokens per sample"),
    ("--train-iters", "train", "train_iters", "int", "optimizer steps"),
    ("--seed", "train", "seed", "int", "seed of init, dropout and data order"),
    ("--log-interval", "train", "log_interval", "int", "iterations between log lines"),
    ("--eval-interval", "train", "eval_interval", "int", "iterations between evaluations"),
    ("--eval-iters", "train", "eval_iters", "int", "batches per evaluation"),
    ("--no-check-for-nan-in-loss-and-grad", "train", "check_for_nan_in_loss_and_grad", "false", "do not stop on NaN/Inf"),
    ("--tensorboard-dir", "train", "tensorboard_dir", "str", "TensorBoard event files"),
    ("--metrics-file", "train", "metrics_file", "str", "JSON lines, one per logged iteration"),
    ("--run-dir", "train", "run_dir", "str", "(mlm_jax) run folder; default runs/<time>"),
    ("--peak-flops-per-device", "train", "peak_flops", "float", "(mlm_jax) MFU denominator; default: measured matmul peak"),
    ("--no-progress-bar", "train", "progress_bar", "false", "(mlm_jax) no progress bar"),
    ("--sample-tokens", "train", "sample_tokens", "int", "(mlm_jax) greedy sample length at the end"),
    # checkpoints and exits (mlm_jax/checkpoint.py)
    ("--save", "checkpoint", "save", "str", "checkpoint folder to save to (default: <run dir>/checkpoints, at the end)"),
    ("--load", "checkpoint", "load", "str", "resume from the latest complete checkpoint of this folder"),
    ("--save-interval", "checkpoint", "save_interval", "int", "iterations between checkpoints"),
    ("--keep-last-checkpoints", "checkpoint", "keep_last", "int", "(mlm_jax) keep only the newest N checkpoints of --save"),
    ("--async-save", "checkpoint", "async_save", "true", "write checkpoints in the background (the default here)"),
    ("--no-async-save", "checkpoint", "async_save", "false", "(mlm_jax) block training until each checkpoint is written"),
    ("--no-save-optim", "checkpoint", "save_optim", "false", "do not save the optimizer state"),
    ("--no-save-rng", "checkpoint", "save_rng", "false", "do not save the RNG state"),
    ("--no-final-checkpoint", "checkpoint", "final_checkpoint", "false", "(mlm_jax) no checkpoint when training ends"),
    ("--no-load-optim", "checkpoint", "load_optim", "false", "fresh optimizer state (and LR schedule) on --load"),
    ("--no-load-rng", "checkpoint", "load_rng", "false", "dropout RNG from --seed, not the checkpoint"),
    ("--finetune", "checkpoint", "finetune", "true", "load weights only; start at iteration 0"),
    ("--exit-on-missing-checkpoint", "checkpoint", "exit_on_missing_checkpoint", "true", "error if --load has no checkpoint"),
    ("--ckpt-step", "checkpoint", "ckpt_step", "int", "load this iteration's checkpoint, not the latest"),
    ("--use-checkpoint-args", "checkpoint", "use_checkpoint_args", "true", "model sizes (and tokenizer) from the --load checkpoint"),
    ("--exit-signal-handler", "checkpoint", "exit_signal_handler", "true", "on SIGTERM save a checkpoint and exit 0"),
    ("--exit-interval", "checkpoint", "exit_interval", "int", "save and exit when iteration % N == 0"),
    ("--exit-duration-in-mins", "checkpoint", "exit_duration_in_mins", "float", "save and exit after this many minutes"),
    # multi-host (mlm_jax/distributed.py); unset: MLM_JAX_* environment variables, then SLURM
    ("--coordinator-address", "distributed", "coordinator_address", "str", "(mlm_jax) HOST:PORT of process 0's jax.distributed coordinator (env MLM_JAX_COORDINATOR_ADDRESS)"),
    ("--num-processes", "distributed", "num_processes", "int", "(mlm_jax) processes in the job, one per host or per GPU (env MLM_JAX_NUM_PROCESSES)"),
    ("--process-id", "distributed", "process_id", "int", "(mlm_jax) this process's index; 0 runs the coordinator (env MLM_JAX_PROCESS_ID)"),
    ("--coordinator-timeout", "distributed", "coordinator_timeout", "float", "(mlm_jax) seconds to reach the coordinator and for every process to join (env MLM_JAX_COORDINATOR_TIMEOUT; default 300)"),
    ("--peer-timeout", "distributed", "peer_timeout", "float", "(mlm_jax) seconds without a heartbeat from another process before every process stops, naming it (env MLM_JAX_PEER_TIMEOUT; default 20)"),
    # instruments (mlm_jax/instruments.py)
    ("--profile", "instruments", "profile", "true", "jax.profiler trace of iterations start+1..end (process 0) into <run dir>/profile"),
    ("--profile-step-start", "instruments", "profile_step_start", "int", "start the trace after this many iterations"),
    ("--profile-step-end", "instruments", "profile_step_end", "int", "stop the trace after this iteration"),
    ("--wandb-project", "instruments", "wandb_project", "str", "also log to Weights & Biases (needs `pip install wandb`)"),
    ("--wandb-exp-name", "instruments", "wandb_exp_name", "str", "Weights & Biases run name"),
    ("--wandb-save-dir", "instruments", "wandb_save_dir", "str", "Weights & Biases local folder"),
    ("--slow-iteration-factor", "instruments", "slow_iteration_factor", "float", "(mlm_jax) warn when an iteration takes this many times the running median (0: never; default 3)"),
]

# Accepted with exactly one meaning; anything else is refused with the reason.
REFUSED = {
    "--fp16": "fp16 is not supported: use --bf16 (bf16 compute with fp32 master params needs no loss scaling)",
}


def _add(parser: argparse.ArgumentParser, flag: str, kind: str, help_text: str) -> None:
    dest = flag[2:].replace("-", "_")
    help_text = help_text.replace("%", "%%")  # argparse formats help strings with %
    if kind in ("true", "false"):
        parser.add_argument(flag, dest=dest, action="store_true", default=None, help=help_text)
    elif kind == "list":
        parser.add_argument(flag, dest=dest, nargs="+", default=None, help=help_text)
    else:
        typ = {"int": int, "float": float, "str": str}[kind]
        parser.add_argument(flag, dest=dest, type=typ, default=None, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mlm_jax.train", allow_abbrev=False,
        description="Train a GPT/Llama model with Megatron-LM's flags. No flags: the default run.",
    )
    parser.add_argument("--config", default=None, help="YAML file of flag: value (flags override it)")
    parser.add_argument("--group-query-attention", action="store_true", default=None,
                        help="grouped-query attention with --num-query-groups")
    for flag, _, _, kind, help_text in FLAGS:
        _add(parser, flag, kind, help_text)
    for flag, why in REFUSED.items():
        parser.add_argument(flag, dest=flag[2:].replace("-", "_"), action="store_true",
                            default=None, help=f"refused: {why}")
    return parser


def _yaml_values(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: not valid YAML ({e})") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag: value, got {type(raw).__name__}")
    known = {a.dest: a for a in parser._actions if a.option_strings}
    values = {}
    for key, value in raw.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in known or dest == "config":
            raise ConfigError(f"--config {path}: unknown key {key!r} (keys are flag names, e.g. num-layers)")
        action = known[dest]
        if action.nargs == 0:  # a switch: only true/false make sense
            if not isinstance(value, bool):
                raise ConfigError(f"--config {path}: {key} is a switch; give true or false, got {value!r}")
            value = True if value else None
        elif action.nargs == "+":
            value = [str(v) for v in (value if isinstance(value, list) else str(value).split())]
        elif value is not None and action.type is not None:
            try:
                value = action.type(value)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"--config {path}: {key}: {value!r} is not a valid {action.type.__name__}") from e
        values[dest] = value
    return values


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Flags (and --config YAML) -> Config. Raises ConfigError or exits 2 on a bad flag."""
    parser = build_parser()
    first = parser.parse_args(argv)
    if first.config:
        parser.set_defaults(**_yaml_values(first.config, parser))
    args = vars(parser.parse_args(argv))
    for flag, why in REFUSED.items():
        if args.get(flag[2:].replace("-", "_")):
            raise ConfigError(f"{flag}: {why}")

    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for flag, section, field, kind, _ in FLAGS:
        value = args[flag[2:].replace("-", "_")]
        if value is None:
            continue
        if kind == "false":
            value = False
        elif kind == "list":
            value = tuple(value)
        sections[section][field] = value
    if sections["model"].get("num_query_groups") is not None and not args["group_query_attention"]:
        raise ConfigError("--num-query-groups needs --group-query-attention (as in Megatron-LM)")
    if args["group_query_attention"] and sections["model"].get("num_query_groups") is None:
        raise ConfigError("--group-query-attention needs --num-query-groups N")
    _check_choices(sections)
    return Config(**{name: dataclasses.replace(cls(), **sections[name]) for name, cls in SECTIONS.items()})


_CHOICES = {
    ("model", "position_embedding_type"): ("learned_absolute", "rope"),
    ("model", "normalization"): ("LayerNorm", "RMSNorm"),
    ("model", "recompute_granularity"): ("full", "selective", "dots", "offload"),
    ("model", "recompute_method"): ("uniform", "block"),
    ("parallel", "pipeline_schedule"): ("gpipe", "1f1b", "interleaved"),
    ("optim", "lr_decay_style"): ("constant", "linear", "cosine", "WSD"),
    ("optim", "lr_wsd_decay_style"): ("linear", "cosine", "exponential"),
}


def _check_choices(sections: dict[str, dict[str, Any]]) -> None:
    flag_of = {(s, f): flag for flag, s, f, _, _ in FLAGS}
    for (section, field), choices in _CHOICES.items():
        value = sections[section].get(field)
        if value is not None and value not in choices:
            raise ConfigError(f"{flag_of[(section, field)]} {value!r}: choose one of {', '.join(choices)}")
