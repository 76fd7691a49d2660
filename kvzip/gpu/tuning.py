"""The fast path's tunables, one frozen Tuning per format: everything that was picked by
measurement (benchmarks/NOTES.md) and may be A/B'd again, in one place.

Each field says where it goes (its metadata's "to"):
  "macro"    a -D option of the fused module (kvzip/gpu/loader.py renders it; kernels/tuning.cuh
             lists them and refuses a build without them),
  "template" a template argument of the format's kernel instances (loader.py's name expressions),
  "host"     read by Python when a program is built (kvzip/gpu/programs.py).
Formats whose macro fields agree share one compiled module (as every shipped format does).

Benchmarks change tuning through override() only:

    with tuning.override(formats=("e5m2",), decode_shape=(2, 3)):
        ...   # kernels and cached programs rebuilt for the new values, restored on exit
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field


def _to(where: str, name: str | None = None):
    return {"to": where, "name": name}


@dataclass(frozen=True)
class Tuning:
    # Dense kernels' shapes: (groups a lane handles per step, blocks per multiprocessor the register
    # budget must allow), swept with benchmarks/sweep_shapes.py and macro_ab.py (the record:
    # benchmarks/NOTES.md, kernel source split: kernel shapes).
    encode_shape: tuple = field(metadata=_to("template"))
    decode_shape: tuple = field(metadata=_to("template"))
    # FP8 formats only: kvz_encode<..., QT> (quantizing as it loads; no step loaded ahead) and
    # kvz_decode<..., DQ> (storing 16-bit values).
    quantizing_encode_shape: tuple = field(default=(4, 4), metadata=_to("template"))
    dequantizing_decode_shape: tuple = field(default=(4, 3), metadata=_to("template"))
    # Chunk queues of the dense kernels (a divisor of the block's 8 warps; common.cuh).
    queues: int = field(default=4, metadata=_to("macro", "KVZ_QUEUES"))
    # Tensors a kvz_encode warp notes before publishing their done counts (encode.cu).
    pending: int = field(default=2, metadata=_to("macro", "KVZ_PENDING"))
    # kvz_decode's sleep between polls of the scan's offsets count, ns (decode.cu).
    poll_ns: int = field(default=256, metadata=_to("macro", "KVZ_POLL_NS"))
    # kvz_decode's L2 prefetch of a chunk's codes and rest as it starts (FP8 and float16 only,
    # whatever this says: the kernel limits it to them; decode.cu).
    decode_prefetch: int = field(default=1, metadata=_to("macro", "KVZ_DECODE_PREFETCH"))
    # Escapes of a scan block the decode scan checks itself; past it kvz_decode does (escapes.cuh).
    check_max: int = field(default=8 * 256, metadata=_to("macro", "KVZ_CHECK_MAX"))
    # Escapes a thread of the decode scan checks a round (escapes.cuh).
    check_batch: int = field(default=4, metadata=_to("macro", "KVZ_CHECK_BATCH"))
    # kvz_decode's whole E5M2 chunks a lane per quad of groups (decode_e5m2_quads); 0: a lane per
    # group, as every other format (benchmarks/e5m2_decode_ab.py; decode.cu).
    e5m2_quads: int = field(default=1, metadata=_to("macro", "KVZ_E5M2_QUADS"))
    # kvz_decode's escape-heavy instance (decode.cu, SCATTER_MIN): a chunk of scatter_min escapes
    # or more decoded a step at a time into shared memory, its escapes patched there by the lanes
    # that hold them, then stored once; taken by a decode whose blobs hold heavy_share escapes a
    # value or more (programs.heavy; benchmarks/NOTES.md, e1, e3 and e4).
    scatter_min: int = field(default=16, metadata=_to("template"))
    heavy_share: float = field(default=0.005, metadata=_to("host"))
    # kvz_decode's tail: the last round of chunks dealt as 2^split_shift parts each (0: whole).
    split_shift: int = field(default=0, metadata=_to("host"))
    # Encode calls return once their blobs are built, the scan finishing them in stream order.
    early_return: bool = field(default=True, metadata=_to("host"))
    # Decode calls return on the scan's verdict, the decoder finishing in stream order.
    early_verdict: bool = field(default=True, metadata=_to("host"))

    def macros(self) -> tuple:
        """The -D options of the macro fields, in field order."""
        return tuple(f"-D{f.metadata['name']}={int(getattr(self, f.name))}" for f in dataclasses.fields(self)
                     if f.metadata["to"] == "macro")


SHIPPED = {
    "e4m3": Tuning(encode_shape=(8, 2), decode_shape=(2, 3)),
    "e5m2": Tuning(encode_shape=(8, 2), decode_shape=(1, 4)),
    "bf16": Tuning(encode_shape=(4, 2), decode_shape=(4, 3), split_shift=2),
    "fp16": Tuning(encode_shape=(4, 2), decode_shape=(2, 4)),
    "fp32": Tuning(encode_shape=(2, 2), decode_shape=(1, 4)),
}
# The format-free kernels' module (kvz_gather_heads, kvz_check_heads) builds with this one's macros.
BASE = "bf16"

_current = dict(SHIPPED)
_listeners: list = []


def tuning_for(fmt_name: str | None) -> Tuning:
    """The tuning in force for a format (None: the format-free kernels')."""
    return _current[BASE if fmt_name is None else fmt_name]


def on_change(forget) -> None:
    """forget() runs whenever override() changes what is in force (caches of compiled kernels)."""
    _listeners.append(forget)


def _changed() -> None:
    for forget in _listeners:
        forget()
    from . import graphs

    graphs.release()  # cached programs hold the previous kernels and launch arguments


@contextlib.contextmanager
def override(formats=None, **changes):
    """Run the block with changes (Tuning fields) applied to formats (default: all), every
    compiled kernel and cached program dropped on entry and exit."""
    global _current
    names = tuple(_current) if formats is None else tuple(formats)
    saved = _current
    _current = {k: dataclasses.replace(t, **changes) if k in names else t for k, t in saved.items()}
    _changed()
    try:
        yield
    finally:
        _current = saved
        _changed()
