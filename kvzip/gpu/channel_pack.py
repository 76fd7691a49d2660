"""ChannelPack (the ratio mode, docs/format.md section 15) on a CUDA GPU: the kernels of
kvzip/gpu/kernels/channel.cu on CuPy arrays, on the current device and stream, giving the CPU
reference's bytes (stages/channel_pack_cpu.py).  CuPy is imported on first use.

    streams = encode(src, n, fmt, channels, chunk)   # src: the values' bits, 1-D CuPy array
    dst, code = decode(streams, n, fmt, channels, chunk)

Each call synchronises with the host once: encode reads the three totals of the variable
streams (their lengths, which the blob's layout needs), decode reads the error word.
"""
from __future__ import annotations

import numpy as np

from kvzip.auto_codebook import sample_plan
from kvzip.bitpack import groups
from kvzip.channel_codebook import CODE_BITS, TABLE_WIDTH

from . import loader
from .launch import NO_ERROR, aligned, cupy, launch

THREADS = 256            # channel.cu's WARPS * 32 (and AUTO_RUN: a thread a sampled run value)
WARPS = THREADS // 32    # a warp a chunk
TILE_THREADS = 256       # CH_TILE_THREADS: the offsets scan's blocks
TILE = 8 * TILE_THREADS  # CH_TILE: chunks a block of the scan


def _names(fmt) -> dict:
    args, gpl = loader._args(fmt), loader.channel_gpl(fmt)
    return {"histogram": f"kvz_ch_histogram<{args}>", "tables": f"kvz_ch_tables<{fmt.exp_bits}>",
            "encode": f"kvz_ch_encode<{args},{gpl}>", "decode": f"kvz_ch_decode<{args},{gpl}>",
            "tile_sums": "kvz_ch_tile_sums", "tile_scan": "kvz_ch_tile_scan", "offsets": "kvz_ch_offsets",
            "compact": "kvz_ch_compact"}


def _launch(name, fmt, blocks, threads, args, shared=0, grid_stride=True):
    launch(loader.channel_kernel, _names(fmt)[name], blocks, threads, args, shared, grid_stride=grid_stride)


def tables(src, n: int, fmt, channels: int):
    """uint8[15 * channels]: channel_codebook.tables_of on the device (the sampled histogram,
    then the ranking)."""
    cp = cupy()
    hist = cp.zeros(channels << fmt.exp_bits, cp.uint32)
    _launch("histogram", fmt, sample_plan(n).blocks, THREADS, (src, np.int64(n), np.int32(channels), hist))
    out = cp.empty(channels * TABLE_WIDTH, cp.uint8)
    _launch("tables", fmt, channels, THREADS, (hist, out))
    return out


def _offsets(esc_count, sec_count, n, fmt, chunk, lengths=None):
    """(offsets int64[3 * nchunks], result uint64[4]) from kvz_ch_tile_sums, kvz_ch_tile_scan and
    kvz_ch_offsets;
    lengths (decode): the variable streams' (sec_codes bytes, escapes, exp_high bytes), checked
    against the counts."""
    cp = cupy()
    nchunks = esc_count.shape[0]
    tiles = max(1, -(-nchunks // TILE))  # one block even without chunks: it sets result
    offsets, result, tile_sums = cp.empty(3 * nchunks, cp.int64), cp.empty(4, cp.uint64), cp.empty(3 * tiles, cp.int64)
    n_sec, n_pos, n_high = lengths or (0, 0, 0)
    head = (esc_count, sec_count, np.int64(nchunks), np.int64(n), np.int32(chunk), np.int32(fmt.exp_bits - CODE_BITS))
    checks = (np.int32(lengths is not None), np.int64(n_sec), np.int64(n_pos), np.int64(n_high))
    _launch("tile_sums", fmt, tiles, TILE_THREADS, (*head, tile_sums, result), grid_stride=False)
    _launch("tile_scan", fmt, 1, TILE_THREADS, (tile_sums, np.int64(tiles), np.int64(nchunks), *checks, result))
    _launch("offsets", fmt, tiles, TILE_THREADS, (*head, *checks, tile_sums, offsets, result), grid_stride=False)
    return offsets, result


def encode(src, n: int, fmt, channels: int, chunk: int) -> dict:
    """The streams of section 15.4 of the n values src (1-D CuPy array of fmt's unsigned dtype),
    as CuPy arrays."""
    cp = cupy()
    src = aligned(src)
    E, HB, R = fmt.exp_bits, fmt.exp_bits - CODE_BITS, fmt.rest_bits
    G, nchunks, gpc = groups(n), -(-n // chunk), chunk // 8
    full_cap = HB * gpc // 3
    tabs = tables(src, n, fmt, channels)
    codes, rest = cp.empty(CODE_BITS * G, cp.uint8), cp.empty(R * G, cp.uint8)
    esc_count, sec_count = cp.empty(nchunks, cp.uint16), cp.empty(nchunks, cp.uint16)
    sec_slots = cp.empty(nchunks * (-(-CODE_BITS * chunk // 32)), cp.uint32)
    pos_slots, exp_slots = cp.empty(nchunks * full_cap, cp.uint16), cp.empty(nchunks * full_cap, cp.uint8)
    high_slots = cp.empty(HB * G, cp.uint8)
    lut_bytes = channels << E
    _launch("encode", fmt, -(-nchunks // WARPS), THREADS,
            (src, np.int64(n), np.int32(channels), tabs, np.int32(chunk), np.int64(nchunks), codes, rest, esc_count,
             sec_count, sec_slots, pos_slots, exp_slots, high_slots), shared=lut_bytes)
    offsets, result = _offsets(esc_count, sec_count, n, fmt, chunk)
    ns, ne, nh = (int(x) for x in result[1:4].get())  # the one wait: the streams' lengths
    sec_codes, esc_pos, esc_exp, exp_high = (cp.empty(ns, cp.uint8), cp.empty(ne, cp.uint16), cp.empty(ne, cp.uint8),
                                             cp.empty(nh, cp.uint8))
    _launch("compact", fmt, -(-nchunks // WARPS), THREADS,
            (esc_count, sec_count, np.int64(nchunks), np.int64(n), np.int32(chunk), np.int32(HB), offsets, sec_slots,
             pos_slots, exp_slots, high_slots, sec_codes, esc_pos, esc_exp, exp_high))
    return dict(tables=tabs, codes=codes, rest=rest, esc_count=esc_count, sec_count=sec_count, sec_codes=sec_codes,
                esc_pos=esc_pos, esc_exp=esc_exp, exp_high=exp_high)


def decode(s: dict, n: int, fmt, channels: int, chunk: int):
    """(the n values' bits as a CuPy array, 0 or the error code of CHANNEL_DECODE_ERRORS) of the
    streams s (CuPy arrays whose dtypes, the lengths n implies and the tables the caller has
    checked: ChannelPack.check)."""
    cp = cupy()
    s = {name: aligned(a) for name, a in s.items()}
    nchunks = s["esc_count"].shape[0]
    offsets, result = _offsets(s["esc_count"], s["sec_count"], n, fmt, chunk,
                               (s["sec_codes"].shape[0], s["esc_pos"].shape[0], s["exp_high"].shape[0]))
    dst = cp.empty(n, fmt.uint_dtype)
    _launch("decode", fmt, -(-nchunks // WARPS), THREADS,
            (s["codes"], s["rest"], s["tables"], np.int32(channels), s["esc_count"], s["sec_count"], offsets,
             s["sec_codes"], s["esc_pos"], s["esc_exp"], s["exp_high"], np.int64(n), np.int32(chunk),
             np.int64(nchunks), result, dst))
    err = int(result[0].get())  # the one wait
    return dst, 0 if err == NO_ERROR else err % 8
