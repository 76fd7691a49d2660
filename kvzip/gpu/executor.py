"""The fused GPU executor: a pipeline whose split/pack/escape step is fused (and last before
Serialize) runs on a real GPU as the CUDA programs of kvzip/gpu/programs.py, which write and
read container blobs in place (the slot zarr v3 calls a CodecPipeline).

kvzip/execution.py decides when it runs (``takes``) and holds one ShapeEncoder per pipeline,
format, shape, device and framework.  What it works out is private to it:

- a ShapeEncoder learns its *lane* (programs.EncodeLane: plan and codebook) the first time the
  general encode runs the fast kernels, so later tensors go straight to the lane's program;
- the *repeat* shortcut (_EncodeRepeat, kept per thread in graphs.remember) sends a tensor like
  the thread's last one to that program with none of the import or lookups redone;
- decoding first tries the layout the blob's length suggests (layout_cache.guess: no header
  read-back), then layouts whose headers passed every check before (layout_cache.match), then
  the general decode, which fully parses the header and teaches layout_cache the layout.

Inputs the kernels cannot take (misaligned, a checksum, stages the kernels do not run) go to the
staged executor (kvzip/staged.py) from wherever the fast path stopped.
"""
from __future__ import annotations

import math

import numpy as np

from kvzip import container, staged, trace
from kvzip.backends import get_backend
from kvzip.frame import Frame
from kvzip.stages import ChannelPack, FusedSplitPackEscape, QuantizeFP8
from kvzip.stages.base import on_device

from . import graphs, layout_cache, programs, quantize_kernels
from .abi import aligned


def takes(pipe, backend) -> bool:
    """Whether this executor may run pipe's work on backend: a real GPU with the kernels on, and
    a pipeline whose fused split/pack/escape step is the last before Serialize."""
    steps = pipe.body_steps
    return pipe.fuse and programs.applicable(backend) and bool(steps) and isinstance(steps[-1], FusedSplitPackEscape)


def decodes(pipe, backend, u8=None) -> bool:
    """Whether this executor decodes blobs for pipe on backend (u8, when given: the blob's bytes
    there, 16-byte aligned).  Any blob: its own recorded pipeline decides, once its header is
    read, whether the kernels or the stages undo it."""
    return pipe.fuse and programs.applicable(backend, 0, u8)


def fits(backend, shape: tuple) -> bool:
    """Whether the kernels' counters hold a tensor of this shape."""
    return programs.applicable(backend, math.prod(shape))


# ----------------------------------------------------------------------------- encode
class ShapeEncoder:
    """Encodes tensors of one format and shape for one pipeline on the GPU (execution.py keeps
    one per pipeline, format, shape, device and framework)."""

    __slots__ = ("pipe", "fmt", "shape", "lane")

    def __init__(self, pipe, fmt, shape: tuple):
        self.pipe, self.fmt, self.shape = pipe, fmt, shape
        self.lane = None  # programs.EncodeLane once the general encode ran the kernels

    def lane_for(self, bits):
        """The lane, if there is one and bits (the input on the GPU) can take it; else None."""
        lane = self.lane
        return lane if lane is not None and aligned(bits) else None

    def encode(self, pipe, x, dtype, bits, backend, origin):
        """The blob of x (imported: bits on backend; pipe: the caller's pipeline, equal to
        self.pipe), as the caller's array."""
        lane = self.lane_for(bits)
        if lane is not None:
            blob = lane.encode(bits, origin)
            if blob is not None:
                trace.note("fast")
                if graphs.KEEP and origin.framework in ("cupy", "torch") and origin.device == "cuda" \
                        and (dtype is None or type(dtype) is str) and math.prod(self.shape):
                    graphs.remember("encode", _EncodeRepeat(pipe, x, dtype, origin, lane))
                return blob
        frame = staged.tensor_frame(bits, self.fmt, self.shape, backend)
        return origin.export_bytes(staged.to_origin(self.encode_frame(frame).streams["blob"], origin))

    def encode_frame(self, frame):
        """The blob frame of a tensor frame: the stages ahead of the fused step, then its kernels
        (which write the container), or the staged executor where they cannot run."""
        pipe = self.pipe
        steps, checksum = pipe.body_steps, pipe.stages[-1].checksum
        frame.meta["pipeline"] = pipe.stage_configs
        for step in steps[:-1]:  # stages ahead of the split (QuantizeFP8) run as staged
            frame = step.encode(frame)
        fused = steps[-1]
        if not programs.applicable(frame.backend, frame.n, frame.streams.get("data")):
            return staged.encode_frame(pipe, frame, start=len(steps) - 1)
        planned = programs.plans_for([frame], fused.top16, fused.chunk, checksum)
        if planned is None:
            return staged.encode_frame(pipe, frame, start=len(steps) - 1)
        batch = programs.encode_batch([frame], *planned, fused.chunk)
        if not batch.fits[0]:
            return staged.stored(pipe, frame)
        trace.note("fast")
        self.learn(frame, batch.plans[0])
        return Frame(frame.backend, {"blob": batch.blob(0)}, frame.meta)

    def learn(self, frame, plan) -> None:
        """Keep the lane for later tensors when the program can do the whole body: the fused step
        alone, or after QuantizeFP8 with one scale per tensor of 16-bit input (the program then
        quantizes too).  frame: the fused step's input.  Never with a checksum (it is summed on
        the host)."""
        steps = self.pipe.body_steps
        if self.lane is not None or self.pipe.stages[-1].checksum or len(steps) > 2:
            return
        quantize = None
        if len(steps) == 2:
            front = steps[0]
            if not (isinstance(front, QuantizeFP8) and front.granularity == "tensor"):
                return
            quantize = frame.meta["quantize_fp8"]["source_format"]
            if quantize not in quantize_kernels.SOURCES:
                return
        fmt, fused = frame.format, steps[-1]
        codebook = None if fused.top16.auto else fused.top16.codebook_for(fmt)  # None: each tensor's own (auto)
        self.lane = programs.EncodeLane(plan, fmt, codebook, fused.chunk, quantize)


class _EncodeRepeat:
    """What encode worked out for a CuPy or torch tensor that took a lane, kept per thread
    (graphs.remember) so the next tensor like it goes straight to the same program: the import,
    the choice and the program lookups would all come out the same.  Like it: the same pipeline
    object and dtype argument (None or a name), array type, dtype and shape, contiguous and
    16-byte aligned on the same device, which is current.  The stream is the caller's current
    one, as on the full path."""

    __slots__ = ("pipe", "dtype", "kind", "xdtype", "shape", "origin", "lane", "program")

    def __init__(self, pipe, x, dtype, origin, lane):
        self.pipe, self.dtype, self.kind, self.xdtype, self.shape = pipe, dtype, type(x), x.dtype, tuple(x.shape)
        self.origin, self.lane = origin, lane
        self.program = lane.program(origin.device_index)

    def encode(self, pipe, x, dtype):
        """The blob of x when it is like the tensor this was made for, else None (also where
        the payload comes out larger than the values: the full path then stores them raw)."""
        if pipe is not self.pipe or dtype != self.dtype or type(x) is not self.kind or x.dtype is not self.xdtype \
                or x.shape != self.shape or not self.lane.usable():
            return None
        ptr = self.origin.address_of(x)
        stream = self.origin.working_stream() if ptr is not None and ptr % 16 == 0 else None
        if stream is None:
            return None
        return self.program.encode([ptr], self.origin, stream)[0]


def encode_again(pipe, x, dtype):
    """The blob of a tensor like the last one this thread encoded through a lane (_EncodeRepeat),
    or None: take the full path."""
    last = graphs.recall("encode")
    if last is None or (dtype is not None and type(dtype) is not str):
        return None
    blob = last.encode(pipe, x, dtype)
    if blob is not None:
        trace.note("fast")
    return blob


def run_lanes(groups, out: list) -> list[int]:
    """Encode tensors through their lanes, a program run per group of one format and caller:
    groups holds [indices, inputs (arrays over the values), lanes, device addresses, origin].
    Fills out; returns the indices left (stored raw after all: the payload came out larger)."""
    rest = []
    for indices, inputs, lanes, ptrs, origin in groups:
        with origin.stream_context():
            blobs = programs.encode_lanes(lanes, inputs, origin, ptrs)
        for i, blob in zip(indices, blobs):
            if blob is None:
                rest.append(i)
            else:
                out[i] = blob
        trace.note("fast")
    return rest


def encode_many_general(members: list, out: list) -> None:
    """Encode tensors without a lane: members (index, encoder, tensor frame, origin), all of one
    pipeline; the stages ahead of the fused step per tensor, then one fused kernel run per
    format; the encoders learn their lanes.  Fills out."""
    groups: dict = {}  # format -> [(index, encoder, fused step's input frame, origin)]
    for i, encoder, frame, origin in members:
        pipe = encoder.pipe
        steps = pipe.body_steps
        frame.meta["pipeline"] = pipe.stage_configs
        with origin.stream_context():
            for step in steps[:-1]:  # stages ahead of the split (QuantizeFP8) run per tensor
                frame = step.encode(frame)
            if programs.applicable(frame.backend, frame.n, frame.streams["data"]):
                groups.setdefault(frame.format.name, []).append((i, encoder, frame, origin))
                continue
            blob = staged.encode_frame(pipe, frame, start=len(steps) - 1).streams["blob"]
        out[i] = origin.export_bytes(staged.to_origin(blob, origin))
    for group in groups.values():
        pipe = group[0][1].pipe
        fused = pipe.body_steps[-1]
        with group[0][3].stream_context():
            frames = [m[2] for m in group]
            planned = programs.plans_for(frames, fused.top16, fused.chunk, pipe.stages[-1].checksum)
            if planned is None:  # auto codebooks the GPU cannot write (version-1 headers)
                for i, _, frame, origin in group:
                    out[i] = origin.export_bytes(staged.encode_frame(pipe, frame, start=len(pipe.body_steps) - 1)
                                                 .streams["blob"])
                continue
            batch = programs.encode_batch(frames, *planned, fused.chunk)
            for j, (i, encoder, frame, origin) in enumerate(group):
                if batch.fits[j]:
                    blob = batch.blob(j)
                    encoder.learn(frame, batch.plans[j])
                else:  # incompressible: stored raw, as encode() would
                    blob = staged.stored(pipe, frame).streams["blob"]
                out[i] = origin.export_bytes(blob)
    if groups:
        trace.note("fast")


# ----------------------------------------------------------------------------- decode
def last_decode():
    """This thread's last decode on a guessed layout, which decode_again may repeat, or None."""
    return layout_cache.last_decode()


def decode_again(call, found):
    """The tensor of a blob like the one call (last_decode()) decoded (layout_cache.decode_again;
    found: the blob's origin, address and length), or None: take the full path."""
    got = layout_cache.decode_again(call, found)
    if got is not None:
        trace.note("fast")
    return got


def decode(pipe, u8, backend, origin):
    """decompress of one blob (u8: its 16-byte aligned bytes on the GPU), on the caller's stream."""
    layout = layout_cache.guess(u8.shape[0])
    if layout is not None:  # most blobs are of the layout decoded last: no header read-back
        got = layout_cache.decode_one_guessed(layout, u8, origin)
        if got is not None:
            trace.note("fast")
            return got
    head = container.read_head(backend, u8)
    hit = layout_cache.match(head, u8.shape[0])
    if hit is not None:  # a layout that passed every check before: straight to the kernels
        trace.note("fast")
        return layout_cache.decode([hit], [u8], origin)[0]
    out = [None]
    decode_general(pipe, [((0, u8, origin, backend), head)], out, labelled=False)
    return out[0]


def decode_many(pipe, gpu: list, out: list, guess: bool) -> None:
    """decode_many's GPU blobs: gpu holds (index, 16-byte aligned bytes on the GPU, origin,
    backend) entries.  guess: first try the layouts their lengths suggest.  Fills out."""
    with gpu[0][2].stream_context():
        launched = False
        if guess:  # first on the layouts guessed from the blobs' lengths, no header read-back
            left = _decode_guessed(gpu, out)
            launched = len(left) < len(gpu)
            gpu = [gpu[j] for j in left]
        if not gpu:
            trace.note("fast")
            return
        sizes = [g[1].shape[0] for g in gpu]
        block, checks = programs.head_block([g[1].data.ptr for g in gpu], sizes)  # one read-back for all
        matched, unmatched = layout_cache.match_many(block, sizes, checks)
        heads = programs.heads_from_block(block[unmatched], [gpu[j][1] for j in unmatched])
        launched = _decode_known(matched, gpu, out) or launched
        decode_general(pipe, [(gpu[j], head) for j, head in zip(unmatched, heads)], out)
    if launched:
        trace.note("fast")


def decode_like_batch(pipe, blobs: list, found, out: list) -> list[int] | None:
    """decode_many's usual batch with the least host work: blobs compress_many gave a CuPy or
    torch caller (one device, 16-byte aligned) of one guessed layout, checked in one pass and
    decoded in one program run (the general loops cost far more host time ahead of the launch:
    benchmarks/NOTES.md, v18).  Fills out; returns the positions left to decode
    the checked way (a wrong guess), or None where the batch is not of that kind.  found: the
    blobs' (origin, addresses, lengths) as kvzip.arrays.blob_addresses gives them, or None."""
    if found is None or not decodes(pipe, get_backend("cuda")):
        return None
    origin, ptrs, lengths = found
    guesses = layout_cache.guess_many(lengths)
    layout = guesses[0]
    if layout is None or any(g is not layout for g in guesses):
        return None
    if layout.dequantize is not None and origin.framework != "cupy":  # its scale is read through CuPy arrays
        return None
    with origin.stream_context():
        got, misses = layout_cache.decode_guessed(guesses, blobs, range(len(blobs)), origin, (ptrs, lengths))
    out[:] = got
    if len(misses) < len(blobs):
        trace.note("fast")
    return misses


def decode_general(pipe, rest: list, out: list, labelled: bool = True) -> bool:
    """Decode blobs no remembered layout matched (rest: their (index, bytes, origin, backend)
    entries and heads) with the full checks: one fused kernel run per format and chunk size, the
    other pipelines stage by stage; layouts the kernels decoded are remembered.  labelled: errors
    name the blob by its index (a batch).  Returns whether any fused run was made."""
    groups: dict = {}
    channel = []  # the ratio mode's blobs: staged.decode_channel_many's members
    for (i, u8, origin, be), head in rest:
        hdr = container.parse_header(head, u8.shape[0])
        frame = staged.frame_from_header(be, u8, hdr)
        recorded = pipe.recorded(frame.meta)
        recorded.check_streams(frame)
        steps = recorded.body_steps
        if steps and isinstance(steps[-1], FusedSplitPackEscape) and programs.decode_applicable(frame):
            fused = steps[-1]
            cb = fused.check(frame)
            groups.setdefault((frame.format.name, fused.chunk), []).append((i, frame, origin, recorded, cb, head, u8, hdr))
        elif len(steps) == 1 and isinstance(steps[0], ChannelPack) and on_device(be):
            channel.append((i, frame, origin, steps[0], head, u8, hdr))
        else:
            with origin.memory_context():  # stage by stage: CuPy allocates, from the caller's allocator
                out[i] = staged.export_decoded(staged.decode_steps(steps, frame), origin)
            container.remember_header(head, u8.shape[0], hdr)
    if channel:
        staged.decode_channel_many(channel, out)
    for (_, chunk), members in groups.items():
        dsts = programs.decode_batch([m[1] for m in members], chunk, [m[4] for m in members],
                                     [m[0] for m in members] if labelled else None)
        for (i, opened, origin, recorded, _, head, u8, hdr), dst in zip(members, dsts):
            steps = recorded.body_steps
            frame = steps[-1].finish_decode(opened, dst)
            for step in reversed(steps[:-1]):
                frame = step.decode(frame)
            out[i] = staged.export_decoded(frame, origin)
            container.remember_header(head, u8.shape[0], hdr)
            layout_cache.remember(head, u8.shape[0], opened, recorded.stages)
        trace.note("fast")
    return bool(groups)


def _decode_guessed(gpu: list, out: list) -> list[int]:
    """Decode the blobs of gpu (entries (index, bytes, origin, backend)) whose layout
    layout_cache.guess_many can guess: one program run per format, chunk size and caller
    framework, each header checked against its guess on the GPU.  Returns the positions in gpu
    left to decode the checked way (no guess, or a wrong one)."""
    guesses = layout_cache.guess_many([g[1].shape[0] for g in gpu])
    origin = gpu[0][2]
    if guesses[0] is not None and all(g is guesses[0] for g in guesses) and all(g[2] is origin for g in gpu):
        runs = {None: (list(range(len(gpu))), guesses)}  # the usual batch: one layout and caller
    else:
        runs = {}  # (format, chunk, id of the origin) -> (positions, layouts)
        for j, layout in enumerate(guesses):
            if layout is not None:
                pos, layouts = runs.setdefault((layout.fmt.name, layout.chunk, id(gpu[j][2])), ([], []))
                pos.append(j)
                layouts.append(layout)
    left = [j for j, layout in enumerate(guesses) if layout is None]
    for pos, layouts in runs.values():
        got, misses = layout_cache.decode_guessed(layouts, [gpu[j][1] for j in pos], [gpu[j][0] for j in pos],
                                                  gpu[pos[0]][2])
        for j, value in zip(pos, got):
            if value is not None:
                out[gpu[j][0]] = value
        left += [pos[i] for i in misses]
    return sorted(left)


def _decode_known(matched: list, gpu: list, out: list) -> bool:
    """Decode the blobs layout_cache.match_many matched (groups of one layout, batch positions,
    job rows): one program run per format, chunk size and caller framework.  Returns whether
    there were any."""
    runs: dict = {}  # (format, chunk, origin) -> [(layout, positions, jobs)]
    for layout, pos, jobs in matched:
        origins = [gpu[j][2] for j in pos.tolist()]
        if all(o is origins[0] for o in origins):  # the usual batch: one framework and device
            split = [(origins[0], slice(None))]
        else:
            split = [(o, np.array([x == o for x in origins])) for o in dict.fromkeys(origins)]
        for origin, keep in split:
            runs.setdefault((layout.fmt.name, layout.chunk, origin), []).append((layout, pos[keep], jobs[keep]))
    for members in runs.values():
        pos = np.concatenate([m[1] for m in members]).tolist()
        layouts = [m[0] for m in members for _ in m[1]]
        got = layout_cache.decode_rows(layouts, np.concatenate([m[2] for m in members]), [gpu[j][1] for j in pos],
                                       [gpu[j][0] for j in pos], gpu[pos[0]][2])
        for j, value in zip(pos, got):
            out[gpu[j][0]] = value
    return bool(runs)
