"""Megatron-LM's legacy `torch` checkpoints written without PyTorch.

    DIR/latest_checkpointed_iteration.txt
    DIR/iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt

Each file is a torch.save zip archive (torch/serialization.py's format: `archive/data.pkl`, a
protocol 2 pickle whose tensors are `torch._utils._rebuild_tensor_v2(storage, offset, size,
stride, requires_grad, OrderedDict())` with the storage a persistent id `('storage',
torch.FloatStorage, key, 'cpu', numel)`; `archive/data/<key>` the storage's little-endian bytes,
64-byte aligned as torch writes them; `archive/byteorder`, `archive/version`). It holds what
Megatron-LM's save_checkpoint writes for `--ckpt-format torch` minus the optimizer and RNG
states: `args` (an argparse.Namespace of the model's Megatron flags), `checkpoint_version` 3.0,
`iteration`, `num_floating_point_operations_so_far` and `model`, that rank's state dict
(layout_write.py's names, tensor-parallel pieces, layers numbered within the pipeline stage).

Tensors are written one at a time as they are converted: the model is in host memory once.
Everything is written in a temporary folder beside DIR, renamed to DIR when complete.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import io
import os
import pickle
import shutil
import struct
import tempfile
import zipfile

import numpy as np

from mlm_jax.checkpoint.megatron.errors import MegatronCheckpointError
from mlm_jax.checkpoint.megatron.layout_write import check_layout, global_tensors, shard
from mlm_jax.checkpoint.megatron.legacy import FILE
from mlm_jax.config import ModelConfig, padded_vocab_size

TRACKER = "latest_checkpointed_iteration.txt"
_ALIGN = 64  # torch.save aligns each record's data to 64 bytes


class _Global:
    """A global pickled by name (`module.name`) though its module (torch) is not importable here."""

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args):  # pickle's save_reduce wants a callable; never called here
        raise TypeError(f"{self.module}.{self.name} is a stand-in")


REBUILD_TENSOR = _Global("torch._utils", "_rebuild_tensor_v2")
FLOAT_STORAGE = _Global("torch", "FloatStorage")


class _StorageRef:
    def __init__(self, key: str, numel: int):
        self.key, self.numel = key, numel


class _TensorRef:
    """A contiguous fp32 tensor already written as `data/<key>`: pickles as torch does."""

    def __init__(self, key: str, shape: tuple[int, ...]):
        self.storage = _StorageRef(key, int(np.prod(shape, dtype=np.int64)))
        self.shape = tuple(int(s) for s in shape)

    def stride(self) -> tuple[int, ...]:
        out, acc = [], 1
        for n in reversed(self.shape):
            out.append(acc)
            acc *= n
        return tuple(reversed(out))


class _Pickler(pickle._Pickler):  # the Python pickler: its save_global can be overridden
    def __init__(self, f):
        super().__init__(f, protocol=2)

    def persistent_id(self, obj):
        if isinstance(obj, _StorageRef):
            return ("storage", FLOAT_STORAGE, obj.key, "cpu", obj.numel)
        return None

    def save_global(self, obj, name=None):
        if isinstance(obj, _Global):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("ascii"))
            self.memoize(obj)
            return
        super().save_global(obj, name)

    def save(self, obj, save_persistent_id=True):
        if isinstance(obj, _TensorRef):
            # torch.Tensor.__reduce_ex__: _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)
            self.save_reduce(REBUILD_TENSOR, (obj.storage, 0, obj.shape, obj.stride(), False,
                                              collections.OrderedDict()), obj=obj)
            return
        if isinstance(obj, _Global):
            memo = self.memo.get(id(obj))
            if memo is not None:
                self.write(self.get(memo[0]))
            else:
                self.save_global(obj)
            return
        super().save(obj, save_persistent_id)


class ArchiveWriter:
    """A torch.save zip archive written record by record (tensors streamed, pickle last)."""

    def __init__(self, path, prefix: str = "archive"):
        """`path`: a file name, or a binary file object (an archive in memory)."""
        self.path, self.prefix = path, prefix
        self.zip = zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True)
        self.n = 0

    def _record(self, name: str, data: bytes | memoryview) -> None:
        info = zipfile.ZipInfo(f"{self.prefix}/{name}", date_time=(1980, 1, 1, 0, 0, 0))
        info.compress_type = zipfile.ZIP_STORED
        size = len(data)
        zip64 = size >= zipfile.ZIP64_LIMIT
        offset = self.zip.fp.tell()
        head = 30 + len(info.filename.encode("utf-8")) + 4 + (20 if zip64 else 0)
        pad = (-(offset + head)) % _ALIGN
        info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad  # torch's padding field
        info.file_size = size
        with self.zip.open(info, "w", force_zip64=zip64) as f:
            f.write(data)

    def tensor(self, x: np.ndarray) -> _TensorRef:
        x = np.ascontiguousarray(x, dtype="<f4")
        key = str(self.n)
        self.n += 1
        self._record(f"data/{key}", memoryview(x).cast("B"))
        return _TensorRef(key, x.shape)

    def close(self, obj) -> None:
        buf = io.BytesIO()
        _Pickler(buf).dump(obj)
        self._record("data.pkl", buf.getvalue())
        self._record("byteorder", b"little")
        self._record("version", b"3\n")
        self.zip.close()


# --------------------------------------------------------------------------- args


def megatron_args(m: ModelConfig, tp: int, pp: int, iteration: int, consumed_samples: int,
                  tokenizer: dict | None, ckpt_format: str = "torch") -> argparse.Namespace:
    """The args Megatron-LM would hold for this model (args.py's model_config_from_args maps
    them back to `m`): every ModelConfig field under its Megatron name, plus the flags Megatron
    derives (group_query_attention, kv_channels, padded vocab for `tp`, parallel sizes)."""
    fields = {f.name: getattr(m, f.name) for f in dataclasses.fields(ModelConfig)}
    fields = {k: (list(v) if isinstance(v, tuple) else v) for k, v in fields.items()}
    h = m.num_attention_heads
    tok = dict(tokenizer or {})
    kind = tok.get("tokenizer_type") or "NullTokenizer"
    vocab = m.vocab_size - 1 if kind == "NullTokenizer" else m.vocab_size  # NullTokenizer adds its eod
    fields.update(
        ffn_hidden_size=m.ffn_size, num_query_groups=m.query_groups, group_query_attention=m.query_groups != h,
        # MLA's head dims are its own args; Megatron-LM's kv_channels default (hidden / heads) stays.
        kv_channels=(m.kv_channels or m.hidden_size // h) if m.multi_latent_attention else m.head_dim,
        padded_vocab_size=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp),
        vocab_size=vocab, tokenizer_type=kind, vocab_file=tok.get("vocab_file"), merge_file=tok.get("merge_file"),
        tokenizer_model=tok.get("tokenizer_model"), tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=1,
        transformer_impl="local", use_rotary_position_embeddings=m.position_embedding_type == "rope",
        iteration=iteration, consumed_train_samples=consumed_samples,
        consumed_valid_samples=0, ckpt_format=ckpt_format, bf16=False, fp16=False,
        # Megatron's names of the same settings (older releases read these, newer ones both);
        # add_qkv_bias is a QKV bias without the others' (add_bias_linear covers QKV's too).
        layernorm_epsilon=m.norm_epsilon, add_qkv_bias=False,
        add_position_embedding=m.position_embedding_type == "learned_absolute",
        **_gelu_args(m))
    if m.num_experts:
        # The experts are written as the local spec's SequentialMLP (layout_write.py): Megatron
        # builds that one for these args (mlm_jax's own field says how mlm_jax computes them).
        fields.update(moe_ffn_hidden_size=m.moe_ffn_size, moe_grouped_gemm=False)
    return argparse.Namespace(**fields)


def _gelu_args(m: ModelConfig) -> dict:
    """The GELU as Megatron-Core's args say it: with biases, the tanh approximation is its fused
    bias + GELU (bias_gelu_fusion, what a GPT-2 run's args hold: args.py maps it back), else
    openai_gelu; the exact GELU is neither."""
    fused = m.openai_gelu and m.add_bias_linear and not m.swiglu
    return {"bias_gelu_fusion": fused, "openai_gelu": m.openai_gelu and not fused}


# --------------------------------------------------------------------------- the checkpoint


def rank_dir(t: int, p: int, pp: int) -> str:
    return f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"


def write_legacy(save: str, params: dict, m: ModelConfig, iteration: int, tp: int = 1, pp: int = 1,
                 consumed_samples: int = 0, tokenizer: dict | None = None,
                 tokenizer_files: dict[str, bytes] | None = None) -> str:
    """Write `params` (numpy, plain layout) as a legacy Megatron checkpoint at `save`; returns
    the iteration folder. `save` must not exist or be empty; nothing is left on failure."""
    save = os.path.abspath(save)
    if os.path.exists(save) and (not os.path.isdir(save) or os.listdir(save)):
        raise MegatronCheckpointError(f"--save {save}: exists and is not empty")
    check_layout(m, tp, pp)
    rows = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    args = megatron_args(m, tp, pp, iteration, consumed_samples, tokenizer)
    parent = os.path.dirname(save)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(save)}.tmp-", dir=parent)
    try:
        it = os.path.join(tmp, f"iter_{iteration:07d}")
        per = m.num_layers // pp
        for p in range(pp):
            for t in range(tp):
                folder = os.path.join(it, rank_dir(t, p, pp))
                os.makedirs(folder)
                w = ArchiveWriter(os.path.join(folder, FILE))
                model = collections.OrderedDict()
                for name, x in global_tensors(params, m, rows, range(p * per, (p + 1) * per), p == 0, p == pp - 1):
                    model[name] = w.tensor(shard(name, x, t, tp, m.swiglu))
                    del x
                w.close({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                         "num_floating_point_operations_so_far": 0, "model": model})
        publish(tmp, save, iteration, tokenizer_files)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.join(save, f"iter_{iteration:07d}")


def publish(tmp: str, save: str, iteration: int, tokenizer_files: dict | None) -> None:
    """The last steps of a Megatron save written in `tmp`: the tokenizer's files and the tracker
    file beside the iteration folder, then `tmp` renamed to `save` (empty or absent, checked before)."""
    for name, data in (tokenizer_files or {}).items():
        with open(os.path.join(tmp, name), "wb") as f:
            f.write(data)
    with open(os.path.join(tmp, TRACKER), "w") as f:
        f.write(str(iteration))
    if os.path.isdir(save):
        os.rmdir(save)
    os.rename(tmp, save)
