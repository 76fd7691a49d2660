"""How much a per-tensor ("auto") codebook would buy, measured on the CPU: every layer tensor of
every real KV file in ../shared/data/kv/, and adversarial-but-real variants of each, compressed
with the shipped BF16 codebook, with a Top-16 codebook chosen from the tensor's own exponent
histogram, and with one chosen from a sample of it (every STRIDE-th value).  The groundwork for
the any-model issue's choice rule; ratios only (the bytes are the GPU's too), no speeds.

    python benchmarks/codebook_survey.py [--data ../shared/data/kv] [--stride 61] [--out DIR]

The stride is prime on purpose: a stride that divides the head dimension (64 with SmolLM2's 64
or MiniLM's 32) samples one channel of every head and misses the others' exponents.

Variants: kvzip.testing.kv_variant (bit-exact: per-layer and per-channel power-of-two scales,
5 % exact zeros, a wide exponent range).
Writes DIR/codebook-survey-cpu.json (machine, versions and date inside) and prints a summary.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

import kvzip
from kvzip.calibrate import choose_exponents, exponent_histogram
from kvzip.formats import FORMATS
from kvzip.testing import KV_VARIANTS as VARIANTS, kv_variant

BF16 = FORMATS["bf16"]


def load(path: Path) -> dict:
    """{name: uint16 bits of shape [heads, tokens, head_dim]} of a BF16 .safetensors file."""
    import torch
    from safetensors.torch import load_file

    return {k: t.contiguous().view(torch.int16).numpy().view(np.uint16) for k, t in load_file(str(path)).items()}


def ratio_of(bits: np.ndarray, codebook) -> tuple[float, float]:
    blob = kvzip.compress(bits, codebook=codebook, dtype="bf16")
    info = kvzip.info(blob)
    return info["ratio"], info["escape_rate"]


def own_codebook(bits: np.ndarray, stride: int = 1):
    flat = bits.reshape(-1)
    sample = flat[::stride] if flat.size // stride >= 4096 else flat
    return kvzip.Codebook(choose_exponents(exponent_histogram(sample, BF16)), "bf16")


def survey(data: Path, stride: int) -> list[dict]:
    rows = []
    for path in sorted(data.glob("*.safetensors")):
        tensors = load(path)
        print(f"{path.name}: {len(tensors)} tensors", flush=True)
        for key, bits in tensors.items():
            layer = int(key.split(".")[0].removeprefix("layer"))
            for name in VARIANTS:
                v = kv_variant(bits, name, layer, seed=layer)
                row = {"file": path.name, "tensor": key, "variant": name, "values": int(v.size)}
                for label, cb in (("default", None), ("own", own_codebook(v)), ("sampled", own_codebook(v, stride))):
                    row[f"ratio_{label}"], row[f"escapes_{label}"] = ratio_of(v, cb)
                rows.append(row)
    return rows


def summary(rows: list[dict]) -> list[dict]:
    out = []
    families = sorted({r["file"].split("_")[0] for r in rows})
    for fam in families:
        for name in VARIANTS:
            sel = [r for r in rows if r["file"].startswith(fam) and r["variant"] == name]
            if not sel:
                continue
            entry = {"family": fam, "variant": name, "tensors": len(sel)}
            for label in ("default", "own", "sampled"):
                ratios = [r[f"ratio_{label}"] for r in sel]
                entry[f"{label}_min"] = round(min(ratios), 4)
                entry[f"{label}_median"] = round(statistics.median(ratios), 4)
                entry[f"{label}_escapes_median"] = round(statistics.median(r[f"escapes_{label}"] for r in sel), 5)
            entry["sampled_vs_own_worst"] = round(min(r["ratio_sampled"] / r["ratio_own"] for r in sel), 5)
            out.append(entry)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "kv"))
    ap.add_argument("--stride", type=int, default=61,
                    help="sample every STRIDE-th value (default 61: prime, so no head dimension aliases it)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    rows = survey(Path(args.data), args.stride)
    table = summary(rows)
    import torch

    record = {"what": "layer-tensor ratios with the shipped, the tensor's own, and a sampled Top-16 codebook",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
              "versions": {"kvzip": kvzip.__version__, "numpy": np.__version__, "torch": torch.__version__,
                           "python": platform.python_version()},
              "data": args.data, "stride": args.stride, "summary": table, "rows": rows}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codebook-survey-cpu.json").write_text(json.dumps(record, indent=1))
    print("| family | variant | tensors | default min / median | own min / median | sampled min / median "
          "| sampled/own worst | escapes default / own |")
    print("|---|---|---|---|---|---|---|---|")
    for e in table:
        print(f"| {e['family']} | {e['variant']} | {e['tensors']} | {e['default_min']} / {e['default_median']} "
              f"| {e['own_min']} / {e['own_median']} | {e['sampled_min']} / {e['sampled_median']} "
              f"| {e['sampled_vs_own_worst']} | {e['default_escapes_median']:.2%} / {e['own_escapes_median']:.2%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
