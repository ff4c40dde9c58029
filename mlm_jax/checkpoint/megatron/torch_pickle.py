"""PyTorch's `torch.save` files read with the standard library and numpy: no torch, no code run.

A `torch.save` file (since torch 1.6) is an uncompressed zip archive:

    <prefix>/data.pkl      the pickled object; each tensor's storage is a persistent id
                           ('storage', <torch.XStorage>, key, location, numel)
    <prefix>/data/<key>    that storage's raw bytes (little-endian unless `byteorder` says big)
    <prefix>/byteorder, version, .format_version, ...

`load` unpickles `data.pkl` with `find_class` restricted to an explicit allow-list: each allowed
global maps to a stand-in built here (a tensor becomes a lazy view of its storage, a dtype a
`TorchDtype`, a DCP metadata class a plain record). A global outside the list is refused by
name, so a checkpoint can never import a module or call a function of its choosing. Tensors are
read only when asked for (`np.asarray(t)`): an optimizer state stored beside the weights costs
nothing, and storages are views of the memory-mapped file where the byte order allows.
"""

from __future__ import annotations

import argparse
import collections
import functools
import io
import math
import pickle
import zipfile
from collections.abc import Hashable
from typing import Callable

import ml_dtypes
import numpy as np

from mlm_jax.checkpoint.megatron.errors import MegatronCheckpointError

# torch.<X>Storage -> numpy dtype (the typed-storage names torch.save still writes).
STORAGE_DTYPES = {
    "DoubleStorage": np.float64, "FloatStorage": np.float32, "HalfStorage": np.float16,
    "BFloat16Storage": ml_dtypes.bfloat16, "LongStorage": np.int64, "IntStorage": np.int32,
    "ShortStorage": np.int16, "CharStorage": np.int8, "ByteStorage": np.uint8, "BoolStorage": np.bool_,
    "UntypedStorage": np.uint8,
}
# torch.<dtype> -> numpy dtype (names as torch pickles them).
TORCH_DTYPES = {
    "float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16,
    "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8,
    "bool": np.bool_, "float8_e4m3fn": ml_dtypes.float8_e4m3fn, "float8_e5m2": ml_dtypes.float8_e5m2,
}


class TorchDtype:
    """A torch dtype (torch.float32, ...) as pickled: its name and numpy equivalent."""

    def __init__(self, name: str):
        self.name = name
        self.numpy = np.dtype(TORCH_DTYPES[name])

    def __repr__(self):
        return f"torch.{self.name}"

    def __eq__(self, other):
        return isinstance(other, TorchDtype) and other.name == self.name

    def __hash__(self):
        return hash(self.name)


class EnumValue:
    """A Megatron enum member as pickled (`AttnBackend(5)`): its class name and value."""

    def __init__(self, cls: str, value):
        self.cls, self.value = cls, value

    def __repr__(self):
        return f"{self.cls}({self.value!r})"

    def __eq__(self, other):
        return isinstance(other, EnumValue) and (other.cls, other.value) == (self.cls, self.value)

    def __hash__(self):
        return hash((self.cls, self.value))


class Record:
    """A plain stand-in for an allowed class (DCP's metadata dataclasses): pickle's BUILD state
    lands in its attributes; a tuple state (TensorProperties') in `fields` order."""

    fields: tuple[str, ...] = ()

    def __init__(self, *args, **kwargs):
        for name, value in zip(self.fields, args):
            setattr(self, name, value)
        self.__dict__.update(kwargs)

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        if isinstance(state, tuple):
            state = dict(zip(self.fields, state))
        self.__dict__.update(state)

    def __repr__(self):
        return f"{type(self).__name__}({self.__dict__})"


def _record(name: str, fields: tuple[str, ...] = ()) -> type:
    return type(name, (Record,), {"fields": fields})


class Storage:
    """One storage of a torch.save archive: raw bytes (a view of the file) as `dtype`."""

    def __init__(self, archive: "Archive", key: str, dtype, numel: int):
        self.archive, self.key, self.dtype, self.numel = archive, key, np.dtype(dtype), numel

    def array(self) -> np.ndarray:
        raw = self.archive.record(f"data/{self.key}")
        want = self.numel * self.dtype.itemsize
        if len(raw) < want:
            raise MegatronCheckpointError(
                f"{self.archive.where}: storage data/{self.key} has {len(raw)} bytes, {want} expected "
                "(truncated file?)")
        dtype = self.dtype.newbyteorder(">") if self.archive.big_endian else self.dtype
        out = np.frombuffer(raw, dtype=dtype, count=self.numel)
        return out.astype(self.dtype) if self.archive.big_endian else out


class LazyTensor:
    """A tensor of a torch.save archive, read on `np.asarray(t)` (or `.numpy()`)."""

    def __init__(self, storage: Storage, offset: int, shape: tuple, stride: tuple):
        self.storage, self.offset, self.shape, self.stride = storage, int(offset), tuple(shape), tuple(stride)

    @property
    def dtype(self) -> np.dtype:
        return self.storage.dtype

    def numpy(self) -> np.ndarray:
        """The tensor's values (a read-only view where its layout allows, else a copy)."""
        flat = self.storage.array()
        if not self.shape:
            return flat[self.offset:self.offset + 1].reshape(())
        if any(n == 0 for n in self.shape):
            return np.zeros(self.shape, self.dtype)
        last = self.offset + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        if self.offset < 0 or last >= flat.size or min(self.stride) < 0:
            raise MegatronCheckpointError(
                f"{self.storage.archive.where}: a tensor of shape {self.shape} reaches past its storage "
                f"data/{self.storage.key} ({flat.size} elements)")
        item = flat.itemsize
        return np.lib.stride_tricks.as_strided(flat[self.offset:], self.shape, [s * item for s in self.stride],
                                               writeable=False)

    def __array__(self, dtype=None, copy=None):
        out = self.numpy()
        return out if dtype is None else out.astype(dtype)

    def __repr__(self):
        return f"LazyTensor({self.dtype}, {self.shape})"


# ------------------------------------------------------------------------------- the allow-list


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None,
                       metadata=None):
    if not isinstance(storage, Storage):
        raise pickle.UnpicklingError("_rebuild_tensor_v2 without a storage")
    return LazyTensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, *extra):
    return data


def _storage_type(name: str):
    return ("storage_type", name)


def _numpy_reconstruct(cls, shape, typecode):
    if cls is not np.ndarray:
        raise pickle.UnpicklingError("numpy _reconstruct of a class other than numpy.ndarray")
    return np.ndarray.__new__(np.ndarray, shape, typecode)


def _numpy_dtype(spec, align=False, copy=True):
    out = np.dtype(spec)
    if out.hasobject:
        raise pickle.UnpicklingError(f"numpy object dtype {spec!r}")
    return out


def _numpy_scalar(dtype, data=None):
    if not isinstance(dtype, np.dtype) or dtype.hasobject or not isinstance(data, bytes):
        raise pickle.UnpicklingError("numpy scalar of an object dtype")
    return np.frombuffer(data, dtype)[0]


class BytesBuffer(Record):
    """An `io.BytesIO` as pickled (Transformer Engine's `_extra_state`s): its bytes, inert."""

    fields = ("value", "pos", "dict")

    def __init__(self, value=b"", *rest):
        self.value = bytes(value)

    def __setstate__(self, state):
        self.value = bytes(state[0]) if isinstance(state, tuple) and state else getattr(self, "value", b"")


def _codecs_encode(text, encoding="utf-8"):
    """Protocol 2 pickles bytes as _codecs.encode(str, 'latin1'); nothing else is allowed."""
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError("_codecs.encode other than (str, 'latin1')")
    return text.encode("latin1")


def _enum(cls: str) -> Callable:
    return lambda value: EnumValue(cls, value)


def _megatron_enums() -> dict[str, Callable]:
    names = {
        "megatron.core.enums": ("ModelType", "Fp8Recipe", "Fp4Recipe"),
        "megatron.core.transformer.enums": ("ModelType", "LayerType", "AttnType", "AttnMaskType", "AttnBackend",
                                            "CudaGraphModule", "CudaGraphScope", "InferenceCudaGraphScope"),
        "megatron.core.rerun_state_machine": ("RerunDiagnostic", "RerunMode", "RerunState", "RerunValidationStatus"),
    }
    return {f"{mod}.{cls}": _enum(cls) for mod, classes in names.items() for cls in classes}


_DCP = "torch.distributed.checkpoint"
_DCP_RECORDS = {
    f"{_DCP}.metadata.Metadata": ("state_dict_metadata", "planner_data", "storage_data", "storage_meta"),
    f"{_DCP}.metadata.TensorStorageMetadata": ("properties", "size", "chunks"),
    f"{_DCP}.metadata.ChunkStorageMetadata": ("offsets", "sizes"),
    f"{_DCP}.metadata.BytesStorageMetadata": (),
    f"{_DCP}.metadata.TensorProperties": ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"),
    f"{_DCP}.metadata.MetadataIndex": ("fqn", "offset", "index"),
    f"{_DCP}.metadata.StorageMeta": ("checkpoint_id", "save_id", "load_id", "modules"),
    f"{_DCP}.filesystem._StorageInfo": ("relative_path", "offset", "length", "transform_descriptors"),
    f"{_DCP}.planner.SavePlan": ("items", "storage_data", "planner_data"),
    # the save plans Megatron-Core 0.16 keeps in the metadata's planner data
    f"{_DCP}.planner.WriteItem": ("index", "type", "bytes_io_data", "tensor_data"),
    f"{_DCP}.planner.TensorWriteData": ("chunk", "properties", "size"),
    f"{_DCP}.planner.BytesIOWriteData": ("nbytes",),
    # Megatron-Core's empty placeholders in older checkpoints' metadata
    "megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata": (),
    "megatron.core.dist_checkpointing.strategies.torch.MCoreSavePlan": (),
}


def _allowed() -> dict[str, Callable]:
    out: dict[str, Callable] = {
        "torch._utils._rebuild_tensor_v2": _rebuild_tensor_v2,
        "torch._utils._rebuild_parameter": _rebuild_parameter,
        "torch.Size": lambda dims=(): tuple(int(d) for d in dims),
        "torch.serialization._get_layout": lambda name: str(name),
        "torch.device": lambda *args: ":".join(str(a) for a in args),
        f"{_DCP}.metadata._MEM_FORMAT_ENCODING": _enum("_MEM_FORMAT_ENCODING"),
        f"{_DCP}.planner.WriteItemType": _enum("WriteItemType"),
        "collections.OrderedDict": collections.OrderedDict,
        "argparse.Namespace": argparse.Namespace,
        "builtins.set": set, "builtins.frozenset": frozenset, "builtins.slice": slice,
        "builtins.complex": complex, "builtins.bytearray": bytearray,
        "_io.BytesIO": BytesBuffer, "io.BytesIO": BytesBuffer, "_codecs.encode": _codecs_encode,
        "pathlib.PosixPath": lambda *parts: "/".join(str(p) for p in parts),
        "pathlib.PurePosixPath": lambda *parts: "/".join(str(p) for p in parts),
        "numpy.core.multiarray._reconstruct": _numpy_reconstruct,
        "numpy._core.multiarray._reconstruct": _numpy_reconstruct,
        "numpy.core.multiarray.scalar": _numpy_scalar, "numpy._core.multiarray.scalar": _numpy_scalar,
        "numpy.ndarray": np.ndarray, "numpy.dtype": _numpy_dtype,
    }
    out.update({f"torch.{name}": _storage_type(name) for name in STORAGE_DTYPES})
    out.update({f"torch.storage.{name}": _storage_type(name) for name in ("UntypedStorage",)})
    out.update({f"torch.{name}": TorchDtype(name) for name in TORCH_DTYPES})
    out.update({"torch.float": TorchDtype("float32"), "torch.half": TorchDtype("float16"),
                "torch.double": TorchDtype("float64"), "torch.long": TorchDtype("int64"),
                "torch.int": TorchDtype("int32")})
    out.update({name: _record(name.rsplit(".", 1)[1], fields) for name, fields in _DCP_RECORDS.items()})
    out.update({f"numpy.dtypes.{n}DType": _numpy_dtype_class(n) for n in
                ("Float64", "Float32", "Float16", "Int64", "Int32", "Int16", "Int8", "UInt64", "UInt32",
                 "UInt16", "UInt8", "Bool")})
    out.update(_megatron_enums())
    return out


def _numpy_dtype_class(name: str):
    """numpy 2's dtype classes (numpy.dtypes.Float32DType), pickled with a dtype's __reduce__."""
    return lambda *args: np.dtype(name.lower())


ALLOWED: dict[str, Callable] = _allowed()


# ------------------------------------------------------------------------------- the archive


class _Window(io.RawIOBase):
    """A read-only, seekable file over a memoryview (a zip inside a larger file)."""

    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, pos, whence=0):
        self.pos = {0: pos, 1: self.pos + pos, 2: len(self.buf) + pos}[whence]
        return self.pos

    def readinto(self, b):
        n = max(0, min(len(b), len(self.buf) - self.pos))
        b[:n] = self.buf[self.pos:self.pos + n]
        self.pos += n
        return n


class Archive:
    """A torch.save zip archive held in `buf` (bytes, an mmap, or a slice of one): its records
    as zero-copy views."""

    def __init__(self, buf, where: str):
        self.buf, self.where = memoryview(buf).cast("B"), where
        try:
            zf = zipfile.ZipFile(_Window(self.buf))
        except zipfile.BadZipFile as e:
            hint = (" (the pre-1.6 torch.save format is not read; re-save it with a newer torch)"
                    if bytes(self.buf[:2]) == b"\x80\x02" else " (truncated or not a torch.save file?)")
            raise MegatronCheckpointError(f"{where}: not a torch.save zip archive: {e}{hint}") from e
        self.infos = {info.filename: info for info in zf.infolist()}
        pkl = [n for n in self.infos if n.endswith("/data.pkl") or n == "data.pkl"]
        if not pkl:
            raise MegatronCheckpointError(f"{where}: a zip archive without data.pkl (not a torch.save file)")
        self.prefix = pkl[0][: -len("data.pkl")]
        order = self.infos.get(self.prefix + "byteorder")
        self.big_endian = order is not None and bytes(self.record("byteorder")).strip() == b"big"

    def record(self, name: str) -> memoryview:
        """The bytes of record `<prefix>/<name>` (a view of the buffer: stored, not deflated)."""
        info = self.infos.get(self.prefix + name)
        if info is None:
            raise MegatronCheckpointError(f"{self.where}: the archive has no record {self.prefix + name}")
        if info.compress_type != zipfile.ZIP_STORED:
            raise MegatronCheckpointError(f"{self.where}: record {info.filename} is compressed (torch.save never does)")
        head = info.header_offset
        local = bytes(self.buf[head:head + 30])
        if len(local) < 30 or local[:4] != b"PK\x03\x04":
            raise MegatronCheckpointError(f"{self.where}: record {info.filename}: bad local header (truncated?)")
        start = head + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
        end = start + info.file_size
        if end > len(self.buf):
            raise MegatronCheckpointError(
                f"{self.where}: record {info.filename} ends at byte {end}, past the end ({len(self.buf)} bytes; "
                "truncated file?)")
        return self.buf[start:end]


_PY2_MODULES = {"__builtin__": "builtins", "copy_reg": "copyreg", "_codecs": "_codecs"}


def _nbytes(shape, dtype) -> int | None:
    """The bytes an array of `shape` and `dtype` takes (Python ints: no overflow), or None where
    they are not an array's (numpy then refuses them itself)."""
    try:
        dims = [int(shape)] if isinstance(shape, int) else [int(n) for n in shape]
        return math.prod(dims) * np.dtype(dtype).itemsize
    except (TypeError, ValueError):
        return None


def _bounded_bytearray(unpickler, source=b"", *rest):
    if isinstance(source, int):
        unpickler.allocating(source, f"bytearray({source})")
    return bytearray(source, *rest)


def _bounded_ndarray(unpickler, shape=(), dtype=float, *rest, **kwargs):
    unpickler.allocating(_nbytes(shape, dtype), f"numpy.ndarray of shape {shape}")
    return np.ndarray(shape, dtype, *rest, **kwargs)


def _bounded_reconstruct(unpickler, cls, shape, typecode):
    unpickler.allocating(_nbytes(shape, typecode), f"numpy _reconstruct of shape {shape}")
    if getattr(cls, "func", None) is _bounded_ndarray:  # numpy.ndarray as this unpickler hands it out
        cls = np.ndarray
    return _numpy_reconstruct(cls, shape, typecode)


# The allow-listed constructors that allocate what their arguments ask: bounded by the file's size.
_BOUNDED = {bytearray: _bounded_bytearray, np.ndarray: _bounded_ndarray, _numpy_reconstruct: _bounded_reconstruct}


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: memoryview, archive: Archive, allowed: dict[str, Callable]):
        super().__init__(io.BytesIO(data))
        self.archive, self.allowed = archive, allowed
        # What the allow-listed constructors may allocate: no more than the file holds (a
        # checkpoint's pickle rebuilds what it stores, it never asks for fresh gigabytes).
        buf = getattr(archive, "buf", None)
        self.limit = max(len(data), len(buf) if buf is not None else 0)

    def allocating(self, nbytes: int | None, what: str) -> None:
        if nbytes is not None and nbytes > self.limit:
            raise MegatronCheckpointError(
                f"{self.archive.where}: a pickled {what} asks for {nbytes:,} bytes, more than the file's own "
                f"{self.limit:,}: refused (a checkpoint's pickle allocates no more than it holds)")

    def find_class(self, module: str, name: str):
        module = _PY2_MODULES.get(module, module)  # protocol 2 names Python 2's modules
        target = self.allowed.get(f"{module}.{name}")
        if target is None:
            raise MegatronCheckpointError(
                f"{self.archive.where}: refuses to unpickle {module}.{name} (not on the allow-list of "
                "torch/DCP/Megatron names a checkpoint needs; a checkpoint never runs code here)")
        bounded = _BOUNDED.get(target) if isinstance(target, Hashable) else None
        return target if bounded is None else functools.partial(bounded, self)

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise MegatronCheckpointError(f"{self.archive.where}: unknown persistent id {pid!r:.80}")
        _, kind, key, _location, numel = pid[:5]
        if not (isinstance(kind, tuple) and kind[0] == "storage_type"):
            raise MegatronCheckpointError(f"{self.archive.where}: storage of unknown type {kind!r:.80}")
        dtype = STORAGE_DTYPES[kind[1]]
        if kind[1] == "UntypedStorage":
            numel = int(numel)
        return Storage(self.archive, str(key), dtype, int(numel))


def load(buf, where: str, allowed: dict[str, Callable] | None = None):
    """The object a torch.save archive in `buf` holds: dicts, lists, numbers, strings,
    `LazyTensor`s, `argparse.Namespace`s, `TorchDtype`s, `EnumValue`s and records. `where` names
    the file (and key) in every error."""
    archive = Archive(buf, where)
    return unpickle(archive.record("data.pkl"), archive, allowed)


def unpickle(data, archive: Archive | None, allowed: dict[str, Callable] | None = None, where: str = ""):
    """Unpickle `data` (a raw pickle, e.g. DCP's `.metadata`) with the allow-list."""
    if archive is None:
        archive = Archive.__new__(Archive)
        archive.where = where
    try:
        return _Unpickler(memoryview(data), archive, ALLOWED if allowed is None else allowed).load()
    except MegatronCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        raise MegatronCheckpointError(f"{archive.where}: not a readable pickle ({type(e).__name__}: {e})") from e
