"""The public entry points: compress, decompress, their _many forms, info.  They run the preset
pipeline of the mode asked for (built once per setting) through kvzip/execution.py, as
Pipeline.encode/decode do.  Three modes: "speed" (the default, SplitZip's Top-16 code, which the
fused GPU kernels run), "ratio" (ChannelPack's per-channel two-level code: smaller blobs, slower)
and "storage" (ChannelRans's per-channel rANS: smaller still, slower still, for offload to host
memory or disk); each has CPU kernels and CUDA kernels that give the same bytes.  A blob records
its pipeline, so decoding needs no mode."""
from __future__ import annotations

import copy
from functools import lru_cache

import numpy as np

from . import arrays, container, execution, into, packed as packing
from .backends import get_backend
from .channel_codebook import ChannelCodebook
from .codebook import Codebook
from .errors import FormatError
from .pipeline import Pipeline
from .stages import ChannelPack, ChannelRans, EscapeStream, ExponentSplit, Serialize, Top16Pack
from .stages.serialize import frame_from_header

DEFAULT_CHUNK = 4096
STORAGE_CHUNK = ChannelRans.DEFAULT_CHUNK
MODES = ("speed", "ratio", "storage")


def splitzip_pipeline(codebook=None, *, checksum: bool = False, chunk: int = DEFAULT_CHUNK) -> Pipeline:
    """The default lossless pipeline (mode="speed"): ExponentSplit -> Top16Pack -> EscapeStream -> Serialize."""
    return Pipeline([ExponentSplit(), Top16Pack(codebook), EscapeStream(chunk), Serialize(checksum)])


def ratio_pipeline(codebook=None, *, checksum: bool = False, chunk: int = DEFAULT_CHUNK) -> Pipeline:
    """The ratio mode's lossless pipeline: ChannelPack -> Serialize (codebook None: the tables
    from each tensor; a ChannelCodebook or its dict: calibrated ones)."""
    return Pipeline([ChannelPack(chunk, codebook), Serialize(checksum)])


def storage_pipeline(*, checksum: bool = False, chunk: int = STORAGE_CHUNK) -> Pipeline:
    """The storage mode's lossless pipeline: ChannelRans -> Serialize (rANS tables from each tensor)."""
    return Pipeline([ChannelRans(chunk), Serialize(checksum)])


def compress(x, codebook="auto", *, mode: str = "speed", checksum: bool = False, chunk: int | None = None,
             dtype=None, backend: str | None = None):
    """Compress a tensor losslessly.

    x: a torch / CuPy / NumPy / JAX array of bfloat16, float16, float32, float8_e4m3fn or
    float8_e5m2, on the CPU or a CUDA GPU.  codebook: "auto" (the default: the Top-16 exponents
    of x itself, chosen on x's device and recorded in the blob; kvzip/auto_codebook.py), None for
    the shipped default of x's format, a shipped name ("bf16-kv"), a Codebook or its dict; with
    mode="ratio", "auto" or None (per-channel tables chosen from x) or a ChannelCodebook
    (kvzip.calibrate_channels) or its dict; mode="storage" takes none.  mode: "speed" (the
    default: the fused GPU kernels' Top-16 code, ~1.33x on BF16 KV) or "ratio" (per-channel
    two-level codes chosen from x itself, ~1.43x on BF16 KV; on a GPU its CUDA kernels) or
    "storage" (per-channel rANS, ~1.48x on BF16 KV, for offload to host memory or disk; on a GPU
    its CUDA kernels, the tables too).  checksum: also
    protect the payload.  chunk: values per independently decoded chunk (a power of two;
    8..65536 for "speed", 8..32768 for "ratio", 32..2**20 for "storage"; None: 4096, or 65536
    for "storage").
    dtype: the format of x when x holds raw bits (e.g. a CuPy uint16 array of bfloat16 bits).
    backend: "cpu" or "cuda" to override where the work runs (default: where x lives).

    Returns a 1-D uint8 array of x's framework on x's device; on a GPU it is ordered on the
    caller's current stream, where the last kernel writing it may still run (docs/guide.md,
    "CUDA streams and synchronisation").
    """
    return execution.encode(_preset(mode, codebook, checksum, chunk), x, dtype=dtype, backend=backend)


def decompress(blob, *, backend: str | None = None):
    """Decode any kvzip blob; returns the original dtype and shape in the blob's framework.
    Raises kvzip.FormatError if the blob is malformed or (with a checksum) corrupted, or is a
    packed container (kvzip.pack), which decompress_many decodes."""
    try:
        return execution.decode(_default(None, False, DEFAULT_CHUNK), blob, backend=backend)
    except FormatError:
        # Asked only once decoding failed (on a GPU it reads 8 bytes back): a packed container
        # never decodes as a blob, its magic differs.
        if packing.is_packed(blob):
            raise FormatError("this is a packed container of kvzip blobs (kvzip.pack), not a blob: decode it with "
                              "kvzip.decompress_many(packed), or take its blobs with kvzip.unpack(packed)") from None
        raise


def compress_many(xs, codebook="auto", *, mode: str = "speed", checksum: bool = False, chunk: int | None = None,
                  dtype=None, backend: str | None = None, packed: bool = False):
    """compress() for a list of tensors; on a GPU all of them share one set of kernel launches.
    packed=True: the blobs as one packed container, kvzip.pack(the list) (the tensors then must
    all be of one framework and device)."""
    if type(packed) is not bool:
        raise TypeError(f"packed must be True or False, got {packed!r}")
    blobs = execution.encode_many(_preset(mode, codebook, checksum, chunk), xs, dtype=dtype, backend=backend)
    return packing.pack(blobs) if packed else blobs


def compress_bound(x, codebook="auto", *, chunk: int = DEFAULT_CHUNK, dtype=None) -> int:
    """The most bytes compress_into's blob of x can take: the size its dst must have.  x: a
    tensor, or a (shape, dtype) pair such as ((16, 8, 128), "bfloat16")."""
    return into.bound(_default(codebook, False, chunk), x, dtype)


def compress_into(x, dst, size_out, codebook="auto", *, chunk: int = DEFAULT_CHUNK, dtype=None):
    """compress() into the caller's memory: the blob at the start of dst (a 1-D uint8 array of at
    least compress_bound(x) bytes, 16-byte aligned on a GPU) and its length in size_out[0] (a
    1-D int64 array), both on x's device.  Returns size_out.

    On a GPU (x a CuPy array or torch CUDA tensor, contiguous and 16-byte aligned) the call is
    ordered on the caller's current stream and makes no host synchronisation and no allocation,
    so it can be captured in a CUDA graph; the first call for a shape on a stream builds its
    program (allocations), so make one before capturing or let the capture do it (docs/guide.md,
    "Into the caller's buffers").  The blob decodes like compress()'s; it is never stored raw (that
    choice needs the host), so an incompressible tensor's blob may be larger than its values,
    never larger than compress_bound(x).  No checksum: the checksum is summed on the host."""
    return into.compress_into(_default(codebook, False, chunk), x, dst, size_out, dtype)


def decompress_into(blob, out, status_out=None, codebook="auto", *, chunk: int = DEFAULT_CHUNK, dtype=None):
    """decompress() into the caller's tensor: the blob at the start of blob (a 1-D uint8 buffer,
    which may be longer: compress_into's dst) decoded into out, a contiguous tensor of the blob's
    dtype and shape on blob's device.  Returns out.

    status_out (a 1-D int64 array on that device) given: on a GPU the call makes no host
    synchronisation and can be captured in a CUDA graph; status_out[0] becomes 0 once decoded,
    else an error code (kvzip.status_text) and out's contents are undefined.  That way decodes
    blobs of one layout: the default pipeline with codebook ("auto": each blob's own, None: the
    shipped default) for out's dtype and shape, as compress() and compress_into() write them,
    not stored raw.  Without
    status_out any blob of out's dtype and shape decodes, and errors raise kvzip.FormatError (on
    a GPU the call then waits for the status).  dtype: the format of out when out holds raw bits
    (a CuPy uint8 array for float8 values, say), as compress()'s dtype."""
    return into.decompress_into(_default(codebook, False, chunk), blob, out, status_out, dtype)


def decompress_many(blobs, *, backend: str | None = None) -> list:
    """decompress() for a list of blobs, or for the blobs of one packed container (kvzip.pack)
    passed alone; on a GPU one header read-back and one decode launch per group.  A malformed
    member of a packed container raises kvzip.FormatError naming the member."""
    pipe = _default(None, False, DEFAULT_CHUNK)
    if not _one_buffer(blobs):
        return execution.decode_many(pipe, blobs, backend=backend)
    members = packing.unpack(blobs)  # FormatError for anything but a valid packed container
    try:
        return execution.decode_many(pipe, members, backend=backend)
    except FormatError as e:
        failed = e
    # The error path only: decode the members one at a time to name the one that fails (each is
    # judged by its own bytes alone, so it fails alone as it failed in the batch).
    for k, member in enumerate(members):
        try:
            execution.decode(pipe, member, backend=backend)
        except FormatError as e:
            raise FormatError(f"packed member {k} of {len(members)}: {e}") from e
    raise FormatError(f"packed container: {failed}") from failed


def _one_buffer(x) -> bool:
    """Whether decompress_many was handed one buffer (a bytes-like or a 1-D uint8 array: a packed
    container) rather than a list of blobs.  Lists, tuples, other iterables and arrays of other
    shapes or dtypes are lists of blobs, as they always were."""
    if isinstance(x, (list, tuple)):
        return False
    if isinstance(x, (bytes, bytearray, memoryview)):
        return True
    return arrays.framework_of(x) is not None and getattr(x, "ndim", None) == 1 \
        and str(getattr(x, "dtype", "")).removeprefix("torch.") == "uint8"


@lru_cache(maxsize=64)
def _shared(codebook, checksum, chunk) -> Pipeline:
    return splitzip_pipeline(codebook, checksum=checksum, chunk=chunk)


@lru_cache(maxsize=64)
def _shared_by_content(fmt_name: str, exponents: tuple, name, checksum, chunk) -> Pipeline:
    return splitzip_pipeline(Codebook(exponents, fmt_name, name), checksum=checksum, chunk=chunk)


# The modes whose codebooks come from each tensor: their pipeline and default chunk.
_FROM_TENSOR = {"ratio": (ratio_pipeline, DEFAULT_CHUNK), "storage": (storage_pipeline, STORAGE_CHUNK)}


@lru_cache(maxsize=64)
def _shared_from_tensor(mode, checksum, chunk) -> Pipeline:
    return _FROM_TENSOR[mode][0](checksum=checksum, chunk=chunk)


@lru_cache(maxsize=64)
def _shared_calibrated(codebook: ChannelCodebook, checksum, chunk) -> Pipeline:
    return ratio_pipeline(codebook, checksum=checksum, chunk=chunk)


def _preset(mode, codebook, checksum, chunk) -> Pipeline:
    """The pipeline compress() runs for mode (ValueError for an unknown mode, or a codebook the
    mode does not take); chunk None: the mode's default."""
    if mode == "speed" and type(mode) is str:
        return _default(codebook, checksum, DEFAULT_CHUNK if chunk is None else chunk)
    if type(mode) is str and mode in _FROM_TENSOR:
        build, default_chunk = _FROM_TENSOR[mode]
        chunk = default_chunk if chunk is None else chunk
        exact = type(checksum) is bool and type(chunk) is int  # only exact types reach the caches (_default says why)
        if codebook is None or (type(codebook) is str and codebook == "auto"):
            return _shared_from_tensor(mode, checksum, chunk) if exact else build(checksum=checksum, chunk=chunk)
        if mode == "ratio" and isinstance(codebook, (ChannelCodebook, dict)):
            if type(codebook) is dict:
                codebook = ChannelCodebook.from_dict(codebook)
            return _shared_calibrated(codebook, checksum, chunk) if exact else \
                ratio_pipeline(codebook, checksum=checksum, chunk=chunk)
        takes = ("\"auto\", None or a ChannelCodebook (kvzip.calibrate_channels) or its dict" if mode == "ratio" else
                 "no codebook: its tables come from each tensor")
        raise ValueError(f"mode={mode!r} takes {takes}; got {type(codebook).__name__} {_short(codebook)}"
                         + (" (a Top-16 codebook is for mode='speed')" if isinstance(codebook, (Codebook, str)) else ""))
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _default(codebook, checksum, chunk) -> Pipeline:
    """The pipeline compress()/decompress() run: built once per setting when the codebook is a
    name, the default, a Codebook object or its dict (by content: its format, exponents and name,
    all a blob records of it; so the same object comes back for equal codebooks, and the GPU executor's
    shortcuts for a call like the last apply); private, so no caller can change it.  Only exact
    types reach the caches: they match keys by equality, and 0 == False, 4096.0 == 4096, which the
    stages refuse; so a cached answer is always the one a fresh build would give."""
    if type(checksum) is bool and type(chunk) is int:
        if codebook is None or type(codebook) is str:
            return _shared(codebook, checksum, chunk)
        if type(codebook) is dict and isinstance(codebook.get("provenance"), (dict, type(None))):
            # Checked as from_dict checks it, less the provenance (a calibration record: no blob
            # holds it, and copying it would cost more than the encode's host work).
            codebook = Codebook.from_dict({k: v for k, v in codebook.items() if k != "provenance"})
        if type(codebook) is Codebook and (codebook.name is None or len(codebook.name) <= 256):
            return _shared_by_content(codebook.format.name, codebook.exponents, codebook.name, checksum, chunk)
    return splitzip_pipeline(codebook, checksum=checksum, chunk=chunk)


def info(blob) -> dict:
    """What a blob holds: dtype, shape, sizes, ratio, escapes, pipeline.  It accepts exactly the
    blobs decompress accepts (it decodes the blob and drops the values: some checks, such as
    escape positions, are made only while decoding) and raises kvzip.FormatError for the rest, a
    packed container included (take its blobs with kvzip.unpack and ask info of each)."""
    decompress(blob)
    u8, origin = arrays.import_bytes(blob)
    be = get_backend(origin.backend_name)
    hdr = container.parse_header(container.read_head(be, u8), u8.shape[0])
    frame = frame_from_header(be, u8, hdr)
    fmt = frame.dtype_format
    n = frame.n
    nchunks = escapes = plane_chunks = 0
    if "esc_count" in frame.streams:
        raw_counts = be.to_numpy(frame.streams["esc_count"])
        counts = raw_counts.astype(np.int64)
        nchunks = counts.shape[0]
        # 0xFFFF marks a plane-coded chunk in the uint16 counts (speed, ratio); ChannelRans's
        # uint32 counts are escapes only.
        plane = counts == 0xFFFF if raw_counts.dtype == np.uint16 else np.zeros(nchunks, bool)
        plane_chunks = int(plane.sum())
        escapes = int(counts[~plane].sum())
    raw = n * fmt.itemsize
    codebook = frame.meta.get("codebook")
    stages = frame.meta.get("pipeline") or []
    chosen = any(type(st) is dict and st.get("id") == "top16_pack" and st.get("codebook") == "auto" for st in stages)
    return {
        "dtype": fmt.dtype_name,
        "shape": tuple(frame.meta["shape"]),
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
        "pipeline": copy.deepcopy(frame.meta.get("pipeline")),  # parsed headers are cached: hand out a copy
        "codebook": "auto" if chosen else codebook.get("name") if isinstance(codebook, dict) else None,
    }
