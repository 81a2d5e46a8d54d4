"""Arrays of inputs, told and checked without torch: token ids as int64 arrays, prompt embeds
as float arrays (a torch tensor is recognised by its type and read through its own methods, so
this module never imports torch), truncation, and the magnitudes the model dtype cannot hold."""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from vecpool.errors import InputError

TruncationSide = Literal["left", "right"]

# Rounded to the model dtype (by the engine, to nearest, ties to even), magnitudes from these
# up become inf: the largest finite value plus half a step of its binade.
OVERFLOW = {
    "float16": 65520.0,
    "bfloat16": float.fromhex("0x1.ffp127"),
    "float32": float.fromhex("0x1.ffffffp127"),
}


def peak(value: np.ndarray, dtype: str) -> float:
    """The largest magnitude of `value` as the engine's rounding to `dtype` first sees it:
    torch rounds float64 to a half type through float32 (rounding is monotonic, so rounding
    the largest value is enough)."""
    peak = np.abs(value).max()
    if dtype != "float32" and value.dtype == np.float64:
        with np.errstate(over="ignore"):  # past float32's range: inf, refused as it should be
            peak = np.float32(peak)
    return float(peak)


def is_tensor(value: Any) -> bool:
    """Whether `value` is a torch tensor (told without importing torch)."""
    return any(c.__name__ == "Tensor" and c.__module__ == "torch" for c in type(value).__mro__)


def float_array(value: Any, index: int, field: str) -> np.ndarray:
    """Prompt embeds given as a numpy array or a torch tensor, as a float numpy array (a
    bfloat16 tensor widened to float32: exact, and numpy has no bfloat16)."""
    if is_tensor(value):
        if not value.is_floating_point():
            raise InputError(
                f"expected a floating-point tensor, got {value.dtype}", index=index, field=field
            )
        try:
            value = value.detach().cpu()
            if str(value.dtype) == "torch.bfloat16":
                value = value.float()
            return np.asarray(value.numpy())
        except (RuntimeError, NotImplementedError, TypeError) as exc:  # e.g. no data
            raise InputError(
                f"the tensor cannot be read: {exc}", index=index, field=field
            ) from None
    if not isinstance(value, np.ndarray):
        raise InputError(
            f"expected a torch.Tensor or numpy array, got {type(value).__name__}",
            index=index,
            field=field,
        )
    if not np.issubdtype(value.dtype, np.floating):
        raise InputError(
            f"expected a floating-point array, got dtype {value.dtype}", index=index, field=field
        )
    if value.dtype not in _FLOATS:  # byte-swapped (exactly converted), or a width torch lacks
        native = value.dtype.newbyteorder("=")
        if native not in _FLOATS:
            raise InputError(
                f"expected a float16, float32 or float64 array, got dtype {value.dtype}",
                index=index,
                field=field,
            )
        return value.astype(native)
    return value


_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def is_float(x: Any) -> bool:
    if is_tensor(x):
        return bool(x.is_floating_point())
    return bool(np.issubdtype(x.dtype, np.floating))


# A list of ints packed straight into its array (`as_id_array`); False: numpy's conversion, the
# baseline that `benchmarks/lab/bench_prepare.py` times beside it.
PACK_ID_LISTS = True


@functools.lru_cache(maxsize=4096)
def _int64s(n: int) -> struct.Struct:
    """The packing of `n` native int64s (one per length: its format parsed once)."""
    return struct.Struct(f"{n}q")


def _refuse_bools(value: list[Any], ids: np.ndarray, index: int | None, field: str) -> None:
    """A bool among the ints of a list packs and converts as id 0 or 1: refused, naming it.
    Only the 0s and 1s are looked at, and only when the list holds any (a minimum: ~0.3 µs)."""
    if ids[ids.argmin()] > 1:
        return
    for pos in np.flatnonzero(ids <= 1).tolist():
        if isinstance(value[pos], bool | np.bool_):
            raise InputError(
                f"token ids must be ints, got {value[pos]!r} (a bool) at position {pos}",
                index=index,
                field=field,
            )


def as_id_array(value: Any, index: int | None, field: str = "prompt_token_ids") -> np.ndarray:
    if type(value) is list and value:
        # A list of Python ints, packed straight into the array (its conversion by numpy,
        # which first works out a dtype, takes ~1.7x as long). Only integers (and what has
        # `__index__`) within int64 pack; anything else goes on to the checks below, which
        # name it. (A list of bools, which numpy reads as bools, is left to them too.)
        if PACK_ID_LISTS and type(value[0]) is not bool:
            ids = np.empty(len(value), dtype=np.int64)
            try:
                _int64s(len(value)).pack_into(ids, 0, *value)  # type: ignore[arg-type]  # a buffer
            except (struct.error, TypeError, ValueError, OverflowError):
                pass  # (struct's own error for a float, a string, an int past int64)
            else:
                _refuse_bools(value, ids, index, field)
                return ids
        try:
            arr = np.asarray(value)
        except (ValueError, OverflowError, TypeError):
            arr = None  # ragged or odd: the checks below say what is wrong
        if arr is not None and arr.ndim == 1 and arr.dtype.kind == "i":  # flat ints: all good
            _refuse_bools(value, arr, index, field)
            return arr.astype(np.int64, copy=False)
        if arr is not None and arr.ndim == 1 and arr.dtype.kind == "u":  # ints past int64's
            value = arr  # range read as unsigned: the array's checks below name them
    if is_tensor(value):
        try:
            value = value.detach().cpu().numpy()
        except (RuntimeError, NotImplementedError, TypeError) as exc:  # e.g. no data (meta)
            raise InputError(
                f"the tensor cannot be read: {exc}", index=index, field=field
            ) from None
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or not np.issubdtype(value.dtype, np.integer):
            raise InputError(
                f"token ids must be a 1-D integer array, got shape {list(value.shape)} dtype {value.dtype}",
                index=index,
                field=field,
            )
        if value.dtype.kind == "u" and value.size and value.max() > np.iinfo(np.int64).max:
            # Cast, it would wrap to a negative id: named as given.
            pos = int(np.argmax(value > np.iinfo(np.int64).max))
            raise InputError(
                f"token id {int(value[pos])} at position {pos} is outside the vocabulary",
                index=index,
                field=field,
            )
        return value.astype(np.int64)
    if isinstance(value, str | bytes | bytearray | memoryview) or not isinstance(value, Sequence):
        raise InputError(
            f"token ids must be a list of ints, got {type(value).__name__}",
            index=index,
            field=field,
        )
    if len(value) == 0:
        return np.zeros(0, dtype=np.int64)
    try:
        arr = np.asarray(value)
    except (ValueError, OverflowError, TypeError) as exc:
        raise InputError(
            f"token ids must be a flat list of ints ({exc})", index=index, field=field
        ) from None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        # Integers all, some past int64's range (which numpy reads as float or object): the
        # first of those is the one to name.
        if all(type(v) is int for v in value):
            pos = next(i for i, v in enumerate(value) if not -(2**63) <= v < 2**63)
            raise InputError(
                f"token id {value[pos]} at position {pos} is outside the vocabulary",
                index=index,
                field=field,
            )
        got = (
            f"a nested list (shape {list(arr.shape)})"
            if arr.ndim > 1
            else f"elements of type {arr.dtype}"
        )
        raise InputError(
            f"token ids must be a flat list of ints, got {got}", index=index, field=field
        )
    return arr.astype(np.int64)


def truncate(x: Any, limit: int | None, side: TruncationSide) -> Any:
    if limit is None or x.shape[0] <= limit:
        return x
    return x[-limit:] if side == "left" else x[:limit]
