"""How much sooner a call ends when the host polls the download's flag (CallShape.wait) than when
it synchronises the stream (what wait did before v21; benchmarks/NOTES.md).  A development aid:
the cached graphs of kvzip.compress / decompress of real BF16 values, replayed with each way of
waiting, alternated in one process; CUDA events around each replay as the bench measures a call
(median of 60 after warm-up), and the host's own clock.

    python benchmarks/wait_ab.py [log2_values ...]     # default: 28 19
"""
import sys
import time

import cupy
import numpy as np

import kvzip
from kvzip.bench import _sample_bits, _timer
from kvzip.gpu import graphs


def host_clock(f, reps=60):
    stream = cupy.cuda.get_current_stream()
    for _ in range(5):
        f()
    stream.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        f()
        stream.synchronize()
        times.append(time.perf_counter_ns() - t0)
    return float(np.median(times)) / 1e3


def main(sizes=(28, 19), rounds=2):
    timeit = _timer(cupy, 60)
    stream = cupy.cuda.get_current_stream()
    for log2 in sizes:
        x = cupy.asarray(_sample_bits(1 << log2))
        blob = kvzip.compress(x, dtype="bf16")
        keep = [kvzip.compress(x, dtype="bf16") for _ in range(3)] + [kvzip.decompress(blob) for _ in range(3)]
        programs = {type(e).__name__: e for e in graphs.entries()}
        for op, name in (("encode", "_EncodeProgram"), ("decode", "_DecodeProgram")):
            shape = programs[name].shape

            def synchronised():
                shape.launch(stream)
                stream.synchronize()

            def polled():
                shape.launch(stream)
                shape.wait(stream)

            for r in range(rounds):
                for label, f in (("synchronise", synchronised), ("poll flag", polled)):
                    t, _ = timeit(f)
                    print(f"2^{log2} {op} round {r} {label:<11} events {t * 1e6:7.1f} us  host clock "
                          f"{host_clock(f):7.1f} us", flush=True)
        del keep


if __name__ == "__main__":
    main(tuple(int(a) for a in sys.argv[1:]) or (28, 19))
