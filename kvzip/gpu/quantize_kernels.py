"""The fast GPU path of QuantizeFP8 with one scale per tensor on bf16/fp16 input: CUDA C++
kernels (kernels/quantize.cu) that look values up in per-call tables built from kvzip/fp8_bits.py's
logic, run through CuPy on the caller's stream.

Per-channel scales and fp32 input stay on the Numba kernels of stages/quantize_fp8.py, which
with the CPU twin are the reference these kernels are tested against byte for byte (tests/gpu).
A quantize call is a memset and three launches (amax, scale + table, lookup); a dequantize call
one launch (each block builds its 256-entry table from the scale).  Shapes a pipeline has
encoded before skip the quantize pass: programs's quantizing encode program runs amax and the
table, then kvz_encode quantizes as it loads.  Blobs whose layout kvzip/gpu/layout_cache.py
remembers skip the dequantize pass: programs's decode program builds their tables
(kvz_dequant_tables) and kvz_decode applies them as it stores.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np


from . import loader
from .abi import AMAX_ARGS, DEQUANTIZE_ARGS, QUANT_TABLE_ARGS, QUANTIZE_ARGS, aligned

ENABLED = True          # tests switch this off to exercise the Numba kernels on a real GPU
THREADS = 256           # quantize.cu's THREADS; kvz_dequantize builds one table entry a thread
SOURCES = loader.QUANTIZE_SOURCES
TARGETS = loader.QUANTIZE_TARGETS
TABLE_BYTES = 1 << 15   # one code per 15-bit source magnitude


_names = loader.quantize_names


@lru_cache(maxsize=None)
def _kernel(name: str, device_id: int):
    return loader.quantize_kernel(name, _names(), device_id)


@lru_cache(maxsize=None)
def _grid_cap(device_id: int) -> int:
    """Blocks of the grid-stride kernels: enough to fill every multiprocessor several times."""
    import cupy

    return cupy.cuda.Device(device_id).attributes["MultiProcessorCount"] * 8


def grid(units: int, device_id: int) -> int:
    """Blocks for a grid-stride kernel over `units` work items (at least one)."""
    return max(1, min(-(-units // THREADS), _grid_cap(device_id)))


def usable(backend, source: str, fp8: str, granularity: str, *arrays) -> bool:
    """True on a real GPU for per-tensor scales of bf16/fp16 input with 16-byte aligned buffers."""
    return (ENABLED and backend.name == "cuda" and not backend.simulated and granularity == "tensor"
            and source in SOURCES and fp8 in TARGETS and all(map(aligned, arrays)))


def kernels(source: str, fp8: str, device_id: int) -> tuple:
    """(kvz_amax, kvz_quant_table) of a format pair: quantize() runs them, and programs's
    quantizing encode puts them in its CUDA graph ahead of kvz_encode."""
    return _kernel(loader.amax_name(source), device_id), _kernel(loader.quant_table_name(source, fp8), device_id)


def dequant_tables_kernel(fp8: str, source: str, device_id: int):
    """kvz_dequant_tables of a format pair: programs's dequantizing decode program runs it."""
    return _kernel(loader.dequant_tables_name(fp8, source), device_id)


def quantize(src, source: str, fp8: str):
    """(codes uint8[n], scales float32[1]) of the 16-bit values src, as QuantizeFP8 defines them."""
    import cupy

    dev, n = src.device.id, src.size
    work = cupy.empty(TABLE_BYTES + 16, np.uint8)  # the table, then the amax (stream-ordered pool)
    amax = work[TABLE_BYTES:TABLE_BYTES + 4].view(np.uint32)
    amax.fill(0)
    scales = cupy.empty(1, np.float32)
    codes = cupy.empty(n, np.uint8)
    amax_kernel, table_kernel = kernels(source, fp8, dev)
    amax_kernel((grid(n // 8, dev),), (THREADS,), AMAX_ARGS(src=src.data.ptr, src_at=0, n=n, out=amax.data.ptr))
    table_kernel((TABLE_BYTES // THREADS,), (THREADS,),
                 QUANT_TABLE_ARGS(amax=amax.data.ptr, scale=scales.data.ptr, addrs=0, scale_word=0, scale_span=4,
                                  table=work.data.ptr))
    if n:
        _kernel("kvz_quantize", dev)((grid(n // 8, dev),), (THREADS,),
                                     QUANTIZE_ARGS(src=src.data.ptr, n=n, table_g=work.data.ptr, out=codes.data.ptr))
    return codes, scales


def dequantize(codes, scales, fp8: str, source: str):
    """The 16-bit values (uint16[n]) of FP8 codes with one float32 scale."""
    import cupy

    dev, n = codes.device.id, codes.size
    out = cupy.empty(n, np.uint16)
    if n:
        _kernel(loader.dequantize_name(fp8, source), dev)(
            (grid(n // 8, dev),), (THREADS,), DEQUANTIZE_ARGS(codes=codes.data.ptr, n=n, scale=scales.data.ptr, out=out.data.ptr))
    return out
