"""Read a tensor written by `torch.save` without torch: the API processes decode prompt embeds
sent as `torch.save` bytes (the vLLM client convention) with this, so they never load torch.

`torch.save` writes a zip archive: `<name>/data.pkl` (a pickle that rebuilds the tensor from
storages) and one raw file per storage (`<name>/data/<key>`), in the byte order of
`<name>/byteorder`. The pickle is read with an unpickler that knows only the names a saved
plain tensor uses (as `torch.load(weights_only=True)` restricts it): anything else is refused,
nothing in the data is ever called.

What the data declares is not trusted to size anything: reading it never holds more than a few
times its own bytes (`UNPACK_RATIO`). `torch.save` stores its files uncompressed, so no file
may unpack to more than that (a compressed one could unpack to gigabytes); a tensor may not hold
more values than its storage (an expanded view's zero strides would repeat a few values into
any number of rows); and the values of every tensor the pickle rebuilds together fit in that
too (a pickle can rebuild views of one storage again and again).
"""

from __future__ import annotations

import io
import math
import pickle
import zipfile
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np

# torch's storage classes by name: (the dtype torch names, numpy's dtype of the same bytes).
# bfloat16 has no numpy type: its 2-byte values are read as uint16 and widened (exactly).
STORAGES = {
    "FloatStorage": ("float32", "f4"),
    "HalfStorage": ("float16", "f2"),
    "BFloat16Storage": ("bfloat16", "u2"),
    "DoubleStorage": ("float64", "f8"),
    "LongStorage": ("int64", "i8"),
    "IntStorage": ("int32", "i4"),
    "ShortStorage": ("int16", "i2"),
    "CharStorage": ("int8", "i1"),
    "ByteStorage": ("uint8", "u1"),
    "BoolStorage": ("bool", "?"),
}
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
# A file of the archive, and the values of all its tensors, may take at most this many times
# the archive's bytes. torch.save's own files take less than the archive holding them; the
# headroom is for an archive someone compressed (float values compress to ~0.8-0.9).
UNPACK_RATIO = 4


class TorchSaveError(ValueError):
    """The bytes are not a `torch.save` archive this reader can read; the message says why."""


@dataclass(frozen=True)
class _StorageType:
    dtype: str  # torch's name
    numpy: str  # numpy's type code of the same bytes (no byte order)


@dataclass(frozen=True)
class SavedTensor:
    """A tensor read from `torch.save` data: its values as a numpy array in its own dtype
    (bfloat16 widened to float32, exactly) and the dtype torch named."""

    array: np.ndarray
    dtype: str  # "float32", "bfloat16", ...


class _Storage:
    def __init__(self, data: np.ndarray, dtype: str):
        self.data = data  # 1-D, the storage's elements
        self.dtype = dtype


def _strided_view(
    storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...]
) -> np.ndarray:
    """The tensor's values as a read-only view of its storage, once its bounds are checked."""
    data = storage.data
    if not all(isinstance(n, int) for n in (offset, *size, *stride)):
        raise TorchSaveError("a size, stride or offset that is not an integer")
    if len(size) != len(stride):
        raise TorchSaveError("a tensor with a stride per dimension it does not have")
    if any(s < 0 for s in (*size, *stride)) or offset < 0:
        raise TorchSaveError("a negative size, stride or offset")
    count = math.prod(size)
    if count > data.size:
        raise TorchSaveError(
            f"the tensor holds {count} values, more than its storage's {data.size} (an "
            "expanded or overlapping view): save a contiguous tensor (`.contiguous()`)"
        )
    if not count:
        return np.empty(size, dtype=data.dtype)
    if offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) >= data.size:
        raise TorchSaveError("the tensor reaches past its storage")
    itemsize = data.dtype.itemsize
    return np.lib.stride_tricks.as_strided(
        data[offset:], shape=size, strides=[s * itemsize for s in stride], writeable=False
    )


class _Unpickler(pickle.Unpickler):
    def __init__(self, archive: zipfile.ZipFile, prefix: str, order: str, limit: int):
        super().__init__(io.BytesIO(_read(archive, f"{prefix}/data.pkl", limit)))
        self._archive, self._prefix, self._order = archive, prefix, order
        self._limit = limit
        # What the pickle calls to rebuild a tensor: kept in the unpickler's memo, so it holds
        # no reference back to the unpickler (a cycle would keep every tensor read, however
        # large, until the collector's next full pass).
        self._rebuild = _Rebuilder(limit)
        self._storages: dict[str, _Storage] = {}  # by key: one file is read once

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return self._rebuild
        if module == "torch" and name in STORAGES:
            return _StorageType(*STORAGES[name])
        if module == "collections" and name == "OrderedDict":
            return OrderedDict
        raise TorchSaveError(f"unsupported global {module}.{name} in the pickle")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise TorchSaveError("unsupported persistent id in the pickle")
        _, kind, key, _location, numel = pid
        if not isinstance(kind, _StorageType):
            raise TorchSaveError("a storage of an unknown type")
        if not isinstance(key, str) or not isinstance(numel, int):
            raise TorchSaveError("a storage named by other than a string key and a size")
        storage = self._storages.get(key)
        if storage is None:
            raw = _read(self._archive, f"{self._prefix}/data/{key}", self._limit)
            data = np.frombuffer(raw, dtype=np.dtype(self._order + kind.numpy))
            if data.size < numel:
                raise TorchSaveError(f"storage {key} holds {data.size} values, not {numel}")
            storage = self._storages[key] = _Storage(data[:numel], kind.dtype)
        if storage.dtype != kind.dtype or storage.data.size != numel:
            raise TorchSaveError(f"storage {key} named twice, as two different storages")
        return storage


class _Rebuilder:
    """torch's `_rebuild_tensor_v2` for one archive: the tensors it rebuilds may hold at most
    `limit` bytes of values together."""

    def __init__(self, limit: int):
        self.limit = limit
        self.budget = limit  # bytes of values the tensors rebuilt so far may still take

    def __call__(
        self,
        storage: _Storage,
        offset: int,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        *_: Any,
    ) -> SavedTensor:
        if not isinstance(storage, _Storage):
            raise TorchSaveError("a tensor rebuilt from other than a storage")
        view = _strided_view(storage, offset, size, stride)
        self.budget -= view.nbytes
        if self.budget < 0:
            raise TorchSaveError(
                f"its tensors hold more than {self.limit} bytes of values, {UNPACK_RATIO} times "
                "the archive's size (views of one storage rebuilt again and again)"
            )
        array = np.array(view)  # its own, contiguous copy
        if storage.dtype == "bfloat16":  # the upper half of a float32's bits: widening is exact
            array = (array.astype(np.uint32) << 16).view(np.float32)
        return SavedTensor(array, storage.dtype)


def _read(archive: zipfile.ZipFile, name: str, limit: int) -> bytes:
    """A file of the archive, refused if it would unpack to more than `limit` bytes."""
    try:
        info = archive.getinfo(name)
    except KeyError:
        raise TorchSaveError(f"no {name} in the archive") from None
    if info.file_size > limit:
        raise TorchSaveError(
            f"{name} unpacks to {info.file_size} bytes, more than {limit}, {UNPACK_RATIO} "
            "times the archive's size (torch.save stores its files uncompressed)"
        )
    return archive.read(info)


def read_torch_save(raw: bytes) -> Any:
    """What `torch.save` wrote in `raw`: a `SavedTensor` for a tensor, else the plain object
    it holds (a dict, a list, ...: the caller refuses them). `TorchSaveError` when `raw` is no
    `torch.save` archive, or holds what a plain tensor does not."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(raw))
        names = archive.namelist()
    except (zipfile.BadZipFile, ValueError, EOFError) as exc:
        raise TorchSaveError(f"not a zip archive: {exc}") from None
    pickles = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        raise TorchSaveError("no data.pkl in the archive")
    prefix = pickles[0].split("/")[0]
    limit = UNPACK_RATIO * len(raw)
    try:
        order = "<"
        if f"{prefix}/byteorder" in names:
            order = ">" if _read(archive, f"{prefix}/byteorder", limit).strip() == b"big" else "<"
        return _Unpickler(archive, prefix, order, limit).load()
    except TorchSaveError:
        raise
    except Exception as exc:  # a corrupt pickle or archive raises many types
        raise TorchSaveError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
