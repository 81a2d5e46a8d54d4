"""Float formats numpy lacks (bfloat16, FP8 E4M3 and E5M2), for encoding output vectors
without torch: values rounded to nearest, ties to even, as torch's conversions from float32
round them, and the bytes of each format."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FloatFormat:
    """A binary float format: exponent and mantissa bits, and what a value too large becomes."""

    exponent_bits: int
    mantissa_bits: int
    max_finite: float
    saturates: bool  # too large: the largest finite value (E4M3FN has no inf), else inf

    @property
    def min_exponent(self) -> int:  # of the smallest normal value
        return 2 - 2 ** (self.exponent_bits - 1)


BFLOAT16 = FloatFormat(8, 7, float.fromhex("0x1.fep127"), saturates=False)
FP8_E4M3 = FloatFormat(4, 3, 448.0, saturates=True)
FP8_E5M2 = FloatFormat(5, 2, 57344.0, saturates=False)
FORMATS = {"bfloat16": BFLOAT16, "fp8_e4m3": FP8_E4M3, "fp8_e5m2": FP8_E5M2}


def round_to_format(array: np.ndarray, fmt: FloatFormat) -> np.ndarray:
    """`array` rounded to `fmt`, as float32 (every value of these formats is one exactly)."""
    x = np.asarray(array, dtype=np.float64)  # float32 values are exact here
    magnitude = np.abs(x)
    with np.errstate(invalid="ignore"):
        _, e = np.frexp(magnitude)  # magnitude = m * 2**e, m in [0.5, 1)
        exponent = np.maximum(e - 1, fmt.min_exponent)  # below it, subnormals: a fixed step
        step = np.ldexp(1.0, exponent - fmt.mantissa_bits)
        rounded = np.round(magnitude / step) * step  # np.round: ties to even
        over = rounded > fmt.max_finite
    if fmt.saturates:
        rounded[over] = fmt.max_finite
        rounded[np.isnan(x)] = np.nan
    else:
        rounded[over] = np.inf
    return np.copysign(rounded, x).astype(np.float32)


def format_bytes(array: np.ndarray, fmt: FloatFormat, order: str = "<") -> bytes:
    """The values of `array` in `fmt`, row-major: two bytes each in byte order `order` for
    bfloat16, one byte each for FP8."""
    rounded = round_to_format(array, fmt)
    if fmt is BFLOAT16:
        bits = (rounded.view(np.uint32) >> 16).astype(np.uint16)
        return bits.astype(f"{order}u2").tobytes()
    if fmt is FP8_E5M2:  # every E5M2 value is a float16 with the low mantissa byte zero
        return (rounded.astype(np.float16).view(np.uint16) >> 8).astype(np.uint8).tobytes()
    return _e4m3_bits(rounded).tobytes()


def _e4m3_bits(rounded: np.ndarray) -> np.ndarray:
    """E4M3FN bytes (bias 7, no inf, NaN 0x7F) of values already rounded to the format."""
    sign = np.signbit(rounded).astype(np.uint8) << 7
    magnitude = np.abs(rounded.astype(np.float64))
    nan = np.isnan(magnitude)
    magnitude[nan] = 0.0
    _, e = np.frexp(magnitude)
    exponent = e - 1
    normal = (magnitude > 0) & (exponent >= FP8_E4M3.min_exponent)
    mantissa = np.where(
        normal,
        np.ldexp(magnitude, -exponent) * 8 - 8,  # 1.mmm * 2**E: the three bits after the point
        np.ldexp(magnitude, 9),  # subnormals: multiples of 2**-9
    )
    field = np.where(normal, exponent + 7, 0).astype(np.uint8) << 3
    bits = sign | field | mantissa.astype(np.uint8)
    bits[nan] = sign[nan] | 0x7F
    return bits
