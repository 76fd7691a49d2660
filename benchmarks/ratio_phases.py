"""Where a ratio- or storage-mode call's wall time goes on a GPU (development aid, not a benchmark).

    python benchmarks/ratio_phases.py [ratio|storage] [log2_values] [--e5m2] [--no-host]   # default: ratio 28

Three views of kvzip.compress(x, mode=...) and kvzip.decompress on tiled SmolLM2 KV (BF16, or
with --e5m2 the bench's E5M2 of it, kvzip.bench.format_bits; [-1, 64]):
  wall     CUDA events around the plain call, median of 10 (what bench_ratio_gpu.py measures);
  phases   every kernel launch, the device module's host functions and the staged executor's
           steps, each with a stream synchronisation before and after, so GPU time shows under
           the kernel or step that queued it and host work under the step that does it
           (inclusive: a step's time contains its kernels'; the synchronisations add a little);
  host     cProfile of 10 plain calls (no extra synchronisation): the host's own time by function
           (left out with --no-host).
benchmarks/tree_ab.py runs it in two source trees in turn to compare kernel versions.
"""
import cProfile
import pstats
import sys
import time

import cupy

import kvzip
from kvzip import container, staged
from kvzip.bench import _sample_bits, _timer, format_bits
from kvzip.gpu import channel_pack, channel_rans, launch
from kvzip.stages import serialize

args = sys.argv[1:]
e5m2, host = "--e5m2" in args, "--no-host" not in args
args = [a for a in args if a not in ("--e5m2", "--no-host")]
mode = args.pop(0) if args and args[0] in ("ratio", "storage") else "ratio"
log2 = int(args[0]) if args else 28
fmt = "e5m2" if e5m2 else "bf16"
x = cupy.asarray(format_bits(fmt, _sample_bits(1 << log2), 1 << log2)).reshape(-1, 64)
compress = lambda: kvzip.compress(x, dtype=fmt, mode=mode)  # noqa: E731
blob = compress()
decompress = lambda: kvzip.decompress(blob)  # noqa: E731
assert bool((decompress().view(x.dtype) == x).all())
timeit = _timer(cupy, 10)
gb = x.nbytes / 1e9
for label, f in [("compress", compress), ("decompress", decompress)]:
    t = timeit(f)[0]
    print(f"wall {label} {mode} {fmt} 2^{log2}: {t * 1e3:.3f} ms = {gb / t:.0f} GB/s", flush=True)

acc = {}
sync = cupy.cuda.get_current_stream().synchronize


def timed(key, f):
    def run(*a, **k):
        sync()
        t = time.perf_counter()
        r = f(*a, **k)
        sync()
        acc[key] = acc.get(key, 0.0) + time.perf_counter() - t
        return r
    return run


real_launch = launch.launch


def launch_by_name(module, name, *a, **k):
    return timed("kernel " + name.split("<")[0], real_launch)(module, name, *a, **k)


for mod in (channel_pack, channel_rans):
    if hasattr(mod, "launch"):
        mod.launch = launch_by_name
for mod, name in [(channel_pack, "_encode_into"), (channel_pack, "encode_blob"), (channel_pack, "encode"),
                  (channel_pack, "decode"), (channel_pack, "_scan"), (channel_rans, "encode"), (channel_rans, "decode"),
                  (staged, "encode_frame"), (staged, "open_blob"), (staged, "decode_opened"),
                  (staged, "export_decoded"), (staged, "to_origin"), (serialize.Serialize, "encode"),
                  (container, "assemble"), (container, "read_head"), (container, "parse_header"),
                  (serialize, "frame_from_header"), (kvzip.api.arrays, "import_tensor"),
                  (kvzip.api.arrays, "import_bytes")]:
    if hasattr(mod, name):
        setattr(mod, name, timed(f"{getattr(mod, '__name__', mod.__class__.__name__).split('.')[-1]}.{name}",
                                 getattr(mod, name)))
N = 10
for label, f in [("compress", compress), ("decompress", decompress)]:
    f()
    acc.clear()
    sync()
    t = time.perf_counter()
    for _ in range(N):
        f()
    sync()
    print(f"phases {label}: {(time.perf_counter() - t) / N * 1e3:.3f} ms a call with the synchronisations")
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        print(f"  {k:<34} {v / N * 1e3:8.3f} ms")

for label, f in [("compress", compress), ("decompress", decompress)] if host else []:
    prof = cProfile.Profile()
    sync()
    prof.enable()
    for _ in range(N):
        f()
    sync()
    prof.disable()
    print(f"host {label} (own ms a call, inclusive ms, calls a call):")
    rows = sorted(pstats.Stats(prof).stats.items(), key=lambda kv: -kv[1][2])[:16]
    for (path, line, func), (_, calls, own, total, _) in rows:
        print(f"  {own / N * 1e3:7.3f} {total / N * 1e3:7.3f} {calls // N:4d}x  {func} ({path.split('/')[-1]}:{line})")
