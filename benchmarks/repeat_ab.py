"""What the shortcuts for a call like the last one save (kvzip/gpu/executor.py: _EncodeRepeat;
kvzip/gpu/layout_cache.py: decode_again; benchmarks/NOTES.md, v22).  A development aid:
kvzip.compress / decompress of real values with the shortcuts on and off (graphs.KEEP; off: the
full path, as before v22), alternated in one process; CUDA events around each call as the bench measures
one (median of 40 after warm-up).  Each decompress round cycles through blobs of one shape with
different escape counts (so different lengths), as a serving loop's are.

    python benchmarks/repeat_ab.py [log2_values ...]     # default: 28 19
"""
import sys

import cupy
import numpy as np

import kvzip
from kvzip.bench import _sample_bits, _timer, format_bits
from kvzip.gpu import graphs


def shortcuts(on: bool) -> None:
    graphs.KEEP = on


def with_escapes(bits: np.ndarray, k: int) -> np.ndarray:
    """bits with k BF16 values made escapes (exponents far outside the codebook's), spread out."""
    out = bits.copy()
    at = np.linspace(0, bits.size - 1, k, dtype=np.int64)
    out[at] = (out[at] & 0x807F) | np.uint16(230 << 7)
    return out


def main(sizes, rounds=3):
    timeit = _timer(cupy, 40)
    for log2 in sizes:
        host = _sample_bits(1 << log2)
        for fmt in ("bf16", "e5m2"):
            x = cupy.asarray(format_bits(fmt, host, 1 << log2))
            variants = [x] if fmt != "bf16" else [cupy.asarray(with_escapes(host, k)) for k in (0, 1000, 5000)]
            blobs = [kvzip.compress(v, dtype=fmt) for v in variants]
            turn = iter(range(1 << 30))
            for r in range(rounds):
                for on in (False, True):
                    shortcuts(on)
                    te, _ = timeit(lambda: kvzip.compress(x, dtype=fmt))
                    td, _ = timeit(lambda: kvzip.decompress(blobs[next(turn) % len(blobs)]))
                    print(f"2^{log2} {fmt} round {r} shortcuts {'on ' if on else 'off'}  compress {te * 1e6:7.1f} us"
                          f"  decompress {td * 1e6:7.1f} us ({len(blobs)} lengths)", flush=True)
    shortcuts(True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [28, 19])
