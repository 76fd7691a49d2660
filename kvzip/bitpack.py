"""Fixed-width bit packing, the layout every packed stream in kvzip uses.

Values of ``nbits`` bits each are laid end to end, LSB first: value i occupies bits
[i*nbits, (i+1)*nbits) of the stream, and bit b of the stream is bit (b % 8) of byte b // 8.
Streams always hold a whole number of 8-value groups (a group is exactly ``nbits`` bytes), so
group boundaries fall on byte boundaries and a GPU thread can own a group.

These are the array-level reference implementations (NumPy or CuPy, picked by ``xp``); the
fused kernels in stages/fused.py write the same bytes one group at a time.
"""
from __future__ import annotations


def groups(n: int) -> int:
    """Number of 8-value groups covering n values."""
    return (n + 7) // 8


def pack_bits(xp, values, nbits: int):
    """Pack the low ``nbits`` of each value; pads with zero values to a whole group."""
    n = values.shape[0]
    padded = xp.zeros(groups(n) * 8, dtype=xp.uint32)
    padded[:n] = values
    if nbits == 8:
        return padded.astype(xp.uint8)
    if nbits == 4:
        return (padded[0::2] | (padded[1::2] << 4)).astype(xp.uint8)
    if nbits == 0:
        return xp.zeros(0, dtype=xp.uint8)
    shifts = xp.arange(nbits, dtype=xp.uint32)
    bits = ((padded[:, None] >> shifts[None, :]) & 1).astype(xp.uint8)
    return xp.packbits(bits.reshape(-1), bitorder="little")


def unpack_bits(xp, packed, nbits: int, n: int, dtype):
    """Inverse of pack_bits: the first n values, as ``dtype``.  ``packed`` must hold
    exactly groups(n) * nbits bytes (callers validate before calling)."""
    if nbits == 8:
        return packed[:n].astype(dtype)
    if nbits == 4:
        out = xp.empty(groups(n) * 8, dtype=dtype)
        out[0::2] = packed & 0xF
        out[1::2] = packed >> 4
        return out[:n]
    if nbits == 0:
        return xp.zeros(n, dtype=dtype)
    bits = xp.unpackbits(packed, bitorder="little").reshape(-1, nbits).astype(xp.uint32)
    weights = (xp.uint32(1) << xp.arange(nbits, dtype=xp.uint32))
    return (bits * weights[None, :]).sum(axis=1, dtype=xp.uint32)[:n].astype(dtype)
