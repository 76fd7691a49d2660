"""ChannelRans (the storage mode, docs/format.md section 16) on a CUDA GPU: the kernels of
kvzip/gpu/kernels/channel_rans.cu on CuPy arrays, on the current device and stream, giving the
CPU reference's bytes (stages/channel_rans_cpu.py).  CuPy is imported on first use.

    streams = encode(src, n, fmt, channels, chunk)   # the tables made on the device
    dst, code = decode(streams, n, fmt, channels, chunk, shift, tables, freq, cum)

Encode: kvz_rans_histogram counts the exponents, kvz_rans_tables applies the writer's rule of
stages/channel_rans.py to the counts on the device (integers only, so its bytes are the
reference's), kvz_rans_encode, kvz_rans_offsets and kvz_rans_compact code and place the chunks.
It waits for the device twice: the tables' sizes (the encoder's dynamic shared memory) and the
totals of words and escapes (the streams' lengths).  Decode parses the stored tables on the host
with every check (stages/channel_rans.py: parse_tables) and waits once (the error word).
"""
from __future__ import annotations

import numpy as np

from kvzip.bitpack import groups

from . import loader
from .launch import NO_ERROR, aligned, cupy, launch, max_grid

WARPS = 4                # channel_rans.cu's RANS_WARPS: a warp a chunk
THREADS = 32 * WARPS
SCAN_THREADS = 1024      # RANS_SCAN_THREADS: kvz_rans_offsets's one block
HIST_THREADS = 256       # RANS_HIST_THREADS
HIST_COUNTERS = 8192     # RANS_HIST_COUNTERS: shared counters of a histogram block
HIST_MIN_VALUES = 16 * HIST_THREADS  # a histogram block counts at least this many values
LANES = 32
TOTAL = 4096
# The most dynamic shared memory the tables take: 256 groups of 2 descriptor words and 258
# uint16 entries (the escape, 256 exponents, the end) each (rans_tables.cuh: RANS_MAX_TABLE_WORDS).
MAX_TABLE_BYTES = 256 * (8 + 2 * 258)
# kvz_rans_tables's tables stream at most (RANS_MAX_STREAM_BYTES: 256 groups of 257 frequencies)
# and its info words: shift, the stream's bytes, the table words, groups, search_top.
FREQ_BITS = 12           # RANS_FREQ_BITS (stages/channel_rans.py's FREQ_BITS)
MAX_STREAM_BYTES = 1 + 2 * 256 + -(-FREQ_BITS * 256 * 257 // 8)
INFO_WORDS = 5
TABLES_THREADS = 1024    # RANS_TABLES_THREADS: kvz_rans_tables's one block


def _names(fmt) -> dict:
    args = loader._args(fmt)
    return {"histogram": f"kvz_rans_histogram<{args}>", "encode": f"kvz_rans_encode<{args}>",
            "decode": f"kvz_rans_decode<{args}>", "tables": f"kvz_rans_tables<{fmt.exp_bits}>",
            "offsets": "kvz_rans_offsets", "compact": "kvz_rans_compact"}


def _launch(name, fmt, blocks, threads, args, shared=0):
    launch(loader.channel_rans_kernel, _names(fmt)[name], blocks, threads, args, shared,
           opt_in=MAX_TABLE_BYTES if shared else 0)


def histogram_plan(n: int, channels: int, E: int, grid: int) -> tuple:
    """(slice_channels, per_block, blocks) of kvz_rans_histogram for at most `grid` blocks: slices
    of as many channels as HIST_COUNTERS counters hold, each cut in parts of per_block values (a
    multiple of the block) so that the slices' parts fill the grid."""
    S = min(channels, HIST_COUNTERS >> E)
    slices = channels // S
    slice_values = -(-n // channels) * S
    parts = max(1, min(-(-slice_values // HIST_MIN_VALUES), grid // slices))
    per_block = -(-slice_values // parts)
    per_block = -(-per_block // HIST_THREADS) * HIST_THREADS
    return S, per_block, slices * -(-slice_values // per_block) if slice_values else 0


def device_histogram(src, n: int, fmt, channels: int):
    """uint32[channels << E] on the device ([channel][exponent]): every value's exponent counted
    by channel (channel_rans_cpu.histogram's counts)."""
    cp = cupy()
    E = fmt.exp_bits
    hist = cp.zeros(channels << E, cp.uint32)
    S, per_block, blocks = histogram_plan(n, channels, E, max_grid(cp.cuda.Device().id))
    _launch("histogram", fmt, blocks, HIST_THREADS,
            (cp.ascontiguousarray(src), np.int64(n), np.int32(channels), np.int32(S), np.int64(per_block), hist))
    return hist


def choose_tables(hist, fmt, channels: int) -> tuple:
    """(tables stream uint8, table words uint32, shift, groups, search_top) of device_histogram's
    counts, by kvz_rans_tables: the stream and words stay on the device (views of buffers of the
    largest tables' size); its INFO_WORDS info words are read back (the one wait: the encoder's
    shared memory is sized by the words)."""
    cp = cupy()
    stream = cp.empty(-(-MAX_STREAM_BYTES // 4), cp.uint32)
    words, info = cp.empty(MAX_TABLE_BYTES // 4, cp.uint32), cp.empty(INFO_WORDS, cp.uint32)
    _launch("tables", fmt, 1, TABLES_THREADS, (hist, np.int32(channels), stream, words, info))
    shift, nbytes, nwords, ng, top = (int(x) for x in info.get())
    return stream.view(cp.uint8)[:nbytes], words[:nwords], shift, ng, top


def device_tables(tables: np.ndarray, freq: np.ndarray, cum: np.ndarray, E: int) -> tuple:
    """(words uint32, groups, search_top) of a checked tables stream (parse_tables's freq and cum
    beside it): channel_rans.cu's RansTables layout.  Per group g: desc[2 g] = off_g, desc[2 g + 1]
    = lo_g | width_g << 8 | F_g[ESC] << 20; then the uint16 entries, group after group: the first
    slot of the escape (0), of the exponents lo_g .. hi_g, then TOTAL.  search_top: the largest
    power of two <= the most symbols (width_g + 1) of a group."""
    ng = freq.shape[0]
    lo = tables[1:1 + 2 * ng:2].astype(np.int64)
    width = tables[2:2 + 2 * ng:2].astype(np.int64) - lo + 1
    entries = width + 2
    off = np.cumsum(entries) - entries
    g = np.repeat(np.arange(ng), entries)
    k = np.arange(int(entries.sum())) - off[g]  # an entry's place in its group: 0 the escape
    exponent = np.clip(lo[g] + k - 1, 0, (1 << E) - 1)
    cum16 = np.where(k == 0, 0, np.where(k == entries[g] - 1, TOTAL, cum[g, exponent])).astype(np.uint16)
    desc = np.empty(2 * ng, np.uint32)
    desc[0::2] = off
    desc[1::2] = lo | (width << 8) | (freq[:, 1 << E].astype(np.int64) << 20)
    if cum16.shape[0] % 2:
        cum16 = np.append(cum16, np.uint16(0))
    words = np.concatenate((desc, cum16.view(np.uint32)))
    return words, ng, 1 << (int((width + 1).max()).bit_length() - 1)


def _offsets(word_count, esc_count, n, fmt, chunk, lengths=None):
    """(offsets int64[2 * nchunks], result uint64[4]) from kvz_rans_offsets; lengths (decode): the
    words' and escapes' streams', checked against the counts."""
    cp = cupy()
    nchunks = word_count.shape[0]
    offsets, result = cp.empty(2 * nchunks, cp.int64), cp.empty(4, cp.uint64)
    n_words, n_esc = lengths or (0, 0)
    _launch("offsets", fmt, 1, SCAN_THREADS, (word_count, esc_count, np.int64(nchunks), np.int64(n), np.int32(chunk),
                                                np.int32(lengths is not None), np.int64(n_words), np.int64(n_esc),
                                                offsets, result))
    return offsets, result


def encode(src, n: int, fmt, channels: int, chunk: int) -> dict:
    """The streams of section 16.4 of the n values src (1-D CuPy array of fmt's unsigned dtype),
    the tables chosen on the device by the writer's rule, as CuPy arrays."""
    cp = cupy()
    src = aligned(src)
    stream, tab, shift, ng, _ = choose_tables(device_histogram(src, n, fmt, channels), fmt, channels)
    nchunks = -(-n // chunk)
    rest, states = cp.empty(fmt.rest_bits * groups(n), cp.uint8), cp.empty(LANES * nchunks, cp.uint32)
    word_count, esc_count = cp.empty(nchunks, cp.uint32), cp.empty(nchunks, cp.uint32)
    word_slots, esc_slots = cp.empty(n, cp.uint16), cp.empty(n, cp.uint8)
    _launch("encode", fmt, -(-nchunks // WARPS), THREADS,
            (src, np.int64(n), np.int32(channels), np.int32(shift), tab, np.int32(tab.shape[0]), np.int32(ng),
             np.int32(chunk), np.int64(nchunks), rest, states, word_count, esc_count, word_slots, esc_slots),
            shared=4 * tab.shape[0])
    offsets, result = _offsets(word_count, esc_count, n, fmt, chunk)
    nw, ne = (int(x) for x in result[2:4].get())  # the second wait: the streams' lengths
    words, esc_exp = cp.empty(nw, cp.uint16), cp.empty(ne, cp.uint8)
    _launch("compact", fmt, -(-nchunks // WARPS), THREADS,
            (word_count, esc_count, np.int64(nchunks), np.int64(n), np.int32(chunk), offsets, word_slots, esc_slots,
             words, esc_exp))
    return dict(rest=rest, states=states, words=words, word_count=word_count, esc_count=esc_count, esc_exp=esc_exp,
                tables=stream)


def decode(s: dict, n: int, fmt, channels: int, chunk: int, shift: int, tables: np.ndarray, freq, cum):
    """(the n values' bits as a CuPy array, 0 or the error code of RANS_DECODE_ERRORS) of the
    streams s (CuPy arrays whose dtypes and the lengths n implies the caller has checked:
    ChannelRans.check) under the checked tables (the stream on the host, parse_tables's freq and
    cum of it)."""
    cp = cupy()
    s = {name: aligned(s[name]) for name in ("rest", "states", "words", "word_count", "esc_exp", "esc_count")}
    words_, ng, top = device_tables(tables, freq, cum, fmt.exp_bits)
    tab = cp.asarray(words_)
    nchunks = s["word_count"].shape[0]
    offsets, result = _offsets(s["word_count"], s["esc_count"], n, fmt, chunk,
                               (s["words"].shape[0], s["esc_exp"].shape[0]))
    dst = cp.empty(n, fmt.uint_dtype)
    _launch("decode", fmt, -(-nchunks // WARPS), THREADS,
            (s["rest"], s["states"], s["words"], s["word_count"], s["esc_exp"], s["esc_count"], offsets, tab,
             np.int32(tab.shape[0]), np.int32(ng), np.int32(top), np.int32(channels), np.int32(shift), np.int64(n),
             np.int32(chunk), np.int64(nchunks), result, dst), shared=4 * tab.shape[0])
    err = int(result[0].get())  # the one wait
    return dst, 0 if err == NO_ERROR else err % 8
