"""Serialize: streams + metadata -> one self-describing blob (kvzip/container.py), and back.

Streams are written in container.canonical_order and the metadata as canonical JSON, so the same input gives
the same bytes whichever path (fused or stage by stage, CPU or GPU) produced the streams.
"""
from __future__ import annotations

import math

import numpy as np

from kvzip import container
from kvzip.checksum import sum64
from kvzip.errors import FormatError
from kvzip.frame import Frame

from .base import BYTES, CHANNEL_CODED, ESCAPED, SPLIT, TENSOR, Stage, register

MAX_DIMS = 64  # NumPy's limit on array dimensions
MAX_SPAN = 2**63 - 1  # bytes a shape may span (NumPy's limit), its zero sides counted as 1


@register
class Serialize(Stage):
    id = "serialize"
    input_kind = (TENSOR, SPLIT, ESCAPED, CHANNEL_CODED)
    output_kind = BYTES

    def __init__(self, checksum: bool = False):
        if not isinstance(checksum, bool):
            raise TypeError(f"checksum must be a bool, got {checksum!r}")
        self.checksum = checksum

    def get_config(self):
        return {"id": self.id, "checksum": self.checksum}

    def payload_size(self, frame: Frame) -> int:
        return container.layout([a.nbytes for a in frame.streams.values()])[1]

    def encode(self, frame: Frame, flags: int = 0) -> Frame:
        backend = frame.backend
        names = container.canonical_order(frame.streams)
        arrays = [frame.streams[k] for k in names]
        described = []
        for name, a in zip(names, arrays):
            dtype_name = container.STREAM_DTYPE_NAMES.get(a.dtype)
            if dtype_name is None or a.ndim != 1:
                raise TypeError(f"stream {name!r} must be a 1-D array of {sorted(container.STREAM_DTYPES)}, got {a.dtype}")
            described.append((name, dtype_name, a.nbytes))
        offsets, payload_len = container.layout([nb for _, _, nb in described])
        flags |= container.FLAG_CHECKSUM if self.checksum else 0
        header = container.header_for(frame.meta, described, flags)
        blob = container.assemble(backend, header, arrays, payload_len, offsets)
        if self.checksum:
            # The payload is in place: hash it, then write the header again with the sum.
            header = container.header_for(frame.meta, described, flags, sum64(backend.xp, blob[len(header):]))
            blob[: len(header)] = backend.from_numpy(np.frombuffer(header, np.uint8))
        return Frame(backend, {"blob": blob}, dict(frame.meta))

    def decode(self, frame: Frame) -> Frame:
        frame.require("blob")
        return open_blob(frame.backend, frame.streams["blob"])


def open_blob(backend, blob, head: bytes | None = None) -> Frame:
    """Validate a blob's header (and payload checksum) and return a frame of zero-copy stream
    views and its metadata.  ``head``: the header bytes when the caller already fetched them."""
    if head is None:
        head = container.read_head(backend, blob)
    return frame_from_header(backend, blob, container.parse_header(head, blob.shape[0]))


def frame_from_header(backend, blob, hdr: container.Header, check: container.PayloadCheck | None = None) -> Frame:
    """open_blob for a header already parsed: payload checksum, stream views, metadata checks.
    check: the payload's checksum is left to it (the caller verifies it later, kvzip/staged.py)."""
    if check is None:
        container.verify_payload(backend, blob, hdr)
    views = container.stream_views(backend, blob, hdr)
    if "data" in views:
        # A stored-raw blob's values: the one stream a decoder can hand back as it is, so it is
        # copied here, and no decoded tensor is ever a view of (or a writable alias of) the blob.
        views["data"] = views["data"].copy()
    out = Frame(backend, views, dict(hdr.meta))
    n = out.meta_int("n")
    shape = out.meta.get("shape")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
        raise FormatError(f"bad shape {str(shape)[:200]} in metadata (at most {MAX_DIMS} non-negative integers)")
    if int(np.prod(shape, dtype=object)) != n:
        raise FormatError(f"shape {shape} does not hold n={n} values")
    # An empty tensor's other sides are free of n; NumPy (and torch) still refuse a shape whose
    # sides, a 0 counted as 1, span more than 2**63 - 1 bytes.
    if math.prod(max(d, 1) for d in shape) * out.dtype_format.itemsize > MAX_SPAN:
        raise FormatError(f"shape {str(shape)[:200]} spans more than {MAX_SPAN} bytes")
    return out
