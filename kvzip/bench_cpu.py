"""The CPU benchmark (`kvzip bench --device cpu`, benchmarks/bench_cpu.py): kvzip against the
general-purpose compressors a user would otherwise reach for, side by side in one run.

Every row compresses the same bytes and checks its own round trip.  Throughput is uncompressed
bytes over wall time (time.perf_counter), the median of ``repeat`` rounds after a warm-up round;
a round times every method once, in turn, so that a machine busy with other work for a while
slows all rows alike instead of the few measured then.
zstandard and lz4 rows appear when those packages are importable; the NumPy copy row is the
memory ceiling of the machine.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import subprocess
import time

import numpy as np

MiB = 1 << 20


def sample_bf16(nbytes: int) -> np.ndarray:
    """The shipped real KV sample (kvzip/data) as one BF16 array of nbytes, tiled to that size."""
    import ml_dtypes

    from .data import load_sample

    bits = np.concatenate([v.view(np.uint16).ravel() for v in load_sample().values()])
    return np.resize(bits, nbytes // 2).view(ml_dtypes.bfloat16)


def run(x: np.ndarray, repeat: int = 5, progress=None) -> list[dict]:
    """The table's rows for the BF16 array x.  progress(done, total, method): after each step."""
    import kvzip
    from . import cpu_parallel

    raw = x.view(np.uint8).reshape(-1)
    raw_bytes = raw.tobytes()
    ref = x.view(np.uint16)

    def same_bits(back):
        return back.shape == x.shape and np.array_equal(np.asarray(back).view(np.uint16), ref)

    def same_bytes(back):
        return back == raw_bytes

    cases = []
    nthreads = cpu_parallel.available_cores()
    for threads in dict.fromkeys((nthreads, 1)):  # one row when the machine has one core
        for checksum in (False, True):
            def encode(checksum=checksum, threads=threads):
                with cpu_parallel.threads(threads):
                    return kvzip.compress(x, checksum=checksum, backend="cpu")

            def decode(blob, threads=threads):
                with cpu_parallel.threads(threads):
                    return kvzip.decompress(blob, backend="cpu")

            label = f"kvzip, {threads} thread{'s' if threads > 1 else ''}" + (", checksum" if checksum else "")
            cases.append((label, encode, decode, same_bits))
    try:
        import zstandard
    except ImportError:
        zstandard = None
    if zstandard is not None:
        dctx = zstandard.ZstdDecompressor()
        for threads in dict.fromkeys((1, nthreads)):
            cctx = zstandard.ZstdCompressor(level=1, threads=threads if threads > 1 else 0)
            label = f"zstd -1, {threads} thread{'s' if threads > 1 else ''}"
            cases.append((label, lambda c=cctx: c.compress(raw_bytes), dctx.decompress, same_bytes))
    try:
        import lz4.frame as lz4f
    except ImportError:
        lz4f = None
    if lz4f is not None:
        cases.append(("lz4 (frame, default level)", lambda: lz4f.compress(raw_bytes), lz4f.decompress, same_bytes))
    cases.append(("numpy copy", lambda: raw.copy(), lambda b: b.copy(), lambda b: np.array_equal(b, raw)))
    times = [([], []) for _ in cases]
    blobs, exact = [None] * len(cases), [True] * len(cases)
    total = (repeat + 1) * len(cases)
    for r in range(repeat + 1):  # round 0: warm-up (JIT compilation, first touch of buffers)
        for k, (name, encode, decode, equal) in enumerate(cases):
            t0 = time.perf_counter()
            blobs[k] = encode()
            t1 = time.perf_counter()
            back = decode(blobs[k])
            t2 = time.perf_counter()
            exact[k] = exact[k] and bool(equal(back))
            if r:
                times[k][0].append(t1 - t0)
                times[k][1].append(t2 - t1)
            if progress is not None:
                progress(r * len(cases) + k + 1, total, name)
    nbytes = raw.nbytes
    rows = []
    for k, (name, *_) in enumerate(cases):
        size = blobs[k].nbytes if isinstance(blobs[k], np.ndarray) else len(blobs[k])
        rows.append({"method": name, "ratio": nbytes / size, "encode_MBps": nbytes / statistics.median(times[k][0]) / 1e6,
                     "decode_MBps": nbytes / statistics.median(times[k][1]) / 1e6, "exact": exact[k]})
    return rows


def median_seconds(fn, repeat: int) -> float:
    """Median wall time of ``repeat`` calls of fn, after one untimed call (first-use costs)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def code_commit() -> str | None:
    """The commit of the code a benchmark runs: KVZIP_COMMIT where the caller sets it (a copied
    tree's own git may be stale, as on the device machine), else the checkout's HEAD; None
    outside a git checkout."""
    if os.environ.get("KVZIP_COMMIT"):
        return os.environ["KVZIP_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return None
    return head or None


def environment() -> dict:
    """Machine, versions and date, stored with every result."""
    from importlib import metadata

    import numba

    import kvzip
    from .cpu_parallel import available_cores

    versions = {"kvzip": kvzip.__version__, "numba": numba.__version__, "numpy": np.__version__,
                "python": platform.python_version()}
    for pkg in ("zstandard", "lz4"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    try:  # other work on the machine slows every row; the load average says how busy it was
        load = [round(v, 2) for v in os.getloadavg()]
    except (AttributeError, OSError):
        load = None
    return {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "cpu": cpu,
            "cores": available_cores(), "load_average_1_5_15min": load, "platform": platform.platform(),
            "versions": versions}


def format_table(rows: list[dict]) -> str:
    head = f"{'method':<30} {'ratio':>7} {'encode MB/s':>12} {'decode MB/s':>12}  exact"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['method']:<30} {r['ratio']:>7.4f} {r['encode_MBps']:>12.0f} {r['decode_MBps']:>12.0f}  "
                     f"{'yes' if r['exact'] else 'NO'}")
    return "\n".join(lines)
