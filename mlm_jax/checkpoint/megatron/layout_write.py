"""mlm_jax params (numpy, plain layout) -> Megatron-Core's global tensors: layout.py inverted.

`global_tensors(params, m, rows, layers)` yields (name, array) one tensor at a time, under
Megatron-Core's *local-spec* names (`input_layernorm`, `pre_mlp_layernorm`,
`mlp.experts.local_experts.<j>.`) and global layer numbers, in the layouts layout.py reads
(see its docstring): each array is an exact reshape / transpose of one of ours, so reading it
back with layout.py gives the same bits. `shard` cuts a global tensor to one tensor-parallel
rank's piece, the inverse of legacy.merge_tensor_parallel (same COLUMN / ROW tables).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from mlm_jax.checkpoint.megatron.errors import MegatronCheckpointError
from mlm_jax.checkpoint.megatron.layout import _rows
from mlm_jax.checkpoint.megatron.legacy import COLUMN, ROW
from mlm_jax.config import ModelConfig


def check_tensor_parallel(m: ModelConfig, tp: int) -> None:
    """Megatron-Core's divisibility rules for tensor parallel size `tp`; an error names the size."""
    need = [("num_attention_heads", m.num_attention_heads), ("num_query_groups", m.query_groups),
            ("ffn_hidden_size", m.ffn_size)]
    if m.num_experts:
        need.append(("moe_ffn_hidden_size", m.moe_ffn_size))
    if m.moe_shared_expert_intermediate_size:
        need.append(("moe_shared_expert_intermediate_size", m.moe_shared_expert_intermediate_size))
    for name, value in need:
        if value % tp:
            raise MegatronCheckpointError(f"--tensor-model-parallel-size {tp}: does not divide {name} = {value} "
                                          "(unsupported layout)")


def check_layout(m: ModelConfig, tp: int, pp: int) -> None:
    """Sizes Megatron-LM can hold this model at (even pipeline stages); an error names the size."""
    if tp < 1 or pp < 1:
        raise MegatronCheckpointError(f"parallel sizes must be >= 1 (tensor {tp}, pipeline {pp})")
    check_tensor_parallel(m, tp)
    if m.num_layers % pp:
        raise MegatronCheckpointError(f"--pipeline-model-parallel-size {pp}: does not divide num_layers = "
                                      f"{m.num_layers} (unsupported layout; uneven stages are not written)")


def _np(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def _layer_params(params: dict, m: ModelConfig, i: int) -> tuple[dict, bool]:
    """(layer i's params, whether it is an MoE layer), sliced from the stacked trees."""
    kinds = [m.is_moe_layer(j) for j in range(m.num_layers)]
    moe = kinds[i]
    if len(set(kinds)) > 1:
        tree = params["moe_layers" if moe else "layers"]
        idx = sum(1 for j in range(i) if kinds[j] == moe)
    else:
        tree, idx = params["layers"], i

    return _pick(tree, idx), moe


def _norm(p: str, norm: dict, m: ModelConfig):
    yield f"{p}.weight", _np(norm["scale"])
    if m.normalization == "LayerNorm":
        yield f"{p}.bias", _np(norm["bias"])


def _fc1(w1: np.ndarray, swiglu: bool) -> np.ndarray:
    """w1 [.., d, (2,) f] -> fc1 [.., (2) f, d] (SwiGLU: all gate rows, then all up rows)."""
    w1 = _np(w1)
    if not swiglu:
        return np.ascontiguousarray(np.swapaxes(w1, -1, -2))
    lead = w1.ndim - 3
    x = np.moveaxis(w1, lead, -1)  # [.., 2, f, d]
    return np.ascontiguousarray(x.reshape(*x.shape[:lead], -1, x.shape[-1]))


def _mlp(p: str, mlp: dict, m: ModelConfig):
    yield f"{p}.linear_fc1.weight", _fc1(mlp["w1"], m.swiglu)
    yield f"{p}.linear_fc2.weight", np.ascontiguousarray(_np(mlp["w2"]).T)
    if m.add_bias_linear:
        yield f"{p}.linear_fc1.bias", _np(mlp["b1"]).reshape(-1)
        yield f"{p}.linear_fc2.bias", _np(mlp["b2"])


def _mla(a: str, attn: dict, m: ModelConfig):
    """Multi-latent attention's projections and latent norms under the local spec's names (layout._mla
    inverted)."""
    t = lambda x: np.ascontiguousarray(_np(x).reshape(x.shape[0], -1).T)  # noqa: E731  [in, ..] -> [out, in]
    if m.q_lora_rank:
        yield f"{a}.linear_q_down_proj.weight", t(attn["wq_down"])
        yield f"{a}.linear_q_up_proj.weight", t(attn["wq_up"])
    else:
        yield f"{a}.linear_q_proj.weight", t(attn["wq"])
    yield f"{a}.linear_kv_down_proj.weight", t(attn["wkv_down"])
    yield f"{a}.linear_kv_up_proj.weight", t(attn["wkv_up"])
    yield f"{a}.linear_proj.weight", np.ascontiguousarray(_np(attn["wo"]).reshape(-1, m.hidden_size).T)
    if m.qk_layernorm:
        if m.q_lora_rank:
            yield from _norm(f"{a}.q_layernorm", attn["q_norm"], m)
        yield from _norm(f"{a}.kv_layernorm", attn["kv_norm"], m)


def _layer(params: dict, m: ModelConfig, i: int, name: int):
    lp, moe = _layer_params(params, m, i)
    yield from _layer_tensors(lp, moe, m, f"decoder.layers.{name}")


def _mtp(params: dict, m: ModelConfig, k: int):
    """Multi-token prediction depth k + 1 under Megatron-Core's `mtp.layers.{k}` (layout._mtp
    inverted): its layer is the last layer's kind."""
    dp = _pick(params["mtp"], k)
    p = f"mtp.layers.{k}"
    yield from _norm(f"{p}.enorm", dp["enorm"], m)
    yield from _norm(f"{p}.hnorm", dp["hnorm"], m)
    eh = _np(dp["eh_proj"])  # [2, d, d]: the embedding's, the hidden state's
    yield f"{p}.eh_proj.weight", np.ascontiguousarray(np.concatenate([eh[0].T, eh[1].T], axis=1))  # [d, 2d]
    yield from _layer_tensors(dp["layer"], m.is_moe_layer(m.num_layers - 1), m, f"{p}.transformer_layer")
    yield from _norm(f"{p}.final_layernorm", dp["final_norm"], m)


def _pick(tree: dict, idx: int) -> dict:
    return {k: _pick(v, idx) if isinstance(v, dict) else v[idx] for k, v in tree.items()}


def _layer_tensors(lp: dict, moe: bool, m: ModelConfig, p: str):
    """A layer's tensors (`lp`: its params) under prefix `p`."""
    d, h, g, k = m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim
    r = h // g
    yield from _norm(f"{p}.input_layernorm", lp["norm1"], m)
    a = lp["attention"]
    if m.multi_latent_attention:
        yield from _mla(f"{p}.self_attention", a, m)
    else:
        yield (f"{p}.self_attention.linear_qkv.weight",
               np.ascontiguousarray(_np(a["wqkv"]).transpose(1, 2, 3, 0).reshape(g * (r + 2) * k, d)))
        yield f"{p}.self_attention.linear_proj.weight", np.ascontiguousarray(_np(a["wo"]).reshape(h * k, d).T)
        if m.add_bias_linear:
            yield f"{p}.self_attention.linear_qkv.bias", _np(a["bqkv"]).reshape(-1)
    if m.add_bias_linear:
        yield f"{p}.self_attention.linear_proj.bias", _np(a["bo"])
    yield from _norm(f"{p}.pre_mlp_layernorm", lp["norm2"], m)
    mlp = lp["mlp"]
    if not moe:
        yield from _mlp(f"{p}.mlp", mlp, m)
        return
    yield f"{p}.mlp.router.weight", np.ascontiguousarray(_np(mlp["router"]).T)
    if m.moe_router_enable_expert_bias:
        yield f"{p}.mlp.router.expert_bias", _np(mlp["expert_bias"])
    for j in range(m.num_experts):
        e = {key: mlp[key][j] for key in ("w1", "w2", "b1", "b2") if key in mlp}
        yield from _mlp(f"{p}.mlp.experts.local_experts.{j}", e, m)
    if m.moe_shared_expert_intermediate_size:
        yield from _mlp(f"{p}.mlp.shared_experts", mlp["shared"], m)


def global_tensors(params: dict, m: ModelConfig, rows: int, layers: range | None = None, first: bool = True,
                   last: bool = True) -> Iterator[tuple[str, np.ndarray]]:
    """(Megatron name, global fp32 array) of the tensors one pipeline stage holds: the embedding
    (`first`), `layers` (numbered from 0 within the stage), the final norm, output layer and
    multi-token prediction depths (`last`). `rows` is the padded vocab written (embedding rows
    cut or zero-padded to it)."""
    layers = range(m.num_layers) if layers is None else layers
    if first:
        yield "embedding.word_embeddings.weight", _rows(_np(params["embed"]), rows)
        if m.position_embedding_type == "learned_absolute":
            yield "embedding.position_embeddings.weight", _np(params["pos_embed"])
    for n, i in enumerate(layers):
        yield from _layer(params, m, i, n)
    if last:
        yield from _norm("decoder.final_layernorm", params["final_norm"], m)
        if m.untie_embeddings_and_output_weights:
            yield "output_layer.weight", _rows(np.ascontiguousarray(_np(params["lm_head"]).T), rows)
        elif not first:  # pipeline > 1, tied: the last stage holds its copy of the embedding
            yield "output_layer.weight", _rows(_np(params["embed"]), rows)
        for k in range(m.mtp_num_layers or 0):  # where Megatron places them: the last stage
            yield from _mtp(params, m, k)


def shard(name: str, x: np.ndarray, rank: int, tp: int, swiglu: bool) -> np.ndarray:
    """Rank `rank`'s piece of global tensor `name` (contiguous): column parallel on dim 0 (SwiGLU
    fc1: [gate_r; up_r]), row parallel on dim 1, else replicated."""
    if tp == 1:
        return x
    tail = ".".join(name.split(".")[-2:])
    if tail in ("linear_fc1.weight", "linear_fc1.bias") and swiglu:
        gate, up = np.split(x, 2, axis=0)
        return np.ascontiguousarray(np.concatenate([np.split(gate, tp, axis=0)[rank],
                                                    np.split(up, tp, axis=0)[rank]], axis=0))
    if tail in COLUMN:
        return np.ascontiguousarray(np.split(x, tp, axis=0)[rank])
    if tail in ROW:
        return np.ascontiguousarray(np.split(x, tp, axis=1)[rank])
    return x
