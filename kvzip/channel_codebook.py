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

import copy
import json
from numbers import Integral

import numpy as np

from .auto_codebook import FULL_READ_BELOW, sample_indices
from .calibrate import count_samples
from .codebook import _as_format, checked_label, read_json
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
    if n < FULL_READ_BELOW:
        return _count(bits, np.arange(n, dtype=np.intp), fmt, channels)
    where = sample_indices(n)
    return _count(bits[where], where.astype(np.intp), fmt, channels)


def channel_counts(bits: np.ndarray, fmt, channels: int, step: int = 1 << 20) -> np.ndarray:
    """int64[channels, 2**E]: exponent counts of every value of each channel (calibration counts
    all of them; a tensor's own tables come from channel_histogram's sample).  bits: flat raw
    bits; counted ``step`` values at a time, so the temporaries stay small."""
    out = np.zeros((channels, 1 << fmt.exp_bits), np.int64)
    for at in range(0, bits.shape[0], step):
        part = bits[at:at + step]
        out += _count(part, np.arange(at, at + part.shape[0], dtype=np.intp), fmt, channels)
    return out


def _count(values: np.ndarray, index: np.ndarray, fmt, channels: int) -> np.ndarray:
    """int64[channels, 2**E]: counts of the values (at positions ``index``) by channel and exponent."""
    E = fmt.exp_bits
    e = (values >> fmt.mant_bits).astype(np.intp) & ((1 << E) - 1)
    if channels > 1:
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


TABLE_OUT_OF_RANGE, TABLE_REPEAT = 1, 2  # check_tables's findings, in its order (the GPU's codes too)


def table_error_text(code: int, fmt) -> str:
    """check_tables's message for one of its findings."""
    if code == TABLE_OUT_OF_RANGE:
        return f"a channel table holds an exponent >= 2**{fmt.exp_bits}"
    return "a channel table repeats an exponent"


def check_tables(tables: np.ndarray, fmt) -> None:
    """A blob's tables: every entry an exponent of fmt, the 15 of a channel distinct
    (FormatError otherwise; an entry out of range anywhere is reported before a repeat).  The
    caller has checked the stream's length."""
    rows = np.asarray(tables).reshape(-1, TABLE_WIDTH)
    if rows.size and int(rows.max()) >= 1 << fmt.exp_bits:
        raise FormatError(table_error_text(TABLE_OUT_OF_RANGE, fmt))
    ordered = np.sort(rows, axis=1)
    if (ordered[:, 1:] == ordered[:, :-1]).any():
        raise FormatError(table_error_text(TABLE_REPEAT, fmt))


def calibrate_channels(samples, format=None, name=None, *, provenance=None, progress=None) -> ChannelCodebook:
    """Calibrate the ratio mode's per-channel tables on sample tensors (``mode="ratio"`` with
    ``codebook=`` the result codes every tensor with them instead of choosing tables from it).

    ``samples`` as for ``calibrate``; every tensor must have the same channels (its last axis,
    when a power of two up to 256: KV's head_dim) and format.  Every value is counted; each
    channel's table follows the rule a tensor's own tables follow (kvzip/channel_codebook.py), on
    the counts of all samples.  ``provenance`` and ``progress`` as for ``calibrate``.
    """
    channels = []

    def count(bits, fmt):
        d = channels_of(bits.shape)
        if channels and d != channels[0]:
            raise ValueError(f"all samples must have the same channels: a tensor of shape {bits.shape} has {d}, "
                             f"earlier ones {channels[0]} (the last axis, when a power of two up to 256; else 1)")
        channels[:1] = [d]
        return channel_counts(bits.reshape(-1), fmt, d)

    fmt, hist, record = count_samples(samples, format, count, progress)
    record["channels"] = channels[0]
    record.update(provenance or {})
    return ChannelCodebook(rank_tables(hist), fmt, name=name, provenance=record)


class ChannelCodebook:
    """The ratio mode's tables chosen offline: for each of D channels (a power of two, at most
    MAX_CHANNELS) the TABLE_WIDTH exponents of its table in rank order (entries 0..6 take codes
    0..6, entries 7..14 code 7 and second-level indices 0..7), for one float format.

    ``kvzip.compress(x, codebook=cb, mode="ratio")`` codes every tensor of D channels with these
    tables instead of choosing them from the tensor.  The blob still holds the tables (docs/format.md
    section 15), so a decoder needs nothing else.  Made by ``kvzip.calibrate_channels`` (``kvzip
    calibrate --mode ratio``), kept as JSON like a Codebook.  Immutable; equal by format and tables.
    """

    __slots__ = ("format", "tables", "name", "_provenance", "_array")
    KIND = "channel_codebook"
    _KEYS = ("kind", "name", "format", "tables", "provenance")

    def __init__(self, tables, format, name=None, provenance=None):
        fmt = _as_format(format)
        try:
            rows = [tuple(row) for row in tables]
        except TypeError:
            raise ValueError(f"channel tables must be a sequence of rows of {TABLE_WIDTH} exponents, "
                             f"got {type(tables).__name__}") from None
        D = len(rows)
        if not (1 <= D <= MAX_CHANNELS and D & (D - 1) == 0):
            raise ValueError(f"a channel codebook holds a power of two of channels, 1 to {MAX_CHANNELS}; got {D}")
        for d, row in enumerate(rows):
            if len(row) != TABLE_WIDTH:
                raise ValueError(f"channel {d}'s table has {len(row)} exponents; each needs {TABLE_WIDTH}")
            for e in row:
                if type(e) is not int and (isinstance(e, bool) or not isinstance(e, Integral)):
                    raise ValueError(f"channel {d}'s table: exponents must be ints, got {e!r} ({type(e).__name__})")
        array = np.array(rows, dtype=np.int64).reshape(D, TABLE_WIDTH)
        if array.min() < 0 or array.max() >= 1 << fmt.exp_bits:
            raise ValueError(f"channel tables hold exponents outside {fmt.name}'s 0..{(1 << fmt.exp_bits) - 1}")
        try:
            check_tables(array, fmt)
        except FormatError:
            d = int(np.nonzero((np.diff(np.sort(array, axis=1), axis=1) == 0).any(axis=1))[0][0])
            raise ValueError(f"channel {d}'s table repeats an exponent: {list(map(int, array[d]))}") from None
        name, provenance = checked_label(name, provenance)
        set_ = object.__setattr__
        set_(self, "format", fmt)
        set_(self, "tables", tuple(tuple(map(int, row)) for row in array))
        set_(self, "name", name)
        set_(self, "_provenance", provenance)
        set_(self, "_array", array.astype(np.uint8).reshape(-1))

    def __setattr__(self, key, value):
        raise AttributeError("ChannelCodebook is immutable; build a new one")

    @property
    def channels(self) -> int:
        return len(self.tables)

    @property
    def provenance(self) -> dict:
        """Where the tables came from (a copy)."""
        return copy.deepcopy(self._provenance)

    def tables_stream(self) -> np.ndarray:
        """uint8[channels * TABLE_WIDTH]: the blob's tables stream (a copy)."""
        return self._array.copy()

    def check_tensor(self, fmt, shape) -> None:
        """ValueError unless a tensor of this format and shape can be coded with these tables."""
        if fmt != self.format:
            raise ValueError(f"the channel codebook is for {self.format.name}; the tensor is {fmt.name}")
        d = channels_of(shape)
        if d != self.channels:
            raise ValueError(f"the channel codebook has {self.channels} channels; a tensor of shape {tuple(shape)} "
                             f"has {d} (its last axis, when a power of two up to {MAX_CHANNELS}; else 1)")

    # ---- (de)serialisation ---------------------------------------------------------------
    def to_dict(self, *, provenance: bool = True) -> dict:
        d = {"kind": self.KIND, "name": self.name, "format": self.format.name,
             "tables": [list(row) for row in self.tables]}
        if provenance:
            d["provenance"] = self.provenance
        return d

    @classmethod
    def from_dict(cls, d) -> "ChannelCodebook":
        if not isinstance(d, dict):
            raise ValueError(f"a channel codebook must be a dict, got {type(d).__name__}")
        if "exponents" in d and "tables" not in d:
            raise ValueError("this is a Top-16 codebook (mode='speed'), not the ratio mode's channel tables")
        unknown = sorted(set(d) - set(cls._KEYS))
        if unknown:
            raise ValueError(f"unknown channel codebook key(s) {unknown}; expected {list(cls._KEYS)}")
        if d.get("kind", cls.KIND) != cls.KIND:
            raise ValueError(f"'kind' of a channel codebook is {cls.KIND!r}, got {d.get('kind')!r}")
        missing = [k for k in ("format", "tables") if k not in d]
        if missing:
            raise ValueError(f"channel codebook dict lacks {missing}")
        if not isinstance(d["format"], str) or not isinstance(d["tables"], list):
            raise ValueError("a channel codebook's 'format' is a string and its 'tables' a list of lists")
        return cls(d["tables"], d["format"], name=d.get("name"), provenance=d.get("provenance"))

    def to_json(self, path=None) -> str:
        """The codebook as JSON text, a channel's table a line; also written to ``path`` when given."""
        d = self.to_dict()
        rows = ",\n    ".join(json.dumps(row) for row in d["tables"])
        text = json.dumps({**d, "tables": None}, indent=2).replace(
            '\n  "tables": null', '\n  "tables": [\n    ' + rows + "\n  ]", 1) + "\n"
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, text_or_path) -> "ChannelCodebook":
        """Parse JSON text, or read a file when given a path (anything not starting with '{')."""
        return cls.from_dict(read_json(text_or_path, "channel codebook JSON"))

    # ---- identity --------------------------------------------------------------------------
    def __eq__(self, other):
        if not isinstance(other, ChannelCodebook):
            return NotImplemented
        return self.format == other.format and self.tables == other.tables

    def __hash__(self):
        return hash((self.format.name, self.tables))

    def __repr__(self):
        label = f"{self.name!r}, " if self.name else ""
        return f"ChannelCodebook({label}{self.format.name}, {self.channels} channels)"

    def __reduce__(self):
        return (ChannelCodebook, (self.tables, self.format.name, self.name, self._provenance))
