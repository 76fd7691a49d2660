"""Top16Pack: exponents -> 4-bit codes through a Top-16 codebook; sign+mantissa bit-packed.

Output streams (layouts in docs/format.md):
  codes     4 bits per value, kvzip.bitpack layout; an exponent outside the codebook gets code 0
            (EscapeStream records its true exponent)
  rest      sign+mantissa, R = 1 + mantissa bits per value, kvzip.bitpack layout
  exponent  passed through untouched: EscapeStream, which must follow, needs it to find escapes

The codebook travels in the container (``meta["codebook"]``), so a decoder needs no shared state.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from kvzip.bitpack import groups, pack_bits, unpack_bits
from kvzip.codebook import Codebook, resolve_codebook
from kvzip.errors import FormatError
from kvzip.frame import Frame

from .base import PACKED, SPLIT, Stage, register
from .exponent_split import rest_dtype

ESCAPE = 255  # Codebook.encode_lut()'s mark for "not in the codebook"


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


def frame_codebook(frame: Frame) -> Codebook:
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


@register
class Top16Pack(Stage):
    id = "top16_pack"
    input_kind = (SPLIT,)
    output_kind = PACKED
    consumes = ("rest",)
    produces = ("codes", "rest")

    def __init__(self, codebook=None):
        """codebook: None (the shipped default for the data's format), a shipped name such as
        "bf16-kv", a Codebook, or its dict form."""
        if isinstance(codebook, dict):
            codebook = Codebook.from_dict(codebook)
        elif isinstance(codebook, str):
            codebook = Codebook.load(codebook)
        elif codebook is not None and not isinstance(codebook, Codebook):
            raise TypeError(f"codebook must be None, a name, a dict or a Codebook, got {type(codebook).__name__}")
        self.codebook = codebook

    def get_config(self):
        return {"id": self.id, "codebook": None if self.codebook is None else codebook_meta(self.codebook)}

    def codebook_for(self, fmt) -> Codebook:
        return resolve_codebook(self.codebook, fmt)

    def encode(self, frame: Frame) -> Frame:
        fmt, xp, n = frame.format, frame.backend.xp, frame.n
        cb = self.codebook_for(fmt)
        exponent = frame.expect("exponent", np.uint8, n)
        rest = frame.expect("rest", rest_dtype(fmt), n)
        code = frame.backend.from_numpy(cb.encode_lut())[exponent]
        code[code == ESCAPE] = 0
        out = frame.replace(codes=pack_bits(xp, code, 4), rest=pack_bits(xp, rest, fmt.rest_bits))
        out.meta["codebook"] = codebook_meta(cb)
        return out

    def decode(self, frame: Frame) -> Frame:
        fmt, xp, n = frame.format, frame.backend.xp, frame.n
        frame.expect("codes", np.uint8, 4 * groups(n))
        packed = frame.expect("rest", np.uint8, fmt.rest_bits * groups(n))
        frame.expect("exponent", np.uint8, n)
        rest = unpack_bits(xp, packed, fmt.rest_bits, n, rest_dtype(fmt))
        out = frame.replace(drop=("codes",), rest=rest)
        out.meta.pop("codebook", None)
        return out
