"""Start-up cost of kvzip in fresh processes: `import kvzip`, and the first compress / decompress.

Every case runs in a new Python process, twice: once after the Numba cache directory was
emptied (cold: the process compiles every CPU kernel it needs, and writes it to the disk cache)
and once more right after (warm: a second process, which should load the kernels from disk).
The cache directory is a private temporary one (NUMBA_CACHE_DIR), so the run neither reads nor
leaves anything in the tree's __pycache__.

Reported per case and run: seconds of `import kvzip`, which heavy modules that import loaded
(numba.cuda, cupy, cuda.bindings / cuda.core, ml_dtypes, torch), seconds of the first compress
and first decompress of 1 MiB of input (and of the second compress, the steady state for
reference), and Numba's on-disk cache hits / misses summed over the dispatchers that ran.
Inputs are NumPy arrays of the format's dtype; for bf16 / fp8 that is an ml_dtypes dtype, so the
child imports ml_dtypes after `import kvzip` (timed apart: a caller holding such arrays has).

The machine may be shared: warm runs repeat (--repeat) and the JSON keeps each run's figures,
with the per-field minimum as "warm".

    python benchmarks/startup.py [--out benchmarks/results/startup-cpu-2core.json] [--cases bf16,fp32]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("numba.cuda", "numba_cuda", "cupy", "cuda.bindings", "cuda.core", "ml_dtypes", "torch")
MIB = 1 << 20

# name -> (source format, pipeline kind, checksum)
CASES = {
    "import": (None, None, False),
    "bf16": ("bf16", "default", False),
    "bf16_checksum": ("bf16", "default", True),
    "fp16": ("fp16", "default", False),
    "fp32": ("fp32", "default", False),
    "e4m3": ("e4m3", "default", False),
    "e5m2": ("e5m2", "default", False),
    "quantize_e5m2": ("bf16", "quantize_e5m2", False),
    "quantize_e4m3_channel": ("bf16", "quantize_e4m3_channel", False),
}

CHILD = r"""
import json, sys, time
case, fmt_name, kind, checksum = json.loads(sys.argv[1])
t0 = time.perf_counter()
import kvzip
t_import = time.perf_counter() - t0
heavy = {m: m in sys.modules for m in HEAVY}
out = {"import_s": t_import, "imported_by_import": heavy}
if fmt_name is not None:
    import numpy as np
    fmt = kvzip.get_format(fmt_name)
    if fmt.dtype_name not in np.sctypeDict:
        # A NumPy caller of bf16 / fp8 holds ml_dtypes arrays, so has loaded ml_dtypes already.
        t0 = time.perf_counter()
        import ml_dtypes
        out["ml_dtypes_import_s"] = time.perf_counter() - t0
        dtype = getattr(ml_dtypes, fmt.dtype_name)
    else:
        dtype = np.dtype(fmt.dtype_name)
    from kvzip.testing import kv_like_bits
    x = kv_like_bits(fmt, MIB // fmt.itemsize, escape_rate=0.01, seed=1).view(dtype)
    if kind == "default":
        enc = lambda: kvzip.compress(x, checksum=checksum)
        dec = kvzip.decompress
    else:
        from kvzip import stages
        q = stages.QuantizeFP8("e5m2") if kind == "quantize_e5m2" else stages.QuantizeFP8("e4m3", "channel")
        pipe = kvzip.Pipeline([q, stages.ExponentSplit(), stages.Top16Pack(), stages.EscapeStream(),
                               stages.Serialize(checksum)])
        x = x.reshape(-1, 128)
        enc = lambda: pipe.encode(x)
        dec = pipe.decode
    t0 = time.perf_counter(); blob = enc(); out["first_compress_s"] = time.perf_counter() - t0
    t0 = time.perf_counter(); back = dec(blob); out["first_decompress_s"] = time.perf_counter() - t0
    t0 = time.perf_counter(); enc(); out["second_compress_s"] = time.perf_counter() - t0
    if kind == "default":
        assert back.dtype == x.dtype and back.tobytes() == x.tobytes()
    out["ratio"] = x.nbytes / np.asarray(blob).nbytes
    out["imported_after_use"] = {m: m in sys.modules for m in HEAVY}
    import gc
    from numba.core.dispatcher import Dispatcher
    used = [d for d in gc.get_objects() if isinstance(d, Dispatcher) and d.overloads]
    out["numba_dispatchers_used"] = len(used)
    out["numba_cache_hits"] = sum(sum(d.stats.cache_hits.values()) for d in used)
    out["numba_cache_misses"] = sum(sum(d.stats.cache_misses.values()) for d in used)
print("RESULT " + json.dumps(out))
"""


def run_case(name, cache_dir):
    fmt_name, kind, checksum = CASES[name]
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    code = f"HEAVY = {HEAVY!r}\nMIB = {MIB}\n" + CHILD
    res = subprocess.run([sys.executable, "-c", code, json.dumps([name, fmt_name, kind, checksum])], env=env,
                         capture_output=True, text=True, cwd=tempfile.gettempdir())
    if res.returncode:
        raise SystemExit(f"case {name} failed:\n{res.stderr}")
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def _round(d):
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in d.items()}


def versions():
    import numba
    import numpy

    out = {"python": platform.python_version(), "numpy": numpy.__version__, "numba": numba.__version__}
    for mod in ("numba_cuda", "ml_dtypes", "torch", "llvmlite"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 (not installed, or no __version__)
            out[mod] = None
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "startup-cpu-2core.json"))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--repeat", type=int, default=3, help="warm processes per case (the minimum is reported)")
    ap.add_argument("--label", default="", help="free text stored with the results (e.g. 'before')")
    args = ap.parse_args(argv)
    cases = args.cases.split(",")
    cache_dir = tempfile.mkdtemp(prefix="kvzip-numba-cache-")
    results = {}
    try:
        for name in cases:
            shutil.rmtree(cache_dir, ignore_errors=True)
            os.makedirs(cache_dir)
            cold = _round(run_case(name, cache_dir))
            warms = [_round(run_case(name, cache_dir)) for _ in range(args.repeat)]
            warm = dict(warms[0])
            for k, v in warm.items():
                if isinstance(v, float):
                    warm[k] = min(w[k] for w in warms)
            results[name] = {"cold": cold, "warm": warm, "warm_runs": warms}
            print(f"{name:24s} import {cold['import_s']:.3f}/{warm['import_s']:.3f} s"
                  + (f"  first compress {cold['first_compress_s']:.3f} (cold) {warm['first_compress_s']:.3f} (warm)"
                     f"  first decompress {cold['first_decompress_s']:.3f} / {warm['first_decompress_s']:.3f}"
                     f"  cache hits warm {warm['numba_cache_hits']}" if "first_compress_s" in cold else ""),
                  flush=True)
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    git = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {
        "what": "fresh-process start-up: import kvzip, first compress/decompress of 1 MiB; cold = empty Numba "
                "cache dir, warm = the next process",
        "label": args.label,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git": git,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()},
        "versions": versions(),
        "input": "kvzip.testing.kv_like_bits(fmt, 1 MiB, escape_rate=0.01, seed=1) viewed as the format's NumPy "
                 "dtype; the quantize cases shape it (-1, 128)",
        "load_average_at_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "cases": results,
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
