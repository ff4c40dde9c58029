"""Megatron-Core's `torch_dist` format: PyTorch Distributed Checkpoint (DCP) files, read with numpy.

    iter_0000010/
        metadata.json        {"sharded_backend": "torch_dist", ...}
        common.pt            torch.save of the state every rank shares: args, iteration, ...
        .metadata            pickled DCP `Metadata`: for every key its global shape, dtype and
                             chunks (offsets, sizes); `storage_data` maps each chunk to
                             (file, byte offset, byte length)
        __<rank>_<n>.distcp  the chunks, each a small torch.save archive of that chunk's tensor

A key is one *global* tensor: Megatron-Core saves each rank's shard at its global offsets, so
tensor-parallel pieces are already placed (QKV rows per query group, SwiGLU's fc1 as all gate
rows then all up rows). `Distcp.tensor(key)` assembles the chunks into one numpy array.
`BytesStorageMetadata` entries (pickled objects: RNG states, `_extra_state`s) are never read.
"""

from __future__ import annotations

import json
import mmap
import os

import numpy as np

from mlm_jax.checkpoint.megatron import torch_pickle
from mlm_jax.checkpoint.megatron.errors import MegatronCheckpointError
from mlm_jax.paths import inside

METADATA_JSON, COMMON, DCP_METADATA = "metadata.json", "common.pt", ".metadata"


def is_torch_dist(iter_dir: str) -> bool:
    return os.path.isfile(os.path.join(iter_dir, DCP_METADATA))


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            out = json.load(f)
    except (OSError, ValueError) as e:
        raise MegatronCheckpointError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(out, dict):
        raise MegatronCheckpointError(f"{path}: a JSON object is expected")
    return out


class Files:
    """Memory-mapped files of one folder, opened once each."""

    def __init__(self, folder: str):
        self.folder, self.maps = folder, {}

    def get(self, name: str, key: str) -> memoryview:
        if name not in self.maps:
            path = inside(self.folder, name)
            if path is None:
                raise MegatronCheckpointError(
                    f"{os.path.join(self.folder, DCP_METADATA)}: key {key!r} names the file {name!r}, which lies "
                    f"outside the checkpoint folder {self.folder}; only files inside it are read")
            if not os.path.isfile(path):
                raise MegatronCheckpointError(f"{path}: missing (it holds {key!r})")
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.maps[name] = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)) if size else memoryview(b"")
        return self.maps[name]


class Distcp:
    """The tensors of one torch_dist iteration folder."""

    def __init__(self, iter_dir: str):
        self.dir = iter_dir
        meta_json = os.path.join(iter_dir, METADATA_JSON)
        if os.path.isfile(meta_json):
            backend = read_json(meta_json).get("sharded_backend")
            if backend not in (None, "torch_dist"):
                raise MegatronCheckpointError(f"{meta_json}: sharded_backend {backend!r} is not read "
                                              "(torch_dist only; zarr is long deprecated in Megatron-LM)")
        path = os.path.join(iter_dir, DCP_METADATA)
        with open(path, "rb") as f:
            meta = torch_pickle.unpickle(f.read(), None, where=path)
        if not hasattr(meta, "state_dict_metadata") or not hasattr(meta, "storage_data"):
            raise MegatronCheckpointError(f"{path}: not a DCP Metadata object")
        self.files = Files(iter_dir)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, np.dtype] = {}
        self.objects: set[str] = set()
        sizes: dict[str, dict[tuple, tuple]] = {}
        for key, item in meta.state_dict_metadata.items():
            if hasattr(item, "size"):
                self.shapes[key] = tuple(int(n) for n in item.size)
                self.dtypes[key] = item.properties.dtype.numpy
                sizes[key] = {tuple(int(o) for o in c.offsets): tuple(int(n) for n in c.sizes) for c in item.chunks}
            else:
                self.objects.add(key)
        # key -> [(offsets, sizes, storage info)]; the metadata's chunk sizes are authoritative
        # (a chunk saved without the stacked-layer dims is reshaped to them).
        self.chunks: dict[str, list] = {k: [] for k in self.shapes}
        for index, info in meta.storage_data.items():
            if index.fqn in self.chunks:
                offsets = tuple(int(o) for o in index.offset)
                self.chunks[index.fqn].append((offsets, sizes[index.fqn].get(offsets), info))

    def keys(self) -> list[str]:
        return sorted(self.shapes)

    def tensor(self, key: str, dtype=np.float32) -> np.ndarray:
        """The global tensor `key`, assembled from its chunks, as `dtype`."""
        shape = self.shapes[key]
        out = np.zeros(shape, dtype)
        covered = 0
        for offsets, sizes, info in self.chunks[key]:
            where = f"{os.path.join(self.dir, info.relative_path)} (key {key!r}, chunk at {offsets})"
            buf = self.files.get(info.relative_path, key)
            start, length = int(info.offset), int(info.length)
            if getattr(info, "transform_descriptors", None):
                raise MegatronCheckpointError(f"{where}: stored with transforms {info.transform_descriptors}; "
                                              "only plain chunks are read")
            if start + length > len(buf):
                raise MegatronCheckpointError(
                    f"{where}: bytes {start}..{start + length} lie past the file's end ({len(buf)} bytes; "
                    "truncated file?)")
            chunk = np.asarray(torch_pickle.load(buf[start:start + length], where))
            if sizes is not None and chunk.shape != sizes:
                if chunk.size != int(np.prod(sizes)):
                    raise MegatronCheckpointError(f"{where}: holds {chunk.shape}, the metadata says {sizes}")
                chunk = chunk.reshape(sizes)
            if len(offsets) != len(shape) or any(o + n > s for o, n, s in zip(offsets, chunk.shape, shape)):
                raise MegatronCheckpointError(f"{where}: a chunk of shape {chunk.shape} does not fit the "
                                              f"global shape {shape}")
            out[tuple(slice(o, o + n) for o, n in zip(offsets, chunk.shape))] = chunk
            covered += chunk.size
        if covered != int(np.prod(shape)):
            raise MegatronCheckpointError(
                f"{os.path.join(self.dir, DCP_METADATA)}: key {key!r} has chunks covering {covered} of "
                f"{int(np.prod(shape))} elements")
        return out


def read_common(iter_dir: str) -> dict:
    """common.pt's state (args, iteration, checkpoint_version, ...)."""
    path = os.path.join(iter_dir, COMMON)
    if not os.path.isfile(path):
        raise MegatronCheckpointError(f"{path}: missing (a torch_dist checkpoint keeps its args there)")
    files = Files(iter_dir)
    out = torch_pickle.load(files.get(COMMON, "args"), path)
    if not isinstance(out, dict):
        raise MegatronCheckpointError(f"{path}: holds a {type(out).__name__}, a dict is expected")
    return out
