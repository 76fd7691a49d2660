"""Replayable GPU calls for the fast path (kvzip/gpu/programs.py).

A fast-path call is a short fixed sequence: upload the job tables from pinned memory (and zero the
counters the kernels need zeroed), launch two to four kernels, download a few bytes of results.
Through CuPy each of those costs 5 to 10 us of host time, which on 1 to 64 MiB tensors is more
than the kernels take.
So every *call shape* (the same kernels, grids, scalar arguments and workspace layout; the tables'
contents may differ) gets its own device workspace and pinned staging buffers, and from its second
use a CUDA graph of the whole sequence: a repeated call is then one graph launch and one
synchronisation (benchmarks/NOTES.md, v6).

Kernel arguments that point into the workspace are written as ``Region(i)`` in the op list, so an
op list never depends on where its workspace lies.  The objects that own a CallShape (programs's
programs) are cached per thread by ``cached`` under a key that fixes their op list: the plans of an
encode batch, or the format, chunk size and value counts of a decode.
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from functools import lru_cache

import numpy as np

from . import dependent_launch

MAX_SHAPES = 32             # call shapes kept per thread, all devices together (least recently used dropped)
MAX_BYTES = 1 << 30         # and at most this much device workspace between them (per thread)
_local = threading.local()
# Between looks at a pinned flag: give up the CPU and the GIL (os.sched_yield releases the GIL for
# the syscall; Windows has none, and time.sleep(0) gives up the GIL there too).
_yield_cpu = getattr(os, "sched_yield", None) or (lambda: time.sleep(0))
_NOT_READY = 600  # cudaErrorNotReady: cudaStreamQuery's "still working"


def await_word(words: np.ndarray, i: int, stream, value: int | None = None) -> bool:
    """Poll words[i] (pinned host memory that a kernel on stream writes through its mapped
    address) until it is nonzero, or equal to value if one is given; then True.  Between looks
    the CPU and the GIL are given up, as a stream synchronisation gives them up; every 256 looks
    the stream is asked how it is doing: a failed GPU, which would never write the word, has its
    error raised by a synchronisation, and a stream that finished without writing it gives
    False."""
    looks = 0
    while not _arrived(words[i], value):
        looks += 1
        if looks & 255 == 0 and _stream_status(stream) != _NOT_READY and not _arrived(words[i], value):
            stream.synchronize()  # raises the GPU's error, if that is what it was
            return _arrived(words[i], value)
        _yield_cpu()
    return True


def _arrived(word, value) -> bool:
    return bool(word) if value is None else word == value


def _stream_status(stream) -> int:
    """cudaStreamQuery's status for stream (0: all done, _NOT_READY: still working, else an error)."""
    from cupy.cuda import runtime

    return runtime.streamQuery(stream.ptr)

# The upload and download are a kernel that copies between the pinned staging (mapped into the
# device's address space: UVA) and the workspace, 16 bytes a thread, and zeroes a region.  As copy
# nodes they cost far more in a replayed graph (benchmarks/graph_nodes.py measures both).
# It starts as every fast-path kernel does (kvzip/gpu/dependent_launch.py): a download is launched as
# a programmatic dependent of the kernel before it.  A download, the call's last node, runs as one
# block and then sets a flag in the pinned staging, which the host polls instead of synchronising
# the stream: the call's results are complete once the flag is up, and the host learns it ~3 us
# sooner than a stream synchronisation tells it (benchmarks/NOTES.md, v21).  The flag is the
# shape's run count (a word of its workspace, counted up by each download), not a 1 the host
# clears: a call the host did not wait for (CallShape.detach) may still be running when the next
# one is launched, and its download must not stand for the next one's.
_STAGE_SOURCE = r"""
extern "C" __global__ void kvz_stage(const uint4* __restrict__ src, uint4* __restrict__ dst, long long n,
                                     uint4* __restrict__ zero, long long nz, unsigned int* __restrict__ done,
                                     unsigned int* __restrict__ runs) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    unsigned int run = 0;
    if (done != nullptr && threadIdx.x == 0) run = *runs + 1;  // read while the block copies
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (long long i = first; i < n; i += stride) dst[i] = src[i];
    for (long long i = first; i < nz; i += stride) zero[i] = make_uint4(0u, 0u, 0u, 0u);
    if (done != nullptr) {  // a download (one block): the flag once every word is on its way
        __syncthreads();
        if (threadIdx.x == 0) {
            *runs = run;
            __threadfence_system();  // the block's words, seen by thread 0 at the barrier, land first
            *reinterpret_cast<volatile unsigned int*>(done) = run;
        }
    }
}
"""

# An into call (kvzip/gpu/into.py) takes no staging: it may be captured in the caller's CUDA graph,
# which replays with whatever a pinned buffer holds then.  Its first node builds the job tables
# from a template in device memory, adding the call's addresses (kernel arguments, so a captured
# node keeps its own) to the words a patch list names, and zeroes the work region; its last node
# writes the call's result (a blob's size, a decode's status) to the caller's memory.
_INTO_SOURCE = r"""
extern "C" __global__ void kvz_into_start(const unsigned long long* __restrict__ tmpl, unsigned long long* __restrict__ jobs,
                                          long long nwords, const unsigned int* __restrict__ patch, int npatch,
                                          unsigned long long a, unsigned long long b, unsigned long long c,
                                          uint4* __restrict__ zero, long long nz) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    for (long long i = threadIdx.x; i < nwords; i += blockDim.x) jobs[i] = tmpl[i];
    for (long long i = threadIdx.x; i < nz; i += blockDim.x) zero[i] = make_uint4(0u, 0u, 0u, 0u);
    __syncthreads();  // one block: every template word is down before the patched ones go over it
    for (int i = threadIdx.x; i < npatch; i += blockDim.x) {
        const unsigned int word = patch[2 * i], which = patch[2 * i + 1];
        jobs[word] = tmpl[word] + (which == 0 ? a : which == 1 ? b : c);
    }
}

extern "C" __global__ void kvz_into_result(const long long* __restrict__ src, long long add, long long* __restrict__ dst) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
    if (threadIdx.x == 0) dst[0] = src[0] + add;
}
"""
STAGE_THREADS = 256
STAGE_MAX_BLOCKS = 64  # 1 MiB a round; the tables are a few KiB


@lru_cache(maxsize=None)
def _stage_kernel():
    import cupy

    return cupy.RawKernel(_STAGE_SOURCE, "kvz_stage")


@lru_cache(maxsize=None)
def into_kernels(device: int) -> tuple:
    """(kvz_into_start, kvz_into_result) on device."""
    import cupy

    with cupy.cuda.Device(device):
        module = cupy.RawModule(code=_INTO_SOURCE)
        return module.get_function("kvz_into_start"), module.get_function("kvz_into_result")


def _stage_grid(n16: int) -> tuple:
    return (max(1, min(STAGE_MAX_BLOCKS, -(-n16 // STAGE_THREADS))),)


class Region(int):
    """A kernel argument meaning "the device address of workspace region i"."""

    __slots__ = ()


class Mapped(int):
    """A kernel argument meaning one of the addresses of the shape's early download (the "early"
    op), which that kernel makes itself: EARLY_DOWN its area (pinned, mapped), EARLY_FLAG its
    done flag (likewise), EARLY_RUNS its run count (a workspace word)."""

    __slots__ = ()


EARLY_DOWN, EARLY_FLAG, EARLY_RUNS = Mapped(0), Mapped(1), Mapped(2)


class CallShape:
    """The device workspace, pinned staging and (once replayed) CUDA graph of one call shape.

    ops is a tuple of
      ("upload", m)                    host regions 0..m-1 -> device (one copy kernel),
      ("zero", i)                      memset region i (right after ("upload", i): the upload's
                                       kernel zeroes region i as it copies, one node instead of
                                       two),
      ("launch", kernel, grid, block, args)
      ("dependent", kernel, grid, block, args)
                                       the same for a kernel that begins with griddepcontrol.wait:
                                       right after another kernel it is launched as that one's
                                       programmatic dependent (kvzip/gpu/dependent_launch.py),
      ("download", i, nbytes)          the first nbytes of region i -> host (a dependent too; the
                                       last op, if any),
      ("early", i, nbytes)             the same, early in the call (wait_early, early64), made
                                       by the kernel before it, whose arguments name the
                                       addresses it needs (EARLY_DOWN, EARLY_FLAG, EARLY_RUNS):
                                       no node of its own (at most one).
    Each call ends with the host waiting for it (wait), so the workspace and staging are idle when
    the next call of this thread writes them, or with detach once the GPU has read the staging:
    then the next call on the same stream follows it in stream order, and any other use of the
    shape (a call on another stream, settle) first waits for it."""

    def __init__(self, sizes: tuple, ops: tuple):
        import cupy
        import cupyx

        self.cupy = cupy
        self.offsets, at = [], 0
        for nb in sizes:
            self.offsets.append(at)
            at += -(-max(nb, 1) // 256) * 256
        self.sizes = sizes
        down = [op[2] for op in ops if op[0] == "download"]
        early = [op[2] for op in ops if op[0] == "early"]
        assert len(early) <= 1, "one early download at most"
        self.runs_at = at if down or early else None  # a word past the regions: the download's run count
        at += 256 if down or early else 0  # (the early download's, 128 bytes on)
        self.nbytes = at
        self.buffer = cupy.empty(max(at, 1), np.uint8)
        self.base = self.buffer.data.ptr
        if down or early:
            self.buffer[self.runs_at:self.runs_at + 256] = 0
        self.runs = 0           # calls launched (mod 2^32): the flag's value once the last is done
        self.detached = None    # the stream of a call the host did not wait for (detach)
        up = [op[1] for op in ops if op[0] == "upload"]
        self.zeroed = None  # the region the upload zeroes in place of a memset
        if up and ("zero", up[0]) in ops:
            self.zeroed = up[0]
            ops = tuple(op for op in ops if op != ("zero", self.zeroed))
        self.ops = ops
        self.up_bytes = self.offsets[up[0] - 1] + sizes[up[0] - 1] if up else 0
        # Whole 16-byte words both ways (the regions are 256-byte aligned, so the rounding stays
        # inside the last one's padding).
        self.host_up = cupyx.zeros_pinned(max(-(-self.up_bytes // 16) * 16, 16), np.uint8)
        self.staged = self.host_up.view(np.uint64)  # the upload area as 64-bit words (job tables)
        # The same words for single-item writes, which a memoryview takes faster than a NumPy
        # array (benchmarks/NOTES.md, v22).
        self.words = memoryview(self.host_up).cast("B").cast("Q")
        assert not down or ops[-1][0] == "download", "a download is the call's last op"
        self.host_down, self.done = self._download_area(down[0] if down else 0, bool(down))
        self.down64 = self.host_down.view(np.uint64)  # the download as 64-bit words
        early_area, self.early_done = self._download_area(early[0] if early else 0, bool(early))
        self.early64 = early_area.view(np.uint64) if early else None  # the early download's words
        self.graph = None       # cupy.cuda.Graph once captured; False if capture failed
        self.uses = 0

    @staticmethod
    def _download_area(nbytes: int, flagged: bool) -> tuple:
        """Pinned memory for a download of nbytes: its bytes, then its done flag (a run count)."""
        import cupyx

        down16 = max(-(-nbytes // 16) * 16, 16)
        pinned = cupyx.zeros_pinned(down16 + 16, np.uint8)
        return pinned[:down16], pinned[down16:down16 + 4].view(np.uint32) if flagged else None

    def ptr(self, i: int) -> int:
        return self.base + self.offsets[i]

    def put(self, i: int, table: np.ndarray) -> None:
        """Stage table for region i (uploaded by the next run)."""
        if i == self.zeroed:
            raise ValueError(f"region {i} is zeroed on the device by the upload; nothing staged there is uploaded")
        flat = table.reshape(-1).view(np.uint8)
        self.host_up[self.offsets[i]:self.offsets[i] + flat.shape[0]] = flat

    def run(self, stream) -> np.ndarray:
        """Issue the call on stream, wait for it, and return the downloaded bytes (a view of the
        staging buffer, valid until this shape's next run)."""
        self.launch(stream)
        return self.wait(stream)

    def launch(self, stream) -> None:
        """Issue the call on stream without waiting: the host may work meanwhile (on anything but
        this shape's staging), then must call wait (or detach) before this shape runs again."""
        rt = self.cupy.cuda.runtime
        if self.detached is not None and self.detached.ptr != stream.ptr:
            self.settle()  # the workspace is the detached call's until it ends
        if self.graph:
            rt.graphLaunch(self.graph.graphExec, stream.ptr)
        elif self.uses and self.graph is None:
            self._capture()
            if self.graph:
                rt.graphLaunch(self.graph.graphExec, stream.ptr)
            else:
                self._issue(stream)
        else:
            self._issue(stream)
        self.uses += 1
        if self.done is not None or self.early_done is not None:  # counted once launched: a launch that raised
            # leaves no download to wait for
            self.runs = (self.runs + 1) & 0xFFFFFFFF  # the flag this call's download raises

    def wait(self, stream) -> np.ndarray:
        """Wait for the call launch issued; returns the downloaded bytes (as run does).  With a
        download, the host polls the flag the download sets after the bytes (await_word)."""
        self.detached = None
        if self.done is None:
            stream.synchronize()
        elif not await_word(self.done, 0, stream, self.runs):
            raise RuntimeError("kvzip: a call's stream finished without its download")
        return self.host_down

    def wait_early(self, stream) -> np.ndarray:
        """Wait for the launched call's early download (the call goes on: wait for it or detach
        it next); returns its words (early64)."""
        if not await_word(self.early_done, 0, stream, self.runs):
            raise RuntimeError("kvzip: a call's stream finished without its download")
        return self.early64

    def detach(self, stream) -> None:
        """End the call launched on stream without waiting for it, once its kernels have read
        the staging (the caller knows: its results so far came from a kernel after the upload).
        The rest of the call finishes in stream order: the next call on stream follows it, and
        a call on another stream, or settle, first waits for it."""
        self.detached = stream

    def settle(self) -> None:
        """Wait for a detached call, if any (before the workspace or staging is reused or freed)."""
        if self.detached is not None:
            self.wait(self.detached)

    def __del__(self):
        try:  # the workspace and staging go back to CuPy's pools: not while a call still uses them
            self.settle()
        except Exception:
            pass

    def issue_into(self, stream, device: int, start: tuple, result: tuple) -> None:
        """Issue the call on stream as an into call: no staging, no download, nothing the host
        waits for, so it may be captured in the caller's graph.  start: (template address, patch
        list address, patch count, a, b, c) for kvz_into_start; result: (source address, addend,
        destination address) for kvz_into_result."""
        self._issue(stream, (device, start, result))

    def _issue(self, stream, into=None) -> None:
        # A kernel that awaits its predecessor may start early only after a kernel node (a
        # programmatic edge joins two kernels; after a memset it is an ordinary launch).
        after_kernel, early = False, dependent_launch.usable()
        ops = self.ops
        if into is not None:
            assert not any(op[0] in ("download", "early") for op in ops), "an into call downloads nothing"
            start_kernel, result_kernel = into_kernels(into[0])
            ops += (("dependent", result_kernel, (1,), (32,), tuple(np.uint64(v) if i != 1 else np.int64(v)
                                                                    for i, v in enumerate(into[2]))),)
        for op in ops:
            kind = op[0]
            if kind == "zero":
                self.cupy.cuda.runtime.memsetAsync(self.ptr(op[1]), 0, self.sizes[op[1]], stream.ptr)
                after_kernel = False
                continue
            if kind == "early":  # made by the kernel before it
                continue
            if kind in ("launch", "dependent"):
                _, kernel, grid, block, args = op
                args = tuple(self._address(a) if type(a) in (Region, Mapped) else a for a in args)
            elif kind == "upload":  # the first node: an ordinary launch
                n16 = -(-self.up_bytes // 16)
                z16 = -(-self.sizes[self.zeroed] // 16) if self.zeroed is not None else 0
                zero = self.ptr(self.zeroed) if self.zeroed is not None else 0
                if into is not None:
                    tmpl, patch, npatch, a, b, c = into[1]
                    kernel, grid, block = start_kernel, (1,), (STAGE_THREADS,)
                    args = (np.uint64(tmpl), np.uint64(self.base), np.int64(2 * n16), np.uint64(patch),
                            np.int32(npatch), np.uint64(a), np.uint64(b), np.uint64(c), np.uint64(zero), np.int64(z16))
                else:
                    kernel, grid, block = _stage_kernel(), _stage_grid(max(n16, z16)), (STAGE_THREADS,)
                    args = (np.uint64(self.host_up.ctypes.data), np.uint64(self.base), np.int64(n16),
                            np.uint64(zero), np.int64(z16), np.uint64(0), np.uint64(0))
            else:  # download: a dependent, one block (its flag follows the block's words)
                kernel, grid, block = _stage_kernel(), (1,), (STAGE_THREADS,)
                args = (np.uint64(self.ptr(op[1])), np.uint64(self.host_down.ctypes.data), np.int64(-(-op[2] // 16)),
                        np.uint64(0), np.int64(0), np.uint64(self.done.ctypes.data),
                        np.uint64(self.base + self.runs_at))
            if kind in ("dependent", "download") and after_kernel and early:
                dependent_launch.launch(kernel, grid, block, args, stream)
            else:
                kernel(grid, block, args, stream=stream)
            after_kernel = True

    def _address(self, a) -> np.uint64:
        """A Region's or Mapped's address."""
        if type(a) is Region:
            return np.uint64(self.base + self.offsets[a])
        return np.uint64((self.early64.ctypes.data, self.early_done.ctypes.data, self.base + self.runs_at + 128)[a])

    def _capture(self) -> None:
        self.graph = capture(self._issue)

    def capture_into(self, device: int, start: tuple, result: tuple):
        """An into call (issue_into's arguments) as a CUDA graph of its own, or False."""
        return capture(lambda stream: self._issue(stream, (device, start, result)))


def capture(issue):
    """issue(stream) recorded into a CUDA graph on a private stream (relaxed capture mode, so
    allocations on other threads stay legal meanwhile), or False where capture is unsupported
    (the caller then stays eager)."""
    import cupy

    side = cupy.cuda.Stream(non_blocking=True)
    try:
        side.begin_capture()
        try:
            issue(side)
        finally:
            graph = side.end_capture()
        return graph
    except (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError):
        return False


def capturing(stream) -> bool:
    """Whether stream is capturing a graph now."""
    import cupy

    return cupy.cuda.runtime.streamIsCapturing(stream.ptr) != 0


def cached(key, build):
    """This thread's object for key (anything with a CallShape in .shape), built by build() on
    first use.  Least recently used entries go when there are more than MAX_SHAPES or their
    workspaces pass MAX_BYTES (each entry's own: nothing is shared, so nothing is in use)."""
    entries = getattr(_local, "entries", None)
    if entries is None:
        entries = _local.entries = OrderedDict()
    hit = entries.get(key)
    if hit is not None:
        entries.move_to_end(key)
        return hit
    hit = entries[key] = build()
    total = sum(e.shape.nbytes for e in entries.values())
    while len(entries) > 1 and (len(entries) > MAX_SHAPES or total > MAX_BYTES):
        _, old = entries.popitem(last=False)
        old.shape.settle()
        total -= old.shape.nbytes
    return hit


def entries() -> list:
    """This thread's cached entries, least recently used first (for tests and tracing)."""
    return list(getattr(_local, "entries", {}).values())


KEEP = True  # remember() keeps anything (benchmarks/repeat_ab.py switches the shortcuts off)


def remember(name: str, value) -> None:
    """Keep value for this thread under name until release(): a shortcut that holds cached
    programs (kvzip/gpu/executor.py's repeat of the last call) goes with them.  Nothing is kept while
    KEEP is off, and recall then finds nothing."""
    if not KEEP:
        return
    kept = getattr(_local, "kept", None)
    if kept is None:
        kept = _local.kept = {}
    kept[name] = value


def recall(name: str):
    """What this thread last kept under name (None if nothing, or released since)."""
    kept = getattr(_local, "kept", None)
    return kept.get(name) if kept is not None and KEEP else None


def release() -> None:
    """Free this thread's workspaces, staging buffers and graphs (rebuilt by the next call)."""
    for entry in getattr(_local, "entries", {}).values():
        entry.shape.settle()
    _local.entries = OrderedDict()
    _local.kept = {}
