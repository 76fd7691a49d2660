"""Programmatic dependent launches in call graphs (kvzip/gpu/dependent_launch.py), on a real GPU: a
"dependent" kernel really starts before its predecessor ends (a kernel that does not wait sees
the predecessor's memory unwritten), one that awaits its predecessor always sees it written, in
the eager first run, the captured run and graph replays, and the codec writes the same bytes with
dependent launches on and off."""
import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

import kvzip
from kvzip.gpu import graphs, dependent_launch

_SOURCE = r"""
__device__ void await_predecessor() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// One block: lets its dependents start at once, spins ~spin_ns, then writes table + 1.
extern "C" __global__ void slow_writer(const unsigned long long* table, unsigned long long* out, long long spin_ns) {
    await_predecessor();
    unsigned long long t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    for (unsigned long long t = t0; t - t0 < (unsigned long long)spin_ns;) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    out[threadIdx.x] = table[threadIdx.x] + 1;
}
extern "C" __global__ void waiting_reader(const unsigned long long* src, unsigned long long* dst) {
    await_predecessor();
    dst[threadIdx.x] = src[threadIdx.x];
}
extern "C" __global__ void eager_reader(const unsigned long long* src, unsigned long long* dst) {
    dst[threadIdx.x] = src[threadIdx.x];  // no wait: reads whatever is there when it starts
}
"""

pytestmark = pytest.mark.skipif(not dependent_launch.supported(cupy.cuda.Device().id),
                                reason="programmatic dependent launch needs compute capability 9.0 and CUDA 12.3")


def _shape(reader: str) -> graphs.CallShape:
    module = cupy.RawModule(code=_SOURCE)
    R = graphs.Region
    # Regions: table (uploaded) | written by slow_writer (zeroed by the upload) | read back.
    return graphs.CallShape((8 * 32, 8 * 32, 8 * 32), (
        ("upload", 1), ("zero", 1),
        ("dependent", module.get_function("slow_writer"), (1,), (32,), (R(0), R(1), np.int64(200_000))),
        ("dependent", module.get_function(reader), (1,), (32,), (R(1), R(2))),
        ("download", 2, 8 * 32)))


@pytest.mark.parametrize("enabled", [True, False])
def test_a_waiting_dependent_sees_its_predecessor_written_every_run(monkeypatch, enabled):
    monkeypatch.setattr(dependent_launch, "ENABLED", enabled)
    shape, stream = _shape("waiting_reader"), cupy.cuda.get_current_stream()
    for run in range(4):  # eager, captured, then graph replays
        table = np.arange(32, dtype=np.uint64) * 7 + run
        shape.put(0, table)
        np.testing.assert_array_equal(shape.run(stream).view(np.uint64)[:32], table + 1)
    assert shape.graph


def test_a_dependent_starts_before_its_predecessor_ends():
    """The control that shows the launches are programmatic: a reader that does not wait runs
    while the writer still spins (200 us), so it reads the zeroed region, in every run."""
    shape, stream = _shape("eager_reader"), cupy.cuda.get_current_stream()
    for run in range(4):
        shape.put(0, np.arange(32, dtype=np.uint64) + 1)
        np.testing.assert_array_equal(shape.run(stream).view(np.uint64)[:32], 0)
    assert shape.graph


@pytest.mark.parametrize("fmt", ["bf16", "e5m2"])
def test_codec_bytes_are_the_same_with_dependent_launches_on_and_off(monkeypatch, fmt):
    rng = np.random.default_rng(7)
    dtype = np.uint16 if fmt == "bf16" else np.uint8
    exps = rng.integers(120, 130, 1 << 18) if fmt == "bf16" else rng.integers(10, 20, 1 << 18)
    shift = 7 if fmt == "bf16" else 2
    bits = ((exps << shift) | rng.integers(0, 1 << shift, 1 << 18)).astype(dtype)
    bits[::997] ^= dtype(1 << (shift + 4))  # a few rare exponents: escapes
    x = cupy.asarray(bits)
    blobs = {}
    for enabled in (False, True):
        monkeypatch.setattr(dependent_launch, "ENABLED", enabled)
        graphs.release()
        blobs[enabled] = [kvzip.compress(x, dtype=fmt).get() for _ in range(3)]  # eager, captured, replayed
        for b in blobs[enabled]:
            np.testing.assert_array_equal(kvzip.decompress(cupy.asarray(b)).get().reshape(-1).view(dtype), bits)
    for a, b in zip(blobs[False], blobs[True]):
        np.testing.assert_array_equal(a, b)
    graphs.release()
