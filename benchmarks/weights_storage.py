"""The weights storage level (kvzip/weights/storage.py) on real BF16 weights, on the CPU: ratio
overall and per matrix, what the 12-bit code-length limit costs, encode and decode MB/s with all
cores and one, the same code on FP32 and FP16 copies of the weights beside kvzip's KV codec, and
the checkpoint command's file-to-file speed.

    python benchmarks/weights_storage.py [--weights FILE.safetensors] [--repeat 5] [--out DIR]

Input: every BF16 tensor of --weights (default: ../shared/data/weights/minilm-l6_weights_bf16
.safetensors beside the clone, 38 matrices of all-MiniLM-L6-v2).  MB/s are of the tensors' raw
bytes over wall time, median of --repeat runs after a warm-up.  The FP32 copy is each weight
widened, its 16 low mantissa bits random (what the exponent code keeps raw cannot help it); the
FP16 copy is each weight rounded to FP16.  Writes DIR/weights-storage-cpu.json (machine,
versions and date inside, kvzip.bench_cpu.environment()) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

import kvzip
from kvzip import files
from kvzip.bench_cpu import environment, median_seconds
from kvzip.cpu_parallel import available_cores, threads
from kvzip.weights import checkpoint, storage

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WEIGHTS = ROOT.parent / "shared" / "data" / "weights" / "minilm-l6_weights_bf16.safetensors"
LIMITS = (8, 9, 10, 11, 12, 13, 14, 16)


def bf16_tensors(path: Path) -> dict:
    """{name: (shape, bytes)} of the BF16 tensors of a .safetensors file."""
    st = files.read_safetensors(path)
    out = {}
    for name, e in st.entries.items():
        if e["dtype"] == "BF16":
            a, b = e["data_offsets"]
            out[name] = (tuple(e["shape"]), np.array(st.data[a:b]))
    return out


def ratios(tensors: dict, dtype: str) -> dict:
    per = {}
    for name, (shape, data) in tensors.items():
        blob = storage.compress(dtype, shape, data)
        assert np.array_equal(storage.decompress(blob)[2], data), name
        per[name] = {"raw_bytes": int(data.nbytes), "stored_bytes": int(blob.nbytes),
                     "ratio": data.nbytes / blob.nbytes, "coding": storage.CODINGS[storage.read_header(blob).coding]}
    raw, stored = sum(p["raw_bytes"] for p in per.values()), sum(p["stored_bytes"] for p in per.values())
    return {"ratio": raw / stored, "min_ratio": min(p["ratio"] for p in per.values()),
            "max_ratio": max(p["ratio"] for p in per.values()), "raw_bytes": raw, "stored_bytes": stored,
            "per_tensor": per}


def limit_sweep(tensors: dict) -> dict:
    """Exponent bits a weight with each code-length limit, per-tensor codes, against the unlimited
    Huffman code and the per-tensor exponent entropy."""
    n, bits, entropy = 0, dict.fromkeys(LIMITS + (64,), 0), 0.0
    for shape, data in tensors.values():
        u = data.view("<u2")
        counts = np.bincount((u >> 7) & 0xFF, minlength=256)
        n += u.size
        p = counts[counts > 0] / u.size
        entropy += float(-(p * np.log2(p)).sum()) * u.size
        for limit in bits:
            bits[limit] += int((counts * storage.code_lengths(counts, limit).astype(np.int64)).sum())
    return {"exponent_entropy_bits": entropy / n, "unlimited_huffman_bits": bits.pop(64) / n,
            "bits_by_limit": {str(k): v / n for k, v in bits.items()}}


def speeds(tensors: dict, dtype: str, repeat: int) -> dict:
    items = [(shape, data) for shape, data in tensors.values()]
    raw = sum(d.nbytes for _, d in items)
    plans = [storage.plan(dtype, s, d) for s, d in items]
    blobs = [storage.encode(p, d) for p, (_, d) in zip(plans, items)]
    out = {}
    for n_threads in sorted({available_cores(), 1}, reverse=True):
        with threads(n_threads):
            t = {"plan": median_seconds(lambda: [storage.plan(dtype, s, d) for s, d in items], repeat),
                 "encode": median_seconds(lambda: [storage.encode(p, d) for p, (_, d) in zip(plans, items)], repeat),
                 "compress": median_seconds(lambda: [storage.compress(dtype, s, d) for s, d in items], repeat),
                 "decode": median_seconds(lambda: [storage.decompress(b) for b in blobs], repeat)}
        out[f"{n_threads}_threads"] = {f"{k}_MBps": raw / v / 1e6 for k, v in t.items()}
    return out


def widened(tensors: dict, dtype: str, seed: int = 0) -> dict:
    """The BF16 tensors as FP32 (16 random low mantissa bits) or FP16 (rounded), as bytes."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, data) in tensors.items():
        x = data.view(ml_dtypes.bfloat16).astype(np.float32)
        if dtype == "F32":
            bits = x.view(np.uint32) | rng.integers(0, 1 << 16, x.size, dtype=np.uint32)
            out[name] = (shape, bits.view(np.uint8))
        else:
            out[name] = (shape, x.astype(np.float16).view(np.uint8))
    return out


def kv_codec_ratios(tensors: dict, dtype: str) -> dict:
    """kvzip.compress (the KV codec, both modes) on the same tensors, for the choice of coding."""
    np_dtype = {"F32": np.float32, "F16": np.float16}[dtype]
    out = {}
    for mode in ("speed", "ratio"):
        raw = stored = 0
        for shape, data in tensors.values():
            x = data.view(np_dtype).reshape(shape)
            stored += kvzip.compress(x, mode=mode).nbytes
            raw += data.nbytes
        out[f"kvzip.compress mode={mode}"] = raw / stored
    return out


def f16_exponent_only(tensors: dict) -> float:
    """FP16 ratio if only the 5-bit exponent were coded and sign + mantissa (11 bits) packed raw
    (the alternative to coding the top byte; headers left out)."""
    raw = bits = 0
    for shape, data in tensors.values():
        e = (data.view("<u2") >> 10) & 0x1F
        counts = np.bincount(e, minlength=256)
        bits += int((counts * storage.code_lengths(counts).astype(np.int64)).sum()) + 11 * e.size
        raw += data.nbytes
    return raw * 8 / bits


def checkpoint_speeds(path: Path, repeat: int) -> dict:
    raw = files.read_safetensors(path).data.nbytes
    with tempfile.TemporaryDirectory() as tmp:
        packed, back = Path(tmp) / "c.kvz.safetensors", Path(tmp) / "back.safetensors"
        t_c = median_seconds(lambda: checkpoint.compress_file(path, packed), repeat)
        t_d = median_seconds(lambda: checkpoint.decompress_file(packed, back), repeat)
        t_v = median_seconds(lambda: checkpoint.verify_file(packed), repeat)
        t_l = median_seconds(lambda: checkpoint.load_compressed(packed), repeat) if _has_torch() else None
        exact = back.read_bytes() == path.read_bytes()
        sizes = {"file_bytes": path.stat().st_size, "compressed_file_bytes": packed.stat().st_size}
    out = {"byte_identical": exact, **sizes, "file_ratio": sizes["file_bytes"] / sizes["compressed_file_bytes"],
           "compress_file_MBps": raw / t_c / 1e6, "decompress_file_MBps": raw / t_d / 1e6,
           "verify_file_MBps": raw / t_v / 1e6}
    if t_l is not None:
        out["load_compressed_MBps"] = raw / t_l / 1e6
    return out


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", type=Path, default=DEFAULT_WEIGHTS)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args(argv)
    if not args.weights.is_file():
        print(f"no weights file at {args.weights} (give --weights)", file=sys.stderr)
        return 1
    bf16 = bf16_tensors(args.weights)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    log(f"{len(bf16)} BF16 tensors, {sum(d.nbytes for _, d in bf16.values()) / 1e6:.1f} MB")
    env = environment()
    if _has_torch():  # load_compressed's
        import torch

        env["versions"]["torch"] = torch.__version__
    result = {**env, "input": str(args.weights.name), "tensors": len(bf16),
              "values": int(sum(d.nbytes // 2 for _, d in bf16.values())), "repeat": args.repeat,
              "chunk": storage.CHUNK, "max_code_length": storage.MAX_CODE_LENGTH}
    log("ratios")
    result["bf16"] = ratios(bf16, "BF16")
    result["bf16"]["bits_per_weight"] = 16 / result["bf16"]["ratio"]
    result["code_length_limit"] = limit_sweep(bf16)
    log("speeds")
    result["bf16"]["speed"] = speeds(bf16, "BF16", args.repeat)
    for dtype in ("F32", "F16"):
        log(dtype)
        wide = widened(bf16, dtype)
        r = ratios(wide, dtype)
        r.pop("per_tensor")
        result[dtype.lower()] = {**r, "speed": speeds(wide, dtype, max(1, args.repeat // 2)),
                                 "alternatives": kv_codec_ratios(wide, dtype)}
        if dtype == "F16":
            result["f16"]["alternatives"]["top byte not coded, exponent coded, 11 bits packed (estimate)"] = \
                f16_exponent_only(wide)
    log("checkpoint files")
    result["checkpoint"] = checkpoint_speeds(args.weights, args.repeat)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "weights-storage-cpu.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {path}")
    print(table(result))
    return 0


def table(r: dict) -> str:
    b = r["bf16"]
    lines = [f"BF16 ({r['tensors']} tensors, {r['values']:,} values): ratio {b['ratio']:.4f} "
             f"({b['bits_per_weight']:.3f} bits/weight), per tensor {b['min_ratio']:.4f}-{b['max_ratio']:.4f}",
             "code-length limit (exponent bits/weight): " + ", ".join(
                 f"{k}: {v:.4f}" for k, v in r["code_length_limit"]["bits_by_limit"].items())
             + f"; unlimited {r['code_length_limit']['unlimited_huffman_bits']:.4f}, entropy "
               f"{r['code_length_limit']['exponent_entropy_bits']:.4f}",
             f"{'dtype':<6} {'threads':>7} {'plan':>8} {'encode':>8} {'compress':>9} {'decode':>8}  MB/s"]
    for dtype in ("bf16", "f32", "f16"):
        for key, s in r[dtype]["speed"].items():
            lines.append(f"{dtype:<6} {key.split('_')[0]:>7} {s['plan_MBps']:>8.0f} {s['encode_MBps']:>8.0f} "
                         f"{s['compress_MBps']:>9.0f} {s['decode_MBps']:>8.0f}")
    for dtype in ("f32", "f16"):
        alts = ", ".join(f"{k} {v:.4f}" for k, v in r[dtype]["alternatives"].items())
        lines.append(f"{dtype}: exponent code {r[dtype]['ratio']:.4f} (min {r[dtype]['min_ratio']:.4f}); {alts}")
    c = r["checkpoint"]
    lines.append(f"checkpoint file: ratio {c['file_ratio']:.4f}, byte-identical {c['byte_identical']}, compress "
                 f"{c['compress_file_MBps']:.0f}, decompress {c['decompress_file_MBps']:.0f}, verify "
                 f"{c['verify_file_MBps']:.0f}" + (f", load {c['load_compressed_MBps']:.0f}" if
                                                    "load_compressed_MBps" in c else "") + " MB/s")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
