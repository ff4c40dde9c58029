"""Fixtures written by Megatron-Core itself: tiny models built with Megatron-Core on the CPU,
saved as Megatron-LM saves them, with Megatron-Core's own logits for fixed token ids.

Read by tests/test_megatron_core_fixtures.py (TP1 and TP2 writers; no PP2, no expert parallel).

Run BY HAND in a separate venv (the tests never import torch):

    python3 -m venv /work/venv-torch
    /work/venv-torch/bin/pip install torch==2.13.0 numpy packaging psutil
    /work/venv-torch/bin/pip install --no-deps megatron-core==0.16.1
    /work/venv-torch/bin/python tests/make_megatron_fixtures.py tests/fixtures/megatron
    /work/venv-torch/bin/torchrun --nproc-per-node 2 tests/make_megatron_fixtures.py tests/fixtures/megatron --tp 2

(`--only moe` writes one model and keeps the manifest's other entries as they are.) It writes, per
model (gpt2: learned positions, LayerNorm, GELU, biases, tied head; llama: rope, RMSNorm, SwiGLU,
no biases, untied head, GQA 4 heads / 2 groups; moe: llama's, hidden 16, with every MLP a Mixtral
style mixture of 4 SwiGLU experts, top-2, Megatron's default router (softmax over the top-k
logits), allgather dispatcher, dropless, the local spec's SequentialMLP; mla: DeepSeek-V3 style,
`SPECS["mla"]`, built with MLATransformerConfig and get_gpt_decoder_block_spec's local layers, its
core attention `CausalAttention`, as the local spec has none for MLA's head dims; also from a TP2
writer: `... --tp 2 --only mla`; mla_mtp: mla's with one multi-token prediction depth, whose
logits the manifest holds too, `mtp_logits`), a `torch_dist` save root
(`dist_checkpointing.save` of the model's sharded state dict with Megatron-LM's common state:
args, iteration, checkpoint_version, opt_param_scheduler) and a legacy `torch` one
(`mp_rank_00/model_optim_rng.pt` of `state_dict_for_save_checkpoint`), both from one tensor-
parallel rank (world size 1, gloo), local layer specs (no Transformer Engine), fp32; and
`manifest.json`: per fixture the model kind, format, the input ids and Megatron-Core's logits.

    /work/venv-torch/bin/python tests/make_megatron_fixtures.py --resume

writes the resumable fixture llama/resume_tp1 only (the manifest's `resume` entry; the other
entries kept as they are): llama trained 3 steps by Megatron-Core's DistributedOptimizer (Adam,
weight decay 0.1, clip 1.0, cosine LR with 1 warmup iteration; DDP and the optimizer on the CPU,
gloo, patched in `cpu_optimizer_patches`) on one fixed global batch of 4 rows, saved as Megatron-LM
saves with --use-distributed-optimizer --dist-ckpt-optim-fully-reshardable (model, optimizer
`fully_reshardable` sharded state, opt_param_scheduler, content_metadata in common.pt); recorded:
the losses, Adam's step, per-key sums of every optimizer state, the final norm's moments, and one
more step's loss, LR and the logits after it. The loss is over the true vocab's columns (mlm_jax
masks the padding columns; Megatron-LM's cross entropy includes them). TP1 only so far.

    /work/venv-torch/bin/python tests/make_megatron_fixtures.py --check DIR --model llama

loads DIR (torch_dist or legacy) into the same Megatron-Core model and prints the largest
difference of its logits from the manifest's (for checkpoints mlm_jax writes). The round trip
checked on 2026-12-04 (torch 2.13.0, megatron-core 0.16.1), for MODEL in gpt2 llama moe:

    python -m mlm_jax.tools.checkpoint import-megatron --load tests/fixtures/megatron/MODEL/dist_tp1 --save imp
    python -m mlm_jax.tools.checkpoint export-megatron --load imp --save dist --ckpt-format torch_dist
    python -m mlm_jax.tools.checkpoint export-megatron --load imp --save legacy --ckpt-format torch
    /work/venv-torch/bin/python tests/make_megatron_fixtures.py --check dist --model MODEL     # 1.907e-06; moe: 0.0
    /work/venv-torch/bin/python tests/make_megatron_fixtures.py --check legacy --model MODEL   # 1.907e-06; moe: 0.0

For MODEL mla (2026-12-07): 0.000e+00 for both; its legacy export at tensor parallel 2, loaded by
Megatron-Core at TP2 (`torchrun --nproc-per-node 2 ... --check legacy_tp2 --model mla --tp 2`):
1.967e-06. For MODEL mla_mtp (2026-12-07; `--check` prints the MTP depth's logits' difference
too): 0.000e+00 and 0.000e+00 for both formats; the legacy export at TP2 loaded at TP2: 1.132e-06
and 1.527e-06.

The same round trip of two MoE models with a shared expert (built with get_gpt_decoder_block_spec,
not fixtures): every layer MoE, and a dense first layer (Megatron-Core's non-homogeneous layers,
per-layer keys) also gave 0.000e+00 in both formats, their torch_dist exports holding exactly
Megatron-Core's keys, shapes, chunks and objects.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

MAX_POS, VOCAB, ITERATION, GBS = 32, 100, 10, 8
IDS = [[(7 * i + 3) % (VOCAB - 1) + 1 for i in range(16)]]
SPECS = {
    "gpt2": dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                 add_bias_linear=True, untie=False, groups=None, ffn=128),
    "llama": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  untie=True, groups=2, ffn=48),
    # Mixtral style: llama's layers with every MLP 4 SwiGLU experts, top-2 routing (Megatron's
    # default: top-k of the logits, then softmax over the k), dropless; narrower (hidden 16), as
    # its per-expert chunks make the files larger.
    "moe": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                untie=True, groups=2, ffn=32, experts=4, topk=2, moe_ffn=8, hidden=16),
    # DeepSeek-V3 style: multi-latent attention (a query latent, normed latents, YaRN rope), the
    # first layer dense and the second a mixture of 4 experts with DeepSeek's router (sigmoid
    # scores, 2 groups of 2 with the best group's experts chosen, the weights normalised and
    # scaled by 2.5, an expert bias for the choice) and a shared expert.
    "mla": dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                untie=True, groups=None, ffn=32, experts=4, topk=2, moe_ffn=8, hidden=16,
                mla=dict(q_lora_rank=12, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6,
                         rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0),
                router=dict(moe_router_score_function="sigmoid", moe_router_num_groups=2, moe_router_group_topk=1,
                            moe_router_topk_scaling_factor=2.5, moe_router_enable_expert_bias=True,
                            moe_router_load_balancing_type="seq_aux_loss", moe_shared_expert_intermediate_size=8,
                            moe_layer_freq=[0, 1])),
}
# The same with one multi-token prediction depth (Megatron-Core's MultiTokenPredictionBlock: its
# layer the last layer's kind, a MoE layer here), its logits recorded too.
SPECS["mla_mtp"] = dict(SPECS["mla"], mtp=dict(mtp_num_layers=1, mtp_loss_scaling_factor=0.1))
LAYERS, HIDDEN, HEADS = 2, 32, 4


def padded(vocab: int, tp: int = 1) -> int:
    m = 128 * tp
    return (vocab + m - 1) // m * m


def init_megatron(tp: int = 1):
    """World size `tp` (torchrun's RANK / WORLD_SIZE; one process without it), all tensor parallel."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=int(os.environ.get("RANK", 0)),
                                             world_size=int(os.environ.get("WORLD_SIZE", 1)))
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tp, 1)
    # Megatron-Core's CUDA RNG tracker on a machine without CUDA: its states live on the CPU.
    torch.cuda.manual_seed = lambda seed: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: None
    torch.cuda.current_device = lambda: "cpu"  # the attention's scratch buffer
    torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing's save
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    # The MoE router's gating matmul tests `te_general_gemm is not None`, a name moe_utils only
    # defines when Transformer Engine imports: None is its torch.mm path.
    from megatron.core.transformer.moe import moe_utils

    moe_utils.te_general_gemm = getattr(moe_utils, "te_general_gemm", None)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)


class CausalAttention(torch.nn.Module):
    """MLA's core attention without Transformer Engine (the local spec's DotProductAttention takes
    no MLA head dims): causal softmax(q k^T x softmax_scale) v, the math of TE's fused kernel.
    q, k [s, b, n, k_channels], v [s, b, n, v_channels] -> [s, b, n * v_channels]."""

    def __init__(self, config=None, layer_number=None, attn_mask_type=None, attention_type=None, softmax_scale=None,
                 **unused):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **unused):
        scores = torch.einsum("sbnk,tbnk->bnst", query, key) * self.softmax_scale
        s = query.shape[0]
        scores = scores.masked_fill(torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1), float("-inf"))
        out = torch.einsum("bnst,tbnv->sbnv", torch.softmax(scores.float(), dim=-1).to(value.dtype), value)
        return out.reshape(s, out.shape[1], -1)


def build(kind: str, tp: int = 1):
    import torch.nn.functional as F
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    s = SPECS[kind]
    torch.manual_seed(0)
    experts = s.get("experts")
    moe = dict(num_moe_experts=experts, moe_router_topk=s["topk"], moe_ffn_hidden_size=s["moe_ffn"],
               moe_grouped_gemm=False, moe_token_dispatcher_type="allgather", moe_expert_capacity_factor=None,
               moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2) if experts else {}
    moe.update(s.get("router", {}))
    mla = s.get("mla")
    kwargs = dict(
        num_layers=LAYERS, hidden_size=s.get("hidden", HIDDEN), num_attention_heads=HEADS, ffn_hidden_size=s["ffn"],
        num_query_groups=s["groups"], normalization=s["normalization"], gated_linear_unit=s["swiglu"],
        activation_func=F.silu if s["swiglu"] else F.gelu, add_bias_linear=s["add_bias_linear"],
        hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-5, init_method_std=0.2,
        use_cpu_initialization=True, bias_activation_fusion=False, bias_dropout_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False, params_dtype=torch.float32, **moe)
    if mla:
        mla_module = sys.modules["megatron.core.transformer.multi_latent_attention"]
        if not isinstance(mla_module.TELinear, type):  # without Transformer Engine: an isinstance test of nothing
            mla_module.TELinear = ()
        config = MLATransformerConfig(**kwargs, **mla, **s.get("mtp", {}), qk_layernorm=True)
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=s["normalization"])
        for layer in spec.layer_specs:  # the local spec's attention has no MLA head dims (TE's has)
            layer.submodules.self_attention.submodules.core_attention = CausalAttention
    else:
        config = TransformerConfig(**kwargs)
        spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, normalization=s["normalization"])
    mtp = None
    if s.get("mtp"):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

        mtp = get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=padded(VOCAB, tp),
                     max_sequence_length=MAX_POS, share_embeddings_and_output_weights=not s["untie"],
                     position_embedding_type=s["position_embedding_type"], parallel_output=False,
                     mtp_block_spec=mtp)
    with torch.no_grad():  # biases and norms away from their zero/one init, so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():  # the expert bias: large enough to change the choice
            if name.endswith("expert_bias"):
                b.copy_(torch.randn_like(b))
    return model.eval()


def logits(model) -> np.ndarray:
    ids = torch.tensor(IDS)
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        masked = torch.triu(torch.ones(ids.shape[1], ids.shape[1]), diagonal=1).bool()[None, None]  # True: hidden
        if model.config.mtp_num_layers:
            return all_logits(model, ids, pos, masked)[0]
        out = model(ids, pos, attention_mask=masked)
    return out[..., :VOCAB].float().numpy()  # the true vocab (NullTokenizer: vocab_size + 1)


def all_logits(model, ids, pos, masked) -> list[np.ndarray]:
    """[the model's logits, then each MTP depth's] ([b, s, true vocab] each): Megatron-Core's
    GPTModel runs its MTP depths only with labels (it returns the per-token loss then), so the
    output layer's outputs are recorded (the depths' first, in order, then the model's), copied:
    its cross entropy then overwrites them in place."""
    outs = []
    hook = model.output_layer.register_forward_hook(lambda mod, inp, out: outs.append(out[0].detach().clone()))
    try:
        model(ids, pos, attention_mask=masked, labels=ids)
    finally:
        hook.remove()
    outs = [o.transpose(0, 1)[..., :VOCAB].float().numpy() for o in outs]  # [s, b, v] -> [b, s, v]
    return [outs[-1], *outs[:-1]]


def mtp_logits(model) -> list:
    ids = torch.tensor(IDS)
    pos = torch.arange(ids.shape[1])[None]
    masked = torch.triu(torch.ones(ids.shape[1], ids.shape[1]), diagonal=1).bool()[None, None]
    with torch.no_grad():
        return [x[0].tolist() for x in all_logits(model, ids, pos, masked)[1:]]


def make_args(kind: str, tp: int = 1) -> argparse.Namespace:
    """The args Megatron-LM's checkpoint holds, for the fields a reader needs."""
    s = SPECS[kind]
    hidden = s.get("hidden", HIDDEN)
    return argparse.Namespace(
        num_layers=LAYERS, hidden_size=hidden, ffn_hidden_size=s["ffn"], num_attention_heads=HEADS,
        group_query_attention=s["groups"] is not None, num_query_groups=s["groups"] or HEADS,
        kv_channels=hidden // HEADS, max_position_embeddings=MAX_POS, seq_length=MAX_POS,
        position_embedding_type=s["position_embedding_type"], rotary_base=10000, rotary_percent=1.0,
        rotary_interleaved=False, normalization=s["normalization"], norm_epsilon=1e-5, swiglu=s["swiglu"],
        openai_gelu=False, squared_relu=False, untie_embeddings_and_output_weights=s["untie"],
        add_bias_linear=s["add_bias_linear"], add_qkv_bias=False, apply_layernorm_1p=False,
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.2, make_vocab_size_divisible_by=128,
        padded_vocab_size=padded(VOCAB, tp), vocab_size=VOCAB - 1, tokenizer_type="NullTokenizer", vocab_file=None,
        merge_file=None, tokenizer_model=None, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1, transformer_impl="local",
        bias_gelu_fusion=False, bf16=False, fp16=False, params_dtype=torch.float32,
        micro_batch_size=1, global_batch_size=GBS, lr=1e-4, min_lr=1e-5, iteration=ITERATION,
        consumed_train_samples=ITERATION * GBS, ckpt_format="torch_dist", **moe_args(kind), **mla_args(kind),
        **(s.get("mtp") or {"mtp_num_layers": None}))


def mla_args(kind: str) -> dict:
    """Megatron-LM's multi-latent attention args (--multi-latent-attention, --q-lora-rank, ...)."""
    s = SPECS[kind]
    if not s.get("mla"):
        return {"multi_latent_attention": False, "qk_layernorm": False}
    return dict(multi_latent_attention=True, qk_layernorm=True, rope_type=None, **s["mla"])


def moe_args(kind: str) -> dict:
    """Megatron-LM's --num-experts / --moe-* args of an MoE model (build's TransformerConfig)."""
    s = SPECS[kind]
    if not s.get("experts"):
        return {"num_experts": None}
    return dict(num_experts=s["experts"], moe_router_topk=s["topk"], moe_ffn_hidden_size=s["moe_ffn"],
                moe_layer_freq=1, moe_grouped_gemm=False, moe_token_dispatcher_type="allgather",
                moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=None,
                moe_router_pre_softmax=False, moe_router_score_function="softmax", moe_router_topk_scaling_factor=None,
                moe_router_enable_expert_bias=False, moe_expert_capacity_factor=None, moe_token_drop_policy="probs",
                moe_pad_expert_input_to_capacity=False, moe_shared_expert_intermediate_size=None,
                moe_router_dtype=None, moe_use_legacy_grouped_gemm=False, moe_router_num_groups=None,
                moe_router_group_topk=None, moe_router_bias_update_rate=1e-3) | s.get("router", {})


def common_state(kind: str, fmt: str, tp: int = 1) -> dict:
    args = make_args(kind, tp)
    args.ckpt_format = fmt
    return {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
            "opt_param_scheduler": {"max_lr": 1e-4, "min_lr": 1e-5, "num_steps": ITERATION * GBS,
                                    "warmup_steps": 0, "decay_steps": 100 * GBS, "decay_style": "cosine"}}


def save(model, kind: str, root: str, tp: int = 1):
    """Both formats from every tensor-parallel rank (torch_dist collectively; legacy, a
    mp_rank_TT file each)."""
    from megatron.core import dist_checkpointing, parallel_state

    rank_t = parallel_state.get_tensor_model_parallel_rank()
    dist_root, legacy_root = (os.path.join(root, kind, f"dist_tp{tp}"), os.path.join(root, kind, f"legacy_tp{tp}"))
    folder = os.path.join(dist_root, f"iter_{ITERATION:07d}")
    os.makedirs(folder, exist_ok=True)
    torch.distributed.barrier()
    state = common_state(kind, "torch_dist", tp)
    state["model"] = model.sharded_state_dict()
    dist_checkpointing.save(state, folder)
    rank = os.path.join(legacy_root, f"iter_{ITERATION:07d}", f"mp_rank_{rank_t:02d}")
    os.makedirs(rank, exist_ok=True)
    state = common_state(kind, "torch", tp)
    state["model"] = model.state_dict_for_save_checkpoint()
    torch.save(state, os.path.join(rank, "model_optim_rng.pt"))
    if torch.distributed.get_rank() == 0:
        for r in (dist_root, legacy_root):
            with open(os.path.join(r, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(ITERATION))
    return [os.path.relpath(dist_root, root), os.path.relpath(legacy_root, root)]


# The resumable fixture: llama trained RESUME_STEPS Adam steps by Megatron-Core's distributed
# optimizer on TRAIN_IDS (one global batch of 4 rows, every step), saved as Megatron-LM saves with
# --use-distributed-optimizer --dist-ckpt-optim-fully-reshardable; then one more step, recorded.
RESUME_STEPS, RESUME_GBS = 3, 4
TRAIN_IDS = [[(7 * i + 11 * r + 3) % (VOCAB - 1) + 1 for i in range(17)] for r in range(RESUME_GBS)]
OPTIM = dict(lr=1e-3, min_lr=1e-4, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
             clip_grad=1.0, lr_warmup_iters=1, lr_decay_iters=10, train_iters=10, lr_decay_style="cosine")
# Megatron-LM's content metadata of that save (_build_sharded_state_dict_metadata, dp_cp_group dropped).
FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable",
                     "distrib_optim_fully_reshardable_mem_efficient": False, "singleton_local_shards": False,
                     "chained_optim_avoid_prefix": True}


def cpu_optimizer_patches():
    """Megatron-Core's distributed optimizer on the CPU: it makes its flag and norm scalars with
    device='cuda', checks parameters by their CUDA type names and moves gathered shards with
    .cuda(); here those are CPU tensors, CPU type names read as CUDA ones, and .cuda() a no-op."""
    import types

    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.core.optimizer.distrib_optimizer as distrib_optimizer
    import megatron.core.optimizer.optimizer as optimizer
    import megatron.core.utils as mutils

    type_name = torch.Tensor.type

    def cuda_type(self, *a, **k):
        out = type_name(self, *a, **k)
        return out.replace("torch.", "torch.cuda.", 1) if not a and not k and not self.is_cuda else out

    torch.Tensor.type = cuda_type
    torch.Tensor.cuda = lambda self, *a, **k: self

    class CpuTorch(types.ModuleType):
        def __getattr__(self, name):
            f = getattr(torch, name)
            if name not in ("tensor", "zeros", "empty", "ones"):
                return f

            def on_cpu(*a, **k):
                if k.get("device") == "cuda":
                    k["device"] = "cpu"
                return f(*a, **k)
            return on_cpu

    for m in (mutils, optimizer, clip_grads, distrib_optimizer):
        m.torch = CpuTorch("torch")


def train_steps(tp: int = 1):
    """(model, DDP, optimizer, scheduler, per-step loss fn) of llama with Megatron-Core's distributed Adam."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cpu_optimizer_patches()
    model = build("llama", tp).train()
    ddp = DistributedDataParallel(config=model.config, module=model, ddp_config=DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=False))
    o = OPTIM
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=o["lr"], min_lr=o["min_lr"], weight_decay=o["weight_decay"], adam_beta1=o["adam_beta1"],
        adam_beta2=o["adam_beta2"], adam_eps=o["adam_eps"], clip_grad=o["clip_grad"], use_distributed_optimizer=True,
        bf16=False, fp16=False, params_dtype=torch.float32), [ddp])
    # Megatron-LM's iteration-based schedule counts samples: lengths x global batch, step(+batch).
    sched = OptimizerParamScheduler(
        opt, init_lr=0.0, max_lr=o["lr"], min_lr=o["min_lr"], lr_warmup_steps=o["lr_warmup_iters"] * RESUME_GBS,
        lr_decay_steps=o["lr_decay_iters"] * RESUME_GBS, lr_decay_style=o["lr_decay_style"],
        start_wd=o["weight_decay"], end_wd=o["weight_decay"], wd_incr_steps=o["train_iters"] * RESUME_GBS,
        wd_incr_style="constant")
    text = torch.tensor(TRAIN_IDS)
    ids, labels = text[:, :-1], text[:, 1:]
    pos = torch.arange(ids.shape[1])[None].expand_as(ids)
    masked = torch.triu(torch.ones(ids.shape[1], ids.shape[1]), diagonal=1).bool()[None, None]

    def step() -> tuple[float, float]:
        """One training iteration as Megatron-LM's train_step: (loss, the lr it used). The loss
        is over the true vocab's columns (mlm_jax masks the padding columns; Megatron's own
        cross entropy would include them)."""
        ddp.zero_grad_buffer()
        opt.zero_grad()
        out = ddp(ids, pos, attention_mask=masked)[..., :VOCAB]
        loss = torch.nn.functional.cross_entropy(out.float().reshape(-1, VOCAB), labels.reshape(-1))
        loss.backward()
        ddp.finish_grad_sync()
        lr = opt.param_groups[0]["lr"]
        ok, _, _ = opt.step()
        assert ok
        sched.step(increment=RESUME_GBS)
        return float(loss), float(lr)
    return model, opt, sched, step


def save_resumable(root: str, tp: int = 1) -> dict:
    """The resumable fixture's folder and manifest record (see RESUME_STEPS)."""
    from megatron.core import dist_checkpointing, parallel_state

    model, opt, sched, step = train_steps(tp)
    losses = [step()[0] for _ in range(RESUME_STEPS)]
    dist_root = os.path.join(root, "llama", f"resume_tp{tp}")
    folder = os.path.join(dist_root, f"iter_{RESUME_STEPS:07d}")
    os.makedirs(folder, exist_ok=True)
    torch.distributed.barrier()
    o = OPTIM
    args = make_args("llama", tp)
    samples = RESUME_STEPS * RESUME_GBS
    vars(args).update(iteration=RESUME_STEPS, consumed_train_samples=samples, global_batch_size=RESUME_GBS,
                      micro_batch_size=RESUME_GBS, seq_length=len(TRAIN_IDS[0]) - 1, optimizer="adam",
                      use_distributed_optimizer=True, dist_ckpt_optim_fully_reshardable=True,
                      distrib_optim_fully_reshardable_mem_efficient=False, no_save_optim=None, no_save_rng=True,
                      lr_warmup_init=0.0, lr_warmup_fraction=None, lr_warmup_samples=0, lr_decay_samples=None,
                      train_samples=None, **o)
    state = {"args": args, "checkpoint_version": 3.0, "iteration": RESUME_STEPS, "model": model.sharded_state_dict(),
             "opt_param_scheduler": sched.state_dict()}
    state["optimizer"] = opt.sharded_state_dict(state, metadata=dict(FULLY_RESHARDABLE))
    dist_checkpointing.save(state, folder, content_metadata=dict(FULLY_RESHARDABLE))
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(dist_root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(RESUME_STEPS))
    # What the test compares: Adam's moments per key (sums, layout-free: mlm_jax's QKV and
    # gate/up orders permute within a tensor), the final norm's exactly, and the next step.
    inner = (opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt).optimizer
    adam_steps = sorted({int(s["step"]) for s in inner.state.values()})
    stats = {}
    sharded = dist_checkpointing.load_plain_tensors(folder)
    for key, t in sharded.items():
        if key.startswith("optimizer.state."):
            t = t.double()
            stats[key] = {"sum": float(t.sum()), "abs_sum": float(t.abs().sum())}
    final = "decoder.final_layernorm.weight"
    exact = {k: sharded[f"optimizer.state.{k}.{final}"].tolist() for k in ("exp_avg", "exp_avg_sq")}
    next_loss, next_lr = step()
    with torch.no_grad():
        after = logits(model.eval())
    return {"folders": [os.path.relpath(dist_root, root)], "iteration": RESUME_STEPS, "consumed_samples": samples,
            "adam_step": adam_steps, "train_ids": TRAIN_IDS, "optim": OPTIM, "losses": losses,
            "next_loss": next_loss, "next_lr": next_lr, "moment_stats": stats,
            "final_norm_moments": exact, "logits_after_next_step": after[0].tolist(),
            "content_metadata": FULLY_RESHARDABLE}


def load_into(model, path: str):
    """A torch_dist or legacy checkpoint (save root or iteration folder) into `model`."""
    from megatron.core import dist_checkpointing

    if os.path.isfile(os.path.join(path, "latest_checkpointed_iteration.txt")):
        it = open(os.path.join(path, "latest_checkpointed_iteration.txt")).read().strip()
        path = os.path.join(path, "release" if it == "release" else f"iter_{int(it):07d}")
    if os.path.isfile(os.path.join(path, "metadata.json")):
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, path)
        model.load_state_dict(state["model"], strict=False)
    else:
        from megatron.core import parallel_state

        rank = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
        state = torch.load(os.path.join(path, rank, "model_optim_rng.pt"), weights_only=False)
        model.load_state_dict(state["model"], strict=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out", nargs="?", default=os.path.join(os.path.dirname(__file__), "fixtures", "megatron"))
    p.add_argument("--check", default=None, help="a checkpoint to load and compare with the manifest's logits")
    p.add_argument("--model", choices=sorted(SPECS), default="llama")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel writers: run under torchrun --nproc-per-node TP; "
                                                     "adds <model>_tp<TP> entries to an existing manifest")
    p.add_argument("--resume", action="store_true", help="write the resumable llama fixture (model, "
                   "distributed optimizer, scheduler) only, into the manifest's 'resume' entries")
    p.add_argument("--only", nargs="+", choices=sorted(SPECS), default=None,
                   help="write these models only; the manifest's other entries are kept as they are")
    a = p.parse_args(argv)
    init_megatron(a.tp)
    import megatron.core

    if a.check:
        manifest = json.load(open(os.path.join(a.out, "manifest.json")))
        model = build(a.model, a.tp)
        with torch.no_grad():
            for prm in model.parameters():
                prm.zero_()
        load_into(model, a.check)
        want = np.asarray(manifest["models"][a.model]["logits"], np.float32)
        print(f"{a.check}: max |logits - manifest| = {np.abs(logits(model) - want).max():.3e}")
        if SPECS[a.model].get("mtp"):
            got, want = np.asarray(mtp_logits(model)), np.asarray(manifest["models"][a.model]["mtp_logits"])
            print(f"{a.check}: max |MTP logits - manifest| = {np.abs(got - want).max():.3e}")
        return 0
    path = os.path.join(a.out, "manifest.json")
    manifest = {"megatron_core": megatron.core.__version__, "torch": torch.__version__, "ids": IDS,
                "vocab_size": VOCAB - 1, "padded_vocab_size": padded(VOCAB), "iteration": ITERATION,
                "consumed_samples": ITERATION * GBS, "models": {}}
    if a.tp > 1 or a.only or a.resume:
        manifest = json.load(open(path))
    if a.resume:
        rec = save_resumable(a.out, a.tp)
        if torch.distributed.get_rank() == 0:
            manifest.setdefault("resume", {})["llama" if a.tp == 1 else f"llama_tp{a.tp}"] = rec
            with open(path, "w") as f:
                json.dump(manifest, f)
        print(f"resume: {rec['folders']}, losses {rec['losses']}, next {rec['next_loss']}")
        return 0
    for kind in a.only or SPECS:
        model = build(kind, a.tp)
        out = logits(model)
        folders = save(model, kind, a.out, a.tp)
        entry = {"folders": folders, "logits": out[0].tolist()}
        if SPECS[kind].get("mtp"):
            entry["mtp_logits"] = mtp_logits(model)
        manifest["models"][kind if a.tp == 1 else f"{kind}_tp{a.tp}"] = entry
        print(f"{kind}: {folders}, logits {out.shape}")
    if torch.distributed.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(manifest, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
