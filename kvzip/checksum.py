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

from functools import lru_cache

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


# On a GPU: kvz_sum64 and its fused forms, kvzip/gpu/kernels/sum64.cu (which states the
# invariants: the same terms in any order give the NumPy form's bits).
_THREADS = 256


@lru_cache(maxsize=None)
def _device_module(device: int):
    """sum64.cu compiled for CUDA device ``device`` (one module for its three kernels)."""
    from importlib.resources import files

    import cupy

    from .gpu import loader

    source = files("kvzip.gpu").joinpath("kernels", loader.SUM64).read_text()
    with cupy.cuda.Device(device):
        return cupy.RawModule(code=source)


@lru_cache(maxsize=None)
def device_kernel(name: str, device: int):
    """kvz_sum64, kvz_gather_sum64 or kvz_scatter_sum64 on CUDA device ``device``."""
    return _device_module(device).get_function(name)


@lru_cache(maxsize=None)
def _sm_count(device: int) -> int:
    """Device.attributes queries every attribute of the device, ~100 calls: once per device."""
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]


def device_launch(name: str, n_words: int, *args):
    """Launch one of sum64.cu's kernels over n_words words on the current CuPy device and
    stream; returns the 0-d uint64 total it adds into (not waited for)."""
    import cupy

    total = cupy.zeros((), dtype=cupy.uint64)
    if n_words:
        device = cupy.cuda.Device().id
        blocks = min(-(-n_words // _THREADS), 8 * _sm_count(device))  # enough warps to saturate memory
        device_kernel(name, device)((blocks,), (_THREADS,), (*args, total))
    return total


def _device_sum(words):
    import cupy

    return device_launch("kvz_sum64", words.shape[0], words, cupy.uint64(words.shape[0]))
