"""Read a tensor written by `torch.save` without torch: the API processes decode prompt embeds
sent as `torch.save` bytes (the vLLM client convention) with this, so they never load torch.

`torch.save` writes a zip archive: `<name>/data.pkl` (a pickle that rebuilds the tensor from
storages) and one raw file per storage (`<name>/data/<key>`), in the byte order of
`<name>/byteorder`. The pickle is read with an unpickler that knows only the names a saved
plain tensor uses (as `torch.load(weights_only=True)` restricts it): anything else is refused,
nothing in the data is ever called.
"""

from __future__ import annotations

import io
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


def _rebuild_tensor(
    storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...], *_: Any
) -> SavedTensor:
    data = storage.data
    itemsize = data.dtype.itemsize
    if any(s < 0 for s in (*size, *stride)) or offset < 0:
        raise TorchSaveError("a negative size, stride or offset")
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) if all(size) else 0
    if last >= max(data.size, 1) and all(size):
        raise TorchSaveError("the tensor reaches past its storage")
    view = np.lib.stride_tricks.as_strided(
        data[offset:], shape=size, strides=[s * itemsize for s in stride], writeable=False
    )
    array = np.array(view)  # its own, contiguous copy
    if storage.dtype == "bfloat16":  # the upper half of a float32's bits: widening is exact
        array = (array.astype(np.uint32) << 16).view(np.float32)
    return SavedTensor(array, storage.dtype)


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str, order: str):
        super().__init__(io.BytesIO(data))
        self._archive, self._prefix, self._order = archive, prefix, order

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_tensor
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
        raw = self._archive.read(f"{self._prefix}/data/{key}")
        data = np.frombuffer(raw, dtype=np.dtype(self._order + kind.numpy))
        if data.size < numel:
            raise TorchSaveError(f"storage {key} holds {data.size} values, not {numel}")
        return _Storage(data[:numel], kind.dtype)


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
    order = "<"
    if f"{prefix}/byteorder" in names:
        order = ">" if archive.read(f"{prefix}/byteorder").strip() == b"big" else "<"
    try:
        return _Unpickler(archive.read(pickles[0]), archive, prefix, order).load()
    except TorchSaveError:
        raise
    except Exception as exc:  # a corrupt pickle or archive raises many types
        raise TorchSaveError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
