"""Top16Pack: exponents -> 4-bit codes through a Top-16 codebook; sign+mantissa bit-packed.

Output streams (layouts in docs/format.md):
  codes     4 bits per value, kvzip.bitpack layout; an exponent outside the codebook gets code 0
            (EscapeStream records its true exponent)
  rest      sign+mantissa, R = 1 + mantissa bits per value, kvzip.bitpack layout
  exponent  passed through untouched: EscapeStream, which must follow, needs it to find escapes

The codebook travels in the container (``meta["codebook"]``), so a decoder needs no shared state.
"""
from __future__ import annotations


import numpy as np

from kvzip.bitpack import groups, pack_bits, unpack_bits
from kvzip.codebook import Codebook, codebook_meta, resolve_codebook
from kvzip.frame import Frame

from .base import PACKED, SPLIT, Stage, register
from .exponent_split import rest_dtype

ESCAPE = 255  # Codebook.encode_lut()'s mark for "not in the codebook"


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
