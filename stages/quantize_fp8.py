"""QuantizeFP8: the one lossy stage.  bf16/fp16/fp32 -> e5m2/e4m3fn with float32 scales.

encode: amax = max |x| over finite values (per tensor, or per channel = last axis);
        scale = max(float32(amax) / float32(fmax), 2^-126), 1.0 when amax is 0;
        q = RNE_fp8(float32(x) / scale), saturating at ±fmax (NaN -> NaN, Inf -> Inf for e5m2,
        ±448 for e4m3fn).  The stream "scales" (float32) rides along to Serialize.
decode: y = RNE_src(float32(q) * scale).

The per-element bit logic lives in kvzip.fp8_bits and is compiled for both backends, so the CPU
and CUDA paths produce identical bytes.  On a real GPU, per-tensor scales of bf16/fp16 input take
kvzip/gpu/quantize_kernels.py instead: the same logic run once per table entry, then table lookups.
docs/quantize.md derives the error bound and records the measured speed.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from kvzip import fp8_bits
from kvzip.errors import FormatError
from kvzip.formats import FORMATS, get_format
from kvzip.jit import cpu_jit, numba_cuda, twin_compile

from kvzip.gpu import quantize_kernels
from .base import TENSOR, Stage, register

FP8_FORMATS = ("e5m2", "e4m3")
SOURCE_FORMATS = ("bf16", "fp16", "fp32")
GRANULARITIES = ("tensor", "channel")
_THREADS = 128  # a power of two: the amax kernel folds its block in halves
_MAX_BLOCKS = 1 << 15  # grid-stride beyond this; plenty to fill any GPU
cuda = None  # numba.cuda, imported by _cuda_kernels on first CUDA use


def _format_constants(source, fp8):
    """Field widths of the pair, frozen into the kernels below as compile-time constants, so
    the compiler folds the helpers' shifts, masks and special-value codes."""
    s, f = FORMATS[source], FORMATS[fp8]
    # e4m3fn has no Inf: its all-ones exponent holds normal values.
    return s.exp_bits, s.mant_bits, f.exp_bits, f.mant_bits, int(fp8 == "e4m3")


@lru_cache(maxsize=None)
def _helpers(target):
    """kvzip.fp8_bits compiled once per target and shared by every format pair's kernels."""
    return twin_compile(fp8_bits.HELPERS, target)


# The CPU twins as globals of this module: the cached CPU kernels below call them by global name
# (kvzip/jit.py: a closure over a compiled function would never hit Numba's disk cache).
_cpu = _helpers("cpu")
_cpu_finite_magnitude, _cpu_scale_from_amax = _cpu.finite_magnitude, _cpu.scale_from_amax
_cpu_quantize, _cpu_dequantize = _cpu.quantize, _cpu.dequantize


@lru_cache(maxsize=None)
def _cpu_kernels(source, fp8):
    """Closures over the pair's field widths only (ints), so Numba's disk cache keeps one entry
    per pair."""
    SRC_E, SRC_M, E, M, FN = _format_constants(source, fp8)

    # Values are C-ordered, so value i belongs to channel i % n_channels: walk rows x channels.
    @cpu_jit
    def amax(src, n_channels, out):
        for row in range(0, src.size, n_channels):
            for c in range(n_channels):
                out[c] = max(out[c], _cpu_finite_magnitude(src[row + c], SRC_E, SRC_M))

    @cpu_jit
    def scales(amax_bits, out):
        for c in range(out.size):
            out[c] = _cpu_scale_from_amax(amax_bits[c], SRC_E, SRC_M, E, M, FN)

    @cpu_jit
    def encode(src, scale, n_channels, out):
        for row in range(0, src.size, n_channels):
            for c in range(n_channels):
                out[row + c] = _cpu_quantize(src[row + c], SRC_E, SRC_M, scale[c], E, M, FN)

    @cpu_jit
    def decode(codes, scale, n_channels, out):
        for row in range(0, codes.size, n_channels):
            for c in range(n_channels):
                out[row + c] = _cpu_dequantize(codes[row + c], scale[c], E, M, FN, SRC_E, SRC_M)

    return {"amax": amax, "scales": scales, "encode": encode, "decode": decode}


@lru_cache(maxsize=None)
def _cuda_kernels(source, fp8):
    """Compiled on first CUDA use, so importing the stage never needs CUDA.

    The per-value kernels stride by the largest multiple of n_channels that fits in the grid,
    so every element a thread visits is in the same channel: one scale load per thread, no
    per-element modulo, and the amax needs one atomic per thread at most.  _run launches at
    least n_channels threads; at worst (n_channels just over half the grid) half of them idle.
    """
    # A module global, not a local: the CUDA simulator swaps the kernel module's global
    # ``cuda`` for its fake one, and would miss a closure variable.
    global cuda
    cuda = numba_cuda()

    SRC_E, SRC_M, E, M, FN = _format_constants(source, fp8)
    THREADS = _THREADS
    h = _helpers("cuda")
    finite_magnitude, scale_from_amax = h.finite_magnitude, h.scale_from_amax
    quantize, dequantize = h.quantize, h.dequantize

    @cuda.jit
    def amax(src, n_channels, out):
        t = cuda.grid(1)
        stride = (cuda.gridsize(1) // n_channels) * n_channels
        best = 0
        if t < stride:
            for i in range(t, src.size, stride):
                best = max(best, finite_magnitude(src[i], SRC_E, SRC_M))
        # Fold the block before the atomics: per tensor, every thread of the grid would
        # otherwise hit one address.
        # Threads a multiple of n_channels apart share a channel, so the first `width`
        # threads (width: the smallest power of two that is a multiple of n_channels, or
        # the whole block) each gather every width-th slot.
        folded = cuda.shared.array(THREADS, np.uint32)
        lane = cuda.threadIdx.x
        folded[lane] = best
        cuda.syncthreads()
        width = THREADS
        while width > 1 and (width // 2) % n_channels == 0:
            width //= 2
        if t < stride and lane < width:
            for j in range(lane + width, THREADS, width):
                best = max(best, folded[j])
            cuda.atomic.max(out, t % n_channels, np.uint32(best))

    @cuda.jit
    def scales(amax_bits, out):
        for c in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            out[c] = scale_from_amax(amax_bits[c], SRC_E, SRC_M, E, M, FN)

    @cuda.jit
    def encode(src, scale, n_channels, out):
        t = cuda.grid(1)
        stride = (cuda.gridsize(1) // n_channels) * n_channels
        if t < stride:
            s = scale[t % n_channels]
            for i in range(t, src.size, stride):
                out[i] = quantize(src[i], SRC_E, SRC_M, s, E, M, FN)

    @cuda.jit
    def decode(codes, scale, n_channels, out):
        t = cuda.grid(1)
        stride = (cuda.gridsize(1) // n_channels) * n_channels
        if t < stride:
            s = scale[t % n_channels]
            for i in range(t, codes.size, stride):
                out[i] = dequantize(codes[i], s, E, M, FN, SRC_E, SRC_M)

    return {"amax": amax, "scales": scales, "encode": encode, "decode": decode}


def _run(backend, formats, kernel, n, n_channels, *args):
    """Run the named kernel of the (source, fp8) pair over n items of n_channels channels."""
    if n == 0:
        return
    if backend.name == "cuda":
        blocks = max(min(-(-n // _THREADS), _MAX_BLOCKS), -(-n_channels // _THREADS))
        backend.launch(_cuda_kernels(*formats)[kernel], blocks, _THREADS, *args)
    else:
        _cpu_kernels(*formats)[kernel](*args)


def _channels(shape, granularity) -> int:
    """How many scales: 1 per tensor, or the last axis' length (a 0-d tensor is one channel)."""
    if granularity == "channel" and len(shape) > 0:
        return int(shape[-1])
    return 1


@register
class QuantizeFP8(Stage):
    id = "quantize_fp8"
    input_kind = (TENSOR,)
    output_kind = TENSOR
    consumes = ("data",)
    produces = ("data", "scales")
    lossless = False

    def __init__(self, format="e5m2", granularity="tensor"):
        fmt = get_format(format)
        if fmt.name not in FP8_FORMATS:
            raise ValueError(f"QuantizeFP8 format must be e5m2 or e4m3 (float8_e4m3fn), got {format!r}")
        if granularity not in GRANULARITIES:
            raise ValueError(f"QuantizeFP8 granularity must be 'tensor' or 'channel' (last axis), got {granularity!r}")
        self.format = fmt.name
        self.granularity = granularity

    def get_config(self):
        return {"id": self.id, "format": self.format, "granularity": self.granularity}

    def max_encoded_size(self, nbytes: int) -> int:
        # Inputs are at least 2 bytes a value: at most nbytes // 2 FP8 bytes, plus one float32
        # scale per tensor or, at worst (shape [1, n]), one per value.
        values = nbytes // 2
        return values + 4 * (values if self.granularity == "channel" else 1)

    def encode(self, frame):
        meta = frame.meta
        src = get_format(meta.get("format"))
        if src.name not in SOURCE_FORMATS:
            raise TypeError(
                f"QuantizeFP8 quantizes bf16, fp16 or fp32 input, got {src.name} ({src.dtype_name}); "
                "FP8 input is already quantized"
            )
        frame.require("data")
        data = frame.streams["data"]
        n, shape = int(meta["n"]), list(meta["shape"])
        if data.dtype != src.uint_dtype or data.ndim != 1 or data.size != n or math.prod(shape) != n:
            raise ValueError(
                f"tensor frame is inconsistent: data {data.dtype}[{data.size}], n={n}, shape={shape}, "
                f"format {src.name} wants {src.uint_dtype}"
            )
        backend, formats = frame.backend, (src.name, self.format)
        n_channels = _channels(shape, self.granularity)

        if quantize_kernels.usable(backend, src.name, self.format, self.granularity, data):
            codes, scales = quantize_kernels.quantize(data, src.name, self.format)
        else:
            amax = backend.zeros(n_channels, np.uint32)  # magnitude bits; stays 0 without values
            _run(backend, formats, "amax", n, n_channels, data, n_channels, amax)
            scales = backend.empty(n_channels, np.float32)
            _run(backend, formats, "scales", n_channels, n_channels, amax, scales)
            codes = backend.empty(n, np.uint8)
            _run(backend, formats, "encode", n, n_channels, data, scales, n_channels, codes)

        out = frame.replace(data=codes, scales=scales)
        out.meta["format"] = self.format
        out.meta["quantize_fp8"] = {"source_format": src.name}
        return out

    def decode(self, frame):
        meta = frame.meta
        frame.require("data", "scales")
        if frame.format.name != self.format:  # meta.format may be any alias (docs/format.md, section 3)
            raise FormatError(f"QuantizeFP8({self.format}) cannot decode a frame in format {meta.get('format')!r}")
        info = meta.get("quantize_fp8")
        source = info.get("source_format") if isinstance(info, dict) else None
        if source not in SOURCE_FORMATS:
            raise FormatError(f"quantize_fp8 metadata must name a source format in {SOURCE_FORMATS}, got {info!r}")
        n, shape = meta.get("n"), meta.get("shape")
        if not (type(n) is int and n >= 0):
            raise FormatError(f"element count n must be a non-negative int, got {n!r}")
        if not (isinstance(shape, (list, tuple)) and all(type(d) is int and d >= 0 for d in shape)):
            raise FormatError(f"shape must be a list of non-negative ints, got {shape!r}")
        if math.prod(shape) != n:
            raise FormatError(f"shape {list(shape)} holds {math.prod(shape)} values but n is {n}")
        data, scales = frame.streams["data"], frame.streams["scales"]
        if data.dtype != np.uint8 or data.ndim != 1 or data.size != n:
            raise FormatError(f"FP8 data must be uint8[{n}], got {data.dtype}{list(data.shape)}")
        n_channels = _channels(shape, self.granularity)
        if scales.dtype != np.float32 or scales.ndim != 1 or scales.size != n_channels:
            raise FormatError(
                f"{self.granularity} scales must be float32[{n_channels}] for shape {list(shape)}, "
                f"got {scales.dtype}{list(scales.shape)}"
            )

        if quantize_kernels.usable(frame.backend, source, self.format, self.granularity, data, scales):
            out_bits = quantize_kernels.dequantize(data, scales, self.format, source)
        else:
            out_bits = frame.backend.empty(n, FORMATS[source].uint_dtype)
            _run(frame.backend, (source, self.format), "decode", n, n_channels, data, scales, n_channels, out_bits)

        out = frame.replace(drop=("scales",), data=out_bits)
        out.meta["format"] = source
        del out.meta["quantize_fp8"]
        return out
