"""The public entry points: compress, decompress, info; and the glue between a caller's
framework (via kvzip/arrays.py) and a pipeline running on a backend."""
from __future__ import annotations

import copy
import math
from functools import lru_cache

import numpy as np

from . import arrays, container
from .backends import get_backend
from .errors import FormatError
from .frame import Frame
from .pipeline import Pipeline, recorded_pipeline
from .gpu import graphs, layout_cache, programs
from .stages import serialize

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

    Returns a 1-D uint8 array of x's framework on x's device; on a GPU it is ordered on the
    caller's current stream, where the last kernel writing it may still run (docs/guide.md,
    "CUDA streams and synchronisation").
    """
    return encode_with(_default(codebook, checksum, chunk), x, dtype=dtype, backend=backend)  # = Pipeline.encode


def decompress(blob, *, backend: str | None = None):
    """Decode any kvzip blob; returns the original dtype and shape in the blob's framework.
    Raises kvzip.FormatError if the blob is malformed or (with a checksum) corrupted."""
    return decode_with(_default(None, False, DEFAULT_CHUNK), blob, backend=backend)  # = Pipeline.decode


def compress_many(xs, codebook=None, *, checksum: bool = False, chunk: int = DEFAULT_CHUNK, dtype=None,
                  backend: str | None = None) -> list:
    """compress() for a list of tensors; on a GPU all of them share one set of kernel launches."""
    return _default(codebook, checksum, chunk).encode_many(xs, dtype=dtype, backend=backend)


def decompress_many(blobs, *, backend: str | None = None) -> list:
    """decompress() for a list of blobs; on a GPU one header read-back and one decode launch per group."""
    return _default(None, False, DEFAULT_CHUNK).decode_many(blobs, backend=backend)


@lru_cache(maxsize=64)
def _shared(codebook, checksum, chunk) -> Pipeline:
    return splitzip_pipeline(codebook, checksum=checksum, chunk=chunk)


def _default(codebook, checksum, chunk) -> Pipeline:
    """The pipeline compress()/decompress() run: built once per setting when the codebook is a
    name or the default (building one costs ~8 us a call); private, so no caller can change it.
    Only exact types reach the cache: it matches keys by equality, and 0 == False, 4096.0 == 4096,
    which the stages refuse; so a cached answer is always the one a fresh build would give."""
    if (codebook is None or type(codebook) is str) and type(checksum) is bool and type(chunk) is int:
        return _shared(codebook, checksum, chunk)
    return splitzip_pipeline(codebook, checksum=checksum, chunk=chunk)


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
    if backend is None:
        blob = _encode_again(pipe, x, dtype)
        if blob is not None:
            pipe.last_path = "fast"
            return blob
    bits, fmt, shape, origin = arrays.import_tensor(x, dtype)
    be = get_backend(backend or origin.backend_name)
    with origin.stream_context():
        lane = pipe._lane(fmt, shape, be, bits)
        if lane is not None:  # this shape ran fast before
            blob = lane.encode(bits, origin)
            if blob is not None:
                pipe.last_path = "fast"
                if graphs.KEEP and origin.framework in ("cupy", "torch") and origin.device == "cuda" \
                        and (dtype is None or type(dtype) is str) and math.prod(shape):
                    graphs.remember("encode", _EncodeRepeat(pipe, x, dtype, origin, lane))
                return blob
        frame = _tensor_frame(bits, fmt, shape, be)
        blob = pipe.encode_frame(frame).streams["blob"]
        return arrays.export_bytes(_to_origin(blob, origin), origin)


class _EncodeRepeat:
    """What encode_with worked out for a CuPy or torch tensor that took the fast path, kept per
    thread (graphs.remember) so the next tensor like it goes straight to the same program:
    the import, the lane and the program lookups would all come out the same.  On the H200's
    host that halved the Python ahead of the launch (11.4 -> 5.7 us; benchmarks/NOTES.md, v22).
    Like it: the same pipeline and dtype argument (None or a name), array type, dtype and shape,
    contiguous and 16-byte aligned on the same device, which is current.  The stream is the
    caller's current one, as on the full path."""

    __slots__ = ("pipe", "dtype", "kind", "xdtype", "shape", "origin", "lane", "program")

    def __init__(self, pipe: Pipeline, x, dtype, origin, lane):
        self.pipe, self.dtype, self.kind, self.xdtype, self.shape = pipe, dtype, type(x), x.dtype, tuple(x.shape)
        self.origin, self.lane = origin, lane
        self.program = lane.program(origin.device_index)

    def encode(self, pipe: Pipeline, x, dtype):
        """The blob of x when it is like the tensor this was made for, else None (also where
        the payload comes out larger than the values: the full path then stores them raw)."""
        if pipe is not self.pipe or dtype != self.dtype or type(x) is not self.kind or x.dtype is not self.xdtype \
                or x.shape != self.shape or not (pipe.fuse and self.lane.usable()):
            return None
        ptr = arrays.cuda_address(x, self.origin)
        stream = self.origin.working_stream() if ptr is not None and ptr % 16 == 0 else None
        if stream is None:
            return None
        return self.program.encode([ptr], self.origin, stream)[0]


def _encode_again(pipe: Pipeline, x, dtype):
    """encode_with's blob for a tensor like the last one this thread encoded on the fast path
    (_EncodeRepeat), or None: take the full path."""
    last = graphs.recall("encode")
    if last is None or (dtype is not None and type(dtype) is not str):
        return None
    return last.encode(pipe, x, dtype)


def decode_with(pipe: Pipeline, blob, *, backend=None):
    if backend is None and pipe.fuse:
        got = layout_cache.decode_again(blob)
        if got is not None:
            pipe.last_path = "fast"
            return got
    u8, origin = arrays.import_bytes(blob)
    be = get_backend(backend or origin.backend_name)
    with origin.stream_context():
        if type(u8) is arrays.cupy_ndarray() and not arrays.aligned(u8):
            # A blob at an unaligned address (a view at an odd offset): its 2- and 4-byte streams
            # cannot be read in place by any GPU kernel, ours or CuPy's; decode an aligned copy.
            u8 = u8.copy()
        if not (pipe.fuse and programs.applicable(be, 0, u8)):
            u8 = _to_backend(u8, be)
            head = container.read_head(be, u8)
            hdr = container.parse_header(head, u8.shape[0])
            out = _export_decoded(pipe.decode_opened(serialize.frame_from_header(be, u8, hdr)), origin)
            container.remember_header(head, u8.shape[0], hdr)
            return out
        layout = layout_cache.guess(u8.shape[0])
        if layout is not None:  # most blobs are of the layout decoded last: no header read-back
            got = layout_cache.decode_one_guessed(layout, u8, origin)
            if got is not None:
                pipe.last_path = "fast"
                return got
        head = container.read_head(be, u8)
        hit = layout_cache.match(head, u8.shape[0])
        if hit is not None:  # a layout that passed every check before: straight to the kernels
            pipe.last_path = "fast"
            return layout_cache.decode([hit], [u8], origin)[0]
        hdr = container.parse_header(head, u8.shape[0])
        opened = serialize.frame_from_header(be, u8, hdr)
        out = _export_decoded(pipe.decode_opened(opened), origin)
        container.remember_header(head, u8.shape[0], hdr)
        if pipe.last_path == "fast":
            layout_cache.remember(head, u8.shape[0], opened, recorded_pipeline(opened.meta).stages)
        return out


def info(blob) -> dict:
    """What a blob holds: dtype, shape, sizes, ratio, escapes, pipeline.  It accepts exactly the
    blobs decompress accepts (it decodes the blob and drops the values: some checks, such as
    escape positions, are made only while decoding) and raises kvzip.FormatError for the rest."""
    from .stages.serialize import frame_from_header

    decompress(blob)
    u8, origin = arrays.import_bytes(blob)
    be = get_backend(origin.backend_name)
    hdr = container.parse_header(container.read_head(be, u8), u8.shape[0])
    frame = frame_from_header(be, u8, hdr)
    fmt = frame.dtype_format
    n = frame.n
    nchunks = escapes = plane_chunks = 0
    if "esc_count" in frame.streams:
        counts = be.to_numpy(frame.streams["esc_count"]).astype(np.int64)
        nchunks = counts.shape[0]
        plane_chunks = int((counts == 0xFFFF).sum())
        escapes = int(counts[counts != 0xFFFF].sum())
    raw = n * fmt.itemsize
    codebook = frame.meta.get("codebook")
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
        "codebook": codebook.get("name") if isinstance(codebook, dict) else None,
    }


def _tensor_frame(bits, fmt, shape, be) -> Frame:
    return Frame(be, {"data": _to_backend(bits, be)},
                 {"dtype": fmt.dtype_name, "shape": list(shape), "n": math.prod(shape), "format": fmt.name})


def encode_many_with(pipe: Pipeline, xs, *, dtype=None, backend=None) -> list:
    xs = list(xs)
    out = [None] * len(xs)
    rest = _encode_many_by_lanes(pipe, xs, dtype, backend, out)
    if rest:
        for i, blob in zip(rest, _encode_many_general(pipe, [xs[i] for i in rest], dtype, backend)):
            out[i] = blob
    return out


def _encode_many_by_lanes(pipe: Pipeline, xs, dtype, backend, out) -> list[int]:
    """Encode the tensors whose (format, shape) the pipeline has a lane for, a program per format
    and caller; returns the indices left for the general path (no lane, or stored raw after all)."""
    rest, groups = [], {}  # (format, id of the origin) -> [indices, inputs, lanes, device addresses, origin]
    # A serving loop's batch: tensors all alike, the first imported in full and the others only
    # their addresses read, a property at a time over the list (arrays.cuda_addresses).
    alike = arrays.cuda_addresses(xs) if len(xs) > 1 else None
    if alike is not None:
        bits, fmt, shape, origin = arrays.import_tensor(xs[0], dtype)
        lane = pipe._lane(fmt, shape, get_backend(backend or origin.backend_name), bits)
        if lane is not None and origin is alike[0] and bits.data.ptr == alike[1][0] \
                and (origin.framework == "cupy" or not lane.quantize):  # torch's quantizing lanes read CuPy arrays
            groups[(fmt.name, id(origin))] = [list(range(len(xs))), [bits, *xs[1:]], [lane] * len(xs), alike[1], origin]
        else:
            alike = None
    nd, tt = arrays.cupy_ndarray(), arrays.torch_tensor()
    run = None  # (type, dtype, shape, origin, lane, group) of the last input imported in full that had a lane
    for i, x in enumerate(xs if alike is None else ()):
        # Other batches: arrays like the last one need no import, only their address (what the
        # program reads): CuPy ~1 us a tensor instead of ~3 on the H200's host, torch ~1 instead
        # of ~5 (a CuPy array over each tensor's memory: NOTES v19).
        if run is not None and type(x) is run[0] and x.dtype is run[1] and x.shape == run[2]:
            ptr = arrays.cuda_address(x, run[3])
            if ptr is not None and ptr % 16 == 0:  # arrays.aligned: what _lane would say again (its other checks are the backend's)
                group = run[5]
                group[0].append(i)
                group[1].append(x)
                group[2].append(run[4])
                group[3].append(ptr)
                continue
        bits, fmt, shape, origin = arrays.import_tensor(x, dtype)
        lane = pipe._lane(fmt, shape, get_backend(backend or origin.backend_name), bits)
        if lane is None:
            rest.append(i)
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
    for indices, inputs, lanes, ptrs, origin in groups.values():
        with origin.stream_context():
            blobs = programs.encode_lanes(lanes, inputs, origin, ptrs)
        for i, blob in zip(indices, blobs):
            if blob is None:
                rest.append(i)
            else:
                out[i] = blob
        pipe.last_path = "fast"
    return sorted(rest)


def _encode_many_general(pipe: Pipeline, xs, dtype, backend) -> list:
    from . import stages as st

    out = [None] * len(xs)
    steps = pipe._steps(pipe.stages[:-1])
    serialize = pipe.stages[-1]
    fused = steps[-1] if steps and isinstance(steps[-1], st.FusedSplitPackEscape) else None
    groups: dict = {}  # format -> [(index, frame, origin)] for the batched GPU path
    config = pipe._stage_configs()  # one object shared by every frame (plans are cached by it)
    for i, x in enumerate(xs):
        bits, fmt, shape, origin = arrays.import_tensor(x, dtype)
        be = get_backend(backend or origin.backend_name)
        frame = _tensor_frame(bits, fmt, shape, be)
        if fused is not None and programs.applicable(be, frame.n):
            frame.meta["pipeline"] = config
            with origin.stream_context():
                for step in steps[:-1]:  # stages ahead of the split (QuantizeFP8) run per tensor
                    frame = step.encode(frame)
            if programs.applicable(be, frame.n, frame.streams["data"]):
                groups.setdefault(frame.format.name, []).append((i, frame, origin))
                continue
        out[i] = encode_with(pipe, x, dtype=dtype, backend=backend)
    for members in groups.values():
        frames = [m[1] for m in members]
        with members[0][2].stream_context():
            batch = programs.encode_batch(frames, fused.top16, fused.chunk, serialize.checksum)
            for j, (i, frame, origin) in enumerate(members):
                if batch.fits[j]:
                    blob = batch.blob(j)
                    pipe._remember_lane(frame, batch.plans[j], steps, serialize.checksum)  # later tensors: the lane
                else:  # incompressible: stored raw, as encode() would
                    blob = pipe._stored(frame).streams["blob"]
                out[i] = arrays.export_bytes(blob, origin)
    pipe.last_path = "fast" if groups else pipe.last_path
    return out


def decode_many_with(pipe: Pipeline, blobs, *, backend=None) -> list:
    from . import stages as st

    blobs = list(blobs)
    out = [None] * len(blobs)
    todo = _decode_like_batch(blobs, out) if pipe.fuse and backend in (None, "cuda") else None
    if todo is not None and not todo:
        pipe.last_path = "fast"
        return out
    guess = todo is None  # blobs the batch above guessed wrong go straight to the header read-back
    todo, undecoded = (range(len(blobs)), blobs) if guess else (todo, [blobs[i] for i in todo])
    gpu = []
    seen = be = fast = None  # the last origin, its backend, whether the fast path runs there
    for i, (u8, origin) in zip(todo, arrays.import_blobs(undecoded)):
        if origin is not seen:
            seen, be = origin, get_backend(backend or origin.backend_name)
            fast = programs.applicable(be)
            move = be.name != origin.backend_name  # NumPy bytes for the GPU backend
        if fast:
            if move:
                u8 = _to_backend(u8, be)
            if arrays.aligned(u8):  # the rest of applicable(be, 0, u8)
                gpu.append((i, u8, origin, be))
                continue
        out[i] = decode_with(pipe, blobs[i], backend=backend)
    if not gpu:
        return out
    with gpu[0][2].stream_context():
        launched = False
        if pipe.fuse and guess:  # first on the layouts guessed from the blobs' lengths, no header read-back
            left = _decode_guessed(gpu, out)
            launched = len(left) < len(gpu)
            gpu = [gpu[j] for j in left]
        if not gpu:
            pipe.last_path = "fast"
            return out
        sizes = [g[1].shape[0] for g in gpu]
        block, checks = programs.head_block([g[1].data.ptr for g in gpu], sizes)  # one read-back for all
        matched, unmatched = layout_cache.match_many(block, sizes, checks) if pipe.fuse else \
            ([], list(range(len(gpu))))
        heads = programs.heads_from_block(block[unmatched], [gpu[j][1] for j in unmatched])
        launched = _decode_known(matched, gpu, out) or launched
        fused = _decode_general(pipe, [(gpu[j], head) for j, head in zip(unmatched, heads)], out)
    pipe.last_path = "fast" if launched or fused else pipe.last_path
    return out


def _decode_like_batch(blobs: list, out: list) -> list[int] | None:
    """decode_many's usual batch with the least host work: blobs compress_many gave a CuPy or
    torch caller (one device, 16-byte aligned) of one guessed layout, checked in one pass and
    decoded in one program run (~190 us of host ahead of the launch for 64 CuPy blobs through the
    general loops: NOTES v18).  Fills out; returns the positions left to decode the checked way (a
    wrong guess), or None where the batch is not of that kind."""
    found = arrays.blob_addresses(blobs)
    if found is None or not programs.applicable(get_backend("cuda")):
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
    return misses


def _decode_general(pipe: Pipeline, rest: list, out: list) -> bool:
    """Decode blobs no remembered layout matched (rest: their gpu entries and heads) with the full
    checks: one fused decode run per format and chunk size, the other pipelines stage by stage.
    Returns whether any fused run was made."""
    from . import stages as st

    groups: dict = {}
    for (i, u8, origin, be), head in rest:
        hdr = container.parse_header(head, u8.shape[0])
        frame = st.serialize.frame_from_header(be, u8, hdr)
        recorded = recorded_pipeline(frame.meta)
        recorded.check_streams(frame)
        steps = recorded._steps(recorded.stages[:-1])
        if steps and isinstance(steps[-1], st.FusedSplitPackEscape) and programs.decode_applicable(frame):
            fused = steps[-1]
            cb = fused.check(frame)
            groups.setdefault((frame.format.name, fused.chunk), []).append((i, frame, origin, steps, cb, head, u8, hdr))
        else:
            out[i] = _export_decoded(recorded.decode_frame_steps(frame), origin)
            container.remember_header(head, u8.shape[0], hdr)
    for (_, chunk), members in groups.items():
        dsts = programs.decode_batch([m[1] for m in members], chunk, [m[4] for m in members],
                                          [m[0] for m in members])
        for (i, opened, origin, steps, _, head, u8, hdr), dst in zip(members, dsts):
            frame = steps[-1].finish_decode(opened, dst)
            for step in reversed(steps[:-1]):
                frame = step.decode(frame)
            out[i] = _export_decoded(frame, origin)
            container.remember_header(head, u8.shape[0], hdr)
            if pipe.fuse:
                layout_cache.remember(head, u8.shape[0], opened, recorded_pipeline(opened.meta).stages)
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


def _export_decoded(frame: Frame, origin):
    if set(frame.streams) != {"data"}:
        raise FormatError(f"decoding left streams {sorted(frame.streams)}; the blob holds unknown streams")
    fmt = frame.dtype_format
    if frame.format != fmt:
        raise FormatError(f"decoded values are {frame.format.name} but the blob says dtype {fmt.dtype_name}")
    data = frame.expect("data", fmt.uint_dtype, frame.n)
    return arrays.export_tensor(_to_origin(data, origin), fmt, tuple(frame.meta["shape"]), origin)
