"""The GPU codec benchmark (`kvzip bench`, benchmarks/bench_codec.py).

Measures on the real KV sample that ships with kvzip, tiled to 2^28 values (512 MiB of BF16):
the device-copy roofline; kvzip BF16, E5M2, float16, float32 and QuantizeFP8+E5M2 encode/decode
with ratio and a lossless check (float16 / float32: the BF16 sample converted); latency at 1, 8
and 64 MiB; the batch API on 64 x 8 MiB; and nvCOMP's codecs on the same bytes when
`nvidia.nvcomp` is importable.  Throughput is uncompressed bytes over wall time (CUDA events,
median of --repeat runs after warm-up), including every launch and the host synchronisation
inside the call.  Writes <out>/<gpu>.json and <out>/<gpu>.png.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time

import numpy as np

MiB = 1 << 20


def _timer(cupy, repeat, warmup=3):
    def run(f):
        for _ in range(warmup):
            out = f()
        cupy.cuda.get_current_stream().synchronize()
        times = []
        for _ in range(repeat):
            start, stop = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            out = f()
            stop.record()
            stop.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, stop) / 1e3)
        return float(np.median(times)), out

    return run


def _versions(cupy):
    import numba

    v = {"kvzip": __import__("kvzip.version").version.__version__, "numba": numba.__version__, "cupy": cupy.__version__,
         "numpy": np.__version__, "python": platform.python_version(),
         "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "cuda_driver": cupy.cuda.runtime.driverGetVersion()}
    try:
        from importlib.metadata import version

        v["numba_cuda"] = version("numba-cuda")
    except Exception:  # noqa: BLE001 - version lookup is informative only
        pass
    return v


def _sample_bits(n):
    from kvzip.data import load_sample

    sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample().values()])
    return np.resize(sample, n)


def e5m2_bits(bf16_bits, n):
    """E5M2 values: the start of the BF16 sample quantized once (per-tensor scale) on the CPU, tiled to n."""
    from kvzip import stages as S
    from kvzip.backends import get_backend
    from kvzip.frame import Frame

    m = min(1 << 22, bf16_bits.shape[0])
    fr = S.QuantizeFP8("e5m2").encode(Frame(get_backend("cpu"), {"data": bf16_bits[:m]},
                                            {"dtype": "bfloat16", "shape": [m], "n": m, "format": "bf16"}))
    return np.resize(fr.streams["data"], n)


def widened_bits(bf16_bits, n, dtype):
    """float16 or float32 values: the start of the BF16 sample converted on the CPU (exactly to
    float32, to the nearest float16), as raw bits tiled to n."""
    m = min(1 << 22, bf16_bits.shape[0])
    values = (bf16_bits[:m].astype(np.uint32) << 16).view(np.float32).astype(dtype)
    return np.resize(values.view(f"u{values.itemsize}"), n)


def format_bits(fmt: str, host, n):
    """The bench's input in format fmt ("bf16", "e5m2", "fp16" or "fp32") as raw bits (NumPy):
    host (the tiled BF16 sample, _sample_bits(n)) itself, quantized once to E5M2, or converted."""
    if fmt == "bf16":
        return host
    if fmt == "e5m2":
        return e5m2_bits(host, n)
    return widened_bits(host, n, {"fp16": np.float16, "fp32": np.float32}[fmt])


def quantize_pipelines():
    """The bench's lossy pipeline, QuantizeFP8 (E5M2, one scale a tensor) + SplitZip, and
    QuantizeFP8 alone: what the first one's decode must give back."""
    import kvzip
    from kvzip import stages as S

    return (kvzip.Pipeline([S.QuantizeFP8("e5m2"), S.ExponentSplit(), S.Top16Pack("e5m2-kv"), S.EscapeStream(),
                            S.Serialize()]),
            kvzip.Pipeline([S.QuantizeFP8("e5m2"), S.Serialize()]))


def batch_parts(x, k=64):
    """The bench's batch: the first k x 8 MiB of x (BF16 bits) as k tensors (views)."""
    return [x[i * 4 * MiB:(i + 1) * 4 * MiB] for i in range(k)]


def bench_kvzip(cupy, timeit, x, dtype, pipe=None, ref=None):
    """Encode/decode figures of one input; x is a cupy array of raw bits."""
    import kvzip
    from kvzip.trace import last_path

    pipe = pipe or kvzip.splitzip_pipeline()
    t_enc, blob = timeit(lambda: pipe.encode(x, dtype=dtype))
    path = last_path()
    t_dec, back = timeit(lambda: pipe.decode(blob))
    expect = x if ref is None else ref
    lossless = bool(cupy.array_equal(back.reshape(-1).view(expect.dtype), expect.reshape(-1)))
    info = kvzip.info(blob)
    return {"ratio": round(x.nbytes / blob.nbytes, 5), "encode_GBps": round(x.nbytes / t_enc / 1e9, 1),
            "decode_GBps": round(x.nbytes / t_dec / 1e9, 1), "encode_ms": round(t_enc * 1e3, 4),
            "decode_ms": round(t_dec * 1e3, 4), "lossless": lossless, "escape_rate": info["escape_rate"],
            "path": path, "input_bytes": int(x.nbytes)}


def bench_nvcomp(cupy, timeit, x16):
    try:
        from nvidia import nvcomp
    except ImportError:
        return None, None
    out = {}
    raw = x16.view(cupy.uint8)
    for name, kwargs, data in [("ANS", {"data_type": "<f2"}, x16.view(cupy.float16)), ("ANS_bytes", {}, raw),
                               ("Bitcomp", {}, raw), ("Cascaded", {}, raw), ("LZ4", {}, raw),
                               ("GDeflate", {}, raw), ("Zstd", {}, raw)]:
        algorithm = name.split("_")[0]
        try:
            codec = nvcomp.Codec(algorithm=algorithm, **kwargs)
            arr = nvcomp.as_array(data)

            def enc():
                c = codec.encode(arr)
                cupy.cuda.Device().synchronize()
                return c

            t_enc, comp = timeit(enc)

            def dec():
                d = codec.decode(comp)
                cupy.cuda.Device().synchronize()
                return d

            t_dec, back = timeit(dec)
            back_bytes = cupy.asarray(back).view(cupy.uint8).reshape(-1)
            out[name] = {"ratio": round(raw.nbytes / comp.buffer_size, 4),
                         "encode_GBps": round(raw.nbytes / t_enc / 1e9, 1),
                         "decode_GBps": round(raw.nbytes / t_dec / 1e9, 1),
                         "lossless": bool(cupy.array_equal(back_bytes, raw))}
        except Exception as e:  # noqa: BLE001 - record why a baseline could not run, keep going
            out[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return out, getattr(nvcomp, "__version__", "?")


def run(values_log2=28, repeat=20, out_dir="benchmarks/results", quick=False):
    import cupy

    import kvzip
    from kvzip.gpu import programs

    dev = cupy.cuda.Device()
    gpu = cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    timeit = _timer(cupy, repeat)
    n = 1 << values_log2
    host = _sample_bits(n)
    x = cupy.asarray(host)
    res = {"gpu": gpu, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "versions": _versions(cupy), "values": n, "input_MiB": x.nbytes / MiB, "repeat": repeat,
           "data": "kvzip.data sample (real SmolLM2-135M KV, BF16) tiled"}

    copy_dst = cupy.empty_like(x)
    t_copy, _ = timeit(lambda: cupy.copyto(copy_dst, x))  # device-to-device copy: the memory roofline
    res["copy_roofline_GBps"] = round(2 * x.nbytes / t_copy / 1e9, 1)
    res["codec_roofline_GBps"] = round(res["copy_roofline_GBps"] / 1.75, 1)  # 2 B read + ~1.5 B written per value

    k = res["kvzip"] = {}
    k["bf16"] = bench_kvzip(cupy, timeit, x, "bf16")
    print("bf16", k["bf16"], flush=True)
    for name in ("e5m2", "fp16", "fp32"):  # FP8, and the other 16- and 32-bit kernels
        bits = cupy.asarray(format_bits(name, host, n))
        k[name] = bench_kvzip(cupy, timeit, bits, name)
        del bits
        print(name, k[name], flush=True)
    qpipe, qonly = quantize_pipelines()
    ref = qonly.decode(qonly.encode(x, dtype="bf16"))  # what the lossy stage alone gives back
    k["quantize_e5m2"] = bench_kvzip(cupy, timeit, x, "bf16", pipe=qpipe, ref=ref.reshape(-1))
    k["quantize_e5m2"]["note"] = "lossless = decode equals QuantizeFP8 alone; GB/s of BF16 input"
    print("quantize_e5m2", k["quantize_e5m2"], flush=True)

    programs.ENABLED = False  # the Numba-CUDA kernels, for the record (benchmarks/NOTES.md)
    try:
        small = cupy.asarray(host[: 1 << 24])
        k["bf16_numba_cuda_2^24"] = bench_kvzip(cupy, _timer(cupy, 5, 1), small, "bf16")
    finally:
        programs.ENABLED = True
    print("numba", k["bf16_numba_cuda_2^24"], flush=True)

    lat = res["latency_us"] = {}
    for mib in (1, 8, 64):
        xs = x[: mib * MiB // 2]
        t_enc, blob = timeit(lambda: kvzip.compress(xs, dtype="bf16"))
        t_dec, _ = timeit(lambda: kvzip.decompress(blob))
        lat[f"{mib}MiB"] = {"encode": round(t_enc * 1e6, 1), "decode": round(t_dec * 1e6, 1)}
    print("latency", lat, flush=True)

    parts = batch_parts(x)  # 64 x 8 MiB of BF16
    t_enc, blobs = timeit(lambda: kvzip.compress_many(parts, dtype="bf16"))
    t_dec, backs = timeit(lambda: kvzip.decompress_many(blobs))
    ok = all(bool(cupy.array_equal(a, b.reshape(-1).view(a.dtype))) for a, b in zip(parts, backs))
    total = sum(p.nbytes for p in parts)
    b = res["batch_64x8MiB"] = {"encode_GBps": round(total / t_enc / 1e9, 1), "decode_GBps": round(total / t_dec / 1e9, 1),
                                "lossless": ok, "ratio": round(total / sum(int(bl.nbytes) for bl in blobs), 5)}
    b["encode_vs_large"] = round(b["encode_GBps"] / k["bf16"]["encode_GBps"], 3)
    b["decode_vs_large"] = round(b["decode_GBps"] / k["bf16"]["decode_GBps"], 3)
    print("batch", b, flush=True)

    if not quick:
        res["nvcomp"], res["versions"]["nvcomp"] = bench_nvcomp(cupy, _timer(cupy, max(5, repeat // 4), 1), x)
        print("nvcomp", res["nvcomp"], flush=True)

    os.makedirs(out_dir, exist_ok=True)
    stem = gpu.lower().replace("nvidia", "").strip().split()[0] if gpu else "gpu"
    path = os.path.join(out_dir, f"{stem}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, os.path.join(out_dir, f"{stem}.png"))
    print_table(res)
    print("wrote", path)
    return res


def print_table(res):
    print(f"\n{res['gpu']}  {res['date']}  copy roofline {res['copy_roofline_GBps']} GB/s (read+write)")
    print(f"{'codec':<28}{'ratio':>8}{'enc GB/s':>10}{'dec GB/s':>10}  lossless")
    rows = [(f"kvzip {k}", v) for k, v in res["kvzip"].items()]
    rows += [(f"nvCOMP {k}", v) for k, v in (res.get("nvcomp") or {}).items() if "error" not in v]
    for name, v in rows:
        print(f"{name:<28}{v['ratio']:>8}{v['encode_GBps']:>10}{v['decode_GBps']:>10}  {v['lossless']}")
    b = res["batch_64x8MiB"]
    print(f"{'kvzip batch 64x8MiB':<28}{b['ratio']:>8}{b['encode_GBps']:>10}{b['decode_GBps']:>10}  {b['lossless']}")
    for size, v in res["latency_us"].items():
        print(f"latency {size:>6}: encode {v['encode']} us, decode {v['decode']} us")


def plot(res, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [(f"kvzip\n{k}", v) for k, v in res["kvzip"].items() if "numba" not in k]
    rows.append(("kvzip batch\n64x8MiB", res["batch_64x8MiB"]))
    rows += [(f"nvCOMP\n{k}", v) for k, v in (res.get("nvcomp") or {}).items() if "error" not in v]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows)), 4.5))
    xs = np.arange(len(rows))
    ax.bar(xs - 0.2, [v["encode_GBps"] for _, v in rows], 0.4, label="encode")
    ax.bar(xs + 0.2, [v["decode_GBps"] for _, v in rows], 0.4, label="decode")
    ax.axhline(res["codec_roofline_GBps"], color="k", ls="--", lw=1, label="memory roofline (BF16 codec)")
    ax.set_xticks(xs, [name for name, _ in rows], fontsize=8)
    ax.set_ylabel("GB/s of uncompressed input")
    ax.set_title(f"kvzip vs nvCOMP, {res['gpu']}, 2^{int(np.log2(res['values']))} real KV values ({res['date'][:10]})")
    top = max(max(v["encode_GBps"], v["decode_GBps"]) for _, v in rows)
    for i, (_, v) in enumerate(rows):  # compression ratio above each pair of bars
        ax.text(i, max(v["encode_GBps"], v["decode_GBps"]) + 0.01 * top, f"{v['ratio']:.3f}x", ha="center",
                va="bottom", fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def replot(json_path):
    """Redraw the PNG next to a results JSON (the figures come from the JSON, nothing is re-measured)."""
    with open(json_path) as f:
        res = json.load(f)
    plot(res, os.path.splitext(json_path)[0] + ".png")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="kvzip bench", description=__doc__.splitlines()[0])
    ap.add_argument("--values-log2", type=int, default=28)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="skip nvCOMP")
    ap.add_argument("--replot", metavar="JSON", help="only redraw the plot of an existing results file")
    a = ap.parse_args(argv)
    if a.replot:
        replot(a.replot)
        return 0
    try:
        import cupy

        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001
        print(f"kvzip bench needs a CUDA GPU and CuPy: {e}", file=sys.stderr)
        return 2
    t = time.time()
    run(a.values_log2, a.repeat, a.out, a.quick)
    print(f"bench took {time.time() - t:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
