"""The fused split/pack/escape pass on the CPU: chunks in parallel threads, GIL released.

Bytes are those of the serial definition (stages/escape_stream.py, the staged reference), for
any number of threads, because every chunk's output lies at a position known in advance:

* encode: codes and rest of group g always lie at 4 g and R g.  A chunk's escapes go to a slot
  of its own in the escape arrays (chunk c at c * cap, cap = the most a listed chunk holds), a
  plane-coded chunk's high exponent bits to its own slot of exp_high (c * HB * groups per chunk);
  one short serial pass (``_compact``) then moves the slots together in chunk order.  Moving
  forward is safe: the escapes of the chunks before c never exceed c * cap (each holds at most
  cap), and likewise for exp_high.
* decode: a serial pass over esc_count (one uint16 a chunk) finds where each chunk's escapes and
  high bits start and checks the counts; the threads then decode chunk ranges and check escape
  positions and exponents.  The error reported is the one the serial loop meets first: the
  lowest chunk's, a count error of that chunk before its position errors, the stream totals last.

Kernels are specialised per (E, M) with the field widths as compile-time constants; BF16 (every
rest field one whole byte) has its own word-wise loops, the other formats go group by group
through the helpers of kvzip/bitlogic.py shared with the CUDA kernels.
"""
from __future__ import annotations

import sys
from functools import lru_cache

import numpy as np

from kvzip import cpu_parallel
from kvzip.bitlogic import CPU, ESCAPE, PLANE
from kvzip.checksum import sum_terms
from kvzip.jit import cpu_jit

# The shared helpers as globals of this module: cached kernels call them by global name (kvzip/jit.py).
encode_group, encode_group_plane, decode_group = CPU.encode_group, CPU.encode_group_plane, CPU.decode_group
value_exponent, patch_exponent = CPU.value_exponent, CPU.patch_exponent

_jit = cpu_jit(nogil=True)  # nogil: threads over chunk ranges run at the same time; cached on disk


@_jit
def list_chunk_bf16(src, n, g0, g1, lut, flut, codes, rest, esc_pos, esc_exp, slot, cap, src64, codes32, rest64):
    """Groups g0..g1 of BF16 values, a word at a time: each whole group's 8 values are two
    uint64 words of src64, its codes one uint32 of codes32, its rest bytes (sign << 7 |
    mantissa) one uint64 of rest64.  flut is lut with each escape as 0x10 (code nibble 0, the
    flag in bit 4), so the loop has no branch; only a group with one is scanned again, to list its escapes from esc_pos[slot] in order
    while fewer than cap.  A last partial group goes through the shared helper.  Returns the
    chunk's escape count."""
    count = 0
    whole = min(g1, n // 8)
    for g in range(g0, whole):
        w0 = src64[2 * g]
        w1 = src64[2 * g + 1]
        word = np.uint64(0)
        r = np.uint64(0)
        flags = np.uint64(0)
        for j in range(8):
            lane = (w0 if j < 4 else w1) >> np.uint64(16 * (j % 4))
            c = np.uint64(flut[(lane >> np.uint64(7)) & np.uint64(0xFF)])
            flags |= c
            word |= (c & np.uint64(0xF)) << np.uint64(4 * j)
            r |= (((lane >> np.uint64(8)) & np.uint64(0x80)) | (lane & np.uint64(0x7F))) << np.uint64(8 * j)
        codes32[g] = np.uint32(word)
        rest64[g] = r
        if flags & np.uint64(0x10):
            for i in range(8 * g, 8 * g + 8):
                e = (src[i] >> 7) & 0xFF
                if lut[e] == ESCAPE:
                    if count < cap:
                        esc_pos[slot + count] = i - 8 * g0
                        esc_exp[slot + count] = e
                    count += 1
    for g in range(whole, g1):  # at most one: the group holding the last values
        mask = encode_group(src, n, g, 8, 7, lut, codes, rest)
        for j in range(8):
            if (mask >> j) & 1:
                if count < cap:
                    esc_pos[slot + count] = 8 * g + j - 8 * g0
                    esc_exp[slot + count] = (src[8 * g + j] >> 7) & 0xFF
                count += 1
    return count


@_jit
def decode_chunk_bf16(codes, rest, n, g0, g1, dlut, dst, codes32, rest64, dst64):
    """Groups g0..g1 of BF16 values without their escapes, a word at a time (the views of
    list_chunk_bf16; dst64: dst as uint64, whole groups only)."""
    whole = min(g1, n // 8)
    for g in range(g0, whole):
        word = np.uint64(codes32[g])
        r = rest64[g]
        out0 = np.uint64(0)
        out1 = np.uint64(0)
        for j in range(8):
            e = np.uint64(dlut[(word >> np.uint64(4 * j)) & np.uint64(0xF)])
            rb = (r >> np.uint64(8 * j)) & np.uint64(0xFF)
            lane = ((rb & np.uint64(0x80)) << np.uint64(8)) | (e << np.uint64(7)) | (rb & np.uint64(0x7F))
            if j < 4:
                out0 |= lane << np.uint64(16 * j)
            else:
                out1 |= lane << np.uint64(16 * (j - 4))
        dst64[2 * g] = out0
        dst64[2 * g + 1] = out1
    for g in range(whole, g1):  # at most one: the group holding the last values
        decode_group(codes, rest, n, g, 8, 7, dlut, False, codes, 0, dst)


@lru_cache(maxsize=None)
def kernels(E: int, M: int):
    """(encode_range, decode_range) for the format with E exponent and M mantissa bits.

    Closures over ints and a bool only, so Numba's disk cache keeps one entry per format; the
    functions they call are this module's globals (kvzip/jit.py says why)."""
    HB = E - 4
    R = M + 1  # rest bytes a group
    EMASK = (1 << E) - 1
    bf16 = (E, M) == (8, 7) and sys.byteorder == "little"  # the word views read little-endian words

    @_jit
    def encode_range(src, n, lut, flut, C, c0, c1, codes, rest, esc_count, esc_pos, esc_exp, exp_high, src64,
                     codes32, rest64):
        G = (n + 7) // 8
        gpc = C // 8
        full_cap = (HB * gpc) // 3
        for c in range(c0, c1):
            g0 = c * gpc
            g1 = min(g0 + gpc, G)
            cap = (HB * (g1 - g0)) // 3
            slot = c * full_cap
            if bf16:
                count = list_chunk_bf16(src, n, g0, g1, lut, flut, codes, rest, esc_pos, esc_exp, slot, cap, src64,
                                        codes32, rest64)
            else:  # list the chunk's escapes group by group
                count = 0
                for g in range(g0, g1):
                    mask = encode_group(src, n, g, E, M, lut, codes, rest)
                    if mask:
                        for j in range(8):
                            if (mask >> j) & 1:
                                if count < cap:
                                    i = g * 8 + j
                                    esc_pos[slot + count] = i - g0 * 8
                                    esc_exp[slot + count] = value_exponent(int(src[i]), E, M)
                                count += 1
            if count > cap:
                esc_count[c] = PLANE
                hoff = g0 * HB
                for g in range(g0, g1):
                    encode_group_plane(src, n, g, E, M, codes, exp_high, hoff)
                    hoff += HB
            else:
                esc_count[c] = count

    @_jit
    def decode_range(codes, rest, esc_count, esc_off, plane_off, esc_pos, esc_exp, exp_high, n, dlut, C, c0, c1,
                     dst, codes32, rest64, dst64, words, cw, rw):
        """Decode chunks c0..c1; returns (8 * chunk + error code of the first bad chunk, or -1;
        the sum64 terms of the payload words the chunks' codes and rest lie in).  words: the
        payload as uint64 words, codes and rest starting at words cw and rw (empty: no sum).
        A chunk's words are those whose first byte lies in its codes or rest bytes, so the
        chunks of a decode tile two word ranges exactly (stages/fused_cpu.py, decode)."""
        G = (n + 7) // 8
        gpc = C // 8
        summing = words.shape[0] > 0
        total = np.uint64(0)
        for c in range(c0, c1):
            g0 = c * gpc
            g1 = min(g0 + gpc, G)
            if summing:  # first: it brings the chunk's lines in for the decode below
                total += sum_terms(words, cw + (4 * g0 + 7) // 8, cw + (4 * g1 + 7) // 8)
                total += sum_terms(words, rw + (R * g0 + 7) // 8, rw + (R * g1 + 7) // 8)
            cnt = int(esc_count[c])
            if cnt == PLANE:
                hoff = plane_off[c]
                for g in range(g0, g1):
                    decode_group(codes, rest, n, g, E, M, dlut, True, exp_high, hoff, dst)
                    hoff += HB
                continue
            if bf16:
                decode_chunk_bf16(codes, rest, n, g0, g1, dlut, dst, codes32, rest64, dst64)
            else:
                for g in range(g0, g1):
                    decode_group(codes, rest, n, g, E, M, dlut, False, exp_high, 0, dst)
            length = min(C, n - c * C)
            prev = -1
            k0 = esc_off[c]
            for k in range(k0, k0 + cnt):
                pos = int(esc_pos[k])
                e = int(esc_exp[k])
                if pos >= length or pos <= prev:
                    return 8 * c + 3, total
                prev = pos
                if e > EMASK:
                    return 8 * c + 4, total
                patch_exponent(dst, c * C + pos, e, E, M)
        return -1, total

    return encode_range, decode_range


@_jit
def _compact(esc_count, n, C, HB, esc_pos, esc_exp, exp_high):
    """Move each chunk's escape and exp_high slots together, in chunk order; returns the totals."""
    G = (n + 7) // 8
    gpc = C // 8
    full_cap = (HB * gpc) // 3
    ne = 0
    nh = 0
    for c in range(esc_count.shape[0]):
        cnt = int(esc_count[c])
        if cnt == PLANE:
            nbytes = HB * (min(gpc, G - c * gpc))
            src = c * gpc * HB
            for k in range(nbytes):
                exp_high[nh + k] = exp_high[src + k]
            nh += nbytes
        else:
            src = c * full_cap
            for k in range(cnt):
                esc_pos[ne + k] = esc_pos[src + k]
                esc_exp[ne + k] = esc_exp[src + k]
            ne += cnt
    return ne, nh


@_jit
def _decode_offsets(esc_count, n, C, HB, n_pos, n_high, esc_off, plane_off):
    """Where each chunk's escapes and high bits start, checking counts against the streams.
    Returns (the chunks that may be decoded, 8 * chunk + error code or -1 for no count error)."""
    G = (n + 7) // 8
    gpc = C // 8
    ne = 0
    nh = 0
    nchunks = esc_count.shape[0]
    for c in range(nchunks):
        ng = min(gpc, G - c * gpc)
        cnt = int(esc_count[c])
        esc_off[c] = ne
        plane_off[c] = nh
        if cnt == PLANE:
            if nh + HB * ng > n_high:
                return c, 8 * c + 5
            nh += HB * ng
            continue
        if cnt > (HB * ng) // 3:
            return c, 8 * c + 1
        if ne + cnt > n_pos:
            return c, 8 * c + 2
        ne += cnt
    if ne != n_pos:
        return nchunks, 8 * nchunks + 2
    if nh != n_high:
        return nchunks, 8 * nchunks + 5
    return nchunks, -1


def _word_views(values, codes, rest, E, M):
    """The BF16 kernels' word views: values as uint64 (4 a word, whole groups only), codes as
    uint32 and rest as uint64 (one a group).  Other formats get empty views (unused)."""
    if (E, M) != (8, 7) or sys.byteorder != "little":
        return np.zeros(0, np.uint64), np.zeros(0, np.uint32), np.zeros(0, np.uint64)
    whole = values.shape[0] // 8 * 8
    return values[:whole].view(np.uint64), codes.view(np.uint32), rest.view(np.uint64)


def encode(src, n, E, M, lut, C, codes, rest, esc_count, esc_pos, esc_exp, exp_high):
    """Fill codes, rest and esc_count; escapes and high bits packed at the front of esc_pos,
    esc_exp (each at least HB * groups // 3 long: every chunk's slot) and exp_high (HB bytes a group).
    Returns (escapes, exp_high bytes)."""
    encode_range, _ = kernels(E, M)
    nchunks = esc_count.shape[0]
    flut = np.where(lut == ESCAPE, 0x10, lut).astype(np.uint8)
    src64, codes32, rest64 = _word_views(src, codes, rest, E, M)

    def work(c0, c1):
        encode_range(src, n, lut, flut, C, c0, c1, codes, rest, esc_count, esc_pos, esc_exp, exp_high, src64, codes32,
                     rest64)

    cpu_parallel.run_ranges(work, cpu_parallel.split(nchunks, C * src.itemsize))
    ne, nh = _compact(esc_count, n, C, E - 4, esc_pos, esc_exp, exp_high)
    return int(ne), int(nh)


_NO_WORDS = np.zeros(0, np.uint64)


def decode(codes, rest, esc_count, esc_pos, esc_exp, exp_high, n, E, M, dlut, C, dst, words=None, codes_at=0,
           rest_at=0):
    """Rebuild the n values into dst; returns (0, or the error code the serial decoder gives;
    the inner sum of sum64 over words, or None).

    words: the payload as uint64 words, holding codes and rest at byte offsets codes_at and
    rest_at (multiples of 8): each task also sums the terms of the words its chunks' codes and
    rest lie in while they are in cache, and the words outside those two ranges (the other
    streams, padding) are summed after.  Additions mod 2**64 in any order give the same sum.
    The sum is None where words is None or the decode found an error (its tasks stopped early)."""
    _, decode_range = kernels(E, M)
    nchunks = esc_count.shape[0]
    esc_off = np.empty(nchunks, np.int64)
    plane_off = np.empty(nchunks, np.int64)
    stop, count_error = _decode_offsets(esc_count, n, C, E - 4, esc_pos.shape[0], exp_high.shape[0], esc_off,
                                        plane_off)

    dst64, codes32, rest64 = _word_views(dst, codes, rest, E, M)
    summing = words is not None
    w = words if summing else _NO_WORDS
    cw, rw = codes_at // 8, rest_at // 8

    def work(c0, c1):
        return decode_range(codes, rest, esc_count, esc_off, plane_off, esc_pos, esc_exp, exp_high, n, dlut, C,
                            c0, c1, dst, codes32, rest64, dst64, w, cw, rw)

    results = cpu_parallel.run_ranges(work, cpu_parallel.split(stop, C * dst.itemsize))
    errors = [e for e, _ in results if e >= 0]
    if count_error >= 0:
        errors.append(count_error)
    if errors:
        return min(errors) % 8, None
    if not summing:
        return 0, None
    total = sum(int(t) for _, t in results)
    G = (n + 7) // 8
    covered = sorted([(cw, cw + (4 * G + 7) // 8), (rw, rw + ((M + 1) * G + 7) // 8)])
    start = 0
    for lo, hi in covered + [(w.shape[0], w.shape[0])]:
        if lo > start:
            total += int(sum_terms(w, start, lo))
        start = max(start, hi)
    return 0, total % (1 << 64)
