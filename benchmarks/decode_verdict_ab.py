"""Does reading kvz_scan's verdict ahead of each chunk's first loads pay off?  A development aid
behind benchmarks/NOTES.md (v21): kvz_decode reads the verdict on a tensor (its error word) at a
chunk's start and branches on it once the chunk's first step's loads are out ("late", the source
as it is); before, it branched right away, so those loads waited out an L2 round trip ("early",
rebuilt here by a text change).  Decompress and its graph replay alone of 2^28 real BF16 and E5M2
values (the bench's data), CUDA events, median of 30 after warm-up, the variants alternated in one
process so both see the same GPU and host.

    python benchmarks/decode_verdict_ab.py [rounds]
"""
import sys

import cupy

import kvzip
from kvzip.bench import _sample_bits, _timer, e5m2_bits
from kvzip.stages import call_graphs, fused_fast, quantize_fast

VERDICT_READ = "        broken = *reinterpret_cast<volatile u64*>(err);\n"
_source = quantize_fast.cuda_source


def build(variant: str) -> None:
    """Recompile the fast path's kernels as the variant and drop every cached program."""
    def source(name):
        text = _source(name)
        if variant == "early" and name == "fused_fast.cu":
            assert text.count(VERDICT_READ) == 1, "the decoder's verdict read moved: update VERDICT_READ"
            text = text.replace(VERDICT_READ, VERDICT_READ + "        if (broken) return;\n")
        return text

    quantize_fast.cuda_source = source
    fused_fast._module.cache_clear()
    fused_fast._kernels.clear()
    fused_fast._grid_cap.cache_clear()
    call_graphs.release()


def main(rounds: int = 3, n: int = 1 << 28) -> None:
    inputs = {"bf16": cupy.asarray(_sample_bits(n))}
    inputs["e5m2"] = cupy.asarray(e5m2_bits(_sample_bits(n), n))
    timeit = _timer(cupy, 30)
    stream = cupy.cuda.get_current_stream()
    times = {}
    for r in range(rounds):
        for variant in ("early", "late"):
            build(variant)
            for fmt, x in inputs.items():
                blob = kvzip.compress(x, dtype=fmt)
                t, y = timeit(lambda: kvzip.decompress(blob))
                assert cupy.array_equal(y.reshape(-1).view(x.dtype), x)
                prog = [e for e in call_graphs.entries() if type(e).__name__ == "_DecodeProgram"][-1]
                g, _ = timeit(lambda: prog.shape.run(stream))
                times.setdefault((variant, fmt), []).append((t * 1e6, g * 1e6))
                print(f"round {r} {variant:<5} {fmt:<5} decompress {t * 1e6:6.1f} us  graph {g * 1e6:6.1f} us", flush=True)
                del y
    build("late")
    for (variant, fmt), ts in times.items():
        call, graph = zip(*ts)
        print(f"{variant:<5} {fmt:<5} decompress {min(call):6.1f}-{max(call):6.1f}  graph {min(graph):6.1f}-{max(graph):6.1f} us")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
