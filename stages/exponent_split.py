"""ExponentSplit: each value's bits -> an exponent stream and a sign+mantissa ("rest") stream.

Array-level and backend-agnostic (NumPy or CuPy through ``backend.xp``).  When followed by
Top16Pack and EscapeStream the pipeline runs the fused kernel in stages/fused.py instead.
"""
from __future__ import annotations

import numpy as np

from kvzip.errors import FormatError
from kvzip.frame import Frame

from .base import SPLIT, TENSOR, Stage, register


def rest_dtype(fmt) -> np.dtype:
    """Smallest unsigned dtype holding sign+mantissa."""
    r = fmt.rest_bits
    return np.dtype(np.uint8 if r <= 8 else np.uint16 if r <= 16 else np.uint32)


@register
class ExponentSplit(Stage):
    id = "exponent_split"
    input_kind = (TENSOR,)
    output_kind = SPLIT
    consumes = ("data",)
    produces = ("exponent", "rest")

    def encode(self, frame: Frame) -> Frame:
        fmt, xp = frame.format, frame.backend.xp
        data = frame.expect("data", fmt.uint_dtype, frame.n).astype(xp.uint32)
        exponent = ((data >> fmt.mant_bits) & ((1 << fmt.exp_bits) - 1)).astype(xp.uint8)
        sign = data >> (fmt.exp_bits + fmt.mant_bits)
        rest = ((sign << fmt.mant_bits) | (data & ((1 << fmt.mant_bits) - 1))).astype(rest_dtype(fmt))
        return frame.replace(drop=("data",), exponent=exponent, rest=rest)

    def decode(self, frame: Frame) -> Frame:
        fmt, xp, n = frame.format, frame.backend.xp, frame.n
        exponent = frame.expect("exponent", np.uint8, n).astype(xp.uint32)
        rest = frame.expect("rest", rest_dtype(fmt), n).astype(xp.uint32)
        if n and int(exponent.max()) >= 1 << fmt.exp_bits:
            raise FormatError(f"exponent stream holds values >= 2**{fmt.exp_bits}")
        if n and int(rest.max()) >= 1 << fmt.rest_bits:
            raise FormatError(f"rest stream holds values >= 2**{fmt.rest_bits}")
        sign = rest >> fmt.mant_bits
        mant = rest & ((1 << fmt.mant_bits) - 1)
        data = (sign << (fmt.exp_bits + fmt.mant_bits)) | (exponent << fmt.mant_bits) | mant
        return frame.replace(drop=("exponent", "rest"), data=data.astype(fmt.uint_dtype))
