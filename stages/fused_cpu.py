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
rest field one whole byte) has its own value-wise loops, the other formats go group by group
through the helpers of kvzip/bitlogic.py shared with the CUDA kernels.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np
from numba import njit

from kvzip import cpu_parallel
from kvzip.bitlogic import CPU, ESCAPE, PLANE

_jit = njit(nogil=True, cache=False)  # nogil: threads over chunk ranges run at the same time


def escape_slot(chunk: int, hb: int) -> int:
    """Escapes a listed chunk of ``chunk`` values may hold: the size of its slot."""
    return (hb * (chunk // 8)) // 3


@lru_cache(maxsize=None)
def kernels(E: int, M: int):
    """(encode_range, decode_range) for the format with E exponent and M mantissa bits."""
    R, HB = M + 1, E - 4
    EMASK, MMASK = (1 << E) - 1, (1 << M) - 1
    encode_group, encode_group_plane, decode_group = CPU.encode_group, CPU.encode_group_plane, CPU.decode_group
    value_exponent, patch_exponent = CPU.value_exponent, CPU.patch_exponent
    bf16 = (E, M) == (8, 7)

    @_jit
    def list_chunk_bf16(src, n, i0, i1, lut, codes, rest, esc_pos, esc_exp, slot, cap):
        """Codes and rest bytes of values i0..i1 (i0 a multiple of 8; zero padding past n up to a
        group end); escapes listed from esc_pos[slot] while fewer than cap.  Returns their count."""
        count = 0
        end = min(i1, n)
        for i in range(i0, end):  # rest byte = sign << 7 | mantissa
            v = np.uint32(src[i])
            rest[i] = np.uint8(((v >> 8) & 0x80) | (v & 0x7F))
        for i in range(end, i1):
            rest[i] = 0
        for p in range(i0 >> 1, (i1 + 1) >> 1):
            i = 2 * p
            byte = 0
            for h in range(2):
                if i + h < end:
                    e = (np.uint32(src[i + h]) >> 7) & 0xFF
                    c = np.uint32(lut[e])
                    if c == ESCAPE:
                        if count < cap:
                            esc_pos[slot + count] = i + h - i0
                            esc_exp[slot + count] = e
                        count += 1
                    else:
                        byte |= c << (4 * h)
            codes[p] = byte
        return count

    @_jit
    def list_chunk_groups(src, n, g0, g1, lut, codes, rest, esc_pos, esc_exp, slot, cap):
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
        return count

    @_jit
    def encode_range(src, n, lut, C, c0, c1, codes, rest, esc_count, esc_pos, esc_exp, exp_high):
        G = (n + 7) // 8
        gpc = C // 8
        full_cap = (HB * gpc) // 3
        for c in range(c0, c1):
            g0 = c * gpc
            g1 = min(g0 + gpc, G)
            cap = (HB * (g1 - g0)) // 3
            slot = c * full_cap
            if bf16:
                count = list_chunk_bf16(src, n, 8 * g0, 8 * g1, lut, codes, rest, esc_pos, esc_exp, slot, cap)
            else:
                count = list_chunk_groups(src, n, g0, g1, lut, codes, rest, esc_pos, esc_exp, slot, cap)
            if count > cap:
                esc_count[c] = PLANE
                hoff = g0 * HB
                for g in range(g0, g1):
                    encode_group_plane(src, n, g, E, M, codes, exp_high, hoff)
                    hoff += HB
            else:
                esc_count[c] = count

    @_jit
    def decode_chunk_bf16(codes, rest, n, i0, i1, dlut, dst):
        end = min(i1, n)
        for i in range(i0, end):
            r = np.uint32(rest[i])
            e = np.uint32(dlut[(np.uint32(codes[i >> 1]) >> (4 * (i & 1))) & 0xF])
            dst[i] = np.uint16(((r & 0x80) << 8) | (e << 7) | (r & 0x7F))

    @_jit
    def decode_range(codes, rest, esc_count, esc_off, plane_off, esc_pos, esc_exp, exp_high, n, dlut, C, c0, c1,
                     dst):
        """Decode chunks c0..c1; returns 8 * chunk + error code of the first bad chunk, or -1."""
        G = (n + 7) // 8
        gpc = C // 8
        for c in range(c0, c1):
            g0 = c * gpc
            g1 = min(g0 + gpc, G)
            cnt = int(esc_count[c])
            if cnt == PLANE:
                hoff = plane_off[c]
                for g in range(g0, g1):
                    decode_group(codes, rest, n, g, E, M, dlut, True, exp_high, hoff, dst)
                    hoff += HB
                continue
            if bf16:
                decode_chunk_bf16(codes, rest, n, 8 * g0, 8 * g1, dlut, dst)
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
                    return 8 * c + 3
                prev = pos
                if e > EMASK:
                    return 8 * c + 4
                patch_exponent(dst, c * C + pos, e, E, M)
        return -1

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


def encode(src, n, E, M, lut, C, codes, rest, esc_count, esc_pos, esc_exp, exp_high):
    """Fill codes, rest and esc_count; escapes and high bits packed at the front of esc_pos,
    esc_exp (each sized for escape_slot per chunk) and exp_high (HB bytes a group).
    Returns (escapes, exp_high bytes)."""
    encode_range, _ = kernels(E, M)
    nchunks = esc_count.shape[0]

    def work(c0, c1):
        encode_range(src, n, lut, C, c0, c1, codes, rest, esc_count, esc_pos, esc_exp, exp_high)

    cpu_parallel.run_ranges(work, cpu_parallel.split(nchunks, C * src.itemsize))
    ne, nh = _compact(esc_count, n, C, E - 4, esc_pos, esc_exp, exp_high)
    return int(ne), int(nh)


def decode(codes, rest, esc_count, esc_pos, esc_exp, exp_high, n, E, M, dlut, C, dst) -> int:
    """Rebuild the n values into dst; returns 0, or the error code the serial decoder gives."""
    _, decode_range = kernels(E, M)
    nchunks = esc_count.shape[0]
    esc_off = np.empty(nchunks, np.int64)
    plane_off = np.empty(nchunks, np.int64)
    stop, count_error = _decode_offsets(esc_count, n, C, E - 4, esc_pos.shape[0], exp_high.shape[0], esc_off,
                                        plane_off)

    def work(c0, c1):
        return decode_range(codes, rest, esc_count, esc_off, plane_off, esc_pos, esc_exp, exp_high, n, dlut, C,
                            c0, min(c1, stop), dst)

    errors = [e for e in cpu_parallel.run_ranges(work, cpu_parallel.split(stop, C * dst.itemsize)) if e >= 0]
    if count_error >= 0:
        errors.append(count_error)
    return min(errors) % 8 if errors else 0
