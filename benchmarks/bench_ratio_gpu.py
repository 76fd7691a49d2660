"""kvzip's three modes (speed, ratio: ChannelPack, storage: ChannelRans) on one GPU against nvCOMP,
real KV.

    python benchmarks/bench_ratio_gpu.py [--quick] [--repeat 10] [--out benchmarks/results]

Input: kvzip.data's sample (real SmolLM2-135M KV, BF16, head_dim 64) tiled to 2^24 and 2^28
values (kvzip.bench._sample_bits), shaped [-1, 64] so the ratio mode sees its 64 channels, in
BF16 and quantized once to E5M2 and E4M3 (kvzip.bench.format_bits; FP8 raw = one byte a value).
For each: ratio, encode and decode GB/s of uncompressed input (CUDA events around each call,
median of REPEAT after warm-up: kvzip.bench._timer) of kvzip.compress / decompress in speed,
ratio and storage mode (every run checked lossless), and of nvCOMP's codecs on the same bytes where
nvidia.nvcomp imports (kvzip.bench.bench_nvcomp: ANS with data_type '<f2', ANS on bytes,
Bitcomp, Cascaded, LZ4, GDeflate, Zstd), BF16 at both sizes, the FP8 formats at 2^24.
Then batches (bench_batches): 8 tensors of 8 MiB through compress_many / decompress_many against
a loop of single calls, the speed mode and the ratio mode with each tensor's own and with
calibrated tables, interleaved (--batches: only these, written to OUT/ratio-batch-GPU.json).
--quick: 2^24 only, BF16 and E5M2, fewer repeats, no nvCOMP (under a minute).  --replot JSON:
redraw the PNG of a results file (one cut short before its plot, say).

Writes OUT/ratio-mode-GPU.json (GPU: the card's short name, kvzip.bench.gpu_tag, e.g. h200;
inside: gpu, date, commit, versions, every figure; rewritten after each row) and
OUT/ratio-mode-GPU.png (ratio against throughput, one point a codec, encode and decode) at the
end.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import kvzip
from kvzip.bench import _timer, bench_kvzip, bench_nvcomp, gpu_tag, tiled_kv_inputs, tiled_kv_results

HEAD_DIM = 64  # the sample's last axis: the ratio mode's channels
FORMATS = ("bf16", "e5m2", "e4m3")


def run(sizes, formats, repeat, nvcomp_at, out_dir):
    import cupy

    res = tiled_kv_results(cupy, repeat, HEAD_DIM)
    timeit, nv_timeit = _timer(cupy, repeat), _timer(cupy, 3, 1)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ratio-mode-{gpu_tag(res['gpu'])}.json"
    for log2, fmt, x in tiled_kv_inputs(cupy, sizes, formats, HEAD_DIM):
        row = res["runs"][f"{fmt}_2^{log2}"] = {"format": fmt, "values": x.size}
        row["kvzip_speed"] = bench_kvzip(cupy, timeit, x, fmt)
        row["kvzip_ratio"] = bench_kvzip(cupy, timeit, x, fmt, pipe=kvzip.ratio_pipeline())
        row["kvzip_storage"] = bench_kvzip(cupy, timeit, x, fmt, pipe=kvzip.storage_pipeline())
        print(fmt, log2, "speed", row["kvzip_speed"], "\n   ratio", row["kvzip_ratio"], "\n   storage",
              row["kvzip_storage"], flush=True)
        if (fmt, log2) in nvcomp_at:
            row["nvcomp"], res["versions"]["nvcomp"] = bench_nvcomp(cupy, nv_timeit, x.reshape(-1).view(cupy.uint16))
            print("   nvcomp", row["nvcomp"], flush=True)
        del x
        path.write_text(json.dumps(res, indent=1))  # after every row: a cut-short run keeps what it measured
    res["batches"] = bench_batches(cupy, timeit, next(tiled_kv_inputs(cupy, (BATCH_LOG2,), ("bf16",), HEAD_DIM))[2])
    path.write_text(json.dumps(res, indent=1))
    plot(res, path.with_suffix(".png"))
    print("wrote", path)
    return res


BATCH = 8               # tensors a batch: a transfer group of Llama-3-8B KV at 4K tokens (8 x 8 MiB)
BATCH_LOG2 = 25         # 32 Mi values: 4 batches of 8 x 8 MiB tensors


def bench_batches(cupy, timeit, x):
    """Per mode, BATCH tensors of 8 MiB (rows of x) through compress_many / decompress_many
    against a loop of compress / decompress over the same tensors, interleaved rep by rep (each
    a median of the timer's repeats): GB/s of uncompressed input, and whether every tensor came
    back.  "ratio-calibrated": the ratio mode with channel tables calibrated on the batch
    (kvzip.calibrate_channels), which skips each tensor's histogram and ranking kernels."""
    rows = x.reshape(-1, 4 << 20)  # 8 MiB of BF16 a row
    parts = [rows[i].reshape(-1, HEAD_DIM) for i in range(BATCH)]
    total = sum(p.nbytes for p in parts)
    calibrated = kvzip.calibrate_channels(parts, format="bf16")
    out = {"tensors": BATCH, "tensor_MiB": 8, "shape": list(parts[0].shape)}
    for label, mode, kw in (("speed", "speed", {}), ("ratio", "ratio", {}),
                            ("ratio-calibrated", "ratio", {"codebook": calibrated})):
        figures = {}
        for rep in range(3):
            for how in ("many", "loop"):
                if how == "many":
                    t_enc, blobs = timeit(lambda: kvzip.compress_many(parts, dtype="bf16", mode=mode, **kw))
                    t_dec, backs = timeit(lambda: kvzip.decompress_many(blobs))
                else:
                    t_enc, blobs = timeit(lambda: [kvzip.compress(p, dtype="bf16", mode=mode, **kw) for p in parts])
                    t_dec, backs = timeit(lambda: [kvzip.decompress(b) for b in blobs])
                ok = all(bool(cupy.array_equal(p.reshape(-1), b.reshape(-1).view(p.dtype))) for p, b in zip(parts, backs))
                f = figures.setdefault(how, {"encode_GBps": [], "decode_GBps": [], "lossless": True})
                f["encode_GBps"].append(round(total / t_enc / 1e9, 1))
                f["decode_GBps"].append(round(total / t_dec / 1e9, 1))
                f["lossless"] &= ok
                f["ratio"] = round(total / sum(int(b.nbytes) for b in blobs), 5)
        out[label] = figures
        print("batch", label, figures, flush=True)
    return out


def points(res):
    """(label, format, values, figures) of every codec run that succeeded."""
    for row in res["runs"].values():
        codecs = [(f"kvzip {mode}", row[f"kvzip_{mode}"]) for mode in ("speed", "ratio", "storage") if f"kvzip_{mode}" in row]
        codecs += [(f"nvCOMP {k}", v) for k, v in (row.get("nvcomp") or {}).items() if "error" not in v]
        for label, v in codecs:
            yield label, row["format"], row["values"], v


def plot(res, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    labels = sorted({p[0] for p in points(res)})
    colors = {label: plt.cm.tab10(i % 10) for i, label in enumerate(labels)}
    marks = {"bf16": "o", "e5m2": "s", "e4m3": "^"}
    for ax, key in zip(axes, ("encode_GBps", "decode_GBps")):
        for label, fmt, n, v in points(res):
            ax.scatter(v[key], v["ratio"], color=colors[label], marker=marks[fmt], s=30 if n < 1 << 28 else 70,
                       label=f"{label}")
        ax.set_xscale("log")
        ax.set_xlabel(f"{key.split('_')[0]} GB/s of uncompressed input (log)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("compression ratio")
    handles, names = axes[0].get_legend_handles_labels()
    seen = dict(zip(names, handles))
    axes[1].legend(seen.values(), seen.keys(), fontsize=7, loc="upper right")
    fig.suptitle(f"ratio vs throughput, {res['gpu']}, real KV (o bf16, s e5m2, ^ e4m3; large = 2^28) "
                 f"{res['date'][:10]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG beside a results JSON")
    ap.add_argument("--batches", action="store_true", help="only the batches: OUT/ratio-batch-GPU.json")
    a = ap.parse_args(argv)
    if a.batches:
        import cupy

        res = tiled_kv_results(cupy, a.repeat, HEAD_DIM)
        x = next(tiled_kv_inputs(cupy, (BATCH_LOG2,), ("bf16",), HEAD_DIM))[2]
        res["batches"] = bench_batches(cupy, _timer(cupy, a.repeat), x)
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / f"ratio-batch-{gpu_tag(res['gpu'])}.json").write_text(json.dumps(res, indent=1))
    elif a.replot:
        plot(json.loads(Path(a.replot).read_text()), Path(a.replot).with_suffix(".png"))
    elif a.quick:
        run((24,), ("bf16", "e5m2"), min(a.repeat, 5), set(), a.out)
    else:
        nv = {("bf16", 24), ("bf16", 28), ("e5m2", 24), ("e4m3", 24)}
        run((24, 28), FORMATS, a.repeat, nv, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
