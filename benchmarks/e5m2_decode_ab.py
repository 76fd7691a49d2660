"""Does the E5M2 decoder's lane-per-quad path (decode_e5m2_quads) pay off in wall time?  A
development aid behind benchmarks/NOTES.md (v19): decompress of 2^28 real E5M2 values (the bench's
data), CUDA events, median of 30 after warm-up, with the shipped kernels ("quad") and with the quad
path compiled out ("group": Tuning.e5m2_quads = 0), the two alternated three times in one process
so both see the same GPU and host.

    python benchmarks/e5m2_decode_ab.py
"""
import contextlib

import cupy

import kvzip
from kvzip.bench import _sample_bits, _timer, e5m2_bits
from kvzip.gpu import tuning

_active = contextlib.ExitStack()


def build(variant: str) -> None:
    """The fast path's kernels as the variant, every cached program dropped (tuning.override)."""
    global _active
    _active.close()
    _active = contextlib.ExitStack()
    if variant == "group":
        _active.enter_context(tuning.override(formats=("e5m2",), e5m2_quads=0))


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
