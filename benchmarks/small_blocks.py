"""Ratios of small KV blocks (a serving engine's pages of 16 tokens) alone, packed 64 to a
container (kvzip.pack) and as one tensor, on real KV, on the CPU.  Ratios only (the bytes are the
GPU's too), no speeds.

    python benchmarks/small_blocks.py [--data ../shared/data/kv] [--group 64] [--out DIR]

Data families: the shipped sample (kvzip.data.load_sample, one family a text kind) and every
.safetensors file in DATA (loaded as benchmarks/codebook_survey.py loads them), all BF16 with
layer tensors [heads, tokens, head_dim].  Two page shapes from each:

- "native": each layer tensor made token-major ([tokens, heads, head_dim], a paged cache's
  order) and cut into pages of 16 tokens x heads x head_dim (SmolLM2 3 x 64: 6 KB; MiniLM 12 x 32:
  12 KB), a tail of fewer than 16 tokens dropped;
- "32k": 16 x 8 x 128 pages (16384 values, 32 KB) cut from the flat values: every K tensor made
  token-major and concatenated in layer order, then every V tensor the same, so a page mixes
  layers only where one tensor ends (and K with V once); the tail short of a page dropped.

Each family's pages, in order, are cut into groups of GROUP (fewer when the family has fewer
pages: one group of all of them, recorded as group_size); pages left over after the last full
group are not counted, so the three ratios are of the same pages:

- alone: raw bytes / the sum of each page's blob (kvzip.compress_many, the bytes compress gives);
- packed: raw bytes / the sum of each group's kvzip.compress_many(group, packed=True), which
  decompress_many must give back exactly (checked for every group);
- one tensor: raw bytes / the sum of each group's kvzip.compress(np.stack(group)).

with the shipped default codebook and with codebook="auto".  Targets (the issue's, for a 32 KB
BF16 block): alone >= 1.31, packed (64 blocks) >= 1.325.  Writes DIR/small-blocks-cpu.json
(machine, versions and date inside, kvzip.bench_cpu.environment()) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

import kvzip
from kvzip.bench_cpu import code_commit, environment
from kvzip.data import SAMPLE_KINDS, load_sample

sys.path.insert(0, str(Path(__file__).resolve().parent))
from codebook_survey import load  # noqa: E402  (the survey's loader: {key: uint16 bits [heads, tokens, head_dim]})

TOKENS = 16                       # tokens a page
PAGE_32K = (TOKENS, 8, 128)       # 16384 BF16 values, 32 KB
TARGETS = {"alone": 1.31, "packed": 1.325}  # for a 32 KB BF16 block
CODEBOOKS = {"default": None, "auto": "auto"}


def token_major(bits: np.ndarray) -> np.ndarray:
    """[heads, tokens, head_dim] -> [tokens, heads, head_dim], contiguous."""
    return np.ascontiguousarray(bits.transpose(1, 0, 2))


def native_pages(tensors: dict) -> list[np.ndarray]:
    pages = []
    for key in sorted(tensors):
        t = token_major(tensors[key])
        pages += [t[s:s + TOKENS] for s in range(0, t.shape[0] - TOKENS + 1, TOKENS)]
    return pages


def flat_pages(tensors: dict) -> list[np.ndarray]:
    keys = sorted(tensors, key=lambda k: (k.rsplit(".", 1)[-1], k))  # every .k in layer order, then every .v
    flat = np.concatenate([token_major(tensors[k]).reshape(-1) for k in keys])
    per = int(np.prod(PAGE_32K))
    return [flat[s:s + per].reshape(PAGE_32K) for s in range(0, flat.size - per + 1, per)]


def groups_of(pages: list, size: int) -> list[list]:
    size = min(size, len(pages))
    return [pages[s:s + size] for s in range(0, len(pages) - size + 1, size)] if size else []


def measure(pages: list, group: int, codebook) -> dict:
    groups = groups_of(pages, group)
    counted = [p for g in groups for p in g]
    raw = sum(p.nbytes for p in counted)
    blobs = kvzip.compress_many(counted, codebook=codebook, dtype="bf16")
    alone = sum(b.nbytes for b in blobs)
    each = np.array([p.nbytes / b.nbytes for p, b in zip(counted, blobs)])
    stored_raw = sum(int(b[10]) & 2 != 0 for b in blobs)  # flag bit 1 of either header version (format.md 2.2)
    packed = one = 0
    for g in groups:
        container = kvzip.compress_many(g, codebook=codebook, dtype="bf16", packed=True)
        backs = kvzip.decompress_many(container)
        assert all(np.array_equal(b.view(np.uint16), p) for b, p in zip(backs, g)), "packed round trip"
        packed += container.nbytes
        one += kvzip.compress(np.stack(g), codebook=codebook, dtype="bf16").nbytes
    n = len(counted)
    return {"pages": n, "pages_dropped": len(pages) - n, "groups": len(groups), "group_size": len(groups[0]) if groups else 0,
            "page_shape": list(pages[0].shape) if pages else None, "page_bytes": int(pages[0].nbytes) if pages else 0,
            "raw_bytes": raw, "alone_bytes": alone, "packed_bytes": packed, "one_tensor_bytes": one,
            "ratio_alone": raw / alone if alone else None, "ratio_packed": raw / packed if packed else None,
            "ratio_one_tensor": raw / one if one else None,
            "page_ratio_min": float(each.min()) if n else None, "page_ratio_median": float(np.median(each)) if n else None,
            "pages_stored_raw": int(stored_raw),
            "packed_overhead_bytes_per_page": (packed - alone) / n if n else None,
            "blob_bytes_per_page": alone / n if n else None}


def families(data: Path) -> dict:
    out = {}
    sample = load_sample()
    for kind in SAMPLE_KINDS:
        out[f"sample-{kind}"] = {k.split("/", 1)[1]: np.asarray(v).view(np.uint16) for k, v in sample.items()
                                 if k.startswith(kind + "/")}
    for path in sorted(data.glob("*.safetensors")):
        out[path.stem] = load(path)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "kv"))
    ap.add_argument("--group", type=int, default=64, help="pages a packed container (and a one-tensor batch)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = []
    for family, tensors in families(Path(args.data)).items():
        for shape, pages in (("native", native_pages(tensors)), ("32k", flat_pages(tensors))):
            for label, codebook in CODEBOOKS.items():
                row = {"family": family, "pages_of": shape, "codebook": label, **measure(pages, args.group, codebook)}
                if shape == "32k":
                    row["meets_alone_1.31"] = row["ratio_alone"] is not None and row["ratio_alone"] >= TARGETS["alone"]
                    row["meets_packed_1.325"] = row["ratio_packed"] is not None and row["ratio_packed"] >= TARGETS["packed"]
                rows.append(row)
                print(f"{family:28} {shape:6} {label:7} pages {row['pages']:5} x{row['group_size']:<3} "
                      f"alone {row['ratio_alone']:.4f}  packed {row['ratio_packed']:.4f}  "
                      f"one {row['ratio_one_tensor']:.4f}", flush=True)
    record = {"what": "ratios of 16-token KV pages alone, packed GROUP to a kvzip.pack container, and as one "
                      "tensor, default and auto codebook (benchmarks/small_blocks.py's docstring)",
              "environment": environment(), "commit": code_commit(), "data": args.data, "group": args.group,
              "targets_32k_bf16": TARGETS, "seconds": round(time.perf_counter() - t0, 1), "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "small-blocks-cpu.json").write_text(json.dumps(record, indent=1))
    print("\n| family | pages | codebook | page | pages x group | alone | packed | one tensor | packed - alone, bytes a page |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mark = ""
        if r["pages_of"] == "32k":
            mark = " (" + ", ".join(f"{k} {'met' if r[f'meets_{k}_{v}'] else 'NOT met'}" for k, v in TARGETS.items()) + ")"
        print(f"| {r['family']} | {r['pages_of']} | {r['codebook']} | {r['page_bytes'] // 1024} KB | {r['pages']} x "
              f"{r['group_size']} | {r['ratio_alone']:.4f} | {r['ratio_packed']:.4f} | {r['ratio_one_tensor']:.4f} | "
              f"{r['packed_overhead_bytes_per_page']:.1f}{mark} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
