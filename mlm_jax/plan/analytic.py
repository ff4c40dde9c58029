"""The analytic model of one training step: bytes per device (parameters, gradients, optimizer
state, activations, logits), bytes each mesh axis moves, the pipeline bubble and a predicted step
time. Pure Python (no jax): `python -m mlm_jax.plan --search` ranks thousands of layouts with it
and compiles only the best few.

Sources (each term's docstring says which it follows):

- [K] Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv 2205.05198): activations per layer `s*b*h*(34 + 5*a*s/h)` bytes (section 4.1, eq. 1),
  `s*b*h*(10 + 24/t + 5*a*s/(h*t))` with tensor parallelism (eq. 2), divided by t with sequence
  parallelism (eq. 4); selective recompute keeps `34*s*b*h/t` (eq. 5 without the s^2 term);
  full recompute keeps `2*s*b*h` per layer (section 5); the logits `4*s*b*v/t` (section 4.3);
  the first pipeline stage holds p microbatches (1F1B) and `p*(1 + (p-1)/(p*v))` interleaved
  (section 4.2.3).
- [N] Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
  Using Megatron-LM" (arXiv 2104.04473): the bubble `(p-1)/(m*v + p-1)` of the step (sections
  2.2.1-2.2.2: `(p-1)/m` of ideal time, `/v` interleaved); training FLOPs
  `72*B*s*L*h^2*(1 + s/(6h) + V/(12hL))` (appendix, eq. 3; 96 instead of 72 with recompute);
  tensor parallelism's two all-reduces per layer in forward and two in backward (section 2.3).
- [R] Rajbhandari et al. 2020, ZeRO (arXiv 1910.02054): mixed-precision Adam keeps `2 + 2 + 12`
  bytes per parameter (bf16 weights, bf16 gradients, fp32 master + two moments); stage 1 divides
  the 12 by the data-parallel size (section 3 and 5.1).
- [C] ring collectives: an all-reduce of n bytes over g devices sends `2*n*(g-1)/g` per device,
  an all-gather or reduce-scatter `n*(g-1)/g` (Thakur et al. 2005; NCCL's ring algorithm).

Where mlm_jax differs from Megatron, the mlm_jax program is modelled (these are what compiled
memory is calibrated against, `benchmarks/RESULTS.md`):

- parameters are fp32 masters (4 bytes), optimizer state two fp32 moments (8 bytes); with
  --use-distributed-optimizer both are sharded over data (mlm_jax/sharding/rules.py); the step
  gathers a bf16 (or fp16) compute copy of the stage's weights (2 bytes each) and accumulates
  fp32 gradients once per step (4 bytes each, whole per device, reduced after the last
  microbatch), beside which a microbatch's weight gradients exist in the compute dtype (2 bytes
  each: the layer scan's backward returns them stacked before they are added; a pipeline's
  per-tick stage gradients are fp32, 4 bytes, without ZeRO): 4/dp + 8/dp + 2
  + 4 + 2 bytes per parameter with ZeRO, 4 + 8 + 2 + 4 + 2 without (the last term found by
  calibration: the compiled steps held 2 bytes per parameter more than the rest explained, at
  every micro batch size);
- the norms and the MLP activation keep only their inputs (mlm_jax/models/layers.py), so a
  layer without dropout keeps `32*s*b*h` bytes of [K]'s 34 (the two dropout masks go), and
  cuDNN's fused attention (the flags allow it: no attention dropout, bf16/fp16, not the XLA
  context-parallel rings) keeps Q, K, V, the output and a float per head and row instead of
  [K]'s `5*a*s^2*b`;
- the pipeline stashes only each in-flight unit's stage input and recomputes the stage's forward
  for its backward (mlm_jax/pipeline/runtime.py): `slots * 2*s*b*h` plus one unit's activations;
  its slots are counted from the schedule table itself (GPipe m, 1F1B 2*(P-1)+1, interleaved).

Assumptions of the time model, stated because they are assumptions: matmuls reach
`efficiency` (default 0.6) of the datasheet's dense bf16 peak (fp8 products of twice it:
`fp8_flops`); each layer costs a fixed 30 us
per microbatch beyond its FLOPs (kernel launches and small kernels, forward and backward: what
makes fewer, larger microbatches faster at equal FLOPs); tensor-, context- and
expert-parallel and pipeline transfers are exposed (not overlapped); the data-parallel gradient
reduction and ZeRO's gather overlap compute except where they take longer than it; a mesh axis
whose device groups stay inside a node moves at NVLink's bandwidth, otherwise at the node's
network bandwidth per GPU.
"""

from __future__ import annotations

import dataclasses
import math

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What the time model needs of a GPU and its links (bytes/s per GPU, one direction)."""

    name: str
    memory_bytes: int
    bf16_flops: float  # dense peak, FLOP/s
    nvlink_bytes: float  # per GPU inside a node
    network_bytes: float  # per GPU between nodes
    efficiency: float = 0.6  # fraction of peak the matmuls reach (an assumption)
    layer_overhead: float = 30e-6  # seconds per layer and microbatch, forward and backward (launches)


# NVLink: NVIDIA's datasheets' total bandwidth per GPU, halved for one direction (H100/H200 900
# GB/s, A100 600 GB/s, B200 1.8 TB/s). Network: one 400 Gb/s NDR InfiniBand port per GPU (DGX
# H100/H200/B200), 200 Gb/s HDR (DGX A100).
LINKS = {"h100": (450e9, 50e9), "h200": (450e9, 50e9), "a100": (300e9, 25e9), "b200": (900e9, 50e9)}


def hardware(gpu, nvlink_gbps: float | None = None, network_gbps: float | None = None,
             efficiency: float | None = None) -> Hardware:
    """`gpu` (a `targets.Gpu`) with its link bandwidths (GB/s overrides) and matmul efficiency."""
    nv, net = LINKS[gpu.name]
    return Hardware(gpu.name, gpu.memory_bytes, gpu.bf16_tflops * 1e12,
                    nvlink_gbps * 1e9 if nvlink_gbps else nv, network_gbps * 1e9 if network_gbps else net,
                    efficiency if efficiency else 0.6)


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to lay the step out on the cluster (the flags `--search` varies)."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1  # data-parallel size, expert ranks included (Megatron's)
    vp: int = 1  # virtual pipeline stages per rank
    sp: bool = False
    zero: bool = False
    # Megatron-FSDP's optim_grads / optim_grads_params (mlm_jax/parallel/fsdp.py): the layers'
    # gradients (and parameters) split over data too, gathered a layer at a time; None: neither.
    fsdp: str | None = None
    micro: int = 1
    microbatches: int = 1
    recompute: str | None = None  # None, "selective", "full" (uniform, 1 layer)
    # --num-distributed-optimizer-instances (hybrid sharding): the data-parallel ranks in groups
    # of dp / instances that split the state, each group a copy (the mesh's `replica` axis).
    instances: int = 1
    schedule: str | None = None  # pipeline schedule; None: 1f1b (v=1) / interleaved


def layout_of(cfg, world: int) -> Layout:
    """The `Layout` of a finalized `Config` on `world` devices."""
    from mlm_jax.config import data_parallel_size, num_microbatches

    p, m = cfg.parallel, cfg.model
    rec = m.recompute_granularity if m.recompute_granularity in ("full", "selective") else None
    vp = p.virtual_pipeline_model_parallel_size or 1  # or from the layers per chunk (the config is valid)
    if p.num_layers_per_virtual_pipeline_stage and p.pipeline_model_parallel_size > 1:
        vp = m.num_layers // (p.pipeline_model_parallel_size * p.num_layers_per_virtual_pipeline_stage)
    return Layout(tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size, cp=p.context_parallel_size,
                  ep=p.expert_model_parallel_size, dp=data_parallel_size(p, world),
                  vp=vp, sp=p.sequence_parallel,
                  zero=p.use_distributed_optimizer, micro=cfg.train.micro_batch_size,
                  fsdp=p.sharding_strategy if p.sharding_strategy in ("optim_grads", "optim_grads_params") else None,
                  microbatches=num_microbatches(cfg, world) or 1, recompute=rec, schedule=p.pipeline_schedule,
                  instances=p.num_distributed_optimizer_instances)


def one_instance(L: Layout) -> Layout:
    """The layout one hybrid-sharding instance runs (dp / instances ranks): its state split and
    its collectives over `data` are those of that smaller data-parallel group."""
    return dataclasses.replace(L, dp=L.dp // L.instances, instances=1)


# --------------------------------------------------------------------------- parameters


def norm_params(m) -> int:
    """A layer's two norms: a scale each, and a bias each for LayerNorm."""
    return 2 * m.hidden_size * (1 if m.normalization == "RMSNorm" else 2)


def layer_params(m, moe: bool) -> tuple[int, int, int]:
    """(split over tensor, replicated, split over experts x tensor) parameter counts of one layer.

    Attention: Q `h x a*d`, K and V `h x g*d` each, the output `a*d x h` (g: query groups, d:
    head dim); MLP `h x f` (`h x 2f` with SwiGLU) and `f x h`; biases where --add-bias-linear;
    two norms (scale, and bias for LayerNorm). A MoE layer's experts hold E MLPs and a router `h x E`.
    """
    h, d, a, g = m.hidden_size, m.head_dim, m.num_attention_heads, m.query_groups
    bias = m.add_bias_linear
    attn = m.attention_weights + (bias and not m.multi_latent_attention and (a + 2 * g) * d)
    norms = norm_params(m)
    rep = norms + (bias and h)  # the attention output's bias (row parallel) is whole on every rank
    if m.multi_latent_attention:  # the down projections and the latents' norms are whole on every rank
        down = h * ((m.q_lora_rank or 0) + m.kv_lora_rank + m.qk_pos_emb_head_dim)
        attn -= down
        rep += down + (m.qk_layernorm and ((m.q_lora_rank or 0) + m.kv_lora_rank) * (1 if m.normalization == "RMSNorm" else 2))
    gate = 2 if m.swiglu else 1

    def mlp(f):
        return h * f * gate + f * h + (bias and f * gate)

    if moe:
        experts = m.num_experts * (mlp(m.moe_ffn_size) + (bias and h))
        shared = mlp(m.moe_shared_expert_intermediate_size) if m.moe_shared_expert_intermediate_size else 0
        return attn + shared, rep + h * m.num_experts, experts
    return attn + mlp(m.ffn_size), rep + (bias and h), 0  # and fc2's bias


def embedding_params(m) -> tuple[int, int]:
    """(split over tensor, replicated): the vocab-parallel word embedding `V x h` (and the untied
    head `h x V`), learned positions `max_pos x h`, the final norm."""
    tied = 1 if not m.untie_embeddings_and_output_weights else 2
    pos = m.max_position_embeddings * m.hidden_size if m.position_embedding_type == "learned_absolute" else 0
    return tied * m.vocab * m.hidden_size, pos + m.hidden_size * (1 if m.normalization == "RMSNorm" else 2)


def total_params(m) -> int:
    """Parameters of the whole model (what Megatron prints as the model's size)."""
    n = sum(embedding_params(m))
    for i in range(m.num_layers):
        n += sum(layer_params(m, m.is_moe_layer(i)))
    return n


def _layers_per_stage(m, pp: int) -> int:
    return math.ceil(m.num_layers / pp)


def param_counts(m, L: Layout) -> dict:
    """Parameter counts per device: `stored` (the fp32 masters before ZeRO shards them over data),
    `compute` (the stage's weights the step gathers; the gradient accumulator's size), `expert`
    (the experts' share of both: ZeRO shards it over data / ep ranks, not data)."""
    per_stage = _layers_per_stage(m, L.pp)
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    moe_stage = math.ceil(moe_layers / L.pp)
    t_dense, rep = 0, 0
    for moe, count in ((False, per_stage - moe_stage), (True, moe_stage)):
        if count:
            a, b, _ = layer_params(m, moe)
            t_dense, rep = t_dense + count * a, rep + count * b
    experts = moe_stage * layer_params(m, True)[2] if moe_stage else 0
    emb_t, emb_rep = embedding_params(m)
    # Embeddings: stored split over pipe (and tensor); a tied table gathered whole on every stage,
    # an untied head computed in vocab blocks over pipe (mlm_jax/pipeline/runtime.py).
    if m.untie_embeddings_and_output_weights:
        emb_compute = emb_t / 2 / L.tp + emb_t / 2 / L.tp / L.pp
    else:
        emb_compute = emb_t / L.tp
    layers_compute = t_dense / L.tp + rep
    expert_compute = experts / (L.tp * L.ep)
    compute = layers_compute + expert_compute + emb_compute + emb_rep
    stored = layers_compute + expert_compute + (emb_t / L.tp + emb_rep) / L.pp
    return {"stored": stored, "compute": compute, "expert": expert_compute, "layers": layers_compute + expert_compute}


# --------------------------------------------------------------------------- activations


def fused_attention(cfg, L: Layout) -> bool:
    """Whether the step runs cuDNN's fused attention (no s^2 scores kept): what the compiled GPU
    programs show (benchmarks/RESULTS.md, issue 25): not with attention dropout, fp32, the
    unfused or local backend, or document masks; with every context-parallel comm type."""
    m = cfg.model
    dtype_ok = cfg.model.bf16 or cfg.model.fp16
    return (m.attention_dropout == 0 and dtype_ok and m.attention_backend not in ("unfused", "local")
            and not cfg.data.reset_attention_mask)


def layer_activation_bytes(cfg, L: Layout, moe: bool = False) -> float:
    """Bytes one layer keeps for its backward, one microbatch, per device, without recompute.

    [K] eq. 1-4 term by term, per token (s/cp tokens of b rows per device), in 2-byte
    activations: the two norms' inputs (2h each, plus a float mean and 1/std per row) and
    outputs (2h each: the QKV and fc1 inputs), Q, K and V (2*a*d, 2*g*d twice), the attention
    output (2*a*d, the out-projection's input), the MLP activation's input (2f, 4f with SwiGLU)
    and the fc2 input (2f); a dropout mask (1h) per --hidden-dropout; unfused attention adds the
    scores [K]'s `5*a*s` (softmax output 2, dropout mask 1, dropout output 2; 2 without
    attention dropout); fused attention a float per head (the softmax statistics); all of it
    twice in an fp32 step (4-byte activations, the statistics included: an overestimate of 8
    bytes a row). With a
    GPT's sizes (f = 4h, g = a, no dropout, fused): 32h per token, [K]'s 34 less the two masks.
    Tensor parallelism splits all but the norms' (and masks') terms; sequence parallelism
    splits those too ([K] eq. 4). A MoE layer's MLP terms count each token top-k times (times
    `expert_padding`), plus the router's fp32 probabilities (4E) and the dispatched input and
    output (2h each per copy).
    """
    m = cfg.model
    h, d, a, g = m.hidden_size, m.head_dim, m.num_attention_heads, m.query_groups
    t = L.tp
    tokens = L.micro * cfg.train.seq_length / L.cp
    rep = 2 * (2 * h + 2 * h + 8 / h * h)  # two norms: input, output, mean and 1/std
    if m.hidden_dropout > 0:
        rep += 2 * h
    split = 2 * a * d + 2 * 2 * g * d + 2 * a * d  # Q, K, V, attention output
    if fused_attention(cfg, L):
        split += 4 * a
    elif L.recompute != "selective":  # selective recompute drops exactly this term ([K] 5)
        split += (5 if m.attention_dropout > 0 else 2) * a * cfg.train.seq_length
    gate = 2 if m.swiglu else 1
    if moe:
        f, k, pad = m.moe_ffn_size, m.moe_router_topk, expert_padding(cfg, L)
        split += pad * k * (2 * f * gate + 2 * f)
        rep += 4 * m.num_experts + pad * k * 2 * 2 * h  # router probabilities; dispatched in and out
    else:
        split += 2 * m.ffn_size * gate + 2 * m.ffn_size
    per_token = (rep + split) / t if L.sp else rep + split / t
    wide = 1 if (cfg.model.bf16 or cfg.model.fp16) else 2  # fp32 steps keep 4-byte activations
    return tokens * per_token * wide


def expert_padding(cfg, L: Layout) -> float:
    """How many rows a device's experts run per (token, choice) of its own: mlm_jax's dispatch has
    static shapes, so every destination's block is padded to its worst case
    (mlm_jax/parallel/experts.py): ep rows dropless (all-to-all: [ep, T*K] rows received, sent
    too where no ragged all-to-all sends exactly the rows; all-gather: the group's ep*T
    tokens); with a capacity factor cf, at most cf (an
    approximation of min(T*K, experts per rank x capacity) per destination)."""
    if L.ep == 1:
        return 1.0
    cf = cfg.model.moe_expert_capacity_factor
    return float(L.ep) if cf is None else min(float(L.ep), cf)


def f_gate(m) -> int:
    """The MLP activation's input width: f, or 2f (gate and up) with SwiGLU."""
    return m.ffn_size * (2 if m.swiglu else 1)


def layer_input_bytes(cfg, L: Layout) -> float:
    """One layer's input, one microbatch, per device: `2*s*b*h` ([K] section 5), /t with SP."""
    wide = 1 if (cfg.model.bf16 or cfg.model.fp16) else 2
    return 2 * wide * L.micro * cfg.train.seq_length / L.cp * cfg.model.hidden_size / (L.tp if L.sp else 1)


def stash_slots(schedule: str, P: int, m: int, V: int) -> int:
    """Stage inputs the pipeline keeps at its peak (the busiest stage), counted from the two-slot
    schedule table the runtime executes (mlm_jax/pipeline/lockstep.py), as `build_program` does:
    GPipe m, 1F1B 2*(P-1)+1 (at most m), interleaved from its table (chunk units)."""
    from mlm_jax.pipeline import lockstep

    table = lockstep.two_slot(schedule, P, m, V)
    live = [0] * P
    peak = [0] * P
    for fwd, bwd in table:
        for s, act in enumerate(fwd):
            if not act.is_idle and act.chunk * P + s:
                live[s] += 1
                peak[s] = max(peak[s], live[s])
        for s, act in enumerate(bwd):
            if not act.is_idle and act.chunk * P + s:
                live[s] -= 1
    return max(max(peak), 1)


def megatron_in_flight(schedule: str, P: int, m: int, V: int, stage: int) -> int:
    """Microbatches whose activations stage `stage` (0-based) of Megatron's schedules holds at
    its peak, in units of one chunk (1/V of the stage's layers): GPipe m, 1F1B min(P - s, m),
    interleaved min(2*(P-s-1) + (V-1)*P + 1, m*V) (its warm-up forwards plus one; on the first
    stage V*P + P - 1 chunks = P*(1 + (P-1)/(P*V)) stages' worth, [K] 4.2.3). For comparison:
    mlm_jax's pipeline keeps stage inputs instead (`stash_slots`)."""
    if schedule == "gpipe":
        return m * V
    if schedule == "1f1b":
        return min(P - stage, m)
    return min(2 * (P - stage - 1) + (V - 1) * P + 1, m * V)


def activation_bytes(cfg, L: Layout) -> dict:
    """Activations per device at the step's peak: the layers' (by recompute and pipeline) and the
    head's logits.

    - no pipeline: every layer of the microbatch keeps `layer_activation_bytes` (selective: the
      same without unfused attention's scores); full recompute keeps each layer's input
      (`2*s*b*h`, [K] section 5) and one layer's activations while it is recomputed, which
      exist only after the head's logits are freed (the peak holds the larger of the two);
    - pipeline: `stash_slots` stage inputs, plus one unit's (L/(p*v) layers) activations for the
      vjp alive at a time (full recompute inside it: their inputs plus one layer, which again
      exists only after the logits are freed). [K]'s first
      stage would hold p microbatches (1F1B) of every layer's activations: mlm_jax recomputes
      the stage instead (mlm_jax/pipeline/runtime.py);
    - logits: `4*s*b*V/t` fp32 ([K] section 4.3) and their fp32 gradient beside them, the
      head's peak, of one row chunk of mlm_jax's fused loss (`loss_chunks`: its gradient is
      computed in the forward, a chunk at a time).
    """
    m = cfg.model
    layers = _layers_per_stage(m, L.pp)
    moe = bool(m.num_experts)
    per_layer = layer_activation_bytes(cfg, L, moe)
    inp = layer_input_bytes(cfg, L)
    if L.pp > 1:
        unit_layers = math.ceil(layers / L.vp)
        schedule = L.schedule or ("interleaved" if L.vp > 1 else "1f1b")
        slots = stash_slots(schedule, L.pp, L.microbatches, L.vp)
        stash = slots * inp
        unit = unit_layers * inp + per_layer if L.recompute == "full" else unit_layers * per_layer
        layers_bytes = stash + unit
    elif L.recompute == "full":
        slots, layers_bytes = 0, layers * inp + per_layer
    else:
        slots, layers_bytes = 0, layers * per_layer
    chunks = loss_chunks(L.micro, cfg.train.seq_length // L.cp, m.vocab)
    tokens = L.micro * cfg.train.seq_length / L.cp
    logits = 8 * tokens * m.vocab / L.tp / (L.pp if m.untie_embeddings_and_output_weights else 1) / chunks
    if L.recompute == "full":
        # The one layer's recomputed activations exist only in the backward (of the step, or of a
        # pipeline's backward slot), after the head's chunks (their gradient computed in the
        # forward) are freed: the peak holds the larger. A MoE layer's are held while its
        # experts run, inside the experts' working set (`expert_working_bytes`): the larger
        # again (Mixtral pp4 x ep8, full recompute, 64 H100: 37.94 GiB compiled, 43.85 with the
        # sum, 37.64 with the larger).
        layers_bytes -= min(per_layer, max(logits, expert_working_bytes(cfg, L)))
    return {"layers": layers_bytes, "per_layer": per_layer, "stash_slots": slots, "logits": logits}


def loss_chunks(b: int, s: int, v: int, budget: int = 1 << 27, min_rows: int = 64) -> int:
    """Row chunks of mlm_jax's fused linear cross-entropy on a GPU (mlm_jax/models/gpt.py
    `_row_chunks`): halve the sequence while b*s*v/chunks > 2^27 logits, keeping >= 64 rows."""
    chunks = 1
    while b * s * v // chunks > budget and s % (2 * chunks) == 0 and s // (2 * chunks) >= min_rows:
        chunks *= 2
    return chunks


# --------------------------------------------------------------------------- memory


def memory(cfg, L: Layout) -> dict:
    """Bytes per device, by term ([R] with mlm_jax's fp32 masters, see the module docstring)."""
    if L.instances > 1:  # hybrid sharding: each instance holds what its dp / instances ranks would
        return memory(cfg, one_instance(L))
    n = param_counts(cfg.model, L)
    low = cfg.model.bf16 or cfg.model.fp16
    # ZeRO shards over the mesh's `data` axis alone (dp / ep ranks), the dense weights too: the
    # expert axis holds different experts, not copies (calibrated: Mixtral's pp4 x dp2 x ep8 state).
    shard = n["stored"] / max(L.dp // L.ep, 1) if L.zero else n["stored"]
    act = activation_bytes(cfg, L)
    out = {
        "parameters": 4 * shard,
        "optimizer_state": 8 * shard,
        "compute_copy": 2 * n["compute"] if low else 0,
        # The fp32 accumulator, whole per device; a step of one microbatch (no pipeline) has
        # none: each leaf's gradient is widened on its way into the reduction, one at a time
        # (350M GPT, 8 H100, global batch 32 at micro 4 x dp8: 3.53 GiB compiled, 4.14 with
        # the accumulator counted, 3.56 without).
        "gradients": 0 if L.microbatches == 1 and L.pp == 1 else 4 * n["compute"],
        # A microbatch's weight gradients in the compute dtype; a pipeline's per-tick gradients of
        # its stage too under ZeRO (it gathers the weights in the compute dtype and keeps them so),
        # fp32 without (the stage differentiates the fp32 masters: XLA's memory-usage report of
        # GPT-3 175B tp8 x pp16 shows an fp32 [layers, h, 4h] buffer per matrix beside the
        # accumulator; benchmarks/RESULTS.md).
        "microbatch_gradients": (4 if (L.pp > 1 and not L.zero) or not low else 2) * n["compute"],
        "overlap_shares": _overlap_shares(cfg, L, n["compute"]),
        "activations": act["layers"],
        "logits": act["logits"],
        "expert_working_set": expert_working_bytes(cfg, L),
    }
    if L.fsdp:
        out.update(_sharded_layers(cfg, L, n, low))
    out["total"] = sum(out.values())
    return out


def _sharded_layers(cfg, L: Layout, n: dict, low: bool) -> dict:
    """The memory terms FSDP changes (mlm_jax/parallel/fsdp.py; no pipeline): the layers' compute
    copy is whole only under optim_grads (the forward's gathered weights kept for the backward),
    two layers' worth under optim_grads_params (the one computing and the next being gathered);
    their fp32 gradient accumulator is each rank's shard (1/dd, dd the data axis: dp / ep); a
    microbatch's weight gradients in the compute dtype are one layer's at a time. The other
    parameters (embeddings, head, final norm) stay as ZeRO-1 holds them."""
    layers, rest = n["layers"], n["compute"] - n["layers"]
    per_layer = layers / cfg.model.num_layers
    gathered = layers if L.fsdp == "optim_grads" else 2 * per_layer
    dd = max(L.dp // L.ep, 1)
    return {
        "compute_copy": (2 if low else 4) * (rest + gathered),
        "gradients": 4 * layers / dd + (0 if L.microbatches == 1 else 4 * rest),
        "microbatch_gradients": (2 if low else 4) * (rest + per_layer),
    }


def expert_working_bytes(cfg, L: Layout) -> float:
    """The working set of one MoE layer's experts at the step's peak (one layer at a time, in its
    backward): XLA's dense product over the experts without the grouped matmul kernel
    (`dense_expert_bytes`); with it (`--moe-grouped-gemm`, the default) the rows a device's
    experts run (padded as the dispatch pads them, `expert_padding` x T*K) in, out and their
    gradient (3 x 2h bytes a row), the first product and its gradient (2 x 2 x 2f/t, SwiGLU's
    gate and up), the activation and its gradient (2 x 2f/t), and the layer's experts' weight
    gradients in fp32 (4 x E/ep x h x 3f/t with SwiGLU) (fitted to Mixtral 8x7B's layers, 4 of
    them, tp8 x dp8 SP ZeRO at micro 2 on 64 H100: 9.56 GiB compiled, 9.19 predicted, 7.83
    without this term; tests/test_plan_calibration.py). Padded to capacity: none."""
    m = cfg.model
    if not m.num_experts or m.moe_pad_expert_input_to_capacity:
        return 0.0
    if not m.moe_grouped_gemm:
        return dense_expert_bytes(cfg, L)
    rows = expert_padding(cfg, L) * L.micro * cfg.train.seq_length / L.cp * m.moe_router_topk
    f = m.moe_ffn_size / L.tp  # SP's tokens are whole in the dispatch
    gate = 2 if m.swiglu else 1
    per_row = 2 * (3 * m.hidden_size + 2 * gate * f + 2 * f)
    weights = 4 * m.num_experts / L.ep * m.hidden_size * (gate + 1) * f
    return rows * per_row + weights


def dense_expert_bytes(cfg, L: Layout) -> float:
    """The working set of one MoE layer's grouped matmuls as XLA's GPU compiler runs them
    (`dense_expert_flops`): every (token, choice) row broadcast over the rank's E/ep experts, with
    the rows padded to `expert_padding` x T*K, so E x T*K row-expert pairs whatever ep; each holds
    the masked input (h), the first matmul's output (2f/t with SwiGLU, else f/t) and the second's
    input (f/t), in the compute dtype, about 2.2 such buffers alive at the layer's peak (fitted
    to Mixtral 8x7B's layers, 4 of them, tp8 x dp8 SP ZeRO at micro 1, 2 and 4: +3.0 GiB per
    micro batch of 4096 tokens compiled, +0.5 in the model without this term;
    benchmarks/RESULTS.md). Padded to capacity, or with the grouped matmul kernel
    (`--moe-grouped-gemm`, the default: `kernels.grouped_matmul`, no dense product): none."""
    m = cfg.model
    if not m.num_experts or m.moe_pad_expert_input_to_capacity or m.moe_grouped_gemm:
        return 0.0
    tokens = L.micro * cfg.train.seq_length / L.cp  # SP's tokens are whole in the dispatch
    f = m.moe_ffn_size / L.tp
    per_pair = m.hidden_size + f * (2 if m.swiglu else 1) + f
    return 2.2 * 2 * tokens * m.moe_router_topk * m.num_experts * per_pair


def _overlap_shares(cfg, L: Layout, compute: float) -> float:
    """--overlap-grad-reduce: the reduced fp32 shares exist beside the accumulator during the last
    microbatch's backward, 4*N/dp with ZeRO, 4*N without (benchmarks/RESULTS.md, issue 25); it
    applies without a pipeline or expert parallelism (`parallel.data.overlaps_grad_reduce`)."""
    if not cfg.parallel.overlap_grad_reduce or L.pp > 1 or L.ep > 1 or L.dp == 1:
        return 0.0
    return 4 * compute / L.dp if L.zero else 4 * compute


# --------------------------------------------------------------------------- FLOPs and time


def step_flops(cfg, L: Layout) -> float:
    """Model FLOPs of one step, the whole cluster ([N] appendix eq. 3 generalized term by term:
    2 FLOPs per multiply-add, the backward twice the forward; attention scores and values
    `4*s*a*d` per token (full, not causal, as Megatron counts); the experts' MLP top-k times)."""
    m = cfg.model
    h, s = m.hidden_size, cfg.train.seq_length
    qkvo, dense_mlp = _projection_flops(m)
    fwd_token = 0.0
    for i in range(m.num_layers):
        scores = 2 * s * m.attention_core_width
        if m.is_moe_layer(i):
            mlp = sum(_moe_flops(m)) + 2 * h * m.num_experts  # the experts and the router
        else:
            mlp = dense_mlp
        fwd_token += qkvo + scores + mlp
    fwd_token += 2 * h * m.vocab
    # multi-token prediction: per depth a layer of the last layer's kind, eh_proj and the head
    fwd_token += (m.mtp_num_layers or 0) * (qkvo + scores + mlp + 2 * 2 * h * h + 2 * h * m.vocab)
    return 3 * fwd_token * cfg.train.global_batch_size * s


def _projection_flops(m) -> tuple[int, int]:
    """Forward FLOPs per token of a layer's QKV and output projections, and of a dense MLP."""
    return 2 * m.attention_weights, _mlp_flops(m, m.ffn_size)


def _mlp_flops(m, ffn: int) -> int:
    """Forward FLOPs per token of an MLP of hidden size `ffn` (gated under SwiGLU)."""
    h = m.hidden_size
    return 2 * (h * ffn * (2 if m.swiglu else 1) + ffn * h)


def _moe_flops(m) -> tuple[int, int]:
    """Forward FLOPs per token of a MoE layer's routed experts (top-k of them) and of its shared
    expert (0 without one)."""
    shared = m.moe_shared_expert_intermediate_size
    return m.moe_router_topk * _mlp_flops(m, m.moe_ffn_size), _mlp_flops(m, shared) if shared else 0


def _passes(L: Layout) -> int:
    """Forward-sized passes per step: forward and backward (3), plus one each for full recompute
    and the pipeline's stage recompute."""
    return 3 + (L.recompute == "full") + (L.pp > 1)


def dense_expert_flops(cfg, L: Layout) -> float:
    """FLOPs a MoE's expert matmuls execute beyond the model's, per step, on NVIDIA GPUs.

    Without the grouped matmul kernel (`--moe-grouped-gemm` off), `jax.lax.ragged_dot` has no
    grouped kernel in XLA's GPU compiler: it is rewritten as one dense product of every row with each of the rank's E/ep
    experts (rows masked per expert; read from the optimised H100 HLO, benchmarks/RESULTS.md),
    and the dispatch pads a rank's rows (`expert_padding`: ep x T*K dropless): dropless, every
    (token, choice) runs through E experts' MLPs where the model counts one.
    `--moe-pad-expert-input-to-capacity` runs [E/ep, capacity] slots instead, and the grouped
    matmul kernel (`--moe-grouped-gemm`, the default: `kernels.grouped_matmul`) only the rows
    each expert receives: not inflated."""
    m = cfg.model
    if not m.num_experts or m.moe_pad_expert_input_to_capacity or m.moe_grouped_gemm:
        return 0.0
    h, f, k = m.hidden_size, m.moe_ffn_size, m.moe_router_topk
    per_row = 2 * (h * f * (2 if m.swiglu else 1) + f * h)
    moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers))
    runs = m.num_experts / L.ep * expert_padding(cfg, L)  # expert MLPs per (token, choice)
    return 3 * (runs - 1) * k * per_row * moe_layers * cfg.train.global_batch_size * cfg.train.seq_length


def executed_flops(cfg, L: Layout) -> float:
    """FLOPs executed: the model's plus one more forward for full recompute ([N]'s 96 in place of
    72) and one more for the pipeline's stage recompute (both: two more); selective recompute
    runs the attention scores' forward (`4*s*a*d` per token and layer) once more; a dropless
    MoE's experts run E times their FLOPs (`dense_expert_flops`)."""
    flops = (step_flops(cfg, L) + dense_expert_flops(cfg, L)) * _passes(L) / 3
    if L.recompute == "selective" and not fused_attention(cfg, L):  # the scores' forward again ([K] 5)
        m = cfg.model
        flops += 2 * cfg.train.seq_length * m.attention_core_width * m.num_layers * \
            cfg.train.global_batch_size * cfg.train.seq_length
    return flops


def fp8_flops(cfg, L: Layout) -> float:
    """Of `executed_flops`, those of fp8 products (--fp8-format; models/fp8.py): the QKV, output
    and MLP projections of the layers not kept in bf16 (--first-last-layers-bf16), a MoE layer's
    shared expert and its routed experts' products (top-k per token) where they are fp8
    (`fp8.experts`: the grouped kernels or capacity slots), and each multi-token-prediction
    depth's layer; attention, the router and the heads stay bf16. They run at
    twice the bf16 rate (`predict`)."""
    m = cfg.model
    if m.fp8_format is None:
        return 0.0
    start, end = (m.num_layers_at_start_in_bf16, m.num_layers_at_end_in_bf16) if m.first_last_layers_bf16 else (0, 0)
    qkvo, dense_mlp = _projection_flops(m)
    routed, shared = _moe_flops(m) if m.num_experts else (0, 0)
    moe_mlp = (routed if m.moe_grouped_gemm or m.moe_pad_expert_input_to_capacity else 0) + shared
    layer = lambda i: qkvo + (moe_mlp if m.is_moe_layer(i) else dense_mlp)  # noqa: E731
    # multi-token prediction: a layer of the last layer's kind per depth (its eh_proj stays bf16)
    fwd_token = sum(map(layer, range(start, m.num_layers - end))) + (m.mtp_num_layers or 0) * layer(m.num_layers - 1)
    return fwd_token * _passes(L) * cfg.train.global_batch_size * cfg.train.seq_length


def axis_spans_nodes(L: Layout, axis: str, per_node: int) -> bool:
    """Whether `axis`'s device groups leave a node: mesh axes outer to inner pipe, replica, data,
    expert, context, tensor (mlm_jax/sharding/mesh.py); an axis stays inside a node when it and every
    axis inside it fit one. Joined axes ("pipe+data") leave a node when one of them does."""
    if "+" in axis:
        return any(axis_spans_nodes(L, a, per_node) for a in axis.split("+"))
    sizes = {"tensor": L.tp, "context": L.cp, "expert": L.ep, "data": L.dp // L.ep // L.instances,
             "replica": L.instances, "pipe": L.pp}
    inner = 1
    for name in ("tensor", "context", "expert", "data", "replica", "pipe"):
        inner *= sizes[name]
        if name == axis:
            return inner > per_node and sizes[name] > 1
    raise ValueError(axis)


def communication(cfg, L: Layout) -> dict:
    """Bytes each device sends per step, per mesh axis ([C] ring costs: an all-reduce of B bytes
    over n devices sends 2B(n-1)/n, an all-gather, reduce-scatter or all-to-all B(n-1)/n, a
    collective-permute B; 2-byte activations). Checked against the compiled programs' collectives
    (`sent_bytes_per_axis` of `python -m mlm_jax.plan --json`, tests/test_plan_calibration.py).

    - tensor: per layer and microbatch two all-reduces of `2*s*b*h` in forward and two in
      backward ([N] 2.3); sequence parallelism turns each into an all-gather and a
      reduce-scatter, the same bytes ([K] 4.2.2); full recompute adds three of those halves
      (both gathers and the attention's scatter), without SP one all-reduce (the attention's):
      the layer's output is not recomputed; without it SP's backward gathers the QKV and fc1
      inputs again, two halves (Megatron's SP does the same: [K] 4.2.2). Per microbatch the vocab-parallel embedding's output
      and its gradient, the head's input and its fp32 gradient: five halves (six without SP).
      In a pipeline every tick runs its slots' layers: a forward slot four halves a layer, a
      backward slot the stage recompute's four and the backward's four, the head and embedding
      nine (twelve without SP). These counts are read from the compiled programs (GPT; a
      Llama-style layer's SP backward in a pipeline gathers two halves more, not counted:
      benchmarks/RESULTS.md, issue 31).
    - context, what the compiled programs send (mlm_jax/parallel/context.py; the wasteful parts
      are the program's, to be fixed, not Megatron's): per layer and microbatch the p2p ring's
      C steps (C transfers for C-1 blocks) of K and V (`2*2*s/cp*b*g*d`) in the forward, the
      backward's recompute and its second pass, and the K, V gradients in fp32: 5*C such
      blocks; allgather K and V gathered twice and their gradients scattered; a2a Q, K, V
      three times (forward, recompute, gradients) and the output twice. Then each layer's weight
      gradients, partial over the sequence blocks, all-reduced per layer and microbatch in the
      compute dtype (Megatron reduces them once per step over data x context), and per
      microbatch the fused loss's logit gradients and inputs and the embedding's input gradient
      gathered over the blocks;
    - expert: the token dispatch and combine, in forward, in the backward's recompute and in
      backward: on NVIDIA GPUs ragged all-to-alls of the rows a rank routes (T*K; at most cf x
      T*K with a capacity factor cf), not padded (mlm_jax/parallel/experts.py);
    - pipe (mlm_jax/pipeline/runtime.py, lockstep two-slot ticks): every tick of a phase with a
      forward slot sends a stage output, every tick with a backward slot a gradient, idle or not
      (`2*s*b*h` each); a tick with a backward slot also all-reduces the last stage's output
      over pipe in fp32 for the head every stage computes a vocab block of, and its gradient in
      the compute dtype (the backward slot recomputes the forward); the embedding (and the tied head, the positions,
      the final norm), replicated over pipe, has its fp32 gradient reduced over pipe (scattered
      under ZeRO);
    - data: the fp32 gradient all-reduce (`2*4*N*(d-1)/d`), or ZeRO's reduce-scatter of fp32
      gradients and all-gather of the bf16 compute copy (`(4+2)*N*(d-1)/d`), [R]; gradients in
      2 bytes with --grad-reduce-in-bf16. With expert parallelism the experts' gradients
      reduce over `data` and the rest over data x expert ("data+expert", an all-reduce). With
      a pipeline the embedding's share is reduced over
      data after pipe (its 1/P shard), and under ZeRO gathered over pipe and data at once
      ("pipe+data").
    - replica (hybrid sharding, --num-distributed-optimizer-instances N): each instance's
      collectives are those of its dp / N ranks ("data" above); then each rank's reduced
      gradient share (1 / (dp / ep / N) of the gradient) is all-reduced over the N instances,
      once per step, and under FSDP each layer's per microbatch.
    """
    if L.instances > 1:
        return _over_instances(cfg, L, communication(cfg, one_instance(L)))
    from mlm_jax.pipeline import lockstep

    m = cfg.model
    h, d_, g = m.hidden_size, m.head_dim, m.query_groups
    tokens = L.micro * cfg.train.seq_length / L.cp
    mb = L.microbatches
    act = 2 * tokens * h
    out = {}
    if L.pp > 1:
        phases = lockstep.phases(lockstep.two_slot(L.schedule or ("interleaved" if L.vp > 1 else "1f1b"),
                                                   L.pp, mb, L.vp))
        f_ticks = sum(p.ticks for p in phases if p.forward)
        b_ticks = sum(p.ticks for p in phases if p.backward)
    if L.tp > 1:
        # In halves (an all-gather's or a reduce-scatter's act*(t-1)/t; an all-reduce is two).
        remat = (3 if L.sp else 2) * (L.recompute == "full")
        # SP's backward gathers the QKV and fc1 inputs again (models/layers.column_parallel);
        # under full recompute those are the recompute's own gathers.
        regather = 2 * (L.sp and L.recompute != "full")
        if L.pp > 1:  # every tick runs its slot's chunk of layers, idle or not (lockstep)
            chunk = m.num_layers / (L.pp * L.vp)
            backward = 4 + 4 + remat + regather  # the stage recompute's forward, the backward
            halves = chunk * (4 * f_ticks + backward * b_ticks) + (9 if L.sp else 12) * b_ticks + (2 if L.sp else 4)
        else:
            halves = (m.num_layers * (8 + remat + regather) + (5 if L.sp else 6)) * mb
        out["tensor"] = halves * act * (L.tp - 1) / L.tp
    if L.cp > 1:
        frac = (L.cp - 1) / L.cp
        q, k = act / L.tp, tokens * 2 * g * d_ / L.tp  # a device's Q (or output), one of K and V
        if cfg.parallel.cp_comm_type == "a2a":  # Q, K, V forward, again in the recompute, their
            per_layer = (3 * (q + 2 * k) + 2 * q) * frac  # gradients back; the output and its gradient
        elif cfg.parallel.cp_comm_type == "allgather":  # K, V gathered twice, their gradients scattered
            per_layer = 3 * 2 * k * (L.cp - 1)
        else:  # the ring's C steps (the last transfer unused), forward, the backward's recompute
            per_layer = 5 * L.cp * 2 * k  # and a second pass, and the K, V gradients in fp32
        # A layer's weight gradients are partial sums over the sequence blocks, all-reduced per
        # layer and microbatch in the compute dtype (the norms' in fp32).
        split, rep, _ = layer_params(m, False)
        norms = norm_params(m)
        per_layer += 2 * (2 * (split / L.tp + rep - norms) + 4 * norms) * frac
        # Per microbatch the fused loss gathers each row chunk's logit gradient (bf16, [rows, V/t])
        # and input over the blocks, and the embedding's backward the input gradient.
        # (Under SP those inputs are split over tensor too: gathered over both axes at once.)
        whole = L.micro * cfg.train.seq_length
        inputs = 2 * whole * 2 * h
        out["context"] = m.num_layers / L.pp * mb * per_layer + mb * 2 * whole * m.vocab / L.tp * frac
        if L.sp:
            out["context+tensor"] = mb * inputs * (L.cp * L.tp - 1) / (L.cp * L.tp)
        else:
            out["context"] += mb * inputs * frac
    if L.ep > 1:
        # Per MoE layer and microbatch, in the forward and the backward (the dispatch keeps what
        # it received and returned, parallel/experts.py: nothing is sent again for the backward;
        # a pipeline's stage recompute runs the forward's exchanges once more): all-to-all, four
        # ragged all-to-alls of a rank's T*K rows (six in a pipeline; min(1, cf) x T*K: dropped
        # rows are not sent; SP's tokens whole: gathered over tensor first); all-gather, the
        # group's ep x T tokens gathered and their outputs scattered back, four times (five in a
        # pipeline: its recompute needs only the gather).
        moe_layers = sum(m.is_moe_layer(i) for i in range(m.num_layers)) / L.pp
        if cfg.model.moe_token_dispatcher_type == "allgather":
            moved = (5 if L.pp > 1 else 4) * L.ep * act
        else:
            cf = cfg.model.moe_expert_capacity_factor
            moved = (6 if L.pp > 1 else 4) * (1.0 if cf is None else min(1.0, cf)) * m.moe_router_topk * act
        out["expert"] = moe_layers * mb * moved * (L.ep - 1) / L.ep
    grad = 2 if cfg.parallel.grad_reduce_in_bf16 else 4
    n = param_counts(m, L)["compute"]
    if L.pp > 1:
        boundary = act / (L.tp if L.sp else 1)
        ring = (L.pp - 1) / L.pp
        emb_t, emb_rep = embedding_params(m)
        shared = (emb_t / (2 if m.untie_embeddings_and_output_weights else 1)) / L.tp + emb_rep
        out["pipe"] = (f_ticks + b_ticks) * boundary + b_ticks * (2 * 2 + 2) * boundary * ring \
            + (1 if L.zero else 2) * 4 * shared * ring
        n -= shared  # reduced over pipe above; under ZeRO its 1/P shard over data below
        if L.dp > 1:  # the embedding's pipe shard in fp32; under ZeRO gathered over pipe and data
            n_data = (grad + 2) * n + grad * shared / L.pp if L.zero else 2 * grad * (n + shared / L.pp)
            out["data"] = n_data * (L.dp - 1) / L.dp
            if L.zero:
                out["pipe+data"] = 2 * shared * (L.pp * L.dp - 1) / (L.pp * L.dp)
    elif L.ep > 1:
        # The experts' gradients reduce over `data` (dp/ep ranks hold each expert); the rest over
        # data x expert, all-reduced (ZeRO shards them over `data` only, then gathers them there).
        experts, dd = param_counts(m, L)["expert"], L.dp // L.ep
        rest = n - experts
        out["data+expert"] = 2 * grad * rest * (L.dp - 1) / L.dp
        if dd > 1:
            out["data"] = ((grad + 2) * experts + 2 * rest if L.zero else 2 * grad * experts) * (dd - 1) / dd
    elif L.dp > 1:
        out["data"] = (grad + 2 if L.zero else 2 * grad) * n * (L.dp - 1) / L.dp
    if L.fsdp and L.dp > 1:  # the layers gathered and reduce-scattered per microbatch, over data
        _sharded_layers_communication(cfg, L, out, grad)
    return out


def _sharded_layers_communication(cfg, L: Layout, out: dict, grad: int) -> None:
    """FSDP's bytes (no pipeline): per microbatch each layer's weights gathered in the compute
    dtype for the forward (and again for the backward under optim_grads_params: the biases'
    are not needed there, not counted apart) and its gradient reduce-scattered, over `data`
    (dd = dp / ep ranks); the weights not split over `expert` all-reduce their shard over it too.
    The embeddings and head as ZeRO-1's, once per step: in `out` already, less the layers."""
    counts = param_counts(cfg.model, L)
    layers, experts = counts["layers"], counts["expert"]
    dd = L.dp // L.ep
    per_mb = (2 + (2 if L.fsdp == "optim_grads_params" else 0) + grad) * layers * L.microbatches
    if L.ep > 1:  # the step-once terms above counted the layers too: take them out
        rest = counts["compute"] - layers
        out["data+expert"] = 2 * grad * rest * (L.dp - 1) / L.dp
        out["data"] = (2 * rest if L.zero else 0) * (dd - 1) / dd
        out["expert"] = out.get("expert", 0) + 2 * grad * (layers - experts) / dd * L.microbatches * (L.ep - 1) / L.ep
    else:
        out["data"] = (grad + 2) * (counts["compute"] - layers) * (L.dp - 1) / L.dp
    if dd > 1:
        out["data"] += per_mb * (dd - 1) / dd


def _over_instances(cfg, L: Layout, out: dict) -> dict:
    """`out` (one instance's bytes) with the all-reduce of the gradient shares over `replica`."""
    counts = param_counts(cfg.model, L)
    grad = 2 if cfg.parallel.grad_reduce_in_bf16 else 4
    dd = max(L.dp // L.ep // L.instances, 1)
    shares = counts["compute"] if not L.fsdp else counts["compute"] + counts["layers"] * (L.microbatches - 1)
    out["replica"] = 2 * grad * shares / dd * (L.instances - 1) / L.instances
    return out


def bubble(L: Layout) -> float:
    """The pipeline's idle fraction of the step, `(p-1)/(m*v + p-1)` ([N] 2.2)."""
    return (L.pp - 1) / (L.microbatches * L.vp + L.pp - 1)


# The data-parallel gradient reduction and ZeRO's gathers, on the axis groups they use.
_OVERLAPPED = ("data", "data+expert", "pipe+data")


def predict(cfg, L: Layout, hw: Hardware, gpus: int, per_node: int) -> dict:
    """Memory, communication and the predicted step time, tokens/s and MFU of `L` (the
    assumptions are the module docstring's)."""
    mem = memory(cfg, L)
    comm = communication(cfg, L)
    compute = (executed_flops(cfg, L) - fp8_flops(cfg, L) / 2) / gpus / (hw.bf16_flops * hw.efficiency)
    compute += L.microbatches * math.ceil(cfg.model.num_layers / L.pp) * hw.layer_overhead
    compute /= 1 - bubble(L)
    exposed = 0.0
    seconds = {}
    for axis, nbytes in comm.items():
        bw = hw.network_bytes if axis_spans_nodes(L, axis, per_node) else hw.nvlink_bytes
        seconds[axis] = nbytes / bw
        if axis not in _OVERLAPPED:
            exposed += seconds[axis]
    step = compute + exposed
    # The reduction and ZeRO's gathers overlap compute, not beyond it.
    step = max(step, sum(seconds.get(axis, 0.0) for axis in _OVERLAPPED))
    tokens = cfg.train.global_batch_size * cfg.train.seq_length
    return {"memory": mem, "communication": comm, "comm_seconds": seconds, "bubble": bubble(L),
            "compute_seconds": compute, "step_seconds": step, "tokens_per_second": tokens / step,
            "mfu": step_flops(cfg, L) / step / gpus / hw.bf16_flops}
