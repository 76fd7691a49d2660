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

from kvzip.auto_codebook import AUTO, auto_codebook_on
from kvzip.bitpack import groups, pack_bits, unpack_bits
from kvzip.channel_codebook import ChannelCodebook
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
        """codebook: None (the shipped default for the data's format), "auto" (chosen for each
        tensor from a sample of its own exponents: kvzip/auto_codebook.py), a shipped name such
        as "bf16-kv", a Codebook, or its dict form."""
        if isinstance(codebook, dict):
            codebook = Codebook.from_dict(codebook)
        elif codebook == AUTO:
            pass
        elif isinstance(codebook, str):
            codebook = Codebook.load(codebook)
        elif codebook is not None and not isinstance(codebook, Codebook):
            hint = " (the ratio mode's: mode='ratio')" if isinstance(codebook, ChannelCodebook) else ""
            raise TypeError(f"codebook must be None, a name, a dict or a Codebook, got {type(codebook).__name__}{hint}")
        self.codebook = codebook

    @property
    def auto(self) -> bool:
        """Whether the codebook is chosen per tensor (codebook="auto")."""
        return self.codebook == AUTO

    def get_config(self):
        codebook = self.codebook
        return {"id": self.id, "codebook": codebook if codebook is None or codebook == AUTO else codebook_meta(codebook)}

    def codebook_for(self, fmt) -> Codebook:
        """The fixed codebook for fmt (not for "auto": codebook_of)."""
        if self.auto:
            raise AssertionError("an auto codebook depends on the tensor: codebook_of")
        return resolve_codebook(self.codebook, fmt)

    def codebook_of(self, frame: Frame, name: str = "data") -> Codebook:
        """The codebook for the tensor in frame (its stream name: the values, or "exponent")."""
        if not self.auto:
            return self.codebook_for(frame.format)
        return auto_codebook_on(frame.backend, frame.streams[name].reshape(-1), frame.format, name == "exponent")

    def encode(self, frame: Frame) -> Frame:
        fmt, xp, n = frame.format, frame.backend.xp, frame.n
        exponent = frame.expect("exponent", np.uint8, n)
        cb = self.codebook_of(frame, "exponent")
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
