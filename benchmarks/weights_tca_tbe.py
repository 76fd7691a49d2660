"""TCA-TBE (kvzip/weights/tca_tbe.py, ZipServ's weight format) on real BF16 weights, CPU: bits a
weight per matrix and pooled, window coverage, and the NumPy reference's encode / decode speed.

    python benchmarks/weights_tca_tbe.py [--data ../shared/data/weights/minilm-l6_weights_bf16.safetensors]
                                         [--out benchmarks/results] [--repeat 5]

Every 2-D BF16 tensor of DATA (MiniLM-L6: 37 linear layers and the word embedding) is encoded
alone, decoded and checked bit for bit.  Bits a weight count the whole blob (header, bitmaps,
offsets, runs, padding).  Speed: median of REPEAT timed calls after a warm-up, MB/s of BF16
input (encode) or output (decode), for the largest matrix alone (the word embedding, 30522 x 384)
and for the sum of one call a matrix; decode includes every check of the reader, both include the
payload checksum.  Writes OUT/weights-tca-tbe-cpu.json (date, machine, versions, every row) and
prints the markdown table of benchmarks/NOTES.md's TCA-TBE section.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np

from kvzip.bench_cpu import environment, median_seconds
from kvzip.weights import samples, tca_tbe

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data" / "weights" / "minilm-l6_weights_bf16.safetensors"


def git(*cmd):
    try:
        return subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return None


def speed(matrices: list, repeat: int) -> dict:
    blobs = [tca_tbe.encode(w) for w in matrices]
    raw = sum(w.nbytes for w in matrices)
    enc = median_seconds(lambda: [tca_tbe.encode(w) for w in matrices], repeat)
    dec = median_seconds(lambda: [tca_tbe.decode(b) for b in blobs], repeat)
    return {"calls": len(matrices), "raw_bytes": raw, "encode_s": enc, "decode_s": dec,
            "encode_MBps": raw / enc / 1e6, "decode_MBps": raw / dec / 1e6}


def markdown(rows: list, pooled: dict, speeds: dict) -> str:
    bits = [r["bits_per_weight"] for r in rows]
    lines = ["| matrices | weights | coverage | bits/weight pooled | per matrix | ratio |", "|---|---|---|---|---|---|",
             f"| {len(rows)} | {pooled['weights']} | {pooled['coverage']:.4f} | {pooled['bits_per_weight']:.4f} | "
             f"{min(bits):.3f}-{max(bits):.3f} | {16 / pooled['bits_per_weight']:.3f}x |", "",
             "| CPU, NumPy reference | calls | MB | encode MB/s | decode MB/s |", "|---|---|---|---|---|"]
    for name, s in speeds.items():
        lines.append(f"| {name} | {s['calls']} | {s['raw_bytes'] / 1e6:.1f} | {s['encode_MBps']:.0f} | {s['decode_MBps']:.0f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    t0 = time.time()

    matrices = samples.read_bf16_matrices(args.data)
    rows = []
    for name, w in matrices.items():
        blob = tca_tbe.encode(w)
        if not np.array_equal(tca_tbe.decode(blob), w):
            raise SystemExit(f"{name}: round trip differs")
        info = tca_tbe.info(blob)
        rows.append({"name": name, "shape": list(w.shape), "window": list(info["window"]), "bytes": info["bytes"],
                     "coverage": info["coverage"], "bits_per_weight": info["bits_per_weight"]})
    weights = sum(r["shape"][0] * r["shape"][1] for r in rows)
    covered = sum(r["coverage"] * r["shape"][0] * r["shape"][1] for r in rows)
    pooled = {"weights": weights, "bytes": sum(r["bytes"] for r in rows), "coverage": covered / weights,
              "bits_per_weight": 8 * sum(r["bytes"] for r in rows) / weights}
    largest = max(matrices, key=lambda k: matrices[k].size)
    speeds = {f"{largest} {list(matrices[largest].shape)}": speed([matrices[largest]], args.repeat),
              "all matrices, one call each": speed(list(matrices.values()), args.repeat)}

    md = markdown(rows, pooled, speeds)
    env = environment()
    me = Path(__file__).name
    env["versions"].update({"git_head": git("rev-parse", "HEAD"), "script_commit": git("log", "-1", "--format=%H", "--", me),
                            "script_modified": bool(git("status", "--porcelain", "--", me))})
    result = {"benchmark": "weights_tca_tbe", **env, "data": str(args.data), "repeat": args.repeat, "pooled": pooled,
              "speed": speeds, "markdown": md, "rows": rows, "runtime_s": round(time.time() - t0, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "weights-tca-tbe-cpu.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}\n\n{md}")


if __name__ == "__main__":
    main()
