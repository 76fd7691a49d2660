"""Float bit layouts: the one table every stage reads field widths from.

A value of W = 1 + E + M bits is laid out, from the most significant bit down, as
sign (1) | exponent (E) | mantissa (M).  kvzip calls sign+mantissa the *rest* of a value:
R = 1 + M bits, with the sign as its top bit: rest = (sign << M) | mantissa.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class FloatFormat:
    name: str          # short name used in configs and codebooks: "bf16", "e5m2", ...
    dtype_name: str    # the framework dtype name: "bfloat16", "float8_e5m2", ...
    exp_bits: int
    mant_bits: int
    # Derived once at construction (every call on the hot path asks for them):
    width: int = field(init=False, repr=False, compare=False)          # bits per value: 8, 16 or 32
    rest_bits: int = field(init=False, repr=False, compare=False)      # sign + mantissa, kept verbatim
    high_exp_bits: int = field(init=False, repr=False, compare=False)  # exponent bits above a code's 4
    uint_dtype: np.dtype = field(init=False, repr=False, compare=False)  # same-width unsigned: the bits travel in it
    itemsize: int = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        width = 1 + self.exp_bits + self.mant_bits
        for key, value in (("width", width), ("rest_bits", 1 + self.mant_bits), ("high_exp_bits", self.exp_bits - 4),
                           ("uint_dtype", np.dtype({8: np.uint8, 16: np.uint16, 32: np.uint32}[width])),
                           ("itemsize", width // 8)):
            object.__setattr__(self, key, value)


FORMATS: dict[str, FloatFormat] = {
    f.name: f
    for f in (
        FloatFormat("bf16", "bfloat16", 8, 7),
        FloatFormat("fp16", "float16", 5, 10),
        FloatFormat("fp32", "float32", 8, 23),
        FloatFormat("e4m3", "float8_e4m3fn", 4, 3),
        FloatFormat("e5m2", "float8_e5m2", 5, 2),
    )
}
BY_DTYPE_NAME: dict[str, FloatFormat] = {f.dtype_name: f for f in FORMATS.values()}

# Spellings users and frameworks give for the same formats.
_ALIASES = {
    "bfloat16": "bf16", "bf16": "bf16",
    "float16": "fp16", "half": "fp16", "fp16": "fp16", "f2": "fp16", "<f2": "fp16",
    "float32": "fp32", "float": "fp32", "fp32": "fp32", "f4": "fp32", "<f4": "fp32",
    # Not "float8_e4m3": ml_dtypes' float8_e4m3 is IEEE-like (Inf and NaNs), another format.
    "float8_e4m3fn": "e4m3", "e4m3": "e4m3", "e4m3fn": "e4m3",
    "float8_e5m2": "e5m2", "e5m2": "e5m2",
}


def get_format(name_or_dtype) -> FloatFormat:
    """Look a format up by short name, dtype name, or a numpy/torch/jax dtype object."""
    if isinstance(name_or_dtype, FloatFormat):
        return name_or_dtype
    if isinstance(name_or_dtype, str):  # the common case (every decode asks several times): no parsing
        short = _ALIASES.get(name_or_dtype)
        if short is not None:
            return FORMATS[short]
    key = str(name_or_dtype).lower()
    key = key.removeprefix("torch.").removeprefix("dtype(").strip("')\"")
    try:
        return FORMATS[_ALIASES[key]]
    except KeyError:
        supported = ", ".join(f"{f.name} ({f.dtype_name})" for f in FORMATS.values())
        raise TypeError(f"unsupported float format {name_or_dtype!r}; kvzip supports {supported}") from None
