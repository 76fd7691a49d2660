"""Development experiment (benchmarks/NOTES.md, v23): the E5M2 encode graph at 2^28 with kvz_encode
ablated through KVZ_ABLATE, defined in front of the kernels' source: 0 as shipped, 1 the encode
arithmetic replaced by two trivial operations (the blob is then wrong; the traffic is the same),
2 that and the chunks dealt statically instead of from the queue; chunks of 4096 and 8192 values.
CUDA events, median of 30 after warm-up, three rounds alternated in one process.

    python benchmarks/ablate_encode.py
"""
import cupy

import kvzip
from kvzip.bench import _sample_bits, _timer, format_bits
from kvzip.stages import call_graphs, fused_fast, quantize_fast

_SOURCE = quantize_fast.cuda_source


def main(n: int = 1 << 28) -> None:
    x = cupy.asarray(format_bits("e5m2", _sample_bits(n), n))
    timeit = _timer(cupy, 30)
    stream = cupy.cuda.get_current_stream()
    res = {}
    for r in range(3):
        for level in (0, 1, 2):
            quantize_fast.cuda_source = lambda name, L=level: f"#define KVZ_ABLATE {L}\n" + _SOURCE(name)
            fused_fast._module.cache_clear()
            fused_fast._kernels.clear()
            fused_fast._grid_cap.cache_clear()
            for chunk in (4096, 8192):
                call_graphs.release()
                pipe = kvzip.splitzip_pipeline(chunk=chunk)
                t, _ = timeit(lambda: pipe.encode(x, dtype="e5m2"))
                prog = call_graphs.entries()[-1]  # the program of the call just timed
                g, _ = timeit(lambda: prog.shape.run(stream))
                res.setdefault((level, chunk), []).append(g * 1e6)
                print(f"round {r} ablate {level} chunk {chunk}: call {t * 1e6:6.1f} graph {g * 1e6:6.1f} us", flush=True)
    for (level, chunk), v in res.items():
        print(f"ablate {level} chunk {chunk}: graph {min(v):6.1f}-{max(v):6.1f} us")


if __name__ == "__main__":
    main()
