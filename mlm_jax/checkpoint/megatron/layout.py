"""Megatron-Core's parameter names and layouts -> mlm_jax's params (numpy, plain layout).

Names are per global layer (`decoder.layers.<i>.<rest>`; dcp.py and legacy.py both produce
them). Every tensor is checked against the shape the config implies, and every tensor must be
used: a leftover is an unknown key, an error naming it.

Layouts (Megatron [out, in] Linear weights; ours, `mlm_jax/tools/hf_mapping.py`'s):
  linear_qkv.weight  [g * (r + 2) * k, d]: per query group its r query heads, its key, its value
                     -> wqkv [d, g, r + 2, k] (the same interleave; a reshape and a transpose)
  linear_proj.weight [d, h * k] -> wo [h, k, d]
  linear_fc1.weight  [f, d]; SwiGLU [2f, d] = all gate rows then all up rows -> w1 [d, 2, f]
  linear_fc2.weight  [d, f] -> w2 [f, d]
  router.weight [E, d] -> router [d, E]; experts as fc1/fc2 with a leading expert dim
  word_embeddings [V_padded, d] -> embed (rows cut or zero-padded to this run's padded vocab);
  output_layer [V_padded, d] -> lm_head [d, V]
Norms: Transformer Engine specs fuse them into `linear_qkv.layer_norm_weight` and
`mlp.linear_fc1.layer_norm_weight`; the local spec (and TE's MoE layers) keep
`input_layernorm` / `pre_mlp_layernorm`. Under --apply-layernorm-1p both store gamma - 1, as
mlm_jax does, so norms are copied as stored. `_extra_state`s carry no weights.
"""

from __future__ import annotations

import re
from typing import Callable

import numpy as np

from mlm_jax.checkpoint.megatron.errors import MegatronCheckpointError
from mlm_jax.config import ModelConfig

_PER_EXPERT = re.compile(r"^((?:decoder\.layers\.\d+|mtp\.layers\.\d+\.transformer_layer)\.mlp\.experts)\.(\d+)\."
                         r"(linear_fc[12]\.(?:weight|bias))$")


class Tensors:
    """Global tensors by name, each (file it is in, thunk -> array); records which are used."""

    def __init__(self, tensors: dict[str, tuple[str, Callable[[], np.ndarray]]]):
        self.t = dict(tensors)
        self.used: set[str] = set()
        self._stack_experts()

    def _stack_experts(self) -> None:
        """Per-expert names (legacy, or per-expert DCP keys) -> one [E, ...] tensor per layer."""
        groups: dict[str, dict[int, tuple]] = {}
        for name in list(self.t):
            m = _PER_EXPERT.match(name)
            if m:
                groups.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = self.t.pop(name)
        for name, experts in groups.items():
            idx = sorted(experts)
            where = experts[idx[0]][0]
            if idx != list(range(len(idx))):
                raise MegatronCheckpointError(f"{where}: {name} has experts {idx}, not 0..{len(idx) - 1}")
            thunks = [experts[j][1] for j in idx]
            self.t[name] = (where, lambda thunks=thunks: np.stack([f() for f in thunks]))

    def has(self, name: str) -> bool:
        return name in self.t

    def where(self, name: str) -> str:
        return self.t[name][0] if name in self.t else "the checkpoint"

    def take(self, name: str, shape: tuple[int, ...], why: str = "") -> np.ndarray:
        if name not in self.t:
            raise MegatronCheckpointError(f"the checkpoint has no tensor {name!r}" + (f" ({why})" if why else ""))
        where, thunk = self.t[name]
        x = np.asarray(thunk(), dtype=np.float32)
        if x.shape != tuple(shape):
            raise MegatronCheckpointError(f"{where}: key {name!r} has shape {x.shape}, the checkpoint's args "
                                          f"imply {tuple(shape)}")
        self.used.add(name)
        return x

    def first(self, names: tuple[str, ...], shape, why: str) -> np.ndarray:
        for name in names:
            if name in self.t:
                return self.take(name, shape)
        raise MegatronCheckpointError(f"the checkpoint has none of {list(names)} ({why})")

    def unused(self) -> list[str]:
        return sorted(set(self.t) - self.used)


def to_params(src: Tensors, m: ModelConfig, checkpoint_vocab: int) -> dict:
    """mlm_jax params (fp32 numpy, plain layout) of a Megatron GPT model; `checkpoint_vocab`
    is the checkpoint's padded vocab (the embedding's rows)."""
    d = m.hidden_size
    kinds = [m.is_moe_layer(i) for i in range(m.num_layers)]
    layers = [_layer(src, m, i, kinds[i]) for i in range(m.num_layers)]
    stack = lambda ls: _stack([layers[i] for i in ls])  # noqa: E731
    params: dict = {}
    embed = src.take("embedding.word_embeddings.weight", (checkpoint_vocab, d))
    params["embed"] = _rows(embed, m.vocab)
    if m.position_embedding_type == "learned_absolute":
        params["pos_embed"] = src.take("embedding.position_embeddings.weight", (m.max_position_embeddings, d))
    if len(set(kinds)) > 1:
        params["layers"] = stack([i for i, k in enumerate(kinds) if not k])
        params["moe_layers"] = stack([i for i, k in enumerate(kinds) if k])
    else:
        params["layers"] = stack(range(m.num_layers))
    params["final_norm"] = _norm(src, m, ("decoder.final_layernorm",), "the final norm")
    if m.mtp_num_layers:
        params["mtp"] = _stack([_mtp(src, m, k) for k in range(m.mtp_num_layers)])
    if m.untie_embeddings_and_output_weights:
        params["lm_head"] = _rows(src.take("output_layer.weight", (checkpoint_vocab, d)), m.vocab).T
    elif src.has("output_layer.weight"):  # a tied copy (some converters write one): must equal
        head = src.take("output_layer.weight", (checkpoint_vocab, d))
        if not np.array_equal(head, embed):
            raise MegatronCheckpointError(f"{src.where('output_layer.weight')}: key 'output_layer.weight' differs "
                                          "from the word embeddings, but the args tie them")
    leftover = src.unused()
    if leftover:
        raise MegatronCheckpointError(
            f"{src.where(leftover[0])}: unknown key {leftover[0]!r} (not used by this {_describe(m)} model"
            + (f"; {len(leftover) - 1} more: {leftover[1:6]}" if len(leftover) > 1 else "") + ")")
    return params


def _describe(m: ModelConfig) -> str:
    parts = [m.normalization, m.position_embedding_type, "SwiGLU" if m.swiglu else "GELU",
             "biases" if m.add_bias_linear else "no biases"]
    if m.num_experts:
        parts.append(f"{m.num_experts} experts")
    return ", ".join(parts)


def _rows(x: np.ndarray, rows: int) -> np.ndarray:
    """[V_ckpt, d] -> [rows, d]: Megatron's padding rows are dropped or zero rows added (they
    are never looked up and their logits are cut)."""
    if x.shape[0] >= rows:
        return np.ascontiguousarray(x[:rows])
    return np.concatenate([x, np.zeros((rows - x.shape[0], *x.shape[1:]), x.dtype)])


def _stack(layers: list[dict]) -> dict:
    out = {}
    for key, value in layers[0].items():
        out[key] = _stack([layer[key] for layer in layers]) if isinstance(value, dict) else np.stack(
            [layer[key] for layer in layers])
    return out


def _norm(src: Tensors, m: ModelConfig, prefixes: tuple[str, ...], why: str, weight="weight", bias="bias") -> dict:
    d = m.hidden_size
    names = [(f"{p}.{weight}", f"{p}.{bias}") for p in prefixes]
    for w, b in names:
        if src.has(w):
            out = {"scale": src.take(w, (d,))}
            if m.normalization == "LayerNorm":
                out["bias"] = src.take(b, (d,), why)
            return out
    raise MegatronCheckpointError(f"the checkpoint has none of {[w for w, _ in names]} ({why})")


def _mtp(src: Tensors, m: ModelConfig, k: int) -> dict:
    """Multi-token prediction depth k + 1 (Megatron-Core's `mtp.layers.{k}`): its norms of the
    embedding and of the hidden state, eh_proj ([d, 2d]: the normed embedding's columns, then the
    hidden state's), its layer (the last layer's kind) and its final norm."""
    d, p = m.hidden_size, f"mtp.layers.{k}"
    eh = src.take(f"{p}.eh_proj.weight", (d, 2 * d))
    return {"enorm": _norm(src, m, (f"{p}.enorm",), f"MTP depth {k + 1}'s embedding norm"),
            "hnorm": _norm(src, m, (f"{p}.hnorm",), f"MTP depth {k + 1}'s hidden-state norm"),
            "eh_proj": np.stack([eh[:, :d].T, eh[:, d:].T]),
            "layer": _layer(src, m, m.num_layers - 1, m.is_moe_layer(m.num_layers - 1), f"{p}.transformer_layer"),
            "final_norm": _norm(src, m, (f"{p}.final_layernorm",), f"MTP depth {k + 1}'s final norm")}


def _layer(src: Tensors, m: ModelConfig, i: int, moe: bool, p: str | None = None) -> dict:
    """Layer i (`decoder.layers.{i}`, or the layer under prefix `p`)."""
    d, h, g, k = m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim
    r, bias = h // g, m.add_bias_linear
    p = p or f"decoder.layers.{i}"
    out = {}
    norm1 = (f"{p}.self_attention.linear_qkv.layer_norm_weight", f"{p}.input_layernorm.weight")
    if src.has(norm1[0]):
        out["norm1"] = _norm(src, m, (f"{p}.self_attention.linear_qkv",), "layer norm", "layer_norm_weight",
                             "layer_norm_bias")
    else:
        out["norm1"] = _norm(src, m, (f"{p}.input_layernorm",), f"layer {i}'s input norm")
    if m.multi_latent_attention:
        attn = _mla(src, m, f"{p}.self_attention")
    else:
        qkv = src.take(f"{p}.self_attention.linear_qkv.weight", (g * (r + 2) * k, d))
        attn = {"wqkv": qkv.reshape(g, r + 2, k, d).transpose(3, 0, 1, 2)}  # [d, g, r + 2, k]
        wo = src.take(f"{p}.self_attention.linear_proj.weight", (d, h * k))
        attn["wo"] = wo.T.reshape(h, k, d)
        if bias:
            attn["bqkv"] = src.take(f"{p}.self_attention.linear_qkv.bias", (g * (r + 2) * k,)).reshape(g, r + 2, k)
    if bias:
        attn["bo"] = src.take(f"{p}.self_attention.linear_proj.bias", (d,))
    out["attention"] = attn
    if src.has(f"{p}.mlp.linear_fc1.layer_norm_weight"):
        out["norm2"] = _norm(src, m, (f"{p}.mlp.linear_fc1",), "layer norm", "layer_norm_weight", "layer_norm_bias")
    else:
        out["norm2"] = _norm(src, m, (f"{p}.pre_mlp_layernorm",), f"layer {i}'s pre-MLP norm")
    out["mlp"] = _moe(src, m, p) if moe else _mlp(src, m, f"{p}.mlp", m.ffn_size)
    return out


def _mla(src: Tensors, m: ModelConfig, a: str) -> dict:
    """MLASelfAttention's projections ([out, in]; the up projections' outputs head-major, each
    head's query [no rope; rope] and key/value [key; value], the down projection's [latent; key
    rope part]) and its latent norms (the local spec's q_layernorm / kv_layernorm, or fused into
    Transformer Engine's up projections as layer_norm_weight)."""
    d, h, k, r, e = m.hidden_size, m.num_attention_heads, m.head_dim, m.kv_lora_rank, m.qk_pos_emb_head_dim
    kv = m.qk_head_dim + m.v_head_dim
    out = {"wkv_down": src.take(f"{a}.linear_kv_down_proj.weight", (r + e, d)).T,
           "wkv_up": src.take(f"{a}.linear_kv_up_proj.weight", (h * kv, r)).T.reshape(r, h, kv),
           "wo": src.take(f"{a}.linear_proj.weight", (d, h * m.v_head_dim)).T.reshape(h, m.v_head_dim, d)}
    if m.qk_layernorm:
        out["kv_norm"] = _latent_norm(src, m, a, "kv", r)
    if m.q_lora_rank:
        rq = m.q_lora_rank
        out["wq_down"] = src.take(f"{a}.linear_q_down_proj.weight", (rq, d)).T
        out["wq_up"] = src.take(f"{a}.linear_q_up_proj.weight", (h * k, rq)).T.reshape(rq, h, k)
        if m.qk_layernorm:
            out["q_norm"] = _latent_norm(src, m, a, "q", rq)
    else:
        out["wq"] = src.take(f"{a}.linear_q_proj.weight", (h * k, d)).T.reshape(d, h, k)
    return out


def _latent_norm(src: Tensors, m: ModelConfig, a: str, which: str, width: int) -> dict:
    """An MLA latent's norm: `{which}_layernorm.weight` (local spec) or the up projection's fused
    `layer_norm_weight` (Transformer Engine's)."""
    names = (f"{a}.{which}_layernorm", f"{a}.linear_{which}_up_proj")
    for prefix, w, b in ((names[0], "weight", "bias"), (names[1], "layer_norm_weight", "layer_norm_bias")):
        if src.has(f"{prefix}.{w}"):
            out = {"scale": src.take(f"{prefix}.{w}", (width,))}
            if m.normalization == "LayerNorm":
                out["bias"] = src.take(f"{prefix}.{b}", (width,))
            return out
    raise MegatronCheckpointError(f"the checkpoint has neither {names[0]}.weight nor {names[1]}.layer_norm_weight "
                                  f"(the {which} latent's norm under args.qk_layernorm)")


def _w1(x_nd: np.ndarray, f: int, swiglu: bool) -> np.ndarray:
    """fc1 [.., (2) f, d] -> w1 [.., d, (2,) f]."""
    if not swiglu:
        return np.swapaxes(x_nd, -1, -2)
    lead = x_nd.shape[:-2]
    x = x_nd.reshape(*lead, 2, f, x_nd.shape[-1])  # [.., gate|up, f, d]
    return np.moveaxis(x, -1, len(lead))  # [.., d, 2, f]


def _mlp(src: Tensors, m: ModelConfig, p: str, f: int) -> dict:
    d, n = m.hidden_size, 2 if m.swiglu else 1
    out = {"w1": _w1(src.take(f"{p}.linear_fc1.weight", (n * f, d)), f, m.swiglu),
           "w2": src.take(f"{p}.linear_fc2.weight", (d, f)).T}
    if m.add_bias_linear:
        b1 = src.take(f"{p}.linear_fc1.bias", (n * f,))
        out["b1"] = b1.reshape(2, f) if m.swiglu else b1
        out["b2"] = src.take(f"{p}.linear_fc2.bias", (d,))
    return out


def _moe(src: Tensors, m: ModelConfig, p: str) -> dict:
    d, E, f, n = m.hidden_size, m.num_experts, m.moe_ffn_size, 2 if m.swiglu else 1
    e = f"{p}.mlp.experts"
    out = {"router": src.take(f"{p}.mlp.router.weight", (E, d)).T,
           **({"expert_bias": src.take(f"{p}.mlp.router.expert_bias", (E,))} if m.moe_router_enable_expert_bias else {}),
           "w1": _w1(src.take(f"{e}.linear_fc1.weight", (E, n * f, d)), f, m.swiglu),
           "w2": np.swapaxes(src.take(f"{e}.linear_fc2.weight", (E, d, f)), -1, -2)}
    if m.add_bias_linear:
        b1 = src.take(f"{e}.linear_fc1.bias", (E, n * f))
        out["b1"] = b1.reshape(E, 2, f) if m.swiglu else b1
        out["b2"] = src.take(f"{e}.linear_fc2.bias", (E, d))
    if m.moe_shared_expert_intermediate_size:
        out["shared"] = _mlp(src, m, f"{p}.mlp.shared_experts", m.moe_shared_expert_intermediate_size)
    return out
