"""The storage mode (ChannelRans) on real KV, CPU: ratio per layer tensor against issue 28's storage
target (>= 1.46x BF16 on held-out files), beside the conditional-entropy bound, the parts of a
blob, the choices (chunk, grouping, MIN_COUNT) measured, and encode/decode speed.

    python benchmarks/storage_mode.py [--data ../shared/data/kv] [--out benchmarks/results] [--repeat 3]

Every layer tensor ([heads, tokens, head_dim]) of every real KV file in DATA is compressed alone
with kvzip.compress(x, mode="storage"), as BF16 and as E5M2 / E4M3 bits (ratio_mode_survey.quantize:
QuantizeFP8, one scale a tensor; raw = one byte a value), decoded and checked bit for bit.  The
bound beside each ratio is ratio_mode_survey.entropy_bound: the exponent's entropy given its
channel (the tensor's own empirical distribution, free tables) plus the raw rest bits.  The BF16
tensors are also compressed in kvzip.testing's adversarial variants (kv_variant).

Choices: the held-out BF16 and E5M2 tensors again with other chunk sizes (the stage's parameter),
with the grouping forced to one table a channel / one table a tensor (choose_shift replaced), and
with other MIN_COUNT values (the module constant replaced for the run).

Speed: median of REPEAT timed calls (after one warm-up) of compress / decompress of the prose
file's layers stacked (47 MB of BF16 for SmolLM2) and the sum over the per-layer calls, storage
and ratio modes, at the process's thread count.

Writes OUT/storage-mode-cpu.json and prints the markdown tables of benchmarks/NOTES.md s1.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

import kvzip
from kvzip import container
from kvzip.channel_codebook import channels_of
from kvzip.bench_cpu import median_seconds
from kvzip.stages import channel_rans
from kvzip.testing import KV_VARIANTS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ratio_mode import layer_rows, roundtrip, script_environment, setup, subsets  # noqa: E402
from ratio_mode_survey import FMT, contexts, entropy_bound, family_of, quantize, split, text_of, write_result  # noqa: E402

TARGET_BF16 = 1.46
PARTS = {"rest": ("rest",), "exponents": ("words", "esc_exp"), "tables": ("tables",),
         "chunk fields": ("states", "word_count", "esc_count")}


def bound_bytes(q: np.ndarray, fmt: str) -> int:
    E, R = FMT[fmt]
    e, _ = split(q, fmt)
    ctx, n_ctx = contexts(q.shape, "channel")
    return entropy_bound(e, ctx, n_ctx, E, R)


def parts_of(blob) -> dict:
    """Bytes of a blob by part: header, the stream groups of PARTS, alignment padding."""
    u8 = bytes(np.asarray(blob))
    hdr = container.parse_header(u8, len(u8))
    sizes = {name: nb for name, _, _, nb in hdr.streams}
    if "words" not in sizes:
        return {"stored_raw": len(u8)}
    out = {"header": hdr.header_len}
    out.update({part: sum(sizes[s] for s in names) for part, names in PARTS.items()})
    out["padding"] = len(u8) - sum(out.values())
    return out


@contextmanager
def patched(obj, name, value):
    before = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, before)


def held_out(data, fmt):
    for stem in sorted(data):
        if text_of(stem) != "prose":
            for key in sorted(data[stem]):
                yield stem, key, quantize(data[stem][key], fmt)


def sweep(data, log) -> list:
    """Ratio min / median over the held-out tensors of each alternative choice."""
    alternatives = [("chunk", c, {"chunk": c}, None) for c in (4096, 16384, 65536, 262144)]
    alternatives += [("grouping", g, {}, (channel_rans, "choose_shift", f)) for g, f in
                     (("per channel", lambda hist, E: 0),
                      ("per tensor", lambda hist, E: hist.shape[0].bit_length() - 1))]
    alternatives += [("MIN_COUNT", k, {}, (channel_rans, "MIN_COUNT", k)) for k in (1, 2, 8, 32)]
    rows = []
    for fmt in ("bf16", "e5m2"):
        for what, value, kw, patch in alternatives:
            ratios = {}
            with patched(*patch) if patch else _nothing():
                for stem, key, q in held_out(data, fmt):
                    blob = kvzip.compress(q, dtype=fmt, mode="storage", **kw)
                    ratios.setdefault(family_of(stem), []).append(q.nbytes / blob.nbytes)
            for fam, r in ratios.items():
                rows.append({"choice": what, "value": value, "format": fmt, "family": fam, "tensors": len(r),
                             "min": float(np.min(r)), "median": float(np.median(r))})
        log(f"{fmt}: choices swept")
    return rows


@contextmanager
def _nothing():
    yield


def summarize(rows: list) -> list:
    return [{**head, "bound_min": float(np.min([r["bound_ratio"] for r in sel])),
             "bound_median": float(np.median([r["bound_ratio"] for r in sel])),
             "of_bound_min": float(np.min([r["ratio"] / r["bound_ratio"] for r in sel])),
             "ratio_mode_min": float(np.min([r["ratio_mode"] for r in sel]))}
            for _, _, sel, head in subsets(rows)]


def per_file(rows: list) -> list:
    out = []
    for stem in sorted({r["file"] for r in rows}):
        for fmt in FMT:
            sel = [r for r in rows if r["file"] == stem and r["format"] == fmt and r["variant"] == "as-is"]
            parts = {k: int(sum(r["parts"].get(k, 0) for r in sel)) for k in ("header", *PARTS, "padding")}
            out.append({"file": stem, "format": fmt, "tensors": len(sel),
                        "ratio": sum(r["raw_bytes"] for r in sel) / sum(r["bytes"] for r in sel),
                        "min": float(np.min([r["ratio"] for r in sel])),
                        "median": float(np.median([r["ratio"] for r in sel])),
                        "bound_min": float(np.min([r["bound_ratio"] for r in sel])),
                        "bound_median": float(np.median([r["bound_ratio"] for r in sel])),
                        "shifts": sorted({r["shift"] for r in sel}), "parts": parts})
    return out


def markdown(table, files, variants, choices, speeds) -> str:
    lines = ["| family | files | fmt | n | ratio min / median | bound min / median | ratio / bound (min) | "
             "ratio mode min |", "|---|---|---|---|---|---|---|---|"]
    for t in table:
        mark = "**" if t["format"] == "bf16" and t["min"] >= TARGET_BF16 else ""
        lines.append(f"| {t['family']} | {t['subset']} | {t['format']} | {t['tensors']} | {mark}{t['min']:.4f} / "
                     f"{t['median']:.4f}{mark} | {t['bound_min']:.4f} / {t['bound_median']:.4f} | "
                     f"{t['of_bound_min']:.4f} | {t['ratio_mode_min']:.4f} |")
    lines += ["", "Per file (every layer tensor alone; bytes summed over the file's tensors):", "",
              "| file | fmt | ratio min / median | bound min / median | shifts | header | rest | exponents | tables | "
              "chunk fields | padding |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for f in files:
        p = f["parts"]
        lines.append(f"| {f['file']} | {f['format']} | {f['min']:.4f} / {f['median']:.4f} | {f['bound_min']:.4f} / "
                     f"{f['bound_median']:.4f} | {f['shifts']} | {p['header']} | {p['rest']} | {p['exponents']} | "
                     f"{p['tables']} | {p['chunk fields']} | {p['padding']} |")
    lines += ["", "BF16 variants (kvzip.testing.kv_variant), every layer tensor of every file:", "",
              "| family | variant | n | ratio min / median |", "|---|---|---|---|"]
    for v in variants:
        lines.append(f"| {v['family']} | {v['variant']} | {v['tensors']} | {v['min']:.4f} / {v['median']:.4f} |")
    lines += ["", "Choices, held-out tensors (default: chunk 65536, grouping chosen, MIN_COUNT 4):", "",
              "| choice | value | fmt | family | ratio min / median |", "|---|---|---|---|---|"]
    for c in choices:
        lines.append(f"| {c['choice']} | {c['value']} | {c['format']} | {c['family']} | {c['min']:.4f} / "
                     f"{c['median']:.4f} |")
    lines += ["", "CPU speed (MB/s of raw input, median of the timed calls):", "",
              "| input | fmt | mode | ratio | encode MB/s | decode MB/s |", "|---|---|---|---|---|---|"]
    for s in speeds:
        lines.append(f"| {s['input']} | {s['format']} | {s['mode']} | {s['ratio']:.4f} | {s['encode_MBps']:.0f} | "
                     f"{s['decode_MBps']:.0f} |")
    return "\n".join(lines)


def timed(qs, fmt, mode, repeat) -> dict:
    blobs = [kvzip.compress(q, dtype=fmt, mode=mode) for q in qs]
    enc = sum(median_seconds(lambda q=q: kvzip.compress(q, dtype=fmt, mode=mode), repeat) for q in qs)
    dec = sum(median_seconds(lambda b=b: kvzip.decompress(b), repeat) for b in blobs)
    raw = sum(q.nbytes for q in qs)
    return {"raw_bytes": raw, "ratio": raw / sum(b.nbytes for b in blobs), "encode_s": enc, "decode_s": dec,
            "encode_MBps": raw / enc / 1e6, "decode_MBps": raw / dec / 1e6}


def _storage_fields(row: dict, q: np.ndarray, fmt: str) -> None:
    if row["variant"] != "as-is":
        return
    blob = kvzip.compress(q, dtype=fmt, mode="storage")
    row["parts"] = parts_of(blob)
    row["shift"] = int(channel_rans.choose_shift(
        channel_rans.channel_rans_cpu.histogram(q.reshape(-1), kvzip.get_format(fmt), channels_of(q.shape)),
        FMT[fmt][0]))
    row["bound_ratio"] = row["raw_bytes"] / bound_bytes(q, fmt)
    row["ratio_mode"] = row["raw_bytes"] / roundtrip(q, fmt, "ratio")


def main():
    args, data, log, t0 = setup(__doc__.split("\n")[0], repeat=3)
    rows = layer_rows(data, "storage", log, _storage_fields)

    variants = []
    for fam in ("smollm2", "minilm"):
        for variant in KV_VARIANTS:
            sel = [r["ratio"] for r in rows if r["family"] == fam and r["format"] == "bf16" and r["variant"] == variant]
            variants.append({"family": fam, "variant": variant, "tensors": len(sel), "min": float(np.min(sel)),
                             "median": float(np.median(sel))})
    choices = sweep(data, log)

    speeds = []
    prose = data["smollm2-135m_prose_2048"]
    layers = [prose[k] for k in sorted(prose)]
    for fmt in FMT:
        qs = [quantize(b, fmt) for b in layers]
        big = np.concatenate(qs)
        for mode in ("storage", "ratio"):
            speeds.append({"input": f"SmolLM2 prose, {len(qs)} layer tensors stacked {list(big.shape)}", "format": fmt,
                           "mode": mode, **timed([big], fmt, mode, args.repeat)})
            speeds.append({"input": f"SmolLM2 prose, {len(qs)} calls of {list(qs[0].shape)}", "format": fmt,
                           "mode": mode, **timed(qs, fmt, mode, args.repeat)})
        log(f"{fmt}: timed")

    table, files = summarize(rows), per_file(rows)
    md = markdown(table, files, variants, choices, speeds)
    env = script_environment(Path(__file__).name)
    result = {"benchmark": "storage_mode", **env, "data": str(args.data), "repeat": args.repeat,
              "target_bf16": TARGET_BF16, "summary": table, "files": files, "variants": variants, "choices": choices,
              "speed": speeds, "markdown": md, "rows": rows, "runtime_s": round(time.time() - t0, 1)}
    write_result(args.out / "storage-mode-cpu.json", result, md, log)


if __name__ == "__main__":
    main()
