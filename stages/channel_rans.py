"""ChannelRans: the storage mode's lossless code, tensor -> streams in one step.

Each value's exponent is entropy coded with interleaved rANS (Duda 2013; Giesen's interleaving)
under a static frequency table of the value's channel group (the channels of
kvzip/channel_codebook.py, ``2**shift`` adjacent channels a group), the tables chosen from the
tensor itself and stored in the blob.  An exponent outside its table is coded as the escape
symbol and kept as a byte in ``esc_exp``.  The sign+mantissa bits (the "rest") stay raw, packed
as ChannelPack packs them.  Values are cut into chunks of ``chunk`` values, each coded by
LANES interleaved 32-bit states over its own run of 16-bit words, so chunks decode
independently (and, on a GPU later, a warp a chunk with one lane a state).

Streams (docs/format.md section 16 is their normative description): rest, states, words,
word_count, esc_count, esc_exp, tables.  The CPU kernels are stages/channel_rans_cpu.py (the
reference); on a CUDA backend with CuPy arrays (``on_device``) the stage runs
kvzip/gpu/channel_rans.py's CUDA kernels on the device, which give the same bytes and the same
errors: the histogram is counted there and kvz_rans_tables applies this module's writer's rule
to it there (nothing but the tables' sizes comes to the host); decoding copies only the tables
stream to the host.  Under the Numba simulator the CPU kernels run on the host.

The writer's rule (16.2; choose_shift, group_tables, tables_bytes) is integer arithmetic only,
so a device reproduces it bit for bit: each grouping (2**shift channels a table, shift 0 ..
log2 D) is estimated in 2**-16 bits as sum over groups ((16 + 12 K + E esc) << 16) + sum c (L(N)
- L(c)) over a group's K counts c > 0 (escape first, N their sum), with the fixed-point log2 L(x)
= floor(log2 x) << 16 | LOG2_FRAC[the 11 bits of x below its leading one]; the smallest wins,
the finest on ties; _freqs normalises each group's counts.
"""
from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import numpy as np

from kvzip.bitpack import groups
from kvzip.channel_codebook import channels_of
from kvzip.errors import RANS_DECODE_ERRORS, FormatError
from kvzip.frame import Frame

from . import channel_rans_cpu
from .base import CHANNEL_CODED, TENSOR, Stage, on_device, register
from .channel_rans_cpu import LANES, PROB_BITS
from .escape_stream import check_chunk

MIN_CHUNK = LANES       # a chunk gives every lane a value at least once
MAX_CHUNK = 1 << 20
TOTAL = 1 << PROB_BITS
FREQ_BITS = 12          # a stored frequency: 0..4095 (no table gives one symbol all 4096 slots)
MIN_COUNT = 4           # an exponent seen fewer times widens its table only inside [lo, hi]


def _freqs(counts: np.ndarray) -> np.ndarray:
    """counts (int64, escape first) -> frequencies summing to TOTAL, each < TOTAL, >= 1 where the
    count is > 0 (docs/format.md 16.2, the normalisation rule)."""
    c = counts.copy()
    if np.count_nonzero(c) < 2:  # no frequency may reach TOTAL (12 bits): the escape gets a count
        c[0] += 1
    f = np.where(c > 0, np.maximum(1, c * TOTAL // c.sum()), 0)
    d = TOTAL - int(f.sum())
    while d:  # the difference at the largest frequency, lowest index on ties, none below 1
        j = int(np.argmax(f))
        step = d if d > 0 else max(d, 1 - int(f[j]))
        f[j] += step
        d -= step
    return f


def _merged(hist: np.ndarray, shift: int) -> np.ndarray:
    """int64[groups, 2**E]: the counts of each group of 2**shift channels; a group without values
    counts exponent 0 once (16.2)."""
    merged = hist.reshape(hist.shape[0] >> shift, 1 << shift, hist.shape[1]).sum(axis=1)
    merged[merged.sum(axis=1) == 0, 0] = 1
    return merged


def _ranges(merged: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) of every group: the least / greatest of its mode and its exponents of count >= MIN_COUNT."""
    mode = np.argmax(merged, axis=1)
    keep = merged >= MIN_COUNT
    width = merged.shape[1]
    first = np.where(keep.any(axis=1), np.argmax(keep, axis=1), mode)
    last = np.where(keep.any(axis=1), width - 1 - np.argmax(keep[:, ::-1], axis=1), mode)
    return np.minimum(mode, first), np.maximum(mode, last)


def group_tables(hist: np.ndarray, shift: int) -> list:
    """[(lo, hi, freqs int64[hi - lo + 2], escape first)] of each group of 2**shift channels."""
    merged = _merged(hist, shift)
    out = []
    for row, lo, hi in zip(merged, *_ranges(merged)):
        inside = row[lo:hi + 1]
        out.append((int(lo), int(hi), _freqs(np.concatenate(([row.sum() - inside.sum()], inside)))))
    return out


# The writer's fixed-point log2 (16.2): L(x) = floor(log2 x) << 16 | LOG2_FRAC[the LOG2_INDEX_BITS
# bits of x below its leading one], x >= 1; LOG2_FRAC[i] = round(2**16 log2(1 + i / 2**11)).  Each
# entry lies at least 2.5e-4 from a rounding tie (tests/test_storage_mode.py), so float64 gives the
# exact table; kvzip/gpu/kernels/rans_rule.cuh holds the same numbers (cuh()).  L is
# non-decreasing, so every estimate term c (L(N) - L(c)) is >= 0.
LOG2_ONE_BITS = 16
LOG2_INDEX_BITS = 11
LOG2_FRAC = np.round((1 << LOG2_ONE_BITS) * np.log2(1 + np.arange(1 << LOG2_INDEX_BITS) / (1 << LOG2_INDEX_BITS)))
LOG2_FRAC = LOG2_FRAC.astype(np.int64)


def log2_fixed(x: np.ndarray) -> np.ndarray:
    """L(x) of each x >= 1 (int64, < 2**62), exactly: floor(log2 x) << 16 | LOG2_FRAC[index]."""
    x = np.asarray(x, np.int64)
    msb = np.frexp(x.astype(np.float64))[1].astype(np.int64) - 1  # exact below 2**53; above, x may round
    msb -= (x >> msb) == 0                                        # up to 2**(msb + 1), never down
    lift = LOG2_INDEX_BITS - msb
    top = np.where(lift >= 0, x << np.maximum(lift, 0), x >> np.maximum(-lift, 0))
    return (msb << LOG2_ONE_BITS) | LOG2_FRAC[top & ((1 << LOG2_INDEX_BITS) - 1)]


def _estimate_bits(hist: np.ndarray, shift: int, E: int) -> int:
    """The size of one grouping in 2**-16 bits (the writer's choice of shift; 16.2), an exact
    integer: per group (16 + 12 K + E esc) << 16 for its table and escapes, plus c (L(N) - L(c))
    for each of its K counts c > 0 (escape first; N their sum), L the fixed-point log2.  Each
    value adds less than 2**20 (E <= 8 escape bits, log2 K <= 8.01 bits), each product c (L(N) -
    L(c)) is below N 2**22: int64 holds every tensor of fewer than 2**42 values."""
    merged = _merged(hist, shift)
    lo, hi = _ranges(merged)
    e = np.arange(merged.shape[1])
    inside = np.where((e >= lo[:, None]) & (e <= hi[:, None]), merged, 0)
    total = merged.sum(axis=1)
    counts = np.concatenate(((total - inside.sum(axis=1))[:, None], inside), axis=1)
    row, col = np.nonzero(counts)
    c = counts[row, col]
    info = (c * (log2_fixed(total)[row] - log2_fixed(c))).sum()
    table = ((16 + FREQ_BITS * (hi - lo + 2) + E * counts[:, 0]) << LOG2_ONE_BITS).sum()
    return int(table) + int(info)


def cuh() -> str:
    """kvzip/gpu/kernels/rans_rule.cuh: the writer's rule's constants for kvz_rans_tables, the
    fixed-point log2's table among them."""
    frac = [int(v) for v in LOG2_FRAC]
    lines = ["// kvzip/gpu/kernels/rans_rule.cuh: the storage mode's writer's rule's constants for the kernels.",
             "// Generated from stages/channel_rans.py by `python -m kvzip.gpu.headers --write`: do not edit",
             "// (tests/test_storage_mode.py checks that this file is that text).",
             "#pragma once",
             "",
             f"#define RANS_FREQ_BITS {FREQ_BITS}",
             f"#define RANS_MIN_COUNT {MIN_COUNT}",
             f"#define RANS_LOG2_ONE_BITS {LOG2_ONE_BITS}",
             f"#define RANS_LOG2_INDEX_BITS {LOG2_INDEX_BITS}",
             "",
             "// LOG2_FRAC[i] = round(2**16 log2(1 + i / 2**11)): L(x) = floor(log2 x) << 16 | LOG2_FRAC[the 11 bits",
             "// of x below its leading one].",
             f"__device__ const unsigned short rans_log2_frac[{len(frac)}] = {{"]
    lines += ["    " + ", ".join(str(v) for v in frac[i:i + 16]) + "," for i in range(0, len(frac), 16)]
    lines += ["};", ""]
    return "\n".join(lines)


def cuh_path() -> Path:
    return Path(str(files("kvzip.gpu").joinpath("kernels", "rans_rule.cuh")))


def choose_shift(hist: np.ndarray, E: int) -> int:
    """The grouping of the smallest estimate, the finest on ties."""
    D = hist.shape[0]
    costs = [_estimate_bits(hist, s, E) for s in range(D.bit_length())]
    return int(np.argmin(costs))


def tables_bytes(shift: int, tables: list) -> np.ndarray:
    """The tables stream (16.2): shift, (lo, hi) a group, then every group's frequencies as
    12-bit numbers, least significant bit first, the last byte's unused bits 0."""
    head = [shift] + [b for lo, hi, _ in tables for b in (lo, hi)]
    freqs = np.concatenate([f for _, _, f in tables]).astype(np.uint64)
    bits = ((freqs[:, None] >> np.arange(FREQ_BITS, dtype=np.uint64)) & 1).astype(np.uint8).reshape(-1)
    return np.concatenate((np.array(head, np.uint8), np.packbits(bits, bitorder="little")))


def parse_tables(buf: np.ndarray, channels: int, E: int):
    """(shift, freq int32[groups, 2**E + 1], cum int32[...], sym_of uint16[groups, TOTAL]) of a
    tables stream, after every check of 16.2 (FormatError otherwise).  Row g, column e < 2**E:
    exponent e's frequency (0 outside [lo, hi]); column 2**E: the escape's."""
    if buf.shape[0] < 1:
        raise FormatError("the tables stream is empty")
    shift = int(buf[0])
    if (1 << shift) > channels:
        raise FormatError(f"tables: a group of 2**{shift} channels in a tensor of {channels}")
    ng = channels >> shift
    if buf.shape[0] < 1 + 2 * ng:
        raise FormatError("tables: the stream is shorter than its (lo, hi) pairs")
    lo, hi = buf[1:1 + 2 * ng:2].astype(np.int64), buf[2:2 + 2 * ng:2].astype(np.int64)
    if (lo > hi).any() or (hi >= 1 << E).any():
        raise FormatError(f"tables: a range [lo, hi] is empty or reaches past 2**{E} exponents")
    width = hi - lo + 2
    nfreq = int(width.sum())
    if buf.shape[0] != 1 + 2 * ng + -(-FREQ_BITS * nfreq // 8):
        raise FormatError("tables: the stream's length disagrees with its ranges")
    bits = np.unpackbits(buf[1 + 2 * ng:], bitorder="little")
    if bits[FREQ_BITS * nfreq:].any():
        raise FormatError("tables: the unused bits of the last byte are not 0")
    flat = (bits[:FREQ_BITS * nfreq].reshape(-1, FREQ_BITS).astype(np.int64) << np.arange(FREQ_BITS)).sum(axis=1)
    ends = np.cumsum(width)
    if (np.add.reduceat(flat, ends - width) != TOTAL).any():
        raise FormatError(f"tables: a table's frequencies do not sum to {TOTAL}")
    esc = 1 << E
    freq = np.zeros((ng, esc + 1), np.int32)
    cols = np.concatenate([np.concatenate(([esc], np.arange(a, b + 1))) for a, b in zip(lo, hi)])
    freq[np.repeat(np.arange(ng), width), cols] = flat
    cum = np.zeros_like(freq)  # the slots of a table: the escape's first, then the exponents ascending
    order = np.concatenate(([esc], np.arange(esc)))
    cum[:, order] = (np.cumsum(freq[:, order], axis=1) - freq[:, order]).astype(np.int32)
    sym_of = np.repeat(np.tile(order.astype(np.uint16), ng), freq[:, order].reshape(-1)).reshape(ng, TOTAL)
    return shift, freq, cum, sym_of


@register
class ChannelRans(Stage):
    id = "channel_rans"
    input_kind = (TENSOR,)
    output_kind = CHANNEL_CODED
    consumes = ("data",)
    produces = ("rest", "states", "words", "word_count", "esc_count", "esc_exp", "tables")
    DEFAULT_CHUNK = 1 << 16  # 32 lane states cost 128 B a chunk (benchmarks/NOTES.md s1)

    def __init__(self, chunk: int = DEFAULT_CHUNK):
        self.chunk = check_chunk(chunk, MAX_CHUNK, MIN_CHUNK)

    def get_config(self):
        return {"id": self.id, "chunk": self.chunk}

    def encode(self, frame: Frame) -> Frame:
        fmt, backend, n, C = frame.format, frame.backend, frame.n, self.chunk
        data = frame.expect("data", fmt.uint_dtype, n)
        channels = channels_of(frame.meta["shape"])
        if on_device(backend):
            from kvzip.gpu import channel_rans as gpu

            return frame.replace(drop=("data",), **gpu.encode(data, n, fmt, channels, C))
        src = backend.to_numpy(data)
        hist = channel_rans_cpu.histogram(src, fmt, channels)
        shift = choose_shift(hist, fmt.exp_bits)
        tables = tables_bytes(shift, group_tables(hist, shift))
        _, freq, cum, _ = parse_tables(tables, channels, fmt.exp_bits)
        nchunks = -(-n // C)
        rest = np.empty(fmt.rest_bits * groups(n), np.uint8)
        states = np.empty(LANES * nchunks, np.uint32)
        word_count, esc_count = np.empty(nchunks, np.uint32), np.empty(nchunks, np.uint32)
        words, esc_exp = channel_rans_cpu.encode(src, n, fmt, channels, shift, freq, cum, C, rest, states, word_count,
                                                 esc_count)
        streams = dict(rest=rest, states=states, words=words, word_count=word_count, esc_count=esc_count,
                       esc_exp=esc_exp, tables=tables)
        if backend.name != "cpu":
            streams = {name: backend.from_numpy(a) for name, a in streams.items()}
        return frame.replace(drop=("data",), **streams)

    def check(self, frame: Frame) -> dict:
        """The streams, on the frame's backend, after checking their dtypes and the lengths n
        implies (the tables are checked by parse_tables, the per-chunk counts by the decode
        kernels)."""
        fmt, n = frame.format, frame.n
        nchunks = -(-n // self.chunk)
        # rest's length bounds n by the blob's size: checked before anything is sized by n.
        out = {"rest": frame.expect("rest", np.uint8, fmt.rest_bits * groups(n))}
        out["states"] = frame.expect("states", np.uint32, LANES * nchunks)
        for name in ("word_count", "esc_count"):
            out[name] = frame.expect(name, np.uint32, nchunks)
        frame.require("words", "esc_exp", "tables")
        for name, dtype in (("words", np.uint16), ("esc_exp", np.uint8), ("tables", np.uint8)):
            a = frame.streams[name]
            if a.ndim != 1 or a.dtype != dtype:
                raise FormatError(f"stream {name!r} must be 1-D {np.dtype(dtype)}, got {a.dtype} {tuple(a.shape)}")
            out[name] = a
        return out

    def decode(self, frame: Frame) -> Frame:
        fmt, backend, n = frame.format, frame.backend, frame.n
        s = self.check(frame)
        channels = channels_of(frame.meta["shape"])
        tables = backend.to_numpy(s["tables"])
        shift, freq, cum, sym_of = parse_tables(tables, channels, fmt.exp_bits)
        if on_device(backend):
            from kvzip.gpu import channel_rans as gpu

            dst, code = gpu.decode(s, n, fmt, channels, self.chunk, shift, tables, freq, cum)
        else:
            s = {name: backend.to_numpy(a) for name, a in s.items()}
            dst = np.empty(n, fmt.uint_dtype)
            code = channel_rans_cpu.decode(s["rest"], s["states"], s["words"], s["word_count"], s["esc_exp"],
                                           s["esc_count"], freq, cum, sym_of, channels, shift, n, fmt, self.chunk,
                                           dst)
            if backend.name != "cpu":
                dst = backend.from_numpy(dst)
        if code:
            raise FormatError(RANS_DECODE_ERRORS[code])
        return frame.replace(drop=self.produces, data=dst)
