"""Do cache hints on the dense streams pay off?  A development aid behind benchmarks/NOTES.md
(v21): stages/fused_fast.cu reads and writes the values, codes and rest through load_once /
store_once, which use ld.global.cs / st.global.cs (evict first) when KVZ_STREAM_LOADS /
KVZ_STREAM_STORES are 1.  This builds the kernels with each setting and times compress and
decompress of 2^28 real BF16 and E5M2 values (the bench's data), CUDA events, median of 30 after
warm-up, the variants alternated in one process so all see the same GPU and host.

    python benchmarks/cache_hints_ab.py [rounds]
"""
import sys

import cupy

import kvzip
from kvzip.bench import _sample_bits, _timer, e5m2_bits
from kvzip.stages import call_graphs, fused_fast, quantize_fast

VARIANTS = {"plain": (0, 0), "stores": (0, 1), "loads": (1, 0), "both": (1, 1)}
_source = quantize_fast.cuda_source


def build(loads: int, stores: int) -> None:
    """Recompile the fast path's kernels with these hints and drop every cached program."""
    def source(name):
        text = _source(name)
        if name == "fused_fast.cu":
            for macro, on in (("KVZ_STREAM_LOADS", loads), ("KVZ_STREAM_STORES", stores)):
                line = f"#define {macro} "
                assert text.count(line) == 1, f"{macro} is no longer defined once: update this script"
                at = text.index(line) + len(line)
                text = text[:at] + str(on) + text[at + 1:]
        return text

    quantize_fast.cuda_source = source
    fused_fast._module.cache_clear()
    fused_fast._kernels.clear()
    fused_fast._grid_cap.cache_clear()
    call_graphs.release()


def main(rounds: int = 2, n: int = 1 << 28) -> None:
    bf16 = cupy.asarray(_sample_bits(n))
    inputs = {"bf16": bf16, "e5m2": cupy.asarray(e5m2_bits(_sample_bits(n), n))}
    timeit = _timer(cupy, 30)
    times = {}
    for r in range(rounds):
        for variant, (loads, stores) in VARIANTS.items():
            build(loads, stores)
            for fmt, x in inputs.items():
                te, blob = timeit(lambda: kvzip.compress(x, dtype=fmt))
                td, y = timeit(lambda: kvzip.decompress(blob))
                assert cupy.array_equal(y.reshape(-1).view(x.dtype), x)
                times.setdefault((variant, fmt), []).append((te * 1e6, td * 1e6))
                print(f"round {r} {variant:<6} {fmt:<5} compress {te * 1e6:6.1f} us  decompress {td * 1e6:6.1f} us",
                      flush=True)
    build(*VARIANTS["plain"])
    for (variant, fmt), ts in times.items():
        enc, dec = zip(*ts)
        print(f"{variant:<6} {fmt:<5} compress {min(enc):6.1f}-{max(enc):6.1f}  decompress {min(dec):6.1f}-{max(dec):6.1f} us")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
