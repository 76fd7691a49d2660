"""Two dense-kernel shapes against each other, alternated in one process: the check behind a
change of fused_fast.ENCODE_SHAPE / DECODE_SHAPE where sweep_shapes.py's single pass is within
the calls' noise (benchmarks/NOTES.md, v21).

    python benchmarks/shape_ab.py FORMAT KERNEL G,B G,B [rounds]     # FORMAT: bf16, e5m2, fp16 or fp32
    python benchmarks/shape_ab.py e5m2 decode 4,3 2,3

Each round, per shape: compress or decompress of 2^28 real values (the bench's data) and its
graph replay alone (CUDA events, median of 30 after warm-up), with the round trip checked.
"""
import sys

import cupy

import kvzip
from kvzip.bench import _sample_bits, _timer, format_bits
from kvzip.stages import call_graphs, fused_fast


def main(fmt: str, kernel: str, a: str, b: str, rounds: str = "3", n: int = 1 << 28) -> None:
    x = cupy.asarray(format_bits(fmt, _sample_bits(n), n))
    table = fused_fast.ENCODE_SHAPE if kernel == "encode" else fused_fast.DECODE_SHAPE
    default = table[fmt]
    shapes = [tuple(int(v) for v in s.split(",")) for s in (a, b)]
    timeit = _timer(cupy, 30)
    stream = cupy.cuda.get_current_stream()
    times = {}
    for r in range(int(rounds)):
        for shape in shapes:
            table[fmt] = shape
            fused_fast._kernels.clear()
            call_graphs.release()  # cached programs hold the previous kernels
            blob = kvzip.compress(x, dtype=fmt)
            call = (lambda: kvzip.compress(x, dtype=fmt)) if kernel == "encode" else (lambda: kvzip.decompress(blob))
            t, out = timeit(call)
            prog = call_graphs.entries()[-1]  # the program of the call just timed
            g, _ = timeit(lambda: prog.shape.run(stream))
            back = kvzip.decompress(out) if kernel == "encode" else out
            assert cupy.array_equal(back.reshape(-1).view(x.dtype), x)
            times.setdefault(shape, []).append((t * 1e6, g * 1e6))
            print(f"round {r} {fmt} {kernel} {shape}: call {t * 1e6:6.1f} us ({x.nbytes / t / 1e9:6.1f} GB/s)"
                  f"  graph {g * 1e6:6.1f} us", flush=True)
            del out, back
    table[fmt] = default
    for shape, ts in times.items():
        call, graph = zip(*ts)
        print(f"{fmt} {kernel} {shape}: call {min(call):6.1f}-{max(call):6.1f} us  graph {min(graph):6.1f}-{max(graph):6.1f} us")


if __name__ == "__main__":
    main(*sys.argv[1:6])
