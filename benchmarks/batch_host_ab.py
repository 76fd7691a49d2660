"""The batch encode's host work ahead of its launch, two ways alternated in one process
(benchmarks/NOTES.md, v25): 64 x 8 MiB of BF16 through kvzip.compress_many, as the bench's batch,
from CuPy arrays and from torch tensors over the same memory.

    python benchmarks/batch_host_ab.py [rounds]          # loop / maps
    python benchmarks/batch_host_ab.py pieces            # what staging 64 addresses costs

loop: every tensor checked by kvzip.execution._lane_groups's per-tensor loop (arrays.cuda_addresses
switched off); maps: an alike batch checked a property at a time over the list
(arrays.cuda_addresses).  Each: the call (CUDA events, median of 30 after warm-up, as the bench)
and the host time from the call to its graph launch (host_phases.py's "pre", median of 30).
pieces: ways to put 64 device addresses into a staged table, each timed as host_steps.py times a
step (median of five loops of 2000, less an empty call).
"""
import sys
from array import array

import cupy
import numpy as np
import torch
from host_phases import phase_medians
from host_steps import cost_us

import kvzip
from kvzip import arrays
from kvzip.bench import _sample_bits, _timer, batch_parts


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
                          f"{phase_medians(call, 30)[0]:5.1f} us", flush=True)
            finally:
                arrays.cuda_addresses = maps


def pieces() -> None:
    xs = batch_parts(cupy.asarray(_sample_bits(1 << 28)))
    ptrs = [x.data.ptr for x in xs]
    staged = np.zeros(64 * 12, np.uint64)
    column, at = staged[::12], np.arange(64) * 12
    rows = staged.reshape(64, 12)[:, 2:6]
    relative = np.arange(256, dtype=np.uint64).reshape(64, 4)
    empty = cost_us(lambda: None)
    for name, f in [("np.array(list, uint64)", lambda: np.array(ptrs, np.uint64)),
                    ("np.fromiter", lambda: np.fromiter(ptrs, np.uint64, 64)),
                    ("array('Q', list)", lambda: array("Q", ptrs)),
                    ("fancy assignment from the list", lambda: staged.__setitem__(at, ptrs)),
                    ("strided assignment from the list", lambda: column.__setitem__(slice(None), ptrs)),
                    ("np.add into the staged rows (4 x 64)", lambda: np.add(relative, np.uint64(1 << 40), out=rows)),
                    ("x.data.ptr over the list", lambda: [x.data.ptr for x in xs])]:
        print(f"{name:<40} {cost_us(f) - empty:6.2f} us", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["pieces"]:
        pieces()
    else:
        ab(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
