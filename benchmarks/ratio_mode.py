"""The ratio mode (ChannelPack) on real KV, CPU: ratio per layer tensor against issue 28's targets,
bytes against the survey's layout formula, and encode/decode speed beside the speed mode.

    python benchmarks/ratio_mode.py [--data ../shared/data/kv] [--out benchmarks/results] [--repeat 5]

Every layer tensor ([heads, tokens, head_dim]) of every real KV file in DATA is compressed alone
with kvzip.compress(x, mode="ratio"), as BF16 and as E5M2 / E4M3 bits (ratio_mode_survey.quantize:
QuantizeFP8, one scale a tensor; the FP8 bits are the input, so raw = one byte a value), decoded
and checked bit for bit.  For each tensor the blob's length is compared with the survey's exact
count of the c2l-8 layout (ratio_mode_survey.fixed_code_size): the real blob holds the same
streams, and the difference must be the container's 16-byte stream alignment alone (both count
a 64-byte header).  The BF16 tensors are also compressed in kvzip.testing's adversarial variants
(kv_variant).

Speed: median of REPEAT timed calls (after one warm-up) of compress / decompress of one large
tensor, the prose file's layers stacked ([layers * 2 * heads, tokens, head_dim]: 47 MB of BF16 for
SmolLM2), and the sum over the per-layer calls, both modes, at the process's thread count.

Writes OUT/ratio-mode-cpu.json (date, machine, versions, the summary and every per-tensor row)
and prints the markdown tables of benchmarks/NOTES.md section r1.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import kvzip
from kvzip.bench_cpu import environment, median_seconds
from kvzip.testing import KV_VARIANTS, kv_variant

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ratio_mode_survey import FMT, TARGETS, WIDTH, contexts, family_of, fixed_code_size, histogram, load, lut_of, \
    quantize, ranked, split, text_of, write_result  # noqa: E402

ALIGN_SLACK = 15  # bytes of padding the container may add after each stream
STREAMS = 9       # a ratio blob's streams


def survey_bytes(q: np.ndarray, fmt: str) -> int:
    """The survey's exact byte count of the c2l-8 layout for raw bits q of fmt."""
    E, R = FMT[fmt]
    e, _ = split(q, fmt)
    ctx, n_ctx = contexts(q.shape, "channel")
    lut = lut_of(ranked(histogram(e, ctx, n_ctx, E)), 7, 8)
    return fixed_code_size(e, ctx, n_ctx, lut, 7, 8, E, R)["bytes"]


def roundtrip(q: np.ndarray, fmt: str, mode: str) -> int:
    blob = kvzip.compress(q, dtype=fmt, mode=mode)
    back = np.asarray(kvzip.decompress(blob)).view(q.dtype)
    if not np.array_equal(back, q):
        raise AssertionError(f"{fmt} {mode}: round trip differs")
    return int(blob.nbytes)


def speed(q: np.ndarray, fmt: str, mode: str, repeat: int) -> dict:
    blob = kvzip.compress(q, dtype=fmt, mode=mode)
    raw = q.nbytes
    enc = median_seconds(lambda: kvzip.compress(q, dtype=fmt, mode=mode), repeat)
    dec = median_seconds(lambda: kvzip.decompress(blob), repeat)
    return {"raw_bytes": int(raw), "ratio": raw / blob.nbytes, "encode_s": enc, "decode_s": dec,
            "encode_GBps": raw / enc / 1e9, "decode_GBps": raw / dec / 1e9}


def git(*cmd):
    try:
        return subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
    except OSError:
        return None


def subsets(rows: list):
    """(family, "all" or "held-out" (not prose), format, its rows, their summary row's first
    fields) for each non-empty subset of the unvaried (as-is) rows."""
    for fam in ("smollm2", "minilm"):
        for subset in ("all", "held-out"):
            for fmt in FMT:
                sel = [r for r in rows if r["family"] == fam and r["format"] == fmt and r["variant"] == "as-is"
                       and (subset == "all" or r["text"] != "prose")]
                if sel:
                    ratios = [r["ratio"] for r in sel]
                    yield fam, fmt, sel, {"family": fam, "subset": subset, "format": fmt, "tensors": len(sel),
                                          "min": float(np.min(ratios)), "median": float(np.median(ratios))}


def summarize(rows: list) -> list:
    return [{**head, "target": TARGETS[(fam, fmt)],
             "speed_min": float(np.min([r["speed_ratio"] for r in sel])),
             "survey_min": float(np.min([r["raw_bytes"] / r["survey_bytes"] for r in sel])),
             "over_survey_max": int(max(r["bytes"] - r["survey_bytes"] for r in sel))}
            for fam, fmt, sel, head in subsets(rows)]


def markdown(table: list, variants: list, speeds: list) -> str:
    lines = ["| family | files | fmt | n | target | ratio min / median | survey c2l-8 min | speed mode min | "
             "bytes over the survey (max) |", "|---|---|---|---|---|---|---|---|---|"]
    for t in table:
        mark = "**" if t["min"] >= t["target"] else ""
        lines.append(f"| {t['family']} | {t['subset']} | {t['format']} | {t['tensors']} | {t['target']:.2f} | "
                     f"{mark}{t['min']:.4f} / {t['median']:.4f}{mark} | {t['survey_min']:.4f} | {t['speed_min']:.4f} | "
                     f"{t['over_survey_max']} |")
    lines += ["", "BF16 variants (kvzip.testing.kv_variant), every layer tensor of every file:", "",
              "| family | variant | n | ratio min / median | speed mode min |", "|---|---|---|---|---|"]
    for v in variants:
        lines.append(f"| {v['family']} | {v['variant']} | {v['tensors']} | {v['min']:.4f} / {v['median']:.4f} | "
                     f"{v['speed_min']:.4f} |")
    lines += ["", "CPU speed (GB/s of raw input, median of the timed calls):", "",
              "| input | fmt | mode | ratio | encode GB/s | decode GB/s |", "|---|---|---|---|---|---|"]
    for s in speeds:
        lines.append(f"| {s['input']} | {s['format']} | {s['mode']} | {s['ratio']:.4f} | {s['encode_GBps']:.3f} | "
                     f"{s['decode_GBps']:.3f} |")
    return "\n".join(lines)


def setup(description: str, repeat: int):
    """(args, data, log, t0) of a mode benchmark: its command line (--data, --out, --repeat), the
    real KV files ({stem: {key: bits}}) and a log that stamps each line with the seconds since t0."""
    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--data", type=Path, default=here.parent.parent / "shared" / "data" / "kv")
    ap.add_argument("--out", type=Path, default=here / "results")
    ap.add_argument("--repeat", type=int, default=repeat)
    args = ap.parse_args()
    if not args.data.exists():
        args.data = Path("/work/shared/data/kv")
    t0 = time.time()
    log = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)  # noqa: E731
    return args, {f.stem: load(f) for f in sorted(args.data.glob("*.safetensors"))}, log, t0


def layer_rows(data: dict, mode: str, log, extra) -> list:
    """One row per layer tensor of every file in every format (BF16 also in each kv_variant),
    compressed alone in ``mode`` and checked lossless; ``extra(row, q, fmt)`` adds a benchmark's
    own fields to a row."""
    rows = []
    for fmt in FMT:
        for stem in sorted(data):
            for key in sorted(data[stem]):
                variants = KV_VARIANTS if fmt == "bf16" else ("as-is",)
                for k, variant in enumerate(variants):
                    q = quantize(kv_variant(data[stem][key], variant, layer=int(key[5:7]), seed=k), fmt)
                    raw = q.size * WIDTH[fmt] // 8
                    nbytes = roundtrip(q, fmt, mode)
                    row = {"file": stem, "family": family_of(stem), "text": text_of(stem), "key": key, "format": fmt,
                           "variant": variant, "shape": list(q.shape), "raw_bytes": raw, "bytes": nbytes,
                           "ratio": raw / nbytes}
                    extra(row, q, fmt)
                    rows.append(row)
        log(f"{fmt}: {sum(r['format'] == fmt for r in rows)} tensors round-tripped")
    return rows


def script_environment(script: str) -> dict:
    """kvzip.bench_cpu.environment() with the checkout's HEAD and the script's own commit."""
    env = environment()
    env["versions"].update({"git_head": git("rev-parse", "HEAD"),
                            "script_commit": git("log", "-1", "--format=%H", "--", script),
                            "script_modified": bool(git("status", "--porcelain", "--", script))})
    return env


def _ratio_fields(row: dict, q: np.ndarray, fmt: str) -> None:
    row["speed_ratio"] = row["raw_bytes"] / roundtrip(q, fmt, "speed")
    if row["variant"] == "as-is":
        row["survey_bytes"] = survey_bytes(q, fmt)
        # Same streams as the survey's layout: only the 16-byte alignment of each may differ.
        assert 0 <= row["bytes"] - row["survey_bytes"] <= ALIGN_SLACK * STREAMS, row


def main():
    args, data, log, t0 = setup(__doc__.split("\n")[0], repeat=5)
    rows = layer_rows(data, "ratio", log, _ratio_fields)

    variants = []
    for fam in ("smollm2", "minilm"):
        for variant in KV_VARIANTS:
            sel = [r for r in rows if r["family"] == fam and r["format"] == "bf16" and r["variant"] == variant]
            variants.append({"family": fam, "variant": variant, "tensors": len(sel),
                             "min": float(np.min([r["ratio"] for r in sel])),
                             "median": float(np.median([r["ratio"] for r in sel])),
                             "speed_min": float(np.min([r["speed_ratio"] for r in sel]))})

    speeds = []
    prose = data["smollm2-135m_prose_2048"]
    stacked = np.concatenate([prose[k] for k in sorted(prose)])
    one_file = [prose[k] for k in sorted(prose)]
    for fmt in FMT:
        big = quantize(stacked, fmt)
        layers = [quantize(b, fmt) for b in one_file]
        for mode in ("ratio", "speed"):
            s = speed(big, fmt, mode, args.repeat)
            speeds.append({"input": f"SmolLM2 prose, {len(one_file)} layer tensors stacked {list(big.shape)}",
                           "format": fmt, "mode": mode, **s})
            enc = sum(median_seconds(lambda q=q: kvzip.compress(q, dtype=fmt, mode=mode), args.repeat) for q in layers)
            blobs = [kvzip.compress(q, dtype=fmt, mode=mode) for q in layers]
            dec = sum(median_seconds(lambda b=b: kvzip.decompress(b), args.repeat) for b in blobs)
            raw = sum(q.nbytes for q in layers)
            speeds.append({"input": f"SmolLM2 prose, {len(layers)} calls of {list(layers[0].shape)}", "format": fmt,
                           "mode": mode, "raw_bytes": raw, "ratio": raw / sum(b.nbytes for b in blobs),
                           "encode_s": enc, "decode_s": dec, "encode_GBps": raw / enc / 1e9,
                           "decode_GBps": raw / dec / 1e9})
        log(f"{fmt}: timed")

    table = summarize(rows)
    md = markdown(table, variants, speeds)
    env = script_environment(Path(__file__).name)
    result = {"benchmark": "ratio_mode", **env, "data": str(args.data), "repeat": args.repeat,
              "targets": {f"{k[0]}/{k[1]}": v for k, v in TARGETS.items()}, "summary": table, "variants": variants,
              "speed": speeds, "markdown": md, "rows": rows, "runtime_s": round(time.time() - t0, 1)}
    write_result(args.out / "ratio-mode-cpu.json", result, md, log)


if __name__ == "__main__":
    main()
