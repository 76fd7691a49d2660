"""The GPU codec benchmark (`kvzip bench`, benchmarks/bench_codec.py).

Measures on the real KV sample that ships with kvzip, tiled to 2^28 values (512 MiB of BF16):
the device-copy roofline; kvzip BF16, E5M2, float16, float32 and QuantizeFP8+E5M2 encode/decode
with ratio and a lossless check (float16 / float32: the BF16 sample converted); latency at 1, 8
and 64 MiB; the batch API on 64 x 8 MiB; the auto codebook; an escape sweep (0 to 3 % of the
values scaled out of the default codebook, and two KV variants whose escapes cluster); 32 KiB
blocks alone and packed; compress_into / decompress_into called eagerly and captured in CUDA
graphs; with --kv, every real KV file in a folder; and nvCOMP's codecs on the same bytes when
`nvidia.nvcomp` is importable.  Throughput is uncompressed bytes over wall time (CUDA events,
median of --repeat runs after warm-up), including every launch and the host synchronisation
inside the call (the into calls have none: there it is GPU stream time).  Writes
<out>/<gpu>.json and <out>/<gpu>.png.
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

    from .bench_cpu import code_commit

    v = {"kvzip": __import__("kvzip.version").version.__version__, "numba": numba.__version__, "cupy": cupy.__version__,
         "numpy": np.__version__, "python": platform.python_version(), "commit": code_commit(),
         "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(), "cuda_driver": cupy.cuda.runtime.driverGetVersion()}
    try:
        from importlib.metadata import version

        v["numba_cuda"] = version("numba-cuda")
    except Exception:  # noqa: BLE001 - version lookup is informative only
        pass
    return v


def gpu_tag(name: str | None) -> str:
    """A GPU's short name for result files, so a file says which card measured it: the model's
    words up to its first with a digit, less the vendor's and brands' words, cut at a "-":
    "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100", "NVIDIA GeForce RTX 4090" ->
    "rtx4090", "Tesla V100-SXM2-16GB" -> "v100"; "gpu" for no name."""
    words = [w for w in (name or "").lower().split() if w not in ("nvidia", "geforce", "tesla", "quadro")]
    model = []
    for w in words:
        model.append(w.split("-")[0])
        if any(ch.isdigit() for ch in w):
            break
    return "".join(model) or "gpu"


def torch_gpu_tag() -> str:
    """gpu_tag of torch's current CUDA device ("cpu" without one)."""
    import torch

    return gpu_tag(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"


def _sample_bits(n):
    from kvzip.data import load_sample

    sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample().values()])
    return np.resize(sample, n)


def e5m2_bits(bf16_bits, n, fp8="e5m2"):
    """E5M2 (or fp8's) values: the start of the BF16 sample quantized once (per-tensor scale) on
    the CPU, tiled to n."""
    from kvzip import stages as S
    from kvzip.backends import get_backend
    from kvzip.frame import Frame

    m = min(1 << 22, bf16_bits.shape[0])
    fr = S.QuantizeFP8(fp8).encode(Frame(get_backend("cpu"), {"data": bf16_bits[:m]},
                                            {"dtype": "bfloat16", "shape": [m], "n": m, "format": "bf16"}))
    return np.resize(fr.streams["data"], n)


def widened_bits(bf16_bits, n, dtype):
    """float16 or float32 values: the start of the BF16 sample converted on the CPU (exactly to
    float32, to the nearest float16), as raw bits tiled to n."""
    m = min(1 << 22, bf16_bits.shape[0])
    values = (bf16_bits[:m].astype(np.uint32) << 16).view(np.float32).astype(dtype)
    return np.resize(values.view(f"u{values.itemsize}"), n)


def format_bits(fmt: str, host, n):
    """The bench's input in format fmt ("bf16", "e5m2", "e4m3", "fp16" or "fp32") as raw bits
    (NumPy): host (the tiled BF16 sample, _sample_bits(n)) itself, quantized once to FP8, or
    converted."""
    if fmt == "bf16":
        return host
    if fmt in ("e5m2", "e4m3"):
        return e5m2_bits(host, n, fmt)
    return widened_bits(host, n, {"fp16": np.float16, "fp32": np.float32}[fmt])


def tiled_kv_inputs(cupy, sizes, formats, head_dim):
    """(log2 n, format, x) of every size and format: the tiled sample (_sample_bits) of 2**log2
    values in the format (format_bits) on the device, shaped [-1, head_dim] so the channel modes
    see its channels."""
    for log2 in sizes:
        host = _sample_bits(1 << log2)
        for fmt in formats:
            yield log2, fmt, cupy.asarray(format_bits(fmt, host, 1 << log2)).reshape(-1, head_dim)


def tiled_kv_results(cupy, repeat, head_dim) -> dict:
    """The head of a GPU bench's results over tiled_kv_inputs: gpu, date, commit, versions,
    repeat, data, and runs (empty)."""
    from kvzip.bench_cpu import code_commit

    gpu = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    return {"gpu": gpu, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "commit": code_commit(), "versions": _versions(cupy), "repeat": repeat,
            "data": f"kvzip.data sample (real SmolLM2-135M KV) tiled, shape [-1, {head_dim}]; FP8 = QuantizeFP8 "
            "once on the CPU", "runs": {}}


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


ESCAPE_RATES = (0.0, 0.001, 0.003, 0.01, 0.03)  # the escape_sweep's added shares of values


def with_escapes(cupy, x, rate: float, seed: int = 0):
    """x (BF16 bits, CuPy) with a share `rate` of its values, at pseudo-random positions, times
    2^12 (their exponent field +12; zeros, subnormals and values that would overflow untouched):
    escapes of the default codebook spread over every chunk."""
    if not rate:
        return x
    e = (x >> 7) & 0xFF
    pick = (cupy.random.default_rng(seed).random(x.shape[0], dtype=cupy.float32) < rate) & (e > 0) & (e < 255 - 12)
    return cupy.where(pick, x + cupy.uint16(12 << 7), x)


def bench_escape_sweep(cupy, timeit, host, x):
    """Speed and ratio against the escape rate: the sample with escapes added (with_escapes), and
    two KV variants whose escapes cluster in chunks (kvzip.testing.kv_variant)."""
    from kvzip import testing

    rows = []
    for rate in ESCAPE_RATES:
        y = with_escapes(cupy, x, rate)
        row = {"data": f"sample + {100 * rate:g} % scaled", "added_rate": rate, **bench_kvzip(cupy, timeit, y, "bf16")}
        rows.append(row)
        print("escape_sweep", row, flush=True)
        del y
    for variant, layer in (("chan-scaled", 0), ("layer-scaled", 6)):
        y = cupy.asarray(testing.kv_variant(host.reshape(-1, 64), variant, layer=layer).reshape(-1))
        row = {"data": f"sample {variant}" + (f" (layer {layer}: x2^{layer % 7 - 3})" if variant == "layer-scaled" else ""),
               **bench_kvzip(cupy, timeit, y, "bf16")}
        rows.append(row)
        print("escape_sweep", row, flush=True)
        del y
    return {"rows": rows, "targets_GBps": {"escapes<=1%": {"encode": 1800, "decode": 1900},
                                           "escapes<=3%": {"encode": 1500, "decode": 1500}}}


BLOCK_VALUES = 16 * 8 * 128  # a paged KV block: 16 tokens x 8 heads x 128 channels of BF16 (32 KiB)


def bench_small_blocks(cupy, timeit, x, k: int = 64):
    """k 32 KiB blocks of the sample: ratio alone and in one packed container, per-blob overhead,
    and the speed of compress_many(..., packed=True) / decompress_many of the container."""
    import kvzip
    from kvzip import container

    blocks = [x[i * BLOCK_VALUES:(i + 1) * BLOCK_VALUES] for i in range(k)]
    raw = sum(int(b.nbytes) for b in blocks)
    alone = kvzip.compress_many(blocks, dtype="bf16")
    t_enc, packed = timeit(lambda: kvzip.compress_many(blocks, dtype="bf16", packed=True))
    t_dec, backs = timeit(lambda: kvzip.decompress_many(packed))
    lossless = all(bool(cupy.array_equal(a, b.reshape(-1).view(a.dtype))) for a, b in zip(blocks, backs))
    head = container.parse_header(bytes(cupy.asnumpy(alone[0][:4096])), int(alone[0].nbytes))
    return {"block_bytes": 2 * BLOCK_VALUES, "blocks": k,
            "ratio_alone": round(raw / sum(int(b.nbytes) for b in alone), 5),
            "ratio_packed": round(raw / int(packed.nbytes), 5), "header_bytes": head.header_len,
            "packed_overhead_bytes_per_block": round((int(packed.nbytes) - sum(int(b.nbytes) for b in alone)) / k, 1),
            "packed_encode_GBps": round(raw / t_enc / 1e9, 1), "packed_decode_GBps": round(raw / t_dec / 1e9, 1),
            "lossless": lossless, "targets": {"ratio_alone": 1.31, "ratio_packed": 1.325, "header_bytes": 64}}


BRANCHES = 4  # bench_into's streams in one graph


def bench_into(cupy, timeit, x, k: int = 64):
    """compress_into / decompress_into of 8 MiB tensors: called eagerly, one call captured in a
    CUDA graph, 100 calls in one graph (per call), and k different tensors in one graph, on one
    stream and on BRANCHES streams."""
    import kvzip

    parts = batch_parts(x, k)
    bound = kvzip.compress_bound(parts[0], dtype="bf16")
    dst = cupy.zeros(k * bound, np.uint8)
    sizes, status = cupy.zeros(k, np.int64), cupy.full(k, -1, np.int64)
    outs = cupy.zeros((k, parts[0].shape[0]), np.uint16)
    stream = cupy.cuda.Stream(non_blocking=True)
    res = {"tensor_MiB": parts[0].nbytes / MiB, "bound_bytes": bound}

    def enc(i):
        kvzip.compress_into(parts[i], dst[i * bound:(i + 1) * bound], sizes[i:i + 1], dtype="bf16")

    def dec(i):
        kvzip.decompress_into(dst[i * bound:(i + 1) * bound], outs[i], status[i:i + 1], dtype="bf16")

    def graph_of(calls):
        stream.begin_capture(cupy.cuda.runtime.streamCaptureModeGlobal)
        try:
            calls()
        finally:
            graph = stream.end_capture()
        return graph

    branches = [cupy.cuda.Stream(non_blocking=True) for _ in range(BRANCHES)]
    fork, joins = cupy.cuda.Event(), [cupy.cuda.Event() for _ in branches]

    def forked(call):
        """The k calls on BRANCHES streams forked from the capturing one and joined back (each
        stream has a workspace of its own, so the branches overlap in the graph)."""
        fork.record(stream)
        for j, (branch, join) in enumerate(zip(branches, joins)):
            branch.wait_event(fork)
            with branch:
                for i in range(j, k, len(branches)):
                    call(i)
            join.record(branch)
            stream.wait_event(join)

    with stream:
        for name, call in (("encode", enc), ("decode", dec)):
            t_eager, _ = timeit(lambda: call(0))
            one = graph_of(lambda: call(0))
            t_one, _ = timeit(lambda: one.launch(stream))
            hundred = graph_of(lambda: [call(0) for _ in range(100)])
            t_hundred, _ = timeit(lambda: hundred.launch(stream))
            many = graph_of(lambda: [call(i) for i in range(k)])
            t_many, _ = timeit(lambda: many.launch(stream))
            wide = graph_of(lambda: forked(call))
            t_wide, _ = timeit(lambda: wide.launch(stream))
            res[name] = {"eager_call_us": round(t_eager * 1e6, 1), "graph_of_1_us": round(t_one * 1e6, 1),
                         "graph_of_100_per_call_us": round(t_hundred * 1e4, 2),
                         f"graph_of_{k}_GBps": round(k * parts[0].nbytes / t_many / 1e9, 1),
                         f"graph_of_{k}_on_{BRANCHES}_streams_GBps": round(k * parts[0].nbytes / t_wide / 1e9, 1)}
            print("into", name, res[name], flush=True)
        stream.synchronize()
    want = kvzip.compress_many(parts, dtype="bf16")
    got = sizes.get().tolist()
    res["sizes_match_compress"] = got == [int(b.nbytes) for b in want]
    codes = status.get().tolist()
    wrong = [i for i in range(k) if not bool(cupy.array_equal(outs[i], parts[i]))]
    res["lossless"] = all(c == 0 for c in codes) and not wrong
    if not res["lossless"]:  # what failed, for whoever reads the results
        unlike = [i for i in range(k) if got[i] != int(want[i].nbytes)
                  or not bool(cupy.array_equal(dst[i * bound:i * bound + got[i]], want[i]))]
        res["failures"] = {"statuses": {str(c): codes.count(c) for c in sorted(set(codes))},
                           "tensors_not_back": wrong[:16], "blobs_unlike_compress": unlike[:16]}
    res["targets"] = {"graph_call_us": 12, f"graph_of_{k}_GBps": 1500}
    return res


def kv_files(directory):
    """{name: BF16 bits (NumPy, 1-D)} of the real KV files in directory (.safetensors, .npz)."""
    import glob

    found = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors")) + glob.glob(os.path.join(directory, "*.npz"))):
        if path.endswith(".npz"):
            with np.load(path) as f:
                tensors = [f[key] for key in sorted(f.files)]
        else:
            import ml_dtypes  # noqa: F401  (safetensors.numpy needs NumPy's bfloat16)
            from safetensors.numpy import load_file

            tensors = [v for _, v in sorted(load_file(path).items())]
        found[os.path.basename(path)] = np.concatenate([t.view(np.uint16).ravel() for t in tensors])
    return found


def bench_families(cupy, timeit, directory, n):
    """BF16 encode/decode of each real KV file in directory, tiled to n values, with the default
    and the auto codebook."""
    import kvzip

    rows = {}
    for name, bits in kv_files(directory).items():
        y = cupy.asarray(np.resize(bits, n))
        for codebook in (None, "auto"):
            row = bench_kvzip(cupy, timeit, y, "bf16", pipe=kvzip.splitzip_pipeline(codebook))
            rows[f"{name} {codebook or 'default'}"] = row
            print("family", name, codebook, row, flush=True)
        del y
    return rows


def run(values_log2=28, repeat=20, out_dir="benchmarks/results", quick=False, kv_dir=None):
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
    k["bf16_auto"] = bench_kvzip(cupy, timeit, x, "bf16", pipe=kvzip.splitzip_pipeline("auto"))
    print("bf16_auto", k["bf16_auto"], flush=True)

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

    res["escape_sweep"] = bench_escape_sweep(cupy, timeit, host, x)
    res["small_blocks"] = bench_small_blocks(cupy, timeit, x)
    print("small_blocks", res["small_blocks"], flush=True)
    res["into"] = bench_into(cupy, timeit, x)
    if kv_dir:
        res["families"] = bench_families(cupy, timeit, kv_dir, n)

    if not quick:
        res["nvcomp"], res["versions"]["nvcomp"] = bench_nvcomp(cupy, _timer(cupy, max(5, repeat // 4), 1), x)
        print("nvcomp", res["nvcomp"], flush=True)

    os.makedirs(out_dir, exist_ok=True)
    stem = gpu_tag(gpu)
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
    for row in res.get("escape_sweep", {}).get("rows", []):
        print(f"escapes {100 * row['escape_rate']:6.2f} % ({row['data']}): ratio {row['ratio']}, "
              f"encode {row['encode_GBps']} GB/s, decode {row['decode_GBps']} GB/s, lossless {row['lossless']}")
    if "small_blocks" in res:
        b = res["small_blocks"]
        print(f"32 KiB blocks: alone {b['ratio_alone']}x, packed {b['ratio_packed']}x, header {b['header_bytes']} B")
    if "into" in res:
        for name in ("encode", "decode"):
            print(f"into {name}: {res['into'][name]}")


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
    ap.add_argument("--kv", metavar="DIR", help="also measure each real KV file (.safetensors, .npz) in DIR")
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
    run(a.values_log2, a.repeat, a.out, a.quick, a.kv)
    print(f"bench took {time.time() - t:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
