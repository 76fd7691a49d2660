"""How much a per-tensor ("auto") codebook buys, and whether the auto rule's sample chooses as well
as the whole tensor, measured on the CPU.  Ratios only (the bytes are the GPU's too), no speeds.

    python benchmarks/codebook_survey.py [--data ../shared/data/kv] [--stride 61] [--out DIR]

*Layer tensors*: every layer tensor of every real KV file in ../shared/data/kv/, and
adversarial-but-real variants of each, compressed with the shipped BF16 codebook ("default"),
with a Top-16 chosen from the tensor's own full exponent histogram ("own"), from every
STRIDE-th value ("sampled"; prime on purpose: a stride that divides the head dimension, 64 with
SmolLM2's 64 or MiniLM's 32, samples one channel of every head) and by the auto rule
(kvzip.auto_codebook; "auto").  Layer tensors are under 2^20 values, which the rule reads whole.

*Large tensors*: the rule's sampled regime.  Each file's layer tensors (each made into the
variant first) concatenated in key order into one flat tensor, in two layouts: as stored
([heads, tokens, head_dim] per layer) and token-major ([tokens, heads, head_dim], the order of a
paged cache's blocks); then prefixes of it of 1.5 * 2^(19+k) + 4097 values for k = 1..4 (each
step of the rule's ladder; where the file is long enough), the whole of it, and the whole tiled
to 2^26 - 4097 values (k = 5, n not a multiple of the block).  Besides "auto" they get two
ablations: "fixed" (the rule's runs without the varying offset: every run at the start of its
block) and "auto/256", "auto/2048" (the rule with blocks 8 and 64 times longer: margins).

Variants: kvzip.testing.kv_variant (bit-exact: per-layer and per-channel power-of-two scales,
5 % exact zeros, a wide exponent range).
Writes DIR/codebook-survey-cpu.json (machine, versions and date inside) and prints summaries.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

import kvzip
from kvzip import auto_codebook as auto
from kvzip.bench_cpu import code_commit
from kvzip.calibrate import choose_exponents, exponent_histogram
from kvzip.formats import FORMATS
from kvzip.testing import KV_VARIANTS as VARIANTS, kv_variant, scale_pow2

BF16 = FORMATS["bf16"]
TILED = (1 << 26) - 4097
LAYOUTS = ("head-major", "token-major")
# An aliasing probe for the large tensors only: token t times 2**(t % 8 - 4).  Head-major, that
# structure repeats every 8 tokens (512 values with head_dim 64), a divisor of every block the
# rule uses from k = 1 on, so runs at a fixed offset in their block see tokens 0-3 of every 8
# only (half the scales), and runs at the rule's varying offsets see all of them.
LARGE_VARIANTS = VARIANTS + ("token-scaled",)


def load(path: Path) -> dict:
    """{name: uint16 bits of shape [heads, tokens, head_dim]} of a BF16 .safetensors file."""
    import torch
    from safetensors.torch import load_file

    return {k: t.contiguous().view(torch.int16).numpy().view(np.uint16) for k, t in load_file(str(path)).items()}


def layer_of(key: str) -> int:
    return int(key.split(".")[0].removeprefix("layer"))


def ratio_of(bits: np.ndarray, codebook) -> tuple[float, float]:
    blob = kvzip.compress(bits, codebook=codebook, dtype="bf16")
    info = kvzip.info(blob)
    return info["ratio"], info["escape_rate"]


def codebook_of(hist) -> kvzip.Codebook:
    return kvzip.Codebook(choose_exponents(hist), "bf16")


def own_codebook(bits: np.ndarray, stride: int = 1):
    flat = bits.reshape(-1)
    sample = flat[::stride] if flat.size // stride >= 4096 else flat
    return codebook_of(exponent_histogram(sample, BF16))


def runs_histogram(flat: np.ndarray, block: int, offsets: bool) -> np.ndarray:
    """Exponent counts of one RUN_LENGTH run per ``block`` values, at the rule's varying offset
    (``offsets``) or at the start of every block: the rule with another block, for ablations.
    With the rule's own block and offsets it reads exactly auto.run_starts (checked in main)."""
    n, L = flat.size, auto.RUN_LENGTH
    i = np.arange(-(-n // block), dtype=np.uint64)
    j = (((i * np.uint64(auto.WEYL)) & np.uint64(0xFFFFFFFF)) * np.uint64((block - L) // auto.ALIGN + 1)) >> np.uint64(32)
    starts = (i * np.uint64(block) + (j * np.uint64(auto.ALIGN) if offsets else 0)).astype(np.int64)
    idx = (starts[:, None] + np.arange(L)).reshape(-1)
    return exponent_histogram(flat[idx[idx < n]], BF16)


def survey_layers(files: dict, stride: int) -> list[dict]:
    rows = []
    for fname, tensors in files.items():
        print(f"{fname}: {len(tensors)} layer tensors", flush=True)
        for key, bits in tensors.items():
            layer = layer_of(key)
            for name in VARIANTS:
                v = kv_variant(bits, name, layer, seed=layer)
                row = {"file": fname, "tensor": key, "variant": name, "values": int(v.size)}
                for label, cb in (("default", None), ("own", own_codebook(v)), ("sampled", own_codebook(v, stride)),
                                  ("auto", auto.auto_codebook(v.reshape(-1), "bf16"))):
                    row[f"ratio_{label}"], row[f"escapes_{label}"] = ratio_of(v, cb)
                rows.append(row)
    return rows


def e5m2_of(bits: np.ndarray) -> np.ndarray:
    """A BF16 tensor's bits quantized to E5M2 by QuantizeFP8 (one scale for the tensor), as uint8."""
    from kvzip import stages as S
    from kvzip.backends import get_backend
    from kvzip.frame import Frame

    flat = np.ascontiguousarray(bits.reshape(-1))
    frame = Frame(get_backend("cpu"), {"data": flat}, {"dtype": "bfloat16", "shape": [flat.size], "n": flat.size,
                                                        "format": "bf16"})
    return S.QuantizeFP8("e5m2").encode(frame).streams["data"]


def survey_e5m2(files: dict) -> list[dict]:
    """Each layer tensor quantized to E5M2 (as an FP8 KV cache would hold it), compressed alone
    with the shipped e5m2-kv codebook, its own Top-16 and the auto rule's."""
    rows = []
    for fname, tensors in files.items():
        for key, bits in tensors.items():
            q = e5m2_of(bits)
            row = {"file": fname, "tensor": key, "values": int(q.size)}
            own = kvzip.Codebook(choose_exponents(exponent_histogram(q, "e5m2")), "e5m2")
            for label, cb in (("default", None), ("own", own), ("auto", "auto")):
                info = kvzip.info(kvzip.compress(q, codebook=cb, dtype="e5m2"))
                row[f"ratio_{label}"] = info["ratio"]
            rows.append(row)
    return rows


def summary_e5m2(rows: list[dict]) -> list[dict]:
    out = []
    for fam in sorted({family(r["file"]) for r in rows}):
        sel = [r for r in rows if family(r["file"]) == fam]
        entry = {"family": fam, "tensors": len(sel)}
        for label in ("default", "own", "auto"):
            entry[f"{label}_min"] = round(min(r[f"ratio_{label}"] for r in sel), 4)
            entry[f"{label}_median"] = round(statistics.median(r[f"ratio_{label}"] for r in sel), 4)
        out.append(entry)
    return out


LARGE_LABELS = ("default", "own", "auto", "fixed", "auto/256", "auto/2048")


def variant(bits: np.ndarray, name: str, layer: int) -> np.ndarray:
    if name == "token-scaled":
        tokens = np.arange(bits.shape[-2])[:, None]
        return scale_pow2(bits, np.broadcast_to(tokens % 8 - 4, bits.shape))
    return kv_variant(bits, name, layer, seed=layer)


def large_tensors(tensors: dict, name: str):
    """(layout, size label, flat bits) of one file's variant: the concatenation, its prefixes, tiled."""
    parts = {k: variant(t, name, layer_of(k)) for k, t in sorted(tensors.items())}
    for layout in LAYOUTS:
        flat = np.concatenate([(p if layout == "head-major" else p.transpose(1, 0, 2)).reshape(-1)
                               for p in parts.values()])
        for k in range(1, 5):
            n = 3 * (1 << (18 + k)) + 4097
            if n < flat.size:
                yield layout, f"prefix k={k}", flat[:n]
        yield layout, "whole", flat
        yield layout, "tiled", np.resize(flat, TILED)


def survey_large(files: dict) -> list[dict]:
    rows = []
    for fname, tensors in files.items():
        t0 = time.perf_counter()
        for name in LARGE_VARIANTS:
            for layout, what, flat in large_tensors(tensors, name):
                plan = auto.sample_plan(flat.size)
                cbs = {"default": None, "own": codebook_of(exponent_histogram(flat, BF16)),
                       "auto": auto.auto_codebook(flat, "bf16"),
                       "fixed": codebook_of(runs_histogram(flat, plan.block, offsets=False)),
                       "auto/256": codebook_of(runs_histogram(flat, 8 * plan.block, offsets=True)),
                       "auto/2048": codebook_of(runs_histogram(flat, 64 * plan.block, offsets=True))}
                row = {"file": fname, "variant": name, "layout": layout, "size": what, "values": int(flat.size),
                       "block": plan.block, "runs": plan.blocks}
                done = {}  # ratio by codebook: most sampled codebooks are the own one
                for label, cb in cbs.items():
                    key = None if cb is None else cb.exponents
                    if key not in done:
                        done[key] = ratio_of(flat, cb)
                    row[f"ratio_{label}"], row[f"escapes_{label}"] = done[key]
                    # The ratio depends on the set of 16 only; samples often order near-equal counts
                    # differently, which changes the codes but not one byte count.
                    row[f"own_set_{label}"] = cb is not None and set(cb.exponents) == set(cbs["own"].exponents)
                rows.append(row)
        print(f"{fname}: large tensors in {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def gap(r: dict, label: str) -> float:
    """How far below the own codebook's ratio ``label``'s is, as a fraction (negative: above)."""
    return 1 - r[f"ratio_{label}"] / r["ratio_own"]


def family(fname: str) -> str:
    return fname.split("_")[0]


def summary(rows: list[dict]) -> list[dict]:
    out = []
    for fam in sorted({family(r["file"]) for r in rows}):
        for name in VARIANTS:
            sel = [r for r in rows if family(r["file"]) == fam and r["variant"] == name]
            if not sel:
                continue
            entry = {"family": fam, "variant": name, "tensors": len(sel)}
            for label in ("default", "own", "sampled", "auto"):
                ratios = [r[f"ratio_{label}"] for r in sel]
                entry[f"{label}_min"] = round(min(ratios), 4)
                entry[f"{label}_median"] = round(statistics.median(ratios), 4)
                entry[f"{label}_escapes_median"] = round(statistics.median(r[f"escapes_{label}"] for r in sel), 5)
            entry["sampled_vs_own_worst"] = round(min(r["ratio_sampled"] / r["ratio_own"] for r in sel), 5)
            entry["auto_gap_worst"] = max(gap(r, "auto") for r in sel)
            out.append(entry)
    return out


def summary_large(rows: list[dict]) -> list[dict]:
    out = []
    for fam in sorted({family(r["file"]) for r in rows}):
        for name in LARGE_VARIANTS:
            for layout in LAYOUTS:
                sel = [r for r in rows if family(r["file"]) == fam and r["variant"] == name and r["layout"] == layout]
                if not sel:
                    continue
                entry = {"family": fam, "variant": name, "layout": layout, "tensors": len(sel),
                         "own_min": round(min(r["ratio_own"] for r in sel), 4),
                         "default_min": round(min(r["ratio_default"] for r in sel), 4)}
                for label in LARGE_LABELS[2:]:
                    gaps = [gap(r, label) for r in sel]
                    entry[f"{label}_gap_worst"] = max(gaps)
                    entry[f"{label}_gap_median"] = statistics.median(gaps)
                    entry[f"{label}_own_set"] = sum(r[f"own_set_{label}"] for r in sel)
                out.append(entry)
    return out


def pct(x: float) -> str:
    return f"{100 * x:.3f} %"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "kv"))
    ap.add_argument("--stride", type=int, default=61,
                    help="sample every STRIDE-th value (default 61: prime, so no head dimension aliases it)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args(argv)
    for n in (3 * (1 << 22) + 4097, TILED):  # the ablation sampler is the rule itself at the rule's block
        flat = np.arange(n, dtype=np.uint16)
        runs = runs_histogram(flat, auto.sample_plan(n).block, offsets=True)
        assert np.array_equal(runs, auto.sample_histogram(flat, "bf16")), n
    t0 = time.perf_counter()
    files = {path.name: load(path) for path in sorted(Path(args.data).glob("*.safetensors"))}
    rows = survey_layers(files, args.stride)
    large = survey_large(files)
    e5m2 = survey_e5m2(files)
    table, table_large, table_e5m2 = summary(rows), summary_large(large), summary_e5m2(e5m2)
    import torch

    rule = {k: getattr(auto, k) for k in ("RUN_LENGTH", "ALIGN", "FULL_READ_BELOW", "MAX_SHIFT", "WEYL")}
    record = {"what": "ratios with the shipped, the tensor's own, a strided-sample and the auto rule's Top-16 "
                      "codebook, on layer tensors and on large (concatenated, tiled) tensors",
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "seconds": round(time.perf_counter() - t0, 1),
              "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine()},
              "versions": {"kvzip": kvzip.__version__, "numpy": np.__version__, "torch": torch.__version__,
                           "python": platform.python_version(), "commit": code_commit()},
              "data": args.data, "stride": args.stride, "auto_rule": rule,
              "summary": table, "summary_large": table_large, "summary_e5m2": table_e5m2, "rows": rows,
              "rows_large": large, "rows_e5m2": e5m2}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "codebook-survey-cpu.json").write_text(json.dumps(record, indent=1))
    print("\nLayer tensors (all read whole by the auto rule)")
    print("| family | variant | tensors | default min / median | own min / median | sampled min / median "
          "| auto min / median | sampled/own worst | auto gap worst | escapes default / own |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in table:
        print(f"| {e['family']} | {e['variant']} | {e['tensors']} | {e['default_min']} / {e['default_median']} "
              f"| {e['own_min']} / {e['own_median']} | {e['sampled_min']} / {e['sampled_median']} "
              f"| {e['auto_min']} / {e['auto_median']} | {e['sampled_vs_own_worst']} | {pct(e['auto_gap_worst'])} "
              f"| {e['default_escapes_median']:.2%} / {e['own_escapes_median']:.2%} |")
    print("\nE5M2 layer tensors (QuantizeFP8, one scale a tensor), ratio min / median")
    print("| family | tensors | shipped e5m2-kv | own | auto |\n|---|---|---|---|---|")
    for e in table_e5m2:
        print(f"| {e['family']} | {e['tensors']} | {e['default_min']} / {e['default_median']} "
              f"| {e['own_min']} / {e['own_median']} | {e['auto_min']} / {e['auto_median']} |")
    print("\nLarge tensors: gap to the own codebook's ratio, worst / median (how many tensors got the own exponent set)")
    print("| family | variant | layout | tensors | own min | default min | auto | fixed offset | auto/256 | auto/2048 |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for e in table_large:
        cells = " | ".join(f"{pct(e[f'{lab}_gap_worst'])} / {pct(e[f'{lab}_gap_median'])} ({e[f'{lab}_own_set']})"
                           for lab in LARGE_LABELS[2:])
        print(f"| {e['family']} | {e['variant']} | {e['layout']} | {e['tensors']} | {e['own_min']} "
              f"| {e['default_min']} | {cells} |")
    print(f"\n{time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
