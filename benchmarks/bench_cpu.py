"""CPU codec benchmark on real BF16 KV: kvzip (all cores, one thread, with and without the
payload checksum) against zstd -1 and lz4 in the same run (kvzip/bench_cpu.py does the timing).

    python benchmarks/bench_cpu.py [--data ../shared/data/kv] [--mib 64] [--repeat 7]
        [--out benchmarks/results/cpu-<cores>core.json]

Input: the SmolLM2-135M KV files of --data (every tensor, in file and key order), concatenated
and cut to --mib MiB.  Without --data files it falls back to the sample shipped with kvzip,
tiled (what `kvzip bench --device cpu` runs).  Writes the rows with machine, versions and date.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent


def real_kv(data: pathlib.Path, nbytes: int):
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy; import kvzip no longer loads it)
    from safetensors.numpy import load_file

    files = sorted(data.glob("smollm2-*.safetensors"))
    if not files:
        return None, []
    parts, have = [], 0
    for f in files:
        for key, value in load_file(str(f)).items():
            parts.append(value.view(np.uint16).ravel())
            have += parts[-1].nbytes
        if have >= nbytes:
            break
    bits = np.concatenate(parts)
    if bits.nbytes < nbytes:
        sys.exit(f"{data} holds only {bits.nbytes} bytes of SmolLM2 KV, fewer than {nbytes}")
    return bits[: nbytes // 2].view(ml_dtypes.bfloat16), [f.name for f in files]


def main(argv=None) -> int:
    from kvzip import bench_cpu
    from kvzip.cpu_parallel import available_cores

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=pathlib.Path, default=ROOT.parent / "shared" / "data" / "kv",
                    help="folder of smollm2-*.safetensors KV files (default: ../shared/data/kv)")
    ap.add_argument("--mib", type=int, default=64, help="MiB of BF16 values to compress (default 64)")
    ap.add_argument("--repeat", type=int, default=7, help="timed runs per row after a warm-up (default 7)")
    ap.add_argument("--label", default="", help="what code this measures (stored in the JSON)")
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="JSON to write (default benchmarks/results/cpu-<cores>core.json)")
    a = ap.parse_args(argv)
    nbytes = a.mib << 20
    x, files = real_kv(a.data, nbytes)
    source = {"files": files, "folder": str(a.data)}
    if x is None:
        x, source = bench_cpu.sample_bf16(nbytes), {"files": ["kvzip/data/kv_sample.npz (tiled)"]}
    before = bench_cpu.environment()["load_average_1_5_15min"]
    rows = bench_cpu.run(x, a.repeat, progress=lambda done, total, name: print(f"  {done}/{total} {name}", file=sys.stderr))
    print(bench_cpu.format_table(rows))
    out = a.out or ROOT / "benchmarks" / "results" / f"cpu-{available_cores()}core.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {"label": a.label, "load_average_before": before, **bench_cpu.environment(),
           "input": {"bytes": int(x.nbytes), "dtype": "bfloat16", **source}, "repeat": a.repeat, "rows": rows}
    out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {out}")
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
