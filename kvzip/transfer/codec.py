"""What a group of layers becomes on the wire, and back.

Each tensor of a group is sent as a kvzip blob or as its raw bytes, whichever is smaller, so a
message is never larger than the raw group: the receive ring's slots are sized by the raw bytes
alone (plus ALIGN padding a tensor), whatever the data.  Tensors in no kvzip format (integers,
float64, ...) always go raw.

``AutoChooser`` decides ``codec="auto"`` per request from a model of the pipelined transfer
(docs/transfer.md): time ~ fill + (groups - 1) x max(encode, wire, decode), with the link rate
and codec speeds measured on this connection as it runs.
"""
from __future__ import annotations

import time

import numpy as np

from ..formats import BY_DTYPE_NAME
from ..pipeline import Pipeline
from . import buffers
from .protocol import ALIGN, ProtocolError, align

KVZIP_DTYPES = frozenset(BY_DTYPE_NAME)


def kvzip_pipeline() -> Pipeline:
    """The wire pipeline of codec="kvzip": kvzip's default, with the payload checksum on, so a
    corrupted message fails with FormatError instead of decoding to wrong KV."""
    from ..api import splitzip_pipeline

    return splitzip_pipeline(checksum=True)


def slot_need(tensors) -> int:
    """Bytes a group of tensors may take in a slot: their raw bytes, each padded to ALIGN."""
    return sum(align(buffers.nbytes(t)) for t in tensors)


def encode(pipe: Pipeline | None, tensors) -> list:
    """Per tensor, its blob when a blob is smaller than the raw bytes, else None (send raw)."""
    out = [None] * len(tensors)
    if pipe is None:
        return out
    idx = [i for i, t in enumerate(tensors) if buffers.dtype_name(t) in KVZIP_DTYPES and buffers.nbytes(t)]
    if idx:
        blobs = pipe.encode_many([tensors[i] for i in idx])
        for i, b in zip(idx, blobs):
            if b.shape[0] < buffers.nbytes(tensors[i]):
                out[i] = b
    return out


def pack(buf, base: int, tensors, blobs) -> tuple[list[dict], int]:
    """Copy each tensor's wire bytes into ``buf`` from ``base``; returns the TensorEntries (their
    offsets relative to ``base``) and the message length."""
    entries, end = [], 0
    for t, blob in zip(tensors, blobs):
        src = blob if blob is not None else buffers.raw_bytes(t)
        n = int(src.shape[0])
        fw = buffers.framework(src)
        dst = buf.view(base + end, n, fw)
        if n:
            if fw == "torch":
                dst.copy_(src, non_blocking=True)
            else:
                np.copyto(dst, src)
        entries.append({"framework": buffers.framework(t), "dtype": buffers.dtype_name(t),
                        "shape": list(t.shape), "offset": end, "nbytes": n,
                        "codec": "raw" if blob is None else "kvzip"})
        end = align(end + n)
    return entries, end


def unpack(buf, base: int, entries: list[dict], device: str) -> list:
    """The tensors of a message at ``base`` in ``buf``, as new memory (never a view of ``buf``:
    the slot is reused by the next message)."""
    from ..api import decompress_many

    out = [None] * len(entries)
    blobs = {}
    for i, e in enumerate(entries):
        fw = "torch" if e["framework"] == "torch" or device != "cpu" else "numpy"
        view = buf.view(base + e["offset"], e["nbytes"], fw)
        if e["codec"] == "kvzip":
            blobs.setdefault(fw, []).append((i, view))
            continue
        t = buffers.empty_like_entry(e, device)
        dst = buffers.raw_bytes(t)
        if dst.shape[0] != e["nbytes"]:
            raise ProtocolError(f"raw tensor {e['shape']} {e['dtype']} needs {dst.shape[0]} bytes, the message has {e['nbytes']}")
        if e["nbytes"]:
            if fw == "torch":
                dst.copy_(view)
            else:
                dst[...] = view
        out[i] = t
    for fw, items in blobs.items():
        for (i, _), t in zip(items, decompress_many([v for _, v in items])):
            e = entries[i]
            if list(t.shape) != e["shape"] or buffers.dtype_name(t) != e["dtype"]:
                raise ProtocolError(f"a blob decoded to {buffers.dtype_name(t)} {list(t.shape)}, "
                                    f"the message says {e['dtype']} {e['shape']}")
            if buf.contains(buffers.data_ptr(t)):  # guard the ring invariant above
                t = t.clone() if fw == "torch" else t.copy()
            out[i] = t
    return out


# ---- codec="auto" ----------------------------------------------------------------------------

# Starting estimates until this connection has measured its own (GB/s of raw bytes; ratio).
# GPU figures are kvzip's batch API on an H200 (docs/performance.md) rounded down; CPU ones the
# single-thread CPU backend's.  Each is replaced by the running measurement after one request.
_START = {"cuda": (1000.0, 1000.0), "cpu": (0.4, 0.5)}
_START_RATIO = 1.30
_CALL_S = {"cuda": 60e-6, "cpu": 50e-6}  # fixed host cost of one compress or decompress call


class AutoChooser:
    """Running estimates of the link and codec speeds on one connection, and the choice."""

    def __init__(self, device: str, link_gbps: float | None):
        kind = "cpu" if device == "cpu" else "cuda"
        self.encode_gbps, self.decode_gbps = _START[kind]
        self.call_s = _CALL_S[kind]
        self.ratio = _START_RATIO
        self.link_gbps = link_gbps  # known when paced; else measured from raw-rate writes
        self._fixed_link = link_gbps is not None

    def observe_link(self, nbytes: int, seconds: float) -> None:
        if not self._fixed_link and seconds > 0 and nbytes >= 1 << 20:
            self.link_gbps = _ewma(self.link_gbps, nbytes / seconds / 1e9)

    def observe_codec(self, raw: int, sent: int, encode_s: float, decode_s: float) -> None:
        if raw >= 1 << 20:
            self.ratio = _ewma(self.ratio, raw / max(sent, 1))
            if encode_s > 0:
                self.encode_gbps = _ewma(self.encode_gbps, raw / encode_s / 1e9)
            if decode_s > 0:
                self.decode_gbps = _ewma(self.decode_gbps, raw / decode_s / 1e9)

    def predict(self, group_bytes: list[int]) -> tuple[float, float]:
        """Predicted (raw, kvzip) seconds for groups of these raw sizes."""
        link = self.link_gbps * 1e9
        raw = sum(group_bytes) / link
        enc = [self.call_s + g / (self.encode_gbps * 1e9) for g in group_bytes]
        dec = [self.call_s + g / (self.decode_gbps * 1e9) for g in group_bytes]
        wire = [g / self.ratio / link for g in group_bytes]
        stages = [max(e, w, d) for e, w, d in zip(enc, wire, dec)]
        kvzip = enc[0] + dec[-1] + sum(stages) - max(stages) + max(wire[0], wire[-1])
        return raw, kvzip

    def choose(self, group_bytes: list[int]) -> tuple[str, str]:
        """("kvzip" or "raw", the reason in words)."""
        if self.link_gbps is None:
            return "kvzip", "link speed not measured yet: compressing until it is"
        raw, kz = self.predict(group_bytes)
        pick = "kvzip" if kz < 0.98 * raw else "raw"
        return pick, (f"predicted {kz * 1e3:.3f} ms compressed against {raw * 1e3:.3f} ms raw "
                      f"(link {self.link_gbps:.1f} GB/s, codec {self.encode_gbps:.0f}/{self.decode_gbps:.0f} GB/s, "
                      f"ratio {self.ratio:.3f})")


def _ewma(old, new, keep=0.5):
    return new if old is None else keep * old + (1 - keep) * new


def now() -> float:
    return time.perf_counter()
