"""What the tests' second decoders (test_ratio_mode.py, test_storage_mode.py) share, written from
docs/format.md alone (struct and NumPy, no kvzip code): the fixed fields of the 64-byte compact
header (section 13, as versions 3 and 4 lay them out), the shape's LEB128 sides, the channel
count of a shape (15.1, 16.1) and the payload walk of the layout rule (2.4)."""
from __future__ import annotations

import struct

MAGIC = b"KVZIP\x00\r\n"
COMPACT = struct.Struct("<8sHHI8sQIIIBBBBI12s")
FORMAT_CODES = {1: "bf16", 2: "fp16", 3: "fp32", 4: "e4m3", 5: "e5m2"}
BITS = {"bf16": (8, 7, 16), "fp16": (5, 10, 16), "fp32": (8, 23, 32), "e4m3": (4, 3, 8), "e5m2": (5, 2, 8)}  # E, M, width


def compact_header(blob: bytes, version: int):
    """(flags, shape, format name, chunk, (u32 at byte 32, u32 at 36, u32 at 48)) of a 64-byte
    compact header of this version: the three counts each version defines at those places."""
    (magic, got, flags, H, sides, _, a, b, _, dtype, clog, ndim, _, c, _) = COMPACT.unpack_from(blob)
    assert magic == MAGIC and got == version and H == 64
    shape, at = [], 0
    for _ in range(ndim):
        v = shift = 0
        while True:
            byte = sides[at]
            at += 1
            v |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        shape.append(v)
    return flags, shape, FORMAT_CODES[dtype], 1 << clog, (a, b, c)


def channels(shape) -> int:
    """The last axis where it is a power of two up to 256, else 1."""
    return shape[-1] if shape and 1 <= shape[-1] <= 256 and shape[-1] & (shape[-1] - 1) == 0 else 1


def payload(blob: bytes, sizes, start: int = 64) -> list[bytes]:
    """The streams of these byte lengths from start, each at a multiple of 16; they end the blob."""
    out, pos = [], start
    for nb in sizes:
        out.append(blob[pos:pos + nb])
        pos += -(-nb // 16) * 16
    assert pos == len(blob)
    return out
