"""The ``kvzip`` command: calibrate codebooks, and demo the codec on the shipped KV sample.

    kvzip calibrate kv.safetensors [...] -o my-model.json [--format bf16] [--name NAME]
    kvzip demo [--backend cpu|cuda] [--repeat N]

Each subcommand is one ``_add_<name>(subparsers)`` function that registers its parser and sets
``run`` to the function implementing it; ``main`` dispatches.  Runners return the exit status.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvzip", description="Lossless compression of LLM KV caches.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_calibrate(sub)
    _add_demo(sub)
    _add_bench(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # its own argparse (kvzip/bench.py) takes every remaining argument
        from .bench import main as bench_main

        return bench_main(argv[1:])
    args = parser.parse_args(argv)
    return args.run(args)


def _fail(command: str, message) -> int:
    print(f"kvzip {command}: error: {message}", file=sys.stderr)
    return 1


# ---- calibrate -------------------------------------------------------------------------------

def _add_calibrate(sub) -> None:
    p = sub.add_parser("calibrate", help="calibrate a Top-16 codebook on .safetensors KV files",
                       description="Count exponents in every tensor of the given .safetensors files and "
                                   "write the Top-16 codebook as JSON (use it with "
                                   "kvzip.compress(x, codebook=kvzip.Codebook.from_json(path))).")
    p.add_argument("files", nargs="+", type=Path, metavar="FILE", help=".safetensors file(s) of KV tensors")
    p.add_argument("-o", "--output", required=True, type=Path, metavar="OUT.json", help="codebook to write")
    p.add_argument("--format", help="float format (bf16, fp16, fp32, e4m3, e5m2); needed only if the "
                                    "files hold raw integer bits, else checked against them")
    p.add_argument("--name", help="codebook name (default: the output file's stem)")
    p.add_argument("--always-include", type=int, nargs="*", default=[0], metavar="EXP",
                   help="exponents the codebook must hold (default: 0, for zeros and subnormals; "
                        "give none for the plain Top-16)")
    p.set_defaults(run=_run_calibrate)


def _run_calibrate(args) -> int:
    from .calibrate import calibrate

    missing = [str(f) for f in args.files if not f.is_file()]
    if missing:
        return _fail("calibrate", f"no such file: {', '.join(missing)}")
    name = args.name or args.output.stem
    try:
        cb = calibrate(args.files, format=args.format, name=name, always_include=tuple(args.always_include))
    except (ValueError, TypeError, ImportError) as e:
        return _fail("calibrate", e)
    prov = cb.provenance
    print(f"{name}: {cb.format.name} codebook from {prov['values']:,} values in {prov['tensors']} tensors")
    print(f"coverage {cb.coverage:.4%} (escape rate {1 - cb.coverage:.4%})")
    print(f"exponents, code 0 first: {list(cb.exponents)}")
    try:
        cb.to_json(args.output)
    except OSError as e:
        return _fail("calibrate", e)
    print(f"wrote {args.output}")
    return 0


# ---- demo ------------------------------------------------------------------------------------

def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="compress the shipped real KV sample and check the round trip",
                       description="Compress and decompress the KV sample shipped with kvzip (SmolLM2-135M, "
                                   "prose / code / HTML), check every bit, and report ratio and speed.")
    p.add_argument("--backend", choices=("cpu", "cuda"), default=None,
                   help="where to run (default: cuda if a CUDA GPU and CuPy are available, else cpu)")
    p.add_argument("--repeat", type=_positive_int, default=5, metavar="N",
                   help="timed runs after one warm-up; the median is reported (default 5)")
    p.set_defaults(run=_run_demo)


def _positive_int(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _default_backend() -> str:
    try:
        import cupy

        return "cuda" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:  # no CuPy, no driver, no device: all mean "not here"
        return "cpu"


def _run_demo(args) -> int:
    with warnings.catch_warnings():
        # Numba flags small grids; a 6 MB sample makes small grids on purpose.
        warnings.filterwarnings("ignore", message=".*GPU under-utilization")
        return _demo(args)


def _demo(args) -> int:
    import kvzip
    from .data import SAMPLE_KINDS, load_sample

    backend = args.backend or _default_backend()
    if backend == "cuda":
        try:
            import cupy
        except ImportError:
            return _fail("demo", "--backend cuda needs CuPy and a CUDA GPU: pip install 'kvzip[gpu]'")

        # CuPy has no bfloat16: the sample goes up as its uint16 bits, with dtype= saying what
        # they are, and comes back as uint16 bits.
        dtype, to_device, to_host = "bfloat16", cupy.asarray, cupy.asnumpy
        sync = cupy.cuda.Device().synchronize
    else:
        dtype, to_device, to_host = None, np.asarray, np.asarray

        def sync():
            pass

    print(f"kvzip demo: real SmolLM2-135M KV (shipped sample), backend {backend}, "
          f"median of {args.repeat} run(s) after a warm-up")
    header = (f"{'kind':<6} {'values':>10} {'raw MB':>8} {'comp MB':>8} {'ratio':>7} {'escapes':>8} "
              f"{'enc GB/s':>9} {'dec GB/s':>9}  exact")
    print(header)
    print("-" * len(header))
    failed = []
    totals = dict(values=0, raw=0, comp=0, escapes=0, t_enc=0.0, t_dec=0.0)
    for kind in SAMPLE_KINDS:
        sample = np.stack(list(load_sample(kind).values()))  # bfloat16 [layers*2, 3, tokens, 64]
        host = sample.view(np.uint16)
        x = to_device(host) if dtype else sample

        def encode():
            return kvzip.compress(x, dtype=dtype, backend=backend)

        t_enc, blob = _median_time(encode, args.repeat, sync)
        t_dec, back = _median_time(lambda: kvzip.decompress(blob, backend=backend), args.repeat, sync)
        got = np.asarray(to_host(back))
        exact = got.shape == host.shape and np.array_equal(got.view(np.uint16), host)
        if not exact:
            failed.append(kind)
        meta = kvzip.info(blob)
        raw, comp = meta["raw_bytes"], meta["compressed_bytes"]
        print(f"{kind:<6} {host.size:>10,} {raw / 1e6:>8.3f} {comp / 1e6:>8.3f} {meta['ratio']:>7.4f} "
              f"{meta['escape_rate']:>8.4%} {raw / t_enc / 1e9:>9.3f} {raw / t_dec / 1e9:>9.3f}  "
              f"{'yes' if exact else 'NO'}")
        for key, value in (("values", host.size), ("raw", raw), ("comp", comp), ("escapes", meta["escapes"]),
                           ("t_enc", t_enc), ("t_dec", t_dec)):
            totals[key] += value
    t = totals
    print(f"{'all':<6} {t['values']:>10,} {t['raw'] / 1e6:>8.3f} {t['comp'] / 1e6:>8.3f} "
          f"{t['raw'] / t['comp']:>7.4f} {t['escapes'] / t['values']:>8.4%} "
          f"{t['raw'] / t['t_enc'] / 1e9:>9.3f} {t['raw'] / t['t_dec'] / 1e9:>9.3f}  "
          f"{'NO' if failed else 'yes'}")
    print("GB/s: uncompressed bytes per second of wall time, median.", end=" ")
    if backend == "cpu":
        print("kvzip's speed targets are for the GPU; CPU figures are for reference.")
    else:
        print("A ~6 MB sample cannot fill a GPU: throughput at scale needs far more values.")
    if failed:
        return _fail("demo", f"round trip NOT bit-exact for: {', '.join(failed)}")
    return 0


def _median_time(fn, repeat: int, sync):
    """(median seconds of ``repeat`` timed calls after one warm-up, the last result)."""
    out = fn()  # warm-up: JIT compilation, allocator pools
    sync()
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


# ---- bench -----------------------------------------------------------------------------------

def _add_bench(sub) -> None:
    p = sub.add_parser("bench", help="GPU benchmark: kvzip vs the copy roofline and nvCOMP (needs CUDA + CuPy)",
                       add_help=False)
    p.set_defaults(run=None)  # main() hands "bench ..." to kvzip.bench.main before parsing


if __name__ == "__main__":
    sys.exit(main())
