"""Chunks the FP8 encoder claims at once (KVZ_FP8_CLAIM in stages/fused_fast.cu), settings
alternated in one process: each builds the kernels with the macro defined in front of the source
(benchmarks/NOTES.md, v23).  The decoder claims single chunks whatever the setting (units of two
slowed it; commit 391925e measured both): its figures are the run's control.

    python benchmarks/claim_ab.py [UNITS] [rounds]
    python benchmarks/claim_ab.py 1,2,4 3

Each round, per setting: E5M2 compress and decompress of 2^28 real values (the bench's data),
the call and its graph replay alone (CUDA events, median of 30 after warm-up), the blob checked
against the first setting's and the round trip.
"""
import sys

import cupy

import kvzip
from kvzip.bench import _sample_bits, _timer, format_bits
from kvzip.stages import call_graphs, fused_fast, quantize_fast


_SOURCE = quantize_fast.cuda_source  # the shipped text, before build() wraps it


def build(units: int) -> None:
    """The fused kernels with KVZ_FP8_CLAIM = units from the next call on."""
    quantize_fast.cuda_source = lambda name: f"#define KVZ_FP8_CLAIM {units}\n" + _SOURCE(name)
    fused_fast._module.cache_clear()
    fused_fast._kernels.clear()
    fused_fast._grid_cap.cache_clear()
    call_graphs.release()  # cached programs hold the previous kernels


def main(settings: str = "1,2", rounds: str = "3", n: int = 1 << 28) -> None:
    x = cupy.asarray(format_bits("e5m2", _sample_bits(n), n))
    timeit = _timer(cupy, 30)
    stream = cupy.cuda.get_current_stream()
    times, first = {}, None
    for r in range(int(rounds)):
        for units in (int(v) for v in settings.split(",")):
            build(units)
            blob = kvzip.compress(x, dtype="e5m2")
            if first is None:
                first = blob
            assert cupy.array_equal(blob, first), f"{units} chunks a claim: the blob differs"
            row = []
            for call in (lambda: kvzip.compress(x, dtype="e5m2"), lambda: kvzip.decompress(blob)):
                t, out = timeit(call)
                prog = call_graphs.entries()[-1]  # the program of the call just timed
                g, _ = timeit(lambda: prog.shape.run(stream))
                row += [t * 1e6, g * 1e6]
            assert cupy.array_equal(out.reshape(-1).view(x.dtype), x)
            times.setdefault(units, []).append(row)
            print(f"round {r} claim {units}: encode call {row[0]:6.1f} graph {row[1]:6.1f}  decode call {row[2]:6.1f}"
                  f" graph {row[3]:6.1f} us", flush=True)
    for units, rows in times.items():
        span = [f"{min(c):6.1f}-{max(c):6.1f}" for c in zip(*rows)]
        print(f"e5m2 claim {units}: encode call {span[0]} graph {span[1]}  decode call {span[2]} graph {span[3]} us")


if __name__ == "__main__":
    main(*sys.argv[1:3])
