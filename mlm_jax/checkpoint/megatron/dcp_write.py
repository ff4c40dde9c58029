"""Megatron-Core's `torch_dist` checkpoints written without PyTorch (dcp.py's format, inverted).

    DIR/latest_checkpointed_iteration.txt
    DIR/iter_XXXXXXX/metadata.json      {"sharded_backend": "torch_dist", ...}
    DIR/iter_XXXXXXX/common.pt          torch.save of args, iteration, checkpoint_version
    DIR/iter_XXXXXXX/.metadata          a pickled DCP `Metadata`
    DIR/iter_XXXXXXX/__0_0.distcp       every chunk, each a torch.save archive of its tensor

What Megatron-Core's `dist_checkpointing.save` writes for a GPT model's sharded state dict,
as its own files show (tests/fixtures/megatron): one *global* tensor per key, layers stacked
on a leading dim (`decoder.layers.self_attention.linear_qkv.weight` is [L, ...], one chunk per
layer at offset (i, 0, ..), shaped [1, ...]), the norms under the fused
names (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`, an MoE layer's too), SwiGLU's
fc1 (weight and bias) as all gate rows then all up rows, each half a chunk; an `_extra_state`
object per linear layer and layer (`[None]`, as the local spec saves it). The layouts inside each
tensor are layout_write.py's, so any tensor-parallel size Megatron loads it with reads its own
slices. The pickle names torch's classes (`torch.distributed.checkpoint.metadata.*`,
`torch.Size`, `torch.float32`) as torch itself would: `pickle.load` of it in Megatron's process
rebuilds torch's objects.

Mixture of experts, as the local spec's SequentialMLP saves them: the router
`decoder.layers.mlp.router.weight` [L, E, d]; the experts stacked on a second dim,
`decoder.layers.mlp.experts.experts.linear_fc1.weight` [L, E, (2) f, d], one chunk per layer and
expert ([1, 1, ...], SwiGLU's halves apart), an `_extra_state` object per layer and expert
(`.../shard_<i>.<j>_<L>.<E>`); a shared expert as an MLP under `mlp.shared_experts`. When the
layers differ (--moe-layer-freq other than 1: Megatron-Core's `non_homogeneous_layers`) nothing
is stacked on L: every layer has its own keys `decoder.layers.<i>.<rest>`, chunks and objects
without the layer dim (`.../shard_0_1`, an expert's `.../shard_<j>_<E>`).

The chunks are written one at a time into one file; everything in a temporary folder beside DIR,
renamed to DIR when complete.
"""

from __future__ import annotations

import copyreg
import io
import json
import os
import re
import shutil
import tempfile

import numpy as np

from mlm_jax.checkpoint.megatron.errors import MegatronCheckpointError
from mlm_jax.checkpoint.megatron.layout_write import global_tensors
from mlm_jax.checkpoint.megatron.torch_write import ArchiveWriter, _Global, _Pickler, megatron_args, publish
from mlm_jax.config import ModelConfig, padded_vocab_size

_DCP = "torch.distributed.checkpoint.metadata"
_STORAGE = "torch.distributed.checkpoint.filesystem"
DATA_FILE = "__0_0.distcp"
METADATA_JSON = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                 "common_backend_version": 1}
# Legacy per-layer names -> the keys Megatron-Core saves (its fused-norm names, its experts).
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer)\.(.*)$")  # never stacked on the layers
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_NORMS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
          "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
          "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
          "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}
_ATTENTION = ("self_attention.linear_proj", "self_attention.linear_qkv")
_MLP = ("mlp.linear_fc1", "mlp.linear_fc2")
_SHARED = ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2")
_EXPERTS = ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")


class _Obj:
    """An instance of torch class `module.name`, pickled as torch's would be: cls.__new__(cls), then
    its state (`__dict__` update, or `__setstate__` of a tuple)."""

    def __init__(self, module: str, name: str, state):
        self.cls, self.state = _Global(module, name), state


class _Call:
    """`module.name(*args)` in the pickle (torch.Size, layouts, enums)."""

    def __init__(self, module: str, name: str, *args):
        self.fn, self.args = _Global(module, name), args


class _DcpPickler(_Pickler):
    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, _Obj):
            self.save_reduce(copyreg.__newobj__, (obj.cls,), state=obj.state)  # (obj: the class check)
            return
        if isinstance(obj, _Call):
            self.save_reduce(obj.fn, obj.args, obj=obj)
            return
        super().save(obj, save_persistent_id)


def _size(shape) -> _Call:
    return _Call("torch", "Size", tuple(int(n) for n in shape))


def _properties() -> _Obj:
    # TensorProperties.__getstate__: (dtype, layout, requires_grad, memory format, pin_memory)
    return _Obj(_DCP, "TensorProperties", (_Global("torch", "float32"),
                                           _Call("torch.serialization", "_get_layout", "torch.strided"), False,
                                           _Call(_DCP, "_MEM_FORMAT_ENCODING", 0), False))


def _index(key: str, offsets=None) -> _Obj:
    state = {"fqn": key, "index": None}
    if offsets is not None:
        state["offset"] = _size(offsets)
    return _Obj(_DCP, "MetadataIndex", state)


def stacked(m: ModelConfig) -> bool:
    """Whether Megatron-Core stacks the layers on a leading dim: every layer alike (its
    `non_homogeneous_layers` is set by a --moe-layer-freq list or one above 1)."""
    return isinstance(m.moe_layer_freq, int) and m.moe_layer_freq <= 1


def dist_key(name: str, m: ModelConfig) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """(Megatron-Core's key, the chunk's leading offsets, the key's leading global dims) of a
    legacy name: layer (stacked), then expert."""
    match, mtp = _LAYER.match(name), _MTP_LAYER.match(name)
    if not (match or mtp):
        return name, (), ()
    rest = (match or mtp).group(2)
    if not m.multi_latent_attention:  # Megatron-Core's MLA specs keep the local norms' names
        rest = _NORMS.get(rest, rest)
    on_layers = match is not None and stacked(m)
    lead, dims = ((int(match.group(1)),), (m.num_layers,)) if on_layers else ((), ())
    expert = _EXPERT.match(rest)
    if expert:
        rest = f"mlp.experts.experts.{expert.group(2)}"
        lead, dims = (*lead, int(expert.group(1))), (*dims, m.num_experts)
    if mtp:
        return f"{mtp.group(1)}.{rest}", lead, dims
    return (f"decoder.layers.{rest}" if on_layers else f"decoder.layers.{match.group(1)}.{rest}"), lead, dims


def _attention_linears(m: ModelConfig) -> tuple[str, ...]:
    if not m.multi_latent_attention:
        return _ATTENTION
    q = ("linear_q_down_proj", "linear_q_up_proj") if m.q_lora_rank else ("linear_q_proj",)
    return tuple(f"self_attention.{lin}" for lin in ("linear_proj", *q, "linear_kv_down_proj", "linear_kv_up_proj"))


def extra_states(m: ModelConfig) -> list[str]:
    """The `_extra_state` object keys of every linear layer: per layer (and expert), numbered as
    Megatron-Core's ShardedObjects (`shard_<offsets>_<global counts>`)."""
    L, E = m.num_layers, m.num_experts
    out = []
    for i in range(L):
        moe = m.is_moe_layer(i)
        linears = _attention_linears(m) + ((_SHARED if m.moe_shared_expert_intermediate_size else ()) if moe else _MLP)
        if stacked(m):
            out += [f"decoder.layers.{lin}._extra_state/shard_{i}_{L}" for lin in linears]
            if moe:
                out += [f"decoder.layers.{lin}._extra_state/shard_{i}.{j}_{L}.{E}" for lin in _EXPERTS
                        for j in range(E)]
        else:
            out += _layer_extra_states(m, f"decoder.layers.{i}", moe)
    for k in range(m.mtp_num_layers or 0):  # each depth's own keys, its layer the last layer's kind
        out += [f"mtp.layers.{k}.eh_proj._extra_state/shard_0_1"]
        out += _layer_extra_states(m, f"mtp.layers.{k}.transformer_layer", m.is_moe_layer(L - 1))
    return out


def _layer_extra_states(m: ModelConfig, p: str, moe: bool) -> list[str]:
    """A layer's `_extra_state` keys under its own prefix `p` (not stacked on the layers)."""
    E = m.num_experts
    linears = _attention_linears(m) + ((_SHARED if m.moe_shared_expert_intermediate_size else ()) if moe else _MLP)
    out = [f"{p}.{lin}._extra_state/shard_0_1" for lin in linears]
    if moe:
        out += [f"{p}.{lin}._extra_state/shard_{j}_{E}" for lin in _EXPERTS for j in range(E)]
    return out


def _chunk_bytes(x: np.ndarray) -> bytes:
    buf = io.BytesIO()
    w = ArchiveWriter(buf)
    w.close(w.tensor(x))
    return buf.getvalue()


def _object_bytes(obj) -> bytes:
    buf = io.BytesIO()
    ArchiveWriter(buf).close(obj)
    return buf.getvalue()


def write_torch_dist(save: str, params: dict, m: ModelConfig, iteration: int, consumed_samples: int = 0,
                     tokenizer: dict | None = None, tokenizer_files: dict[str, bytes] | None = None) -> str:
    """Write `params` (numpy, plain layout) as a Megatron-Core `torch_dist` checkpoint at `save`;
    returns the iteration folder. `save` must not exist or be empty; nothing is left on failure."""
    save = os.path.abspath(save)
    if os.path.exists(save) and (not os.path.isdir(save) or os.listdir(save)):
        raise MegatronCheckpointError(f"--save {save}: exists and is not empty")
    rows = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1)
    args = megatron_args(m, 1, 1, iteration, consumed_samples, tokenizer, ckpt_format="torch_dist")
    parent = os.path.dirname(save)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(save)}.tmp-", dir=parent)
    try:
        it = os.path.join(tmp, f"iter_{iteration:07d}")
        os.makedirs(it)
        tensors: dict[str, dict] = {}  # key -> {"size": global shape, "chunks": [(offsets, sizes)]}
        storage = {}
        with open(os.path.join(it, DATA_FILE), "wb") as f:
            def put(index: _Obj, data: bytes) -> None:
                storage[index] = _Obj(_STORAGE, "_StorageInfo",
                                      {"relative_path": DATA_FILE, "offset": f.tell(), "length": len(data)})
                f.write(data)

            for name, x in global_tensors(params, m, rows):
                key, lead, dims = dist_key(name, m)
                gated = m.swiglu and key.endswith(("linear_fc1.weight", "linear_fc1.bias"))
                parts = np.split(x, 2 if gated else 1, axis=0)  # gate, then up
                entry = tensors.setdefault(key, {"size": (*dims, *x.shape), "chunks": []})
                for h, part in enumerate(parts):
                    offsets = (*lead, h * part.shape[0], *([0] * (part.ndim - 1)))
                    chunk = part.reshape((1,) * len(lead) + part.shape)  # [1, (1,) ...]: this layer's (expert's)
                    entry["chunks"].append((offsets, chunk.shape))
                    put(_index(key, offsets), _chunk_bytes(chunk))
                del x
            objects = extra_states(m)
            for key in objects:
                put(_index(key), _object_bytes([None]))
        state = {key: _Obj(_DCP, "TensorStorageMetadata", {
            "properties": _properties(), "size": _size(t["size"]),
            "chunks": [_Obj(_DCP, "ChunkStorageMetadata", {"offsets": _size(o), "sizes": _size(s)})
                       for o, s in t["chunks"]]}) for key, t in tensors.items()}
        state.update({key: _Obj(_DCP, "BytesStorageMetadata", {}) for key in objects})
        metadata = _Obj(_DCP, "Metadata", {"state_dict_metadata": state, "planner_data": None,
                                           "storage_data": storage, "storage_meta": None, "version": "1.0.0"})
        buf = io.BytesIO()
        _DcpPickler(buf).dump(metadata)
        with open(os.path.join(it, ".metadata"), "wb") as f:
            f.write(buf.getvalue())
        ArchiveWriter(os.path.join(it, "common.pt")).close(
            {"args": args, "checkpoint_version": 3.0, "iteration": iteration,
             "num_floating_point_operations_so_far": 0})
        with open(os.path.join(it, "metadata.json"), "w") as f:
            json.dump(METADATA_JSON, f)
        publish(tmp, save, iteration, tokenizer_files)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.join(save, f"iter_{iteration:07d}")
