"""The batch encode's host work ahead of its launch, two ways alternated in one process
(benchmarks/NOTES.md, v25): 64 x 8 MiB of BF16 through kvzip.compress_many, as the bench's batch,
from CuPy arrays and from torch tensors over the same memory.

    python benchmarks/batch_host_ab.py [rounds]          # loop / maps
    python benchmarks/batch_host_ab.py pieces            # what staging 64 addresses costs

loop: every tensor checked by api._encode_many_by_lanes's per-tensor loop (arrays.cuda_addresses
switched off); maps: an alike batch checked a property at a time over the list
(arrays.cuda_addresses).  Each: the call (CUDA events, median of 30 after warm-up, as the bench)
and the host time from the call to its graph launch (median of 30).
pieces: micro-timings (median of 300) of ways to put 64 device addresses into a staged table.
"""
import sys
import time
from array import array

import cupy
import numpy as np
import torch

import kvzip
from kvzip import arrays
from kvzip.bench import _sample_bits, _timer, batch_parts
from kvzip.stages import call_graphs


def ahead_of_launch(call, repeat=30) -> float:
    """Median host time (us) from the call to its (last) graph launch."""
    stamps, launch = [], call_graphs.CallShape.launch

    def stamped(self, stream):
        stamps.append(time.perf_counter_ns())
        launch(self, stream)

    call_graphs.CallShape.launch = stamped
    try:
        times = []
        for _ in range(repeat):
            stamps.clear()
            t0 = time.perf_counter_ns()
            out = call()
            times.append(stamps[-1] - t0)
            torch.cuda.synchronize()
            del out
    finally:
        call_graphs.CallShape.launch = launch
    return float(np.median(times)) / 1e3


def ab(rounds: int) -> None:
    xs = batch_parts(cupy.asarray(_sample_bits(1 << 28)))
    tensors = [torch.from_dlpack(x) for x in xs]
    timeit, maps = _timer(cupy, 30), arrays.cuda_addresses
    for r in range(rounds):
        for name, check in [("loop", lambda xs: None), ("maps", maps)]:
            arrays.cuda_addresses = check
            try:
                for framework, batch in [("cupy", xs), ("torch", tensors)]:
                    call = lambda: kvzip.compress_many(batch, dtype="bf16")  # noqa: E731
                    t, _ = timeit(call)
                    print(f"round {r} {name} {framework:<5} call {t * 1e6:6.1f} us  ahead of the launch "
                          f"{ahead_of_launch(call):5.1f} us", flush=True)
            finally:
                arrays.cuda_addresses = maps


def median_us(f, repeat=300) -> float:
    for _ in range(5):
        f()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        f()
        times.append(time.perf_counter_ns() - t0)
    return float(np.median(times)) / 1e3


def pieces() -> None:
    xs = batch_parts(cupy.asarray(_sample_bits(1 << 28)))
    ptrs = [x.data.ptr for x in xs]
    staged = np.zeros(64 * 12, np.uint64)
    column, at = staged[::12], np.arange(64) * 12
    rows = staged.reshape(64, 12)[:, 2:6]
    relative = np.arange(256, dtype=np.uint64).reshape(64, 4)
    for name, f in [("np.array(list, uint64)", lambda: np.array(ptrs, np.uint64)),
                    ("np.fromiter", lambda: np.fromiter(ptrs, np.uint64, 64)),
                    ("array('Q', list)", lambda: array("Q", ptrs)),
                    ("fancy assignment from the list", lambda: staged.__setitem__(at, ptrs)),
                    ("strided assignment from the list", lambda: column.__setitem__(slice(None), ptrs)),
                    ("np.add into the staged rows (4 x 64)", lambda: np.add(relative, np.uint64(1 << 40), out=rows)),
                    ("x.data.ptr over the list", lambda: [x.data.ptr for x in xs])]:
        print(f"{name:<40} {median_us(f):6.2f} us", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["pieces"]:
        pieces()
    else:
        ab(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
