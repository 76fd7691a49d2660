"""The staged executor: a pipeline's stages run one after another on any backend, the
reference every fast path is tested against.

Where ExponentSplit, Top16Pack and EscapeStream follow each other in a pipeline that fuses
(``Pipeline.fuse``), they run as one step, FusedSplitPackEscape (stages/fused.py: a CPU twin and
Numba-CUDA kernels), which writes the same bytes.  On the CPU a pipeline whose fused step comes
last writes the container directly (FusedSplitPackEscape.encode_blob).  The ratio mode's
ChannelPack (stages/channel_pack.py) is one step of its own; on a GPU, as the last step before
Serialize, it writes the container directly too (ChannelPack.encode_blob).  Encoding falls back
to storing the values raw (flagged) when the split or channel-coded streams would be larger than
the values.
kvzip/execution.py decides when this executor runs; kvzip/trace.py records which path did.
"""
from __future__ import annotations

import math

import numpy as np

from . import container, trace
from .errors import FormatError
from .frame import Frame
from .stages import ChannelPack, ChannelRans, ExponentSplit, FusedSplitPackEscape, Serialize, channel_pack
from .stages.base import on_device
from .stages.serialize import frame_from_header


def to_backend(a, backend):
    """a (a NumPy or CuPy array) on backend: a no-op when it is there already."""
    if backend.name == "cpu":
        return a if isinstance(a, np.ndarray) else np.asarray(a.get() if hasattr(a, "get") else a)
    return backend.from_numpy(a) if isinstance(a, np.ndarray) else a


def to_origin(a, origin):
    """a on the caller's device (origin: kvzip.arrays.Origin), as NumPy or CuPy."""
    if origin.device == "cpu":
        return a if isinstance(a, np.ndarray) else a.get()
    if isinstance(a, np.ndarray):
        import cupy

        return cupy.asarray(a)
    return a


def tensor_frame(bits, fmt, shape, backend) -> Frame:
    return Frame(backend, {"data": to_backend(bits, backend)},
                 {"dtype": fmt.dtype_name, "shape": list(shape), "n": math.prod(shape), "format": fmt.name})


# ----------------------------------------------------------------------------- encode
def encode(pipe, bits, fmt, shape, backend, origin):
    """The blob of one imported tensor, as the caller's 1-D uint8 array (origin: the caller, a
    kvzip.arrays.Origin)."""
    with origin.memory_context():
        blob = encode_frame(pipe, tensor_frame(bits, fmt, shape, backend)).streams["blob"]
        return origin.export_bytes(to_origin(blob, origin))


# The steps that take the values apart (after them the size fallback can store the values raw).
SPLITTING = (ExponentSplit, FusedSplitPackEscape, ChannelPack, ChannelRans)


def encode_frame(pipe, frame: Frame, start: int = 0) -> Frame:
    """Tensor frame -> blob frame.  start: the index in pipe.body_steps to run from (frame is
    the output of the steps before it; the fused GPU executor hands over its fallbacks so)."""
    frame.meta["pipeline"] = pipe.stage_configs
    steps, serialize = pipe.body_steps, pipe.stages[-1]
    trace.note("staged")
    before_split = None
    for i in range(start, len(steps)):
        step = steps[i]
        if isinstance(step, SPLITTING):
            before_split = frame
        if isinstance(step, FusedSplitPackEscape):
            trace.note("fused")
            if i == len(steps) - 1 and frame.backend.name == "cpu" and set(frame.streams) == {"data"}:
                # The CPU writes the container itself; a frame with more streams (a quantizer's
                # scales) takes the general way below.
                out = step.encode_blob(frame, serialize.checksum)
                return stored(pipe, before_split) if out is None else out
        if isinstance(step, ChannelPack) and i == len(steps) - 1 and set(frame.streams) == {"data"}:
            head = step.blob_header(frame, serialize.checksum)
            if head is not None:  # on a GPU the kernels write the container themselves
                out, payload = step.encode_blob(frame, head, serialize.checksum)
                return stored(pipe, before_split) if payload > serialize.payload_size(before_split) else out
        frame = step.encode(frame)
    if before_split is not None and serialize.payload_size(frame) > serialize.payload_size(before_split):
        return stored(pipe, before_split)
    return serialize.encode(frame)


def encode_many(pipe, items: list, out: list) -> None:
    """encode of each (index, bits, fmt, shape, backend, origin) into out[index].  The ratio
    mode's tensors on a GPU ([ChannelPack, Serialize], the kernels writing the blobs) go per caller
    in one batch, every tensor's kernels queued before one wait for all (stages/channel_pack.py
    encode_blobs); the others one by one."""
    steps = pipe.body_steps
    batched = {}  # origin -> [(index, bits, fmt, shape, backend)]: Origins are equal by value, one a caller
    for i, bits, fmt, shape, be, origin in items:
        if len(steps) == 1 and isinstance(steps[0], ChannelPack) and on_device(be):
            batched.setdefault(origin, []).append((i, bits, fmt, shape, be))
        else:
            with origin.stream_context():
                out[i] = encode(pipe, bits, fmt, shape, be, origin)
    for origin, members in batched.items():
        with origin.stream_context(), origin.memory_context():
            _encode_channel_batch(pipe, members, origin, out)


def _encode_channel_batch(pipe, members: list, origin, out: list) -> None:
    stage, serialize = pipe.body_steps[0], pipe.stages[-1]
    at, frames, heads = [], [], []
    for i, bits, fmt, shape, be in members:
        frame = tensor_frame(bits, fmt, shape, be)
        frame.meta["pipeline"] = pipe.stage_configs
        head = stage.blob_header(frame, serialize.checksum)
        if head is None:  # a blob the compact header cannot hold: Serialize writes it
            out[i] = origin.export_bytes(to_origin(encode_frame(pipe, frame).streams["blob"], origin))
            continue
        at.append(i)
        frames.append(frame)
        heads.append(head)
    trace.note("staged")
    for i, frame, (blob, payload) in zip(at, frames, channel_pack.encode_blobs(stage, frames, heads, serialize.checksum)):
        if payload > serialize.payload_size(frame):
            blob = stored(pipe, frame)
        out[i] = origin.export_bytes(to_origin(blob.streams["blob"], origin))


def stored(pipe, before_split: Frame) -> Frame:
    """The values raw (after any stages ahead of the split), flagged as the size fallback."""
    split_at = next(i for i, s in enumerate(pipe.stages) if isinstance(s, SPLITTING))
    serialize = pipe.stages[-1]
    before_split.meta["pipeline"] = [s.get_config() for s in (*pipe.stages[:split_at], serialize)]
    trace.note("stored")
    return serialize.encode(before_split, flags=container.FLAG_STORED)


# ----------------------------------------------------------------------------- decode
def open_blob(u8, backend):
    """(head bytes, parsed header, opened frame) of a blob on backend."""
    head = container.read_head(backend, u8)
    hdr = container.parse_header(head, u8.shape[0])
    return head, hdr, frame_from_header(backend, u8, hdr)


def decode(pipe, u8, backend, origin):
    """The tensor of one imported blob (u8 on backend), in the caller's framework.

    On the CPU a payload checksum is verified by the fused decode as it reads the words (a
    PayloadCheck), not in a pass of its own before; still before any other step reads the
    payload and before any error goes out: a corrupted payload's checksum error wins over the
    errors the header checks or the decode would raise."""
    with origin.memory_context():
        return _decode(pipe, u8, backend, origin)


def _decode(pipe, u8, backend, origin):
    head = container.read_head(backend, u8)
    hdr = container.parse_header(head, u8.shape[0])
    check = container.PayloadCheck(u8, hdr) if backend.name == "cpu" and hdr.flags & container.FLAG_CHECKSUM \
        else None
    try:
        frame = decode_opened(pipe, frame_from_header(backend, u8, hdr, check), check)
        if check is not None:
            check.verify()  # a no-op where the fused decode verified it
    except Exception:
        if check is not None:
            check.verify()
        raise
    out = export_decoded(frame, origin)
    container.remember_header(head, u8.shape[0], hdr)
    return out


def decode_channel_many(members: list, out: list) -> None:
    """Decode opened blobs of the ratio mode on a GPU ([ChannelPack, Serialize] recorded):
    members are (index, opened frame, origin, ChannelPack stage, head, blob, parsed header) and
    out[index] gets each tensor, per caller in one batch (stages/channel_pack.py decode_many:
    one wait for all the kernels, which check the tables too).  The first (by index) blob that
    fails raises its FormatError once the batch is done."""
    trace.note("staged")
    by_origin: dict = {}
    for m in members:
        by_origin.setdefault(m[2], []).append(m)  # Origins are equal by value: one group a caller
    failed = {}
    for group in by_origin.values():
        origin = group[0][2]
        with origin.memory_context():
            decoded = channel_pack.decode_many([(m[3], m[1]) for m in group])
        for (i, _, _, _, head, u8, hdr), frame in zip(group, decoded):
            if isinstance(frame, Exception):
                failed[i] = frame
                continue
            out[i] = export_decoded(frame, origin)
            container.remember_header(head, u8.shape[0], hdr)
    if failed:
        raise failed[min(failed)]


def decode_frame(pipe, frame: Frame) -> Frame:
    """Blob frame -> tensor frame, following the pipeline the blob records."""
    return decode_opened(pipe, Serialize().decode(frame))


def decode_opened(pipe, frame: Frame, check: container.PayloadCheck | None = None) -> Frame:
    """Undo the stages of the pipeline an opened blob records (fused as pipe fuses).  check: the
    payload checksum still to verify (decode_steps says where)."""
    recorded = pipe.recorded(frame.meta, fuse=pipe.fuse)
    recorded.check_streams(frame)
    frame = decode_steps(recorded.body_steps, frame, check)
    if set(frame.streams) != {"data"}:
        raise FormatError(f"decoding left streams {sorted(frame.streams)}; the blob holds unknown streams")
    return frame


def decode_steps(steps, frame: Frame, check: container.PayloadCheck | None = None) -> Frame:
    """The steps' decoders, last step first.  check: verified by the fused decode where that runs
    first (on the CPU it sums the words it decodes), else here before any step reads the payload."""
    trace.note("staged")
    steps = list(reversed(steps))
    if check is not None and not (steps and isinstance(steps[0], FusedSplitPackEscape)):
        check.verify()
        check = None
    for step in steps:
        if isinstance(step, FusedSplitPackEscape):
            frame = step.decode(frame, check)
            trace.note("fused")
        else:
            frame = step.decode(frame)
        check = None
    return frame


def export_decoded(frame: Frame, origin):
    """A decoded frame's values as the caller's tensor (its dtype and shape from the blob)."""
    if set(frame.streams) != {"data"}:
        raise FormatError(f"decoding left streams {sorted(frame.streams)}; the blob holds unknown streams")
    fmt = frame.dtype_format
    if frame.format != fmt:
        raise FormatError(f"decoded values are {frame.format.name} but the blob says dtype {fmt.dtype_name}")
    data = frame.expect("data", fmt.uint_dtype, frame.n)
    return origin.export_tensor(to_origin(data, origin), fmt, tuple(frame.meta["shape"]))
