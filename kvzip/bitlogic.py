"""The split/pack/escape bit logic, written once for the CPU (@njit) and CUDA kernels.

Plain Python here; ``CPU`` and ``cuda_helpers()`` are the compiled twins (kvzip/jit.py).  A value
of format (E, M) splits into exponent e = bits M..M+E-1 and rest r = (sign << M) | mantissa.
Every helper works on one 8-value group, the unit a GPU thread owns: its 4 code bytes, its R
rest bytes and its E-4 exp_high bytes all start on byte boundaries (kvzip/bitpack.py).
"""
from __future__ import annotations

from functools import lru_cache

from .jit import twin_compile
from .layout import PLANE  # noqa: F401 (esc_count of a plane-coded chunk: the CPU and Numba kernels take it from here)

ESCAPE = 255


def value_exponent(v, E, M):
    return (v >> M) & ((1 << E) - 1)


def value_rest(v, E, M):
    return ((v >> (E + M)) << M) | (v & ((1 << M) - 1))


def join_value(e, r, E, M):
    return ((r >> M) << (E + M)) | (e << M) | (r & ((1 << M) - 1))


def popcount8(mask):
    c = 0
    for j in range(8):
        c += (mask >> j) & 1
    return c


def encode_group(src, n, g, E, M, lut, codes, rest):
    """Write group g's 4 code bytes and R rest bytes; return the mask of its escaping values."""
    R = M + 1
    mask = 0
    word = 0
    acc = 0
    nacc = 0
    out = g * R
    for j in range(8):
        i = g * 8 + j
        code = 0
        r = 0
        if i < n:
            v = int(src[i])
            r = value_rest(v, E, M)
            c = int(lut[value_exponent(v, E, M)])
            if c == ESCAPE:
                mask |= 1 << j
            else:
                code = c
        word |= code << (4 * j)
        acc |= r << nacc
        nacc += R
        while nacc >= 8:
            rest[out] = acc & 0xFF
            out += 1
            acc >>= 8
            nacc -= 8
    for k in range(4):
        codes[4 * g + k] = (word >> (8 * k)) & 0xFF
    return mask


def encode_group_plane(src, n, g, E, M, codes, exp_high, hoff):
    """Plane coding of group g: low exponent nibbles as its codes, the high E-4 bits at
    exp_high[hoff : hoff + E - 4]."""
    HB = E - 4
    word = 0
    high = 0
    for j in range(8):
        i = g * 8 + j
        if i < n:
            e = value_exponent(int(src[i]), E, M)
            word |= (e & 0xF) << (4 * j)
            high |= (e >> 4) << (HB * j)
    for k in range(4):
        codes[4 * g + k] = (word >> (8 * k)) & 0xFF
    for k in range(HB):
        exp_high[hoff + k] = (high >> (8 * k)) & 0xFF


def decode_group(codes, rest, n, g, E, M, dlut, plane, exp_high, hoff, dst):
    """Rebuild group g's values into dst (escapes are patched afterwards).  For a plane-coded
    group the exponent is code | high bits from exp_high[hoff:]; otherwise dlut[code]."""
    R = M + 1
    HB = E - 4
    word = 0
    for k in range(4):
        word |= int(codes[4 * g + k]) << (8 * k)
    high = 0
    if plane:
        for k in range(HB):
            high |= int(exp_high[hoff + k]) << (8 * k)
    acc = 0
    nacc = 0
    inp = g * R
    for j in range(8):
        while nacc < R:
            acc |= int(rest[inp]) << nacc
            inp += 1
            nacc += 8
        r = acc & ((1 << R) - 1)
        acc >>= R
        nacc -= R
        c = (word >> (4 * j)) & 0xF
        if plane:
            e = c | (((high >> (HB * j)) & ((1 << HB) - 1)) << 4)
        else:
            e = int(dlut[c])
        i = g * 8 + j
        if i < n:
            dst[i] = join_value(e, r, E, M)


def patch_exponent(dst, i, e, E, M):
    """Overwrite the exponent of dst[i] (an escape)."""
    v = int(dst[i])
    dst[i] = (v & ~(((1 << E) - 1) << M)) | (e << M)


HELPERS = (value_exponent, value_rest, join_value, popcount8, encode_group, encode_group_plane,
           decode_group, patch_exponent)
CPU = twin_compile(HELPERS, "cpu")


@lru_cache(maxsize=None)
def cuda_helpers():
    """CUDA device-function twins (compiled lazily: importing kvzip never needs CUDA)."""
    return twin_compile(HELPERS, "cuda")
