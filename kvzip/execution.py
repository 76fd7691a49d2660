"""Where a pipeline's work runs: the one place that chooses an executor.

Two executors do the work:

- the staged executor (kvzip/staged.py): the stages one after another on any backend (with the
  fused split/pack/escape step where the pipeline fuses); the reference;
- the fused GPU executor (kvzip/gpu/executor.py): the CUDA programs that write and read blobs in
  place, for pipelines whose fused step is the last before Serialize, on a real GPU.

An encode's choice is made once per (pipeline configuration, format, shape, device, framework)
and kept in one bounded cache (_encoders); the GPU executor's ShapeEncoder there also holds what
it learned about the shape.  A decode's choice depends only on the pipeline's ``fuse`` and the
backend: which stages undo a blob is the blob's own recorded pipeline's business.  Which path a
call took is recorded per thread (kvzip.trace.last_path()).
"""
from __future__ import annotations

from collections import OrderedDict

from . import arrays, staged
from .backends import get_backend
from .gpu import executor as gpu

MAX_ENCODERS = 256  # choices kept (the oldest dropped first)
_encoders: OrderedDict = OrderedDict()  # see encoder(): key -> ShapeEncoder | None


def encoder(pipe, fmt, shape: tuple, backend, origin):
    """The fused GPU executor's ShapeEncoder for tensors of this format and shape from origin's
    framework and device, or None where the staged executor does the work."""
    # programs.ENABLED: tests and benchmarks switch the kernels off to run the Numba ones.
    key = (pipe.key, fmt.name, shape, backend.name, origin.device_index, origin.framework, gpu.programs.ENABLED)
    try:
        chosen = _encoders[key]
    except KeyError:
        chosen = gpu.ShapeEncoder(pipe, fmt, shape) if gpu.takes(pipe, backend) else None
        if len(_encoders) >= MAX_ENCODERS:
            _encoders.popitem(last=False)
        _encoders[key] = chosen
    return chosen


def forget() -> None:
    """Drop every choice (and what the GPU executor learned with it)."""
    _encoders.clear()


# ----------------------------------------------------------------------------- encode
def encode(pipe, x, *, dtype=None, backend=None):
    if backend is None:
        blob = gpu.encode_again(pipe, x, dtype)
        if blob is not None:
            return blob
    bits, fmt, shape, origin = arrays.import_tensor(x, dtype)
    be = get_backend(backend or origin.backend_name)
    chosen = encoder(pipe, fmt, shape, be, origin)
    with origin.stream_context():
        if chosen is not None:
            return chosen.encode(pipe, x, dtype, bits, be, origin)
        return staged.encode(pipe, bits, fmt, shape, be, origin)


def encode_many(pipe, xs, *, dtype=None, backend=None) -> list:
    xs = list(xs)
    out = [None] * len(xs)

    def lane_of(bits, fmt, shape, origin):
        chosen = encoder(pipe, fmt, shape, get_backend(backend or origin.backend_name), origin)
        return chosen.lane_for(bits) if chosen is not None else None

    rest, groups = _lane_groups(xs, dtype, lane_of)
    rest.update((i, None) for i in gpu.run_lanes(groups, out))
    members = []  # (index, ShapeEncoder, tensor frame, origin): the GPU executor's, without a lane
    by_stage = []  # (index, bits, fmt, shape, backend, origin): the staged executor's
    for i in sorted(rest):
        bits, fmt, shape, origin = rest[i] or arrays.import_tensor(xs[i], dtype)
        be = get_backend(backend or origin.backend_name)
        chosen = encoder(pipe, fmt, shape, be, origin)
        if chosen is None:
            by_stage.append((i, bits, fmt, shape, be, origin))
        elif gpu.fits(be, shape):
            members.append((i, chosen, staged.tensor_frame(bits, fmt, shape, be), origin))
        else:
            with origin.stream_context():
                out[i] = chosen.encode(pipe, xs[i], dtype, bits, be, origin)
    if by_stage:
        staged.encode_many(pipe, by_stage, out)
    if members:
        gpu.encode_many_general(members, out)
    return out


def _lane_groups(xs: list, dtype, lane_of) -> tuple[dict, list]:
    """The tensors of xs that have a lane (lane_of(bits, fmt, shape, origin): the lane of an
    imported tensor's ShapeEncoder, or None), grouped for gpu.run_lanes by format and caller
    ([indices, inputs, lanes, device addresses, origin]); and the others, index -> their import
    (bits, fmt, shape, origin), so that it is not done twice."""
    rest, groups = {}, {}  # (format, id of the origin) -> group
    # A serving loop's batch: tensors all alike, the first imported in full and the others only
    # their addresses read, a property at a time over the list (arrays.cuda_addresses).
    alike = arrays.cuda_addresses(xs) if len(xs) > 1 else None
    if alike is not None:
        bits, fmt, shape, origin = arrays.import_tensor(xs[0], dtype)
        lane = lane_of(bits, fmt, shape, origin)
        if lane is not None and origin is alike[0] and bits.data.ptr == alike[1][0] \
                and (origin.framework == "cupy" or not lane.quantize):  # torch's quantizing lanes read CuPy arrays
            return {}, [[list(range(len(xs))), [bits, *xs[1:]], [lane] * len(xs), alike[1], origin]]
    nd, tt = arrays.cupy_ndarray(), arrays.torch_tensor()
    run = None  # (type, dtype, shape, origin, lane, group) of the last input imported in full that had a lane
    for i, x in enumerate(xs):
        # Other batches: arrays like the last one need no import, only their address (what the
        # program reads), a fraction of an import's cost (a CuPy array over each tensor's memory:
        # benchmarks/NOTES.md, v19).
        if run is not None and type(x) is run[0] and x.dtype is run[1] and x.shape == run[2]:
            ptr = arrays.cuda_address(x, run[3])
            if ptr is not None and ptr % 16 == 0:  # aligned: what lane_of would check again
                group = run[5]
                group[0].append(i)
                group[1].append(x)
                group[2].append(run[4])
                group[3].append(ptr)
                continue
        imported = arrays.import_tensor(x, dtype)
        bits, fmt, shape, origin = imported
        lane = lane_of(bits, fmt, shape, origin)
        if lane is None:
            rest[i] = imported
            run = None
            continue
        group = groups.get((fmt.name, id(origin)))
        if group is None:  # a program per format and caller (the blobs come out in its framework)
            group = groups[(fmt.name, id(origin))] = [[], [], [], [], origin]
        group[0].append(i)
        group[1].append(bits)
        group[2].append(lane)
        group[3].append(bits.data.ptr)
        like = type(x) is nd or (type(x) is tt and not lane.quantize)
        run = (type(x), x.dtype, x.shape, origin, lane, group) if like else None
    return rest, list(groups.values())


# ----------------------------------------------------------------------------- decode
def decode(pipe, blob, *, backend=None):
    if backend is None and pipe.fuse:
        call = gpu.last_decode()
        if call is not None:
            got = gpu.decode_again(call, arrays.blob_addresses((blob,)))
            if got is not None:
                return got
    u8, origin = arrays.import_bytes(blob)
    be = get_backend(backend or origin.backend_name)
    with origin.stream_context():
        if type(u8) is arrays.cupy_ndarray() and not arrays.aligned(u8):
            # A blob at an unaligned address (a view at an odd offset): its 2- and 4-byte streams
            # cannot be read in place by any GPU kernel, ours or CuPy's; decode an aligned copy.
            u8 = u8.copy()
        if gpu.decodes(pipe, be, u8):
            return gpu.decode(pipe, u8, be, origin)
        return staged.decode(pipe, staged.to_backend(u8, be), be, origin)


def decode_many(pipe, blobs, *, backend=None) -> list:
    blobs = list(blobs)
    out = [None] * len(blobs)
    todo = gpu.decode_like_batch(pipe, blobs, arrays.blob_addresses(blobs), out) if backend in (None, "cuda") \
        else None
    if todo is not None and not todo:
        return out
    guess = todo is None  # blobs the batch above guessed wrong go straight to the header read-back
    todo, undecoded = (range(len(blobs)), blobs) if guess else (todo, [blobs[i] for i in todo])
    on_gpu = []  # (index, 16-byte aligned bytes on the GPU, origin, backend)
    seen = be = fast = None  # the last origin, its backend, whether the GPU executor decodes there
    for i, (u8, origin) in zip(todo, arrays.import_blobs(undecoded)):
        if origin is not seen:
            seen, be = origin, get_backend(backend or origin.backend_name)
            fast = gpu.decodes(pipe, be)
            move = be.name != origin.backend_name  # NumPy bytes for the GPU backend
        if fast:
            if move:
                u8 = staged.to_backend(u8, be)
            if arrays.aligned(u8):
                on_gpu.append((i, u8, origin, be))
                continue
        out[i] = decode(pipe, blobs[i], backend=backend)
    if on_gpu:
        gpu.decode_many(pipe, on_gpu, out, guess)
    return out
