"""Where a compress/decompress call's wall time goes on a GPU (development aid, not a benchmark).

    python benchmarks/trace_calls.py [log2_values]      # default 19 (1 MiB of BF16)
    python benchmarks/trace_calls.py ncu 28             # a plain workload to run under ncu

Wraps the steps of the fast path and synchronises the stream around each, so kernel time shows
under _launch and host work under the step that does it.  The synchronisation changes the total a
little; bench_codec.py gives the real figures.
"""
import sys
import time

import cupy
import numpy as np

import kvzip
from kvzip import api, container
from kvzip.data import load_sample
from kvzip.stages import fused_fast, serialize

args = sys.argv[1:]
mode = args.pop(0) if args and args[0] == "ncu" else "trace"
log2 = int(args[0]) if args else 19
sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample().values()])
x = cupy.asarray(np.resize(sample, 1 << log2))
blob = kvzip.compress(x, dtype="bf16")
kvzip.decompress(blob)

if mode == "ncu":
    for _ in range(2):
        blob = kvzip.compress(x, dtype="bf16")
        kvzip.decompress(blob)
    cupy.cuda.Device().synchronize()
    sys.exit(0)

acc = {}


def wrap(mod, name):
    f = getattr(mod, name)

    def timed(*a, **k):
        cupy.cuda.get_current_stream().synchronize()
        t = time.perf_counter()
        r = f(*a, **k)
        cupy.cuda.get_current_stream().synchronize()
        acc[name] = acc.get(name, 0) + time.perf_counter() - t
        return r

    setattr(mod, name, timed)


for mod, name in [(api.arrays, "import_tensor"), (api.arrays, "export_bytes"), (api.arrays, "import_bytes"),
                  (api.arrays, "export_tensor"), (fused_fast, "encode_batch"), (fused_fast, "decode_batch"),
                  (fused_fast, "_launch"), (fused_fast, "_read_back"), (fused_fast, "_Workspace"),
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
