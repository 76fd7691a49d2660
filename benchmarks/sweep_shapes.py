"""Time the dense kernels' shapes (groups per lane per step, blocks per multiprocessor) on a GPU:
the measurement behind kvzip/gpu/tuning.py's encode_shape / decode_shape (benchmarks/NOTES.md).

    python benchmarks/sweep_shapes.py [log2_values] [bf16|e5m2|fp16|fp32 ...] [encode|decode]
                                                  # default 28, BF16 and E5M2, both kernels, real KV
    ncu -k regex:kvz_ python benchmarks/sweep_shapes.py 28 once   # one call per shape, for ncu

Each line: one kernel's shape changed from the default, the wall time per call (CUDA events,
median of 20 after warm-up) of compress and decompress, and whether the round trip was exact.
"""
import sys

import cupy
import kvzip
from kvzip.bench import _sample_bits, _timer, format_bits
from kvzip.gpu import tuning

log2 = int(sys.argv[1]) if len(sys.argv) > 1 else 28
n = 1 << log2
host = _sample_bits(n)
once = "once" in sys.argv[2:]
timeit = _timer(cupy, 1, 0) if once else _timer(cupy, 20)
# Shapes tried per value width in bytes.
encode_shapes = {4: [(1, 4), (1, 3), (2, 2), (1, 2)], 2: [(4, 2), (2, 3), (2, 4), (4, 3), (8, 2), (1, 4)],
                 1: [(4, 3), (2, 4), (4, 4), (8, 2), (16, 2)]}
decode_shapes = {4: [(1, 4), (2, 3), (1, 3), (2, 2)], 2: [(2, 3), (2, 4), (4, 3), (4, 2), (4, 4), (8, 2), (1, 4)],
                 1: [(2, 4), (2, 3), (4, 3), (8, 2), (8, 3), (16, 2)]}
only = [a for a in sys.argv[2:] if a in ("bf16", "e5m2", "fp16", "fp32")] or ["bf16", "e5m2"]  # formats swept
for name in only:
    x = cupy.asarray(format_bits(name, host, n))
    width = x.dtype.itemsize
    kernels = [k for k in ("encode", "decode") if k in sys.argv[2:]] or ["encode", "decode"]
    for which, shapes in [(k, (encode_shapes if k == "encode" else decode_shapes)[width]) for k in kernels]:
        for shape in shapes:
            with tuning.override(formats=(name,), **{f"{which}_shape": shape}):  # kernels and programs rebuilt
                t_enc, blob = timeit(lambda: kvzip.compress(x, dtype=name))
                t_dec, back = timeit(lambda: kvzip.decompress(blob))
            ok = bool(cupy.array_equal(back.reshape(-1).view(x.dtype), x))
            print(f"{name} {which} shape {shape}: encode {x.nbytes / t_enc / 1e9:7.1f} GB/s"
                  f"  decode {x.nbytes / t_dec / 1e9:7.1f} GB/s  ratio {x.nbytes / blob.nbytes:.4f}  exact {ok}", flush=True)
