"""Megatron-LM's flag names -> the typed config, in one table.

An unknown flag is an error naming it (and what it likely meant: mlm_jax/flag_aliases.py), a
bad value one line naming the flag (`ArgumentParser`, which every mlm_jax command uses), a flag
we accept but cannot serve yet an error from config validation naming it, and `--config
FILE.yaml` supplies defaults (flag names as keys, values typed exactly as on the command line)
that flags on the command line override.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os
import sys
from typing import Any, NoReturn, Sequence

import yaml

from mlm_jax.config import (FP8_FORMATS, FP8_RECIPES, RECOMPUTE_MODULES, SHARDING_STRATEGIES, CheckpointConfig, Config, ConfigError, DataConfig, DistributedConfig,
                            InstrumentsConfig, ModelConfig, OptimConfig, ParallelConfig, TrainConfig)
from mlm_jax.flag_aliases import unknown_flag

SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "optim": OptimConfig,
            "data": DataConfig, "train": TrainConfig, "checkpoint": CheckpointConfig,
            "distributed": DistributedConfig, "instruments": InstrumentsConfig}

# kinds: int, float, str, list (one or more values), true (flag sets True), false (flag sets False),
# int3 (three integers), words (one or more values joined by spaces into one string)
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
    ("--fp16", "model", "fp16", "true", "fp16 compute, fp32 master params and optimizer state, loss scaling (dynamic unless --loss-scale)"),
    # fp8 (mlm_jax/models/fp8.py, docs/guides/fp8.md)
    ("--fp8-format", "model", "fp8_format", "str", "e4m3 | hybrid: the layers' projections (QKV, attention output, MLP) multiply fp8 operands, e4m3 (hybrid: gradients e5m2), and so do the MoE experts; needs --bf16"),
    ("--fp8-recipe", "model", "fp8_recipe", "str", "delayed (scales from an amax history of earlier steps) | tensorwise (per-tensor current scaling: each tensor's amax in this step); blockwise | mxfp8 | custom are refused"),
    ("--fp8-margin", "model", "fp8_margin", "int", "fp8 scales keep 2^margin headroom below the format's largest value (default 0)"),
    ("--fp8-amax-history-len", "model", "fp8_amax_history_len", "int", "delayed scaling: steps of amax history kept per tensor (default 1)"),
    ("--fp8-amax-compute-algo", "model", "fp8_amax_compute_algo", "str", "delayed scaling: the history's most_recent entry or its max scales a tensor"),
    ("--fp8-param-gather", "model", "fp8_param_gather", "true", "with --fp8-format and --use-distributed-optimizer: ZeRO's all-gather sends the projections' weights in fp8 (e4m3, one scale per weight), half its bf16 bytes"),
    ("--no-fp8-wgrad", "model", "fp8_wgrad", "false", "with --fp8-format: the weight gradients' products in bf16 (the input gradients stay fp8)"),
    ("--first-last-layers-bf16", "model", "first_last_layers_bf16", "true", "with --fp8-format: the first and last layers' projections stay bf16"),
    ("--num-layers-at-start-in-bf16", "model", "num_layers_at_start_in_bf16", "int", "with --first-last-layers-bf16: layers at the start kept in bf16 (default 1)"),
    ("--num-layers-at-end-in-bf16", "model", "num_layers_at_end_in_bf16", "int", "with --first-last-layers-bf16: layers at the end kept in bf16 (default 1)"),
    # multi-latent attention (DeepSeek-V3; mlm_jax/models/mla.py)
    ("--multi-latent-attention", "model", "multi_latent_attention", "true", "multi-latent attention (DeepSeek-V2/V3): keys and values from a per-token latent"),
    ("--q-lora-rank", "model", "q_lora_rank", "int", "with --multi-latent-attention: the queries' latent rank (default none: queries projected directly)"),
    ("--kv-lora-rank", "model", "kv_lora_rank", "int", "with --multi-latent-attention: the keys' and values' latent rank (default 32)"),
    ("--qk-head-dim", "model", "qk_head_dim", "int", "with --multi-latent-attention: a head's query/key channels without position (default 128)"),
    ("--qk-pos-emb-head-dim", "model", "qk_pos_emb_head_dim", "int", "with --multi-latent-attention: a head's query/key channels with rope (default 64)"),
    ("--v-head-dim", "model", "v_head_dim", "int", "with --multi-latent-attention: a head's value channels (default 128)"),
    ("--qk-layernorm", "model", "qk_layernorm", "true", "with --multi-latent-attention: norms (--normalization) on the query and key/value latents"),
    ("--rope-type", "model", "rope_type", "str", "rope | yarn: multi-latent attention's rope (default yarn, as Megatron's)"),
    ("--rotary-scaling-factor", "model", "rotary_scaling_factor", "float", "YaRN's context extension factor (multi-latent attention; default 1: plain rope)"),
    ("--mscale", "model", "mscale", "float", "YaRN's magnitude scale of the rope part (multi-latent attention; default 1.0)"),
    ("--mscale-all-dim", "model", "mscale_all_dim", "float", "YaRN's magnitude scale of the whole head, squared into the scores' scale (multi-latent attention; default 0.0)"),
    ("--mtp-num-layers", "model", "mtp_num_layers", "int", "multi-token prediction depths (DeepSeek-V3: 1): each predicts one token further ahead with a layer of its own, the embedding and LM head shared"),
    ("--mtp-loss-scaling-factor", "model", "mtp_loss_scaling_factor", "float", "the MTP losses' weight: this / --mtp-num-layers per depth (default 0.1)"),
    ("--attention-backend", "model", "attention_backend", "str", "auto | flash | fused | unfused | local (flash/fused: cuDNN; unfused/local: XLA)"),
    # Megatron's norm, rope, LR, gradient-reduction and XLA-overlap flags
    ("--apply-layernorm-1p", "model", "apply_layernorm_1p", "true", "norm weights stored as w-1 (init 0) and applied as 1+w (LayerNorm and RMSNorm; no weight decay on them)"),
    ("--rotary-percent", "model", "rotary_percent", "float", "rope on the first rotary-percent x head-dim channels of each head, the rest unrotated (default 1.0)"),
    ("--use-rope-scaling", "model", "use_rope_scaling", "true", "Llama 3.1 rope frequency scaling (low/high freq factors 1 and 4, original max positions 8192, as in Megatron-LM)"),
    ("--rope-scaling-factor", "model", "rope_scaling_factor", "float", "the Llama 3.1 rope scaling factor (default 8.0)"),
    ("--decoupled-lr", "optim", "decoupled_lr", "float", "peak LR of the input embedding and output layer (same schedule; others use --lr)"),
    ("--decoupled-min-lr", "optim", "decoupled_min_lr", "float", "final LR of the input embedding and output layer (with --decoupled-lr; default --min-lr)"),
    ("--grad-reduce-in-bf16", "parallel", "grad_reduce_in_bf16", "true", "data-parallel gradient all-reduce / reduce-scatter in bf16 (where gradients are reduced once per step; see docs/parallelism/data.md)"),
    ("--overlap-grad-reduce", "parallel", "overlap_grad_reduce", "true", "reduce each layer's data-parallel gradient inside the last microbatch's backward, overlapping the rest of it (not with pipeline or expert parallelism or mixed dense/MoE layers: reduced once after the backward there); GPU: XLA's latency-hiding scheduler and pipelined all-reduce / reduce-scatter too (see docs/parallelism/data.md)"),
    ("--overlap-param-gather", "parallel", "overlap_param_gather", "true", "GPU: XLA's latency-hiding scheduler and async all-gather (needs --use-distributed-optimizer, as in Megatron-LM)"),
    # parallel
    ("--tensor-model-parallel-size", "parallel", "tensor_model_parallel_size", "int", "tensor parallel size"),
    ("--pipeline-model-parallel-size", "parallel", "pipeline_model_parallel_size", "int", "pipeline parallel size"),
    ("--context-parallel-size", "parallel", "context_parallel_size", "int", "context parallel size: the sequence split over `context` (load-balanced chunks)"),
    ("--cp-comm-type", "parallel", "cp_comm_type", "str", "context-parallel attention: p2p (ring) | allgather | a2a (Ulysses)"),
    # mixture of experts (mlm_jax/models/moe.py)
    ("--num-experts", "model", "num_experts", "int", "MoE experts per MoE layer"),
    ("--moe-router-topk", "model", "moe_router_topk", "int", "experts per token"),
    ("--moe-ffn-hidden-size", "model", "moe_ffn_hidden_size", "int", "each expert's hidden size (default --ffn-hidden-size)"),
    ("--moe-layer-freq", "model", "moe_layer_freq", "pattern", "N: MoE every Nth layer; or a list such as ([0]*1+[1]*3)"),
    ("--moe-router-load-balancing-type", "model", "moe_router_load_balancing_type", "str", "aux_loss | seq_aux_loss | none"),
    ("--moe-aux-loss-coeff", "model", "moe_aux_loss_coeff", "float", "load-balancing loss coefficient"),
    ("--moe-z-loss-coeff", "model", "moe_z_loss_coeff", "float", "router z-loss coefficient"),
    ("--moe-router-pre-softmax", "model", "moe_router_pre_softmax", "true", "softmax over all experts before top-k"),
    ("--moe-router-score-function", "model", "moe_router_score_function", "str", "softmax | sigmoid"),
    ("--moe-router-num-groups", "model", "moe_router_num_groups", "int", "group-limited routing (DeepSeek): the experts in this many equal groups; with --moe-router-group-topk"),
    ("--moe-router-group-topk", "model", "moe_router_group_topk", "int", "group-limited routing: a token's top-k experts are taken within its best this-many groups (a group scored by the sum of its top k/group-topk experts' scores)"),
    ("--moe-router-topk-scaling-factor", "model", "moe_router_topk_scaling_factor", "float", "the routing weights times this factor (DeepSeek-V3: 2.5)"),
    ("--moe-router-enable-expert-bias", "model", "moe_router_enable_expert_bias", "true", "aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the sigmoid scores for the top-k choice only, moved by --moe-router-bias-update-rate after each step towards the mean load of the step's tokens over every rank"),
    ("--moe-router-bias-update-rate", "model", "moe_router_bias_update_rate", "float", "the expert bias's step: bias += rate x sign(mean load - the expert's load) (default 1e-3)"),
    ("--moe-expert-capacity-factor", "model", "moe_expert_capacity_factor", "float", "capacity per expert (default: dropless)"),
    ("--moe-token-drop-policy", "model", "moe_token_drop_policy", "str", "probs | position: which tokens over capacity drop"),
    ("--moe-pad-expert-input-to-capacity", "model", "moe_pad_expert_input_to_capacity", "true", "every expert computes exactly its capacity"),
    ("--moe-shared-expert-intermediate-size", "model", "moe_shared_expert_intermediate_size", "int", "shared expert's hidden size (default: none)"),
    ("--moe-token-dispatcher-type", "model", "moe_token_dispatcher_type", "str", "alltoall | allgather (flex: alltoall)"),
    ("--moe-receive-buffer-factor", "model", "moe_receive_buffer_factor", "float", "(mlm_jax) with --expert-model-parallel-size > 1 and the alltoall dispatcher: the rows a rank's receive buffer holds, as a multiple of the rows it sends (tokens x top-k; 1.0 is a perfectly balanced load); rows beyond it are dropped, the busiest experts' first, and counted in the dropped tokens (default: the worst case, expert-parallel size x the rows sent: never drops)"),
    ("--moe-grouped-gemm", "model", "moe_grouped_gemm", "true", "the experts as one grouped-GEMM kernel (Pallas/Triton) on NVIDIA GPUs; on by default here, XLA's ragged_dot elsewhere"),
    ("--expert-model-parallel-size", "parallel", "expert_model_parallel_size", "int", "expert parallel size (carved out of data parallel)"),
    ("--expert-tensor-parallel-size", "parallel", "expert_tensor_parallel_size", "int", "tensor parallel size of the experts (default and only value: --tensor-model-parallel-size)"),
    ("--sequence-parallel", "parallel", "sequence_parallel", "true", "shard activations on seq over tensor"),
    ("--use-distributed-optimizer", "parallel", "use_distributed_optimizer", "true", "ZeRO-1: master params and Adam moments sharded over data"),
    ("--use-megatron-fsdp", "parallel", "use_megatron_fsdp", "true", "sharded data parallelism (Megatron-FSDP): what --data-parallel-sharding-strategy says is split over data (see docs/parallelism/data.md)"),
    ("--data-parallel-sharding-strategy", "parallel", "data_parallel_sharding_strategy", "str", "with --use-megatron-fsdp: no_shard | optim (ZeRO-1) | optim_grads (ZeRO-2: gradients reduce-scattered each microbatch, held split) | optim_grads_params (default; ZeRO-3: parameters held split too, gathered one layer at a time in the forward and again in the backward)"),
    ("--num-distributed-optimizer-instances", "parallel", "num_distributed_optimizer_instances", "int", "hybrid sharding: the data-parallel ranks in N groups (instances) of dp/N neighbouring ranks; the distributed optimizer (and FSDP) splits the state within an instance and each instance holds a copy; gradients reduce-scatter within, all-reduce across (default 1)"),
    ("--use-torch-fsdp2", "parallel", "use_torch_fsdp2", "true", "= --use-megatron-fsdp (one FSDP here; with --torch-fsdp2-no-reshard-after-forward: optim_grads)"),
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
    # sample-based schedule (with --train-samples; mlm_jax/batch_schedule.py, mlm_jax/optim.py)
    ("--lr-warmup-samples", "optim", "lr_warmup_samples", "int", "linear warmup samples"),
    ("--lr-decay-samples", "optim", "lr_decay_samples", "int", "decay length in samples (default --train-samples)"),
    ("--lr-wsd-decay-samples", "optim", "lr_wsd_decay_samples", "int", "WSD: final anneal length in samples"),
    ("--lr-warmup-fraction", "optim", "lr_warmup_fraction", "float", "warmup = this fraction of the decay length (instead of --lr-warmup-iters/-samples)"),
    ("--lr-warmup-init", "optim", "lr_warmup_init", "float", "learning rate at the start of the warmup (default 0)"),
    ("--weight-decay", "optim", "weight_decay", "float", "AdamW decay (not on biases and norms)"),
    ("--clip-grad", "optim", "clip_grad", "float", "global gradient-norm clip (0: off)"),
    ("--adam-beta1", "optim", "adam_beta1", "float", "Adam beta1"),
    ("--adam-beta2", "optim", "adam_beta2", "float", "Adam beta2"),
    ("--adam-eps", "optim", "adam_eps", "float", "Adam epsilon"),
    ("--loss-scale", "optim", "loss_scale", "float", "static loss scale (default: dynamic under --fp16); an overflow skips the step, 3 in a row stop the run"),
    ("--initial-loss-scale", "optim", "initial_loss_scale", "float", "dynamic loss scaling: the starting scale (2**32)"),
    ("--min-loss-scale", "optim", "min_loss_scale", "float", "dynamic loss scaling: the scale never halves below this (1.0)"),
    ("--loss-scale-window", "optim", "loss_scale_window", "int", "dynamic loss scaling: clean steps before the scale doubles (1000)"),
    ("--hysteresis", "optim", "hysteresis", "int", "dynamic loss scaling: overflows (since the scale last grew) before it halves (2)"),
    # data
    ("--data-path", "data", "data_path", "list", "[weight] prefix ... of .bin/.idx datasets"),
    ("--train-data-path", "data", "train_data_path", "list", "training datasets"),
    ("--valid-data-path", "data", "valid_data_path", "list", "validation datasets"),
    ("--test-data-path", "data", "test_data_path", "list", "test datasets"),
    ("--split", "data", "split", "str", "train,valid,test proportions of --data-path"),
    ("--data-cache-path", "data", "data_cache_path", "str", "where sample indices are cached"),
    ("--mock-data", "data", "mock_data", "true", "deterministic synthetic documents"),
    ("--tokenizer-type", "data", "tokenizer_type", "str", "GPT2BPETokenizer | SentencePieceTokenizer | GPTSentencePieceTokenizer | Llama2Tokenizer | Llama3Tokenizer | TikTokenizer | HuggingFaceTokenizer | NullTokenizer"),
    ("--tokenizer-model", "data", "tokenizer_model", "str", "SentencePiece model, Llama-3 tokenizer.model, TikTokenizer JSON or Hugging Face tokenizer path"),
    ("--tiktoken-pattern", "data", "tiktoken_pattern", "str", "TikTokenizer split pattern: v1 | v2 (default v2)"),
    ("--tiktoken-num-special-tokens", "data", "tiktoken_num_special_tokens", "int", "TikTokenizer: ids reserved for special tokens before the ranks (default 1000)"),
    ("--tokenizer-special-tokens", "data", "tokenizer_special_tokens", "list", "TikTokenizer's named special tokens (must include <unk> <s> </s> <mask> <pad> <cls> <sep>)"),
    ("--tiktoken-special-tokens", "data", "tokenizer_special_tokens", "list", "Megatron's deprecated name of --tokenizer-special-tokens"),
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
    ("--train-samples", "train", "train_samples", "int", "samples to train on (sample-based training: the iterations follow from the batch schedule)"),
    ("--rampup-batch-size", "train", "rampup_batch_size", "int3", "START INCR SAMPLES: grow the global batch from START by INCR up to --global-batch-size over SAMPLES samples (needs --train-samples)"),
    ("--step-batch-size-schedule", "train", "step_batch_size_schedule", "words", "\"TOKENS:BATCH ...\" (suffixes K M B T): the global batch from each token count on; first threshold 0; not with --global-batch-size"),
    ("--seed", "train", "seed", "int", "seed of init, dropout and data order"),
    ("--log-interval", "train", "log_interval", "int", "iterations between log lines"),
    ("--eval-interval", "train", "eval_interval", "int", "iterations between evaluations"),
    ("--eval-iters", "train", "eval_iters", "int", "batches per evaluation (0: no validation, as in Megatron-LM)"),
    ("--eval-at-start", "train", "eval_at_start", "true", "(mlm_jax) one validation pass before the first step (the default run does; Megatron-LM does not)"),
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

# Megatron flags that are irrelevant on XLA or already how mlm_jax works: accepted so that
# Megatron's scripts run unchanged, each help text saying what it maps to. None has a config
# field; `_map_accepted` applies the few that carry a value or a rule. (flag, kind, help)
ACCEPTED: list[tuple[str, str, str]] = [
    ("--distributed-backend", "str", "nccl | gloo; accepted, no effect: XLA picks the collectives"),
    ("--distributed-timeout-minutes", "int", "the jax.distributed coordinator timeout: --coordinator-timeout = minutes x 60 (unless --coordinator-timeout is given)"),
    ("--use-mcore-models", "true", "accepted, no effect: mlm_jax has one model implementation"),
    ("--transformer-impl", "str", "local | transformer_engine; accepted, no effect: XLA compiles the layers (--attention-backend picks the attention kernel)"),
    ("--no-masked-softmax-fusion", "true", "accepted, no effect: XLA fuses (or not) the masked softmax"),
    ("--attention-softmax-in-fp32", "true", "always: the attention softmax runs in fp32"),
    ("--cross-entropy-loss-fusion", "true", "accepted, no effect: XLA fuses the cross entropy (computed in fp32)"),
    ("--no-create-attention-mask-in-dataloader", "true", "always: the causal mask is built in the model, never by the data loader"),
    ("--log-throughput", "true", "always: tokens/s, step time and MFU are logged"),
    ("--calculate-per-token-loss", "true", "always: the loss is the sum over every unmasked token of the global batch divided by their count, whatever the microbatch and data-parallel split"),
    ("--ckpt-format", "str", "torch_dist | zarr | torch | fsdp_dtensor | torch_dcp; accepted: checkpoints are written with Orbax (layout-free)"),
    ("--manual-gc", "true", "accepted, no effect: Python's garbage collector is left automatic"),
    ("--num-workers", "int", "accepted, no effect: mlm_jax's loader builds batches ahead in a background thread"),
    ("--no-mmap-bin-files", "true", "accepted, no effect: .bin files are always memory-mapped"),
    ("--empty-unused-memory-level", "int", "0 | 1 | 2; accepted, no effect: XLA manages device memory"),
    ("--use-rotary-position-embeddings", "true", "= --position-embedding-type rope"),
    ("--no-position-embedding", "true", "no learned position table: accepted with rope positions, refused with learned_absolute"),
    ("--fp8-interval", "int", "accepted, no effect (deprecated in Transformer Engine 1.8: scales are computed every step)"),
    ("--torch-fsdp2-no-reshard-after-forward", "true", "with --use-torch-fsdp2: the parameters stay gathered (= --data-parallel-sharding-strategy optim_grads)"),
    ("--outer-dp-sharding-strategy", "str", "hybrid sharding's outer group (--num-distributed-optimizer-instances > 1): no_shard (each instance holds the whole sharded state; optim, the state split over the instances too, is not built)"),
    ("--keep-fp8-transpose-cache", "true", "accepted, no effect: XLA lays out the fp8 operands of each product"),
    ("--moe-router-dtype", "str", "fp32: accepted, no effect (the router computes in fp32); fp64 is refused"),
    ("--cache-mla-latents", "true", "accepted, no effect: decoding a multi-latent attention model always caches its latents"),
    # Megatron's DeepSeek-V3 script's (examples/megatron_fsdp/sbatch_mfsdp_deepseek_v3.sh)
    ("--use-flash-attn", "true", "accepted: cuDNN's fused (flash) attention runs where it applies, as --attention-backend auto (the default) decides"),
    ("--manual-gc-interval", "int", "accepted, no effect: Python's garbage collector is left automatic"),
    ("--recompute-modules", "list", "core_attn | moe_act | layernorm | mla_up_proj | mlp | moe | shared_experts, with --recompute-granularity selective: those modules' values are recomputed in the backward, not kept (core_attn: always, the fused attention keeps none)"),
    ("--moe-flex-dispatcher-backend", "str", "deepep | hybridep; accepted, no effect: the expert dispatch is XLA's all-to-all (--moe-token-dispatcher-type flex runs alltoall)"),
    ("--moe-permute-fusion", "true", "accepted, no effect: XLA fuses the tokens' permutation"),
    ("--auto-detect-ckpt-format", "true", "always: --load reads an mlm_jax, Megatron torch_dist or torch checkpoint by what it finds"),
    ("--dist-ckpt-strictness", "str", "accepted: a restore always checks every key and shape and refuses a mismatch (stricter than log_all)"),
    ("--log-timers-to-tensorboard", "true", "always: the step time and data wait go to TensorBoard with the other metrics"),
    ("--log-memory-to-tensorboard", "true", "always: device memory goes to TensorBoard with the other metrics"),
    ("--log-validation-ppl-to-tensorboard", "true", "always: the validation loss and perplexity go to TensorBoard"),
    ("--log-num-zeros-in-grad", "true", "accepted, not logged: the gradient's zero count is not computed"),
    ("--log-params-norm", "true", "accepted, not logged: the parameters' norm is not computed"),
    ("--logging-level", "int", "accepted, no effect: the console shows the progress lines at any level"),
    ("--enable-experimental", "true", "accepted, no effect: nothing here is behind Megatron's experimental switch"),
    ("--no-gradient-accumulation-fusion", "true", "accepted, no effect: XLA fuses the weight gradients' accumulation"),
    ("--init-model-with-meta-device", "true", "accepted, no effect: each device initialises only its own shard of the parameters"),
    ("--fsdp-double-buffer", "true", "accepted, no effect: XLA schedules FSDP's gather buffers"),
    ("--use-nccl-ub", "true", "accepted, no effect: NCCL user buffers are XLA's choice"),
    ("--megatron-fsdp-grad-comm-dtype", "str", "bf16 | fp32: the gradients' reduce-scatter dtype; bf16 = --grad-reduce-in-bf16"),
    ("--megatron-fsdp-main-grads-dtype", "str", "bf16 | fp32; accepted: the main gradients are kept in fp32 (bf16 would round them)"),
]

_ACCEPTED_CHOICES = {
    "--distributed-backend": ("nccl", "gloo"),
    "--transformer-impl": ("local", "transformer_engine"),
    "--ckpt-format": ("torch_dist", "zarr", "torch", "fsdp_dtensor", "torch_dcp"),
    "--empty-unused-memory-level": (0, 1, 2),
    "--moe-router-dtype": ("fp32", "fp64"),
    "--moe-flex-dispatcher-backend": ("deepep", "hybridep"),
    "--dist-ckpt-strictness": ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
                               "return_unexpected", "return_all", "ignore_all"),
    "--megatron-fsdp-grad-comm-dtype": ("bf16", "fp32"),
    "--megatron-fsdp-main-grads-dtype": ("bf16", "fp32"),
}

_FP4 = "fp4 (NVFP4) GEMMs need Blackwell GPUs; mlm_jax trains on H100/H200 in bf16 or fp8 (--fp8-format)"
_FP8_ATTENTION = "the attention runs in bf16 (cuDNN's fp8 attention is not built); --fp8-format covers the projections"
# Refused flags that take a value (the others are switches).
_REFUSED_WITH_VALUE = ("--fp4-format", "--fp4-recipe", "--te-precision-config-file", "--fp8-quantizer-factory",
                       "--fp4-quantizer-factory")

# Megatron flags refused with the reason (nothing else takes them).
REFUSED = {
    "--tp-only-amax-red": "fp8 amaxes are reduced over every rank holding a piece of the tensor (data, tensor, "
                          "context parallel), so every layout quantizes as one device does",
    "--fp8-dot-product-attention": _FP8_ATTENTION,
    "--fp8-multi-head-attention": _FP8_ATTENTION,
    "--fp8-output-proj": "an mxfp8 option (Blackwell); the LM head stays bf16",
    "--fp4-format": _FP4, "--fp4-recipe": _FP4, "--fp4-param-gather": _FP4,
    "--fp4-quantizer-factory": _FP4,
    "--te-precision-config-file": "Transformer Engine's per-module precision file: not built (fp8 is set for "
                                  "all projections by --fp8-format, with --first-last-layers-bf16)",
    "--fp8-quantizer-factory": "a Python quantizer of Transformer Engine (--fp8-recipe custom): not built",
    "--moe-router-force-load-balancing": "random routing logits for benchmarks are not built (the routing is learned); "
                                         "leave it out",
}

# Megatron's fp8 recipes not built here, and why (--fp8-recipe; Megatron's default is delayed).
_FP8_RECIPES_REFUSED = {
    "blockwise": "blockwise scaling is not built; use --fp8-recipe tensorwise",
    "mxfp8": "MXFP8 GEMMs need Blackwell GPUs; use --fp8-recipe tensorwise on H100/H200",
    "custom": "a Transformer Engine quantizer factory: not built; use --fp8-recipe tensorwise",
}


# The no-flag default run (a tiny GPT on the embedded corpus, minutes on a laptop) keeps its own
# schedule and intervals; every other run gets Megatron-LM's defaults for what its flags leave out
# (the config dataclasses). Applied to a run on the embedded corpus (no --data-path,
# --train-data-path or --mock-data), for the fields its flags do not set.
DEFAULT_RUN: dict[str, dict[str, Any]] = {
    "optim": {"min_lr": 1e-4, "lr_decay_style": "cosine"},
    "train": {"log_interval": 10, "eval_interval": 100, "eval_iters": 10, "eval_at_start": True},
}


def _infer_tokenizer(sections: dict[str, dict[str, Any]]) -> None:
    """Megatron's GPT example scripts give --vocab-file and --merge-file but no --tokenizer-type
    (Megatron itself then stops: its default is None). Only GPT-2's byte-level BPE takes a merge
    file, so that pair names it: GPT2BPETokenizer (a deliberate difference: docs/megatron/differences.md)."""
    data = sections["data"]
    if data.get("tokenizer_type") is None and data.get("vocab_file") and data.get("merge_file"):
        data["tokenizer_type"] = "GPT2BPETokenizer"


def _apply_default_run(sections: dict[str, dict[str, Any]]) -> None:
    data = sections["data"]
    if data.get("data_path") or data.get("train_data_path") or data.get("mock_data"):
        return
    for section, values in DEFAULT_RUN.items():
        for field, value in values.items():
            sections[section].setdefault(field, value)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _looks_negative(text: str) -> bool:
    """`-1e-3`, `-inf`, `-5,3,2`: a value that starts with a minus sign, never a flag (`--x`, `-h`)."""
    return text.startswith("-") and (_is_number(text) or text[1:2].isdigit() or text[1:2] == ".")


class ArgumentParser(argparse.ArgumentParser):
    """argparse for every mlm_jax command: a bad flag or value is ONE line naming the flag (and
    the closest known flag for a typo), raised as `ConfigError` (exit 2 under `mlm_jax.cli`)
    instead of a usage screen; a negative number after a flag is its value (`--lr -1e-3`),
    where plain argparse takes `-1e-3` for a flag; no abbreviated flags. `--help` is unchanged."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)  # a typo is an error, not a guessed flag
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)

    def _value_flags(self) -> set[str]:
        return {o for a in self._actions if a.nargs is None for o in a.option_strings}

    def _join_negative_values(self, args: Sequence[str]) -> list[str]:
        """`--lr -1e-3` -> `--lr=-1e-3` for flags taking one value (before any `--`): argparse
        would read a value that starts with '-' as a flag unless it matches its plain-number
        pattern, which has no exponents."""
        flags, out, i = self._value_flags(), [], 0
        args = list(args)
        while i < len(args):
            if args[i] == "--":
                return out + args[i:]
            if args[i] in flags and i + 1 < len(args) and _looks_negative(args[i + 1]):
                out.append(f"{args[i]}={args[i + 1]}")
                i += 2
                continue
            out.append(args[i])
            i += 1
        return out

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else args
        return super().parse_known_args(self._join_negative_values(args), namespace)

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self._describe_extra(extras))
        return parsed

    def _describe_extra(self, extras: list[str]) -> str:
        flag = next((e for e in extras if e.startswith("-") and not _is_number(e)), None)
        if flag is None:
            return f"unexpected value {extras[0]!r}: every value follows its flag (see --help)"
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        return unknown_flag(flag.split("=", 1)[0], known)


def _pattern_value(node):
    """A list expression of 0/1 built with [...], + and * (Megatron evaluates it as Python)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.List):
        return [_pattern_value(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
        left, right = _pattern_value(node.left), _pattern_value(node.right)
        return left + right if isinstance(node.op, ast.Add) else left * right
    raise ValueError("not a list pattern")


def layer_pattern(text: str) -> int | tuple[int, ...]:
    """--moe-layer-freq: an integer N, or a list pattern such as "([0]*1+[1]*3)" (0 dense, 1 MoE)."""
    try:
        value = _pattern_value(ast.parse(str(text).strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError) as e:
        raise ValueError(f"--moe-layer-freq {text!r}: give an integer or a list such as ([0]*1+[1]*3)") from e
    if isinstance(value, list):
        if not all(isinstance(v, int) for v in value):
            raise ValueError(f"--moe-layer-freq {text!r}: the list must hold integers 0 or 1")
        return tuple(value)
    return value


layer_pattern.__name__ = "layer pattern"  # argparse's "invalid <name> value" wording


def _add(parser: argparse.ArgumentParser, flag: str, kind: str, help_text: str) -> None:
    dest = flag[2:].replace("-", "_")
    help_text = help_text.replace("%", "%%")  # argparse formats help strings with %
    if kind in ("true", "false"):
        parser.add_argument(flag, dest=dest, action="store_true", default=None, help=help_text)
    elif kind == "int3":
        parser.add_argument(flag, dest=dest, nargs=3, type=int, default=None, metavar=("START", "INCR", "SAMPLES"),
                            help=help_text)
    elif kind in ("list", "words"):  # words: one value, quoted or not ("0:8 256:16" or 0:8 256:16)
        parser.add_argument(flag, dest=dest, nargs="+", default=None, help=help_text)
    else:
        typ = {"int": int, "float": float, "str": str, "pattern": layer_pattern}[kind]
        parser.add_argument(flag, dest=dest, type=typ, default=None, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m mlm_jax.train", allow_abbrev=False,
        description="Train a GPT/Llama model with Megatron-LM's flags. No flags: the default run.",
    )
    parser.add_argument("--config", default=None, help="YAML file of flag: value (flags override it)")
    parser.add_argument("--group-query-attention", action="store_true", default=None,
                        help="grouped-query attention with --num-query-groups")
    for flag, _, _, kind, help_text in FLAGS:
        _add(parser, flag, kind, help_text)
    for flag, kind, help_text in ACCEPTED:
        _add(parser, flag, kind, help_text)
    for flag, why in REFUSED.items():
        dest = flag[2:].replace("-", "_")
        if flag in _REFUSED_WITH_VALUE:
            parser.add_argument(flag, dest=dest, default=None, metavar="VALUE", help=f"refused: {why}")
        else:
            parser.add_argument(flag, dest=dest, action="store_true", default=None, help=f"refused: {why}")
    return parser


def _yaml_values(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    try:
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"--config {path}: {yaml_problem(e)}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"--config {path}: not a text file (byte {e.start} is not {e.encoding}); "
                          "give a YAML file of flag: value") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag: value, got {type(raw).__name__}")
    known = {a.dest: a for a in parser._actions if a.option_strings}
    values = {}
    for key, value in raw.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in known or dest == "config":
            raise ConfigError(f"--config {path}: unknown key {key!r} (keys are flag names, e.g. num-layers)")
        values[dest] = _yaml_value(path, key, value, known[dest])
    return values


def yaml_problem(e: "yaml.YAMLError") -> str:
    """One line for a YAML syntax error: 'line N, column M: problem (context at line K, ...)'
    from its marks (1-based, as editors count), instead of PyYAML's four-line text."""
    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    mark, problem = getattr(e, "problem_mark", None), getattr(e, "problem", None)
    if mark is None or problem is None:
        return "not valid YAML (" + " ".join(str(e).split()) + ")"
    context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
    where = f" ({context} started at {at(context_mark)})" if context and context_mark else ""
    return f"not valid YAML: {at(mark)}: {problem}{where}"


def _yaml_value(path: str, key, value, action: argparse.Action):
    """One YAML value as its flag would parse it; never rounded, never silently dropped."""
    if action.nargs == 0:  # a switch: only true/false make sense
        if not isinstance(value, bool):
            raise ConfigError(f"--config {path}: {key} is a switch; give true or false, got {value!r}")
        return True if value else None
    if value is None:
        raise ConfigError(f"--config {path}: {key} has no value; give one or remove the key")
    if action.nargs == 3:  # --rampup-batch-size START INCR SAMPLES
        items = value if isinstance(value, list) else str(value).split()
        if len(items) != 3 or not all(isinstance(v, int) or str(v).strip().isdigit() for v in items):
            raise ConfigError(f"--config {path}: {key} needs three whole numbers, got {value!r}")
        return [int(v) for v in items]
    if action.nargs == "+":
        items = value if isinstance(value, list) else str(value).split()
        if not items or any(v is None or isinstance(v, (dict, list)) for v in items):
            raise ConfigError(f"--config {path}: {key} needs one or more plain values, got {value!r}")
        return [str(v) for v in items]
    if isinstance(value, (dict, list, bool)):
        raise ConfigError(f"--config {path}: {key} takes one value, got {value!r}")
    typ = action.type or str
    if typ is int and isinstance(value, float):
        raise ConfigError(f"--config {path}: {key}: {value!r} is not an integer")
    try:
        return typ(value)
    except (TypeError, ValueError):
        raise ConfigError(f"--config {path}: {key}: {value!r} is not a valid {typ.__name__}") from None


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Flags (and --config YAML) -> Config. Raises ConfigError or exits 2 on a bad flag."""
    parser = build_parser()
    first = parser.parse_args(argv)
    if first.config:
        parser.set_defaults(**_yaml_values(first.config, parser))
    args = vars(parser.parse_args(argv))
    for flag, why in REFUSED.items():
        if args.get(flag[2:].replace("-", "_")) is not None:
            raise ConfigError(f"{flag}: {why}")

    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for flag, section, field, kind, _ in FLAGS:
        value = args[flag[2:].replace("-", "_")]
        if value is None:
            continue
        if kind == "false":
            value = False
        elif kind in ("list", "int3"):
            value = tuple(value)
        elif kind == "words":
            value = " ".join(value)
        sections[section][field] = value
    if sections["model"].get("num_query_groups") is not None and not args["group_query_attention"]:
        raise ConfigError("--num-query-groups needs --group-query-attention (as in Megatron-LM)")
    if args["group_query_attention"] and sections["model"].get("num_query_groups") is None:
        raise ConfigError("--group-query-attention needs --num-query-groups N")
    sections["checkpoint"]["seq_length_given"] = args["seq_length"] is not None
    _check_fsdp(args, sections)  # before --overlap-param-gather's rule: FSDP runs on the distributed optimizer
    _map_accepted(args, sections)
    _check_instances(sections)
    _check_fp8(sections)
    _check_choices(sections)
    _check_schedule_flags(args, sections)
    _infer_tokenizer(sections)
    _apply_default_run(sections)
    return Config(**{name: dataclasses.replace(cls(), **sections[name]) for name, cls in SECTIONS.items()})


_CHOICES = {
    ("model", "position_embedding_type"): ("learned_absolute", "rope"),
    ("model", "normalization"): ("LayerNorm", "RMSNorm"),
    ("model", "recompute_granularity"): ("full", "selective", "dots", "offload"),
    ("model", "recompute_method"): ("uniform", "block"),
    ("parallel", "pipeline_schedule"): ("gpipe", "1f1b", "interleaved"),
    ("parallel", "cp_comm_type"): ("p2p", "allgather", "a2a"),
    ("model", "moe_router_load_balancing_type"): ("aux_loss", "seq_aux_loss", "none"),
    ("model", "moe_router_score_function"): ("softmax", "sigmoid"),
    ("model", "moe_token_drop_policy"): ("probs", "position"),
    ("model", "moe_token_dispatcher_type"): ("alltoall", "allgather"),
    ("optim", "lr_decay_style"): ("constant", "linear", "cosine", "WSD"),
    ("optim", "lr_wsd_decay_style"): ("linear", "cosine", "exponential"),
    ("data", "tiktoken_pattern"): ("v1", "v2"),
    ("model", "fp8_amax_compute_algo"): ("most_recent", "max"),
}


def _check_choices(sections: dict[str, dict[str, Any]]) -> None:
    flag_of = {(s, f): flag for flag, s, f, _, _ in FLAGS}
    for (section, field), choices in _CHOICES.items():
        value = sections[section].get(field)
        if value is not None and value not in choices:
            raise ConfigError(f"{flag_of[(section, field)]} {value!r}: choose one of {', '.join(choices)}")


def _check_schedule_flags(args: dict[str, Any], sections: dict[str, dict[str, Any]]) -> None:
    """Megatron's refusals that need to know which flags were given (the rest are config rules,
    mlm_jax/validation.py `validate_samples`)."""
    if args["train_iters"] is not None and args["train_samples"] is not None:
        raise ConfigError("--train-iters with --train-samples: give one (Megatron-LM: expected iteration-based "
                          "training, or sample-based training)")
    if args["rampup_batch_size"] is not None and args["train_iters"] is not None:
        raise ConfigError("--rampup-batch-size with --train-iters: expected no batch-size rampup for "
                          "iteration-based training (Megatron-LM's rule); give --train-samples")
    if args["step_batch_size_schedule"] is not None and args["global_batch_size"] is not None:
        raise ConfigError("Cannot specify both --step-batch-size-schedule and --global-batch-size "
                          "(Megatron-LM's rule: the schedule gives every batch size)")


def _check_fsdp(args: dict[str, Any], sections: dict[str, dict[str, Any]]) -> None:
    """--use-megatron-fsdp's rules (Megatron-FSDP, whose version 1 runs on the distributed
    optimizer: every strategy but no_shard sets it); --use-torch-fsdp2 is the same FSDP here."""
    parallel = sections["parallel"]
    if args["torch_fsdp2_no_reshard_after_forward"]:
        if not parallel.get("use_torch_fsdp2"):
            raise ConfigError("--torch-fsdp2-no-reshard-after-forward needs --use-torch-fsdp2")
        parallel.setdefault("data_parallel_sharding_strategy", "optim_grads")
    if parallel.get("use_torch_fsdp2"):
        parallel["use_megatron_fsdp"] = True
    instances = parallel.get("num_distributed_optimizer_instances", 1)
    outer = args["outer_dp_sharding_strategy"] or "no_shard"
    if instances < 1:
        raise ConfigError(f"--num-distributed-optimizer-instances must be 1 or more, got {instances}")
    if outer not in ("no_shard", "optim"):
        raise ConfigError(f"--outer-dp-sharding-strategy {outer!r}: choose one of no_shard, optim")
    if outer != "no_shard":
        if instances == 1:
            raise ConfigError(f"--outer-dp-sharding-strategy {outer} needs --num-distributed-optimizer-instances > 1 "
                              "(the outer group is the instances)")
        raise ConfigError(f"--outer-dp-sharding-strategy {outer}: not built (the optimizer state split over the "
                          "instances too); give no_shard: each instance holds the whole sharded state")
    strategy = parallel.get("data_parallel_sharding_strategy")
    if strategy is not None and strategy not in SHARDING_STRATEGIES:
        raise ConfigError(f"--data-parallel-sharding-strategy {strategy!r}: choose one of {', '.join(SHARDING_STRATEGIES)}")
    if not parallel.get("use_megatron_fsdp"):
        if strategy is not None:
            raise ConfigError(f"--data-parallel-sharding-strategy {strategy} needs --use-megatron-fsdp (without it "
                              "data parallelism is --use-distributed-optimizer's: optim, or no_shard)")
        return
    if (strategy or "optim_grads_params") != "no_shard":
        parallel["use_distributed_optimizer"] = True


def _check_instances(sections: dict[str, dict[str, Any]]) -> None:
    """--num-distributed-optimizer-instances > 1 needs the distributed optimizer (Megatron-LM's rule)."""
    parallel = sections["parallel"]
    instances = parallel.get("num_distributed_optimizer_instances", 1)
    if instances > 1 and not parallel.get("use_distributed_optimizer"):
        raise ConfigError(f"--num-distributed-optimizer-instances {instances} needs --use-distributed-optimizer (or "
                          "--use-megatron-fsdp): the instances are copies of the sharded optimizer state")


def _check_fp8(sections: dict[str, dict[str, Any]]) -> None:
    """--fp8-format's rules: a built recipe, --bf16 beside it, the history and layer counts."""
    model = sections["model"]
    recipe = model.get("fp8_recipe")
    if model.get("fp8_param_gather"):
        if model.get("fp8_format") is None:
            raise ConfigError("--fp8-param-gather needs --fp8-format (the weights it gathers in fp8 feed fp8 products)")
        if not sections["parallel"].get("use_distributed_optimizer"):
            raise ConfigError("--fp8-param-gather needs --use-distributed-optimizer (its parameter all-gather is what "
                              "goes fp8; as in Megatron-LM)")
    if model.get("fp8_format") is None:
        if recipe is not None and recipe not in FP8_RECIPES + tuple(_FP8_RECIPES_REFUSED):
            raise ConfigError(f"--fp8-recipe {recipe!r}: choose one of tensorwise, delayed, blockwise, mxfp8, custom")
        for field in ("fp8_recipe", "fp8_amax_history_len", "fp8_amax_compute_algo"):
            model.pop(field, None)  # without --fp8-format no recipe applies (as in Megatron-LM)
        return
    fmt = model["fp8_format"]
    if fmt not in FP8_FORMATS:
        raise ConfigError(f"--fp8-format {fmt!r}: choose one of {', '.join(FP8_FORMATS)}")
    if recipe in _FP8_RECIPES_REFUSED:
        raise ConfigError(f"--fp8-recipe {recipe}: {_FP8_RECIPES_REFUSED[recipe]}")
    if recipe is not None and recipe not in FP8_RECIPES:
        raise ConfigError(f"--fp8-recipe {recipe!r}: choose delayed or tensorwise (Megatron-LM's blockwise, "
                          "mxfp8 and custom are refused here)")
    if model.get("fp8_amax_history_len", 1) < 1:
        raise ConfigError(f"--fp8-amax-history-len must be 1 or more, got {model['fp8_amax_history_len']}")
    algo = model.get("fp8_amax_compute_algo", "most_recent")
    if algo not in ("most_recent", "max"):
        raise ConfigError(f"--fp8-amax-compute-algo {algo!r}: choose one of most_recent, max")
    if not model.get("bf16"):
        raise ConfigError("--fp8-format needs --bf16 (fp8 projections, bf16 everywhere else, as in Megatron-LM)")
    for flag, field in (("--num-layers-at-start-in-bf16", "num_layers_at_start_in_bf16"),
                        ("--num-layers-at-end-in-bf16", "num_layers_at_end_in_bf16")):
        if model.get(field, 1) < 0:
            raise ConfigError(f"{flag} must be 0 or more, got {model[field]}")
    if model.get("fp8_margin", 0) < 0:
        raise ConfigError(f"--fp8-margin must be 0 or more, got {model['fp8_margin']}")


def _map_accepted(args: dict[str, Any], sections: dict[str, dict[str, Any]]) -> None:
    """The ACCEPTED flags: their choices, Megatron's rules on them, and the few that set a field."""
    given = {flag: args[flag[2:].replace("-", "_")] for flag, _, _ in ACCEPTED}
    for flag, choices in _ACCEPTED_CHOICES.items():
        if given[flag] is not None and given[flag] not in choices:
            raise ConfigError(f"{flag} {given[flag]!r}: choose one of {', '.join(map(str, choices))}")
    if sections["parallel"].get("overlap_param_gather") and not sections["parallel"].get("use_distributed_optimizer"):
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer (as in Megatron-LM)")
    minutes = given["--distributed-timeout-minutes"]
    if minutes is not None:
        if minutes <= 0:
            raise ConfigError(f"--distributed-timeout-minutes must be a positive number, got {minutes}")
        sections["distributed"].setdefault("coordinator_timeout", minutes * 60.0)
    if given["--num-workers"] is not None and given["--num-workers"] < 0:
        raise ConfigError(f"--num-workers must be 0 or more, got {given['--num-workers']}")
    for module in given["--recompute-modules"] or ():
        if module not in RECOMPUTE_MODULES:
            raise ConfigError(f"--recompute-modules {module!r}: choose from {', '.join(RECOMPUTE_MODULES)}")
    if given["--recompute-modules"]:
        sections["model"]["recompute_modules"] = tuple(dict.fromkeys(given["--recompute-modules"]))
    if given["--megatron-fsdp-grad-comm-dtype"] == "bf16":
        sections["parallel"].setdefault("grad_reduce_in_bf16", True)
    if given["--moe-router-dtype"] == "fp64":
        raise ConfigError("--moe-router-dtype fp64: not built (jax runs with 64-bit floats off); the router computes "
                          "in fp32: give fp32 or leave it out")
    model = sections["model"]
    if model.get("moe_token_dispatcher_type") == "flex":  # DeepEP / HybridEP's dispatch: the all-to-all's here
        model["moe_token_dispatcher_type"] = "alltoall"
    if given["--use-rotary-position-embeddings"]:
        if model.get("position_embedding_type", "rope") != "rope":
            raise ConfigError("--use-rotary-position-embeddings contradicts --position-embedding-type "
                              f"{model['position_embedding_type']}")
        model["position_embedding_type"] = "rope"
    if given["--no-position-embedding"] and model.get("position_embedding_type") != "rope":
        raise ConfigError("--no-position-embedding needs rope positions (--position-embedding-type rope): "
                          "learned_absolute positions have no other position information")
