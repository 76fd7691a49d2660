"""Interleaved A/B of two source trees on one benchmark command: runs the command in tree A and
tree B in turn (the order alternating a round), each a fresh process with the tree first on
PYTHONPATH, picks the figures a regular expression finds in its output and writes their
medians per tree and B / A.  For a kernel change measured against the commit before it on one
machine in one call, where a machine's state moves figures between calls (NOTES r3: up to 25 %).

    git archive HEAD~1 | (mkdir -p .dev/base && tar -x -C .dev/base)      # tree A: a plain copy
    python benchmarks/tree_ab.py .dev/base . --rounds 3 --out ab.json \\
        --match 'wall (\\w+ \\w+ \\w+ \\S+): ([\\d.]+) ms' --match '  kernel (\\w+)\\s+([\\d.]+) ms' \\
        -- python3 benchmarks/ratio_phases.py ratio 28 --no-host

Each --match has two groups: a label and a number (lower is better is not assumed: the
output gives B / A for every label).  Labels seen more than once in a run are numbered.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path


def tree_env(tree) -> dict:
    """os.environ with the source tree `tree` first on PYTHONPATH (its kvzip before an installed one)."""
    rest = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), rest]) if rest else str(tree))


def interleave(rounds: int, sides: dict) -> dict:
    """{side: [each round's result]} of sides' callables (side -> f(round)), run in turn, the
    order reversed every other round, so that drift in the machine's state falls on both."""
    names, runs = list(sides), {side: [] for side in sides}
    for r in range(rounds):
        for side in (names if r % 2 == 0 else names[::-1]):
            t = time.perf_counter()
            runs[side].append(sides[side](r))
            print(f"round {r + 1}/{rounds} {side}: {time.perf_counter() - t:.0f} s", flush=True)
    return runs


def run_once(tree: Path, command: list[str], patterns: list[re.Pattern], timeout: float) -> dict:
    """{label: number} of the figures the patterns find in command's output, run in tree."""
    done = subprocess.run(command, cwd=tree, env=tree_env(tree), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{command} failed in {tree} ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    found: dict = {}
    for line in done.stdout.splitlines():
        for p in patterns:
            if m := p.search(line):
                label, k = m.group(1), 2
                while label in found:
                    label, k = f"{m.group(1)} #{k}", k + 1
                found[label] = float(m.group(2))
    return found


def device() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or "none"
    except (OSError, subprocess.SubprocessError):
        return "none"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="tree A (the base)")
    ap.add_argument("b", type=Path, help="tree B (the change)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--match", action="append", required=True, help="regex with (label) and (number) groups")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a run may take")
    ap.add_argument("--out", type=Path, help="JSON of every run and the medians")
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        ap.error("no command: give it after --, run in each tree's root")
    cut = argv.index("--")
    args, command = ap.parse_args(argv[:cut]), argv[cut + 1:]
    for tree in (args.a, args.b):
        if not (tree / "kvzip" / "__init__.py").exists():
            ap.error(f"{tree} is not a kvzip source tree")
    patterns = [re.compile(m) for m in args.match]
    runs = interleave(args.rounds, {side: (lambda r, tree=tree.resolve(): run_once(tree, command, patterns, args.timeout))
                                    for side, tree in (("A", args.a), ("B", args.b))})
    labels = [k for k in runs["A"][0] if all(k in x for x in runs["A"] + runs["B"])]
    rows = {}
    for k in labels:
        a = statistics.median(x[k] for x in runs["A"])
        b = statistics.median(x[k] for x in runs["B"])
        rows[k] = {"A": a, "B": b, "B/A": b / a if a else None}
        print(f"{k:<40} A {a:10.4f}  B {b:10.4f}  B/A {b / a if a else float('nan'):.3f}")
    result = {"command": command, "a": str(args.a), "b": str(args.b), "rounds": args.rounds, "device": device(),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "medians": rows, "runs": runs}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
