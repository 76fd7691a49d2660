"""Escape-heavy BF16 data against variants of the fast path's tunables, interleaved in one run.

    python benchmarks/escape_ab.py [--values-log2 28] [--runs 3] [--repeat 10] [--out DIR]
    ncu --clock-control none --metrics gpu__time_duration.sum --csv -k regex:kvz_ \\
        python benchmarks/escape_ab.py --profile          # each kernel's time, shipped tuning

The data: the shipped sample with a share of its values scaled out of the default codebook
(kvzip.bench.with_escapes: spread over every chunk), and two KV variants whose escapes cluster
in chunks (kvzip.testing.kv_variant).  Each variant (a kvzip.gpu.tuning override of the BF16
kernels) must give the shipped variant's blobs byte for byte and decode them losslessly; the
figures are medians over runs of each call's median over --repeat.  Writes
<out>/escape-ab-<gpu>.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import sys

import numpy as np

VARIANTS = {
    "shipped": {},
    "decode scan checks all": {"check_max": 1 << 20},
}
RATES = (0.0, 0.003, 0.01, 0.03)


def datasets(cupy, n):
    from kvzip import bench, testing

    host = bench._sample_bits(n)
    x = cupy.asarray(host)
    out = {f"+{100 * r:g} %": bench.with_escapes(cupy, x, r) for r in RATES}
    for variant, layer in (("chan-scaled", 0), ("layer-scaled", 6)):
        out[variant] = cupy.asarray(testing.kv_variant(host.reshape(-1, 64), variant, layer=layer).reshape(-1))
    return out


def measure(cupy, timeit, x):
    import kvzip

    t_enc, blob = timeit(lambda: kvzip.compress(x, dtype="bf16"))
    t_dec, back = timeit(lambda: kvzip.decompress(blob))
    ok = bool(cupy.array_equal(back.reshape(-1).view(x.dtype), x))
    digest = hashlib.sha256(cupy.asnumpy(blob).tobytes()).hexdigest()[:16]
    info = kvzip.info(blob)
    return {"encode_GBps": x.nbytes / t_enc / 1e9, "decode_GBps": x.nbytes / t_dec / 1e9, "lossless": ok,
            "blob": digest, "escape_rate": info["escape_rate"], "ratio": x.nbytes / blob.nbytes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values-log2", type=int, default=28)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--profile", action="store_true", help="one call of each, shipped tuning (for ncu)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS to run")
    a = ap.parse_args(argv)
    import cupy

    from kvzip import bench
    from kvzip.gpu import tuning

    data = datasets(cupy, 1 << (a.values_log2 if not a.profile else min(a.values_log2, 26)))
    if a.profile:
        import kvzip

        for name, x in data.items():
            print("profile", name, flush=True)
            kvzip.decompress(kvzip.compress(x, dtype="bf16"))
            cupy.cuda.get_current_stream().synchronize()
        return 0
    timeit = bench._timer(cupy, a.repeat)
    seen: dict = {}  # (variant, data) -> [rows]
    for run in range(a.runs):
        for variant in a.variants.split(","):
            changes = VARIANTS[variant]
            with tuning.override(formats=("bf16",), **changes):
                for name, x in data.items():
                    row = measure(cupy, timeit, x)
                    seen.setdefault((variant, name), []).append(row)
                    print(run, variant, name, {k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()},
                          flush=True)
    rows = []
    for (variant, name), got in seen.items():
        rows.append({"variant": variant, "changes": {k: v for k, v in VARIANTS[variant].items()}, "data": name,
                     "escape_rate": got[0]["escape_rate"], "ratio": round(got[0]["ratio"], 5),
                     "encode_GBps": round(float(np.median([g["encode_GBps"] for g in got])), 1),
                     "decode_GBps": round(float(np.median([g["decode_GBps"] for g in got])), 1),
                     "encode_runs": [round(g["encode_GBps"], 1) for g in got],
                     "decode_runs": [round(g["decode_GBps"], 1) for g in got],
                     "lossless": all(g["lossless"] for g in got),
                     "same_blob_as_shipped": all(g["blob"] == seen[("shipped", name)][0]["blob"] for g in got)})
    gpu = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    res = {"gpu": gpu, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "versions": bench._versions(cupy), "values": int(next(iter(data.values())).shape[0]), "runs": a.runs,
           "repeat": a.repeat, "rows": rows}
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"escape-ab-{gpu.lower().replace('nvidia', '').strip().split()[0]}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"{'variant':<28}{'data':<14}{'esc %':>7}{'enc':>8}{'dec':>8}  same  lossless")
    for r in rows:
        print(f"{r['variant']:<28}{r['data']:<14}{100 * r['escape_rate']:>7.2f}{r['encode_GBps']:>8}{r['decode_GBps']:>8}"
              f"  {r['same_blob_as_shipped']}  {r['lossless']}")
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
