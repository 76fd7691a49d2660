"""Top-16 exponent codebooks: which 16 exponents get a 4-bit code, and the lookup tables for it.

Code ``i`` stands for ``exponents[i]``; codes are ordered most frequent first.  Every other
exponent is an *escape* and travels in the sparse escape stream.  A codebook is plain data
(JSON), so it rides inside each blob's pipeline config and the receiver needs nothing else.

Shipped codebooks live as JSON files in the package ``kvzip.codebooks`` (the repository's
``codebooks/`` folder); ``tools/make_codebooks.py`` regenerates them and ``docs/calibration.md``
says how they were calibrated.
"""
from __future__ import annotations

import copy
import json
import math
import os
from functools import lru_cache
from importlib import resources
from numbers import Integral, Real
from typing import Any

import numpy as np

from .errors import FormatError
from .formats import FloatFormat, get_format

N_CODES = 16
ESCAPE = 255  # encode_lut entry of an exponent that has no code

_DICT_KEYS = ("name", "format", "exponents", "coverage", "provenance")


def _as_format(fmt) -> FloatFormat:
    try:
        return get_format(fmt)
    except TypeError as e:
        raise ValueError(str(e)) from None


class Codebook:
    """16 distinct exponents of one float format; code ``i`` <-> ``exponents[i]``.

    Immutable (it is hashed and shared from a cache); build a new one to change anything.
    """

    __slots__ = ("format", "exponents", "name", "coverage", "_provenance")

    def __init__(self, exponents, format, name=None, coverage=None, provenance=None):
        fmt = _as_format(format)
        try:
            exps = list(exponents)
        except TypeError:
            raise ValueError(f"codebook exponents must be a sequence of {N_CODES} ints, "
                             f"got {type(exponents).__name__}") from None
        if len(exps) != N_CODES:
            raise ValueError(f"a codebook needs exactly {N_CODES} exponents, got {len(exps)}")
        for e in exps:
            # bool is an Integral too, but True as an exponent is surely a mistake.  A plain int
            # is decided without the ABC check, which costs a microsecond (compress may build a
            # codebook per call).
            if type(e) is not int and (isinstance(e, bool) or not isinstance(e, Integral)):
                raise ValueError(f"codebook exponents must be ints, got {e!r} ({type(e).__name__})")
        exps = tuple(map(int, exps))
        limit = 1 << fmt.exp_bits
        bad = [e for e in exps if not 0 <= e < limit]
        if bad:
            raise ValueError(f"exponents {bad} out of range for {fmt.name}: "
                             f"its {fmt.exp_bits}-bit exponent lies in [0, {limit - 1}]")
        if len(set(exps)) != N_CODES:
            dups = sorted({e for e in exps if exps.count(e) > 1})
            raise ValueError(f"codebook exponents must be distinct; repeated: {dups}")
        if coverage is not None:
            if isinstance(coverage, bool) or not isinstance(coverage, Real) or not 0.0 <= coverage <= 1.0:
                raise ValueError(f"coverage must be a fraction in [0, 1] or None, got {coverage!r}")
            coverage = float(coverage)
        name, provenance = checked_label(name, provenance)
        set_ = object.__setattr__
        set_(self, "format", fmt)
        set_(self, "exponents", exps)
        set_(self, "name", name)
        set_(self, "coverage", coverage)
        set_(self, "_provenance", provenance)

    def __setattr__(self, key, value):
        raise AttributeError("Codebook is immutable; build a new one")

    @property
    def provenance(self) -> dict:
        """Where the codebook came from (a copy: the codebook itself stays immutable)."""
        return copy.deepcopy(self._provenance)

    # ---- lookup tables -------------------------------------------------------------------

    def encode_lut(self) -> np.ndarray:
        """uint8[2**E]: exponent -> code 0..15, or 255 (ESCAPE) for an exponent without a code."""
        lut = np.full(1 << self.format.exp_bits, ESCAPE, dtype=np.uint8)
        lut[list(self.exponents)] = np.arange(N_CODES, dtype=np.uint8)
        return lut

    def decode_lut(self) -> np.ndarray:
        """uint8[16]: code -> exponent."""
        return np.array(self.exponents, dtype=np.uint8)

    def coverage_of(self, exponent_histogram) -> float:
        """Fraction of the values counted in ``exponent_histogram`` (length 2**E) that get a code.

        An empty histogram is fully covered (it produces no escapes).
        """
        hist = np.asarray(exponent_histogram)
        if hist.shape != (1 << self.format.exp_bits,):
            raise ValueError(f"expected a histogram of {1 << self.format.exp_bits} {self.format.name} "
                             f"exponents, got shape {hist.shape}")
        total = hist.sum()
        if total == 0:
            return 1.0
        return float(hist[list(self.exponents)].sum() / total)

    # ---- (de)serialisation ---------------------------------------------------------------

    def to_dict(self, *, provenance: bool = True) -> dict[str, Any]:
        """JSON-able form.  ``provenance=False`` leaves out the calibration record (about 1 kB
        with its exponent histogram), for embedding the codebook in every blob's header."""
        d = {
            "name": self.name,
            "format": self.format.name,
            "exponents": list(self.exponents),
            "coverage": self.coverage,
        }
        if provenance:
            d["provenance"] = self.provenance
        return d

    @classmethod
    def from_dict(cls, d) -> "Codebook":
        if not isinstance(d, dict):
            raise ValueError(f"a codebook must be a dict, got {type(d).__name__}")
        if "tables" in d and "exponents" not in d:
            raise ValueError("this is the ratio mode's channel codebook (mode='ratio'), not a Top-16 codebook")
        unknown = sorted(set(d) - set(_DICT_KEYS))
        if unknown:
            raise ValueError(f"unknown codebook key(s) {unknown}; expected {list(_DICT_KEYS)}")
        missing = [k for k in ("format", "exponents") if k not in d]
        if missing:
            raise ValueError(f"codebook dict lacks {missing}")
        fmt, exps = d["format"], d["exponents"]
        # Only spellings JSON produces: a format name and a list of ints.
        if not isinstance(fmt, str):
            raise ValueError(f"codebook 'format' must be a string, got {type(fmt).__name__}")
        if not isinstance(exps, (list, tuple)):
            raise ValueError(f"codebook 'exponents' must be a list, got {type(exps).__name__}")
        coverage = d.get("coverage")
        if isinstance(coverage, float) and math.isnan(coverage):
            raise ValueError("coverage must be a fraction in [0, 1] or None, got nan")
        return cls(exps, fmt, name=d.get("name"), coverage=coverage, provenance=d.get("provenance"))

    def to_json(self, path=None) -> str:
        """The codebook as JSON text; also written to ``path`` when given."""
        d = self.to_dict()
        # The 16 exponents on one line: that line is the codebook, and diffs should show it.
        # "name" and "format" precede it and are one-line strings, so the first match is ours.
        text = json.dumps({**d, "exponents": None}, indent=2).replace(
            '\n  "exponents": null', '\n  "exponents": ' + json.dumps(d["exponents"]), 1) + "\n"
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    @classmethod
    def from_json(cls, text_or_path) -> "Codebook":
        """Parse JSON text, or read a file when given a path (anything not starting with '{')."""
        return cls.from_dict(read_json(text_or_path, "codebook JSON"))

    # ---- shipped codebooks ---------------------------------------------------------------

    @staticmethod
    def available() -> list[str]:
        """Names of the codebooks shipped with kvzip."""
        return list(_available())

    @classmethod
    def load(cls, name: str) -> "Codebook":
        """A shipped codebook by name (see ``available()``)."""
        return _load_shipped(name)

    @classmethod
    def default_for(cls, fmt) -> "Codebook":
        """The shipped default for a float format: ``"<format>-kv"``, calibrated on real KV."""
        return _load_shipped(f"{_as_format(fmt).name}-kv")

    # ---- identity --------------------------------------------------------------------------

    def __eq__(self, other):
        if not isinstance(other, Codebook):
            return NotImplemented
        return self.format == other.format and self.exponents == other.exponents

    def __hash__(self):
        return hash((self.format.name, self.exponents))

    def __repr__(self):
        label = f"{self.name!r}, " if self.name else ""
        cov = f", coverage={self.coverage:.4%}" if self.coverage is not None else ""
        return f"Codebook({label}{self.format.name}, {list(self.exponents)}{cov})"

    def __reduce__(self):
        # __slots__ + a blocking __setattr__ need an explicit recipe for pickle and copy.
        return (Codebook, (self.exponents, self.format.name, self.name, self.coverage, self._provenance))


def checked_label(name, provenance) -> tuple:
    """(name, provenance) of a codebook after their checks (ValueError): a name is a string or
    None; a provenance a JSON-able dict (copied: the caller may change theirs later) or None
    ({})."""
    if name is not None and not isinstance(name, str):
        raise ValueError(f"codebook name must be a string or None, got {type(name).__name__}")
    if provenance is not None and not isinstance(provenance, dict):
        raise ValueError(f"provenance must be a dict, got {type(provenance).__name__}")
    if not provenance:  # an empty one needs neither the check nor a copy
        return name, {}
    try:
        json.dumps(provenance)
    except (TypeError, ValueError, RecursionError) as e:  # RecursionError: nested too deep to copy
        raise ValueError(f"provenance must be JSON-able: {type(e).__name__}: {str(e)[:200]}") from None
    return name, copy.deepcopy(provenance)


def read_json(text_or_path, what: str):
    """The value of JSON text, or of a file's when given a path (anything not starting with '{');
    ValueError naming the file (or ``what``) where it is not valid JSON."""
    if isinstance(text_or_path, (bytes, bytearray)):
        text_or_path = text_or_path.decode("utf-8")
    if isinstance(text_or_path, os.PathLike) or not str(text_or_path).lstrip().startswith("{"):
        with open(text_or_path, encoding="utf-8") as f:
            text = f.read()
        where = os.fspath(text_or_path)
    else:
        text, where = text_or_path, what
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON: {e}") from None


@lru_cache(maxsize=None)
def _available() -> tuple[str, ...]:
    files = resources.files("kvzip.codebooks")
    return tuple(sorted(p.name[: -len(".json")] for p in files.iterdir() if p.name.endswith(".json")))


@lru_cache(maxsize=None)
def _load_shipped(name: str) -> Codebook:
    # Cached: compress() resolves its default codebook on every call.
    names = _available()
    if name not in names:
        raise ValueError(f"no shipped codebook named {name!r}; available: {', '.join(names) or 'none'}")
    text = resources.files("kvzip.codebooks").joinpath(f"{name}.json").read_text(encoding="utf-8")
    return Codebook.from_json(text)


def resolve_codebook(spec, fmt) -> Codebook:
    """Turn what a user passed as ``codebook=`` into a Codebook for format ``fmt``.

    ``spec`` is None (the shipped default for ``fmt``), a shipped codebook's name, a dict as
    from ``Codebook.to_dict()``, or a Codebook.  Its format must be ``fmt``.
    """
    fmt = _as_format(fmt)
    if spec is None:
        cb = Codebook.default_for(fmt)
    elif isinstance(spec, Codebook):
        cb = spec
    elif isinstance(spec, str):
        cb = Codebook.load(spec)
    elif isinstance(spec, dict):
        cb = Codebook.from_dict(spec)
    else:
        raise TypeError(f"codebook must be None, a name, a dict or a Codebook, got {type(spec).__name__}")
    if cb.format != fmt:
        label = f"codebook {cb.name!r}" if cb.name else "the codebook"
        raise ValueError(f"{label} is for {cb.format.name}, but the data is {fmt.name}")
    return cb


def codebook_meta(cb: Codebook) -> dict:
    """The compact form a blob carries: what decoding needs, not the calibration record."""
    return {"name": cb.name, "format": cb.format.name, "exponents": list(cb.exponents)}


@lru_cache(maxsize=256)
def _codebook_from_key(fmt: str, exponents: tuple, name) -> Codebook:
    return Codebook.from_dict({"format": fmt, "exponents": list(exponents), "name": name})


def _cacheable(d) -> bool:
    """Whether a header's codebook may be looked up in _codebook_from_key's cache: of the compact
    form, with exactly typed fields.  The cache matches keys by equality, and 14.0 == 14 and
    False == 0, which Codebook refuses; a short name keeps the cache small in bytes."""
    if not (type(d) is dict and set(d) <= {"name", "format", "exponents"} and type(d.get("format")) is str
            and type(d.get("exponents")) is list and len(d["exponents"]) == 16):
        return False
    name = d.get("name")
    return (name is None or (type(name) is str and len(name) <= 256)) and len(d["format"]) <= 32 \
        and all(type(e) is int for e in d["exponents"])


def frame_codebook(frame) -> Codebook:
    """The codebook a frame was packed with (validated: it comes from an untrusted header;
    cached, since a serving loop decodes blobs of the same few codebooks over and over)."""
    d = frame.meta.get("codebook")
    try:
        if _cacheable(d):
            cb = _codebook_from_key(d["format"], tuple(d["exponents"]), d.get("name"))
        else:
            cb = Codebook.from_dict(d)
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"bad or missing codebook in metadata: {e}") from None
    if cb.format != frame.format:
        raise FormatError(f"codebook is for {cb.format.name}, data is {frame.format.name}")
    return cb
