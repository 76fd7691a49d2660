"""The FP8 encoder with and without its ring of bulk copies (fused_fast.RING_SLOTS), alternated in
one process (benchmarks/NOTES.md, v23).

    python benchmarks/ring_ab.py [FORMAT] [SLOTS,SLOTS,...] [rounds]
    python benchmarks/ring_ab.py e5m2 0,2,3,4 3

Each round, per setting: compress of 2^28 real values (the bench's data) and its graph replay
alone (CUDA events, median of 30 after warm-up), the blob checked against the first setting's.
"""
import sys

import cupy

import kvzip
from kvzip.bench import _sample_bits, _timer, format_bits
from kvzip.stages import call_graphs, fused_fast


def main(fmt: str = "e5m2", settings: str = "0,3", rounds: str = "3", n: int = 1 << 28) -> None:
    x = cupy.asarray(format_bits(fmt, _sample_bits(n), n))
    default = fused_fast.RING_SLOTS
    timeit = _timer(cupy, 30)
    stream = cupy.cuda.get_current_stream()
    times, first = {}, None
    for r in range(int(rounds)):
        for k in (int(v) for v in settings.split(",")):
            fused_fast.RING_SLOTS = k
            call_graphs.release()  # cached programs hold the previous launch settings
            t, out = timeit(lambda: kvzip.compress(x, dtype=fmt))
            prog = call_graphs.entries()[-1]  # the program of the call just timed
            g, _ = timeit(lambda: prog.shape.run(stream))
            if first is None:
                first = out
                assert cupy.array_equal(kvzip.decompress(out).reshape(-1).view(x.dtype), x)
            assert cupy.array_equal(out, first), f"ring {k}: the blob differs"
            times.setdefault(k, []).append((t * 1e6, g * 1e6))
            print(f"round {r} {fmt} ring {k}: call {t * 1e6:6.1f} us ({x.nbytes / t / 1e9:6.1f} GB/s)"
                  f"  graph {g * 1e6:6.1f} us", flush=True)
            del out
    fused_fast.RING_SLOTS = default
    for k, ts in times.items():
        call, graph = zip(*ts)
        print(f"{fmt} encode ring {k}: call {min(call):6.1f}-{max(call):6.1f} us  graph {min(graph):6.1f}-{max(graph):6.1f} us")


if __name__ == "__main__":
    main(*sys.argv[1:4])
