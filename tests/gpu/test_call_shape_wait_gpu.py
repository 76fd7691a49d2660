"""How a call shape's host learns that a call is done (stages/call_graphs.py, CallShape.wait):
the download, the call's last node, sets a flag in pinned memory after its bytes, and the host
polls the flag instead of synchronising the stream.  On a real GPU: every downloaded byte is
there when wait returns, in the eager run, the captured one and graph replays; a stream that
ends without the flag raises instead of polling forever; a shape without a download still
synchronises."""
import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

from kvzip.stages import call_graphs

R = call_graphs.Region
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


def _shape(download: bool = True) -> call_graphs.CallShape:
    ops = (("upload", 1), ("launch", _slow_fill, (64,), (256,), (R(0), R(1), np.int64(WORDS), np.int64(100_000))))
    return call_graphs.CallShape((8 * 2, 8 * WORDS), ops + ((("download", 1, 8 * WORDS),) if download else ()))


def test_every_downloaded_byte_is_in_when_wait_returns():
    shape, stream = _shape(), cupy.cuda.get_current_stream()
    assert shape.done is not None
    for run in range(5):  # eager, captured, then graph replays; the kernel spins 100 us first
        shape.put(0, np.array([run + 3, 0], np.uint64))
        got = shape.run(stream).view(np.uint64)[:WORDS]
        np.testing.assert_array_equal(got, np.uint64(run + 3) * np.arange(WORDS, dtype=np.uint64) + np.uint64(1))
        assert shape.done[0] == 1
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
