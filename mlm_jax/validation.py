"""The cross-field rules of a `Config`, checked before anything is compiled, and `finalize`,
which fills the derived fields and then checks them.

`validate` runs the rule groups below in a fixed order; each error names the flags, the values
and the rule. Kept free of jax so that validating stays light to import.
"""

from __future__ import annotations

import dataclasses
import math

from mlm_jax.batch_schedule import from_config
from mlm_jax.config import (
    CheckpointConfig,
    Config,
    InstrumentsConfig,
    ModelConfig,
    data_parallel_size,
    padded_vocab_size,
)
from mlm_jax.errors import ConfigError, UsageError
from mlm_jax.pipeline.layout import pipeline_plan


def finalize(cfg: Config, world_size: int) -> Config:
    """Fill derived fields (padded vocab, global batch, the iterations of --train-samples) and
    validate against the device count. The true vocab size (the tokenizer's) must be known
    first: a run finalizes its config once (mlm_jax/train.py `prepare`)."""
    validate_divisors(cfg)  # the sizes this function divides by, before it divides
    dp = data_parallel_size(cfg.parallel, world_size)
    model = dataclasses.replace(
        cfg.model,
        padded_vocab_size=padded_vocab_size(
            cfg.model.vocab_size,
            cfg.model.make_vocab_size_divisible_by,
            cfg.parallel.tensor_model_parallel_size,
        ),
    )
    train = cfg.train
    if train.global_batch_size is None:
        train = dataclasses.replace(train, global_batch_size=train.micro_batch_size * dp)
    if train.train_samples is not None and train.train_samples > 0:  # Megatron's update_train_iters
        train = dataclasses.replace(train, train_iters=from_config(cfg.replace(train=train), dp).train_iters(
            train.train_samples))
    cfg = cfg.replace(model=model, train=train)
    validate(cfg, world_size)
    return cfg


def _positive(name: str, value) -> None:
    if value is None or value <= 0:
        raise ConfigError(f"{name} must be a positive number, got {value}")


def validate(cfg: Config, world_size: int) -> None:
    """Check every rule that would otherwise fail deep inside compilation (or silently).

    The groups run in this order, so a config breaking several rules is refused for the first.
    """
    validate_sizes(cfg)
    validate_mla(cfg)
    validate_pipeline(cfg, world_size)
    validate_context_parallel(cfg)
    validate_moe(cfg, world_size)
    validate_tensor_parallel(cfg, world_size)
    validate_lengths(cfg)
    validate_training(cfg, world_size)
    validate_samples(cfg, world_size)
    validate_numbers(cfg)
    validate_optimizer(cfg)
    validate_decoupled_lr_and_rotary(cfg)
    validate_loss_scaling(cfg)
    validate_fp8(cfg.model)
    validate_sharded_data(cfg)
    validate_instances(cfg, world_size)
    validate_attention_backend(cfg.model, cfg.data.reset_attention_mask)
    validate_checkpoint(cfg.checkpoint)
    validate_instruments(cfg.instruments)
    validate_finite(cfg)


_YARN_FLAGS = (("--rotary-scaling-factor", "rotary_scaling_factor", 1.0), ("--mscale", "mscale", 1.0),
               ("--mscale-all-dim", "mscale_all_dim", 0.0))


def validate_mla(cfg: Config) -> None:
    """--multi-latent-attention's sizes, and what it does not compose with (Megatron's rules and
    what is not built here); its flags without it are refused rather than ignored."""
    m = cfg.model
    if m.rope_type not in (None, "rope", "yarn"):
        raise ConfigError(f"--rope-type {m.rope_type!r}: choose rope or yarn")
    validate_mtp(cfg)
    if not m.multi_latent_attention:
        if m.qk_layernorm:
            raise ConfigError("--qk-layernorm without --multi-latent-attention: per-head query/key norms of "
                              "standard attention are not built (with MLA they are the latents' norms)")
        if m.rope_type == "yarn":
            raise ConfigError("--rope-type yarn needs --multi-latent-attention (as in Megatron-LM, standard "
                              "attention takes rope; Llama 3.1's scaling is --use-rope-scaling)")
        for flag, field, default in _YARN_FLAGS:
            if getattr(m, field) != default:
                raise ConfigError(f"{flag} {getattr(m, field)} is multi-latent attention's YaRN rope; add "
                                  "--multi-latent-attention (Llama 3.1's rope scaling is --use-rope-scaling)")
        return
    for flag, value in (("--kv-lora-rank", m.kv_lora_rank), ("--qk-pos-emb-head-dim", m.qk_pos_emb_head_dim),
                        ("--v-head-dim", m.v_head_dim)):
        _positive(flag, value)
    if m.q_lora_rank is not None:
        _positive("--q-lora-rank", m.q_lora_rank)
    if m.qk_head_dim < 0:
        raise ConfigError(f"--qk-head-dim must be 0 or more, got {m.qk_head_dim}")
    if m.qk_pos_emb_head_dim % 2:
        raise ConfigError(f"--qk-pos-emb-head-dim must be even (rope turns channel pairs), got {m.qk_pos_emb_head_dim}")
    if not (math.isfinite(m.rotary_scaling_factor) and m.rotary_scaling_factor > 0):
        raise ConfigError(f"--rotary-scaling-factor must be a positive number, got {m.rotary_scaling_factor}")
    if m.num_query_groups is not None:
        raise ConfigError("--group-query-attention and --multi-latent-attention exclude each other (as in "
                          "Megatron-LM): MLA's heads each have their own keys and values")
    if m.use_rope_scaling:
        raise ConfigError("--use-rope-scaling (Llama 3.1's) with --multi-latent-attention: MLA's rope is YaRN "
                          "(--rotary-scaling-factor, --mscale, --mscale-all-dim)")


def validate_mtp(cfg: Config) -> None:
    """--mtp-num-layers: a positive depth count, in the layouts built for it."""
    m, p = cfg.model, cfg.parallel
    if m.mtp_num_layers is None:
        return
    _positive("--mtp-num-layers", m.mtp_num_layers)
    if not (math.isfinite(m.mtp_loss_scaling_factor) and m.mtp_loss_scaling_factor >= 0):
        raise ConfigError(f"--mtp-loss-scaling-factor must be 0 or more, got {m.mtp_loss_scaling_factor}")
    if p.pipeline_model_parallel_size > 1 and m.fp8_format:
        raise ConfigError(f"--mtp-num-layers with --fp8-format and --pipeline-model-parallel-size "
                          f"{p.pipeline_model_parallel_size}: the depths' fp8 amax histories are not built under the "
                          "pipeline (the depths run on every stage); leave out one of the three")


def validate_divisors(cfg: Config) -> None:
    """The sizes `finalize` divides by (the padded vocab, the data-parallel size, the batch
    schedule): positive, or a division by zero would speak instead of the flag."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name, value in [
        ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by),
        ("--tensor-model-parallel-size", p.tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size),
        ("--context-parallel-size", p.context_parallel_size),
        ("--expert-model-parallel-size", p.expert_model_parallel_size),
        ("--micro-batch-size", t.micro_batch_size),
    ]:
        _positive(name, value)
    if t.global_batch_size is not None:  # None: micro batch x data parallel (finalize)
        _positive("--global-batch-size", t.global_batch_size)


def validate_sizes(cfg: Config) -> None:
    """The sizes and counts that must be positive before any other rule can be computed."""
    m, t = cfg.model, cfg.train
    validate_divisors(cfg)
    for name, value in [
        ("--num-layers", m.num_layers),
        ("--hidden-size", m.hidden_size),
        ("--num-attention-heads", m.num_attention_heads),
        ("--vocab-size", m.vocab_size),
        ("--seq-length", t.seq_length),
        ("--max-position-embeddings", m.max_position_embeddings),
        ("--train-iters", t.train_iters),
        ("--log-interval", t.log_interval),
        ("--ffn-hidden-size", m.ffn_size),
        ("--eval-interval", t.eval_interval),
    ]:
        _positive(name, value)
    if t.eval_iters is None or t.eval_iters < 0:  # 0: no validation at all, as in Megatron-LM
        raise ConfigError(f"--eval-iters must be 0 (no validation) or more, got {t.eval_iters}")


def validate_tensor_parallel(cfg: Config, world_size: int) -> None:
    """The device count and the head, key/value group and MLP widths over the tensor-parallel ranks."""
    m, p = cfg.model, cfg.parallel
    tp = p.tensor_model_parallel_size
    dp = data_parallel_size(p, world_size)
    if world_size != dp * tp * p.pipeline_model_parallel_size * p.context_parallel_size:
        raise ConfigError(f"device count {world_size} != product of parallel sizes")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
            f"{m.num_attention_heads}; set --kv-channels or change one of them"
        )
    if m.num_attention_heads % tp:
        raise ConfigError(
            f"--num-attention-heads {m.num_attention_heads} is not divisible by "
            f"--tensor-model-parallel-size {tp}; each tensor-parallel rank needs whole heads"
        )
    groups = m.query_groups
    if groups <= 0 or m.num_attention_heads % groups:
        raise ConfigError(
            f"--num-attention-heads {m.num_attention_heads} is not divisible by "
            f"--num-query-groups {groups}"
        )
    if groups % tp:
        raise ConfigError(
            f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size {tp}; "
            "each tensor-parallel rank needs whole key/value groups"
        )
    if m.ffn_size % tp:
        raise ConfigError(
            f"--ffn-hidden-size {m.ffn_size} is not divisible by --tensor-model-parallel-size {tp}"
        )


def validate_lengths(cfg: Config) -> None:
    """Positions (rotary head dim, learned-position length), the sequence split and the vocab."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    tp = p.tensor_model_parallel_size
    if m.position_embedding_type == "rope" and m.head_dim % 2:
        raise ConfigError(f"rotary embeddings need an even head dim, got {m.head_dim}")
    if m.position_embedding_type == "learned_absolute" and t.seq_length > m.max_position_embeddings:
        raise ConfigError(
            f"--seq-length {t.seq_length} exceeds --max-position-embeddings "
            f"{m.max_position_embeddings}; learned positions exist only up to that length"
        )
    if p.sequence_parallel and t.seq_length % tp:
        raise ConfigError(
            f"--sequence-parallel needs --seq-length {t.seq_length} divisible by "
            f"--tensor-model-parallel-size {tp}"
        )
    if m.vocab_size > m.vocab:
        raise ConfigError(f"padded vocab {m.vocab} is smaller than the vocab {m.vocab_size}")
    if m.vocab % tp:
        raise ConfigError(
            f"padded vocab {m.vocab} is not divisible by --tensor-model-parallel-size {tp}"
        )


def validate_training(cfg: Config, world_size: int) -> None:
    """Recompute flags, dropout rates, and the global batch over micro batch x data parallel."""
    m, t = cfg.model, cfg.train
    _check_recompute(m)
    for name, rate in [("--hidden-dropout", m.hidden_dropout), ("--attention-dropout", m.attention_dropout)]:
        if not 0.0 <= rate < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {rate}")
    dp = data_parallel_size(cfg.parallel, world_size)
    gbs = t.global_batch_size
    per_step = t.micro_batch_size * dp
    if gbs is None or gbs <= 0 or gbs % per_step:
        raise ConfigError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp} = {per_step}"
        )


def _refuse_mixed_schedule(cfg: Config) -> None:
    """Megatron's rule: iteration-based and sample-based flags are not mixed (its reasons quoted)."""
    o, t = cfg.optim, cfg.train
    if t.train_samples is not None:
        wrong = [("--lr-decay-iters", o.lr_decay_iters is not None, "expected sample-based learning rate decay"),
                 ("--lr-warmup-iters", o.lr_warmup_iters != 0, "expected sample-based learning rate warmup"),
                 ("--lr-wsd-decay-iters", o.lr_wsd_decay_iters is not None, "expected sample-based WSD decay")]
        given, other = "--train-samples", "give the -samples flag"
    else:
        wrong = [("--lr-decay-samples", o.lr_decay_samples is not None, "expected iteration-based learning rate decay"),
                 ("--lr-warmup-samples", o.lr_warmup_samples != 0, "expected iteration-based learning rate warmup"),
                 ("--lr-wsd-decay-samples", o.lr_wsd_decay_samples is not None, "expected iteration-based WSD decay"),
                 ("--rampup-batch-size", t.rampup_batch_size is not None,
                  "expected no batch-size rampup for iteration-based training")]
        given, other = "--train-iters", "give --train-samples for sample-based training"
    for flag, bad, reason in wrong:
        if bad:
            raise ConfigError(f"{flag} with {given}: {reason} (Megatron-LM's rule); {other}")
    if o.lr_warmup_fraction is not None:
        warm = "--lr-warmup-samples" if t.train_samples is not None else "--lr-warmup-iters"
        if (o.lr_warmup_samples if t.train_samples is not None else o.lr_warmup_iters) != 0:
            raise ConfigError(f"--lr-warmup-fraction with {warm}: can only specify one of "
                              f"lr-warmup-fraction and {warm[2:]}")


def validate_samples(cfg: Config, world_size: int) -> None:
    """Sample-based training and the batch-size schedules (mlm_jax/batch_schedule.py): Megatron's
    combinations, its calculator's checks on every batch size the run reaches, and the
    pipeline's microbatch rules for each of them."""
    t = cfg.train
    _refuse_mixed_schedule(cfg)
    if t.train_samples is not None and t.train_samples <= 0:
        raise ConfigError(f"--train-samples must be a positive number, got {t.train_samples}")
    if t.rampup_batch_size is not None and t.step_batch_size_schedule is not None:
        raise ConfigError("--rampup-batch-size with --step-batch-size-schedule: give one (Megatron-LM replaced "
                          "the first by the second)")
    dp = data_parallel_size(cfg.parallel, world_size)
    if t.step_batch_size_schedule is not None and t.global_batch_size != t.micro_batch_size * dp:
        raise ConfigError("Cannot specify both --step-batch-size-schedule and --global-batch-size "
                          "(Megatron-LM's rule: the schedule gives every batch size)")
    schedule = from_config(cfg, dp)
    if not schedule.varies:
        return
    sizes = set(schedule.plan(0, 0, t.train_iters)[1])
    schedule.check_sizes(sizes)
    for size in sorted(sizes):  # the pipeline's microbatch rules hold for every batch size
        pipeline_plan(cfg.replace(train=dataclasses.replace(t, global_batch_size=size)), world_size)


def validate_optimizer(cfg: Config) -> None:
    """The learning-rate schedule's bounds and Adam's betas."""
    o, t = cfg.optim, cfg.train
    if o.min_lr > o.lr:
        raise ConfigError(
            f"need 0 <= --min-lr ({o.min_lr}) <= --lr ({o.lr}): the schedule decays from --lr to --min-lr"
        )
    decay = o.lr_decay_iters if o.lr_decay_iters is not None else t.train_iters
    if o.lr_warmup_iters < 0 or (o.lr_decay_style != "constant" and o.lr_warmup_iters > decay):
        raise ConfigError(
            f"--lr-warmup-iters {o.lr_warmup_iters} must be between 0 and --lr-decay-iters {decay}"
        )
    if not 0.0 <= o.lr_warmup_init <= o.lr:
        raise ConfigError(f"--lr-warmup-init {o.lr_warmup_init} must be between 0 and --lr {o.lr}")
    if o.lr_warmup_fraction is not None and not 0.0 <= o.lr_warmup_fraction <= 1.0:
        raise ConfigError(f"--lr-warmup-fraction {o.lr_warmup_fraction} must be between 0 and 1")
    if t.train_samples is not None:
        decay = o.lr_decay_samples if o.lr_decay_samples is not None else t.train_samples
        if o.lr_warmup_samples < 0 or (o.lr_decay_style != "constant" and o.lr_warmup_samples > decay):
            raise ConfigError(
                f"--lr-warmup-samples {o.lr_warmup_samples} must be between 0 and --lr-decay-samples {decay}")
    if not (0.0 <= o.adam_beta1 < 1.0 and 0.0 <= o.adam_beta2 < 1.0):
        raise ConfigError(
            f"--adam-beta1 {o.adam_beta1} and --adam-beta2 {o.adam_beta2} must be in [0, 1)"
        )


def validate_loss_scaling(cfg: Config) -> None:
    """--fp16 and the loss-scaling flags (Megatron's asserts, as one-line errors)."""
    m, o = cfg.model, cfg.optim
    if m.fp16 and m.bf16:
        raise ConfigError("--fp16 and --bf16 exclude each other (as in Megatron-LM): choose one")
    if o.loss_scale is not None and not (math.isfinite(o.loss_scale) and o.loss_scale > 0):
        raise ConfigError(f"--loss-scale must be a {'finite ' if not math.isfinite(o.loss_scale) else ''}"
                          f"positive number, got {o.loss_scale} "
                          "(leave it out for dynamic loss scaling)")
    for flag, value in (("--initial-loss-scale", o.initial_loss_scale), ("--min-loss-scale", o.min_loss_scale),
                        ("--loss-scale-window", o.loss_scale_window), ("--hysteresis", o.hysteresis)):
        _bounded(flag, value, "> 0")
    if o.min_loss_scale > o.initial_loss_scale:
        raise ConfigError(f"--min-loss-scale {o.min_loss_scale} must be <= --initial-loss-scale "
                          f"{o.initial_loss_scale}")


def validate_fp8(m: ModelConfig) -> None:
    """--first-last-layers-bf16's counts fit the model (the flags check the rest)."""
    if m.fp8_format is None or not m.first_last_layers_bf16:
        return
    start, end = m.num_layers_at_start_in_bf16, m.num_layers_at_end_in_bf16
    if start + end > m.num_layers:
        raise ConfigError(f"--num-layers-at-start-in-bf16 {start} + --num-layers-at-end-in-bf16 {end} is more "
                          f"than the model's {m.num_layers} layers")


def validate_sharded_data(cfg: Config) -> None:
    """--data-parallel-sharding-strategy optim_grads / optim_grads_params (mlm_jax/parallel/fsdp.py):
    what they do not compose with yet, named."""
    p, m = cfg.parallel, cfg.model
    strategy = p.sharding_strategy
    if strategy not in ("optim_grads", "optim_grads_params"):
        return
    flag = f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy}"
    if p.pipeline_model_parallel_size > 1:
        raise ConfigError(f"{flag} with --pipeline-model-parallel-size {p.pipeline_model_parallel_size}: not built "
                          "(the pipeline's stages gather their layers once per step); use "
                          "--data-parallel-sharding-strategy optim (ZeRO-1) with the pipeline")
    if m.fp8_param_gather:
        raise ConfigError(f"{flag} with --fp8-param-gather: not built (the per-layer gather sends bf16); leave out "
                          "--fp8-param-gather, or use --data-parallel-sharding-strategy optim")


def validate_instances(cfg: Config, world_size: int) -> None:
    """--num-distributed-optimizer-instances N (hybrid sharding): N groups of the data-parallel
    ranks (with expert parallelism, of the ranks one expert's copies are on)."""
    p = cfg.parallel
    n = p.num_distributed_optimizer_instances
    if n == 1:
        return
    dp = data_parallel_size(p, world_size)
    ranks = dp // p.expert_model_parallel_size
    if ranks % n:
        of = (f"the data-parallel size {dp}" if p.expert_model_parallel_size == 1 else
              f"the data-parallel size {dp} over --expert-model-parallel-size {p.expert_model_parallel_size} = {ranks}")
        raise ConfigError(f"--num-distributed-optimizer-instances {n} does not divide {of} (each instance is an "
                          "equal group of the data-parallel ranks)")
    if p.pipeline_model_parallel_size > 1:
        raise ConfigError(f"--num-distributed-optimizer-instances {n} with --pipeline-model-parallel-size "
                          f"{p.pipeline_model_parallel_size}: not built (the pipeline's per-rank schedule reduces over "
                          "the data ranks of one group); give 1")


def validate_context_parallel(cfg: Config) -> None:
    """--context-parallel-size C and --cp-comm-type: the sizes the chunked sequence needs."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    cp, tp = p.context_parallel_size, p.tensor_model_parallel_size
    if p.cp_comm_type not in ("p2p", "allgather", "a2a"):
        raise ConfigError(f"--cp-comm-type {p.cp_comm_type!r}: choose one of p2p, allgather, a2a")
    if cp == 1:
        return
    if t.seq_length % (2 * cp):
        raise ConfigError(
            f"--seq-length {t.seq_length} is not divisible by 2 x --context-parallel-size {cp} = "
            f"{2 * cp}; the causal load balance cuts the sequence into {2 * cp} equal chunks")
    if p.sequence_parallel and t.seq_length % (cp * tp):
        raise ConfigError(
            f"--sequence-parallel with --context-parallel-size {cp} needs --seq-length "
            f"{t.seq_length} divisible by {cp} x --tensor-model-parallel-size {tp} = {cp * tp}")
    if p.cp_comm_type == "a2a":
        for flag, n in (("--num-attention-heads", m.num_attention_heads),
                        ("--num-query-groups", m.query_groups)):
            if n % (tp * cp):
                raise ConfigError(
                    f"--cp-comm-type a2a needs {flag} {n} divisible by --context-parallel-size {cp}"
                    + (f" x --tensor-model-parallel-size {tp} = {tp * cp}" if tp > 1 else "")
                    + "; use --cp-comm-type p2p or allgather")


ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


def validate_attention_backend(m: ModelConfig, documents: bool) -> None:
    """--attention-backend flash/fused where cuDNN cannot run is refused here, before compiling
    (the platform is checked when the model is placed on devices)."""
    if m.attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"--attention-backend {m.attention_backend!r} is unknown; choose one of "
                          f"{', '.join(ATTENTION_BACKENDS)}")
    if m.attention_backend in ("flash", "fused"):
        from mlm_jax.models.attention import fused_attention_obstacle

        why = fused_attention_obstacle(m, documents)
        if why:
            raise ConfigError(f"--attention-backend {m.attention_backend}: {why}; or use "
                              "--attention-backend auto (cuDNN where it applies, XLA otherwise) or unfused")


def validate_decoupled_lr_and_rotary(cfg: Config) -> None:
    """--decoupled-lr / --decoupled-min-lr bounds (Megatron's scheduler: 0 <= min <= max) and
    --rotary-percent: a fraction of the head whose channel count is even (rotate-half pairs)."""
    o, m = cfg.optim, cfg.model
    _bounded("--decoupled-lr", o.decoupled_lr, ">= 0")
    _bounded("--decoupled-min-lr", o.decoupled_min_lr, ">= 0")
    if o.decoupled_min_lr is not None and o.decoupled_lr is None:
        raise ConfigError(f"--decoupled-min-lr {o.decoupled_min_lr} needs --decoupled-lr (the peak LR of the "
                          "embedding and output layer)")
    if o.decoupled_lr is not None:
        low = o.decoupled_min_lr if o.decoupled_min_lr is not None else o.min_lr
        if low > o.decoupled_lr:
            raise ConfigError(f"need {'--decoupled-min-lr' if o.decoupled_min_lr is not None else '--min-lr'} "
                              f"({low}) <= --decoupled-lr ({o.decoupled_lr}): the embedding and output layer's "
                              "schedule decays from one to the other")
    if not (math.isfinite(m.rotary_percent) and 0.0 < m.rotary_percent <= 1.0):
        raise ConfigError(f"--rotary-percent must be in (0, 1], got {m.rotary_percent}")
    if m.rotary_percent != 1.0:
        if m.position_embedding_type != "rope":
            raise ConfigError(f"--rotary-percent {m.rotary_percent} needs --position-embedding-type rope "
                              f"(got {m.position_embedding_type})")
        dims = int(m.head_dim * m.rotary_percent)
        if dims < 2 or dims % 2:
            raise ConfigError(f"--rotary-percent {m.rotary_percent} x head dim {m.head_dim} = {dims} rotary "
                              "channels; they must be a positive even number (rotated in pairs)")
    validate_rope_scaling(m)


def validate_rope_scaling(m) -> None:
    """--use-rope-scaling (Llama 3.1's): rope positions, a factor >= 1 (it only slows
    frequencies), 0 < low freq factor < high freq factor (the blend divides by their gap)."""
    if not m.use_rope_scaling:
        return
    if m.position_embedding_type != "rope":
        raise ConfigError(f"--use-rope-scaling needs --position-embedding-type rope (got {m.position_embedding_type})")
    if not (math.isfinite(m.rope_scaling_factor) and m.rope_scaling_factor >= 1.0):
        raise ConfigError(f"--rope-scaling-factor must be >= 1, got {m.rope_scaling_factor}")
    low, high = m.rope_scaling_low_freq_factor, m.rope_scaling_high_freq_factor
    if not (math.isfinite(low) and math.isfinite(high) and 0.0 < low < high):
        raise ConfigError(f"rope scaling low_freq_factor {low} and high_freq_factor {high}: need 0 < low < high")
    if m.rope_scaling_original_max_position_embeddings < 1:
        raise ConfigError("rope scaling original_max_position_embeddings must be >= 1, got "
                          f"{m.rope_scaling_original_max_position_embeddings}")


def _bounded(flag: str, value, rule: str) -> None:
    """`rule` is '> 0' or '>= 0'; None means unset. NaN and infinities are refused too."""
    if value is None:
        return
    ok = math.isfinite(value) and (value > 0 if rule == "> 0" else value >= 0)
    if not ok:
        raise ConfigError(f"{flag} must be {_finite(value)}{rule}, got {value}")


def _finite(value) -> str:
    """'a finite number ' where `value` is NaN or an infinity (the rule then says so first)."""
    return "" if math.isfinite(value) else "a finite number "


def validate_finite(cfg: Config) -> None:
    """NaN and infinities of the float flags no rule above bounds (a loss coefficient, a
    timeout, a factor): never a meaningful value, refused naming the flag."""
    from mlm_jax.arguments import FLAGS  # the flag of each field (arguments imports no validation)

    for flag, section, field, kind, _ in FLAGS:
        value = getattr(getattr(cfg, section), field)
        if kind == "float" and value is not None and not math.isfinite(value):
            raise ConfigError(f"{flag} must be a finite number, got {value}")


def validate_numbers(cfg: Config) -> None:
    """Sign and finiteness of the numeric flags that `validate`'s other rules do not cover
    (Megatron's scheduler asserts 0 <= min_lr <= lr; NumPy seeds are 32-bit unsigned), and
    the --split syntax, so a bad value stops the run before any data or compile work."""
    m, o, t = cfg.model, cfg.optim, cfg.train
    for flag, value, rule in [
        ("--lr", o.lr, ">= 0"), ("--min-lr", o.min_lr, ">= 0"),
        ("--weight-decay", o.weight_decay, ">= 0"), ("--clip-grad", o.clip_grad, ">= 0"),
        ("--adam-eps", o.adam_eps, "> 0"), ("--lr-decay-iters", o.lr_decay_iters, "> 0"),
        ("--lr-decay-samples", o.lr_decay_samples, "> 0"),
        ("--lr-wsd-decay-samples", o.lr_wsd_decay_samples, ">= 0"),
        ("--lr-wsd-decay-iters", o.lr_wsd_decay_iters, ">= 0"),
        ("--norm-epsilon", m.norm_epsilon, "> 0"), ("--init-method-std", m.init_method_std, ">= 0"),
        ("--rotary-base", m.rotary_base, "> 0"), ("--kv-channels", m.kv_channels, "> 0"),
        ("--num-query-groups", m.num_query_groups, "> 0"), ("--sample-tokens", t.sample_tokens, ">= 0"),
        ("--peak-flops-per-device", t.peak_flops, "> 0"), ("--seed", t.seed, ">= 0"),
    ]:
        _bounded(flag, value, rule)
    if t.seed >= 2**32:
        raise ConfigError(f"--seed must be below 2**32 (a NumPy seed), got {t.seed}")
    try:
        from mlm_jax.data.gpt_dataset import parse_split

        parse_split(cfg.data.split)
    except UsageError as e:
        raise ConfigError(str(e)) from None


def validate_checkpoint(c: CheckpointConfig) -> None:
    """The checkpoint flags' own rules (the folders themselves are checked when used)."""
    for name, value in [("--save-interval", c.save_interval), ("--keep-last-checkpoints", c.keep_last),
                        ("--exit-interval", c.exit_interval),
                        ("--exit-duration-in-mins", c.exit_duration_in_mins)]:
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be a positive number, got {value}")
    if c.ckpt_step is not None and c.ckpt_step < 0:
        raise ConfigError(f"--ckpt-step must be >= 0, got {c.ckpt_step}")
    for name, given in [("--finetune", c.finetune), ("--ckpt-step", c.ckpt_step is not None),
                        ("--use-checkpoint-args", c.use_checkpoint_args),
                        ("--exit-on-missing-checkpoint", c.exit_on_missing_checkpoint)]:
        if given and not c.load:
            raise ConfigError(f"{name} needs --load DIR")


def validate_instruments(i: InstrumentsConfig) -> None:
    if i.slow_iteration_factor < 0:
        raise ConfigError(f"--slow-iteration-factor must be >= 0, got {i.slow_iteration_factor}")
    if i.profile and not 0 <= i.profile_step_start < i.profile_step_end:
        raise ConfigError(
            f"--profile needs 0 <= --profile-step-start ({i.profile_step_start}) < "
            f"--profile-step-end ({i.profile_step_end})"
        )


def validate_router_groups(m: ModelConfig) -> None:
    """--moe-router-num-groups G / --moe-router-group-topk g (Megatron-LM's rules): both or neither;
    G equal groups of the experts, g of them chosen, enough experts in them for the top-k."""
    G, g, E, K = m.moe_router_num_groups, m.moe_router_group_topk, m.num_experts, m.moe_router_topk
    if (G is None) != (g is None):
        given = "--moe-router-num-groups" if G is not None else "--moe-router-group-topk"
        raise ConfigError(f"{given} needs {'--moe-router-group-topk' if G is not None else '--moe-router-num-groups'} "
                          "too (group-limited routing)")
    if m.moe_router_topk_scaling_factor is not None and not m.moe_router_topk_scaling_factor > 0:
        raise ConfigError(f"--moe-router-topk-scaling-factor must be a positive number, got "
                          f"{m.moe_router_topk_scaling_factor}")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        raise ConfigError("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid (the bias moves "
                          "sigmoid scores, as in DeepSeek-V3 and Megatron-Core)")
    if m.moe_router_enable_expert_bias and not m.moe_router_bias_update_rate > 0:
        raise ConfigError(f"--moe-router-bias-update-rate must be a positive number, got {m.moe_router_bias_update_rate}")
    if G is None:
        return
    if G < 1 or E % G:
        raise ConfigError(f"--moe-router-num-groups {G} must divide --num-experts {E} (equal groups)")
    if not 1 <= g <= G:
        raise ConfigError(f"--moe-router-group-topk {g} must be between 1 and --moe-router-num-groups {G}")
    if K % g or K // g > E // G:
        raise ConfigError(f"--moe-router-topk {K} must be a multiple of --moe-router-group-topk {g} with at most "
                          f"{E // G} (the experts of a group) per group")


def validate_moe(cfg: Config, world_size: int) -> None:
    """Mixture-of-experts rules: experts over the expert-parallel ranks, top-k, the layer pattern."""
    m, p = cfg.model, cfg.parallel
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    if m.num_experts is not None and m.num_experts < 0:
        raise ConfigError(f"--num-experts must be a positive number, got {m.num_experts} (leave it out for a "
                          "dense model)")
    dp = data_parallel_size(p, world_size)
    if dp % ep:
        raise ConfigError(
            f"--expert-model-parallel-size {ep} does not divide the data-parallel size {dp} "
            "(expert parallelism is carved out of data parallelism)")
    if not m.num_experts:
        if ep != 1:
            raise ConfigError(f"--expert-model-parallel-size {ep} needs --num-experts")
        if m.moe_receive_buffer_factor is not None:
            raise ConfigError("--moe-receive-buffer-factor needs --num-experts (a mixture-of-experts model)")
        return
    if p.context_parallel_size > 1:
        raise ConfigError(
            f"--num-experts {m.num_experts} with --context-parallel-size {p.context_parallel_size} is not "
            "supported yet (the expert dispatch needs the whole sequence); use --context-parallel-size 1")
    E, K = m.num_experts, m.moe_router_topk
    if E % ep:
        raise ConfigError(f"--num-experts {E} is not divisible by --expert-model-parallel-size {ep}")
    if not 1 <= K <= E:
        raise ConfigError(f"--moe-router-topk {K} must be between 1 and --num-experts {E}")
    validate_router_groups(m)
    etp = p.expert_tensor_parallel_size or tp
    if etp != tp:
        raise ConfigError(
            f"--expert-tensor-parallel-size {etp}: only the tensor-parallel size ({tp}) is supported")
    if m.moe_ffn_size % tp:
        raise ConfigError(f"--moe-ffn-hidden-size {m.moe_ffn_size} is not divisible by "
                          f"--expert-tensor-parallel-size {tp}")
    freq = m.moe_layer_freq
    if isinstance(freq, tuple):
        if len(freq) != m.num_layers or any(f not in (0, 1) for f in freq):
            raise ConfigError(f"--moe-layer-freq {list(freq)}: give one 0 or 1 per layer "
                              f"({m.num_layers} layers)")
    elif freq < 1:
        raise ConfigError(f"--moe-layer-freq {freq} must be a positive integer or a list pattern")
    mixed = len({m.is_moe_layer(i) for i in range(m.num_layers)}) > 1
    if mixed and p.pipeline_model_parallel_size > 1:
        raise ConfigError(
            f"--moe-layer-freq {freq} mixes dense and MoE layers, which --pipeline-model-parallel-size "
            f"{p.pipeline_model_parallel_size} does not support yet; use an all-MoE pattern (1)")
    if m.moe_expert_capacity_factor is not None and m.moe_expert_capacity_factor <= 0:
        raise ConfigError(f"--moe-expert-capacity-factor {m.moe_expert_capacity_factor} must be positive")
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    factor = m.moe_receive_buffer_factor
    if factor is not None:
        if not factor > 0:
            raise ConfigError(f"--moe-receive-buffer-factor {factor} must be positive (1.0: the rows a rank "
                              "sends, a perfectly balanced load)")
        if ep == 1 or m.moe_token_dispatcher_type != "alltoall":
            raise ConfigError(f"--moe-receive-buffer-factor sizes the alltoall dispatcher's receive buffers, "
                              f"which --expert-model-parallel-size {ep} with --moe-token-dispatcher-type "
                              f"{m.moe_token_dispatcher_type} does not have; use --expert-model-parallel-size > 1 "
                              "and --moe-token-dispatcher-type alltoall, or leave it out")


def validate_pipeline(cfg: Config, world_size: int) -> None:
    """The pipeline rules (layer split, schedule, microbatch count); see mlm_jax/pipeline/layout.py.

    Refused with the numbers named: layers not divisible over the stages (or virtual stages),
    an uneven split that does not add up, virtual stages or an uneven split with pipeline size
    1, both virtual-stage flags at once, a schedule that does not match the virtual stages, and
    too few microbatches (or not a multiple of the pipeline size) for the interleaved schedule.
    """
    pipeline_plan(cfg, world_size)


def _check_recompute(m: ModelConfig) -> None:
    """Megatron's rules: --recompute-method needs full granularity, and its layer count >= 1."""
    if m.recompute_modules and m.recompute_granularity != "selective":
        raise ConfigError(f"--recompute-modules {' '.join(m.recompute_modules)} needs --recompute-granularity "
                          f"selective, as in Megatron-LM (got {m.recompute_granularity})")
    if m.recompute_method is not None and m.recompute_granularity != "full":
        raise ConfigError(f"--recompute-method {m.recompute_method} needs --recompute-granularity full "
                          f"(got {m.recompute_granularity})")
    if m.recompute_num_layers is not None:
        if m.recompute_method is None:
            raise ConfigError("--recompute-num-layers needs --recompute-method uniform | block")
        if m.recompute_num_layers < 1 and m.recompute_method == "uniform":
            raise ConfigError(f"--recompute-num-layers {m.recompute_num_layers}: must be 1 or more")
        if m.recompute_num_layers < 0:
            raise ConfigError(f"--recompute-num-layers {m.recompute_num_layers}: must be 0 or more")
