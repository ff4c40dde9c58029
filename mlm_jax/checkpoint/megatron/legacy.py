"""Megatron-LM's legacy `torch` format: one torch.save file per model-parallel rank.

    iter_0000010/mp_rank_TT/model_optim_rng.pt              pipeline size 1
    iter_0000010/mp_rank_TT_PPP/model_optim_rng.pt          pipeline size > 1
    iter_0000010/mp_rank_TT[_PPP]_EEE/model_optim_rng.pt    expert parallel size > 1

Each file holds `args`, `iteration`, ... and that rank's slice of the model: `model`, or
`model0`, `model1`, ... with virtual pipeline stages. Layers are numbered within each chunk;
chunks are laid out in the order (virtual stage, pipeline rank), so a chunk's first global layer
is the count of layers in the chunks before it (this also covers uneven first/last stages).
Experts are numbered within each expert-parallel rank.

`LegacyShards.tensors()` merges the ranks into global tensors under per-layer names
(`decoder.layers.<global i>.<rest>`), the same names `layout.py` reads from torch_dist:
  column parallel (split on dim 0): linear_qkv, linear_fc1 (SwiGLU: each rank holds its
      [gate_r; up_r], merged to [all gate; all up]), word_embeddings, output_layer, and multi-latent
      attention's projections (linear_q_proj, linear_q_up_proj, linear_kv_up_proj: by heads; the
      down projections in the local spec, whole on every rank in Transformer Engine's)
  row parallel (split on dim 1): linear_proj.weight, linear_fc2.weight
  replicated: norms (also the fused `layer_norm_weight`s), row-parallel biases, router,
      position embeddings (rank 0's copy is taken)
"""

from __future__ import annotations

import os
import re

import numpy as np

from mlm_jax.checkpoint.megatron import torch_pickle
from mlm_jax.checkpoint.megatron.dcp import Files
from mlm_jax.checkpoint.megatron.errors import MegatronCheckpointError

FILE = "model_optim_rng.pt"
_RANK_DIR = re.compile(r"^mp_rank_(\d+)(?:_(\d+))?(?:_(\d+))?$")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer)\.(.*)$")  # a multi-token prediction depth's layer
# Per-expert names in a rank's state dict: SequentialMLP's local_experts.<j>.<fc>.<param>,
# TEGroupedMLP's <fc>.weight<j> / bias<j>.
_SEQ_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.(weight|bias)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")

COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias", "eh_proj.weight",
          "word_embeddings.weight", "output_layer.weight", "output_layer.bias",
          "linear_q_proj.weight", "linear_q_up_proj.weight", "linear_kv_up_proj.weight",  # MLA's, by heads
          # MLA's down projections: column parallel in the local spec (what mlm_jax writes), whole on
          # every rank in Transformer Engine's (TELinear "duplicated"): equal pieces are one tensor.
          "linear_q_down_proj.weight", "linear_kv_down_proj.weight")
DUPLICATED_IN_TE = ("linear_q_down_proj.weight", "linear_kv_down_proj.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")


def rank_dirs(iter_dir: str) -> dict[tuple[int, int, int], str]:
    """{(tp, pp, ep): folder} of a legacy iteration folder (empty: not this format)."""
    out = {}
    for name in sorted(os.listdir(iter_dir)) if os.path.isdir(iter_dir) else ():
        m = _RANK_DIR.match(name)
        if m and os.path.isdir(os.path.join(iter_dir, name)):
            tp, a, b = int(m.group(1)), m.group(2), m.group(3)
            pp, ep = (int(a), int(b)) if b is not None else (int(a) if a is not None else 0, 0)
            out[(tp, pp, ep)] = os.path.join(iter_dir, name)
    return out


class LegacyShards:
    """The rank files of one legacy iteration folder."""

    def __init__(self, iter_dir: str):
        self.dir = iter_dir
        self.ranks = rank_dirs(iter_dir)
        if not self.ranks:
            raise MegatronCheckpointError(f"{iter_dir}: no mp_rank_* folders (not a legacy torch checkpoint)")
        self.tp = 1 + max(r[0] for r in self.ranks)
        self.pp = 1 + max(r[1] for r in self.ranks)
        self.ep = 1 + max(r[2] for r in self.ranks)
        self._states: dict = {}

    def use_args(self, args) -> None:
        """Take the parallel sizes the run saved with from its args (rank 0's file), so that a
        lost rank folder is missing rather than ignored, and check every rank is there."""
        if self.pp > 1 and getattr(args, "pipeline_model_parallel_size", 1) == 1:
            # mp_rank_TT_EEE (no pipeline number) reads like mp_rank_TT_PPP
            self.ranks = {(t, 0, p): d for (t, p, _), d in self.ranks.items()}
            self.pp, self.ep = 1, self.pp
        self.tp = int(getattr(args, "tensor_model_parallel_size", None) or self.tp)
        self.pp = int(getattr(args, "pipeline_model_parallel_size", None) or self.pp)
        self.ep = int(getattr(args, "expert_model_parallel_size", None) or self.ep)
        want = {(t, p, e) for t in range(self.tp) for p in range(self.pp) for e in range(self.ep)}
        missing = sorted(want - set(self.ranks))
        if missing:
            t, p, e = missing[0]
            raise MegatronCheckpointError(f"{self.dir}: the folder of rank (tensor {t}, pipeline {p}, expert {e}) "
                                          f"is missing ({len(missing)} of {len(want)} missing)")
        extra = sorted(set(self.ranks) - want)
        if extra:
            raise MegatronCheckpointError(f"{self.dir}: holds rank folders {extra[:3]} beyond the args' sizes "
                                          f"(tensor {self.tp}, pipeline {self.pp}, expert {self.ep})")

    def path(self, rank) -> str:
        if rank not in self.ranks:
            t, p, e = rank
            raise MegatronCheckpointError(f"{self.dir}: the folder of rank (tensor {t}, pipeline {p}, expert {e}) "
                                          "is missing")
        return os.path.join(self.ranks[rank], FILE)

    def state(self, rank) -> dict:
        if rank not in self._states:
            path = self.path(rank)
            folder = os.path.dirname(path)
            out = torch_pickle.load(Files(folder).get(FILE, "the model"), path)
            if not isinstance(out, dict):
                raise MegatronCheckpointError(f"{path}: holds a {type(out).__name__}, a dict is expected")
            self._states[rank] = out
        return self._states[rank]

    def common(self) -> dict:
        return self.state((0, 0, 0))

    def _chunks(self, rank) -> list[tuple[int, dict]]:
        """[(virtual stage, model state dict)] of one rank's file."""
        st = self.state(rank)
        if "model" in st:
            return [(0, st["model"])]
        chunks = sorted((int(k[5:]), v) for k, v in st.items() if re.fullmatch(r"model\d+", k))
        if not chunks:
            raise MegatronCheckpointError(f"{self.path(rank)}: no 'model' (or 'model0', ...) entry")
        return chunks

    def tensors(self, num_experts: int | None, swiglu: bool) -> dict[str, tuple[str, object]]:
        """{global name: (file it came from, lazy global array)}; `_extra_state`s left out."""
        # Per chunk (vp, pp): {local name: {(tp, ep): tensor}} and its layer count.
        chunks: dict[tuple[int, int], dict[str, dict]] = {}
        for (t, p, e) in sorted(self.ranks):
            for vp, sd in self._chunks((t, p, e)):
                names = chunks.setdefault((vp, p), {})
                for key, value in sd.items():
                    if key.endswith("_extra_state"):
                        continue
                    if not isinstance(value, torch_pickle.LazyTensor):
                        raise MegatronCheckpointError(f"{self.path((t, p, e))}: key {key!r} holds a "
                                                      f"{type(value).__name__}, not a tensor")
                    names.setdefault(key, {})[(t, e)] = value
        out: dict[str, tuple[str, object]] = {}
        first = 0
        for vp, p in sorted(chunks):  # (virtual stage, pipeline rank): the global layer order
            names = chunks[(vp, p)]
            layers = sorted({int(m.group(1)) for k in names if (m := _LAYER.match(k))})
            if layers != list(range(len(layers))):
                raise MegatronCheckpointError(f"{self.path((0, p, 0))}: chunk {vp} numbers its layers {layers}")
            for key, shards in names.items():
                where = self.path((0, p, 0))
                m = _LAYER.match(key)
                if m is not None:
                    self._put_layer(out, f"decoder.layers.{first + int(m.group(1))}", m.group(2), where, shards,
                                    swiglu, num_experts)
                elif (mtp := _MTP_LAYER.match(key)) is not None:
                    self._put_layer(out, mtp.group(1), mtp.group(2), where, shards, swiglu, num_experts)
                else:
                    self._put(out, key, where, shards, swiglu)
            first += len(layers)
        return out

    def _put_layer(self, out: dict, layer: str, rest: str, where: str, shards: dict, swiglu: bool,
                   num_experts) -> None:
        """A layer's tensor `rest` under global name `layer`; an expert's under its global expert
        index (`<layer>.mlp.experts.<i>.<fc>.<param>`), from whichever expert rank holds it."""
        ex = _SEQ_EXPERT.match(rest) or _GROUPED_EXPERT.match(rest)
        if ex is None:
            self._put(out, f"{layer}.{rest}", where, shards, swiglu)
            return
        j, fc, param = ((int(ex.group(1)), ex.group(2), ex.group(3)) if ex.re is _SEQ_EXPERT
                        else (int(ex.group(3)), ex.group(1), ex.group(2)))
        local = (num_experts or 0) // self.ep
        by_ep: dict[int, dict] = {}
        for (t, e), v in shards.items():
            by_ep.setdefault(e, {})[(t, 0)] = v
        for e, sh in by_ep.items():
            self._put(out, f"{layer}.mlp.experts.{e * local + j}.{fc}.{param}", where, sh, swiglu)

    def _put(self, out: dict, name: str, where: str, shards: dict, swiglu: bool) -> None:
        tps = sorted({t for t, _ in shards})
        if tps != list(range(self.tp)):
            raise MegatronCheckpointError(f"{where}: key {name!r} is held by tensor ranks {tps} of {self.tp}")
        pieces = [shards[(t, min(e for tt, e in shards if tt == t))] for t in tps]
        out[name] = (where, lambda: merge_tensor_parallel(name, pieces, swiglu))


def merge_tensor_parallel(name: str, pieces: list, swiglu: bool) -> np.ndarray:
    """One global tensor from its tensor-parallel pieces (rank order), by the role of `name`."""
    arrays = [np.asarray(p, dtype=np.float32) for p in pieces]
    if len(arrays) == 1:
        return arrays[0]
    tail = ".".join(name.split(".")[-2:])
    if tail in ("linear_fc1.weight", "linear_fc1.bias") and swiglu:
        halves = [np.split(a, 2, axis=0) for a in arrays]  # each rank: [gate_r; up_r]
        return np.concatenate([h[0] for h in halves] + [h[1] for h in halves], axis=0)
    if tail in DUPLICATED_IN_TE and all(np.array_equal(a, arrays[0]) for a in arrays[1:]):
        return arrays[0]
    if tail in COLUMN:
        return np.concatenate(arrays, axis=0)
    if tail in ROW:
        return np.concatenate(arrays, axis=1)
    return arrays[0]
