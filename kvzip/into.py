"""compress_into / decompress_into: the codec writing into buffers the caller owns.

On a GPU (CuPy arrays, torch CUDA tensors) a call makes no host synchronisation and no
allocation: the blob's size (compress_into) and the decode's status (decompress_into, when
status_out is given) land in device memory, and the call can be captured in the caller's CUDA
graph (kvzip/gpu/into.py runs it).  On the CPU the same calls work synchronously: the ordinary
compress / decompress, then a copy into the caller's buffer.

Every argument is checked before any kernel runs, so a bad one raises and writes nothing:
buffers that are too small, of the wrong dtype or device, not contiguous, misaligned, or
overlapping one another.
"""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from . import arrays, container, execution
from .backends import get_backend
from .errors import FormatError, decode_error_text
from .formats import get_format
from .frame import Frame
from .gpu import into as gpu_into
from .gpu import programs
from .stages import FusedSplitPackEscape

ALIGN = 16        # dst, blob and out must start on 16-byte boundaries (the kernels' vector accesses)
MAX_LANES = 256   # plans kept (the oldest dropped first)
# (pipeline key, format, shape) -> [programs.EncodeLane, its layout_cache.Layout once asked for]
_lanes: OrderedDict = OrderedDict()


def bound(pipe, x, dtype=None) -> int:
    """The most bytes pipe's blob of x (a tensor, or a (shape, dtype) pair) can take."""
    fmt, shape = _format_and_shape(x, dtype)
    return _planned(pipe, fmt, shape)[0].plan.blob_bytes


def compress_into(pipe, x, dst, size_out, dtype=None):
    """Write pipe's blob of x at the start of dst and its length (int64) into size_out[0]."""
    _check_pipeline(pipe, "compress_into")
    bits, fmt, shape, origin = arrays.import_tensor(x, dtype)
    lane = _planned(pipe, fmt, shape)[0]
    need = lane.plan.blob_bytes
    if origin.device != "cuda":
        dst_u8 = _target(dst, "dst", origin, (np.uint8,), need, bound=True)
        sizes = _target(size_out, "size_out", origin, (np.int64,), 8)
        blob = arrays.import_bytes(execution.encode(pipe, x, dtype=dtype))[0]
        dst_u8[:blob.shape[0]] = blob
        sizes[0] = blob.shape[0]
        return size_out
    src = _in_place(x, origin, "x")
    dst_u8 = _target(dst, "dst", origin, (np.uint8,), need, aligned=True, bound=True)
    sizes = _target(size_out, "size_out", origin, (np.int64,), 8)
    _disjoint(("x", src, bits.nbytes), ("dst", dst_u8.data.ptr, need), ("size_out", sizes.data.ptr, 8))
    if not programs.applicable(get_backend("cuda"), bits.shape[0]):
        raise ValueError("compress_into needs the fast GPU kernels (on a real GPU, with fewer than 2**33 values)")
    import cupy

    with origin.stream_context():
        stream = cupy.cuda.get_current_stream()
        gpu_into.encoder(lane, cupy.cuda.runtime.getDevice(), stream).launch(src, dst_u8.data.ptr, sizes.data.ptr,
                                                                              stream)
    return size_out


def decompress_into(pipe, blob, out, status_out=None, dtype=None):
    """Decode the blob at the start of blob into out (a tensor of the blob's dtype and shape);
    its status (0, or a decode error code) into status_out[0] (int64), else raise on error."""
    _check_pipeline(pipe, "decompress_into")
    bits, fmt, shape, origin = arrays.import_tensor(out, dtype)
    u8, blob_origin = arrays.import_bytes(blob)
    if origin.device != "cuda":
        if blob_origin.device == "cuda":
            raise ValueError("decompress_into: blob is on a GPU but out is in host memory; both must be on one device")
        arrays.borrow_writable(out, "out")  # bits is then a view of out's memory
        status = _target(status_out, "status_out", origin, (np.int64,), 8) if status_out is not None else None
        _decode_copy(pipe, u8, bits, fmt, shape, origin)
        if status is not None:
            status[0] = 0
        return out
    dst = _in_place(out, origin, "out")
    u8 = _target(blob, "blob", origin, (np.uint8,), 1, aligned=True)
    status = _target(status_out, "status_out", origin, (np.int64,), 8) if status_out is not None else None
    _disjoint(("blob", u8.data.ptr, u8.nbytes), ("out", dst, bits.nbytes),
              *((("status_out", status.data.ptr, 8),) if status is not None else ()))
    try:
        layout = _layout(_planned(pipe, fmt, shape), shape)
    except ValueError:  # a version-1 header (2**32 values or more): no layout the device path checks
        if status is not None:
            raise
        layout = None
    short = layout is not None and u8.nbytes < layout.fixed_bytes  # shorter than any blob of the layout
    fast = programs.applicable(get_backend("cuda"), bits.shape[0])
    if status is None and (layout is None or short or not fast):
        with origin.stream_context():
            _decode_copy(pipe, u8, bits, fmt, shape, origin)
        return out
    if not fast:
        raise ValueError("decompress_into with status_out needs the fast GPU kernels (a real GPU, fewer than 2**33 values)")
    import cupy

    with origin.stream_context():
        if short:  # a blob of another layout (stored raw, say): the kernels would read past the buffer
            status.fill(programs.GUESS_MISSED)
            return out
        stream = cupy.cuda.get_current_stream()
        program = gpu_into.decoder(layout, cupy.cuda.runtime.getDevice(), stream)
        where = status.data.ptr if status is not None else program.status.data.ptr
        program.launch(u8.data.ptr, u8.nbytes, dst, where, stream)
        if status is not None:
            return out
        code = int(program.status.get(stream=stream)[0])  # the host's one look, asked for by leaving status_out out
        if code == programs.GUESS_MISSED:  # not a blob of the planned layout: decode it the checked way
            _decode_copy(pipe, u8, bits, fmt, shape, origin)
        elif code:
            raise FormatError(decode_error_text(code))
    return out


def status_text(code: int) -> str:
    """What a decompress_into status means (0: decoded)."""
    if code == 0:
        return "decoded"
    if code == programs.GUESS_MISSED:
        return ("not a blob of the expected layout: another dtype, shape, pipeline or codebook, a blob stored raw, "
                "or a header that does not check out")
    return decode_error_text(code)


# ----------------------------------------------------------------------------- helpers
def _check_pipeline(pipe, what: str) -> None:
    """The into calls run the preset pipeline's fused step alone (no checksum: it is summed on the host)."""
    steps = pipe.body_steps
    if not (pipe.fuse and len(steps) == 1 and isinstance(steps[0], FusedSplitPackEscape)) or pipe.stages[-1].checksum:
        raise ValueError(f"{what} runs the default pipeline without a checksum; use compress / decompress for others")


def _format_and_shape(x, dtype):
    """(format, shape) of a tensor, or of a (shape, dtype) pair."""
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], (tuple, list)):
        shape, name = tuple(int(d) for d in x[0]), x[1]
        if any(d < 0 for d in shape):
            raise ValueError(f"bad shape {shape}")
        return arrays.format_of_dtype(name), shape
    _, fmt, shape, _ = arrays.import_tensor(x, dtype)
    return fmt, tuple(shape)


def _planned(pipe, fmt, shape: tuple) -> list:
    """[encode plan (programs.EncodeLane), its layout or None] of pipe's blobs of tensors of fmt
    and shape (_layout fills the second in)."""
    key = (pipe.key, fmt.name, shape)
    hit = _lanes.get(key)
    if hit is not None:
        _lanes.move_to_end(key)
        return hit
    fused = pipe.body_steps[-1]
    n = math.prod(shape)
    data = np.broadcast_to(np.zeros((), fmt.uint_dtype), (n,))  # the plan reads sizes only
    frame = Frame(get_backend("cpu"), {"data": data},
                  {"dtype": fmt.dtype_name, "shape": list(shape), "n": n, "format": fmt.name,
                   "pipeline": pipe.stage_configs})
    planned = programs.plans_for([frame], fused.top16, fused.chunk, False)
    if planned is None:
        raise ValueError(f"a tensor of shape {shape} needs a version-1 header, which the into calls do not write "
                         "(2**32 values or more, or a long shape); use compress")
    (plan,), cb = planned
    hit = _lanes[key] = [programs.EncodeLane(plan, fmt, cb, fused.chunk), None]
    if len(_lanes) > MAX_LANES:
        _lanes.popitem(last=False)
    return hit


def _layout(planned: list, shape):
    """The layout every blob of _planned's entry has (what decompress_into's kernels expect)."""
    if planned[1] is None:
        planned[1] = gpu_into.planned_layout(planned[0], shape)
    return planned[1]


def _in_place(x, origin, what: str) -> int:
    """x's device address, where the kernels may use x's own memory (contiguous, aligned)."""
    ptr = origin.address_of(x)
    if ptr is None:
        raise ValueError(f"{what}: the into calls use the tensor's own memory: pass a contiguous CuPy array or "
                         "torch CUDA tensor")
    if ptr % ALIGN:
        raise ValueError(f"{what}: its address is not a multiple of {ALIGN} bytes")
    return ptr


def _target(x, what: str, origin, dtypes, least: int, aligned: bool = False, bound: bool = False):
    """x as a writable 1-D view of its own memory (NumPy or CuPy) on origin's device, of one of
    dtypes and at least `least` bytes (bound: that is compress_bound's figure), on a GPU starting
    on an ALIGN boundary where aligned; ValueError or TypeError otherwise."""
    if x is None:
        raise TypeError(f"{what} is required")
    arr, name, x_origin = arrays.borrow_writable(x, what)
    if x_origin.device != origin.device or x_origin.device_index != origin.device_index:
        raise ValueError(f"{what} is on {_where(x_origin)}, the tensor on {_where(origin)}: both must be on one device")
    if name not in [np.dtype(d).name for d in dtypes] or arr.ndim != 1:
        want = " or ".join(np.dtype(d).name for d in dtypes)
        raise ValueError(f"{what} must be a 1-D {want} array, got {name} of shape {tuple(arr.shape)}")
    if arr.nbytes < least:
        raise ValueError(f"{what} holds {arr.nbytes} bytes; the call needs {least}"
                         + (" (kvzip.compress_bound)" if bound else ""))
    if aligned and origin.device == "cuda" and arr.data.ptr % ALIGN:
        raise ValueError(f"{what}: its address is not a multiple of {ALIGN} bytes")
    return arr


def _where(origin) -> str:
    return f"cuda:{origin.device_index}" if origin.device == "cuda" else "the CPU"


def _disjoint(*ranges) -> None:
    """ValueError where two of the (name, address, bytes) ranges overlap."""
    for i, (a, at, na) in enumerate(ranges):
        for b, bt, nb in ranges[i + 1:]:
            if at < bt + nb and bt < at + na:
                raise ValueError(f"{a} and {b} overlap")


def _decode_copy(pipe, u8, bits, fmt, shape, origin) -> None:
    """The checked decode of the blob at the start of u8, copied into bits (out's memory)."""
    be = get_backend(origin.backend_name)
    head = container.read_head(be, u8)
    length = container.claimed_length(head)
    if length > u8.shape[0]:
        raise FormatError(f"the blob's header claims {length} bytes; the buffer holds {u8.shape[0]}")
    got = execution.decode(pipe, u8[:length])  # every check of the blob first (FormatError)
    got_bits, got_fmt, got_shape, _ = arrays.import_tensor(got, _recorded_format(container.parse_header(head, length)))
    if got_fmt.name != fmt.name or tuple(got_shape) != tuple(shape):
        raise ValueError(f"the blob holds a {got_fmt.dtype_name} tensor of shape {tuple(got_shape)}; "
                         f"out is {fmt.dtype_name} of shape {tuple(shape)}")
    bits[...] = got_bits


def _recorded_format(hdr):
    """The format of the values a decoded blob holds: its metadata's dtype (which decoding has
    accepted, aliases included), so that raw bits (a CuPy array of float8 codes) import as it."""
    return get_format(hdr.meta["dtype"])
