"""The automatic codebook on the GPU against the shipped one and a calibrated Codebook object:
ratio, escape rate, encode and decode GB/s through the public API (kvzip.compress /
kvzip.decompress on CuPy arrays), one run, side by side, on the shipped KV sample tiled to
2^N values (N = 28 by default) and bit-exact variants of it (kvzip.testing.kv_variant: a
whole tensor scaled by 2^3, per-channel scales, exact zeros), BF16 and E5M2; plus a batch of
64 x 8 MiB (compress_many) whose tensors are scaled differently, and one 8 MiB tensor's latency.

    python benchmarks/auto_codebook_bench.py [--log2 28] [--repeat 20] [--out benchmarks/results]

Writes OUT/auto-codebook-<gpu>.json (GPU, versions, date inside) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--log2", type=int, default=28)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    import cupy

    import kvzip
    from kvzip import testing as kt
    from kvzip.bench import _sample_bits, _timer, _versions, batch_parts, e5m2_bits
    from kvzip.calibrate import choose_exponents, exponent_histogram
    from kvzip.trace import last_path

    n = 1 << args.log2
    timeit = _timer(cupy, args.repeat)
    base = _sample_bits(n)
    inputs = {
        "bf16 as-is": ("bf16", base),
        "bf16 tensor x 2^3": ("bf16", kt.scale_pow2(base, 3)),
        "bf16 channels x 2^(c%8-4)": ("bf16", kt.kv_variant(base.reshape(-1, 64), "chan-scaled").reshape(-1)),
        "bf16 5 % zeros": ("bf16", kt.kv_variant(base, "zeros-5%")),
        "e5m2 as-is": ("e5m2", e5m2_bits(base, n)),
    }
    rows = []
    for label, (fmt, bits) in inputs.items():
        x = cupy.asarray(bits)
        own = kvzip.Codebook(choose_exponents(exponent_histogram(bits[: 1 << 24], fmt)), fmt)
        for name, spec in (("shipped", None), ("auto", "auto"), ("object", own)):
            t_enc, blob = timeit(lambda: kvzip.compress(x, dtype=fmt, codebook=spec))
            path = last_path()
            t_dec, back = timeit(lambda: kvzip.decompress(blob))
            ok = bool(cupy.array_equal(back.reshape(-1).view(x.dtype), x))
            info = kvzip.info(blob)
            rows.append({"input": label, "codebook": name, "ratio": round(x.nbytes / blob.nbytes, 5),
                         "escape_rate": info["escape_rate"], "encode_GBps": round(x.nbytes / t_enc / 1e9, 1),
                         "decode_GBps": round(x.nbytes / t_dec / 1e9, 1), "path": path, "lossless": ok})
            print(rows[-1], flush=True)
        del x
    # A batch of 64 x 8 MiB, tensor i scaled by 2^(i % 7 - 3): one codebook does not fit them all.
    parts = [cupy.asarray(kt.scale_pow2(p, i % 7 - 3)) for i, p in enumerate(batch_parts(base))]
    total = sum(p.nbytes for p in parts)
    for name, spec in (("shipped", None), ("auto", "auto")):
        t_enc, blobs = timeit(lambda: kvzip.compress_many(parts, dtype="bf16", codebook=spec))
        t_dec, backs = timeit(lambda: kvzip.decompress_many(blobs))
        ok = all(bool(cupy.array_equal(b.reshape(-1).view(p.dtype), p)) for b, p in zip(backs, parts))
        rows.append({"input": "batch 64 x 8 MiB, scaled 2^(i%7-3)", "codebook": name,
                     "ratio": round(total / sum(b.nbytes for b in blobs), 5),
                     "encode_GBps": round(total / t_enc / 1e9, 1), "decode_GBps": round(total / t_dec / 1e9, 1),
                     "lossless": ok})
        print(rows[-1], flush=True)
    one = parts[3]
    for name, spec in (("shipped", None), ("auto", "auto")):
        t_enc, blob = timeit(lambda: kvzip.compress(one, dtype="bf16", codebook=spec))
        t_dec, _ = timeit(lambda: kvzip.decompress(blob))
        rows.append({"input": "latency 8 MiB", "codebook": name, "encode_us": round(t_enc * 1e6, 1),
                     "decode_us": round(t_dec * 1e6, 1)})
        print(rows[-1], flush=True)
    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    out = {"gpu": gpu, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "versions": _versions(cupy),
           "values_log2": args.log2, "repeat": args.repeat, "rows": rows}
    path = Path(args.out) / f"auto-codebook-{gpu.split()[-1].lower()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print("| input | codebook | ratio | escapes | encode GB/s | decode GB/s |\n|---|---|---|---|---|---|")
    for r in rows:
        if "ratio" in r:
            print(f"| {r['input']} | {r['codebook']} | {r['ratio']} | {r.get('escape_rate', 0):.4%} | "
                  f"{r['encode_GBps']} | {r['decode_GBps']} |")
        else:
            print(f"| {r['input']} | {r['codebook']} | | | {r['encode_us']} us | {r['decode_us']} us |")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
