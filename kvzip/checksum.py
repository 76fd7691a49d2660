"""sum64: the payload checksum, a parallel-friendly 64-bit hash.

Payload bytes (a multiple of 8 long) are read as little-endian uint64 words w_0..w_{m-1}:

    sum64 = mix(  (sum_i mix(w_i + i * GOLDEN) mod 2**64)  XOR  payload_length )

with mix = the SplitMix64 finaliser (a bijection on 64-bit words).  Because mix is a bijection,
changing any single word always changes the sum; any other corruption goes unnoticed with
probability about 2**-64.  Unlike CRC32 it needs no sequential scan, so a GPU computes it at
memory speed with plain array operations (the same code runs on NumPy and CuPy).  On the CPU a
nogil Numba loop sums word ranges in threads instead (the array form makes four temporaries).
"""
from __future__ import annotations

import numpy as np

from . import cpu_parallel
from .jit import cpu_jit

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix(xp, z):
    z = z + GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@cpu_jit(nogil=True)
def sum_terms(words, i0, i1):
    """sum of mix(w_i + i * GOLDEN) over i0 <= i < i1, mod 2**64: the one definition of the terms,
    also called from the CPU decode kernels (stages/fused_cpu.py) on the words they decode.
    A plain loop over a slice, k stepping by GOLDEN: LLVM vectorises it (contiguous loads,
    vpmullq where the CPU has AVX-512DQ); indexing ``words`` itself, or two words a step, made
    it gather (benchmarks/NOTES.md, c6).  All uint64: numba would turn a uint64 and int64 mix
    into float64."""
    t = np.uint64(0)
    w = words[i0:i1]
    k = np.uint64(i0) * GOLDEN + GOLDEN  # mix's own + GOLDEN folded in
    for j in range(w.shape[0]):
        z = w[j] + k
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        t += z ^ (z >> np.uint64(31))
        k += GOLDEN
    return t


def _cpu_total(words: np.ndarray) -> int:
    ranges = cpu_parallel.split(words.shape[0], 8)
    return sum(int(t) for t in cpu_parallel.run_ranges(lambda i0, i1: sum_terms(words, i0, i1), ranges)) % (1 << 64)


def sum64(xp, payload) -> int:
    """Checksum of a 1-D uint8 array whose length is a multiple of 8 (NumPy or CuPy)."""
    return sum64_finish(sum64_start(xp, payload), payload.shape[0])


def sum64_start(xp, payload):
    """The inner sum of sum64: an int on the CPU; on a GPU a 0-d CuPy array, queued on the current
    stream and not waited for, so the caller reads it once it synchronises that stream anyway."""
    if payload.shape[0] % 8:
        raise ValueError("sum64 needs a whole number of 8-byte words")
    words = payload.view(xp.uint64)
    return _cpu_total(words) if xp is np else _device_sum(words)


def sum64_finish(total, length: int) -> int:
    """sum64 from sum64_start's result and the payload's length in bytes."""
    with np.errstate(over="ignore"):
        return int(mix(np, np.asarray([int(total) ^ length], dtype=np.uint64))[0])


# One pass over the words on a GPU: each thread adds up mix(w_i + i * GOLDEN) for its share in a
# register, a warp adds its threads' sums by shuffles and one atomic per warp adds that into the
# total.  Addition mod 2**64 is associative and commutative, so the order of the additions
# cannot change the result: it is the NumPy form's, bit for bit (tests/gpu/test_checksum_gpu.py).
_SUM64_SOURCE = r"""
extern "C" __global__ void kvz_sum64(const unsigned long long* __restrict__ w, unsigned long long n,
                                     unsigned long long* total) {
    const unsigned long long golden = 0x9E3779B97F4A7C15ull;
    unsigned long long acc = 0;
    const unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        unsigned long long z = w[i] + i * golden + golden;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        acc += z ^ (z >> 31);
    }
    for (int d = 16; d > 0; d >>= 1)
        acc += __shfl_down_sync(0xffffffffu, acc, d);
    if ((threadIdx.x & 31) == 0)
        atomicAdd(total, acc);
}
"""
_SUM64_KERNEL = None
_THREADS = 256


def _device_sum(words):
    global _SUM64_KERNEL
    import cupy

    if _SUM64_KERNEL is None:
        _SUM64_KERNEL = cupy.RawKernel(_SUM64_SOURCE, "kvz_sum64")
    total = cupy.zeros((), dtype=cupy.uint64)
    n = words.shape[0]
    if n:
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        blocks = min(-(-n // _THREADS), 8 * sms)  # enough warps in flight to saturate memory
        _SUM64_KERNEL((blocks,), (_THREADS,), (words, cupy.uint64(n), total))
    return total
