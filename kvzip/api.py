"""The public entry points: compress, decompress, info; and the glue between a caller's
framework (via kvzip/arrays.py) and a pipeline running on a backend."""
from __future__ import annotations

import math

import numpy as np

from . import arrays, container
from .backends import get_backend
from .errors import FormatError
from .formats import get_format
from .frame import Frame
from .pipeline import Pipeline

DEFAULT_CHUNK = 4096


def splitzip_pipeline(codebook=None, *, checksum: bool = False, chunk: int = DEFAULT_CHUNK) -> Pipeline:
    """The default lossless pipeline: ExponentSplit -> Top16Pack -> EscapeStream -> Serialize."""
    from . import stages

    return Pipeline([stages.ExponentSplit(), stages.Top16Pack(codebook), stages.EscapeStream(chunk),
                     stages.Serialize(checksum)])


def compress(x, codebook=None, *, checksum: bool = False, chunk: int = DEFAULT_CHUNK, dtype=None,
             backend: str | None = None):
    """Compress a tensor losslessly.

    x: a torch / CuPy / NumPy / JAX array of bfloat16, float16, float32, float8_e4m3fn or
    float8_e5m2, on the CPU or a CUDA GPU.  codebook: None for the shipped default of x's format,
    a shipped name ("bf16-kv"), a Codebook or its dict.  checksum: also protect the payload.
    dtype: the format of x when x holds raw bits (e.g. a CuPy uint16 array of bfloat16 bits).
    backend: "cpu" or "cuda" to override where the work runs (default: where x lives).

    Returns a 1-D uint8 array of x's framework on x's device.
    """
    return splitzip_pipeline(codebook, checksum=checksum, chunk=chunk).encode(x, dtype=dtype, backend=backend)


def decompress(blob, *, backend: str | None = None):
    """Decode any kvzip blob; returns the original dtype and shape in the blob's framework.
    Raises kvzip.FormatError if the blob is malformed or (with a checksum) corrupted."""
    return splitzip_pipeline().decode(blob, backend=backend)


def _to_backend(a, backend):
    """Move an array onto the backend (a no-op when it is already there)."""
    if backend.name == "cpu":
        return a if isinstance(a, np.ndarray) else np.asarray(a.get() if hasattr(a, "get") else a)
    return backend.from_numpy(a) if isinstance(a, np.ndarray) else a


def _to_origin(a, origin):
    if origin.device == "cpu":
        return a if isinstance(a, np.ndarray) else a.get()
    if isinstance(a, np.ndarray):
        import cupy

        return cupy.asarray(a)
    return a


def encode_with(pipe: Pipeline, x, *, dtype=None, backend=None):
    bits, fmt, shape, origin = arrays.import_tensor(x, dtype)
    be = get_backend(backend or origin.backend_name)
    with origin.stream_context():
        frame = Frame(be, {"data": _to_backend(bits, be)},
                      {"dtype": fmt.dtype_name, "shape": list(shape), "n": math.prod(shape), "format": fmt.name})
        blob = pipe.encode_frame(frame).streams["blob"]
        return arrays.export_bytes(_to_origin(blob, origin), origin)


def decode_with(pipe: Pipeline, blob, *, backend=None):
    u8, origin = arrays.import_bytes(blob)
    be = get_backend(backend or origin.backend_name)
    with origin.stream_context():
        frame = pipe.decode_frame(Frame(be, {"blob": _to_backend(u8, be)}, {}))
        try:
            fmt = get_format(frame.meta.get("dtype"))
        except TypeError as e:
            raise FormatError(str(e)) from None
        if frame.format != fmt:
            raise FormatError(f"decoded values are {frame.format.name} but the blob says dtype {fmt.dtype_name}")
        data = frame.expect("data", fmt.uint_dtype, frame.n)
        return arrays.export_tensor(_to_origin(data, origin), fmt, tuple(frame.meta["shape"]), origin)


def info(blob) -> dict:
    """What a blob holds, without decoding it: dtype, shape, sizes, ratio, escapes, pipeline."""
    u8, origin = arrays.import_bytes(blob)
    be = get_backend(origin.backend_name)
    hdr = container.parse_header(container.read_head(be, u8), u8.shape[0])
    meta = hdr.meta
    streams = container.stream_views(be, u8, hdr)
    fmt = get_format(meta["dtype"])
    n = int(meta["n"])
    nchunks = escapes = plane_chunks = 0
    if "esc_count" in streams:
        counts = be.to_numpy(streams["esc_count"]).astype(np.int64)
        nchunks = counts.shape[0]
        plane_chunks = int((counts == 0xFFFF).sum())
        escapes = int(counts[counts != 0xFFFF].sum())
    raw = n * fmt.itemsize
    return {
        "dtype": fmt.dtype_name,
        "shape": tuple(meta["shape"]),
        "raw_bytes": raw,
        "compressed_bytes": int(u8.shape[0]),
        "ratio": raw / u8.shape[0] if u8.shape[0] else float("nan"),
        "escapes": escapes,
        "escape_rate": escapes / n if n else 0.0,
        "chunks": nchunks,
        "raw_chunks": plane_chunks,
        "stored_raw": bool(hdr.flags & container.FLAG_STORED),
        "checksum": bool(hdr.flags & container.FLAG_CHECKSUM),
        "streams": {name: nb for name, _, _, nb in hdr.streams},
        "pipeline": meta.get("pipeline"),
        "codebook": (meta.get("codebook") or {}).get("name"),
    }
