"""EscapeStream: the exponents a Top-16 codebook misses, as a sparse per-chunk stream.

The values are cut into chunks of ``chunk`` values (a power of two, 8..65536).  For each chunk:

* normally its escapes are listed: a uint16 position inside the chunk (strictly increasing; a
  decoder rejects any other order) and the
  uint8 original exponent; ``esc_count`` holds how many, so chunks decode in parallel;
* when listing would cost more bytes than storing the exponents' high bits outright
  (3 * escapes > (E - 4) * groups), the chunk is *plane-coded* instead: ``esc_count`` is
  0xFFFF, its codes hold the low 4 exponent bits and ``exp_high`` the other E - 4.  So no chunk
  ever takes more bytes than its raw values, whatever the data.

Output streams: codes (plane-coded chunks patched), rest, esc_count, esc_pos, esc_exp, exp_high.
This is the array-level reference; stages/fused.py does the same in one pass.
"""
from __future__ import annotations

import numpy as np

from kvzip.bitpack import groups, pack_bits, unpack_bits
from kvzip.codebook import frame_codebook
from kvzip.errors import FormatError
from kvzip.frame import Frame
from kvzip.layout import PLANE  # esc_count value marking a plane-coded chunk

from .base import ESCAPED, PACKED, Stage, register
from .top16_pack import ESCAPE

ESCAPE_BYTES = 3          # uint16 position + uint8 exponent
MIN_CHUNK, MAX_CHUNK = 8, 65536


def chunk_layout(n: int, chunk: int):
    """(number of chunks, groups in each chunk as an int64 NumPy array, values in each chunk)."""
    nchunks = -(-n // chunk)
    lengths = np.full(nchunks, chunk, dtype=np.int64)
    if nchunks:
        lengths[-1] = n - (nchunks - 1) * chunk
    return nchunks, (lengths + 7) // 8, lengths


def escape_capacity(fmt, chunk_groups):
    """Most escapes a chunk may list before plane coding is smaller (per chunk)."""
    return (fmt.high_exp_bits * chunk_groups) // ESCAPE_BYTES


def check_chunk(chunk, most: int = MAX_CHUNK, least: int = MIN_CHUNK) -> int:
    """chunk, if it is a power of two in [least, most] (ValueError otherwise)."""
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk & (chunk - 1) or not least <= chunk <= most:
        raise ValueError(f"chunk must be a power of two in [{least}, {most}], got {chunk!r}")
    return chunk


@register
class EscapeStream(Stage):
    id = "escape_stream"
    input_kind = (PACKED,)
    output_kind = ESCAPED
    consumes = ("exponent",)
    produces = ("esc_count", "esc_pos", "esc_exp", "exp_high")

    def __init__(self, chunk: int = 4096):
        self.chunk = check_chunk(chunk)

    def get_config(self):
        return {"id": self.id, "chunk": self.chunk}

    def encode(self, frame: Frame) -> Frame:
        fmt, backend, n, C = frame.format, frame.backend, frame.n, self.chunk
        xp = backend.xp
        cb = frame_codebook(frame)
        exponent = frame.expect("exponent", np.uint8, n)
        codes = unpack_bits(xp, frame.expect("codes", np.uint8, 4 * groups(n)), 4, groups(n) * 8, np.uint8)
        nchunks, chunk_groups, _ = chunk_layout(n, C)

        where = xp.nonzero(backend.from_numpy(cb.encode_lut())[exponent] == ESCAPE)[0]
        counts = backend.to_numpy(xp.bincount(where // C, minlength=nchunks)) if nchunks else np.zeros(0, np.int64)
        plane = counts > escape_capacity(fmt, chunk_groups)
        listed = ~backend.from_numpy(plane)[where // C]
        esc_pos = (where[listed] % C).astype(xp.uint16)
        esc_exp = exponent[where[listed]]
        esc_count = np.where(plane, PLANE, counts).astype(np.uint16)

        # Plane-coded chunks: low exponent nibble in the codes, high bits in exp_high (padding is 0).
        padded = xp.zeros(codes.shape[0], dtype=xp.uint8)
        padded[:n] = exponent
        in_plane = backend.from_numpy(np.repeat(plane, C)[: codes.shape[0]])
        codes[in_plane] = padded[in_plane] & 0xF
        exp_high = pack_bits(xp, padded[in_plane] >> 4, fmt.high_exp_bits)

        return frame.replace(
            drop=("exponent",), codes=pack_bits(xp, codes, 4), esc_count=backend.from_numpy(esc_count),
            esc_pos=esc_pos, esc_exp=esc_exp, exp_high=exp_high,
        )

    def decode(self, frame: Frame) -> Frame:
        fmt, backend, n, C = frame.format, frame.backend, frame.n, self.chunk
        xp = backend.xp
        cb = frame_codebook(frame)
        packed_codes = frame.expect("codes", np.uint8, 4 * groups(n))  # bounds n before anything is sized by it
        nchunks, chunk_groups, lengths = chunk_layout(n, C)
        counts = backend.to_numpy(frame.expect("esc_count", np.uint16, nchunks)).astype(np.int64)
        plane = counts == PLANE
        listed = np.where(plane, 0, counts)
        over = np.nonzero(listed > escape_capacity(fmt, chunk_groups))[0]
        if over.size:
            raise FormatError(f"chunk {over[0]} claims {listed[over[0]]} escapes, more than an escape list may hold")
        esc_pos = frame.expect("esc_pos", np.uint16, int(listed.sum()))
        esc_exp = frame.expect("esc_exp", np.uint8, int(listed.sum()))
        exp_high = frame.expect("exp_high", np.uint8, fmt.high_exp_bits * int(chunk_groups[plane].sum()))
        esc_chunk = backend.from_numpy(np.repeat(np.arange(nchunks, dtype=np.int64), listed))
        if esc_pos.size and bool((esc_pos >= backend.from_numpy(lengths)[esc_chunk]).any()):
            raise FormatError("an escape position lies outside its chunk")
        same_chunk = esc_chunk[1:] == esc_chunk[:-1]
        if esc_pos.size > 1 and bool((same_chunk & (esc_pos[1:] <= esc_pos[:-1])).any()):
            raise FormatError("escape positions within a chunk must increase")
        if esc_exp.size and int(esc_exp.max()) >= 1 << fmt.exp_bits:
            raise FormatError(f"an escaped exponent is >= 2**{fmt.exp_bits}")

        codes = unpack_bits(xp, packed_codes, 4, groups(n) * 8, np.uint8)
        exponent = backend.from_numpy(cb.decode_lut())[codes]
        in_plane = backend.from_numpy(np.repeat(plane, C)[: codes.shape[0]])
        high = unpack_bits(xp, exp_high, fmt.high_exp_bits, int(in_plane.sum()), np.uint8)
        exponent[in_plane] = codes[in_plane] | (high << 4)
        exponent[esc_chunk * C + esc_pos] = esc_exp
        return frame.replace(
            drop=("esc_count", "esc_pos", "esc_exp", "exp_high"), exponent=exponent[:n].copy()
        )
