"""The storage mode (ChannelRans) on one GPU beside kvzip's speed mode, real KV.

    python benchmarks/bench_storage_gpu.py [--quick] [--repeat 5] [--out benchmarks/results]

Input: kvzip.data's sample (real SmolLM2-135M KV, BF16, head_dim 64) tiled to 2^24 and 2^28
values (kvzip.bench._sample_bits), shaped [-1, 64] so the storage mode sees its 64 channels, in
BF16 and quantized once to E5M2 (kvzip.bench.format_bits; FP8 raw = one byte a value).  For
each: ratio, encode and decode GB/s of uncompressed input (CUDA events around each call, median
of REPEAT after warm-up: kvzip.bench._timer) of kvzip's storage and speed modes (the ratio mode:
bench_ratio_gpu.py), every run checked lossless; and the tables' share of a storage encode: the
device histogram (histogram_ms, to a synchronize) and kvz_rans_tables with the read of its sizes
(tables_ms: kvzip/gpu/channel_rans.py's choose_tables), each timed alone.
--quick: 2^24 only, fewer repeats (well under a minute).

Writes OUT/storage-mode-GPU.json (GPU: the card's short name, kvzip.bench.gpu_tag, e.g. h200;
inside: gpu, date, commit, versions, every figure; rewritten after each row).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import kvzip
from kvzip.bench import _timer, bench_kvzip, gpu_tag, tiled_kv_inputs, tiled_kv_results

HEAD_DIM = 64  # the sample's last axis: the channel modes' channels
FORMATS = ("bf16", "e5m2")


def tables_share(cupy, x, fmt_name, repeat):
    """(histogram_ms, tables_ms) of the storage encode of x: the device histogram, then the
    writer's rule on the device with the read of the tables' sizes (medians of repeat)."""
    from kvzip.formats import FORMATS as ALL
    from kvzip.gpu import channel_rans as gpu

    fmt, n, channels = ALL[fmt_name], x.size, x.shape[-1]
    flat = x.reshape(-1)
    hist_t, table_t = [], []
    stream = cupy.cuda.get_current_stream()
    for _ in range(repeat + 1):
        stream.synchronize()
        t0 = time.perf_counter()
        hist = gpu.device_histogram(flat, n, fmt, channels)
        stream.synchronize()
        t1 = time.perf_counter()
        gpu.choose_tables(hist, fmt, channels)  # ends with the read of the sizes
        t2 = time.perf_counter()
        hist_t.append(t1 - t0)
        table_t.append(t2 - t1)
    return _median_ms(hist_t[1:]), _median_ms(table_t[1:])  # the first call compiles the kernels


def _median_ms(seconds) -> float:
    return round(sorted(seconds)[len(seconds) // 2] * 1e3, 3)


def run(sizes, formats, repeat, out_dir):
    import cupy

    res = tiled_kv_results(cupy, repeat, HEAD_DIM)
    timeit = _timer(cupy, repeat)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"storage-mode-{gpu_tag(res['gpu'])}.json"
    for log2, fmt, x in tiled_kv_inputs(cupy, sizes, formats, HEAD_DIM):
        row = res["runs"][f"{fmt}_2^{log2}"] = {"format": fmt, "values": x.size}
        row["kvzip_storage"] = bench_kvzip(cupy, timeit, x, fmt, pipe=kvzip.storage_pipeline())
        row["histogram_ms"], row["tables_ms"] = tables_share(cupy, x, fmt, repeat)
        row["kvzip_speed"] = bench_kvzip(cupy, timeit, x, fmt)
        print(fmt, log2, "storage", row["kvzip_storage"], "histogram", row["histogram_ms"], "ms, tables",
              row["tables_ms"], "ms\n   speed", row["kvzip_speed"], flush=True)
        del x
        path.write_text(json.dumps(res, indent=1))  # after every row: a cut-short run keeps what it measured
    print("wrote", path)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args(argv)
    if a.quick:
        run((24,), FORMATS, min(a.repeat, 3), a.out)
    else:
        run((24, 28), FORMATS, a.repeat, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
