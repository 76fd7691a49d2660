"""The container blob's bytes, defined once (docs/format.md section 2 is their normative text).

Every reader and writer of the layout takes it from here: kvzip/container.py (the reference
writer and reader), stages/fused.py's encode_blob, kvzip/gpu/programs.py (header templates, the
host's payload arithmetic), kvzip/gpu/layout_cache.py (headers of remembered layouts), and the
CUDA kernels through kvzip/gpu/kernels/layout.cuh, which is generated from this module
(``python -m kvzip.gpu.headers --write``; tests/test_layout.py fails when the committed file differs).

    offset  size  field
    0       8     magic b"KVZIP\\x00\\r\\n"
    8       2     version (uint16)
    10      2     flags (uint16)
    12      4     header_len H (uint32): multiple of ALIGN, the payload starts there
    16      8     payload_len P (uint64): multiple of ALIGN; the blob is H + P bytes
    24      8     checksum (uint64): sum64 of the payload, 0 without FLAG_CHECKSUM
    32      4     meta_len J (uint32)
    36      4     stream_count S (uint32)
    40      4     header_crc (uint32): CRC-32 of [0, H) with these 4 bytes zeroed
    44      4     reserved, 0
    48      16*S  stream table: per stream (offset from the payload's start, length), uint64 each
    48+16S  J     metadata JSON, then zero padding up to H
    H       P     the streams in table order, each ALIGN-aligned, zero padding between

All integers little-endian.  That is version 1; the compact version-2 header (COMPACT_FIELDS
below, docs/format.md section 13) keeps magic, version, flags, header length, checksum and CRC
at these offsets.
"""
from __future__ import annotations

import struct
import zlib

# ----------------------------------------------------------------------------- the prefix
MAGIC = b"KVZIP\x00\r\n"
VERSION = 1
FLAG_CHECKSUM = 1   # the checksum field holds sum64 of the payload
FLAG_STORED = 2     # the values were stored raw (size fallback)
KNOWN_FLAGS = FLAG_CHECKSUM | FLAG_STORED
MAX_HEADER = 1 << 20
MAX_STREAMS = 64
ALIGN = 16          # header length, payload length and every stream offset are multiples of it


class Field:
    """A prefix field: name, byte offset, size, struct code, and its bytes as a slice."""

    __slots__ = ("name", "offset", "size", "code", "end", "span")

    def __init__(self, name: str, offset: int, size: int, code: str):
        self.name, self.offset, self.size, self.code = name, offset, size, code
        self.end = offset + size
        self.span = slice(offset, self.end)

    def read(self, buf) -> int:
        """The field's unsigned value in buf (bytes-like, at least end bytes)."""
        return int.from_bytes(buf[self.offset:self.end], "little")

    def __repr__(self) -> str:
        return f"Field({self.name!r}, {self.offset}, {self.size}, {self.code!r})"


def consecutive_fields(spec) -> tuple:
    """Fields (name, size, struct code) laid back to back from offset 0."""
    out, at = [], 0
    for name, size, code in spec:
        out.append(Field(name, at, size, code))
        at += size
    return tuple(out)


PREFIX_FIELDS = consecutive_fields((
    ("magic", 8, "8s"),
    ("version", 2, "H"),
    ("flags", 2, "H"),
    ("header_len", 4, "I"),
    ("payload_len", 8, "Q"),
    ("checksum", 8, "Q"),
    ("meta_len", 4, "I"),
    ("stream_count", 4, "I"),
    ("header_crc", 4, "I"),
    ("reserved", 4, "4x"),
))
FIELD = {f.name: f for f in PREFIX_FIELDS}
PREFIX = struct.Struct("<" + "".join(f.code for f in PREFIX_FIELDS))  # "<8sHHIQQIII4x", 48 bytes
PREFIX_SIZE = PREFIX.size
# PREFIX.unpack's values, in order (the reserved bytes give none).
PREFIX_VALUES = tuple(f.name for f in PREFIX_FIELDS if not f.code.endswith("x"))

HEADER_LEN = FIELD["header_len"]
PAYLOAD_LEN = FIELD["payload_len"]
STREAM_COUNT = FIELD["stream_count"]
HEADER_CRC = FIELD["header_crc"]
_CRC_ZERO = bytes(HEADER_CRC.size)

# ----------------------------------------------------------------------------- the stream table
TABLE_AT = PREFIX_SIZE       # the stream table follows the prefix
ENTRY = struct.Struct("<QQ")  # a stream's (offset from the payload's start, length in bytes)
ENTRY_SIZE = ENTRY.size

# Payload order: streams whose size is known before encoding come first, so a GPU encoder can
# write them straight into the blob before it knows how many escapes there are.
STREAM_ORDER = ("data", "scales", "codes", "rest", "esc_count", "esc_pos", "esc_exp", "exp_high")
# The fused split/pack/escape streams (name, dtype), in payload order, and the three whose sizes
# follow the escape count: they close the payload, in this order.
FUSED_STREAMS = (("codes", "uint8"), ("rest", "uint8"), ("esc_count", "uint16"),
                 ("esc_pos", "uint16"), ("esc_exp", "uint8"), ("exp_high", "uint8"))
ESCAPE_STREAMS = ("esc_pos", "esc_exp", "exp_high")
ESC_POS_BYTES = 2   # esc_pos: a uint16 position an escape; esc_exp a byte an escape
ESCAPES = struct.Struct("<6Q")  # the escape streams' three table entries, back to back
ESCAPE_SLACK = len(ESCAPE_STREAMS) * ALIGN  # more than their padding can take in all
PLANE = 0xFFFF      # esc_count of a plane-coded chunk

assert STREAM_ORDER[-len(ESCAPE_STREAMS):] == ESCAPE_STREAMS
assert tuple(name for name, _ in FUSED_STREAMS) == STREAM_ORDER[2:]
assert ESCAPES.size == len(ESCAPE_STREAMS) * ENTRY_SIZE


def canonical_order(names) -> list[str]:
    """Streams in payload order: STREAM_ORDER first, any others after them by name."""
    rank = {name: i for i, name in enumerate(STREAM_ORDER)}
    return sorted(names, key=lambda k: (rank.get(k, len(rank)), k))


def align(x: int) -> int:
    """x rounded up to a multiple of ALIGN."""
    return (x + ALIGN - 1) // ALIGN * ALIGN


def entry_at(k: int) -> int:
    """Header offset of stream k's table entry."""
    return TABLE_AT + ENTRY_SIZE * k


def escapes_at(stream_count: int) -> int:
    """Header offset of the escape streams' entries (the last three of stream_count)."""
    return TABLE_AT + ENTRY_SIZE * (stream_count - len(ESCAPE_STREAMS))


def place(stream_nbytes) -> tuple[list[int], int]:
    """Payload offsets of streams of these byte lengths in table order, and the payload length."""
    offsets, pos = [], 0
    for nb in stream_nbytes:
        offsets.append(pos)
        pos = align(pos + nb)
    return offsets, pos


_UP = ALIGN - 1
assert not ALIGN & _UP  # a power of two: the escape arithmetic rounds with a mask


def escape_layout(var_base: int, escapes: int, high_bytes: int) -> tuple[int, int, int, int]:
    """place()'s offsets of esc_pos, esc_exp and exp_high, and the payload length, for escape
    streams that start at payload offset var_base (ALIGN-aligned: every stream before them has
    a size fixed by the shape) and close the payload: esc_pos ESC_POS_BYTES an escape, esc_exp
    one, exp_high high_bytes.  (kernels/header.cuh's finish_blob does the same arithmetic.)"""
    exp_at = (var_base + ESC_POS_BYTES * escapes + _UP) & ~_UP
    high_at = (exp_at + escapes + _UP) & ~_UP
    return var_base, exp_at, high_at, (high_at + high_bytes + _UP) & ~_UP


def escape_entries(var_base: int, escapes: int, high_bytes: int) -> tuple[tuple, int]:
    """The escape streams' (offset, bytes) of esc_pos, esc_exp and exp_high as escape_layout
    places them (a version-1 header's last three table entries), and the payload length."""
    pos_at, exp_at, high_at, payload_len = escape_layout(var_base, escapes, high_bytes)
    return (pos_at, ESC_POS_BYTES * escapes, exp_at, escapes, high_at, high_bytes), payload_len


def escape_payload_len(var_base: int, escapes: int, high_bytes: int) -> int:
    """escape_layout's payload length alone (the encoders size every blob by it)."""
    return escape_layout(var_base, escapes, high_bytes)[3]


def escapes_laid_out(payload_len: int, escapes: tuple) -> bool:
    """Whether the escape streams' entries (offset, bytes of esc_pos, esc_exp, exp_high) are as
    escape_layout places them (esc_pos ESC_POS_BYTES an escape) and close a payload of
    payload_len bytes.  (kernels/header.cuh's head_facts checks the same on the GPU.)"""
    pos_at, _, _, exp_nb, _, high_nb = escapes
    return escape_entries(pos_at, exp_nb, high_nb) == (tuple(escapes), payload_len)


# ----------------------------------------------------------------------------- header checks
def crc_blanked(header: bytearray) -> tuple[int, int]:
    """(stored CRC, CRC of the header with the field zeroed), zeroing the field in header."""
    stored = HEADER_CRC.read(header)
    header[HEADER_CRC.span] = _CRC_ZERO
    return stored, zlib.crc32(header)


def seal(header: bytearray) -> None:
    """Write the header's CRC (its field zero on entry)."""
    _U32.pack_into(header, HEADER_CRC.offset, zlib.crc32(header))


_U32 = struct.Struct("<I")


def payload_fits(header_len: int, payload_len: int, blob_len: int) -> bool:
    """The payload length is an ALIGN multiple and the payload ends at the blob's end."""
    return not payload_len % ALIGN and header_len + payload_len == blob_len


def header_fits(header_len: int, blob_len: int) -> bool:
    """The header length's own constraints: an ALIGN multiple in [PREFIX_SIZE, MAX_HEADER], not
    past the blob's end."""
    return not header_len % ALIGN and PREFIX_SIZE <= header_len <= MAX_HEADER and header_len <= blob_len


def table_fits(stream_count: int, meta_len: int, header_len: int) -> bool:
    """The stream table and the metadata fit the header."""
    return stream_count <= MAX_STREAMS and TABLE_AT + ENTRY_SIZE * stream_count + meta_len <= header_len


def escape_entries_at(stream_count: int, header_len: int) -> int | None:
    """escapes_at(stream_count) when a header of header_len bytes holds the escape streams'
    entries there (so the table has them: stream_count >= 3), else None."""
    at = escapes_at(stream_count)
    return at if stream_count >= len(ESCAPE_STREAMS) and at + ESCAPES.size <= header_len else None


# The header fields that follow the escape count, which a remembered layout's header has blanked
# (kvzip/gpu/layout_cache.py; guess_head in kernels/header.cuh): these two prefix fields and the
# escape streams' ESCAPES.size bytes of entries at escapes_at(stream_count).
VARYING = (PAYLOAD_LEN, HEADER_CRC)


# ----------------------------------------------------------------------------- version 2: the compact header
# A 64-byte header of fixed binary fields for the blobs of the preset pipelines (docs/format.md
# section 13): no stream table and no JSON; a reader derives both from these fields.  It keeps
# magic, version, flags, header length, checksum and CRC at their version-1 offsets, so a
# reader finds the payload (and checks the CRC) before it looks at the version.
COMPACT_VERSION = 2
# The first 47 bytes, which the ratio mode's version-3 header shares (RATIO_FIELDS below).
_COMPACT_COMMON = (
    ("magic", 8, "8s"),
    ("version", 2, "H"),
    ("flags", 2, "H"),
    ("header_len", 4, "I"),      # COMPACT_SIZE
    ("shape", 8, "8s"),          # the sides as unsigned LEB128, then zero bytes
    ("checksum", 8, "Q"),
    ("escapes", 4, "I"),         # E: esc_pos holds 2E bytes, esc_exp E
    ("high_bytes", 4, "I"),      # exp_high's bytes
    ("header_crc", 4, "I"),
    ("dtype", 1, "B"),           # DTYPE_CODES
    ("chunk_log2", 1, "B"),      # 0 when stored raw
    ("ndim", 1, "B"),
)
COMPACT_FIELDS = consecutive_fields(_COMPACT_COMMON + (
    ("codebook_source", 1, "B"),  # CODEBOOK_SOURCES
    ("codebook", 16, "16s"),     # code c <-> exponent byte c; zero when stored raw
))
COMPACT_FIELD = {f.name: f for f in COMPACT_FIELDS}
COMPACT = struct.Struct("<" + "".join(f.code for f in COMPACT_FIELDS))
COMPACT_SIZE = COMPACT.size
COMPACT_SHAPE_BYTES = COMPACT_FIELD["shape"].size
COMPACT_MAX_N = 1 << 32  # E and exp_high's bytes are 32-bit fields: n stays below this
# The format codes of the dtype field (the caller's dtype; the compact header holds no QuantizeFP8).
DTYPE_CODES = {"bf16": 1, "fp16": 2, "fp32": 3, "e4m3": 4, "e5m2": 5}
# Where the codebook came from, which the reader turns back into the recorded configuration:
# the pipeline's default (top16_pack's codebook null: the shipped "<format>-kv"), an unnamed
# codebook the caller gave, the shipped default given by its name, or chosen for this tensor
# (top16_pack's codebook "auto").
CODEBOOK_SOURCES = ("default", "given", "named", "auto")
for _name in ("magic", "version", "flags", "header_len", "checksum", "header_crc"):
    assert COMPACT_FIELD[_name].offset == FIELD[_name].offset, _name
assert COMPACT_SIZE == 64 and COMPACT_SIZE % ALIGN == 0
COMPACT_VARYING = (COMPACT_FIELD["escapes"], COMPACT_FIELD["high_bytes"], HEADER_CRC)
VERSION_AT = FIELD["version"]


# ----------------------------------------------------------------------------- version 3: the ratio header
# The compact header of the ratio mode's blobs (ChannelPack then Serialize: docs/format.md
# section 15.6): version 2's fields up to the ndim byte (chunk_log2 never 0: no stored raw),
# then the one count the ratio streams add; no codebook (the tables are a stream).
RATIO_VERSION = 3
RATIO_FIELDS = consecutive_fields(_COMPACT_COMMON + (
    ("reserved", 1, "B"),        # 0
    ("second_bytes", 4, "I"),    # sec_codes's bytes
    ("tail", 12, "12s"),         # zero
))
RATIO_FIELD = {f.name: f for f in RATIO_FIELDS}
RATIO = struct.Struct("<" + "".join(f.code for f in RATIO_FIELDS))
# The ratio mode's streams (name, dtype) in payload order (canonical_order's of their names).
RATIO_STREAMS = (("codes", "uint8"), ("rest", "uint8"), ("esc_count", "uint16"), ("esc_pos", "uint16"),
                 ("esc_exp", "uint8"), ("exp_high", "uint8"), ("sec_codes", "uint8"), ("sec_count", "uint16"),
                 ("tables", "uint8"))
assert RATIO.size == COMPACT_SIZE


# ----------------------------------------------------------------------------- version 4: the storage header
# The compact header of the storage mode's blobs (ChannelRans then Serialize: docs/format.md
# section 16.5): version 3's layout, its counts read as the storage streams' (escapes: esc_exp's
# bytes, high_bytes: the words stream's 16-bit words, second_bytes: the tables stream's bytes).
STORAGE_VERSION = 4
STORAGE = RATIO
STORAGE_STREAMS = (("rest", "uint8"), ("esc_count", "uint32"), ("esc_exp", "uint8"), ("states", "uint32"),
                   ("tables", "uint8"), ("word_count", "uint32"), ("words", "uint16"))
COMPACT_VERSIONS = (COMPACT_VERSION, RATIO_VERSION, STORAGE_VERSION)


def version_of(head) -> int:
    """The container version a header's prefix claims (0 when head is too short to say)."""
    return VERSION_AT.read(head) if len(head) >= VERSION_AT.end else 0


def leb128(sides) -> bytes:
    """Unsigned LEB128 of each side, back to back: 7 bits a byte, low first, bit 7 set on every
    byte but a number's last."""
    out = bytearray()
    for v in sides:
        while True:
            low = v & 0x7F
            v >>= 7
            out.append(low | (0x80 if v else 0))
            if not v:
                break
    return bytes(out)


def unleb128(buf: bytes, count: int) -> tuple[tuple, int] | None:
    """count sides from buf, and the bytes they take; None when buf ends inside a number or a
    number is not in its shortest form (a last byte of 0 after others), which writers never
    produce, so no two encodings of one shape exist."""
    sides, at = [], 0
    for _ in range(count):
        v = shift = 0
        while True:
            if at >= len(buf):
                return None
            b = buf[at]
            at += 1
            v |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                break
        if b == 0 and shift > 7:
            return None
        sides.append(v)
    return tuple(sides), at


# ----------------------------------------------------------------------------- the C side
def cuh() -> str:
    """kvzip/gpu/kernels/layout.cuh: these constants for the CUDA kernels."""
    lines = [
        "// kvzip/gpu/kernels/layout.cuh: the container layout for the kernels.",
        "// Generated from kvzip/layout.py by `python -m kvzip.gpu.headers --write`: do not edit (tests/test_layout.py",
        "// checks that this file is that text).",
        "#pragma once",
        "",
        "// Prefix fields: byte offset (_AT) and size in bytes (_SIZE).",
    ]
    for f in PREFIX_FIELDS:
        key = f.name.upper()
        lines.append(f"#define KVZ_{key}_AT {f.offset}")
        lines.append(f"#define KVZ_{key}_SIZE {f.size}")
        if f.size in (2, 4, 8):  # the kernels read these as words of their size
            lines.append(f"static_assert(KVZ_{key}_AT % KVZ_{key}_SIZE == 0, \"{f.name} is aligned to its size\");")
    lines += [
        f"#define KVZ_PREFIX_SIZE {PREFIX_SIZE}",
        "",
        "// Header length, payload length and stream offsets are multiples of KVZ_ALIGN.",
        f"#define KVZ_ALIGN {ALIGN}",
        "// The stream table: an entry (offset from the payload's start, length; uint64 each) a stream.",
        f"#define KVZ_TABLE_AT {TABLE_AT}",
        f"#define KVZ_ENTRY_SIZE {ENTRY_SIZE}",
        "// The escape streams close the payload and the table, in this order.",
    ]
    for k, name in enumerate(ESCAPE_STREAMS):
        lines.append(f"#define KVZ_{name.upper()}_INDEX {k}")
    lines += [
        f"#define KVZ_ESCAPE_STREAMS {len(ESCAPE_STREAMS)}",
        f"#define KVZ_ESCAPE_ENTRIES_SIZE {ESCAPES.size}  // their table entries, back to back",
        f"#define KVZ_ESC_POS_BYTES {ESC_POS_BYTES}",
        "// esc_count of a plane-coded chunk.",
        f"#define PLANE 0x{PLANE:X}u",
        "",
        "// Version 2, the compact header: its fields' offsets (_AT) and sizes; it is KVZ_COMPACT_SIZE bytes.",
        f"#define KVZ_COMPACT_VERSION {COMPACT_VERSION}",
        f"#define KVZ_COMPACT_SIZE {COMPACT_SIZE}",
    ]
    for f in COMPACT_FIELDS:
        if FIELD.get(f.name) is None:  # those it shares with version 1 are above
            lines.append(f"#define KVZ_COMPACT_{f.name.upper()}_AT {f.offset}")
            lines.append(f"#define KVZ_COMPACT_{f.name.upper()}_SIZE {f.size}")
    lines += ["", "// Version 3, the ratio mode's header: version 2's fields up to ndim, then these; the same size."]
    for f in RATIO_FIELDS:
        if COMPACT_FIELD.get(f.name) is None:
            lines.append(f"#define KVZ_RATIO_{f.name.upper()}_AT {f.offset}")
            lines.append(f"#define KVZ_RATIO_{f.name.upper()}_SIZE {f.size}")
    lines.append("")
    return "\n".join(lines)


def cuh_path():
    from pathlib import Path

    return Path(__file__).parent / "gpu" / "kernels" / "layout.cuh"
