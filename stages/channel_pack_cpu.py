"""ChannelPack's CPU kernels: the two-level channel code, chunks in parallel threads, GIL released.

The bytes are docs/format.md section 15's for any number of threads, because every chunk's
output lies at a position known in advance or is moved there by a serial pass:

* encode: chunk c's codes and rest lie at 3 g and R g of its groups g, always.  Its second-level
  indices go to a slot of its own (3 bytes a group: a whole chunk of second-level hits fits),
  its escapes to slot c * cap (cap = the most a listed chunk of C values may hold), a
  plane-coded chunk's high exponent bits to (E - 3) bytes a group of its own; ``_compact`` then
  moves every chunk's run to the front in chunk order.  Moving forward is safe: no chunk's run is
  longer than its slot.
* decode: a serial pass over the two uint16 counts a chunk (``_decode_offsets``) finds where each
  chunk's second-level indices, escapes and high bits start and checks the counts against the
  stream lengths; the threads then decode chunk ranges, checking the second-level count against
  the chunk's code-7 values and the escapes' positions and exponents.  The error reported is the
  one a serial decoder meets first: the lowest chunk's, its count error before its value errors,
  the stream totals last.

Kernels are specialised per (E, M) (closures over ints: kvzip/jit.py's cache rules) and work a
group of 8 values at a time, the unit whose code bytes (3), rest bytes (R) and plane bytes
(E - 3) start on byte boundaries.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvzip import cpu_parallel
from kvzip.auto_codebook import RUN_LENGTH, run_starts
from kvzip.bitlogic import CPU, PLANE
from kvzip.channel_codebook import CODE_BITS, PRIMARY, TABLE_WIDTH
from kvzip.jit import cpu_jit

# The shared helpers as globals of this module: cached kernels call them by global name (kvzip/jit.py).
value_exponent, value_rest, join_value, patch_exponent = (CPU.value_exponent, CPU.value_rest, CPU.join_value,
                                                          CPU.patch_exponent)

SECOND = PRIMARY  # the code that says "a second-level index follows"

_jit = cpu_jit(nogil=True)
_inline = cpu_jit(nogil=True, inline="always")  # the bit-stream helpers, in the loops that call them


@_inline
def _put_bytes(buf, at, acc, nacc):
    """acc's whole bytes (of its nacc bits, low bits first) to buf from at; returns (at, acc,
    nacc) with the fewer than 8 bits left over."""
    while nacc >= 8:
        buf[at] = acc & 0xFF
        at += 1
        acc >>= 8
        nacc -= 8
    return at, acc, nacc


@_inline
def _take_bits(buf, at, acc, nacc, need):
    """buf's bytes from at into acc above its nacc bits until it holds need bits; returns (at, acc, nacc)."""
    while nacc < need:
        acc |= int(buf[at]) << nacc
        at += 1
        nacc += 8
    return at, acc, nacc


@lru_cache(maxsize=None)
def kernels(E: int, M: int):
    """(encode_range, decode_range) for the format with E exponent and M mantissa bits."""
    R = M + 1          # rest bits a value = rest bytes a group
    HB = E - CODE_BITS  # exponent bits a plane-coded chunk keeps in exp_high
    EMASK = (1 << E) - 1
    HMASK = (1 << HB) - 1
    RMASK = (1 << R) - 1
    GROUP_CODE_BITS = 8 * CODE_BITS  # a group's codes: one 24-bit word, 3 bytes
    WORD_REST = R <= 8  # a group's rest bits fit one 64-bit word (bf16, e4m3, e5m2)

    @_jit
    def encode_range(src, n, D, lut, C, c0, c1, codes, rest, esc_count, sec_count, sec_slots, esc_pos, esc_exp,
                     high_slots):
        """Chunks c0..c1: codes, rest and the two counts in place, the variable runs in their slots."""
        G = (n + 7) // 8
        gpc = C // 8
        full_cap = (HB * gpc) // 3
        DM = D - 1
        for c in range(c0, c1):
            g0 = c * gpc
            g1 = min(g0 + gpc, G)
            plane_bytes = HB * (g1 - g0)
            cap = plane_bytes // 3
            eslot = c * full_cap
            sout = c * CODE_BITS * gpc  # the chunk's slot of second-level indices, written as a bit stream
            sacc = 0
            sn = 0
            esc = 0
            sec = 0
            for g in range(g0, g1):
                word = 0
                acc = 0
                nacc = 0
                out = g * R
                for j in range(8):
                    i = g * 8 + j
                    code = 0
                    r = 0
                    if i < n:
                        v = int(src[i])
                        r = value_rest(v, E, M)
                        e = value_exponent(v, E, M)
                        k = int(lut[((i & DM) << E) | e])
                        if k < SECOND:
                            code = k
                        elif k < TABLE_WIDTH:
                            code = SECOND
                            sout, sacc, sn = _put_bytes(sec_slots, sout, sacc | ((k - SECOND) << sn), sn + CODE_BITS)
                            sec += 1
                        else:  # an escape: code 0, listed while the chunk may still list it
                            if esc < cap:
                                esc_pos[eslot + esc] = i - g0 * 8
                                esc_exp[eslot + esc] = e
                            esc += 1
                    word |= code << (CODE_BITS * j)
                    out, acc, nacc = _put_bytes(rest, out, acc | (r << nacc), nacc + R)
                _put_bytes(codes, CODE_BITS * g, word, GROUP_CODE_BITS)
            _put_bytes(sec_slots, sout, sacc, 8 if sn else 0)  # the run's last, partial byte
            if (CODE_BITS * sec + 7) // 8 + 3 * esc > plane_bytes:  # plane coding is smaller
                esc_count[c] = PLANE
                sec_count[c] = 0
                for g in range(g0, g1):
                    word = 0
                    high = 0
                    for j in range(8):
                        i = g * 8 + j
                        if i < n:
                            e = value_exponent(int(src[i]), E, M)
                            word |= (e & 7) << (CODE_BITS * j)
                            high |= (e >> CODE_BITS) << (HB * j)
                    _put_bytes(codes, CODE_BITS * g, word, GROUP_CODE_BITS)
                    _put_bytes(high_slots, HB * g, high, 8 * HB)
            else:
                esc_count[c] = esc
                sec_count[c] = sec

    @_jit
    def decode_range(codes, rest, tables, D, esc_count, sec_count, esc_off, sec_off, plane_off, esc_pos, esc_exp,
                     exp_high, sec_codes, n, C, c0, c1, dst):
        """Decode chunks c0..c1 into dst; returns 8 * chunk + error code of the first bad chunk, or -1."""
        G = (n + 7) // 8
        gpc = C // 8
        DM = D - 1
        for c in range(c0, c1):
            g0 = c * gpc
            g1 = min(g0 + gpc, G)
            plane = int(esc_count[c]) == PLANE
            hoff = plane_off[c]
            sin = sec_off[c]
            want = int(sec_count[c])
            hits = 0
            sacc = 0
            sn = 0
            for g in range(g0, g1):
                word = _take_bits(codes, CODE_BITS * g, 0, 0, GROUP_CODE_BITS)[1]
                high = 0
                if plane:
                    hoff, high, _ = _take_bits(exp_high, hoff, 0, 0, 8 * HB)
                acc = 0
                nacc = 0
                inp = g * R
                if WORD_REST:  # the group's rest bits in one word
                    acc = _take_bits(rest, inp, 0, 0, 8 * R)[1]
                for j in range(8):
                    if WORD_REST:
                        r = (acc >> (R * j)) & RMASK
                    else:
                        inp, acc, nacc = _take_bits(rest, inp, acc, nacc, R)
                        r = acc & RMASK
                        acc >>= R
                        nacc -= R
                    i = g * 8 + j
                    if i >= n:
                        continue
                    code = (word >> (CODE_BITS * j)) & 7
                    if plane:
                        e = code | (((high >> (HB * j)) & HMASK) << CODE_BITS)
                    elif code < SECOND:
                        e = int(tables[(i & DM) * TABLE_WIDTH + code])
                    else:
                        if hits == want:  # more code-7 values than the chunk's count
                            return 8 * c + 6
                        if sn < CODE_BITS:  # (not _take_bits: the call here costs the loop ~15 %)
                            sacc |= int(sec_codes[sin]) << sn
                            sin += 1
                            sn += 8
                        e = int(tables[(i & DM) * TABLE_WIDTH + SECOND + (sacc & 7)])
                        sacc >>= CODE_BITS
                        sn -= CODE_BITS
                        hits += 1
                    dst[i] = join_value(e, r, E, M)
            if hits != want:
                return 8 * c + 6
            if plane:
                continue
            length = min(C, n - c * C)
            prev = -1
            k0 = esc_off[c]
            for k in range(k0, k0 + int(esc_count[c])):
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
def _count_runs(src, n, starts, L, DM, E, M, hist):
    """hist[(channel << E) | exponent] += 1 for every value of the runs [start, start + L) cut at n."""
    EMASK = (1 << E) - 1
    for s in starts:
        for i in range(s, min(s + L, n)):
            hist[((i & DM) << E) | ((int(src[i]) >> M) & EMASK)] += 1


def runs_histogram(src, fmt, channels, starts, run_length):
    """int64[channels, 2**E]: the exponents of the values of the runs [start, start + run_length)
    (cut at the end of src, flat raw bits) counted by channel, ranges of runs in threads, each
    counting into its own histogram."""
    E, n = fmt.exp_bits, src.shape[0]

    def work(r0, r1):
        hist = np.zeros(channels << E, np.int64)
        _count_runs(src, n, starts[r0:r1], run_length, channels - 1, E, fmt.mant_bits, hist)
        return hist

    parts = cpu_parallel.run_ranges(work, cpu_parallel.split(starts.shape[0], run_length * src.itemsize))
    return sum(parts[1:], parts[0]).reshape(channels, 1 << E)


def histogram(src, fmt, channels):
    """kvzip.channel_codebook.channel_histogram of src (flat raw bits) in one compiled pass over
    the sample's runs."""
    return runs_histogram(src, fmt, channels, run_starts(src.shape[0]), RUN_LENGTH)


@_jit
def _compact(esc_count, sec_count, n, C, HB, sec_slots, esc_pos, esc_exp, high_slots):
    """Move each chunk's second-level, escape and exp_high runs to the front, in chunk order;
    returns their totals (bytes, escapes, bytes)."""
    G = (n + 7) // 8
    gpc = C // 8
    full_cap = (HB * gpc) // 3
    ns = 0
    ne = 0
    nh = 0
    for c in range(esc_count.shape[0]):
        cnt = int(esc_count[c])
        if cnt == PLANE:
            nbytes = HB * min(gpc, G - c * gpc)
            at = c * gpc * HB
            for k in range(nbytes):
                high_slots[nh + k] = high_slots[at + k]
            nh += nbytes
            continue
        nbytes = (CODE_BITS * int(sec_count[c]) + 7) // 8
        at = c * CODE_BITS * gpc
        for k in range(nbytes):
            sec_slots[ns + k] = sec_slots[at + k]
        ns += nbytes
        at = c * full_cap
        for k in range(cnt):
            esc_pos[ne + k] = esc_pos[at + k]
            esc_exp[ne + k] = esc_exp[at + k]
        ne += cnt
    return ns, ne, nh


@_jit
def _decode_offsets(esc_count, sec_count, n, C, HB, n_sec, n_pos, n_high, sec_off, esc_off, plane_off):
    """Where each chunk's runs start, checking the counts against the streams' lengths.
    Returns (the chunks that may be decoded, 8 * chunk + error code, or -1 for no count error)."""
    G = (n + 7) // 8
    gpc = C // 8
    ns = 0
    ne = 0
    nh = 0
    nchunks = esc_count.shape[0]
    for c in range(nchunks):
        ng = min(gpc, G - c * gpc)
        cnt = int(esc_count[c])
        sec = int(sec_count[c])
        sec_off[c] = ns
        esc_off[c] = ne
        plane_off[c] = nh
        if cnt == PLANE:
            if sec != 0:
                return c, 8 * c + 6
            if nh + HB * ng > n_high:
                return c, 8 * c + 5
            nh += HB * ng
            continue
        if sec > min(C, n - c * C) or (CODE_BITS * sec + 7) // 8 + 3 * cnt > HB * ng:
            return c, 8 * c + 1
        if ne + cnt > n_pos:
            return c, 8 * c + 2
        if ns + (CODE_BITS * sec + 7) // 8 > n_sec:
            return c, 8 * c + 6
        ne += cnt
        ns += (CODE_BITS * sec + 7) // 8
    if ns != n_sec:
        return nchunks, 8 * nchunks + 6
    if ne != n_pos:
        return nchunks, 8 * nchunks + 2
    if nh != n_high:
        return nchunks, 8 * nchunks + 5
    return nchunks, -1


def encode(src, n, fmt, channels, lut, C, codes, rest, esc_count, sec_count):
    """Fill codes, rest, esc_count and sec_count (sized for n values in chunks of C); returns
    the variable streams (sec_codes, esc_pos, esc_exp, exp_high) as new arrays."""
    E, M = fmt.exp_bits, fmt.mant_bits
    HB = E - CODE_BITS
    encode_range, _ = kernels(E, M)
    nchunks = esc_count.shape[0]
    G = (n + 7) // 8
    cap = (HB * (C // 8)) // 3
    sec_slots = np.empty(CODE_BITS * G, np.uint8)
    esc_pos, esc_exp = np.empty(cap * nchunks, np.uint16), np.empty(cap * nchunks, np.uint8)
    high_slots = np.empty(HB * G, np.uint8)

    def work(c0, c1):
        encode_range(src, n, channels, lut, C, c0, c1, codes, rest, esc_count, sec_count, sec_slots, esc_pos,
                     esc_exp, high_slots)

    cpu_parallel.run_ranges(work, cpu_parallel.split(nchunks, C * src.itemsize))
    ns, ne, nh = _compact(esc_count, sec_count, n, C, HB, sec_slots, esc_pos, esc_exp, high_slots)
    return sec_slots[:ns].copy(), esc_pos[:ne].copy(), esc_exp[:ne].copy(), high_slots[:nh].copy()


def decode(codes, rest, tables, channels, esc_count, sec_count, sec_codes, esc_pos, esc_exp, exp_high, n, fmt, C,
           dst) -> int:
    """Rebuild the n values into dst; returns 0 or the error code (kvzip.errors.CHANNEL_DECODE_ERRORS)
    a serial decoder meets first.  The callers have checked every stream's dtype and the lengths
    that follow from n (codes, rest, tables, the counts)."""
    E, M = fmt.exp_bits, fmt.mant_bits
    _, decode_range = kernels(E, M)
    nchunks = esc_count.shape[0]
    sec_off, esc_off, plane_off = (np.empty(nchunks, np.int64) for _ in range(3))
    stop, count_error = _decode_offsets(esc_count, sec_count, n, C, E - CODE_BITS, sec_codes.shape[0],
                                        esc_pos.shape[0], exp_high.shape[0], sec_off, esc_off, plane_off)

    def work(c0, c1):
        return decode_range(codes, rest, tables, channels, esc_count, sec_count, esc_off, sec_off, plane_off,
                            esc_pos, esc_exp, exp_high, sec_codes, n, C, c0, c1, dst)

    errors = [e for e in cpu_parallel.run_ranges(work, cpu_parallel.split(stop, C * dst.itemsize)) if e >= 0]
    if count_error >= 0:
        errors.append(count_error)
    return min(errors) % 8 if errors else 0
