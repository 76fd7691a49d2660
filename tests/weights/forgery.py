"""Forged TCA-TBE blobs for the decoders' tests (tests/weights, tests/gpu): checksums made right
again after an edit, so that only the format's structure can catch it."""
from __future__ import annotations

import struct
import zlib

import numpy as np

from kvzip.checksum import sum64


def reseal(blob) -> bytes:
    """blob with its payload sum64 and header CRC-32 recomputed, as docs/weights-format.md
    defines them (not through the encoder's code)."""
    blob = bytearray(blob)
    blob[40:48] = struct.pack("<Q", sum64(np, np.frombuffer(bytes(blob[64:]), np.uint8)))
    blob[48:52] = bytes(4)
    blob[48:52] = struct.pack("<I", zlib.crc32(bytes(blob[:64])))
    return bytes(blob)


def mutations(blob: bytes, streams: dict, count: int, rng: np.random.Generator):
    """count resealed blobs, each with 1-2 random bytes replaced: half anywhere in the payload,
    half in the first 64 bytes of a stream (offsets, bitmaps' first tiles, runs' starts)."""
    starts = [o for o, n in streams.values() if n]
    for k in range(count):
        b = bytearray(blob)
        for _ in range(int(rng.integers(1, 3))):
            at = int(rng.integers(64, len(b))) if k % 2 else min(len(b) - 1, int(rng.choice(starts) + rng.integers(0, 64)))
            b[at] = int(rng.integers(0, 256))
        yield reseal(b)
