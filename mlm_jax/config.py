"""Typed, frozen configuration for every component.

Each component owns one dataclass; `Config` groups them. Flags map onto these fields in one
table (`mlm_jax/arguments.py`); presets are Python functions (`mlm_jax/models/presets.py`).
`validate` checks every cross-field rule before anything is compiled, and each error names the
values and the rule.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from mlm_jax.errors import UsageError


class ConfigError(UsageError):
    """A configuration that cannot run; the message names the values and the rule."""


@dataclass(frozen=True)
class ModelConfig:
    # Defaults: the default run's small GPT (a few million parameters, minutes on a laptop CPU).
    num_layers: int = 4
    hidden_size: int = 128
    ffn_hidden_size: int | None = None  # None: 4 * hidden (GELU) or Megatron's SwiGLU size
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None: multi-head attention (groups = heads)
    kv_channels: int | None = None  # head dim; None: hidden / heads
    vocab_size: int = 8192  # the tokenizer's true vocab size
    padded_vocab_size: int | None = None  # set by `finalize`; what the embedding is built with
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int = 256
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    rotary_base: float = 10000.0
    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    openai_gelu: bool = False  # tanh-approximated GELU (GPT-2's); default is exact erf GELU
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    # full | selective (Megatron's); dots | offload (mlm_jax's): see mlm_jax/models/recompute.py
    recompute_granularity: Literal["full", "selective", "dots", "offload"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None  # with full only
    recompute_num_layers: int | None = None  # uniform: group size; block: checkpointed layers
    bf16: bool = False
    # Megatron's --attention-backend: flash/fused = cuDNN's fused kernel, unfused/local = XLA's
    # einsums, auto = cuDNN where it applies (mlm_jax/models/attention.py).
    attention_backend: Literal["auto", "flash", "fused", "unfused", "local"] = "auto"
    # Mixture of experts (mlm_jax/models/moe.py), Megatron's --num-experts / --moe-* flags.
    num_experts: int | None = None  # None: every layer dense
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # None: ffn_size
    moe_layer_freq: int | tuple[int, ...] = 1  # N: every Nth layer (0, N, 2N, ...); or a 0/1 per layer
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_pre_softmax: bool = False
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    moe_grouped_gemm: bool = True  # experts always run as one grouped matmul here

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer `index` (0-based) is a mixture-of-experts layer (--moe-layer-freq)."""
        if not self.num_experts:
            return False
        freq = self.moe_layer_freq
        return bool(freq[index]) if isinstance(freq, tuple) else index % freq == 0

    @property
    def moe_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.swiglu:
            # Megatron/Llama: 2/3 of 4h, rounded up to a multiple of 64.
            return int(math.ceil(int(8 * self.hidden_size / 3) / 64) * 64)
        return 4 * self.hidden_size

    @property
    def vocab(self) -> int:
        """The embedding's row count: the padded vocab once finalized, else the true vocab."""
        return self.padded_vocab_size or self.vocab_size


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    cp_comm_type: Literal["p2p", "allgather", "a2a"] = "p2p"  # context-parallel attention (mlm_jax/parallel/)
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # None: the tensor-parallel size (Megatron)
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    # Pipeline schedule (mlm_jax/pipeline/): None picks Megatron's default (1F1B; interleaved
    # when virtual stages are given).
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved"] | None = None
    virtual_pipeline_model_parallel_size: int | None = None  # virtual chunks per pipeline rank
    num_layers_per_virtual_pipeline_stage: int | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_decay_style: Literal["constant", "linear", "cosine", "WSD"] = "cosine"
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # None: train_iters
    lr_wsd_decay_iters: int | None = None  # WSD: length of the final decay; None: 10% of decay
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential"] = "linear"
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8


@dataclass(frozen=True)
class DataConfig:
    # Megatron's `--data-path`: prefixes, optionally each preceded by a weight.
    data_path: tuple[str, ...] = ()
    train_data_path: tuple[str, ...] = ()
    valid_data_path: tuple[str, ...] = ()
    test_data_path: tuple[str, ...] = ()
    split: str = "969,30,1"
    data_cache_path: str | None = None
    mock_data: bool = False
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    prefetch: int = 2  # batches the loader runs ahead of the step

    @property
    def uses_default_corpus(self) -> bool:
        return not (self.mock_data or self.data_path or self.train_data_path)


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int | None = None  # None: micro * dp (no accumulation)
    seq_length: int = 128
    train_iters: int = 300
    seed: int = 1234
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 10
    check_for_nan_in_loss_and_grad: bool = True
    tensorboard_dir: str | None = None
    metrics_file: str | None = None
    run_dir: str | None = None  # None: runs/<timestamp>
    peak_flops: float | None = None  # per device; None: measured matmul peak
    progress_bar: bool = True
    sample_tokens: int = 64  # greedy sample length printed at the end (0: none)


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving, loading and clean exits (mlm_jax/checkpoint.py); Megatron's flag names."""

    save: str | None = None  # None: the final checkpoint goes to <run dir>/checkpoints
    load: str | None = None
    save_interval: int | None = None  # iterations between saves (None: only at the end / exit)
    keep_last: int | None = None  # keep the newest N checkpoints of --save (None: all)
    async_save: bool = True  # write in the background; the step blocks only for the copy
    save_optim: bool = True
    save_rng: bool = True
    final_checkpoint: bool = True  # save when training ends
    load_optim: bool = True
    load_rng: bool = True
    finetune: bool = False  # weights only, from iteration 0
    exit_on_missing_checkpoint: bool = False
    ckpt_step: int | None = None  # load this iteration instead of the latest
    use_checkpoint_args: bool = False  # model sizes (and tokenizer) from the checkpoint
    exit_signal_handler: bool = False  # SIGTERM: save and exit 0
    exit_interval: int | None = None  # save and exit when iteration % N == 0
    exit_duration_in_mins: float | None = None  # save and exit after this much wall time


@dataclass(frozen=True)
class DistributedConfig:
    """Joining the processes of a multi-host run (mlm_jax/distributed.py).

    Unset fields come from MLM_JAX_COORDINATOR_ADDRESS / MLM_JAX_NUM_PROCESSES /
    MLM_JAX_PROCESS_ID / MLM_JAX_COORDINATOR_TIMEOUT, then from SLURM (srun); else one process.
    """

    coordinator_address: str | None = None  # HOST:PORT where process 0 runs the coordinator
    num_processes: int | None = None
    process_id: int | None = None
    coordinator_timeout: float | None = None  # seconds to reach it and for all to join (300)
    peer_timeout: float | None = None  # seconds without a peer's heartbeat before stopping (20)


@dataclass(frozen=True)
class InstrumentsConfig:
    """Timers, slow-iteration warnings, profiler traces, Weights & Biases (mlm_jax/instruments.py)."""

    slow_iteration_factor: float = 3.0  # warn above this x the running median (0: never)
    profile: bool = False
    profile_step_start: int = 10  # Megatron's defaults: iterations 11..12 are traced
    profile_step_end: int = 12
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    instruments: InstrumentsConfig = field(default_factory=InstrumentsConfig)

    def replace(self, **sections) -> "Config":
        return dataclasses.replace(self, **sections)


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Megatron's `_vocab_size_with_padding`: round up to a multiple of divisible_by * tp."""
    multiple = divisible_by * tensor_parallel_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def data_parallel_size(parallel: ParallelConfig, world_size: int) -> int:
    """Megatron's rule: dp = world / (tp * pp * cp)."""
    model_parallel = (
        parallel.tensor_model_parallel_size
        * parallel.pipeline_model_parallel_size
        * parallel.context_parallel_size
    )
    if model_parallel <= 0 or world_size % model_parallel:
        raise ConfigError(
            f"device count {world_size} is not divisible by tensor ({parallel.tensor_model_parallel_size})"
            f" x pipeline ({parallel.pipeline_model_parallel_size}) x context "
            f"({parallel.context_parallel_size}) = {model_parallel}; the device count must be a "
            "multiple of the model-parallel size"
        )
    return world_size // model_parallel


def num_microbatches(cfg: Config, world_size: int) -> int | None:
    """Microbatches per step, global batch / (micro batch x data-parallel size): the one place
    it is computed. None while the sizes do not divide (`validate` says why)."""
    p, t = cfg.parallel, cfg.train
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    if model_parallel <= 0 or world_size % model_parallel or not t.global_batch_size:
        return None
    per_step = t.micro_batch_size * (world_size // model_parallel)
    if per_step <= 0 or t.global_batch_size % per_step:
        return None
    return t.global_batch_size // per_step


def finalize(cfg: Config, world_size: int) -> Config:
    """Fill derived fields (padded vocab, global batch) and validate against the device count."""
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
    cfg = cfg.replace(model=model, train=train)
    validate(cfg, world_size)
    return cfg


def _positive(name: str, value) -> None:
    if value is None or value <= 0:
        raise ConfigError(f"{name} must be a positive number, got {value}")


def validate(cfg: Config, world_size: int) -> None:
    """Check every rule that would otherwise fail deep inside compilation (or silently)."""
    m, p, t, o = cfg.model, cfg.parallel, cfg.train, cfg.optim
    for name, value in [
        ("--num-layers", m.num_layers),
        ("--hidden-size", m.hidden_size),
        ("--num-attention-heads", m.num_attention_heads),
        ("--vocab-size", m.vocab_size),
        ("--seq-length", t.seq_length),
        ("--max-position-embeddings", m.max_position_embeddings),
        ("--micro-batch-size", t.micro_batch_size),
        ("--train-iters", t.train_iters),
        ("--log-interval", t.log_interval),
        ("--tensor-model-parallel-size", p.tensor_model_parallel_size),
        ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size),
        ("--context-parallel-size", p.context_parallel_size),
        ("--expert-model-parallel-size", p.expert_model_parallel_size),
        ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by),
        ("--ffn-hidden-size", m.ffn_size),
        ("--eval-iters", t.eval_iters),
        ("--eval-interval", t.eval_interval),
    ]:
        _positive(name, value)

    validate_pipeline(cfg, world_size)
    validate_context_parallel(cfg)
    validate_moe(cfg, world_size)

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
    _check_recompute(m)
    for name, rate in [("--hidden-dropout", m.hidden_dropout), ("--attention-dropout", m.attention_dropout)]:
        if not 0.0 <= rate < 1.0:
            raise ConfigError(f"{name} must be in [0, 1), got {rate}")
    gbs = t.global_batch_size
    per_step = t.micro_batch_size * dp
    if gbs is None or gbs <= 0 or gbs % per_step:
        raise ConfigError(
            f"--global-batch-size {gbs} is not divisible by --micro-batch-size "
            f"{t.micro_batch_size} x data-parallel size {dp} = {per_step}"
        )
    validate_numbers(cfg)
    if o.min_lr > o.lr:
        raise ConfigError(
            f"need 0 <= --min-lr ({o.min_lr}) <= --lr ({o.lr}): the schedule decays from --lr to --min-lr"
        )
    decay = o.lr_decay_iters if o.lr_decay_iters is not None else t.train_iters
    if o.lr_warmup_iters < 0 or (o.lr_decay_style != "constant" and o.lr_warmup_iters > decay):
        raise ConfigError(
            f"--lr-warmup-iters {o.lr_warmup_iters} must be between 0 and --lr-decay-iters {decay}"
        )
    if not (0.0 <= o.adam_beta1 < 1.0 and 0.0 <= o.adam_beta2 < 1.0):
        raise ConfigError(
            f"--adam-beta1 {o.adam_beta1} and --adam-beta2 {o.adam_beta2} must be in [0, 1)"
        )
    validate_attention_backend(m, cfg.data.reset_attention_mask)
    validate_checkpoint(cfg.checkpoint)
    validate_instruments(cfg.instruments)


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
    if m.attention_backend in ("flash", "fused"):
        raise ConfigError(
            f"--attention-backend {m.attention_backend} with --context-parallel-size {cp}: the "
            "context-parallel blocks run XLA attention; use --attention-backend auto or unfused")


ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


def fused_attention_obstacle(m: ModelConfig, documents: bool) -> str | None:
    """Why cuDNN's fused attention cannot run this model (None: it can, on an NVIDIA GPU)."""
    if not m.bf16:
        return "cuDNN fused attention needs bf16 compute (add --bf16)"
    if m.attention_dropout > 0:
        return f"cuDNN fused attention has no attention dropout (--attention-dropout {m.attention_dropout}; set 0)"
    if documents:
        return "cuDNN fused attention cannot mask documents (--reset-attention-mask)"
    if m.head_dim % 8 or m.head_dim > 128:
        return f"cuDNN fused attention needs a head dim that is a multiple of 8 and <= 128, got {m.head_dim}"
    return None


def validate_attention_backend(m: ModelConfig, documents: bool) -> None:
    """--attention-backend flash/fused where cuDNN cannot run is refused here, before compiling
    (the platform is checked when the model is placed on devices)."""
    if m.attention_backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"--attention-backend {m.attention_backend!r} is unknown; choose one of "
                          f"{', '.join(ATTENTION_BACKENDS)}")
    if m.attention_backend in ("flash", "fused"):
        why = fused_attention_obstacle(m, documents)
        if why:
            raise ConfigError(f"--attention-backend {m.attention_backend}: {why}; or use "
                              "--attention-backend auto (cuDNN where it applies, XLA otherwise) or unfused")


def _bounded(flag: str, value, rule: str) -> None:
    """`rule` is '> 0' or '>= 0'; None means unset. NaN and infinities are refused too."""
    if value is None:
        return
    ok = math.isfinite(value) and (value > 0 if rule == "> 0" else value >= 0)
    if not ok:
        raise ConfigError(f"{flag} must be {rule}, got {value}")


def validate_numbers(cfg: Config) -> None:
    """Sign and finiteness of the numeric flags that `validate`'s other rules do not cover
    (Megatron's scheduler asserts 0 <= min_lr <= lr; NumPy seeds are 32-bit unsigned), and
    the --split syntax, so a bad value stops the run before any data or compile work."""
    m, o, t = cfg.model, cfg.optim, cfg.train
    for flag, value, rule in [
        ("--lr", o.lr, ">= 0"), ("--min-lr", o.min_lr, ">= 0"),
        ("--weight-decay", o.weight_decay, ">= 0"), ("--clip-grad", o.clip_grad, ">= 0"),
        ("--adam-eps", o.adam_eps, "> 0"), ("--lr-decay-iters", o.lr_decay_iters, "> 0"),
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


def validate_moe(cfg: Config, world_size: int) -> None:
    """Mixture-of-experts rules: experts over the expert-parallel ranks, top-k, the layer pattern."""
    m, p = cfg.model, cfg.parallel
    ep, tp = p.expert_model_parallel_size, p.tensor_model_parallel_size
    dp = data_parallel_size(p, world_size)
    if dp % ep:
        raise ConfigError(
            f"--expert-model-parallel-size {ep} does not divide the data-parallel size {dp} "
            "(expert parallelism is carved out of data parallelism)")
    if not m.num_experts:
        if ep != 1:
            raise ConfigError(f"--expert-model-parallel-size {ep} needs --num-experts")
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


def validate_pipeline(cfg: Config, world_size: int) -> None:
    """The pipeline rules (layer split, schedule, microbatch count); see mlm_jax/pipeline/layout.py.

    Refused with the numbers named: layers not divisible over the stages (or virtual stages),
    an uneven split that does not add up, virtual stages or an uneven split with pipeline size
    1, both virtual-stage flags at once, a schedule that does not match the virtual stages, and
    too few microbatches (or not a multiple of the pipeline size) for the interleaved schedule.
    """
    pipeline_plan(cfg, world_size)


def pipeline_plan(cfg: Config, world_size: int | None = None):
    """(schedule name, layer layout) of a config; ConfigError naming the numbers if invalid."""
    from mlm_jax.pipeline.layout import PipelinePlanError, plan_pipeline

    p = cfg.parallel
    m = None if world_size is None else num_microbatches(cfg, world_size)
    try:
        return plan_pipeline(
            num_layers=cfg.model.num_layers,
            pipeline_size=p.pipeline_model_parallel_size,
            schedule=p.pipeline_schedule,
            virtual_stages=p.virtual_pipeline_model_parallel_size,
            layers_per_virtual_stage=p.num_layers_per_virtual_pipeline_stage,
            first_stage_layers=p.decoder_first_pipeline_num_layers,
            last_stage_layers=p.decoder_last_pipeline_num_layers,
            num_microbatches=m,
        )
    except PipelinePlanError as e:
        raise ConfigError(str(e)) from None


def _check_recompute(m: ModelConfig) -> None:
    """Megatron's rules: --recompute-method needs full granularity, and its layer count >= 1."""
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
