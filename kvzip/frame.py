"""What flows between stages."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backends import Backend
from .errors import FormatError
from .formats import FloatFormat, get_format


@dataclass
class Frame:
    """Named 1-D streams on one backend plus small JSON-able metadata.

    Conventions every stage follows:

    * a *tensor* frame holds the stream ``data``: the values' raw bits, 1-D, contiguous, in the
      unsigned dtype of their width (``FloatFormat.uint_dtype``);
    * ``meta`` holds ``dtype`` (the caller's original dtype name), ``shape``, ``n`` (element
      count) and ``format`` (the short name of the format ``data`` is in right now); stages add
      what their decoder needs (the codebook, quantization details, the chunk size);
    * a stage leaves streams it does not own untouched (QuantizeFP8's ``scales`` rides along
      to Serialize that way).
    """

    backend: Backend
    streams: dict[str, Any]
    meta: dict[str, Any] = field(default_factory=dict)

    def replace(self, drop=(), **streams) -> "Frame":
        """A new frame with some streams dropped and others added; meta is copied."""
        new = {k: v for k, v in self.streams.items() if k not in drop}
        new.update(streams)
        return Frame(self.backend, new, dict(self.meta))

    def require(self, *names) -> None:
        missing = [n for n in names if n not in self.streams]
        if missing:
            raise FormatError(f"missing stream(s) {missing}; present: {sorted(self.streams)}")

    def expect(self, name: str, dtype, length: int):
        """The stream ``name``, after checking it is 1-D, of ``dtype`` and exactly ``length`` long.
        Decoders call this before any kernel reads the stream."""
        self.require(name)
        a = self.streams[name]
        if a.ndim != 1 or a.dtype != np.dtype(dtype) or a.shape[0] != length:
            raise FormatError(
                f"stream {name!r}: expected {length} values of {np.dtype(dtype)}, "
                f"got shape {tuple(a.shape)} of {a.dtype}"
            )
        return a

    @property
    def format(self) -> FloatFormat:
        """The format the ``data`` stream is in now (FormatError if meta names none we know)."""
        return self._meta_format("format")

    @property
    def dtype_format(self) -> FloatFormat:
        """The format of the caller's original dtype, which decoding must give back."""
        return self._meta_format("dtype")

    def _meta_format(self, key: str) -> FloatFormat:
        try:
            return get_format(self.meta.get(key))
        except TypeError as e:
            raise FormatError(str(e)) from None

    @property
    def n(self) -> int:
        """Element count, range-checked."""
        return self.meta_int("n")

    def meta_int(self, key: str, lo: int = 0, hi: int = 2**62) -> int:
        """An integer from meta, range-checked (meta comes from an untrusted header on decode)."""
        v = self.meta.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
            raise FormatError(f"metadata {key!r} must be an integer in [{lo}, {hi}], got {v!r}")
        return v
