"""Where a fast-path call's host time falls around its GPU work (development aid).

    python benchmarks/host_phases.py [log2_values ...]     # default: 28 23 19

Stamps the host clock around the cached CUDA graph's launch and wait (kvzip/gpu/graphs.py) in
kvzip.compress / decompress of BF16 (and of E5M2 at the first size), and compress_many /
decompress_many of 64 x 8 MiB, and prints the median of each phase:

    pre      from the call to the graph launch: Python ahead of the GPU, all of it on the wall time
    launch   the graph launch itself
    between  from the launch to the wait: host work the GPU's run hides (result arrays, and for
             batches of encodes, the wait for the published sizes)
    wait     the synchronisation (for an encode that returns before its scan ends,
             Tuning.early_return, the detach in its place: ~0)
    post     from the wait to the return: on the wall time again
"""
import sys
import time

import cupy
import numpy as np

import kvzip
from kvzip.bench import _sample_bits, batch_parts, e5m2_bits
from kvzip.gpu import graphs

_stamps = []
_launch, _wait, _detach = graphs.CallShape.launch, graphs.CallShape.wait, graphs.CallShape.detach


def _stamped_launch(self, stream):
    _stamps.append(("l0", time.perf_counter_ns()))
    _launch(self, stream)
    _stamps.append(("l1", time.perf_counter_ns()))


def _stamped_wait(self, stream):
    _stamps.append(("w0", time.perf_counter_ns()))
    got = _wait(self, stream)
    _stamps.append(("w1", time.perf_counter_ns()))
    return got


def _stamped_detach(self, stream):
    _stamps.append(("w0", time.perf_counter_ns()))
    _detach(self, stream)
    _stamps.append(("w1", time.perf_counter_ns()))


def phase_medians(call, repeat=40) -> np.ndarray:
    """Median (us) over repeat calls of pre, launch, between, wait, post and total (the module's
    docstring), CallShape's launch, wait and detach stamped meanwhile."""
    shape = graphs.CallShape
    shape.launch, shape.wait, shape.detach = _stamped_launch, _stamped_wait, _stamped_detach
    try:
        for _ in range(5):
            out = call()
        cupy.cuda.get_current_stream().synchronize()
        rows = []
        for _ in range(repeat):
            _stamps.clear()
            t0 = time.perf_counter_ns()
            out = call()
            t1 = time.perf_counter_ns()
            s = dict(_stamps)  # the last launch and wait (or detach) of the call: one each on the fast path
            rows.append((s["l0"] - t0, s["l1"] - s["l0"], s["w0"] - s["l1"], s["w1"] - s["w0"], t1 - s["w1"], t1 - t0))
            del out
    finally:
        shape.launch, shape.wait, shape.detach = _launch, _wait, _detach
    return np.median(np.array(rows), axis=0) / 1e3


def phases(name, call, repeat=40):
    m = phase_medians(call, repeat)
    print(f"{name:<26} pre {m[0]:6.1f}  launch {m[1]:5.1f}  between {m[2]:6.1f}  wait {m[3]:7.1f}  "
          f"post {m[4]:5.1f}  total {m[5]:7.1f} us", flush=True)


def main(argv):
    sizes = [int(a) for a in argv] or [28, 23, 19]
    host = _sample_bits(1 << max(sizes))
    for log2 in sizes:
        kinds = [("bf16", host[:1 << log2])] + ([("e5m2", e5m2_bits(host, 1 << log2))] if log2 == sizes[0] else [])
        for dtype, bits in kinds:
            x = cupy.asarray(bits)
            blob = kvzip.compress(x, dtype=dtype)
            phases(f"compress {dtype} 2^{log2}", lambda: kvzip.compress(x, dtype=dtype))
            phases(f"decompress {dtype} 2^{log2}", lambda: kvzip.decompress(blob))
    xs = batch_parts(cupy.asarray(_sample_bits(1 << 28)))
    blobs = kvzip.compress_many(xs, dtype="bf16")
    phases("compress_many 64x8MiB", lambda: kvzip.compress_many(xs, dtype="bf16"), 20)
    phases("decompress_many 64x8MiB", lambda: kvzip.decompress_many(blobs), 20)


if __name__ == "__main__":
    main(sys.argv[1:])
