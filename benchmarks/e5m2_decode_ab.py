"""Does the E5M2 decoder's lane-per-quad path (decode_e5m2_quads) pay off in wall time?  A
development aid behind benchmarks/NOTES.md (v19): decompress of 2^28 real E5M2 values (the bench's
data), CUDA events, median of 30 after warm-up, with the kernels built from the source as it is
("quad") and with the quad path compiled out ("group"), the two alternated three times in one
process so both see the same GPU and host.

    python benchmarks/e5m2_decode_ab.py
"""
import cupy

import kvzip
from kvzip.bench import _sample_bits, _timer, e5m2_bits
from kvzip.gpu import graphs, programs, quantize_kernels

QUAD_SWITCH = "if constexpr (E5M2 && !DQ) {"  # the decoder's dispatch to decode_e5m2_quads
_source = quantize_kernels.cuda_source


def build(variant: str) -> None:
    """Recompile the fast path's kernels as the variant and drop every cached program."""
    def source(name):
        text = _source(name)
        if variant == "group" and name == "fused_fast.cu":
            assert QUAD_SWITCH in text, "the decoder's quad dispatch moved: update QUAD_SWITCH"
            text = text.replace(QUAD_SWITCH, "if constexpr (false) {")
        return text

    quantize_kernels.cuda_source = source
    programs._module.cache_clear()
    programs._kernels.clear()
    programs._grid_cap.cache_clear()
    graphs.release()


def main(n=1 << 28, rounds=3):
    x = cupy.asarray(e5m2_bits(_sample_bits(n), n))
    timeit = _timer(cupy, 30)
    times = {"group": [], "quad": []}
    for r in range(rounds):
        for variant in times:
            build(variant)
            blob = kvzip.compress(x, dtype="e5m2")
            t, y = timeit(lambda: kvzip.decompress(blob))
            assert cupy.array_equal(y.reshape(-1).view(x.dtype), x)
            times[variant].append(t * 1e6)
            print(f"round {r} {variant:<5} decompress {t * 1e6:6.1f} us  {x.nbytes / t / 1e9:7.1f} GB/s", flush=True)
    build("quad")
    for variant, ts in times.items():
        print(f"{variant:<5} {min(ts):6.1f}-{max(ts):6.1f} us")


if __name__ == "__main__":
    main()
