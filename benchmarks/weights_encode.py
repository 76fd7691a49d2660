"""The tiled layout's GPU encoder (kvzip.weights.tiled.encode on a CUDA tensor) on every shape of
bench_weights.py: GB/s of BF16 input, the median of REPS synchronised calls after a warm-up.
A change of the encoder is compared with benchmarks/tree_ab.py (two trees, this script in each).

    python benchmarks/weights_encode.py --out benchmarks/results        # on a GPU
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_weights import SHAPES, TARGETS, encode_s, environment, synthetic  # noqa: E402

from kvzip.bench import torch_gpu_tag  # noqa: E402
from kvzip.weights import tiled  # noqa: E402

REPS = 7


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--tag", default=None,
                    help="the result files' suffix (default: the GPU's short name, kvzip.bench.gpu_tag)")
    args = ap.parse_args(argv)
    rows = []
    for i, (m, k) in enumerate(s for group in SHAPES.values() for s in group):
        w = synthetic(m, k, i)
        assert torch.equal(tiled.decode(tiled.encode(w)).view(torch.int16), w.view(torch.int16)), (m, k)
        times = [encode_s(w) for _ in range(REPS)]
        rows.append({"shape": [m, k], "encode_gbs": 2 * m * k / statistics.median(times) / 1e9,
                     "encode_ms": [1e3 * t for t in times]})
        print(f"{m}x{k}: {rows[-1]['encode_gbs']:.1f} GB/s", file=sys.stderr, flush=True)
        del w
        torch.cuda.empty_cache()
    result = {"environment": environment(), "reps": REPS, "target_gbs": TARGETS["encode_gbs"], "shapes": rows,
              "encode_gbs_min": min(r["encode_gbs"] for r in rows)}
    result["met"] = result["encode_gbs_min"] >= TARGETS["encode_gbs"]
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"weights-encode-{args.tag or torch_gpu_tag()}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}: min {result['encode_gbs_min']:.1f} GB/s, target {TARGETS['encode_gbs']}", file=sys.stderr)


if __name__ == "__main__":
    main()
