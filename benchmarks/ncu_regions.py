"""Where a kernel's instructions go, from Nsight Compute's source counters: executed warp
instructions per value, by straight-line region of SASS, for each kernel of a report.

On the GPU (the stage kernels of one ratio-mode round trip, 2^24 BF16 values):
    ncu --clock-control none --kernel-name regex:"kvz_ch_(encode|decode)" --launch-count 2 \\
        --section SourceCounters --export rep python benchmarks/ncu_regions.py --run ratio
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv
Then anywhere:
    python benchmarks/ncu_regions.py src.csv --values 16777216 [--min 0.4] [--show 0x2a20]

A region is a run of consecutive instructions with the same execution count (a basic block, or
blocks the compiler laid out back to back that run equally often).  Each line gives its offset
in the kernel, its length, how often it ran, its cost as thread instructions a value
(count x length x 32 / values) and its first opcodes; --show OFFSET lists one region's SASS.
benchmarks/NOTES.md r3 reads ChannelPack's kernels this way.
"""
from __future__ import annotations

import argparse
import csv
import sys


def kernels(path: str) -> list[dict]:
    """[{name, rows: [(offset, executed, sass)]}] of an ncu source-page CSV."""
    out, cur, col = [], None, None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                cur = {"name": row[1], "rows": []}
                out.append(cur)
            elif row[0] == "Address":
                col = {name: i for i, name in enumerate(row)}
            elif cur is not None and col is not None:
                executed = int(row[col["Instructions Executed"]].replace(",", "") or 0)
                cur["rows"].append((int(row[0], 16), executed, row[col["Source"]].strip()))
    for k in out:
        base = k["rows"][0][0] if k["rows"] else 0
        k["rows"] = [(a - base, n, t) for a, n, t in k["rows"]]
    return out


def regions(rows) -> list[tuple[int, int, int, list[str]]]:
    """[(offset, instructions, executions, sass lines)]: runs of equal execution counts."""
    out = []
    for offset, n, text in rows:
        if out and out[-1][2] == n:
            out[-1][1] += 1
            out[-1][3].append(text)
        else:
            out.append([offset, 1, n, [text]])
    return [tuple(r) for r in out]


def opcode(sass: str) -> str:
    words = sass.split()
    op = words[1] if words and words[0].startswith("@") and len(words) > 1 else (words[0] if words else "?")
    return op.split(".")[0]


def report(path: str, values: int, least: float, show: int | None) -> None:
    for k in kernels(path):
        total = sum(n for _, n, _ in k["rows"])
        print(f"== {k['name'][:100]}\n   {total * 32 / values:.2f} thread instructions a value in all")
        for offset, length, n, sass in regions(k["rows"]):
            cost = n * length * 32 / values
            if show is not None and offset == show:
                print("\n".join(f"   {line}" for line in sass))
            elif cost >= least:
                ops = " ".join(opcode(s) for s in sass[:14])
                print(f"   +{offset:#07x} x{length:4d} ran {n:9d}  {cost:6.2f}/value  {ops}")


def run(mode: str) -> None:
    """The workload to profile: one encode and one decode of 2^24 tiled BF16 values (CuPy)."""
    import cupy

    import kvzip
    from kvzip.bench import _sample_bits

    x = cupy.asarray(_sample_bits(1 << 24)).reshape(-1, 64)
    back = kvzip.decompress(kvzip.compress(x, dtype="bf16", mode=mode))
    assert bool(cupy.array_equal(back.reshape(-1).view(cupy.uint16), x.reshape(-1)))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="?", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--values", type=int, default=1 << 24, help="values the profiled calls coded")
    ap.add_argument("--min", type=float, default=0.4, help="list regions costing at least this a value")
    ap.add_argument("--show", type=lambda s: int(s, 0), help="print the SASS of the region at this offset")
    ap.add_argument("--run", choices=["speed", "ratio", "storage"], help="run the workload to profile instead")
    args = ap.parse_args(argv)
    if args.run:
        run(args.run)
    elif args.csv:
        report(args.csv, args.values, args.min, args.show)
    else:
        ap.error("give a CSV to read or --run MODE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
