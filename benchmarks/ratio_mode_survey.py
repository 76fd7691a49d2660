"""Ratio mode: which exponent code can reach the issue's targets, measured exactly per layer tensor
on the CPU (sizes only: the bytes are the GPU's; no speeds).

    python benchmarks/ratio_mode_survey.py [--data ../shared/data/kv] [--out benchmarks/results]

Every layer tensor ([heads, tokens, head_dim]) of every real KV file in DATA is compressed alone,
as BF16 and as E5M2 / E4M3 (kvzip's QuantizeFP8 stage, one scale per tensor: amax / 57344 or
amax / 448).  The sign+mantissa bits (the "rest", R = 8 / 3 / 4 bits) are kept raw in every
scheme; only the E-bit exponent (E = 8 / 5 / 4) is coded.  Sizes are exact byte counts of a
decodable layout (below) except the two columns labelled "estimate" and "bound".

Schemes (chunks of 4096 values; a 64-byte header in each of ours, as kvzip's compact header):
  baseline     kvzip.compress(bits, dtype=fmt, codebook="auto"), len(blob).
  t8           per-tensor Top-8 (by count in the tensor), fixed 3-bit codes + escapes.
  c8           per-channel Top-8 (channel = index on the last axis), 8 B of codebook a channel.
  hc8          per (head, channel) Top-8, 8 B a (head, channel).
  c8-cal/hc8-cal  c8 / hc8 with codebooks from the same layer tensor of the family's prose file,
               applied to the held-out (code / html) files; the codebook is still paid for in the
               header (as if stored).
  t2l / c2l / hc2l  two-level fixed code, per tensor / channel / (head, channel): 3-bit code,
               0..6 = the 7 dominant exponents, 7 = "a 4-bit nibble follows, selecting one of the
               next 16"; escapes beyond those 23.  23 B of tables a context.  (E4M3 has only 16
               exponents: 7 + 9, still a 4-bit second level, no escapes.)
  c2l-8        as c2l with a 3-bit second level (7 + 8 exponents, 15 B a channel).
  rans-est     "rANS model (estimate)": per-channel static model, frequencies quantized to 12 bits
               (each present symbol >= 1/4096), payload sum of -log2(q/4096) bits per chunk rounded
               up to bytes, + 3 B per present symbol per channel (symbol + 12-bit frequency) + 1 B
               a channel, + per chunk 32 interleaved lanes x 4 B state + a 4 B chunk offset.
  bound-t / bound-c  empirical entropy of the exponent per tensor / per channel + raw rest bits
               ("bound": no tables, no chunking; not a code).

Layout of the fixed-code schemes (t8, c8, hc8, t2l, c2l), which the self-check builds as bytes
and decodes: header 64 | tables (n_ctx x (8 | 7 + 16) B) | esc_count uint16 per chunk (0xFFFF =
plane-coded) | [two-level: nib_count uint16 per chunk] | code plane (3 bits a value, 1536 B a
full chunk: fixed-size, so chunk c's codes start at c * 1536) | rest plane (R bits a value) |
[nibbles: 4 bits a secondary hit, per chunk rounded up to a byte] | escape positions (uint16,
in chunk) | escape exponents (uint8) | exp_high (E - 3 bits a value, plane-coded chunks only).
A listed chunk costs 3 B an escape (+ its nibbles); a chunk is plane-coded (its code plane holds
the exponent's low 3 bits, exp_high the rest: (E - 3) * 512 B) when that is cheaper, as kvzip's
SplitZip does with 4-bit codes.  Escaped values get code 0 (the escape overrides it).

Writes OUT/ratio-mode-survey-cpu.json (date, machine, versions, every per-tensor row) and prints
the markdown tables that benchmarks/NOTES.md section r0 carries.
"""
from __future__ import annotations

import argparse
import json
import platform
import struct
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

import kvzip

CHUNK = 4096
HEADER = 64
CODE_BITS = 3
FMT = {"bf16": (8, 8), "e5m2": (5, 3), "e4m3": (4, 4)}  # format: (E exponent bits, R rest bits)
WIDTH = {"bf16": 16, "e5m2": 8, "e4m3": 8}
LANES, LANE_STATE, CHUNK_OFFSET = 32, 4, 4  # the rANS estimate's per-chunk overhead
PROB_BITS = 12
SCHEMES = ("baseline", "t8", "c8", "hc8", "c8-cal", "hc8-cal", "t2l", "c2l", "hc2l", "c2l-8", "rans-est", "bound-t",
           "bound-c")
# The fixed-code schemes: (name, context, primary codes, second-level exponents)
FIXED = (("t8", "tensor", 8, 0), ("c8", "channel", 8, 0), ("hc8", "head-channel", 8, 0), ("t2l", "tensor", 7, 16),
         ("c2l", "channel", 7, 16), ("hc2l", "head-channel", 7, 16), ("c2l-8", "channel", 7, 8))
LABELS = {
    "baseline": "0 baseline kvzip auto", "t8": "1 tensor Top-8", "c8": "2 channel Top-8",
    "hc8": "2 head+channel Top-8", "c8-cal": "2 channel Top-8, prose-calibrated",
    "hc8-cal": "2 head+channel Top-8, prose-calibrated", "t2l": "3 two-level 7+16, tensor",
    "c2l": "3 two-level 7+16, channel", "hc2l": "3 two-level 7+16, head+channel",
    "c2l-8": "3 two-level 7+8 (3-bit second level), channel", "rans-est": "4 rANS model (estimate)",
    "bound-t": "5 bound, tensor entropy", "bound-c": "5 bound, channel entropy",
}
TARGETS = {("smollm2", "bf16"): 1.42, ("minilm", "bf16"): 1.40, ("smollm2", "e5m2"): 1.22,
           ("minilm", "e5m2"): 1.22, ("smollm2", "e4m3"): 1.10, ("minilm", "e4m3"): 1.10}


# ---------------------------------------------------------------------------------------- data
def load(path: Path) -> dict:
    """{name: uint16 bits of shape [heads, tokens, head_dim]} of a BF16 .safetensors file."""
    import torch
    from safetensors.torch import load_file

    return {k: t.contiguous().view(torch.int16).numpy().view(np.uint16) for k, t in load_file(str(path)).items()}


def quantize(bits: np.ndarray, fmt: str) -> np.ndarray:
    """bits (BF16) quantized to fmt by kvzip's QuantizeFP8 stage, one scale for the tensor."""
    if fmt == "bf16":
        return bits
    from kvzip import stages as S
    from kvzip.backends import get_backend
    from kvzip.frame import Frame

    n = bits.size
    fr = S.QuantizeFP8(fmt, "tensor").encode(Frame(get_backend("cpu"), {"data": bits.reshape(-1)},
                                                   {"dtype": "bfloat16", "shape": [n], "n": n, "format": "bf16"}))
    return np.ascontiguousarray(fr.streams["data"]).reshape(bits.shape)


def split(q: np.ndarray, fmt: str):
    """(exponent, rest) of raw bits q (flat, int64 exponent for indexing)."""
    E, R = FMT[fmt]
    flat = q.reshape(-1).astype(np.int64)
    m = R - 1
    e = (flat >> m) & ((1 << E) - 1)
    rest = ((flat >> (E + m)) << m) | (flat & ((1 << m) - 1))
    return e, rest


def contexts(shape, mode: str) -> tuple[np.ndarray, int]:
    """Context (codebook) index of every value of a C-ordered [H, T, D] tensor, and their count."""
    H, T, D = shape
    i = np.arange(H * T * D, dtype=np.int64)
    if mode == "tensor":
        return np.zeros_like(i), 1
    if mode == "channel":
        return i & (D - 1) if D & (D - 1) == 0 else i % D, D
    if mode == "head-channel":
        return (i // (T * D)) * D + i % D, H * D
    raise ValueError(mode)


def histogram(e, ctx, n_ctx, E):
    return np.bincount(ctx * (1 << E) + e, minlength=n_ctx << E).reshape(n_ctx, 1 << E)


def ranked(hist):
    """Exponents of each context by count, most frequent first (ties: lower exponent first)."""
    return np.argsort(-hist, axis=1, kind="stable")


def lut_of(order, kp, ks):
    """lut[ctx, e] = class: 0..kp-1 primary code, kp..kp+ks-1 secondary slot, -1 escape."""
    lut = np.full(order.shape, -1, dtype=np.int64)
    rows = np.arange(order.shape[0])[:, None]
    lut[rows, order[:, :kp + ks]] = np.arange(kp + ks)
    return lut


# ------------------------------------------------------------------------------ exact sizes
def chunk_sums(mask, n):
    """Per-chunk count of a boolean per-value mask."""
    c = -(-n // CHUNK)
    pad = np.zeros(c * CHUNK, dtype=np.int64)
    pad[:n] = mask
    return pad.reshape(c, CHUNK).sum(1)


def chunk_lengths(n):
    c = -(-n // CHUNK)
    lens = np.full(c, CHUNK, dtype=np.int64)
    lens[-1] = n - (c - 1) * CHUNK
    return lens


def sec_bits(ks):
    """Width of the second-level index: 4 bits for 16 (or E4M3's 9) more exponents, 3 for 8."""
    return (ks - 1).bit_length() if ks else 0


def fixed_code_plan(e, ctx, lut, kp, ks, E):
    """Per value class, and per chunk (escapes, secondary hits, plane-coded?)."""
    n = e.size
    cls = lut[ctx, e]
    esc = chunk_sums(cls < 0, n)
    sec = chunk_sums(cls >= kp, n) if ks else np.zeros_like(esc)
    lens = chunk_lengths(n)
    listed = -(-sec * sec_bits(ks) // 8) + 3 * esc
    plane_cost = -(-lens * (E - CODE_BITS) // 8)
    plane = listed > plane_cost
    return cls, esc, sec, plane, listed, plane_cost


def fixed_code_size(e, ctx, n_ctx, lut, kp, ks, E, R) -> dict:
    """Exact bytes of the fixed-code layout (module docstring), with its parts."""
    n = e.size
    _, esc, sec, plane, listed, plane_cost = fixed_code_plan(e, ctx, lut, kp, ks, E)
    lens = chunk_lengths(n)
    parts = {
        "header": HEADER,
        "tables": n_ctx * (kp + ks),
        "chunk_fields": 2 * lens.size * (2 if ks else 1),
        "codes": int((-(-lens * CODE_BITS // 8)).sum()),
        "rest": -(-n * R // 8),
        "escapes": int(np.where(plane, plane_cost, listed).sum()),
    }
    return {"bytes": int(sum(parts.values())), "parts": parts, "escape_rate": float(esc[~plane].sum() / n),
            "plane_chunks": int(plane.sum())}


def quantized_freqs(counts):
    """counts (one context) -> 12-bit frequencies summing to 4096, >= 1 for every present symbol."""
    total = 1 << PROB_BITS
    present = counts > 0
    q = np.where(present, np.maximum(1, (counts * total) // max(1, counts.sum())), 0)
    diff = total - q.sum()
    while diff != 0:  # give / take the difference at the largest frequencies (>= 2 when taking)
        j = int(np.argmax(q))
        step = diff if diff > 0 else max(diff, 1 - q[j])
        q[j] += step
        diff -= step
    return q


def rans_estimate(e, ctx, n_ctx, E, R) -> dict:
    n = e.size
    hist = histogram(e, ctx, n_ctx, E)
    q = np.stack([quantized_freqs(h) for h in hist])
    cost = PROB_BITS - np.log2(np.where(q > 0, q, 1).astype(np.float64))  # bits a symbol
    bits = cost[ctx, e]
    c = -(-n // CHUNK)
    pad = np.zeros(c * CHUNK)
    pad[:n] = bits
    payload = int(np.ceil(pad.reshape(c, CHUNK).sum(1) / 8).sum())
    parts = {"header": HEADER, "tables": int(3 * (hist > 0).sum() + n_ctx),
             "chunk_fields": c * (LANES * LANE_STATE + CHUNK_OFFSET), "payload": payload, "rest": -(-n * R // 8)}
    return {"bytes": int(sum(parts.values())), "parts": parts}


def entropy_bound(e, ctx, n_ctx, E, R) -> int:
    hist = histogram(e, ctx, n_ctx, E).astype(np.float64)
    tot = hist.sum(1, keepdims=True)
    p = np.where(hist > 0, hist / np.maximum(tot, 1), 1.0)
    bits = -(hist * np.log2(p)).sum()
    return int(np.ceil((bits + e.size * R) / 8))


# -------------------------------------------------------------- reference encoder / decoder
def pack_bits(vals, w):
    if w == 0 or len(vals) == 0:
        return b""
    v = np.asarray(vals, dtype=np.uint32)
    bits = ((v[:, None] >> np.arange(w, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1), bitorder="little").tobytes()


def unpack_bits(buf, w, n):
    bits = np.unpackbits(np.frombuffer(buf, dtype=np.uint8), bitorder="little")[:n * w].reshape(n, w)
    return (bits.astype(np.int64) << np.arange(w)).sum(1)


MODES = ("tensor", "channel", "head-channel")


def encode(e, rest, shape, mode, order, kp, ks, E, R) -> bytes:
    """The fixed-code layout of the module docstring, as bytes."""
    ctx, n_ctx = contexts(shape, mode)
    lut = lut_of(order, kp, ks)
    cls, esc, sec, plane, _, _ = fixed_code_plan(e, ctx, lut, kp, ks, E)
    n = e.size
    lens = chunk_lengths(n)
    H, T, D = shape
    head = struct.pack("<4sBBBBBBIIII", b"KVRM", MODES.index(mode), E, R, kp, ks, CODE_BITS, n, H, T, D)
    out = [head.ljust(HEADER, b"\0")]
    tables = order[:, :kp + ks].astype(np.uint8)
    out.append(tables[:, :kp].tobytes() + (tables[:, kp:].tobytes() if ks else b""))
    out.append(np.where(plane, 0xFFFF, esc).astype("<u2").tobytes())
    if ks:
        out.append(np.where(plane, 0, sec).astype("<u2").tobytes())
    codes, nibbles, positions, escexp, high = [], [], [], [], []
    for c, ln in enumerate(lens):
        s = slice(c * CHUNK, c * CHUNK + ln)
        ec, kc = e[s], cls[s]
        if plane[c]:
            codes.append(pack_bits(ec & 7, CODE_BITS))
            high.append(pack_bits(ec >> CODE_BITS, E - CODE_BITS))
            continue
        code = np.where(kc < 0, 0, np.minimum(kc, kp if ks else kp - 1))
        codes.append(pack_bits(code, CODE_BITS))
        if ks:
            nibbles.append(pack_bits(kc[kc >= kp] - kp, sec_bits(ks)))
        where = np.flatnonzero(kc < 0)
        positions.append(where.astype("<u2").tobytes())
        escexp.append(ec[where].astype(np.uint8).tobytes())
    out += [b"".join(codes), pack_bits(rest, R), b"".join(nibbles), b"".join(positions), b"".join(escexp), b"".join(high)]
    return b"".join(out)


def decode(blob: bytes):
    """(exponents, rest) from a blob of encode(), reading nothing but its bytes."""
    magic, m, E, R, kp, ks, cb, n, H, T, D = struct.unpack_from("<4sBBBBBBIIII", blob)
    assert magic == b"KVRM" and cb == CODE_BITS
    mode = MODES[m]
    ctx, n_ctx = contexts((H, T, D), mode)
    p = HEADER
    prim = np.frombuffer(blob, np.uint8, n_ctx * kp, p).reshape(n_ctx, kp).astype(np.int64)
    p += n_ctx * kp
    secd = np.frombuffer(blob, np.uint8, n_ctx * ks, p).reshape(n_ctx, ks).astype(np.int64) if ks else None
    p += n_ctx * ks
    lens = chunk_lengths(n)
    C = lens.size
    cnt = np.frombuffer(blob, "<u2", C, p).astype(np.int64)
    p += 2 * C
    nib = np.frombuffer(blob, "<u2", C, p).astype(np.int64) if ks else np.zeros(C, np.int64)
    p += 2 * C if ks else 0
    code_bytes = -(-lens * CODE_BITS // 8)
    code_at = p + np.concatenate([[0], np.cumsum(code_bytes)])
    p = int(code_at[-1])
    rest = unpack_bits(blob[p:p + -(-n * R // 8)], R, n)
    p += -(-n * R // 8)
    plane = cnt == 0xFFFF
    k = np.where(plane, 0, cnt)
    nib_at = p + np.concatenate([[0], np.cumsum(-(-nib * sec_bits(ks) // 8))])
    p = int(nib_at[-1])
    pos_at = p + np.concatenate([[0], np.cumsum(2 * k)])
    p = int(pos_at[-1])
    exp_at = p + np.concatenate([[0], np.cumsum(k)])
    p = int(exp_at[-1])
    hb = np.where(plane, -(-lens * (E - CODE_BITS) // 8), 0)
    high_at = p + np.concatenate([[0], np.cumsum(hb)])
    assert int(high_at[-1]) == len(blob), "trailing or missing bytes"
    e = np.empty(n, np.int64)
    for c, ln in enumerate(lens):  # every chunk decodes from its own offsets (prefix sums of fields)
        s0 = c * CHUNK
        code = unpack_bits(blob[code_at[c]:code_at[c + 1]], CODE_BITS, ln)
        cx = ctx[s0:s0 + ln]
        if plane[c]:
            e[s0:s0 + ln] = code | (unpack_bits(blob[high_at[c]:high_at[c + 1]], E - CODE_BITS, ln) << CODE_BITS)
            continue
        if ks:
            out = prim[cx, np.minimum(code, kp - 1)]
            hit = code == kp
            assert hit.sum() == nib[c]
            ns = unpack_bits(blob[nib_at[c]:nib_at[c + 1]], sec_bits(ks), int(hit.sum()))
            out[hit] = secd[cx[hit], ns]
        else:
            out = prim[cx, code]
        pos = np.frombuffer(blob, "<u2", k[c], pos_at[c]).astype(np.int64)
        out[pos] = np.frombuffer(blob, np.uint8, k[c], exp_at[c])
        e[s0:s0 + ln] = out
    return e, rest


def self_check(bits_bf16: np.ndarray, log) -> list:
    """Schemes 1-3 encoded and decoded bit-exactly for one tensor per format, and a copy with one
    chunk's exponents scrambled (so that chunk is plane-coded); blob length == the formula's."""
    checked = []
    rng = np.random.default_rng(0)
    for fmt in FMT:
        E, R = FMT[fmt]
        q = quantize(bits_bf16, fmt)
        e0, rest = split(q, fmt)
        e1 = e0.copy()
        e1[CHUNK:2 * CHUNK] = rng.integers(0, 1 << E, CHUNK)
        for label, e in (("real", e0), ("scrambled chunk 1", e1)):
            for name, mode, kp, ks in FIXED:
                ks = min(ks, (1 << E) - kp)
                ctx, n_ctx = contexts(q.shape, mode)
                order = ranked(histogram(e, ctx, n_ctx, E))
                blob = encode(e, rest, q.shape, mode, order, kp, ks, E, R)
                size = fixed_code_size(e, ctx, n_ctx, lut_of(order, kp, ks), kp, ks, E, R)
                d_e, d_rest = decode(blob)
                assert np.array_equal(d_e, e) and np.array_equal(d_rest, rest), (fmt, name, label)
                assert len(blob) == size["bytes"], (fmt, name, label, len(blob), size["bytes"])
                if label != "real" and size["plane_chunks"] == 0:
                    assert ks and kp + ks == 1 << E, (fmt, name)  # only a code without escapes has none
                checked.append({"format": fmt, "scheme": name, "input": label, "bytes": len(blob),
                                "plane_chunks": size["plane_chunks"], "escape_rate": size["escape_rate"]})
        log(f"self-check {fmt}: schemes {' '.join(f[0] for f in FIXED)} decode bit-exactly, blob bytes == formula")
    return checked


# ------------------------------------------------------------------------------------ survey
def measure(q, fmt, cal_e=None):
    """{scheme: bytes} for one tensor q (raw bits) of fmt; cal_e: (exponents, shape) of the prose
    tensor of the same layer and K/V, whose codebooks the "-cal" schemes apply to q."""
    E, R = FMT[fmt]
    e, _ = split(q, fmt)
    out = {"baseline": int(len(kvzip.compress(q, dtype=fmt, codebook="auto")))}
    extra = {}
    for name, mode, kp, ks in FIXED:
        ks = min(ks, (1 << E) - kp)  # E4M3 has 16 exponents: 7 + 9, no escapes
        ctx, n_ctx = contexts(q.shape, mode)
        s = fixed_code_size(e, ctx, n_ctx, lut_of(ranked(histogram(e, ctx, n_ctx, E)), kp, ks), kp, ks, E, R)
        out[name] = s["bytes"]
        extra[name] = {"escape_rate": s["escape_rate"], "plane_chunks": s["plane_chunks"], "parts": s["parts"]}
        if cal_e is not None and name in ("c8", "hc8"):
            cal_ctx, _ = contexts(cal_e[1], mode)  # the prose tensor's own shape (more tokens)
            lut = lut_of(ranked(histogram(cal_e[0], cal_ctx, n_ctx, E)), kp, ks)
            s = fixed_code_size(e, ctx, n_ctx, lut, kp, ks, E, R)
            out[name + "-cal"] = s["bytes"]
            extra[name + "-cal"] = {"escape_rate": s["escape_rate"], "plane_chunks": s["plane_chunks"]}
    ctx, n_ctx = contexts(q.shape, "channel")
    r = rans_estimate(e, ctx, n_ctx, E, R)
    out["rans-est"] = r["bytes"]
    extra["rans-est"] = {"parts": r["parts"]}
    out["bound-t"] = entropy_bound(e, np.zeros_like(ctx), 1, E, R)
    out["bound-c"] = entropy_bound(e, ctx, n_ctx, E, R)
    return out, extra


def family_of(name):
    return "smollm2" if name.startswith("smollm2") else "minilm"


def text_of(name):
    return name.split("_")[1]


def summarize(rows):
    table = []
    for fam in ("smollm2", "minilm"):
        for subset in ("all", "held-out"):
            for fmt in FMT:
                sel = [r for r in rows if r["family"] == fam and r["format"] == fmt
                       and (subset == "all" or r["text"] != "prose")]
                if not sel:
                    continue
                cell = {}
                for s in SCHEMES:
                    vals = [r["ratio"][s] for r in sel if s in r["ratio"]]
                    if vals:
                        cell[s] = {"min": float(np.min(vals)), "median": float(np.median(vals)), "n": len(vals)}
                table.append({"family": fam, "subset": subset, "format": fmt, "tensors": len(sel),
                              "target": TARGETS[(fam, fmt)], "schemes": cell})
    return table


def markdown(table):
    cols = [s for s in SCHEMES if s not in ("c8-cal", "hc8-cal")]
    lines = ["Ratio min / median over layer tensors (each alone; " + ", ".join(f"{s} = {LABELS[s]}" for s in SCHEMES) + ")", ""]
    lines.append("| family | files | fmt | n | target | " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * (5 + len(cols)))
    for t in table:
        cells = []
        for s in cols:
            c = t["schemes"].get(s)
            mark = "**" if c and s not in ("bound-t", "bound-c") and c["min"] >= t["target"] else ""
            cells.append(f"{mark}{c['min']:.4f} / {c['median']:.4f}{mark}" if c else "-")
        lines.append(f"| {t['family']} | {t['subset']} | {t['format']} | {t['tensors']} | {t['target']:.2f} | " + " | ".join(cells) + " |")
    lines += ["", "Bold: min >= target.  Prose-calibrated codebooks on the held-out files (code, html):", ""]
    lines.append("| family | fmt | n | c8 own | c8 prose-cal | hc8 own | hc8 prose-cal |")
    lines.append("|---|---|---|---|---|---|---|")
    for t in table:
        if t["subset"] != "held-out":
            continue
        c = t["schemes"]
        lines.append(f"| {t['family']} | {t['format']} | {t['tensors']} | " + " | ".join(
            f"{c[s]['min']:.4f} / {c[s]['median']:.4f}" for s in ("c8", "c8-cal", "hc8", "hc8-cal")) + " |")
    return "\n".join(lines)


def versions():
    import ml_dtypes
    import safetensors
    import torch

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], capture_output=True, text=True, cwd=Path(__file__).parent).stdout.strip()
        except OSError:
            return None

    me = Path(__file__).name
    return {"python": sys.version.split()[0], "numpy": np.__version__, "torch": torch.__version__,
            "ml_dtypes": ml_dtypes.__version__, "safetensors": safetensors.__version__,
            "kvzip": kvzip.__version__, "git_head": git("rev-parse", "HEAD"),
            "script_commit": git("log", "-1", "--format=%H", "--", me),  # the last commit of this script
            "script_modified": bool(git("status", "--porcelain", "--", me))}


def main():
    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=here.parent.parent / "shared" / "data" / "kv")
    ap.add_argument("--out", type=Path, default=here / "results")
    args = ap.parse_args()
    if not args.data.exists():
        args.data = Path("/work/shared/data/kv")
    t0 = time.time()
    log = lambda msg: print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)  # noqa: E731

    files = sorted(args.data.glob("*.safetensors"))
    data = {f.stem: load(f) for f in files}
    first = data[sorted(data)[0]]
    checks = self_check(first[sorted(first)[0]], log)

    rows = []
    for fmt in FMT:
        prose_e = {}  # (family, key) -> exponents of the prose tensor in fmt
        for stem, tensors in data.items():
            if text_of(stem) == "prose":
                for key, bits in tensors.items():
                    prose_e[(family_of(stem), key)] = (split(quantize(bits, fmt), fmt)[0], bits.shape)
        for stem in sorted(data):
            fam, text = family_of(stem), text_of(stem)
            for key in sorted(data[stem]):
                bits = data[stem][key]
                q = quantize(bits, fmt)
                cal = prose_e.get((fam, key)) if text != "prose" else None
                sizes, extra = measure(q, fmt, cal)
                raw = bits.size * WIDTH[fmt] // 8
                rows.append({"file": stem, "family": fam, "text": text, "key": key, "format": fmt,
                             "shape": list(bits.shape), "raw_bytes": raw, "bytes": sizes,
                             "ratio": {s: raw / b for s, b in sizes.items()}, "detail": extra})
        log(f"{fmt}: {sum(r['format'] == fmt for r in rows)} layer tensors")

    table = summarize(rows)
    md = markdown(table)
    result = {
        "benchmark": "ratio_mode_survey", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": __import__("os").cpu_count()},
        "versions": versions(), "data": str(args.data), "chunk": CHUNK, "header_bytes": HEADER,
        "schemes": LABELS, "targets": {f"{k[0]}/{k[1]}": v for k, v in TARGETS.items()},
        "rans_estimate": {"prob_bits": PROB_BITS, "lanes": LANES, "lane_state_bytes": LANE_STATE,
                          "chunk_offset_bytes": CHUNK_OFFSET, "table_bytes_per_symbol": 3},
        "self_check": checks, "summary": table, "markdown": md, "rows": rows,
        "runtime_s": round(time.time() - t0, 1),
    }
    write_result(args.out / "ratio-mode-survey-cpu.json", result, md, log)



def write_result(path: Path, result: dict, md: str, log) -> None:
    """Write a survey's result JSON at path (its folder made) and print its markdown table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {path}")
    print()
    print(md)

if __name__ == "__main__":
    main()
