"""ChannelRans's CPU kernels: interleaved rANS over each value's exponent, chunks in parallel
threads, GIL released.  docs/format.md section 16 is the normative description; the algorithm is
Duda's rANS (2013) with Giesen's interleaving of independent states over one word stream.

The bytes are section 16's for any number of threads, because every chunk's output lies at a
position known in advance or is moved there by a serial pass:

* encode: chunk c's rest bytes lie at R g of its groups g and its LANES states at LANES c, always.
  Its 16-bit words (at most one a value: 16-bit renormalisation of a 32-bit state with 12-bit
  frequencies emits at most one word a symbol) are written backward into the slot
  ``[c C, c C + len_c)`` and its escaped exponents forward into the same slot of an escape
  buffer; ``_compact`` then moves every chunk's runs to the front in chunk order.
* decode: a serial pass over the two uint32 counts a chunk (``_decode_offsets``) finds where
  each chunk's words and escapes start and checks them against the streams' lengths; the threads
  then decode chunk ranges.  The error reported is the one a serial decoder meets first: the
  lowest chunk's, the stream totals last.

Kernels are specialised per (E, M) (closures over ints: kvzip/jit.py's cache rules).
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvzip import cpu_parallel
from kvzip.bitlogic import CPU
from kvzip.jit import cpu_jit

from .channel_pack_cpu import _put_bytes, _take_bits, runs_histogram

value_exponent, value_rest, join_value = CPU.value_exponent, CPU.value_rest, CPU.join_value

LANES = 32          # interleaved states a chunk: value j of a chunk is lane j % LANES's
PROB_BITS = 12      # every table's frequencies sum to 2**PROB_BITS
STATE_LOW = 1 << 16  # a state lies in [STATE_LOW, 2**32) between symbols
WORD_BITS = 16      # renormalisation moves 16-bit words
HIST_RUN = 1 << 16  # values a histogram run counts (threads take ranges of runs)

_jit = cpu_jit(nogil=True)


@lru_cache(maxsize=None)
def kernels(E: int, M: int):
    """(encode_range, decode_range) for the format with E exponent and M mantissa bits."""
    R = M + 1
    RMASK = (1 << R) - 1
    WORD_REST = R <= 8  # a group's rest bits fit one 64-bit word (bf16, e4m3, e5m2)
    EMASK = (1 << E) - 1
    ESC = 1 << E        # the escape symbol's index in a table's freq / cum rows
    SLOT_MASK = (1 << PROB_BITS) - 1
    WORD_MASK = (1 << WORD_BITS) - 1
    # A state x encodes a symbol of frequency f without leaving [STATE_LOW, 2**32) iff
    # x < f << (32 - PROB_BITS): the renormalisation bound (one word out when it does not hold).
    BOUND_SHIFT = 32 - PROB_BITS

    @_jit
    def encode_range(src, n, DM, shift, freq, cum, C, c0, c1, rest, states, word_slots, word_count, esc_slots,
                     esc_count):
        """Chunks c0..c1: rest and states in place, word and escape runs at the start of their slots."""
        x = np.empty(LANES, np.int64)
        for c in range(c0, c1):
            base = c * C
            length = min(C, n - base)
            for g in range((base + 7) // 8, (base + length + 7) // 8):  # rest: R bytes a group of 8
                acc = 0
                nacc = 0
                out = g * R
                for i in range(8 * g, 8 * g + 8):
                    r = value_rest(int(src[i]), E, M) if i < n else 0
                    out, acc, nacc = _put_bytes(rest, out, acc | (r << nacc), nacc + R)
            ne = 0
            for i in range(base, base + length):  # escapes in value order, the order a decoder meets them
                e = value_exponent(int(src[i]), E, M)
                if freq[((i & DM) >> shift), e] == 0:
                    esc_slots[base + ne] = e
                    ne += 1
            esc_count[c] = ne
            for lane in range(LANES):
                x[lane] = STATE_LOW
            p = base + length  # words go backward: the decoder reads them forward
            for j in range(length - 1, -1, -1):
                i = base + j
                g = (i & DM) >> shift
                s = value_exponent(int(src[i]), E, M)
                f = int(freq[g, s])
                if f == 0:
                    s = ESC
                    f = int(freq[g, ESC])
                lane = j % LANES
                xs = x[lane]
                if xs >= f << BOUND_SHIFT:
                    p -= 1
                    word_slots[p] = xs & WORD_MASK
                    xs >>= WORD_BITS
                x[lane] = ((xs // f) << PROB_BITS) + xs % f + int(cum[g, s])
            nw = base + length - p
            for k in range(nw):
                word_slots[base + k] = word_slots[p + k]
            word_count[c] = nw
            for lane in range(LANES):
                states[c * LANES + lane] = x[lane]

    @_jit
    def decode_range(rest, states, words, word_off, word_count, esc_exp, esc_off, esc_count, freq, cum, sym_of, DM,
                     shift, n, C, c0, c1, dst):
        """Decode chunks c0..c1 into dst; returns 8 * chunk + error code of the first bad chunk, or -1."""
        x = np.empty(LANES, np.int64)
        for c in range(c0, c1):
            base = c * C
            length = min(C, n - base)
            for lane in range(LANES):
                x[lane] = int(states[c * LANES + lane])
                if x[lane] < STATE_LOW:
                    return 8 * c + 1
            wp = word_off[c]
            wend = wp + int(word_count[c])
            ep = esc_off[c]
            eend = ep + int(esc_count[c])
            for g in range(base // 8, (base + length + 7) // 8):
                acc = 0
                nacc = 0
                inp = g * R
                if WORD_REST:
                    acc = _take_bits(rest, inp, 0, 0, 8 * R)[1]
                for i in range(8 * g, min(8 * g + 8, base + length)):
                    if WORD_REST:
                        r = (acc >> (R * (i - 8 * g))) & RMASK
                    else:
                        inp, acc, nacc = _take_bits(rest, inp, acc, nacc, R)
                        r = acc & RMASK
                        acc >>= R
                        nacc -= R
                    lane = (i - base) % LANES
                    gi = (i & DM) >> shift
                    xs = x[lane]
                    slot = xs & SLOT_MASK
                    s = int(sym_of[gi, slot])
                    xs = int(freq[gi, s]) * (xs >> PROB_BITS) + slot - int(cum[gi, s])
                    if xs < STATE_LOW:
                        if wp == wend:
                            return 8 * c + 2
                        xs = (xs << WORD_BITS) | int(words[wp])
                        wp += 1
                    x[lane] = xs
                    if s == ESC:
                        if ep == eend:
                            return 8 * c + 3
                        s = int(esc_exp[ep])
                        ep += 1
                        if s > EMASK or freq[gi, s] != 0:
                            return 8 * c + 4
                    dst[i] = join_value(s, r, E, M)
            if wp != wend:
                return 8 * c + 2
            if ep != eend:
                return 8 * c + 3
            for lane in range(LANES):
                if x[lane] != STATE_LOW:
                    return 8 * c + 5
        return -1

    return encode_range, decode_range


def histogram(src, fmt, channels):
    """int64[channels, 2**E]: every value's exponent counted by channel (all values: the tables
    must cover the whole tensor), in runs of HIST_RUN values."""
    return runs_histogram(src, fmt, channels, np.arange(0, src.shape[0], HIST_RUN, dtype=np.int64), HIST_RUN)


@_jit
def _compact(counts, C, slots):
    """Move each chunk's run (counts[c] items at c * C) to the front, in chunk order; returns the total."""
    at = 0
    for c in range(counts.shape[0]):
        k = int(counts[c])
        for t in range(k):
            slots[at + t] = slots[c * C + t]
        at += k
    return at


@_jit
def _decode_offsets(word_count, esc_count, n, C, n_words, n_esc, word_off, esc_off):
    """Where each chunk's runs start, checking the counts against the chunk lengths and the
    streams' lengths.  Returns (the chunks that may be decoded, 8 * chunk + error code or -1)."""
    nw = 0
    ne = 0
    nchunks = word_count.shape[0]
    for c in range(nchunks):
        length = min(C, n - c * C)
        word_off[c] = nw
        esc_off[c] = ne
        w = int(word_count[c])
        k = int(esc_count[c])
        if w > length or nw + w > n_words:
            return c, 8 * c + 2
        if k > length or ne + k > n_esc:
            return c, 8 * c + 3
        nw += w
        ne += k
    if nw != n_words:
        return nchunks, 8 * nchunks + 2
    if ne != n_esc:
        return nchunks, 8 * nchunks + 3
    return nchunks, -1


def encode(src, n, fmt, channels, shift, freq, cum, C, rest, states, word_count, esc_count):
    """Fill rest, states and the two counts (sized for n values in chunks of C); returns the
    words (uint16) and escaped exponents (uint8) as new arrays."""
    encode_range, _ = kernels(fmt.exp_bits, fmt.mant_bits)
    word_slots, esc_slots = np.empty(n, np.uint16), np.empty(n, np.uint8)

    def work(c0, c1):
        encode_range(src, n, channels - 1, shift, freq, cum, C, c0, c1, rest, states, word_slots, word_count,
                     esc_slots, esc_count)

    cpu_parallel.run_ranges(work, cpu_parallel.split(word_count.shape[0], C * src.itemsize))
    nw = _compact(word_count, C, word_slots)
    ne = _compact(esc_count, C, esc_slots)
    return word_slots[:nw].copy(), esc_slots[:ne].copy()


def decode(rest, states, words, word_count, esc_exp, esc_count, freq, cum, sym_of, channels, shift, n, fmt, C,
           dst) -> int:
    """Rebuild the n values into dst; returns 0 or the error code (kvzip.errors.RANS_DECODE_ERRORS)
    a serial decoder meets first.  The caller has checked every stream's dtype, the lengths that
    follow from n and the tables."""
    _, decode_range = kernels(fmt.exp_bits, fmt.mant_bits)
    nchunks = word_count.shape[0]
    word_off, esc_off = np.empty(nchunks, np.int64), np.empty(nchunks, np.int64)
    stop, count_error = _decode_offsets(word_count, esc_count, n, C, words.shape[0], esc_exp.shape[0], word_off,
                                        esc_off)

    def work(c0, c1):
        return decode_range(rest, states, words, word_off, word_count, esc_exp, esc_off, esc_count, freq, cum, sym_of,
                            channels - 1, shift, n, C, c0, c1, dst)

    errors = [e for e in cpu_parallel.run_ranges(work, cpu_parallel.split(stop, C * dst.itemsize)) if e >= 0]
    if count_error >= 0:
        errors.append(count_error)
    return min(errors) % 8 if errors else 0
