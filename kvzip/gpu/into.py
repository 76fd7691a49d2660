"""compress_into and decompress_into on the GPU: a blob written into the caller's buffer with its
size left in device memory, and a blob decoded into the caller's tensor with its status left in
device memory; no host synchronisation, no allocation, and every call capturable in the caller's
CUDA graph.

Each call runs the fast path's own program (programs._EncodeProgram, or _DecodeProgram on a
guessed layout) built with into=True, issued by graphs.CallShape.issue_into: its first node
builds the job tables from a template kept in device memory, adding the call's addresses (kernel
arguments, so a captured node keeps its own), its last node writes the call's result to the
caller's memory.  Nothing goes through pinned staging, which a captured graph would read at
replay with whatever it holds by then.

A program (its workspace, template and patch list) is kept for every (device, stream, tensor
layout) it ran on, for the life of the process or until release(): a graph that captured a call
refers to that workspace.  Calls on one stream run in its order, so they may share one; a
captured call uses the workspace of the stream it was captured on, so its graph must be replayed
in that stream's order (as any graph's static buffers must).  The first call of a layout on a
stream builds the program (allocations, uploads); inside a capture that is done on a side stream
with the thread's capture mode relaxed, so nothing of it enters the caller's graph.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from collections import OrderedDict
from functools import lru_cache

import numpy as np

from . import graphs, layout_cache, programs

_PATCH_A, _PATCH_B, _PATCH_C = 0, 1, 2  # which call argument a patched word adds (kvz_into_start's a, b, c)
_lock = threading.Lock()
_programs: dict = {}  # (kind, device, stream, key) -> _IntoEncode | _IntoDecode


class _IntoProgram:
    """What both kinds share: a call goes straight into the caller's capture, or else runs as a
    CUDA graph of its own, one kept for each of the last MAX_GRAPHS sets of call addresses (a
    serving loop's static buffers: one graph launch a call, where issuing the kernels one by one
    costs a few hundred microseconds of host time)."""

    MAX_GRAPHS = 32

    def __init__(self, program, patches: list, device: int):
        """program: the fast path's program built with into=True, its staged tables as every
        call starts from them; patches: (staged word, _PATCH_*) of the words a call adds to."""
        import cupy

        graphs.into_kernels(device)  # compiled and loaded here, never inside a capture
        self.program, self.device, self.graphs = program, device, OrderedDict()
        self.template = cupy.asarray(program.shape.staged.copy())  # kvz_into_start's template
        self.patch = cupy.asarray(np.array(patches, np.uint32))

    def _run(self, stream, call: tuple, result: tuple) -> None:
        """Issue a call on stream: call (a, b, c) for kvz_into_start, result for kvz_into_result."""
        start = (self.template.data.ptr, self.patch.data.ptr, self.patch.shape[0], *call)
        shape = self.program.shape
        if graphs.capturing(stream):
            shape.issue_into(stream, self.device, start, result)
            return
        key = (call, result)
        graph = self.graphs.get(key)
        if graph is None:
            graph = self.graphs[key] = shape.capture_into(self.device, start, result)
            if len(self.graphs) > self.MAX_GRAPHS:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        if graph:
            import cupy

            cupy.cuda.runtime.graphLaunch(graph.graphExec, stream.ptr)
        else:
            shape.issue_into(stream, self.device, start, result)


class _IntoEncode(_IntoProgram):
    """compress_into's program for one plan (a fused-only pipeline's tensor layout)."""

    def __init__(self, lane, device: int):
        prog = programs._EncodeProgram((lane.plan,), lane.fmt, lane.codebook, lane.chunk, device, into=True)
        super().__init__(prog, [(programs._SRC, _PATCH_A)] + [(int(at), _PATCH_B) for at in prog.out_at], device)
        self.payload_at = prog.shape.ptr(programs.ENCODE_SIZES_REGION) + 8 * programs._PAYLOAD  # its SIZES row's payload
        self.header_len = len(lane.plan.header)

    def launch(self, src: int, dst: int, size_out: int, stream) -> None:
        """Encode the tensor at src into the blob buffer at dst; its length goes to size_out (int64)."""
        self._run(stream, (src, dst, 0), (self.payload_at, self.header_len, size_out))


class _IntoDecode(_IntoProgram):
    """decompress_into's program for one layout (layout_cache.Layout) decoded on a guess."""

    def __init__(self, layout, device: int):
        import cupy

        prog = programs._DecodeProgram(layout.fmt, layout.chunk, (layout.n,), device, expect=(layout.expect,),
                                       into=True)
        staged, heads_at = prog.shape.staged, prog.heads_at
        staged[:programs.DECODE_COLUMNS] = layout.guess_row[0]
        staged[programs._BASES] = prog.fixed[0, 1:3]
        staged[heads_at + programs._HEAD_PTR] = 0
        staged[heads_at + programs._HEAD_LEN] = programs.HEAD_LEN_CAPACITY
        streams = range(programs._STREAMS.start, programs._STREAMS.stop)
        super().__init__(prog, [(at, _PATCH_A) for at in streams] +
                         [(programs._DST, _PATCH_B), (heads_at + programs._HEAD_PTR, _PATCH_A),
                          (heads_at + programs._HEAD_LEN, _PATCH_C)], device)
        self.error_at = prog.shape.ptr(prog.work_region) + 8  # the work counter, then the blob's error
        self.status = cupy.zeros(1, np.int64)  # where a call without status_out has its status

    def launch(self, blob: int, capacity: int, out: int, status: int, stream) -> None:
        """Decode the blob at the start of the buffer at blob (capacity bytes) into out; its
        status (0, or a decode error code) goes to status (int64)."""
        self._run(stream, (blob, out, capacity), (self.error_at, 0, status))


def encoder(lane, device: int, stream) -> _IntoEncode:
    """The compress_into program of lane (programs.EncodeLane) on device for stream."""
    return _program(("encode", device, stream.ptr, id(lane.plan)), lambda: _IntoEncode(lane, device), lane.plan, stream)


def decoder(layout, device: int, stream) -> _IntoDecode:
    """The decompress_into program of layout on device for stream."""
    return _program(("decode", device, stream.ptr, layout.key, layout.expect, layout.shape, layout.dtype_format.name),
                    lambda: _IntoDecode(layout, device), None, stream)


def _program(key, build, holds, stream):
    with _lock:
        hit = _programs.get(key)
    if hit is not None and (holds is None or hit.program.plans[0] is holds):
        return hit
    with _outside_capture(stream):
        made = build()
    with _lock:
        _programs[key] = made
    return made


def release() -> None:
    """Free every into program (a graph that captured a call must not be replayed after this)."""
    with _lock:
        _programs.clear()


@contextlib.contextmanager
def _outside_capture(stream):
    """Build a program while stream may be capturing: its allocations and uploads go on a side
    stream, with this thread's capture mode relaxed so they are legal, and are complete on exit."""
    import cupy

    if not graphs.capturing(stream):
        yield
        return
    mode = ctypes.c_int(_RELAXED)
    _exchange_capture_mode()(ctypes.byref(mode))
    try:
        side = cupy.cuda.Stream(non_blocking=True)
        with side:
            yield
        side.synchronize()
    finally:
        _exchange_capture_mode()(ctypes.byref(mode))


_RELAXED = 2  # CUstreamCaptureMode's CU_STREAM_CAPTURE_MODE_RELAXED


@lru_cache(maxsize=None)
def _exchange_capture_mode():
    """The driver's cuThreadExchangeStreamCaptureMode."""
    fn = ctypes.CDLL("libcuda.so.1").cuThreadExchangeStreamCaptureMode
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(ctypes.c_int)]
    return fn


def planned_layout(lane, shape: tuple):
    """The layout (layout_cache.Layout) every blob of lane's plan (for tensors of this shape)
    has: what decompress_into expects of a blob for a tensor like its output."""
    return layout_cache.planned(lane.plan, lane.fmt, shape, lane.chunk, lane.codebook)

