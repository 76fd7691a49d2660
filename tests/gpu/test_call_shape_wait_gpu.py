"""How a call shape's host learns that a call is done (kvzip/gpu/graphs.py, CallShape.wait):
the download, the call's last node, sets a flag in pinned memory after its bytes, and the host
polls the flag instead of synchronising the stream.  On a real GPU: every downloaded byte is
there when wait returns, in the eager run, the captured one and graph replays; a stream that
ends without the flag raises instead of polling forever; a shape without a download still
synchronises.  A detached call (CallShape.detach) is followed in stream order by the next call
on its stream, and waited for by a call on another stream and by settle.  An early download
between two kernels has its own flag: wait_early returns its bytes while the call goes on."""
import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

from kvzip.gpu import graphs

R = graphs.Region
WORDS = 1 << 14  # 128 KiB downloaded: 32 rounds of the download block's 256 threads

_slow_fill = cupy.RawKernel(r"""
extern "C" __global__ void slow_fill(const unsigned long long* table, unsigned long long* out, long long n,
                                     long long spin_ns) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (t = t0; t - t0 < (unsigned long long)spin_ns;) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    for (long long i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        out[i] = table[0] * i + 1;
}""", "slow_fill")


def _shape(download: bool = True) -> graphs.CallShape:
    ops = (("upload", 1), ("launch", _slow_fill, (64,), (256,), (R(0), R(1), np.int64(WORDS), np.int64(100_000))))
    return graphs.CallShape((8 * 2, 8 * WORDS), ops + ((("download", 1, 8 * WORDS),) if download else ()))


def test_every_downloaded_byte_is_in_when_wait_returns():
    shape, stream = _shape(), cupy.cuda.get_current_stream()
    assert shape.done is not None
    for run in range(5):  # eager, captured, then graph replays; the kernel spins 100 us first
        shape.put(0, np.array([run + 3, 0], np.uint64))
        got = shape.run(stream).view(np.uint64)[:WORDS]
        np.testing.assert_array_equal(got, np.uint64(run + 3) * np.arange(WORDS, dtype=np.uint64) + np.uint64(1))
        assert shape.done[0] == run + 1  # the flag is the shape's run count
    assert shape.graph


def test_a_stream_done_without_the_flag_raises_instead_of_polling_forever():
    shape, stream = _shape(), cupy.cuda.get_current_stream()
    shape.put(0, np.array([1, 0], np.uint64))
    shape.run(stream)
    stream.synchronize()
    shape.done[0] = 0  # as if the download had never run
    with pytest.raises(RuntimeError, match="without its download"):
        shape.wait(stream)


def test_a_shape_without_a_download_synchronises():
    shape, stream = _shape(download=False), cupy.cuda.get_current_stream()
    assert shape.done is None
    out = cupy.ndarray((WORDS,), np.uint64, cupy.cuda.MemoryPointer(
        cupy.cuda.UnownedMemory(shape.ptr(1), 8 * WORDS, shape.buffer), 0))
    for run in range(3):
        shape.put(0, np.array([run + 5, 0], np.uint64))
        shape.run(stream)
        assert stream.done  # run returned after the stream's work, not before
        assert int(out[WORDS - 1].get()) == (run + 5) * (WORDS - 1) + 1


def _expected(first):
    return np.uint64(first) * np.arange(WORDS, dtype=np.uint64) + np.uint64(1)


def _waits(shape):
    """The streams shape.wait is called with, from now on."""
    seen, real = [], shape.wait
    shape.wait = lambda stream: seen.append(stream.ptr) or real(stream)
    return seen


def test_a_detached_call_is_followed_in_stream_order():
    shape, stream = _shape(), cupy.cuda.get_current_stream()
    shape.put(0, np.array([3, 0], np.uint64))
    for _ in range(3):  # eager, captured, replayed: each detached behind the 100 us spin
        shape.launch(stream)
        shape.detach(stream)
    seen = _waits(shape)
    shape.launch(stream)  # the same stream: no wait, the stream orders the calls
    assert seen == []
    got = shape.wait(stream).view(np.uint64)[:WORDS]
    assert shape.done[0] == 4 and shape.runs == 4  # the fourth call's flag, not an earlier one's
    np.testing.assert_array_equal(got, _expected(3))


def test_a_call_on_another_stream_waits_for_a_detached_one():
    shape, first, other = _shape(), cupy.cuda.Stream(non_blocking=True), cupy.cuda.Stream(non_blocking=True)
    shape.put(0, np.array([5, 0], np.uint64))
    shape.launch(first)
    shape.detach(first)
    seen = _waits(shape)
    shape.launch(other)
    assert seen == [first.ptr] and shape.done[0] >= 1  # the detached call ended first
    np.testing.assert_array_equal(shape.wait(other).view(np.uint64)[:WORDS], _expected(5))
    assert shape.detached is None


def test_settle_and_release_wait_for_a_detached_call():
    shape, stream = _shape(), cupy.cuda.Stream(non_blocking=True)
    shape.put(0, np.array([7, 0], np.uint64))
    shape.launch(stream)
    shape.detach(stream)
    shape.settle()
    assert shape.done[0] == 1 and shape.detached is None
    np.testing.assert_array_equal(shape.host_down.view(np.uint64)[:WORDS], _expected(7))

    class Entry:  # what graphs.cached holds: an object with its CallShape in .shape
        pass

    entry = Entry()
    entry.shape = _shape()
    entry.shape.put(0, np.array([9, 0], np.uint64))
    graphs.cached(("detached test",), lambda: entry)
    entry.shape.launch(stream)
    entry.shape.detach(stream)
    graphs.release()
    assert entry.shape.done[0] == 1 and entry.shape.detached is None


_report = cupy.RawKernel(r"""
extern "C" __global__ void report(const unsigned long long* src, unsigned long long* down, int n, unsigned int* flag,
                                  unsigned int* runs) {
    for (int i = threadIdx.x; i < n; i += blockDim.x) down[i] = src[i];
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int run = *runs + 1;
        *runs = run;
        __threadfence_system();
        *(volatile unsigned int*)flag = run;
    }
}""", "report")


def test_an_early_download_arrives_while_the_call_goes_on():
    """An "early" op: a kernel sends words and raises the early flag itself (as kvz_scan sends a
    decode's verdict); wait_early returns them while a slow kernel after it still runs."""
    small = 64
    ops = (("upload", 1),
           ("launch", _slow_fill, (1,), (64,), (R(0), R(1), np.int64(small), np.int64(0))),
           ("launch", _report, (1,), (64,), (R(1), graphs.EARLY_DOWN, np.int32(small), graphs.EARLY_FLAG,
                                             graphs.EARLY_RUNS)),
           ("early", 1, 8 * small),
           ("launch", _slow_fill, (64,), (256,), (R(0), R(2), np.int64(WORDS), np.int64(20_000_000))),
           ("download", 2, 8 * WORDS))
    shape, stream = graphs.CallShape((8 * 2, 8 * small, 8 * WORDS), ops), cupy.cuda.Stream(non_blocking=True)
    for run in range(3):  # eager, captured, replayed
        shape.put(0, np.array([run + 2, 0], np.uint64))
        shape.launch(stream)
        early = shape.wait_early(stream)[:small].copy()
        assert not stream.done  # the last kernel spins 20 ms
        np.testing.assert_array_equal(early, np.uint64(run + 2) * np.arange(small, dtype=np.uint64) + np.uint64(1))
        assert shape.early_done[0] == run + 1
        np.testing.assert_array_equal(shape.wait(stream).view(np.uint64)[:WORDS], _expected(run + 2))
        assert shape.done[0] == run + 1
    assert shape.graph
