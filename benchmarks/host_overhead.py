"""How much of a call's wall time is the GPU work and how much the host around it (development aid).

    python benchmarks/host_overhead.py [log2_values ...]     # default: 19 23 28

For each size: the wall time of kvzip.compress / kvzip.decompress (CUDA events around the call,
as bench_codec.py measures), and of replaying the call's cached CUDA graph alone (the same
kernels, copies and final synchronisation, no Python around them).  The difference is the host
overhead per call.
"""
import sys

import cupy

import kvzip
from kvzip.bench import _sample_bits, _timer
from kvzip.gpu import graphs

timeit = _timer(cupy, 50)
print(f"{'values':>8} {'op':<10} {'api us':>9} {'graph us':>9} {'host us':>8}")
for log2 in [int(a) for a in sys.argv[1:]] or [19, 23, 28]:
    x = cupy.asarray(_sample_bits(1 << log2))
    for op, call in [("compress", lambda: kvzip.compress(x, dtype="bf16")), ("decompress", None)]:
        if call is None:
            blob = kvzip.compress(x, dtype="bf16")
            call = lambda: kvzip.decompress(blob)  # noqa: E731
        graphs.release()
        t_api, last = timeit(call)  # last: the output the staged tables point at, kept alive for the replay
        prog = [e for e in graphs.entries() if type(e).__name__ != "_HeadsProgram"][-1]  # the last used
        stream = cupy.cuda.get_current_stream()
        t_graph, _ = timeit(lambda: prog.shape.run(stream))
        del last
        print(f"2^{log2:<6} {op:<10} {t_api * 1e6:9.1f} {t_graph * 1e6:9.1f} {(t_api - t_graph) * 1e6:8.1f}", flush=True)
