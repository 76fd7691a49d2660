"""TCA-TBE, ZipServ's lossless BF16 weight format (tensor-core-aware triple bitmap encoding), a
clean-room implementation after Fan et al., "ZipServ: Fast and Memory-Efficient LLM Inference with
Hardware-Aware Lossless Compression", ASPLOS '26 (arXiv 2603.17435).

A weight whose exponent lies in a window of 7 consecutive exponents [base + 1, base + 7] keeps its
sign and mantissa (one byte) and a 3-bit code, exponent - base; any other weight (code 0) is stored
whole.  The codes of an 8x8 tile are three 64-bit bitmaps, one per code bit; 64 tiles make a 64x64
global tile whose bytes and fallback values are contiguous, so tiles decode independently.  The
byte layout is specified in docs/weights-format.md ("TCA-TBE"); this module is its reference:

    blob = encode(w)            # w: (M, K) uint16, the bits of BF16 weights
    w2 = decode(blob)           # (M, K) uint16, every bit equal
    bits_per_weight(blob)       # e.g. ~11.35 on MiniLM's weights
"""
from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np

from kvzip.checksum import sum64
from kvzip.errors import FormatError

MAGIC = b"KVZTBE\x00\n"
VERSION = 1
HEADER = struct.Struct("<8sHhIIBB2sQQQI12s")  # magic, version, base, rows, cols, row/col padding,
HEADER_BYTES = 64                             # reserved, stream bytes x2, payload sum64, CRC-32, reserved
CRC_AT = 48
assert HEADER.size == HEADER_BYTES

TILE = 64                          # a global tile is TILE x TILE weights ...
SMALL = 64                         # ... of 64 small 8x8 tiles, each 64 weights
WINDOW = 7                         # exponents coded 1..7; 0 is the fallback
BASES = range(-1, 256 - WINDOW)    # window [base + 1, base + 7] within the exponents 0..255
MAX_WEIGHTS = 1 << 31              # padded size limit: every offset then fits a uint32
SM_ALIGN, FB_ALIGN = 16, 8         # a global tile's run of sign-mantissa bytes / fallback values


@dataclass(frozen=True)
class Layout:
    """What a header says, and where the streams lie in the blob (offsets from its first byte)."""
    rows: int
    cols: int
    base: int
    sm_bytes: int
    fb_bytes: int
    checksum: int

    @property
    def tiles_m(self) -> int:
        return -(-self.rows // TILE)

    @property
    def tiles_k(self) -> int:
        return -(-self.cols // TILE)

    @property
    def tiles(self) -> int:
        return self.tiles_m * self.tiles_k

    @property
    def streams(self) -> dict:
        """{name: (offset, length)} in payload order, each stream 16-byte aligned."""
        g = self.tiles
        lengths = (("bitmap0", 8 * SMALL * g), ("bitmap1", 8 * SMALL * g), ("bitmap2", 8 * SMALL * g),
                   ("global_offsets", 8 * (g + 1)), ("median_offsets", 32 * g),
                   ("sign_mantissa", self.sm_bytes), ("fallback", self.fb_bytes))
        out, at = {}, HEADER_BYTES
        for name, n in lengths:
            out[name] = (at, n)
            at += _align16(n)
        return out

    @property
    def length(self) -> int:
        offset, n = self.streams["fallback"]
        return offset + _align16(n)

    @property
    def filler(self) -> int:
        """The value of every padding weight: code 1, sign and mantissa 0."""
        return (self.base + 1) << 7


def _align16(n: int) -> int:
    return (n + 15) & ~15


# ----------------------------------------------------------------------------- geometry
def _tile_order(padded: np.ndarray) -> np.ndarray:
    """(Mp, Kp) weights -> (G, 4096) in stream order.  Row 64gm + 16m + 8i + r, column
    64gk + 8k + c is element 8r + c of small tile 16m + 2k + i of global tile gm * tiles_k + gk:
    a global tile is four 16x64 median tiles from the top, and a median tile's 2x8 small tiles go
    column by column, the order of the A operand of mma.m16n8k16 (ZipServ's order)."""
    gm, gk = padded.shape[0] // TILE, padded.shape[1] // TILE
    return padded.reshape(gm, 4, 2, 8, gk, 8, 8).transpose(0, 4, 1, 5, 2, 3, 6).reshape(gm * gk, TILE * TILE)


def _matrix_order(tiles: np.ndarray, gm: int, gk: int) -> np.ndarray:
    """The inverse of _tile_order."""
    return tiles.reshape(gm, gk, 4, 8, 2, 8, 8).transpose(0, 2, 4, 5, 1, 3, 6).reshape(gm * TILE, gk * TILE)


def choose_base(exponent_counts: np.ndarray) -> int:
    """The base of the window of 7 consecutive exponents that holds the most weights, the lowest
    such window on a tie (a rule for writers only: it makes the encoding unique)."""
    c = np.concatenate(([0], np.cumsum(exponent_counts, dtype=np.int64)))
    return int(np.argmax(c[WINDOW:] - c[:-WINDOW])) - 1


def _spans(in_window: np.ndarray) -> tuple:
    """Per global tile: in-window count, and the lengths of its sign-mantissa and fallback runs."""
    n = np.count_nonzero(in_window, axis=1).astype(np.int64)
    return n, (n + SM_ALIGN - 1) & -SM_ALIGN, (TILE * TILE - n + FB_ALIGN - 1) & -FB_ALIGN


def _offsets(in_window: np.ndarray) -> tuple:
    """The global offsets ((G + 1, 2): each tile's first sign-mantissa byte and first fallback
    value, then the totals) and median offsets ((G, 4, 2): each median tile's, from its global
    tile's) that in_window ((G, 4096), stream order) implies."""
    _, sm_span, fb_span = _spans(in_window)
    glob = np.zeros((in_window.shape[0] + 1, 2), np.int64)
    glob[1:, 0], glob[1:, 1] = np.cumsum(sm_span), np.cumsum(fb_span)
    per_median = np.count_nonzero(in_window.reshape(-1, 4, 1024), axis=2)
    med = np.empty((in_window.shape[0], 4, 2), np.int64)
    med[:, :, 0] = np.cumsum(per_median, axis=1) - per_median
    med[:, :, 1] = np.arange(4) * 1024 - med[:, :, 0]
    return glob, med


def _padding_positions(n: np.ndarray, span: np.ndarray, start: np.ndarray) -> np.ndarray:
    """Positions in a stream of the zeros after each tile's n values (up to its span)."""
    pad = span - n
    first = np.repeat(start + n - (np.cumsum(pad) - pad), pad)
    return first + np.arange(first.shape[0])


# ----------------------------------------------------------------------------- encode
def _as_bits(w) -> np.ndarray:
    w = np.asarray(w)
    if w.ndim != 2 or w.dtype.name not in ("uint16", "bfloat16"):
        raise ValueError(f"TCA-TBE encodes a 2-D uint16 (BF16 bits) matrix, got {w.dtype} of shape {w.shape}")
    return np.ascontiguousarray(w).view(np.uint16)


def encode(w) -> bytes:
    """The TCA-TBE blob of an (M, K) matrix of BF16 bit patterns (uint16, or ml_dtypes bfloat16)."""
    w = _as_bits(w)
    rows, cols = w.shape
    lay = Layout(rows, cols, choose_base(np.bincount(((w >> 7) & 0xFF).ravel(), minlength=256)), 0, 0, 0)
    mp, kp = lay.tiles_m * TILE, lay.tiles_k * TILE
    if mp * kp > MAX_WEIGHTS:
        raise ValueError(f"TCA-TBE holds at most {MAX_WEIGHTS} weights after padding, got {mp} x {kp}")
    padded = np.full((mp, kp), lay.filler, np.uint16)
    padded[:rows, :cols] = w
    tiles = _tile_order(padded)

    low = ((tiles >> 7) & 0xFF) - np.uint16(lay.base + 1)       # wraps below the window: >= 7 too
    in_window = low < WINDOW
    code = np.where(in_window, low + 1, 0).astype(np.uint8)
    planes = [np.packbits((code >> b) & 1, axis=1, bitorder="little").view("<u8") for b in range(3)]

    n, sm_span, fb_span = _spans(in_window)
    glob, med = _offsets(in_window)
    sign_mantissa = (((tiles >> 8) & 0x80) | (tiles & 0x7F)).astype(np.uint8)[in_window]
    fallback = tiles[~in_window]
    # each tile's run closes with zeros up to its span: inserted where the next tile's run begins
    sign_mantissa = np.insert(sign_mantissa, np.repeat(np.cumsum(n), sm_span - n), np.uint8(0))
    fallback = np.insert(fallback, np.repeat(np.cumsum(TILE * TILE - n), fb_span - (TILE * TILE - n)), np.uint16(0))

    lay = Layout(rows, cols, lay.base, sign_mantissa.nbytes, fallback.nbytes, 0)
    blob = np.zeros(lay.length, np.uint8)
    data = {"bitmap0": planes[0], "bitmap1": planes[1], "bitmap2": planes[2],
            "global_offsets": glob.astype("<u4"), "median_offsets": med.astype("<u4"),
            "sign_mantissa": sign_mantissa, "fallback": fallback.astype("<u2")}
    for name, (offset, length) in lay.streams.items():
        blob[offset:offset + length] = np.ascontiguousarray(data[name]).reshape(-1).view(np.uint8)
    header = _pack_header(lay, sum64(np, blob[HEADER_BYTES:]))
    blob[:HEADER_BYTES] = np.frombuffer(header, np.uint8)
    return blob.tobytes()


def _pack_header(lay: Layout, checksum: int) -> bytes:
    fields = (MAGIC, VERSION, lay.base, lay.rows, lay.cols, lay.tiles_m * TILE - lay.rows,
              lay.tiles_k * TILE - lay.cols, bytes(2), lay.sm_bytes, lay.fb_bytes, checksum, 0, bytes(12))
    head = HEADER.pack(*fields)
    return HEADER.pack(*fields[:-2], zlib.crc32(head), bytes(12))


# ----------------------------------------------------------------------------- decode
def read_layout(header, length: int) -> Layout:
    """Check a blob's header (its first 64 bytes, or more) against the blob's length; its layout.
    Everything here is cheap, so a GPU decoder runs it on the host before it launches."""
    header = bytes(memoryview(header)[:HEADER_BYTES])
    if len(header) < HEADER_BYTES or length < HEADER_BYTES:
        raise FormatError(f"TCA-TBE blob truncated: {length} bytes, the header alone is {HEADER_BYTES}")
    magic, version, base, rows, cols, pad_r, pad_c, res1, sm_bytes, fb_bytes, checksum, crc, res2 = HEADER.unpack(header)
    if magic != MAGIC:
        raise FormatError("not a TCA-TBE blob (bad magic)")
    if version != VERSION:
        raise FormatError(f"TCA-TBE version {version} is not supported (only {VERSION})")
    if zlib.crc32(header[:CRC_AT] + bytes(4) + header[CRC_AT + 4:]) != crc:
        raise FormatError("TCA-TBE header CRC-32 mismatch: the header is corrupted")
    if any(res1) or any(res2):
        raise FormatError("TCA-TBE header: reserved bytes are not zero")
    lay = Layout(rows, cols, base, sm_bytes, fb_bytes, checksum)
    if base not in BASES:
        raise FormatError(f"TCA-TBE header: base exponent {base} outside [-1, {BASES[-1]}]")
    if (pad_r, pad_c) != (lay.tiles_m * TILE - rows, lay.tiles_k * TILE - cols):
        raise FormatError(f"TCA-TBE header: padding {pad_r}, {pad_c} does not round {rows} x {cols} up to {TILE}")
    if lay.tiles_m * lay.tiles_k * TILE * TILE > MAX_WEIGHTS:
        raise FormatError(f"TCA-TBE header: {rows} x {cols} is over the limit of {MAX_WEIGHTS} padded weights")
    if sm_bytes > lay.tiles * TILE * TILE or fb_bytes > lay.tiles * TILE * TILE * 2 or sm_bytes % SM_ALIGN \
            or fb_bytes % (2 * FB_ALIGN):
        raise FormatError(f"TCA-TBE header: stream lengths {sm_bytes}, {fb_bytes} impossible for {rows} x {cols}")
    if length != lay.length:
        raise FormatError(f"TCA-TBE blob is {length} bytes, its header describes {lay.length}"
                          + (" (truncated)" if length < lay.length else ""))
    return lay


def _parse(blob) -> tuple:
    """(layout, streams as arrays, codes (G, 4096) in stream order), every offset checked: after
    this, indexing the streams by the codes stays in range."""
    buf = np.frombuffer(blob, np.uint8)
    if buf.ctypes.data % 16:  # aligned word views
        buf = buf.copy()
    lay = read_layout(buf[:HEADER_BYTES], buf.shape[0])
    if sum64(np, buf[HEADER_BYTES:]) != lay.checksum:
        raise FormatError("TCA-TBE payload checksum mismatch: the blob is corrupted")
    if any(buf[o + n:_align16(o + n)].any() for o, n in lay.streams.values()):
        raise FormatError("TCA-TBE alignment bytes between streams are not zero")
    types = {"global_offsets": "<u4", "median_offsets": "<u4", "sign_mantissa": np.uint8, "fallback": "<u2"}
    s = {name: buf[o:o + n].view(types.get(name, "<u8")) for name, (o, n) in lay.streams.items()}
    bits = [np.unpackbits(s[f"bitmap{b}"].view(np.uint8).reshape(-1, 8), axis=1, bitorder="little") for b in range(3)]
    code = (bits[0] | (bits[1] << 1) | (bits[2] << 2)).reshape(lay.tiles, TILE * TILE)
    glob, med = _offsets(code != 0)
    stored_glob = s["global_offsets"].reshape(-1, 2)
    if not np.array_equal(stored_glob, glob):
        bad = int(np.flatnonzero((stored_glob != glob).any(axis=1))[0])
        raise FormatError(f"TCA-TBE global offsets of tile {bad} disagree with the bitmaps")
    if (glob[-1, 0], 2 * glob[-1, 1]) != (lay.sm_bytes, lay.fb_bytes):
        raise FormatError("TCA-TBE header stream lengths disagree with the bitmaps")
    if not np.array_equal(s["median_offsets"].reshape(-1, 4, 2), med):
        raise FormatError("TCA-TBE median offsets disagree with the bitmaps")
    return lay, s, code


def decode(blob) -> np.ndarray:
    """The (M, K) uint16 matrix of a TCA-TBE blob (any bytes-like).  A malformed, forged or
    corrupted blob raises FormatError."""
    return _decode(blob)[2]


def _decode(blob) -> tuple:
    """(layout, codes, matrix) of a blob, every rule of the format checked."""
    lay, s, code = _parse(blob)
    code = code.reshape(-1)
    in_window = code != 0
    n, sm_span, fb_span = _spans(in_window.reshape(lay.tiles, TILE * TILE))
    glob = s["global_offsets"].reshape(-1, 2).astype(np.int64)
    # Drop the runs' closing zeros; every stream element is >= 0, so their sum is 0 only if all are.
    sm_pad = _padding_positions(n, sm_span, glob[:-1, 0])
    fb_pad = _padding_positions(TILE * TILE - n, fb_span, glob[:-1, 1])
    if s["sign_mantissa"][sm_pad].any() or s["fallback"][fb_pad].any():
        raise FormatError("TCA-TBE stream padding is not zero")
    sign_mantissa = np.delete(s["sign_mantissa"], sm_pad).astype(np.uint16)

    tiles = np.empty(code.shape[0], np.uint16)
    exponent = (code[in_window] + np.uint16(lay.base & 0xFFFF)) & 0xFF   # base + code in [0, 255]
    tiles[in_window] = ((sign_mantissa & 0x80) << 8) | (exponent << 7) | (sign_mantissa & 0x7F)
    tiles[~in_window] = np.delete(s["fallback"], fb_pad)

    padded = _matrix_order(tiles, lay.tiles_m, lay.tiles_k)
    if (padded[lay.rows:] != lay.filler).any() or (padded[:lay.rows, lay.cols:] != lay.filler).any():
        raise FormatError("TCA-TBE padding weights are not the filler value")
    return lay, code, np.ascontiguousarray(padded[:lay.rows, :lay.cols])


# ----------------------------------------------------------------------------- reports
def info(blob) -> dict:
    """A checked blob's shape, window, coverage (the share of its weights inside the window) and
    bits per weight (the whole blob's bits over the matrix's weights)."""
    lay, code, _ = _decode(blob)
    weights = lay.rows * lay.cols
    in_window = int(np.count_nonzero(code)) - (lay.tiles * TILE * TILE - weights)  # less the filler
    return {"shape": (lay.rows, lay.cols), "base": lay.base, "window": (lay.base + 1, lay.base + WINDOW),
            "bytes": lay.length, "in_window": in_window, "fallback": weights - in_window,
            "coverage": in_window / weights if weights else None,
            "bits_per_weight": 8 * lay.length / weights if weights else None}


def bits_per_weight(blob) -> float:
    """Bits of the blob, header and all, per weight of the matrix (16 for raw BF16).  The header
    alone is read: the blob's length is checked against it, its contents are not."""
    buf = memoryview(blob).cast("B")
    lay = read_layout(buf[:HEADER_BYTES], buf.nbytes)
    if lay.rows * lay.cols == 0:
        raise ValueError("an empty matrix has no bits per weight")
    return 8 * lay.length / (lay.rows * lay.cols)
