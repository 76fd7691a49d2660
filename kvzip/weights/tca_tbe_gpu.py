"""TCA-TBE decode on a CUDA GPU: kvz_tca_tbe_decode (kvzip/gpu/kernels/tca_tbe.cu), one block a
64x64 global tile, through a CuPy RawModule.  CuPy is imported on first use, so this module
imports anywhere.

    out = decode(blob)          # blob: bytes-like on the host, or a 1-D uint8 CuPy array
                                # out: (M, K) uint16 CuPy array, the bits of the BF16 weights

The host checks the header (kvzip.weights.tca_tbe.read_layout) and the payload's sum64 on the
device; the kernel checks every tile's offsets against its bitmaps before it reads a run, and
its padding weights, so a forged blob raises FormatError as on the CPU.
"""
from __future__ import annotations

from functools import lru_cache
from importlib.resources import files

import numpy as np

from kvzip.checksum import sum64
from kvzip.errors import FormatError

from . import tca_tbe

KERNEL = "kvz_tca_tbe_decode"
THREADS = 128
ERRORS = {1: "TCA-TBE global offsets disagree with the bitmaps", 2: "TCA-TBE median offsets disagree with the bitmaps",
          4: "TCA-TBE padding weights are not the filler value",
          8: "TCA-TBE stream padding or alignment bytes are not zero"}  # tca_tbe.cu's TBE_BAD_*


def source() -> str:
    return files("kvzip.gpu").joinpath("kernels", "tca_tbe.cu").read_text()


@lru_cache(maxsize=None)
def _kernel(device: int):
    import cupy

    with cupy.cuda.Device(device):
        return cupy.RawModule(code=source(), options=("-std=c++17",)).get_function(KERNEL)


def _args(lay: tca_tbe.Layout, stream_at, out, error) -> tuple:
    """kvz_tca_tbe_decode's arguments, in its order; stream_at(name, dtype) gives a stream."""
    return (stream_at("bitmap0", np.uint64), stream_at("global_offsets", np.uint32),  # bitmap1, 2 follow bitmap0
            stream_at("median_offsets", np.uint32), stream_at("sign_mantissa", np.uint8), np.uint32(lay.sm_bytes),
            stream_at("fallback", np.uint16), np.uint32(lay.fb_bytes // 2),
            out, np.uint32(lay.rows), np.uint32(lay.cols), np.uint32(lay.tiles_k), np.int32(lay.base), error)


def decode(blob):
    """The (M, K) uint16 CuPy matrix of a TCA-TBE blob, decoded on the current device and stream."""
    import cupy

    if isinstance(blob, cupy.ndarray):
        if blob.dtype != cupy.uint8 or blob.ndim != 1:
            raise TypeError(f"a device blob is a 1-D uint8 CuPy array, got {blob.dtype} of shape {blob.shape}")
        dev = blob if blob.flags.c_contiguous and blob.data.ptr % 16 == 0 else blob.copy()  # 16-byte loads
        lay = tca_tbe.read_layout(cupy.asnumpy(dev[:tca_tbe.HEADER_BYTES]), dev.shape[0])
    else:
        host = np.frombuffer(blob, np.uint8)
        lay = tca_tbe.read_layout(host[:tca_tbe.HEADER_BYTES], host.shape[0])
        dev = cupy.asarray(host)
    if sum64(cupy, dev[tca_tbe.HEADER_BYTES:]) != lay.checksum:
        raise FormatError("TCA-TBE payload checksum mismatch: the blob is corrupted")
    if lay.tiles == 0:  # no blocks to check the (one) offset pair: the host reads the 80-byte blob
        return cupy.asarray(tca_tbe.decode(cupy.asnumpy(dev)))

    streams = lay.streams

    def stream_at(name, dtype):
        offset, length = streams[name]
        return dev[offset:offset + length].view(dtype)

    out = cupy.empty((lay.rows, lay.cols), cupy.uint16)
    error = cupy.zeros(1, cupy.uint32)
    _kernel(cupy.cuda.Device().id)((lay.tiles,), (THREADS,), _args(lay, stream_at, out, error))
    flags = int(error.get()[0])
    if flags:
        raise FormatError("; ".join(text for bit, text in ERRORS.items() if flags & bit))
    return out
