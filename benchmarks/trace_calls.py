"""Where a compress/decompress call's wall time goes on a GPU (development aid, not a benchmark).

    python benchmarks/trace_calls.py [log2_values]      # default 19 (1 MiB of BF16)
    python benchmarks/trace_calls.py ncu 28 [bf16|e5m2|quantize] [noescapes]
                                                        # a plain workload to run under ncu: the default
                                                        # pipeline on BF16 or E5M2 values, or QuantizeFP8
                                                        # + E5M2 on BF16; noescapes: every exponent set
                                                        # to one in the codebook (what escapes cost)
    python benchmarks/trace_calls.py profile 28         # cProfile of the host side (also the batch API on
                                                        # 64 parts of the tensor), no extra syncs
    python benchmarks/trace_calls.py host 19            # host time per step (cumulative), no syncs

Wraps the steps of the fast path and synchronises the stream around each, so kernel time shows
under launch and host work under the step that does it.  The synchronisation changes the total a
little; bench_codec.py gives the real figures.
"""
import sys
import time

import cupy
import numpy as np

import kvzip
from kvzip import api, container
from kvzip.data import load_sample
from kvzip.gpu import graphs, programs, layout_cache
from kvzip.stages import serialize

args = sys.argv[1:]
mode = args.pop(0) if args and args[0] in ("ncu", "profile", "host") else "trace"
log2 = int(args[0]) if args else 19
sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample().values()])
x = cupy.asarray(np.resize(sample, 1 << log2))
blob = kvzip.compress(x, dtype="bf16")
kvzip.decompress(blob)

if mode == "ncu":
    from kvzip.bench import e5m2_bits, quantize_pipelines

    kind = args[1] if len(args) > 1 else "bf16"
    pipe, data, dtype = kvzip.splitzip_pipeline(), x, "bf16"
    if kind == "e5m2":
        data, dtype = cupy.asarray(e5m2_bits(np.resize(sample, 1 << log2), 1 << log2)), "e5m2"
    if "noescapes" in args[2:]:  # exponent 120 (BF16) / 20 (E5M2): in the default codebooks
        data = (data & 0x83) | (20 << 2) if dtype == "e5m2" else (data & 0x807F) | (120 << 7)
    if kind == "quantize":
        pipe = quantize_pipelines()[0]
    for _ in range(3):
        blob = pipe.encode(data, dtype=dtype)
        pipe.decode(blob)
    cupy.cuda.Device().synchronize()
    sys.exit(0)

if mode == "profile":
    import cProfile
    import pstats

    parts = [x[i * (x.shape[0] // 64):(i + 1) * (x.shape[0] // 64)] for i in range(64)]
    blobs = kvzip.compress_many(parts, dtype="bf16")
    for label, f in [("compress", lambda: kvzip.compress(x, dtype="bf16")), ("decompress", lambda: kvzip.decompress(blob)),
                     ("compress_many 64 parts", lambda: kvzip.compress_many(parts, dtype="bf16")),
                     ("decompress_many 64 parts", lambda: kvzip.decompress_many(blobs))]:
        for _ in range(3):
            f()
        cupy.cuda.get_current_stream().synchronize()
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        for _ in range(20):
            f()
        prof.disable()
        cupy.cuda.get_current_stream().synchronize()
        print(f"== {label} 2^{log2}: {(time.perf_counter() - t) / 20 * 1e6:.1f} us/call (own time per call, us)")
        rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:24]
        for (path, line, func), (_, calls, own, total, _) in rows:
            print(f"  {own / 20 * 1e6:7.1f} {total / 20 * 1e6:7.1f}  {calls // 20:3d}x  {func} ({path.split('/')[-1]}:{line})")
    sys.exit(0)

acc = {}


def wrap(mod, name):
    f = getattr(mod, name)
    sync = cupy.cuda.get_current_stream().synchronize if mode == "trace" else (lambda: None)

    def timed(*a, **k):
        sync()
        t = time.perf_counter()
        r = f(*a, **k)
        sync()
        acc[name] = acc.get(name, 0) + time.perf_counter() - t
        return r

    setattr(mod, name, timed)


from kvzip import pipeline, staged  # noqa: E402
from kvzip.gpu import executor as gpu_executor  # noqa: E402
from kvzip.stages import fused  # noqa: E402

extra = [(staged, "encode_frame"), (staged, "decode_opened"), (gpu_executor.ShapeEncoder, "encode_frame"),
         (gpu_executor, "decode_general"), (programs, "_plan"),
         (programs, "_device_lut"), (graphs.CallShape, "put"),
         (graphs, "cached"), (layout_cache, "match"), (layout_cache, "decode"),
         (fused.FusedSplitPackEscape, "check"), (staged, "export_decoded"), (api, "splitzip_pipeline"),
         (pipeline, "recorded_pipeline"), (container, "stream_views")] if mode == "host" else []
for mod, name in extra + [(api.arrays, "import_tensor"), (api.arrays, "export_bytes"), (api.arrays, "import_bytes"),
                  (api.arrays, "export_tensor"), (programs, "encode_batch"), (programs, "decode_batch"),
                  (graphs.CallShape, "launch"), (graphs.CallShape, "wait"),  # run calls both
                  (container, "read_head"), (container, "parse_header"), (serialize, "open_blob")]:
    wrap(mod, name)
N = 20
for label, f in [("compress", lambda: kvzip.compress(x, dtype="bf16")), ("decompress", lambda: kvzip.decompress(blob))]:
    acc.clear()
    t = time.perf_counter()
    for _ in range(N):
        f()
    cupy.cuda.get_current_stream().synchronize()
    print(f"{label} 2^{log2} values: {(time.perf_counter() - t) / N * 1e6:.1f} us/call")
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<16} {v / N * 1e6:8.1f} us/call")
