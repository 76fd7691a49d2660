"""The ratio mode's per-channel two-level codebook: for each channel, the 7 exponents it codes
in 3 bits and the 8 it codes in 3 + 3, chosen from the tensor being compressed.

This module is the reference for the choice; a GPU kernel must follow the same rule, so it is
defined on the tensor's raw bits with integer arithmetic only and is a pure function of them.
docs/format.md section 15 is the normative description of how the tables are used.

**Channels.**  A tensor's values are taken in memory (C) order, ``bits[0 .. n-1]``.  With
``shape[-1]`` a power of two in ``[1, MAX_CHANNELS]`` the tensor has ``D = shape[-1]`` channels
and value ``i`` belongs to channel ``i & (D - 1)`` (= ``i % D``: its index on the last axis, the
head dimension of a ``[heads, tokens, head_dim]`` KV tensor).  Any other shape (a 0-d tensor,
a last axis of 0, 96, 384, or above 256) has one channel.  Powers of two only, so that a
decoder finds a value's channel with a mask and every chunk (a power of two of at least 8
values) starts at channel 0 when ``D <= chunk``; 256 at most, so the tables (15 bytes a channel,
3840 at most) stay small beside the tensor and fit a GPU block's shared memory.

**The sample.**  The values counted are kvzip/auto_codebook.py's sample (``sample_indices``):
all of them below 2^20 values, one run of 256 consecutive values in every block beyond.  A run
of 256 consecutive values holds every channel ``256 / D`` times, so each channel is sampled
equally.

**The choice**, for each channel ``d`` with ``count[d][e]`` = sampled values of channel ``d``
whose exponent field is ``e``:

* ``mode`` = the lowest exponent among those of the largest count (0 for a channel with no
  sampled value);
* rank every exponent by the key, ascending:
  ``(count == 0, -count if count > 0 else |e - mode|, e)``: seen exponents by count
  descending, ties to the lower exponent; then unseen ones nearest the mode first (they are the
  likeliest outside the sample), ties to the lower exponent;
* the channel's table is the first ``TABLE_WIDTH = 15`` by rank: entries 0..6 (PRIMARY) are the
  exponents of codes 0..6, entries 7..14 (SECONDARY) those of second-level indices 0..7.

Exponents not in a channel's table are escapes.  (No exponent is forced into a table, unlike
the speed mode's exponent 0: a channel whose values are often zero ranks 0 by its count.)
"""
from __future__ import annotations

import numpy as np

from .auto_codebook import FULL_READ_BELOW, sample_indices
from .errors import FormatError

CODE_BITS = 3        # a value's code in the code plane; also the width of a second-level index
PRIMARY = 7          # codes 0..6: the channel's 7 most frequent exponents
SECONDARY = 8        # code 7 + a 3-bit index: the next 8
TABLE_WIDTH = PRIMARY + SECONDARY
MAX_CHANNELS = 256
ESCAPE = 255         # encode_lut's mark of an exponent outside the channel's table


def channels_of(shape) -> int:
    """The number of channels of a tensor of this shape (module docstring)."""
    d = shape[-1] if len(shape) else 0
    return d if 1 <= d <= MAX_CHANNELS and d & (d - 1) == 0 else 1


def channel_histogram(bits: np.ndarray, fmt, channels: int) -> np.ndarray:
    """int64[channels, 2**E]: exponent counts of the sampled values of each channel (the
    reference; ChannelPack counts with stages/channel_pack_cpu.py's compiled pass).  bits: the
    tensor's raw bits, flat, in the format's unsigned dtype."""
    n = bits.shape[0]
    E, M = fmt.exp_bits, fmt.mant_bits
    if n < FULL_READ_BELOW:
        values, where = bits, None
    else:
        where = sample_indices(n)
        values = bits[where]
    e = (values >> M).astype(np.intp) & ((1 << E) - 1)
    if channels > 1:
        index = np.arange(n, dtype=np.intp) if where is None else where.astype(np.intp)
        e |= (index & (channels - 1)) << E
    return np.bincount(e, minlength=channels << E).reshape(channels, 1 << E)


def rank_tables(hist: np.ndarray) -> np.ndarray:
    """uint8[channels, TABLE_WIDTH]: each channel's table from its histogram (the rule above)."""
    hist = np.asarray(hist, dtype=np.int64)
    exps = np.broadcast_to(np.arange(hist.shape[1]), hist.shape)
    mode = np.argmax(hist, axis=1)[:, None]  # the lowest exponent among the most frequent
    unseen = hist == 0
    # lexsort: the last key is the primary one; it sorts along the last axis, each channel alone.
    order = np.lexsort((exps, np.where(unseen, np.abs(exps - mode), 0), -hist, unseen))
    return order[:, :TABLE_WIDTH].astype(np.uint8)


def tables_of(bits: np.ndarray, fmt, channels: int) -> np.ndarray:
    """The tables stream of a tensor: uint8[channels * TABLE_WIDTH], channel 0's table first (the
    reference composition of the two steps above)."""
    return rank_tables(channel_histogram(bits, fmt, channels)).reshape(-1)


def encode_lut(tables: np.ndarray, fmt) -> np.ndarray:
    """uint8[channels << E]: entry ``(d << E) | e`` is e's place in channel d's table (0..14) or
    ESCAPE."""
    rows = tables.reshape(-1, TABLE_WIDTH).astype(np.intp)
    lut = np.full((rows.shape[0], 1 << fmt.exp_bits), ESCAPE, np.uint8)
    lut[np.arange(rows.shape[0])[:, None], rows] = np.arange(TABLE_WIDTH, dtype=np.uint8)
    return lut.reshape(-1)


def check_tables(tables: np.ndarray, fmt) -> None:
    """A blob's tables: every entry an exponent of fmt, the 15 of a channel distinct
    (FormatError otherwise).  The caller has checked the stream's length."""
    rows = np.asarray(tables).reshape(-1, TABLE_WIDTH)
    if rows.size and int(rows.max()) >= 1 << fmt.exp_bits:
        raise FormatError(f"a channel table holds an exponent >= 2**{fmt.exp_bits}")
    ordered = np.sort(rows, axis=1)
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        raise FormatError("a channel table repeats an exponent")
