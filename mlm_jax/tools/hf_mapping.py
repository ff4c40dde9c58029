"""Hugging Face tensor names and layouts <-> mlm_jax params, for GPT-2, Llama and Mixtral.

Pure numpy. The layouts each family uses are described in mlm_jax/tools/checkpoint.py's
docstring; the folders, configs and command line are there too, and it re-exports these names.
"""

from __future__ import annotations

import numpy as np

from mlm_jax.config import ConfigError, ModelConfig

_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")  # buffers, not weights


class HFError(ConfigError):
    """A Hugging Face folder or model that cannot be converted; the message says why."""


def _gpt2_prefix(tensors: dict) -> str:
    return "transformer." if any(k.startswith("transformer.") for k in tensors) else ""


class _HFTensors:
    """The Hugging Face tensors of one import; remembers which were taken, so leftovers are refused."""

    def __init__(self, tensors: dict[str, np.ndarray], m: ModelConfig, kind: str, padded_vocab: int):
        self.t = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
        self.used: set[str] = set()
        self.kind, self.num_layers, self.vocab, self.padded_vocab = kind, m.num_layers, m.vocab_size, padded_vocab
        self.one_p = m.apply_layernorm_1p

    def norm(self, name: str) -> np.ndarray:
        """A norm weight: Hugging Face's gamma, stored as gamma - 1 under --apply-layernorm-1p."""
        return self.take(name) - 1.0 if self.one_p else self.take(name)

    def take(self, name: str) -> np.ndarray:
        if name not in self.t:
            raise HFError(f"the safetensors have no tensor {name!r} (needed by a {self.kind} model of this config)")
        self.used.add(name)
        self.last = name  # the tensor being converted: named if its shape does not fit
        return np.asarray(self.t[name], dtype=np.float32)

    def pad_rows(self, x: np.ndarray) -> np.ndarray:  # [V, ...] -> [padded, ...], zero rows
        V = self.vocab
        if x.shape[0] != V:
            raise HFError(f"vocab tensor has {x.shape[0]} rows, config.json says vocab_size {V}")
        return np.concatenate([x, np.zeros((self.padded_vocab - V, *x.shape[1:]), np.float32)])

    def stack(self, fn) -> np.ndarray:  # fn(layer) for every layer -> [L, ...]
        return np.stack([fn(i) for i in range(self.num_layers)])


def hf_to_params(tensors: dict[str, np.ndarray], m: ModelConfig, kind: str, padded_vocab: int) -> dict:
    """Hugging Face tensors -> mlm_jax params (plain layout, fp32 numpy, vocab padded)."""
    src = _HFTensors(tensors, m, kind, padded_vocab)
    try:
        params = (_gpt2_params(src, m) if kind == "gpt2" else _deepseek_v3_params(src, m) if kind == "deepseek_v3"
                  else _llama_params(src, m, kind))
    except ValueError as e:  # a reshape or stack that the tensor's shape does not allow
        name = getattr(src, "last", None)
        shape = tuple(src.t[name].shape) if name else None
        raise HFError(f"tensor {name!r} has shape {shape}, which this config does not give it "
                      f"({' '.join(str(e).split())})") from None
    unused = sorted(set(src.t) - src.used)
    if unused:
        raise HFError(f"the safetensors hold tensors this {kind} config does not use: {unused[:8]}"
                      + (f" and {len(unused) - 8} more" if len(unused) > 8 else ""))
    return params


def _gpt2_params(src: _HFTensors, m: ModelConfig) -> dict:
    """GPT2LMHeadModel tensors -> params (Conv1D weights are already [in, out])."""
    take, stack, t, norm = src.take, src.stack, src.t, src.norm
    d, h, k = m.hidden_size, m.num_attention_heads, m.head_dim
    p = _gpt2_prefix(t)
    ln = lambda name: {"scale": norm(f"{name}.weight"), "bias": take(f"{name}.bias")}  # noqa: E731

    def qkv_w(i):  # [d, 3*h*k] (q | k | v) -> [d, h, 3, k]
        w = take(f"{p}h.{i}.attn.c_attn.weight").reshape(d, 3, h, k)
        return w.transpose(0, 2, 1, 3)

    def qkv_b(i):
        return take(f"{p}h.{i}.attn.c_attn.bias").reshape(3, h, k).transpose(1, 0, 2)

    layers = {
        "norm1": {"scale": stack(lambda i: norm(f"{p}h.{i}.ln_1.weight")),
                  "bias": stack(lambda i: take(f"{p}h.{i}.ln_1.bias"))},
        "attention": {
            "wqkv": stack(qkv_w), "bqkv": stack(qkv_b),
            "wo": stack(lambda i: take(f"{p}h.{i}.attn.c_proj.weight").reshape(h, k, d)),
            "bo": stack(lambda i: take(f"{p}h.{i}.attn.c_proj.bias"))},
        "norm2": {"scale": stack(lambda i: norm(f"{p}h.{i}.ln_2.weight")),
                  "bias": stack(lambda i: take(f"{p}h.{i}.ln_2.bias"))},
        "mlp": {
            "w1": stack(lambda i: take(f"{p}h.{i}.mlp.c_fc.weight")),
            "b1": stack(lambda i: take(f"{p}h.{i}.mlp.c_fc.bias")),
            "w2": stack(lambda i: take(f"{p}h.{i}.mlp.c_proj.weight")),
            "b2": stack(lambda i: take(f"{p}h.{i}.mlp.c_proj.bias"))},
    }
    params = {"embed": src.pad_rows(take(f"{p}wte.weight")), "pos_embed": take(f"{p}wpe.weight"),
              "layers": layers, "final_norm": ln(f"{p}ln_f")}
    head = "lm_head.weight"
    if m.untie_embeddings_and_output_weights:
        params["lm_head"] = src.pad_rows(take(head)).T
    elif head in t:
        if not np.array_equal(t[head], t[f"{p}wte.weight"]):
            raise HFError("tie_word_embeddings is true but lm_head.weight differs from wte.weight")
        src.used.add(head)
    return params


def _llama_params(src: _HFTensors, m: ModelConfig, kind: str) -> dict:
    """LlamaForCausalLM / MixtralForCausalLM tensors -> params (Linear weights are [out, in])."""
    take, stack, norm = src.take, src.stack, src.norm
    d, h, g, k = m.hidden_size, m.num_attention_heads, m.query_groups, m.head_dim
    r = h // g

    def qkv_w(i):  # q [h*k, d], k/v [g*k, d] -> [d, g, r + 2, k]
        q = take(f"model.layers.{i}.self_attn.q_proj.weight").reshape(g, r, k, d)
        kk = take(f"model.layers.{i}.self_attn.k_proj.weight").reshape(g, 1, k, d)
        v = take(f"model.layers.{i}.self_attn.v_proj.weight").reshape(g, 1, k, d)
        return np.concatenate([q, kk, v], axis=1).transpose(3, 0, 1, 2)

    def w1(i):  # gate/up [f, d] -> [d, 2, f]
        return np.stack([take(f"model.layers.{i}.mlp.gate_proj.weight").T,
                         take(f"model.layers.{i}.mlp.up_proj.weight").T], axis=1)

    layers = {
        "norm1": {"scale": stack(lambda i: norm(f"model.layers.{i}.input_layernorm.weight"))},
        "attention": {
            "wqkv": stack(qkv_w),
            "wo": stack(lambda i: take(f"model.layers.{i}.self_attn.o_proj.weight").T.reshape(h, k, d))},
        "norm2": {"scale": stack(lambda i: norm(f"model.layers.{i}.post_attention_layernorm.weight"))},
        "mlp": (_mixtral_experts_in(take, m, stack) if kind == "mixtral" else
                {"w1": stack(w1), "w2": stack(lambda i: take(f"model.layers.{i}.mlp.down_proj.weight").T)}),
    }
    params = {"embed": src.pad_rows(take("model.embed_tokens.weight")), "layers": layers,
              "final_norm": {"scale": norm("model.norm.weight")}}
    if m.untie_embeddings_and_output_weights:
        params["lm_head"] = src.pad_rows(take("lm_head.weight")).T
    elif "lm_head.weight" in src.t:
        src.used.add("lm_head.weight")
    return params


def _deepseek_v3_params(src: _HFTensors, m: ModelConfig) -> dict:
    """DeepseekV3ForCausalLM tensors -> params: MLA's projections (Linear weights [out, in]; the up
    projections' outputs head-major: head i's channels i*c .. (i+1)*c), the dense first layers'
    MLP, the MoE layers' router, expert bias, experts and shared expert. With dense and MoE layers
    both, the dense ones are `layers` and the MoE ones `moe_layers` (models/gpt.py)."""
    take, norm = src.take, src.norm
    d, h, k = m.hidden_size, m.num_attention_heads, m.head_dim
    kv, r = m.qk_head_dim + m.v_head_dim, m.kv_lora_rank

    def layer(i: int) -> dict:
        a = f"model.layers.{i}.self_attn."
        attn = {"wkv_down": take(a + "kv_a_proj_with_mqa.weight").T,
                "kv_norm": {"scale": norm(a + "kv_a_layernorm.weight")},
                "wkv_up": take(a + "kv_b_proj.weight").T.reshape(r, h, kv),
                "wo": take(a + "o_proj.weight").T.reshape(h, m.v_head_dim, d)}
        if m.q_lora_rank:
            attn.update(wq_down=take(a + "q_a_proj.weight").T, q_norm={"scale": norm(a + "q_a_layernorm.weight")},
                        wq_up=take(a + "q_b_proj.weight").T.reshape(m.q_lora_rank, h, k))
        else:
            attn["wq"] = take(a + "q_proj.weight").T.reshape(d, h, k)
        mlp = f"model.layers.{i}.mlp."
        return {"norm1": {"scale": norm(f"model.layers.{i}.input_layernorm.weight")}, "attention": attn,
                "norm2": {"scale": norm(f"model.layers.{i}.post_attention_layernorm.weight")},
                "mlp": _deepseek_moe_in(src, m, mlp) if m.is_moe_layer(i) else _swiglu_in(take, mlp)}

    def stacked(indices):
        return _stack_trees([layer(i) for i in indices])

    moe = [i for i in range(m.num_layers) if m.is_moe_layer(i)]
    dense = [i for i in range(m.num_layers) if not m.is_moe_layer(i)]
    params = {"embed": src.pad_rows(take("model.embed_tokens.weight")),
              "layers": stacked(dense if dense else moe), "final_norm": {"scale": norm("model.norm.weight")}}
    if dense and moe:
        params["moe_layers"] = stacked(moe)
    if m.untie_embeddings_and_output_weights:
        params["lm_head"] = src.pad_rows(take("lm_head.weight")).T
    elif "lm_head.weight" in src.t:
        src.used.add("lm_head.weight")
    # Multi-token prediction layers past the model's (model.layers.{L}...): transformers drops them too.
    src.used.update(n for n in src.t if n.startswith("model.layers.") and int(n.split(".")[2]) >= m.num_layers)
    return params


def _swiglu_in(take, pre: str) -> dict:
    """A SwiGLU MLP's gate/up/down_proj [out, in] -> w1 [d, 2, f], w2 [f, d]."""
    return {"w1": np.stack([take(pre + "gate_proj.weight").T, take(pre + "up_proj.weight").T], axis=1),
            "w2": take(pre + "down_proj.weight").T}


def _deepseek_moe_in(src: _HFTensors, m: ModelConfig, pre: str) -> dict:
    """A DeepSeek-V3 MoE's gate [E, d], e_score_correction_bias [E], experts (one module each, or
    transformers 5's fused gate_up_proj [E, 2f, d] and down_proj [E, d, f]) and shared experts."""
    E, f, take = m.num_experts, m.moe_ffn_size, src.take
    if pre + "experts.gate_up_proj" in src.t:
        gate_up, down = take(pre + "experts.gate_up_proj"), take(pre + "experts.down_proj")
        w1 = np.stack([gate_up[:, :f].transpose(0, 2, 1), gate_up[:, f:].transpose(0, 2, 1)], axis=2)
        w2 = down.transpose(0, 2, 1)
    else:
        experts = [_swiglu_in(take, pre + f"experts.{j}.") for j in range(E)]
        w1, w2 = np.stack([e["w1"] for e in experts]), np.stack([e["w2"] for e in experts])
    out = {"router": take(pre + "gate.weight").T, "expert_bias": take(pre + "gate.e_score_correction_bias"),
           "w1": w1, "w2": w2}
    if m.moe_shared_expert_intermediate_size:
        out["shared"] = _swiglu_in(take, pre + "shared_experts.")
    return out


def _deepseek_v3_out(P: dict, m: ModelConfig, put, embed) -> None:
    """params -> DeepseekV3ForCausalLM tensors (the inverse of `_deepseek_v3_params`; experts one
    module each, as transformers saves them)."""
    d, h = m.hidden_size, m.num_attention_heads
    moe = [i for i in range(m.num_layers) if m.is_moe_layer(i)]
    dense = [i for i in range(m.num_layers) if not m.is_moe_layer(i)]
    put("model.embed_tokens.weight", embed)
    for i in range(m.num_layers):
        stack = "moe_layers" if (dense and moe and i in moe) else "layers"
        j = (moe if stack == "moe_layers" or not dense else dense).index(i)
        L = lambda name: P[f"{stack}/{name}"][j]  # noqa: E731
        a = f"model.layers.{i}.self_attn."
        put(f"model.layers.{i}.input_layernorm.weight", L("norm1/scale"))
        put(f"model.layers.{i}.post_attention_layernorm.weight", L("norm2/scale"))
        put(a + "kv_a_proj_with_mqa.weight", L("attention/wkv_down").T)
        put(a + "kv_a_layernorm.weight", L("attention/kv_norm/scale"))
        put(a + "kv_b_proj.weight", L("attention/wkv_up").reshape(m.kv_lora_rank, -1).T)
        put(a + "o_proj.weight", L("attention/wo").reshape(h * m.v_head_dim, d).T)
        if m.q_lora_rank:
            put(a + "q_a_proj.weight", L("attention/wq_down").T)
            put(a + "q_a_layernorm.weight", L("attention/q_norm/scale"))
            put(a + "q_b_proj.weight", L("attention/wq_up").reshape(m.q_lora_rank, -1).T)
        else:
            put(a + "q_proj.weight", L("attention/wq").reshape(d, -1).T)
        mlp = f"model.layers.{i}.mlp."
        if not m.is_moe_layer(i):
            _swiglu_out(put, mlp, L("mlp/w1"), L("mlp/w2"))
            continue
        put(mlp + "gate.weight", L("mlp/router").T)
        bias = P.get(f"{stack}/mlp/expert_bias")
        put(mlp + "gate.e_score_correction_bias", bias[j] if bias is not None else np.zeros(m.num_experts))
        for e in range(m.num_experts):
            _swiglu_out(put, mlp + f"experts.{e}.", L("mlp/w1")[e], L("mlp/w2")[e])
        if m.moe_shared_expert_intermediate_size:
            _swiglu_out(put, mlp + "shared_experts.", L("mlp/shared/w1"), L("mlp/shared/w2"))
    put("model.norm.weight", P["final_norm/scale"])


def _swiglu_out(put, pre: str, w1, w2) -> None:
    """w1 [d, 2, f], w2 [f, d] -> gate/up/down_proj [out, in] (the inverse of `_swiglu_in`)."""
    put(pre + "gate_proj.weight", w1[:, 0].T)
    put(pre + "up_proj.weight", w1[:, 1].T)
    put(pre + "down_proj.weight", w2.T)


def _stack_trees(trees: list[dict]) -> dict:
    """Nested dicts of arrays, stacked leaf by leaf on a new leading (layers) dim."""
    first = trees[0]
    return {k: _stack_trees([t[k] for t in trees]) if isinstance(first[k], dict) else np.stack([t[k] for t in trees])
            for k in first}


def _mixtral_experts_in(take, m: ModelConfig, stack) -> dict:
    """block_sparse_moe tensors -> our MoE params: router [L, d, E], w1 [L, E, d, 2, f], w2 [L, E, f, d]."""
    E = m.num_experts

    def moe(i, name):
        return f"model.layers.{i}.block_sparse_moe.{name}"

    def w1(i):  # w1 (gate) and w3 (up) [f, d] -> [E, d, 2, f]
        return np.stack([np.stack([take(moe(i, f"experts.{j}.w1.weight")).T,
                                   take(moe(i, f"experts.{j}.w3.weight")).T], axis=1) for j in range(E)])

    return {"router": stack(lambda i: take(moe(i, "gate.weight")).T), "w1": stack(w1),
            "w2": stack(lambda i: np.stack([take(moe(i, f"experts.{j}.w2.weight")).T for j in range(E)]))}


def _mixtral_experts_out(P: dict, m: ModelConfig, i: int, put) -> None:
    """Layer i's MoE params -> its block_sparse_moe tensors (the inverse of _mixtral_experts_in)."""
    pre = f"model.layers.{i}.block_sparse_moe"
    put(f"{pre}.gate.weight", P["layers/mlp/router"][i].T)
    for j in range(m.num_experts):
        put(f"{pre}.experts.{j}.w1.weight", P["layers/mlp/w1"][i][j][:, 0].T)
        put(f"{pre}.experts.{j}.w3.weight", P["layers/mlp/w1"][i][j][:, 1].T)
        put(f"{pre}.experts.{j}.w2.weight", P["layers/mlp/w2"][i][j].T)


def params_to_hf(params: dict, m: ModelConfig, kind: str, dtype=np.float32, prefix: str = "transformer.",
                 write_tied_head: bool = False) -> dict[str, np.ndarray]:
    """mlm_jax params (plain layout) -> Hugging Face tensors, true vocab rows only."""
    d, L, V = m.hidden_size, m.num_layers, m.vocab_size
    h, g, k = m.num_attention_heads, m.query_groups, m.head_dim
    r = h // g
    P = {kk: np.asarray(v) for kk, v in _flatten(params).items()}
    if m.apply_layernorm_1p:  # stored gamma - 1 -> Hugging Face's gamma
        P.update({kk: v + 1.0 for kk, v in P.items() if kk.endswith("/scale")})
    out: dict[str, np.ndarray] = {}

    def put(name, x):
        out[name] = np.ascontiguousarray(np.asarray(x, np.float32).astype(dtype))

    embed = P["embed"][:V]
    if kind == "deepseek_v3":
        _deepseek_v3_out(P, m, put, embed)
    elif kind == "gpt2":
        p = prefix
        put(f"{p}wte.weight", embed)
        put(f"{p}wpe.weight", P["pos_embed"])
        for i in range(L):
            put(f"{p}h.{i}.ln_1.weight", P["layers/norm1/scale"][i])
            put(f"{p}h.{i}.ln_1.bias", P["layers/norm1/bias"][i])
            put(f"{p}h.{i}.attn.c_attn.weight", P["layers/attention/wqkv"][i].transpose(0, 2, 1, 3).reshape(d, 3 * h * k))
            put(f"{p}h.{i}.attn.c_attn.bias", P["layers/attention/bqkv"][i].transpose(1, 0, 2).reshape(3 * h * k))
            put(f"{p}h.{i}.attn.c_proj.weight", P["layers/attention/wo"][i].reshape(h * k, d))
            put(f"{p}h.{i}.attn.c_proj.bias", P["layers/attention/bo"][i])
            put(f"{p}h.{i}.ln_2.weight", P["layers/norm2/scale"][i])
            put(f"{p}h.{i}.ln_2.bias", P["layers/norm2/bias"][i])
            put(f"{p}h.{i}.mlp.c_fc.weight", P["layers/mlp/w1"][i])
            put(f"{p}h.{i}.mlp.c_fc.bias", P["layers/mlp/b1"][i])
            put(f"{p}h.{i}.mlp.c_proj.weight", P["layers/mlp/w2"][i])
            put(f"{p}h.{i}.mlp.c_proj.bias", P["layers/mlp/b2"][i])
        put(f"{p}ln_f.weight", P["final_norm/scale"])
        put(f"{p}ln_f.bias", P["final_norm/bias"])
    else:
        put("model.embed_tokens.weight", embed)
        for i in range(L):
            qkv = P["layers/attention/wqkv"][i].transpose(1, 2, 3, 0)  # [g, r + 2, k, d]
            put(f"model.layers.{i}.input_layernorm.weight", P["layers/norm1/scale"][i])
            put(f"model.layers.{i}.self_attn.q_proj.weight", qkv[:, :r].reshape(h * k, d))
            put(f"model.layers.{i}.self_attn.k_proj.weight", qkv[:, r].reshape(g * k, d))
            put(f"model.layers.{i}.self_attn.v_proj.weight", qkv[:, r + 1].reshape(g * k, d))
            put(f"model.layers.{i}.self_attn.o_proj.weight", P["layers/attention/wo"][i].reshape(h * k, d).T)
            put(f"model.layers.{i}.post_attention_layernorm.weight", P["layers/norm2/scale"][i])
            if kind == "mixtral":
                _mixtral_experts_out(P, m, i, put)
                continue
            put(f"model.layers.{i}.mlp.gate_proj.weight", P["layers/mlp/w1"][i][:, 0].T)
            put(f"model.layers.{i}.mlp.up_proj.weight", P["layers/mlp/w1"][i][:, 1].T)
            put(f"model.layers.{i}.mlp.down_proj.weight", P["layers/mlp/w2"][i].T)
        put("model.norm.weight", P["final_norm/scale"])
    if m.untie_embeddings_and_output_weights:
        put("lm_head.weight", P["lm_head"][:, :V].T)
    elif write_tied_head:
        put("lm_head.weight", embed)
    return out


def _flatten(tree, prefix=""):
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "/"))
        elif value is not None:
            out[name] = value
    return out
