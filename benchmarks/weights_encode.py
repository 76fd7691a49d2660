"""The tiled layout's GPU encoder (kvzip.weights.tiled.encode on a CUDA tensor) on every shape of
bench_weights.py: GB/s of BF16 input, the median of REPS synchronised calls after a warm-up; and,
interleaved in the same run, the same encoder with the codebook chosen by torch operations
(tiled.choose_codebook and _code_of, the encoder before kvz_w_codebook) as the A/B baseline.

    python benchmarks/weights_encode.py --out benchmarks/results        # on a GPU
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_weights import SHAPES, TARGETS, encode_s, environment, synthetic  # noqa: E402

from kvzip.bench import torch_gpu_tag  # noqa: E402
from kvzip.gpu import weights as gpu  # noqa: E402
from kvzip.weights import tiled  # noqa: E402

REPS = 7


@contextmanager
def torch_codebook():
    """The encoder with its codebook from torch operations (the baseline)."""
    def by_torch(hist, book, code_of, stream):
        b = tiled.choose_codebook(hist)
        book.copy_(b)
        code_of.copy_(tiled._code_of(b))
    kernel = gpu.codebook
    gpu.codebook = by_torch
    try:
        yield
    finally:
        gpu.codebook = kernel


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--tag", default=None,
                    help="the result files' suffix (default: the GPU's short name, kvzip.bench.gpu_tag)")
    args = ap.parse_args(argv)
    rows = []
    for i, (m, k) in enumerate(s for group in SHAPES.values() for s in group):
        w = synthetic(m, k, i)
        a = tiled.encode(w)
        with torch_codebook():
            b = tiled.encode(w)  # the same bytes either way
        assert all(torch.equal(x, y) for x, y in zip(a.arrays(), b.arrays())), (m, k)
        kernel, baseline = [], []
        for _ in range(REPS):  # interleaved, so both see the same machine state
            kernel.append(encode_s(w))
            with torch_codebook():
                baseline.append(encode_s(w))
        gbs = lambda t: 2 * m * k / statistics.median(t) / 1e9  # noqa: E731
        rows.append({"shape": [m, k], "encode_gbs": gbs(kernel), "encode_ms": [1e3 * t for t in kernel],
                     "baseline_gbs": gbs(baseline), "baseline_ms": [1e3 * t for t in baseline]})
        print(f"{m}x{k}: {rows[-1]['encode_gbs']:.1f} GB/s (torch codebook {rows[-1]['baseline_gbs']:.1f})",
              file=sys.stderr, flush=True)
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
