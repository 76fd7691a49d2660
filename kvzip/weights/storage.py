"""The storage level: one tensor of model weights as a self-describing blob, for checkpoints on
disk, decoded once at load.  docs/weights-format.md ("Storage level and compressed
checkpoints") is the normative description.

A BF16 weight is a sign, an 8-bit exponent and 7 mantissa bits.  The exponent carries ~2.7 bits
of information in real weights, the other 8 bits look random.  So the blob keeps the sign and
mantissa as one raw byte a weight and codes the exponent with the tensor's own canonical
Huffman code of at most MAX_CODE_LENGTH bits, in chunks of CHUNK weights that decode on their
own (a table holds where each chunk's code ends), so decoders can run chunks in parallel.
FP32 is coded the same way (exponent coded; sign, mantissa: three raw bytes); FP16 codes its
top byte (sign, 5-bit exponent, 2 mantissa bits) and keeps the low byte raw.  Any other dtype,
and any tensor the code would not make smaller, is stored raw.

    offset       size   field
    0            8      magic b"KVZWT\\x00\\r\\n"
    8            1      version, 1
    9            1      dtype code (DTYPES)
    10           1      coding: 0 raw, 1 exponent code
    11           1      ndim, at most MAX_NDIM
    12           4      CRC-32 (zlib) of the header [0, H) with these 4 bytes zeroed
    16           8      sum64 (kvzip.checksum) of the tensor's bytes, zero-padded to a multiple of 8
    24           8*ndim shape (uint64 each); n = the product (1 for ndim 0)
    coding 1 only:
    +0           256    code length of each symbol (uint8, 0: absent)
    +256         8*k    end of each chunk's code in the code stream (uint64 bytes), k = ceil(n / CHUNK)
    H                   code stream: chunk c at [end[c-1], end[c]), zero bits to its byte's end,
                        the stream zero-padded to a multiple of 8 bytes
    H + S        n*r    raw plane, r bytes a value (coding 0: the tensor's bytes)

Little-endian throughout; codes are written least significant bit first (the first bit of a
code is the lowest bit not yet used), so a reader looks the next MAX_CODE_LENGTH bits up in a
table.  Every length, offset and count is checked before it is used; a blob that fails a check,
or whose decoded bytes do not give the stored sum64, raises FormatError.
"""
from __future__ import annotations

import heapq
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from .. import cpu_parallel
from ..checksum import GOLDEN, mix, sum64_finish, sum64_start
from ..errors import FormatError
from ..jit import cpu_jit

MAGIC = b"KVZWT\x00\r\n"
VERSION = 1
CHUNK = 1 << 14            # values a chunk: independently decodable units
MAX_CODE_LENGTH = 12       # a decode table of 4096 entries (8 KiB) fits L1 and a GPU's shared memory
MAX_NDIM = 64
MAX_VALUES = 1 << 62       # so that a reader's 64-bit arithmetic on counts and offsets cannot wrap
RAW, EXPONENT_CODE = 0, 1
CODINGS = {RAW: "raw", EXPONENT_CODE: "exponent-huffman"}

# DTYPES[code]: the dtype of a blob's dtype code, by its safetensors name.
DTYPES = ("BOOL", "U8", "I8", "F8_E4M3", "F8_E5M2", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
          "I64", "U64", "F64")
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# The dtypes with an exponent code -> the lowest bit of the 8 coded ones in a value: the exponent
# of BF16 and FP32, the top byte of FP16 (sign, exponent, two mantissa bits).
CODED = {"BF16": 7, "F32": 23, "F16": 8}
_WORDS = {2: np.uint16, 4: np.uint32}

_FIXED = struct.Struct("<8sBBBBIQ")  # magic, version, dtype, coding, ndim, CRC, sum64
_CRC_AT = 12
SYMBOLS = 256


@dataclass(frozen=True)
class Plan:
    """What encode writes for one tensor, known before it writes: the header and every size."""
    dtype: str
    shape: tuple
    coding: int
    lengths: np.ndarray | None     # uint8[256], coding 1
    chunk_ends: np.ndarray | None  # uint64[k], coding 1
    nbytes: int                    # the blob's length


@dataclass(frozen=True)
class Header:
    """A blob's header, checked."""
    dtype: str
    shape: tuple
    coding: int
    checksum: int
    lengths: np.ndarray | None
    chunk_ends: np.ndarray | None
    header_len: int
    stream_len: int
    nbytes: int

    @property
    def raw_bytes(self) -> int:
        return _count(self.shape) * ITEMSIZE[self.dtype]


def _count(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _align8(x: int) -> int:
    return -(-x // 8) * 8


def _header_len(ndim: int, coding: int, n: int) -> int:
    return 24 + 8 * ndim + (SYMBOLS + 8 * -(-n // CHUNK) if coding == EXPONENT_CODE else 0)


# ---- the code ---------------------------------------------------------------------------------

def code_lengths(counts: np.ndarray, limit: int = MAX_CODE_LENGTH) -> np.ndarray:
    """Code lengths (uint8[256]) of a prefix code of least total length for these symbol counts,
    none longer than limit (package-merge).  The code is complete (Kraft sum exactly 1); a lone
    symbol gets a partner of count 0, so that it too has a complete code (1 bit each)."""
    symbols = [int(s) for s in np.flatnonzero(counts)]
    if len(symbols) == 1:
        symbols.append(symbols[0] ^ 1)
    lengths = np.zeros(SYMBOLS, np.uint8)
    if not symbols:
        return lengths
    # An item is (weight, 0, symbol) for a leaf, (weight, 1, -1) for a pair: sorted tuples put
    # leaves before pairs of the same weight.  Level 0 is the leaves; level l merges the leaves
    # with the pairs of consecutive items of level l-1 (both lists already sorted).
    leaves = sorted((int(counts[s]), 0, s) for s in symbols)
    levels = [leaves]
    for _ in range(limit - 1):
        below = levels[-1]
        pairs = [(below[i][0] + below[i + 1][0], 1, -1) for i in range(0, len(below) - 1, 2)]
        levels.append(list(heapq.merge(leaves, pairs)))
    # The 2m-2 lightest items of the top level; a pair among the first p of its level stands for
    # the first 2p items of the level below.  A symbol's length is how many levels pick it.
    take = 2 * len(leaves) - 2
    for level in reversed(levels):
        picked = level[:take]
        for _, _, s in picked:
            if s >= 0:
                lengths[s] += 1
        take = 2 * sum(1 for _, _, s in picked if s < 0)
    return lengths


def _canonical_order(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The present symbols in canonical order (shorter codes first, equal lengths by symbol) and
    the share of the code space each takes, in units of 2**-MAX_CODE_LENGTH."""
    present = np.flatnonzero(lengths)
    order = present[np.argsort(lengths[present], kind="stable")]
    return order, 1 << (MAX_CODE_LENGTH - lengths[order].astype(np.int64))


def _reversed_bits(width: int) -> np.ndarray:
    """r[v]: the width bits of v in reverse order, for every v < 2**width."""
    v = np.arange(1 << width)
    return sum(((v >> b) & 1) << (width - 1 - b) for b in range(width))


_BIT_REVERSED = _reversed_bits(MAX_CODE_LENGTH)


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Each symbol's code (int64[256]) as the writer emits it: the canonical code with its bits
    reversed, first bit lowest.  A canonical code, read first bit first and padded with zeros
    to MAX_CODE_LENGTH bits, is where its symbol's share of the code space starts."""
    order, span = _canonical_order(lengths)
    codes = np.zeros(SYMBOLS, np.int64)
    codes[order] = _BIT_REVERSED[np.cumsum(span) - span]
    return codes


def decode_table(lengths: np.ndarray) -> np.ndarray:
    """uint16[2**MAX_CODE_LENGTH] for a complete code: for the next MAX_CODE_LENGTH bits of the
    stream (first bit lowest), the symbol (low byte) and the length (high byte) of the code they
    start with.  In first-bit-highest order the entries are the symbols' shares in canonical
    order; reversing the index bits gives the stream's order."""
    if not _complete(lengths):
        raise ValueError("decode_table needs a complete code")
    order, span = _canonical_order(lengths)
    entries = (order | lengths[order].astype(np.int64) << 8).astype(np.uint16)
    return np.repeat(entries, span)[_BIT_REVERSED]


def _complete(lengths: np.ndarray) -> bool:
    """Whether lengths (none over MAX_CODE_LENGTH) are those of a complete prefix code: their
    shares of the code space add up to all of it."""
    return int(_canonical_order(lengths)[1].sum()) == 1 << MAX_CODE_LENGTH


# ---- kernels: a range of chunks each, c0 <= c < c1 --------------------------------------------
# They read or write the values as words (uint16 / uint32 for 2 / 4 bytes).  A value's symbol is
# its 8 bits from bit `shift` up; its raw value the bits below them and, shifted down by 8, the
# bits above them: r = itemsize - 1 bytes, little-endian, in the raw plane.

@cpu_jit(nogil=True)
def _count_chunks(values, shift, n, counts, c0, c1):
    for c in range(c0, c1):
        row = counts[c]
        for i in range(c * CHUNK, min(n, (c + 1) * CHUNK)):
            row[(np.int64(values[i]) >> shift) & 0xFF] += 1


@cpu_jit(nogil=True)
def _encode_chunks(values, r, shift, n, codes, lengths, chunk_ends, stream, raw, c0, c1):
    """Writes chunks c0..c1-1 of the code stream and the raw plane; returns 0, or c + 1 when chunk
    c does not fill exactly its planned bytes (the data changed since it was planned)."""
    below = (1 << shift) - 1
    for c in range(c0, c1):
        j = chunk_ends[c - 1] if c > 0 else 0
        end = chunk_ends[c]
        acc = 0    # bits not yet written, first bit lowest; never more than 7 + MAX_CODE_LENGTH
        held = 0
        for i in range(c * CHUNK, min(n, (c + 1) * CHUNK)):
            v = np.int64(values[i])
            sym = (v >> shift) & 0xFF
            rest = (v & below) | ((v >> (shift + 8)) << shift)
            for b in range(r):
                raw[i * r + b] = (rest >> (8 * b)) & 0xFF
            acc |= codes[sym] << held
            held += lengths[sym]
            while held >= 8:
                if j >= end:
                    return c + 1
                stream[j] = acc & 0xFF
                acc >>= 8
                held -= 8
                j += 1
        if held:
            if j >= end:
                return c + 1
            stream[j] = acc
            j += 1
        if j != end:
            return c + 1
    return 0


@cpu_jit(nogil=True)
def _decode_chunks(stream, chunk_ends, table, raw, r, shift, n, values, c0, c1):
    """Decodes chunks c0..c1-1 into values; returns 0, or c + 1 when chunk c's code does not end
    exactly at its recorded end with zero padding bits.  Reads only the chunk's own bytes (past
    them it reads zeros), so a forged chunk cannot read out of bounds."""
    mask = (1 << MAX_CODE_LENGTH) - 1
    below = (1 << shift) - 1
    for c in range(c0, c1):
        start = chunk_ends[c - 1] if c > 0 else 0
        end = chunk_ends[c]
        j = start  # the next byte to load (past end: zeros)
        acc = 0    # loaded bits not yet used, next bit lowest; at most 56, so int64 holds them
        held = 0
        for i in range(c * CHUNK, min(n, (c + 1) * CHUNK)):
            if held < MAX_CODE_LENGTH:
                while held <= 48:
                    if j < end:
                        acc |= np.int64(stream[j]) << held
                    j += 1
                    held += 8
            entry = table[acc & mask]
            length = entry >> 8
            acc >>= length
            held -= length
            rest = 0
            for b in range(r):
                rest |= np.int64(raw[i * r + b]) << (8 * b)
            values[i] = (rest & below) | (np.int64(entry & 0xFF) << shift) | ((rest >> shift) << (shift + 8))
        used = (j - start) * 8 - held
        pad = (end - start) * 8 - used
        if pad < 0 or pad > 7 or acc & ((1 << pad) - 1):
            return c + 1
    return 0


def _chunk_ranges(k: int, itemsize: int):
    return cpu_parallel.split(k, CHUNK * itemsize)


def _words(data: np.ndarray, itemsize: int) -> np.ndarray:
    """The values of a coded dtype's bytes as words, copied first if they are not word-aligned
    (a tensor in a .safetensors file need not be)."""
    if data.ctypes.data % itemsize:
        data = data.copy()
    return data.view(_WORDS[itemsize])


# ---- encode -----------------------------------------------------------------------------------

def _checked_input(dtype: str, shape, data) -> tuple[tuple, np.ndarray]:
    if dtype not in ITEMSIZE:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    shape = tuple(int(d) for d in shape)
    if len(shape) > MAX_NDIM or any(d < 0 for d in shape) or _count(shape) > MAX_VALUES:
        raise ValueError(f"bad shape {list(shape)} (at most {MAX_NDIM} dimensions, none negative, 2**62 values)")
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.ndim != 1:
        raise TypeError(f"data must be the tensor's bytes as a 1-D uint8 array, got {data.dtype} {data.shape}")
    if data.nbytes != _count(shape) * ITEMSIZE[dtype]:
        raise ValueError(f"{data.nbytes} bytes do not hold a {dtype} tensor of shape {list(shape)}")
    return shape, np.ascontiguousarray(data)


def plan(dtype: str, shape, data: np.ndarray) -> Plan:
    """What encode will write for the tensor of this dtype and shape whose little-endian bytes
    are data (1-D uint8): the coding, the code and every chunk's size.  One pass over data."""
    shape, data = _checked_input(dtype, shape, data)
    n, itemsize = _count(shape), ITEMSIZE[dtype]
    raw = Plan(dtype, shape, RAW, None, None, _header_len(len(shape), RAW, n) + n * itemsize)
    if dtype not in CODED or n == 0:
        return raw
    k = -(-n // CHUNK)
    counts = np.zeros((k, SYMBOLS), np.uint16)  # a chunk holds at most 2**14 values
    values = _words(data, itemsize)
    cpu_parallel.run_ranges(lambda c0, c1: _count_chunks(values, CODED[dtype], n, counts, c0, c1),
                            _chunk_ranges(k, itemsize))
    lengths = code_lengths(counts.sum(axis=0, dtype=np.int64))
    chunk_bits = counts.astype(np.int64) @ lengths.astype(np.int64)
    chunk_ends = np.cumsum(-(-chunk_bits // 8)).astype(np.uint64)
    nbytes = _header_len(len(shape), EXPONENT_CODE, n) + _align8(int(chunk_ends[-1])) + n * (itemsize - 1)
    if nbytes >= raw.nbytes:
        return raw
    return Plan(dtype, shape, EXPONENT_CODE, lengths, chunk_ends, nbytes)


def encode(p: Plan, data: np.ndarray) -> np.ndarray:
    """The blob (uint8[p.nbytes]) of the tensor p was planned from."""
    shape, data = _checked_input(p.dtype, p.shape, data)
    if data.ctypes.data % 8:  # one copy, aligned for the word and checksum kernels
        data = data.copy()
    n, itemsize = _count(shape), ITEMSIZE[p.dtype]
    blob = np.empty(p.nbytes, np.uint8)
    head_len = _header_len(len(shape), p.coding, n)
    if p.coding == RAW:
        blob[head_len:] = data
    else:
        k = p.chunk_ends.shape[0]
        code_end = int(p.chunk_ends[-1])
        stream_end = head_len + _align8(code_end)
        stream, raw = blob[head_len:stream_end], blob[stream_end:]
        stream[code_end:] = 0
        codes, lengths, ends = canonical_codes(p.lengths), p.lengths.astype(np.int64), p.chunk_ends.astype(np.int64)
        values = _words(data, itemsize)
        bad = cpu_parallel.run_ranges(
            lambda c0, c1: _encode_chunks(values, itemsize - 1, CODED[p.dtype], n, codes, lengths, ends, stream, raw, c0,
                                          c1), _chunk_ranges(k, itemsize))
        if any(bad):
            raise RuntimeError("the tensor changed between plan() and encode()")
        at = 24 + 8 * len(shape)
        blob[at:at + SYMBOLS] = p.lengths
        blob[at + SYMBOLS:head_len] = p.chunk_ends.astype("<u8").view(np.uint8)
    _FIXED.pack_into(blob, 0, MAGIC, VERSION, DTYPES.index(p.dtype), p.coding, len(shape), 0, _checksum(data))
    blob[24:24 + 8 * len(shape)] = np.asarray(shape, "<u8").view(np.uint8)
    crc = zlib.crc32(blob[:head_len])
    blob[_CRC_AT:_CRC_AT + 4] = np.frombuffer(struct.pack("<I", crc), np.uint8)
    return blob


def compress(dtype: str, shape, data: np.ndarray) -> np.ndarray:
    """encode(plan(dtype, shape, data), data)."""
    return encode(plan(dtype, shape, data), data)


def _checksum(data: np.ndarray) -> int:
    """sum64 of data zero-padded to a multiple of 8 bytes."""
    whole = data.nbytes // 8 * 8
    body = data[:whole]
    if body.ctypes.data % 8:  # the word kernel reads aligned uint64
        body = body.copy()
    total = sum64_start(np, body)
    if whole < data.nbytes:
        last = np.zeros(8, np.uint8)
        last[:data.nbytes - whole] = data[whole:]
        with np.errstate(over="ignore"):
            word = last.view(np.uint64) + np.uint64(whole // 8) * GOLDEN
            total = (total + int(mix(np, word)[0])) % (1 << 64)
    return sum64_finish(total, _align8(data.nbytes))


# ---- decode -----------------------------------------------------------------------------------

def read_header(blob: np.ndarray) -> Header:
    """The checked header of a blob (1-D uint8); FormatError if any field is out of bounds,
    inconsistent with the blob's length or the CRC."""
    blob = np.asarray(blob)
    if blob.dtype != np.uint8 or blob.ndim != 1:
        raise TypeError(f"a blob is a 1-D uint8 array, got {blob.dtype} {blob.shape}")
    size = blob.shape[0]
    if size < 24:
        raise FormatError(f"a weights blob has at least 24 bytes, this one {size}")
    magic, version, dtype_code, coding, ndim, crc, checksum = _FIXED.unpack_from(bytes(blob[:24]))
    if magic != MAGIC:
        raise FormatError("not a kvzip weights blob (bad magic)")
    if version != VERSION:
        raise FormatError(f"unsupported weights blob version {version} (this kvzip reads version {VERSION})")
    if dtype_code >= len(DTYPES) or coding not in CODINGS or ndim > MAX_NDIM:
        raise FormatError(f"bad dtype code {dtype_code}, coding {coding} or ndim {ndim}")
    dtype = DTYPES[dtype_code]
    if coding == EXPONENT_CODE and dtype not in CODED:
        raise FormatError(f"{dtype} has no exponent code")
    if size < 24 + 8 * ndim:
        raise FormatError("weights blob truncated in its shape")
    shape = tuple(int(d) for d in blob[24:24 + 8 * ndim].view("<u8"))
    n, itemsize = _count(shape), ITEMSIZE[dtype]
    if n > MAX_VALUES:
        raise FormatError(f"shape {list(shape)} has more than 2**62 values")
    if coding == EXPONENT_CODE and n == 0:
        raise FormatError("an empty tensor is stored raw, never coded")
    head_len = _header_len(ndim, coding, n)
    if head_len > size:
        raise FormatError(f"weights blob of {size} bytes too short for its {head_len}-byte header (shape {list(shape)})")
    head = bytearray(blob[:head_len])
    head[_CRC_AT:_CRC_AT + 4] = bytes(4)
    if zlib.crc32(head) != crc:
        raise FormatError("weights blob header CRC mismatch (corrupted header)")
    lengths = chunk_ends = None
    stream_len = 0
    raw_len = n * itemsize
    if coding == EXPONENT_CODE:
        at = 24 + 8 * ndim
        lengths = np.array(blob[at:at + SYMBOLS])
        chunk_ends = np.array(blob[at + SYMBOLS:head_len]).view("<u8").astype(np.uint64)
        if int(lengths.max()) > MAX_CODE_LENGTH or not _complete(lengths):
            raise FormatError("the code lengths are not those of a complete prefix code")
        _check_chunk_ends(chunk_ends, n)
        stream_len = _align8(int(chunk_ends[-1]))
        raw_len = n * (itemsize - 1)
    if head_len + stream_len + raw_len != size:
        raise FormatError(f"weights blob is {size} bytes, its header says {head_len + stream_len + raw_len}")
    return Header(dtype, shape, coding, checksum, lengths, chunk_ends, head_len, stream_len, size)


def _check_chunk_ends(chunk_ends: np.ndarray, n: int) -> None:
    """Each chunk's code is at least a bit and at most MAX_CODE_LENGTH bits a value long."""
    counts = np.full(chunk_ends.shape[0], CHUNK, np.int64)
    counts[-1] = n - CHUNK * (counts.shape[0] - 1)
    if int(chunk_ends[-1]) > n * MAX_CODE_LENGTH:  # also keeps the int64 arithmetic below exact
        raise FormatError("the code stream is longer than any chunk table allows")
    sizes = np.diff(chunk_ends.astype(np.int64), prepend=0)
    if np.any(sizes < -(-counts // 8)) or np.any(sizes > -(-counts * MAX_CODE_LENGTH // 8)):
        raise FormatError("a chunk's recorded code length is impossible for its number of values")


def decompress(blob: np.ndarray) -> tuple[str, tuple, np.ndarray]:
    """(dtype, shape, the tensor's bytes as a new 1-D uint8 array) of a blob; FormatError if it
    is malformed or corrupted."""
    h = read_header(blob)
    blob = np.asarray(blob)
    n, itemsize = _count(h.shape), ITEMSIZE[h.dtype]
    padded = np.empty(_align8(n * itemsize), np.uint8)  # 8-aligned, for the checksum's words
    padded[n * itemsize:] = 0
    out = padded[:n * itemsize]
    body = blob[h.header_len:]
    if h.coding == RAW:
        out[:] = body
    else:
        stream = np.ascontiguousarray(body[:h.stream_len])
        if np.any(stream[int(h.chunk_ends[-1]):]):
            raise FormatError("the code stream's padding is not zero")
        raw = np.ascontiguousarray(body[h.stream_len:])
        table = decode_table(h.lengths)
        ends = h.chunk_ends.astype(np.int64)
        values = out.view(_WORDS[itemsize])
        bad = cpu_parallel.run_ranges(
            lambda c0, c1: _decode_chunks(stream, ends, table, raw, itemsize - 1, CODED[h.dtype], n, values, c0, c1),
            _chunk_ranges(ends.shape[0], itemsize))
        bad = [b for b in bad if b]
        if bad:
            raise FormatError(f"chunk {bad[0] - 1}'s code does not end where the chunk table says (corrupted)")
    if sum64_finish(sum64_start(np, padded), padded.nbytes) != h.checksum:
        raise FormatError("weights blob checksum mismatch: the decoded tensor is not the one stored (corrupted)")
    return h.dtype, h.shape, out
