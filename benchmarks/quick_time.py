"""Quick GPU timing of compress/decompress on tiled real KV (development aid; the committed
figures come from bench_codec.py)."""
import sys
import time

import cupy
import numpy as np

import kvzip
from kvzip.data import load_sample

logn = int(sys.argv[1]) if len(sys.argv) > 1 else 28
sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample("prose").values()])
bits = cupy.asarray(np.resize(sample, 1 << logn))
nbytes = bits.nbytes


def timeit(f, reps=10):
    f()
    cupy.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        s, e = cupy.cuda.Event(), cupy.cuda.Event()
        s.record()
        out = f()
        e.record()
        e.synchronize()
        ts.append(cupy.cuda.get_elapsed_time(s, e) / 1e3)
    return float(np.median(ts)), out


t_enc, blob = timeit(lambda: kvzip.compress(bits, dtype="bf16"))
t_dec, back = timeit(lambda: kvzip.decompress(blob))
assert bool((back == bits).all())
print(f"n=2^{logn} ratio {nbytes / blob.nbytes:.4f} encode {nbytes / t_enc / 1e9:.1f} GB/s decode {nbytes / t_dec / 1e9:.1f} GB/s")
