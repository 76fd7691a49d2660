"""sum64: the payload checksum, a parallel-friendly 64-bit hash.

Payload bytes (a multiple of 8 long) are read as little-endian uint64 words w_0..w_{m-1}:

    sum64 = mix(  (sum_i mix(w_i + i * GOLDEN) mod 2**64)  XOR  payload_length )

with mix = the SplitMix64 finaliser (a bijection on 64-bit words).  Because mix is a bijection,
changing any single word always changes the sum; any other corruption goes unnoticed with
probability about 2**-64.  Unlike CRC32 it needs no sequential scan, so a GPU computes it at
memory speed with plain array operations (the same code runs on NumPy and CuPy).
"""
from __future__ import annotations

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix(xp, z):
    z = z + GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def sum64(xp, payload) -> int:
    """Checksum of a 1-D uint8 array whose length is a multiple of 8 (NumPy or CuPy)."""
    return sum64_finish(sum64_start(xp, payload), payload.shape[0])


def sum64_start(xp, payload):
    """The inner sum of sum64 as a 0-d array of the payload's library, without waiting for it:
    on a GPU the caller reads it once its stream is synchronised anyway."""
    if payload.shape[0] % 8:
        raise ValueError("sum64 needs a whole number of 8-byte words")
    words = payload.view(xp.uint64)
    with np.errstate(over="ignore"):
        if xp is np:
            terms = mix(np, words + np.arange(words.shape[0], dtype=np.uint64) * GOLDEN)
        else:  # one fused pass instead of a dozen array operations, each with its own temporary
            terms = _device_terms()(words)
        return terms.sum(dtype=xp.uint64)


def sum64_finish(total, length: int) -> int:
    """sum64 from sum64_start's result and the payload's length in bytes."""
    with np.errstate(over="ignore"):
        return int(mix(np, np.asarray([int(total) ^ length], dtype=np.uint64))[0])


_TERMS = None


def _device_terms():
    """CuPy kernel: t_i = mix(w_i + i * GOLDEN), the same arithmetic as ``mix`` above (mod 2**64)."""
    global _TERMS
    if _TERMS is None:
        import cupy

        _TERMS = cupy.ElementwiseKernel(
            "uint64 w", "uint64 t",
            """unsigned long long z = w + (unsigned long long)i * GOLDEN + GOLDEN;
               z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
               z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
               t = z ^ (z >> 31);""",
            "kvz_sum64_terms", preamble=f"#define GOLDEN {int(GOLDEN):#x}ull")
    return _TERMS
