"""Typed, frozen configuration for every component.

Each component owns one dataclass; `Config` groups them. Flags map onto these fields in one
table (`mlm_jax/arguments.py`); presets are Python functions (`mlm_jax/models/presets.py`).
`mlm_jax.validation.finalize` fills the derived fields and checks every cross-field rule before
anything is compiled (each error names the values and the rule). This module imports only
`mlm_jax.errors` (whose `ConfigError` it hands on to the modules that take it with the config).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from mlm_jax.errors import ConfigError


# fp8 (mlm_jax/models/fp8.py): the formats of Megatron's --fp8-format, and the recipes built.
FP8_FORMATS = ("e4m3", "hybrid")
# Megatron's --recompute-modules (with selective; models/recompute.py recomputes each)
RECOMPUTE_MODULES = ("core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts")
FP8_RECIPES = ("tensorwise", "delayed")


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
    padded_vocab_size: int | None = None  # set by `validation.finalize`; what the embedding is built with
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
    # Megatron's --apply-layernorm-1p (zero-centered gamma): every norm's weight is stored as
    # w - 1 (initialised to zeros) and applied as (1 + w); LayerNorm and RMSNorm.
    apply_layernorm_1p: bool = False
    rotary_percent: float = 1.0  # rope on the first rotary_percent x head_dim channels of each head
    # Llama 3.1's rope frequency scaling (Megatron's --use-rope-scaling, Hugging Face's
    # rope_type "llama3"): long wavelengths slowed by the factor, short ones kept, a smooth
    # blend between; see `rotary` in mlm_jax/models/layers.py. Off by default.
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    rope_scaling_low_freq_factor: float = 1.0
    rope_scaling_high_freq_factor: float = 4.0
    rope_scaling_original_max_position_embeddings: int = 8192
    # Multi-latent attention (DeepSeek-V2/V3; Megatron's --multi-latent-attention and its MLA
    # flags, mlm_jax/models/mla.py): queries (through a rank-q_lora_rank latent when given) and
    # keys/values from one rank-kv_lora_rank latent per token; each head's query and key are
    # qk_head_dim channels without position plus qk_pos_emb_head_dim with rope (the key's rope
    # part shared by the heads), its value v_head_dim channels. `qk_layernorm`: norms on the
    # latents. Rope: `rope_type` None means YaRN for MLA (Megatron's), with
    # `rotary_scaling_factor`, `mscale`, `mscale_all_dim` and the original positions below.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    qk_layernorm: bool = False
    rope_type: Literal["rope", "yarn"] | None = None
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    yarn_original_max_position_embeddings: int = 4096  # MLATransformerConfig's; Megatron has no flag for MLA's
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    # Multi-token prediction (--mtp-num-layers D, mlm_jax/models/mtp.py): D more layers predicting
    # the tokens 2..D+1 ahead, their losses x mtp_loss_scaling_factor / D added to the objective.
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1
    # full | selective (Megatron's); dots | offload (mlm_jax's): see mlm_jax/models/recompute.py
    recompute_granularity: Literal["full", "selective", "dots", "offload"] | None = None
    recompute_method: Literal["uniform", "block"] | None = None  # with full only
    recompute_num_layers: int | None = None  # uniform: group size; block: checkpointed layers
    # With selective: Megatron's --recompute-modules (RECOMPUTE_MODULES)
    recompute_modules: tuple[str, ...] | None = None
    bf16: bool = False
    fp16: bool = False  # fp16 compute, fp32 master params and optimizer state, loss scaling (loss_scale.py)
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
    # DeepSeek's group-limited routing (--moe-router-num-groups, --moe-router-group-topk): the
    # experts in groups, a token's top-k taken within its best `group_topk` groups (a group's score:
    # the sum of its top k / group_topk experts' scores); None: over all experts.
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_topk_scaling_factor: float | None = None  # the routing weights times this (DeepSeek-V3: 2.5)
    # Aux-loss-free balancing (--moe-router-enable-expert-bias): a per-expert bias added to the
    # sigmoid scores for the top-k choice only, moved after each step by the update rate towards
    # the mean load (models/moe.py `updated_bias`).
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_expert_capacity_factor: float | None = None  # None: dropless
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "alltoall"
    # (mlm_jax) the rows an expert-parallel rank's receive buffer holds, as a multiple of the rows
    # it sends (tokens x top-k); rows beyond it are dropped (parallel/experts.py `within`). None:
    # the worst case (ep x the rows sent), which never drops.
    moe_receive_buffer_factor: float | None = None
    moe_grouped_gemm: bool = True  # the experts' grouped-GEMM kernel on NVIDIA GPUs (else XLA's ragged_dot)
    # fp8 matmuls (Megatron's --fp8-* flags; mlm_jax/models/fp8.py): None, or one of FP8_FORMATS
    # (e5m2 gradients); the recipe is Megatron's name (only "tensorwise" is built).
    fp8_format: Literal["e4m3", "hybrid"] | None = None
    fp8_recipe: Literal["tensorwise", "delayed"] = "delayed"  # FP8_RECIPES (Megatron's default)
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1  # delayed: the amax history's length (Megatron's default 1)
    fp8_amax_compute_algo: Literal["most_recent", "max"] = "most_recent"  # delayed: which entry scales
    fp8_wgrad: bool = True  # the weight gradient's product in fp8 too
    fp8_param_gather: bool = False  # ZeRO gathers the projections' weights in fp8
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1

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
        """A head's query/key channels (MLA: the no-position and rope parts together)."""
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim
        return self.kv_channels or self.hidden_size // self.num_attention_heads

    @property
    def value_head_dim(self) -> int:
        """A head's value (and attention output) channels."""
        return self.v_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def attention_weights(self) -> int:
        """One layer's attention projection weights: the multiply-adds per token (QKV and output;
        MLA's down and up projections)."""
        d, h, k = self.hidden_size, self.num_attention_heads, self.head_dim
        if not self.multi_latent_attention:
            return d * (h + 2 * self.query_groups) * k + h * k * d
        q = d * h * k if self.q_lora_rank is None else self.q_lora_rank * (d + h * k)
        kv = d * (self.kv_lora_rank + self.qk_pos_emb_head_dim) + self.kv_lora_rank * h * (self.qk_head_dim + self.v_head_dim)
        return q + kv + h * self.v_head_dim * d

    @property
    def attention_core_width(self) -> int:
        """Per query token and key, the multiply-adds of a layer's scores and weighted sum:
        heads x (query/key channels + value channels)."""
        return self.num_attention_heads * (self.head_dim + self.value_head_dim)

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
    # Megatron-FSDP (--use-megatron-fsdp, --data-parallel-sharding-strategy): how much of the
    # training state data parallelism splits over `data` (`sharding_strategy`; mlm_jax/parallel/fsdp.py).
    use_megatron_fsdp: bool = False
    data_parallel_sharding_strategy: Literal["no_shard", "optim", "optim_grads", "optim_grads_params"] = "optim_grads_params"
    use_torch_fsdp2: bool = False  # --use-torch-fsdp2: the same FSDP (use_megatron_fsdp is set too)
    # --num-distributed-optimizer-instances: hybrid sharding, the data-parallel ranks in this many
    # groups (the mesh's `replica` axis); the state is split within a group, copied across.
    num_distributed_optimizer_instances: int = 1
    # Megatron's --grad-reduce-in-bf16: the data-parallel gradient reduction in bf16 (where the
    # step reduces once per step: mlm_jax/step.py `reduce_once_loss_and_grads`).
    grad_reduce_in_bf16: bool = False
    # --overlap-grad-reduce: each layer's gradient reduced in the last microbatch's backward
    # (mlm_jax/parallel/data.py `overlaps_grad_reduce`); with --overlap-param-gather, XLA's GPU
    # scheduler flags (mlm_jax/xla_flags.py).
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    # Pipeline schedule (mlm_jax/pipeline/): None picks Megatron's default (1F1B; interleaved
    # when virtual stages are given).
    pipeline_schedule: Literal["gpipe", "1f1b", "interleaved"] | None = None
    virtual_pipeline_model_parallel_size: int | None = None  # virtual chunks per pipeline rank
    num_layers_per_virtual_pipeline_stage: int | None = None
    decoder_first_pipeline_num_layers: int | None = None
    decoder_last_pipeline_num_layers: int | None = None

    @property
    def sharding_strategy(self) -> str:
        """What data parallelism splits over `data` (Megatron-FSDP's names): `no_shard` nothing,
        `optim` the optimizer state (ZeRO-1: --use-distributed-optimizer), `optim_grads` the
        gradients too (ZeRO-2), `optim_grads_params` the parameters too (ZeRO-3)."""
        if self.use_megatron_fsdp:
            return self.data_parallel_sharding_strategy
        return "optim" if self.use_distributed_optimizer else "no_shard"


SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")


@dataclass(frozen=True)
class OptimConfig:
    # Megatron-LM's defaults (docs/megatron/flags.md); --lr has none there (it is required): 1e-3 here.
    # The no-flag default run sets its own schedule explicitly (arguments.DEFAULT_RUN).
    lr: float = 1e-3
    min_lr: float = 0.0
    lr_decay_style: Literal["constant", "linear", "cosine", "WSD"] = "linear"
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # None: train_iters
    lr_wsd_decay_iters: int | None = None  # WSD: length of the final decay; None: 10% of decay
    lr_wsd_decay_style: Literal["linear", "cosine", "exponential"] = "linear"
    # Sample-based schedule (with TrainConfig.train_samples; Megatron never mixes the two kinds).
    lr_warmup_samples: int = 0
    lr_decay_samples: int | None = None  # None: train_samples
    lr_wsd_decay_samples: int | None = None
    lr_warmup_fraction: float | None = None  # warmup = fraction x decay length (iterations or samples)
    lr_warmup_init: float = 0.0  # the warmup starts here (Megatron's --lr-warmup-init)
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    # Megatron's --decoupled-lr / --decoupled-min-lr: the input embedding and output layer follow
    # the same schedule with these peak / final rates (None: --lr / --min-lr).
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    # Loss scaling (mlm_jax/loss_scale.py), Megatron's flags: a static scale when given, else
    # dynamic under --fp16.
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


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
    # TikTokenizer (Megatron's): split pattern v1 | v2, the reserved special ids before the ranks,
    # and the named special tokens (None: Megatron's <unk> <s> </s> <mask> <pad> <cls> <sep>).
    tiktoken_pattern: Literal["v1", "v2"] = "v2"
    tiktoken_num_special_tokens: int = 1000
    tokenizer_special_tokens: tuple[str, ...] | None = None
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
    train_iters: int = 300  # derived from train_samples when that is set (`validation.finalize`)
    train_samples: int | None = None  # sample-based training (mlm_jax/batch_schedule.py)
    rampup_batch_size: tuple[int, int, int] | None = None  # (start, increment, ramp-up samples)
    step_batch_size_schedule: str | None = None  # Megatron's "THRESHOLD:BS ..." (thresholds in tokens)
    seed: int = 1234
    # Megatron-LM's intervals (its eval interval was 1000 until late 2025; it now has none, i.e.
    # no periodic validation: give --eval-interval to choose); the default run sets its own.
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 100
    eval_at_start: bool = False  # (mlm_jax) a validation pass before the first step (default run)
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
    # Whether --seq-length was given (flag or --config): --use-checkpoint-args takes the
    # checkpoint's otherwise, as Megatron-LM's load_args_from_checkpoint does.
    seq_length_given: bool = True
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
    """Microbatches per step, global batch / (micro batch x data-parallel size), on `world_size`
    devices before a mesh exists (the rules of `mlm_jax.validation`); a run reads it from its
    `mlm_jax.batch_layout.BatchLayout`. None while the sizes do not divide (`validate` says why)."""
    p, t = cfg.parallel, cfg.train
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    if model_parallel <= 0 or world_size % model_parallel or not t.global_batch_size:
        return None
    per_step = t.micro_batch_size * (world_size // model_parallel)
    if per_step <= 0 or t.global_batch_size % per_step:
        return None
    return t.global_batch_size // per_step
