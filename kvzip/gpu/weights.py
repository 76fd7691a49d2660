"""Launches of the weights' kernels (kernels/weights.cu) on a stream the caller gives (a CuPy
stream object): the fused decode+GEMM (kvz_w_gemm for N <= MAX_N, kvz_w_gemm_wide above), the
decoder and the encoder.

Everything here is handed arrays kvzip.weights has allocated and checked (device, dtype, shape,
alignment), read only through their data_ptr(): the launches make no host synchronisation and
no allocation, so a caller can capture them in a CUDA graph.
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from . import abi, loader

# The tiled layout's geometry (docs/weights-format.md §1; kvzip/weights/tiled.py takes it from here):
BAND, CHUNK, BLOCK_BYTES = 16, 64, 1536  # rows, columns and bytes of a block (W_CHUNK, W_BLOCK_U4)
WARPS = 8                       # W_WARPS of weights.cu: 256 threads a block
TABLE_BYTES = 256 * 32 * 4      # the per-lane pair table
DECODE_STAGES = 4               # W_DECODE_STAGES: kvz_w_decode's ring of blocks a warp
TILE_BYTES = WARPS * 16 * 33 * 4  # kvz_w_decode's tiles (W_TILE_WORDS = 33)
N_TILES = loader.WEIGHT_N_TILES
MAX_N = 8 * N_TILES[-1]         # kvz_w_gemm's widest x; wider takes kvz_w_gemm_wide
WIDE_TILES = loader.WEIGHT_WIDE_N_TILES
WIDE_STAGES, X_ROW = 3, 72      # W_WIDE_STAGES, W_X_ROW of weights_wide.cuh
REGISTERS, SHARED_PER_SM, THREADS_PER_SM = 65536, 228 * 1024, 2048  # sm_90's limits per multiprocessor
BLOCK_COST = 4                  # a kvz_w_gemm block's fixed cost (pair table, sums), in chunks a warp


def grid(shape) -> tuple[int, int]:
    """(bands, chunks) of an M x K matrix."""
    return -(-shape[0] // BAND), -(-shape[1] // CHUNK)


def _shared(name: str) -> int:
    """Dynamic shared memory of a kernel: the pair table (and kvz_w_decode's rings and tiles)."""
    if name.startswith("kvz_w_gemm<"):
        return TABLE_BYTES
    if name.startswith("kvz_w_gemm_wide<"):  # its stages: a block of W a warp and 8 NT rows of x
        return WIDE_STAGES * (WARPS * BLOCK_BYTES + 8 * int(name[16:-1]) * X_ROW * 2)
    if name == "kvz_w_decode":
        return TABLE_BYTES + WARPS * DECODE_STAGES * BLOCK_BYTES + TILE_BYTES
    return 0


@lru_cache(maxsize=None)
def kernel(name: str, device_id: int):
    """(kernel, dynamic shared bytes, resident thread blocks per multiprocessor)."""
    import cupy

    with cupy.cuda.Device(device_id):
        fn = loader.weights_kernel(name, device_id)
    shared = _shared(name)
    if shared:
        fn.max_dynamic_shared_size_bytes = shared
    regs = -(-max(fn.num_regs, 1) // 8) * 8
    resident = min(REGISTERS // (regs * WARPS * 32), SHARED_PER_SM // (shared + fn.shared_size_bytes + 1024),
                   THREADS_PER_SM // (WARPS * 32))
    return fn, shared, max(1, resident)


@lru_cache(maxsize=None)
def multiprocessors(device_id: int) -> int:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device_id)["multiProcessorCount"]


def n_tiles(n: int) -> int:
    """The kvz_w_gemm instance for N columns of x (N <= MAX_N)."""
    return next(t for t in N_TILES if n <= 8 * t)


@lru_cache(maxsize=4096)
def gemm_plan(shape, n: int, device_id: int) -> tuple[int, int]:
    """(splits, chunks per split) of kvz_w_gemm for an M x K weight and N columns.  A thread
    block per band and split; with `slots` blocks resident the time is about
    waves x (chunks per split + a block's fixed cost), waves = ceil(bands x splits / slots), so
    the split count minimising that wins (the smaller on a tie): it fills the last wave, or makes
    it a small part of many.  The plan depends on the shape and the GPU only, so a weight's sums
    are the same in every call."""
    bands, chunks = grid(shape)
    _, _, resident = kernel(f"kvz_w_gemm<{n_tiles(n)}>", device_id)
    slots = resident * multiprocessors(device_id)
    best = None
    for want in range(1, max(1, chunks // WARPS) + 1):  # at least a chunk per warp
        per_split = -(-chunks // want)
        splits = -(-chunks // per_split)
        cost = -(-bands * splits // slots) * (per_split + BLOCK_COST)
        if best is None or cost < best[0]:
            best = (cost, splits, per_split)
    return best[1], best[2]


def gemm(tw, x, bias, y, partial, tickets, plan, stream) -> None:
    """y (N x M, rows ldy apart) = x (N x K, rows ldx apart) W^T + bias, for N <= MAX_N, by
    gemm_plan's plan.  partial: float32, bands x splits x 16 x N (when splits > 1); tickets:
    int32 (bands,), zero (and zero again after the kernel)."""
    n, k = x.shape
    bands, chunks = grid(tw.shape)
    splits, per_split = plan
    fn, shared, _ = kernel(f"kvz_w_gemm<{n_tiles(n)}>", x.device.index)
    args = abi.W_GEMM_ARGS(blocks=tw.blocks.data_ptr(), codebook=tw.codebook.data_ptr(),
                           esc_off=tw.esc_off.data_ptr(), esc_pos=tw.esc_pos.data_ptr(), esc_val=tw.esc_val.data_ptr(),
                           x=x.data_ptr(), ldx=x.stride(0), bias=0 if bias is None else bias.data_ptr(),
                           y=y.data_ptr(), ldy=y.stride(0), partial=partial.data_ptr(), tickets=tickets.data_ptr(),
                           M=tw.shape[0], K=k, N=n, chunks=chunks, per_split=per_split)
    fn((bands, splits), (WARPS * 32,), args, shared_mem=shared, stream=stream)


def wide_tiles(n: int) -> int:
    """The kvz_w_gemm_wide instance for N columns of x: the narrowest whose n block holds them,
    else the widest (several n blocks)."""
    return next((t for t in WIDE_TILES if n <= 8 * t), WIDE_TILES[-1])


@lru_cache(maxsize=4096)
def wide_plan(shape, n: int, device_id: int) -> tuple[int, int]:
    """(splits, chunks per split) of kvz_w_gemm_wide for an M x K weight and N columns.  A thread
    block per (row block of WARPS bands, split, n block); with splits > 1 each block also writes
    its sums (a partial tile: 512 bytes a column of its n block, PARTIAL chunks' worth of its
    12 KiB a chunk of W) and the tile's last block reads all of them.  Time ~ waves x (chunks per
    split + BLOCK_COST + PARTIAL) + splits x PARTIAL; the split count minimising it wins (the
    smaller on a tie).  Splits need a ticket a tile (ZipLinear holds one a band), so where tiles
    outnumber bands there is one split.  Depends on the shape, N and the GPU only, so a weight's
    sums are the same in every call."""
    bands, chunks = grid(shape)
    bn = 8 * wide_tiles(n)
    tiles = -(-bands // WARPS) * -(-n // bn)
    _, _, resident = kernel(f"kvz_w_gemm_wide<{bn // 8}>", device_id)
    slots = resident * multiprocessors(device_id)
    partial = bn / 24  # 16 rows x bn floats a warp, WARPS warps, over WARPS x BLOCK_BYTES a chunk
    best = None
    for want in range(1, (chunks if tiles <= bands else 1) + 1):
        per_split = -(-chunks // want)
        splits = -(-chunks // per_split)
        reduce = partial if splits > 1 else 0.0
        cost = -(-tiles * splits // slots) * (per_split + BLOCK_COST + reduce) + splits * reduce
        if best is None or cost < best[0]:
            best = (cost, splits, per_split)
    return best[1], best[2]


def wide_partial_floats(shape, n: int, splits: int) -> int:
    """Floats of kvz_w_gemm_wide's partial sums for a plan of ``splits`` (0 when it needs none)."""
    if splits == 1:
        return 0
    bands, _ = grid(shape)
    bn = 8 * wide_tiles(n)
    return -(-bands // WARPS) * -(-n // bn) * splits * WARPS * 16 * bn


def gemm_wide(tw, x, bias, y, partial, tickets, plan, stream) -> None:
    """gemm() for N > MAX_N, by kvz_w_gemm_wide and wide_plan's plan.  partial: float32 of
    wide_partial_floats (when splits > 1); tickets: int32, one a tile (zero, and zero again
    after the kernel)."""
    n, k = x.shape
    bands, chunks = grid(tw.shape)
    splits, per_split = plan
    nt = wide_tiles(n)
    fn, shared, _ = kernel(f"kvz_w_gemm_wide<{nt}>", x.device.index)
    args = abi.W_GEMM_WIDE_ARGS(blocks=tw.blocks.data_ptr(), codebook=tw.codebook.data_ptr(),
                                esc_off=tw.esc_off.data_ptr(), esc_pos=tw.esc_pos.data_ptr(),
                                esc_val=tw.esc_val.data_ptr(), x=x.data_ptr(), ldx=x.stride(0),
                                bias=0 if bias is None else bias.data_ptr(), y=y.data_ptr(), ldy=y.stride(0),
                                partial=partial.data_ptr(), tickets=tickets.data_ptr(),
                                M=tw.shape[0], K=k, N=n, chunks=chunks, per_split=per_split)
    fn((-(-bands // WARPS), splits, -(-n // (8 * nt))), (WARPS * 32,), args, shared_mem=shared, stream=stream)


def decode(tw, out, stream) -> None:
    """out (M x K, contiguous BF16) = W, escapes included."""
    m, k = tw.shape
    bands, chunks = grid(tw.shape)
    device = out.device.index
    fn, shared, resident = kernel("kvz_w_decode", device)
    blocks = min(-(-bands * chunks // WARPS), resident * multiprocessors(device))
    fn((blocks,), (WARPS * 32,), abi.W_DECODE_ARGS(blocks=tw.blocks.data_ptr(), codebook=tw.codebook.data_ptr(),
                                                    out=out.data_ptr(), M=m, K=k, bands=bands, chunks=chunks),
       shared_mem=shared, stream=stream)
    if tw.escapes:
        fn, _, _ = kernel("kvz_w_patch", device)
        fn((-(-tw.escapes // 256),), (256,), abi.W_PATCH_ARGS(esc_off=tw.esc_off.data_ptr(),
                                                              esc_pos=tw.esc_pos.data_ptr(), esc_val=tw.esc_val.data_ptr(),
                                                              bands=bands, out=out.data_ptr(), K=k), stream=stream)


def _spread(work: int, kernel_name: str, device: int) -> int:
    """Thread blocks for ``work`` warp tasks: enough to fill the GPU, no more than there is work."""
    _, _, resident = kernel(kernel_name, device)
    return max(1, min(-(-work // WARPS), resident * multiprocessors(device)))


# The GPU encoder's workspace: int32 words, zeroed a call.  Word offsets of kvz_w_histogram's histogram
# and ticket, the code table (256 bytes) its last block leaves for kvz_w_encode and kvz_w_escapes,
# kvz_w_encode's ticket and its escapes a band (bands words); its escapes a block (bands x chunks
# words) come last, at Workspace.counts.
HIST, HIST_TICKET, ENCODE_TICKET, CODE_OF, BAND_COUNTS = 0, 256, 257, 260, 324


class Workspace(NamedTuple):
    words: int           # the whole, in int32 words
    counts: int          # the escapes a block, from this word on
    histogram_grid: int  # thread blocks of kvz_w_histogram
    encode_grid: int     # of kvz_w_encode and kvz_w_escapes


@lru_cache(maxsize=4096)
def workspace(shape, device: int) -> Workspace:
    """The encoder's workspace and grids for an M x K weight on a device."""
    bands, chunks = grid(shape)
    n = shape[0] * shape[1]
    return Workspace(BAND_COUNTS + bands + bands * chunks, BAND_COUNTS + bands,
                     _spread(-(-n // 256), "kvz_w_histogram", device),  # a warp task: 256 values
                     _spread(bands * chunks, "kvz_w_encode", device))


def _word(work, offset: int) -> int:
    return work.data_ptr() + 4 * offset


def histogram(w, work, book, ws, stream) -> None:
    """The exponent histogram of w (contiguous BF16, 16-byte aligned) into the workspace, then by
    its last thread block book (16 uint8) and the workspace's code table, by
    kvzip/weights/tiled.py's choose_codebook and _code_of."""
    fn, _, _ = kernel("kvz_w_histogram", w.device.index)
    fn((ws.histogram_grid,), (WARPS * 32,),
       abi.W_HISTOGRAM_ARGS(w=w.data_ptr(), n=w.numel(), hist=_word(work, HIST), ticket=_word(work, HIST_TICKET),
                            book=book.data_ptr(), code_of=_word(work, CODE_OF)), stream=stream)


def encode_blocks(w, work, blocks, esc_off, ws, stream) -> None:
    """The blocks of W (contiguous M x K BF16) and, by the last thread block, esc_off (int32,
    bands + 1): the escape lists' offsets.  After histogram() on the same workspace."""
    (m, k), device = w.shape, w.device.index
    bands, chunks = grid(w.shape)
    fn, _, _ = kernel("kvz_w_encode", device)
    fn((ws.encode_grid,), (WARPS * 32,),
       abi.W_ENCODE_ARGS(w=w.data_ptr(), M=m, K=k, code_of=_word(work, CODE_OF), blocks=blocks.data_ptr(),
                         counts=_word(work, ws.counts), band_counts=_word(work, BAND_COUNTS),
                         ticket=_word(work, ENCODE_TICKET), esc_off=esc_off.data_ptr(), bands=bands, chunks=chunks),
       stream=stream)


def encode_escapes(w, work, esc_off, esc_pos, esc_val, ws, stream) -> None:
    """The escape lists (esc_off[-1] of each), after encode_blocks() on the same workspace."""
    (m, k), device = w.shape, w.device.index
    bands, chunks = grid(w.shape)
    fn, _, _ = kernel("kvz_w_escapes", device)
    fn((ws.encode_grid,), (WARPS * 32,),
       abi.W_ESCAPES_ARGS(w=w.data_ptr(), M=m, K=k, code_of=_word(work, CODE_OF), counts=_word(work, ws.counts),
                          esc_off=esc_off.data_ptr(), esc_pos=esc_pos.data_ptr(), esc_val=esc_val.data_ptr(),
                          bands=bands, chunks=chunks), stream=stream)
