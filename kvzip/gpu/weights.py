"""Launches of the weights' kernels (kernels/weights.cu) on a stream the caller gives (a CuPy
stream object): the fused decode+GEMM for small N, the standalone decode and its escape patch.

Everything here is handed arrays kvzip.weights has checked (device, dtype, shape, alignment),
read only through their data_ptr(): the launches make no host synchronisation and no allocation,
so a caller can capture them in a CUDA graph.
"""
from __future__ import annotations

from functools import lru_cache

from . import abi, loader

BAND, CHUNK = 16, 64             # rows and columns of a block (kvzip/weights/tiled.py, W_CHUNK)
WARPS = 8                       # W_WARPS of weights.cu
TABLE_BYTES = 256 * 32 * 4      # the per-lane pair table
TILE_BYTES = WARPS * 16 * 36 * 4  # kvz_w_decode's tiles
N_TILES = loader.WEIGHT_N_TILES
MAX_N = 8 * N_TILES[-1]         # the fused kernel's widest x
GEMM = "kvz_w_gemm"



@lru_cache(maxsize=None)
def kernel(name: str, device_id: int):
    import cupy

    with cupy.cuda.Device(device_id):
        fn = loader.weights_kernel(name, device_id)
    shared = TABLE_BYTES + (TILE_BYTES if name == "kvz_w_decode" else 0)
    fn.max_dynamic_shared_size_bytes = shared
    return fn, shared


def grid(shape) -> tuple[int, int]:
    """(bands, chunks) of an M x K matrix."""
    return -(-shape[0] // BAND), -(-shape[1] // CHUNK)


@lru_cache(maxsize=None)
def multiprocessors(device_id: int) -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]


def n_tiles(n: int) -> int:
    """The kvz_w_gemm instance for N columns (N <= MAX_N)."""
    return next(t for t in N_TILES if n <= 8 * t)


def split_plan(shape, device_id: int) -> tuple[int, int]:
    """(splits, chunks per split) of kvz_w_gemm: K split until bands x splits blocks fill the GPU
    about four times over, each split a whole number of chunks per warp.  The grid shape alone
    decides it, so a band's sum is the same in every call (and the summation order with it)."""
    bands, chunks = grid(shape)
    want = max(1, -(-4 * multiprocessors(device_id) // bands))
    per_split = max(WARPS, -(-chunks // want // WARPS) * WARPS)
    return -(-chunks // per_split), per_split


def gemm(tw, x, bias, y, partial, tickets, splits: int, per_split: int, stream) -> None:
    """y (N x M, rows ldy apart) = x (N x K, rows ldx apart) W^T + bias, for N <= MAX_N.
    partial: float32, at least bands x splits x 16 x N (when splits > 1); tickets: int32
    (bands,), zero (and zero again after the kernel)."""
    n, k = x.shape
    m = tw.shape[0]
    bands, chunks = grid(tw.shape)
    fn, shared = kernel(f"{GEMM}<{n_tiles(n)}>", x.device.index)
    args = abi.W_GEMM_ARGS(blocks=tw.blocks.data_ptr(), codebook=tw.codebook.data_ptr(), esc_off=tw.esc_off.data_ptr(),
                     esc_pos=tw.esc_pos.data_ptr(), esc_val=tw.esc_val.data_ptr(), x=x.data_ptr(), ldx=x.stride(0),
                     bias=0 if bias is None else bias.data_ptr(), y=y.data_ptr(), ldy=y.stride(0),
                     partial=partial.data_ptr(), tickets=tickets.data_ptr(), M=m, K=k, N=n, chunks=chunks,
                     per_split=per_split)
    fn((bands, splits), (WARPS * 32,), args, shared_mem=shared, stream=stream)


def decode(tw, out, stream) -> None:
    """out (M x K, contiguous BF16) = W, escapes included."""
    m, k = tw.shape
    bands, chunks = grid(tw.shape)
    device = out.device.index
    fn, shared = kernel("kvz_w_decode", device)
    blocks = min(bands * chunks // WARPS + 1, 8 * multiprocessors(device))
    fn((blocks,), (WARPS * 32,), abi.W_DECODE_ARGS(blocks=tw.blocks.data_ptr(), codebook=tw.codebook.data_ptr(),
                                              out=out.data_ptr(), M=m, K=k, bands=bands, chunks=chunks),
       shared_mem=shared, stream=stream)
    if tw.escapes:
        fn, _ = kernel("kvz_w_patch", device)
        fn((-(-tw.escapes // 256),), (256,), abi.W_PATCH_ARGS(esc_off=tw.esc_off.data_ptr(), esc_pos=tw.esc_pos.data_ptr(),
                                                        esc_val=tw.esc_val.data_ptr(), bands=bands,
                                                        out=out.data_ptr(), K=k), stream=stream)

