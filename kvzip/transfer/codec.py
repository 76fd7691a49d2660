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
from .protocol import ProtocolError, align

KVZIP_DTYPES = frozenset(BY_DTYPE_NAME)


class WireCodec:
    """A way to put tensors on the wire, known by ``name`` on both sides (``register``).

    ``encode(tensors)`` returns, per tensor, a 1-D uint8 array of its framework and device, or
    None where the tensor should go raw; ``decode(views, entries)`` turns the slot's bytes (views,
    one per entry) back into tensors of the entries' dtype and shape.  Both run on the caller's
    current CUDA stream when the tensors are on a GPU."""

    name = "?"

    def encode(self, tensors) -> list:
        raise NotImplementedError

    def decode(self, views, entries) -> list:
        raise NotImplementedError


class KvzipWire(WireCodec):
    """kvzip blobs (self-describing: any pipeline decodes through kvzip.decompress_many), known
    as ``name``: "kvzip" the speed mode's default pipeline (as kvzip.compress runs it: each
    tensor's own Top-16 exponents, codebook="auto", so KV of any model family or scale keeps
    its ratio), "kvzip-ratio" the ratio mode's.

    Both pipelines leave the blob checksum off: every message carries a sum64 digest of
    all its bytes (blobs and raw tensors alike), which the receiver checks, so a corrupted
    message still fails with FormatError.  Per message it costs one fused pass with no host
    synchronisation of its own; per blob it cost a synchronisation each (benchmarks/NOTES.md)."""

    def __init__(self, pipeline: Pipeline | None = None, name: str = "kvzip"):
        from ..api import splitzip_pipeline

        self.pipeline = pipeline or splitzip_pipeline("auto")
        self.name = name

    def encode(self, tensors):
        out = [None] * len(tensors)
        idx = [i for i, t in enumerate(tensors) if _format_name(t) in KVZIP_DTYPES and buffers.nbytes(t)]
        if idx:
            for i, b in zip(idx, self.pipeline.encode_many([tensors[i] for i in idx])):
                out[i] = b
        return out

    def decode(self, views, entries):
        from ..api import decompress_many

        return [_in_byte_order(t, e) for t, e in zip(decompress_many(views), entries)]


def _format_name(t) -> str:
    """The name of t's format, byte order aside: NumPy's ">f2" is "float16".  Invariant: every
    tensor kvzip.compress codes is coded on the wire too (it takes a non-native byte order and
    codes the values), so the wire never falls back to raw where compress would not."""
    return t.dtype.name if buffers.framework(t) == "numpy" else buffers.dtype_name(t)


def _in_byte_order(t, entry: dict):
    """A decoded NumPy array (native byte order, as kvzip.decompress gives it) in the entry's
    byte order where only that differs (a big-endian sender's ">f2"); anything else as it is,
    for _decode_coded to judge against the entry."""
    name = entry["dtype"]
    if isinstance(t, np.ndarray) and name != buffers.dtype_name(t) and name[:1] in ("<", ">"):
        try:
            want = np.dtype(name)
        except (TypeError, ValueError):  # not a dtype at all: _decode_coded refuses the entry
            return t
        if want.newbyteorder("=") == t.dtype:
            return t.astype(want)
    return t


def _ratio_wire() -> KvzipWire:
    from ..api import ratio_pipeline

    return KvzipWire(ratio_pipeline(), "kvzip-ratio")


_CODECS: dict[str, WireCodec] = {"kvzip": KvzipWire(), "kvzip-ratio": _ratio_wire()}
CHOICES = ("raw", "kvzip", "kvzip-ratio")  # what codec="auto" chooses between


def register(codec: WireCodec) -> None:
    """Make a wire codec known in this process (both the sending and the receiving one)."""
    if not isinstance(codec, WireCodec) or type(codec.name) is not str or codec.name in ("raw", "auto"):
        raise ValueError(f"not a wire codec with a usable name: {codec!r}")
    _CODECS[codec.name] = codec


def known() -> set[str]:
    return {"raw", *_CODECS}


def get(name: str) -> WireCodec:
    return _CODECS[name]


def speed_ceiling(tensors) -> float:
    """The most the speed mode ("kvzip") can make of these tensors' bytes, whatever the data: its
    Top-16 code puts 4 bits in place of a value's exponent bits, so width / (rest_bits + 4)
    (BF16 1.333, FP16 1.067, FP32 and E5M2 1.143) and nothing for E4M3 (4 exponent bits) or a
    tensor in no kvzip format (sent raw).  codec="auto" caps the speed mode's ratio estimate by
    it, so a request of FP8 E4M3 or FP16 KV is not predicted at a BF16 request's ratio."""
    return _speed_ratio(tensors, lambda t, f: 0.0)


SAMPLE = 1 << 16        # values of a tensor speed_estimate reads (about; evenly spaced)
ESCAPE_BITS = 24        # an escape in the speed mode: a 2-byte position and its exponent byte


def speed_estimate(tensors) -> float:
    """What the speed mode ("kvzip") would make of these tensors' bytes, predicted from a sample
    of each one's exponents: per tensor a fraction f of its sampled values falls outside its 16
    commonest exponents (the auto codebook's).  So BF16 KV as captured predicts ~1.33, the same
    with a wide exponent range ~1.0 (what it crosses at), E4M3 1.0.  One sampled histogram a
    tensor; on a GPU it waits for the tensors (the caller's stream) and reads 256 counts back."""
    def outside(t, f):
        counts = _exponent_sample(t, f)
        return 1.0 - sum(sorted(counts, reverse=True)[:16]) / max(sum(counts), 1)

    return _speed_ratio(tensors, outside)


def _speed_ratio(tensors, outside) -> float:
    """The speed mode's ratio over these tensors where a share outside(t, format) of each one's
    values escapes: each value costs rest_bits + 4, each escape ESCAPE_BITS more until the chunk
    is coded as planes instead (at most high_exp_bits a value); a tensor whose code would not be
    smaller, or in a format the code cannot shrink (E4M3) or no kvzip format, counts raw."""
    raw = coded = 0.0
    for t in tensors:
        n, f = buffers.nbytes(t), BY_DTYPE_NAME.get(_format_name(t))
        raw += n
        if not n or f is None or f.high_exp_bits <= 0:
            coded += n
            continue
        bits = f.rest_bits + 4 + min(ESCAPE_BITS * outside(t, f), f.high_exp_bits)
        coded += min(n, n * bits / f.width)
    return raw / coded if coded else 1.0


def _stride(n: int) -> int:
    """An odd step giving about SAMPLE of n values: coprime with every power of two, so the sample
    visits every channel of a [..., head_dim] tensor (an even step would see only some of them,
    and per-channel scales, KV's commonest structure, would vanish from the histogram)."""
    return max(1, n // SAMPLE) | 1


def _exponent_sample(t, f) -> list[int]:
    """Counts of each exponent field value over about SAMPLE evenly spaced values of t."""
    if buffers.framework(t) == "numpy":
        flat = np.ascontiguousarray(t).reshape(-1)
        if not flat.dtype.isnative:  # ">f2" from a big-endian sender: its values, not its byte order
            flat = flat.astype(flat.dtype.newbyteorder("="))
        bits = flat[::_stride(flat.size)].view(f.uint_dtype).astype(np.int64)
        return np.bincount((bits >> f.mant_bits) & ((1 << f.exp_bits) - 1), minlength=1 << f.exp_bits).tolist()
    import torch

    flat = t.reshape(-1)
    as_int = {8: torch.uint8, 16: torch.int16, 32: torch.int32}[f.width]
    bits = flat[::_stride(flat.numel())].view(as_int).to(torch.int64)
    return torch.bincount((bits >> f.mant_bits) & ((1 << f.exp_bits) - 1), minlength=1 << f.exp_bits).tolist()


def slot_need(tensors) -> int:
    """Bytes a group of tensors may take in a slot: their raw bytes, each padded to ALIGN."""
    return sum(align(buffers.nbytes(t)) for t in tensors)


def encode(wire: WireCodec | None, tensors) -> list:
    """Per tensor, its encoding when that is smaller than the raw bytes, else None (send raw)."""
    if wire is None:
        return [None] * len(tensors)
    return [b if b is not None and b.shape[0] < buffers.nbytes(t) else None
            for t, b in zip(tensors, wire.encode(tensors))]


def pack(buf, base: int, tensors, blobs, wire_name: str, stream=None) -> tuple[list[dict], int, object]:
    """Lay each tensor's wire bytes out in ``buf`` from ``base`` (Buffer.gather: one pass, the
    digest with it); returns the TensorEntries (their offsets relative to ``base``), the message
    length and its sum64_start."""
    entries, parts, end = [], [], 0
    for t, blob in zip(tensors, blobs):
        src = blob if blob is not None else buffers.message_bytes(t, buf.device)
        n = buffers.nbytes(src)
        parts.append((src, end))
        entries.append({"framework": buffers.framework(t), "dtype": buffers.dtype_name(t),
                        "shape": list(t.shape), "offset": end, "nbytes": n,
                        "codec": "raw" if blob is None else wire_name})
        end = align(end + n)
    return entries, end, buf.gather(base, end, parts, stream)


def unpack(buf, base: int, nbytes: int, entries: list[dict], device: str, verify, stream=None) -> tuple[list, object]:
    """The tensors of a message of nbytes at ``base`` in ``buf``, as new memory (never a view of
    ``buf``: the slot is reused by the next message), and the message's sum64_start.  The raw
    tensors are filled and the digest summed by one Buffer.scatter; the coded ones decoded by
    their wire codec after it (on ``stream``, the current one, on a GPU).

    ``verify(total)`` raises FormatError when the digest disagrees with the sender's.  A corrupted
    message must fail as corrupted, not as whatever its damaged blobs decode to, so verify runs
    before any decoding where the total is at hand (the CPU), and otherwise, on a GPU where it
    would cost a synchronisation, only when decoding fails."""
    out = [None] * len(entries)
    coded, parts = {}, []
    for i, e in enumerate(entries):
        fw = "torch" if e["framework"] == "torch" or device != "cpu" else "numpy"
        if e["codec"] != "raw":
            coded.setdefault((e["codec"], fw), []).append((i, buf.view(base + e["offset"], e["nbytes"], fw)))
            continue
        t = buffers.empty_like_entry(e, device)
        dst = buffers.message_bytes(t, buf.device)
        if buffers.nbytes(dst) != e["nbytes"]:
            raise ProtocolError(f"raw tensor {e['shape']} {e['dtype']} needs {buffers.nbytes(dst)} bytes, "
                                f"the message has {e['nbytes']}")
        parts.append((dst, e["offset"]))
        out[i] = t
    total = buf.scatter(base, nbytes, parts, stream)
    if device == "cpu":
        verify(total)
    try:
        _decode_coded(buf, entries, coded, out)
    except Exception:
        verify(total)
        raise
    return out, total


def _decode_coded(buf, entries: list[dict], coded: dict, out: list) -> None:
    for (name, fw), items in coded.items():
        wire = _CODECS.get(name)
        if wire is None:
            raise ProtocolError(f"message uses wire codec {name!r}, unknown here: register it on the receiver too")
        decoded = wire.decode([v for _, v in items], [entries[i] for i, _ in items])
        for (i, _), t in zip(items, decoded):
            e = entries[i]
            if list(t.shape) != e["shape"] or buffers.dtype_name(t) != e["dtype"]:
                raise ProtocolError(f"a {name} payload decoded to {buffers.dtype_name(t)} {list(t.shape)}, "
                                    f"the message says {e['dtype']} {e['shape']}")
            if buf.contains(buffers.data_ptr(t)):  # guard the ring invariant above
                t = t.clone() if fw == "torch" else t.copy()
            out[i] = t


# ---- codec="auto" ----------------------------------------------------------------------------

# Each stage of the pipeline (encode: pack + digest + codec; decode: digest + codec + unpack)
# costs, per group, a fixed time, a time per tensor (a call of the codec: the speed mode batches a
# group's tensors into one, the ratio mode pays each) and the group's raw bytes over a rate.
# Starting values, per device kind: (fixed seconds, seconds a tensor, GB/s) per codec and stage,
# and the ratio, fitted to the H200 runs of benchmarks/bench_transfer.py (benchmarks/NOTES.md,
# transfer t2, t8, t9) and to the 2-core CPU; a connection refines the rates and ratios from its
# own requests.
_START = {
    "cuda": {"raw": {"enc": (6e-4, 0.0, 800.0), "dec": (8e-4, 0.0, 900.0)},
             "kvzip": {"enc": (9e-4, 0.0, 800.0), "dec": (9e-4, 0.0, 1400.0)},
             "kvzip-ratio": {"enc": (5e-4, 4.8e-4, 500.0), "dec": (5e-4, 4.8e-4, 500.0)}},
    "cpu": {"raw": {"enc": (2e-4, 0.0, 3.0), "dec": (1e-4, 0.0, 3.0)},
            "kvzip": {"enc": (3e-4, 0.0, 0.5), "dec": (3e-4, 0.0, 0.6)},
            "kvzip-ratio": {"enc": (3e-4, 1e-4, 0.3), "dec": (3e-4, 1e-4, 0.5)}},
}
_START_RATIO = {"raw": 1.0, "kvzip": 1.30, "kvzip-ratio": 1.38}


class AutoChooser:
    """Running estimates of the link and of each codec's stage costs and ratio on one connection,
    and, per codec and request size (a power of two), how far whole requests took longer than the
    model predicted.

    The model sees each stage's own cost; what it cannot see (every Python and torch call of a
    group costs several times more beside the pipeline's other threads, and the control messages
    between the stages) weighs most on small requests and fast links, where it can reverse the
    choice (benchmarks/NOTES.md t6, t12).  So a bulk request's measured time over the model's
    prediction for it is kept per (codec, size class), and the choices for requests of that
    class scale their predictions by it."""

    def __init__(self, device: str, link_gbps: float | None):
        start = _START["cpu" if device == "cpu" else "cuda"]
        self.stage = {c: dict(st) for c, st in start.items()}
        self.ratio = dict(_START_RATIO)
        self.link_gbps = link_gbps  # known when paced; else measured from the engine's writes
        self._fixed_link = link_gbps is not None
        self.scale: dict[tuple[str, int], float] = {}  # (codec, size class): measured over modelled time

    def observe_link(self, nbytes: int, seconds: float) -> None:
        if not self._fixed_link and seconds > 0 and nbytes >= 1 << 20:
            self.link_gbps = _ewma(self.link_gbps, nbytes / seconds / 1e9)

    def observe(self, kind: str, raw: int, sent: int, groups: int, encode_s: float, decode_s: float,
                tensors: int = 0, seconds: float | None = None, plan: tuple | None = None) -> None:
        """A finished request: ``kind`` one of CHOICES, its bytes, groups, summed stage times and
        tensors; ``seconds``, its whole time, where its layers were all given at its start (a
        bulk send, not one paced by its producer), and ``plan``, the (group sizes, tensors a
        group[, speed_ceiling]) its choice was (or would have been) predicted for."""
        if kind not in self.stage or raw < 1 << 20 or groups < 1:
            return
        if kind != "raw":
            self.ratio[kind] = _ewma(self.ratio[kind], raw / max(sent, 1))
        g, calls = raw / groups, tensors / groups
        for stage, stage_s in (("enc", encode_s), ("dec", decode_s)):
            fixed, per_call, rate = self.stage[kind][stage]
            if stage_s > 0:
                left = max(stage_s / groups - fixed - calls * per_call, 1e-6)
                self.stage[kind][stage] = (fixed, per_call, _ewma(rate, g / left / 1e9))
        if seconds is not None and seconds > 0 and self.link_gbps is not None:
            sizes, per_group, *ceiling = plan if plan is not None else ([g] * groups, calls)
            ceiling = ceiling[0] if ceiling else None  # a plan of (sizes, calls) alone: no ceiling
            key = (kind, _size_class(sum(sizes)))
            self.scale[key] = _ewma(self.scale.get(key), seconds / self._model(kind, sizes, per_group, ceiling))

    def observe_group(self, kind: str, raw: int, sent: int) -> None:
        """A group of a request still under way, sent with ``kind`` at a ratio materially below
        what its choice assumed (Sender._recheck): the connection's estimate takes it at once."""
        if kind in self.stage and kind != "raw" and sent > 0:
            self.ratio[kind] = _ewma(self.ratio[kind], raw / sent)

    def predict(self, kind: str, group_bytes: list[int], calls: int = 1, ceiling: float | None = None,
                measured: dict | None = None) -> float:
        """Seconds to move groups of these raw sizes, of ``calls`` tensors each, with ``kind``:
        the model's time, scaled by what requests of this size took on this connection.
        ``ceiling``: the speed mode's ratio at most for the request's formats (speed_ceiling);
        ``measured``: {codec: ratio} the request's own groups gave, which stand for the estimates."""
        scale = self.scale.get((kind, _size_class(sum(group_bytes))), 1.0)
        return self._model(kind, group_bytes, calls, ceiling, measured) * scale

    def assumed(self, kind: str, ceiling: float | None = None) -> float:
        """The ratio a choice of ``kind`` assumes for a request whose formats allow ``ceiling``."""
        return self._ratio(kind, ceiling)

    def _ratio(self, kind: str, ceiling: float | None, measured: dict | None = None) -> float:
        if measured and kind in measured:
            return measured[kind]
        return min(self.ratio[kind], ceiling) if kind == "kvzip" and ceiling is not None else self.ratio[kind]

    def _model(self, kind: str, group_bytes: list[int], calls: float, ceiling: float | None = None,
               measured: dict | None = None) -> float:
        """The pipeline's fill (first encode, last decode) plus every group through its slowest
        stage."""
        link = self.link_gbps * 1e9
        (fe, ce, re), (fd, cd, rd) = self.stage[kind]["enc"], self.stage[kind]["dec"]
        enc = [fe + calls * ce + g / (re * 1e9) for g in group_bytes]
        dec = [fd + calls * cd + g / (rd * 1e9) for g in group_bytes]
        wire = [g / self._ratio(kind, ceiling, measured) / link for g in group_bytes]
        return enc[0] + dec[-1] + sum(max(e, w, d) for e, w, d in zip(enc, wire, dec))

    def choose(self, group_bytes: list[int], calls: int = 1, ceiling: float | None = None,
               measured: dict | None = None) -> tuple[str, str]:
        """(one of CHOICES, the reason in words) for groups of ``calls`` tensors: the fastest
        predicted, a codec only where it beats raw by 2 %, the ratio mode only where it beats the
        speed mode by 2 %.  ``ceiling``, ``measured``: as predict's."""
        if self.link_gbps is None:
            return "kvzip", "link speed not measured yet: compressing until it is"
        t = {kind: self.predict(kind, group_bytes, calls, ceiling, measured) for kind in CHOICES}
        pick = "raw"
        for kind in CHOICES[1:]:
            if t[kind] < 0.98 * t[pick]:
                pick = kind
        said = ", ".join(f"{kind} {t[kind] * 1e3:.3f} ms" for kind in CHOICES)
        size = _size_class(sum(group_bytes))
        seen = [kind for kind in CHOICES if (kind, size) in self.scale]
        return pick, (f"predicted {said} (link {self.link_gbps:.1f} GB/s, ratios "
                      f"{self._ratio('kvzip', ceiling, measured):.3f} / {self._ratio('kvzip-ratio', None, measured):.3f}, "
                      f"{len(group_bytes)} groups; "
                      f"{'scaled by requests of this size seen with ' + ', '.join(seen) if seen else 'model only'})")


def _size_class(nbytes: float) -> int:
    """Requests within a factor of two of each other share what was measured for them."""
    return max(int(nbytes), 1).bit_length()


def _ewma(old, new, keep=0.5):
    return new if old is None else keep * old + (1 - keep) * new


def now() -> float:
    return time.perf_counter()
