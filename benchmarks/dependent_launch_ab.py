"""What programmatic dependent launches (kvzip/gpu/dependent_launch.py) buy a call: a development aid
behind benchmarks/NOTES.md (v20).  For BF16 and E5M2 at 2^28 values (the bench's data) and BF16
at 1 MiB: the wall time of compress and decompress (CUDA events, median of 30 after warm-up, as
bench_codec.py measures) and of replaying the call's graph alone, with the graphs recorded with
ordinary launches ("plain") and with dependent ones ("dependent"), alternated three times in one
process so both see the same GPU and host.

    python benchmarks/dependent_launch_ab.py
"""
import cupy

import kvzip
from kvzip.bench import _sample_bits, _timer, e5m2_bits
from kvzip.gpu import graphs, dependent_launch

VARIANTS = {"plain": False, "dependent": True}


def cases():
    bf16 = cupy.asarray(_sample_bits(1 << 28))
    e5m2 = cupy.asarray(e5m2_bits(_sample_bits(1 << 28), 1 << 28))
    return [("bf16 2^28", bf16, "bf16"), ("e5m2 2^28", e5m2, "e5m2"), ("bf16 1 MiB", bf16[:1 << 19], "bf16")]


def measure(x, fmt, timeit):
    """(compress, its graph alone, decompress, its graph alone) in seconds."""
    stream = cupy.cuda.get_current_stream()
    out = []
    for op in ("compress", "decompress"):
        if op == "compress":
            call = lambda: kvzip.compress(x, dtype=fmt)  # noqa: E731
        else:
            blob = kvzip.compress(x, dtype=fmt)
            call = lambda: kvzip.decompress(blob)  # noqa: E731
        t_call, last = timeit(call)  # last: what the staged tables point at, alive for the replay
        prog = [e for e in graphs.entries() if type(e).__name__ != "_HeadsProgram"][-1]
        t_graph, _ = timeit(lambda: prog.shape.run(stream))
        assert prog.shape.graph
        out += [t_call, t_graph]
        del last
    return out


def main(rounds=3):
    timeit = _timer(cupy, 30)
    rows = {}
    for r in range(rounds):
        for name, x, fmt in cases():
            for variant, enabled in VARIANTS.items():
                dependent_launch.ENABLED = enabled
                graphs.release()
                t = measure(x, fmt, timeit)
                rows.setdefault((name, variant), []).append(t)
                print(f"round {r} {name:<11} {variant:<9} compress {t[0] * 1e6:7.1f} us (graph {t[1] * 1e6:6.1f})"
                      f"  decompress {t[2] * 1e6:7.1f} us (graph {t[3] * 1e6:6.1f})", flush=True)
    dependent_launch.ENABLED = True
    graphs.release()
    print(f"{'case':<11} {'variant':<9} {'compress us':>15} {'graph':>15} {'decompress us':>15} {'graph':>15}")
    for (name, variant), ts in rows.items():
        cols = [f"{min(t[i] for t in ts) * 1e6:6.1f}-{max(t[i] for t in ts) * 1e6:6.1f}" for i in range(4)]
        print(f"{name:<11} {variant:<9} " + " ".join(f"{c:>15}" for c in cols))


if __name__ == "__main__":
    main()
