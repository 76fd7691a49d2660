"""A/B of bench_codec.py between two kvzip trees in one device lease: the runs interleaved
(tree_ab.interleave: before, after, then after, before, ...), the median of each figure, and the
after/before ratio.  benchmarks/tree_ab.py does the same for any command's printed figures.

    python benchmarks/ab_codec.py --before SITE_A --after SITE_B [--runs 3] [--out DIR]

SITE_A/SITE_B: directories put first on PYTHONPATH for each side (an installed kvzip each).
Writes DIR/ab-<gpu>.json (every run's figures, the medians, the ratios) and prints a markdown
table; DIR/after-<i>/ and before-<i>/ hold each run's own JSON and plot.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tree_ab import interleave, tree_env  # noqa: E402

# (name, path into a bench_codec result): the figures the redesign issue holds within 3 %.
FIGURES = [
    *[(f"{fmt} {way}", ("kvzip", fmt, f"{way}_GBps")) for fmt in ("bf16", "e5m2", "quantize_e5m2", "fp16", "fp32")
      for way in ("encode", "decode")],
    *[(f"latency {size} {way} (us)", ("latency_us", size, way)) for size in ("1MiB", "8MiB", "64MiB")
      for way in ("encode", "decode")],
    ("batch 64x8MiB encode", ("batch_64x8MiB", "encode_GBps")),
    ("batch 64x8MiB decode", ("batch_64x8MiB", "decode_GBps")),
    ("bf16 ratio", ("kvzip", "bf16", "ratio")),
]
LOWER_IS_BETTER = {name for name, _ in FIGURES if "latency" in name}


def _get(result: dict, path: tuple):
    for key in path:
        result = result.get(key) if isinstance(result, dict) else None
    return result


def run_once(site: str, out: Path, values_log2: int, repeat: int) -> dict:
    env = tree_env(site)
    code = ("import sys; from kvzip.bench import main; "
            f"sys.exit(main(['--values-log2', '{values_log2}', '--repeat', '{repeat}', '--quick', '--out', '{out}']))")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd="/tmp")
    found = [p for p in out.glob("*.json")]
    if len(found) != 1:
        raise RuntimeError(f"{out}: expected one result JSON, found {found}")
    return json.loads(found[0].read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", required=True)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--values-log2", type=int, default=28)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    out = Path(args.out)
    runs = interleave(args.runs, {side: (lambda i, side=side: run_once(getattr(args, side), out / f"{side}-{i}",
                                                                       args.values_log2, args.repeat))
                                  for side in ("before", "after")})
    medians = {side: {name: statistics.median(v for v in (_get(r, path) for r in results) if v is not None)
                      for name, path in FIGURES if all(_get(r, path) is not None for r in results)}
               for side, results in runs.items()}
    rows, worst = [], 0.0
    for name, _ in FIGURES:
        if name not in medians["before"] or name not in medians["after"]:
            continue
        b, a = medians["before"][name], medians["after"][name]
        ratio = a / b if b else float("nan")
        change = (b / a - 1) if name in LOWER_IS_BETTER else (ratio - 1)  # > 0: the after side is better
        worst = min(worst, change)
        rows.append({"figure": name, "before": b, "after": a, "after_over_before": round(ratio, 4),
                     "better_by": round(change, 4)})
    first = runs["after"][0]
    record = {"gpu": first.get("gpu"), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "versions": first.get("versions"), "values_log2": args.values_log2, "repeat": args.repeat,
              "runs": args.runs, "order": "interleaved: before, after; then after, before; ...", "rows": rows,
              "worst_change": round(worst, 4), "within_3_percent": worst >= -0.03, "raw": runs}
    name = (first.get("gpu") or "gpu").lower().replace("nvidia ", "").replace(" ", "-")
    (out / f"ab-{name}.json").write_text(json.dumps(record, indent=1))
    print("| figure | before | after | after/before |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['figure']} | {r['before']} | {r['after']} | {r['after_over_before']} |")
    print(f"worst change {worst:+.1%} ({'within' if worst >= -0.03 else 'OUTSIDE'} 3 %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
