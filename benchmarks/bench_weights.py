"""ZipLinear's fused decode+GEMM against cuBLAS on one GPU, same run: Llama-3-8B and -70B
shapes, N = 1..256; plus the standalone decoder against a device copy, the GPU encoder, the
accuracy of both products against FP32, and (where the real weights are given) the layout's
ratio on them.

    python benchmarks/bench_weights.py --out benchmarks/results            # on a GPU
    python benchmarks/bench_weights.py --real ../shared/data/weights/minilm-l6_weights_bf16.safetensors

Method.  Weights are synthetic with the statistics of trained ones (Student-t, 5 degrees of
freedom, per-row log-normal scales), BF16.  Each timing is a CUDA graph of calls over rotating
copies of the weight (working set >= 400 MB, so L2 holds none of it), replayed 5 times; the
median replay over its calls is the time of one call.  The encoder: the median of 5 synchronised
calls (benchmarks/weights_encode.py times it alone, with an A/B).  cuBLAS is torch's: F.linear
(and torch.mv at N = 1; the better counts).  kvzip: the fused kernel (kvz_w_gemm, to
ZipLinear.route_n = 32) and decode + cuBLAS; the better of the two is what ZipLinear's routing
should take, and the speedup is cuBLAS time over it.  kvz_w_gemm_wide, at every N: the candidate
for N > 32 (wide_ms, wide_speedup; benchmarks/NOTES.md w8).  For N above route_n, also the
candidate route of weights_sliced.py
(band slices decoded into L2-sized scratch, overlapping the GEMMs; sliced_speedup).  DFloat11,
where the `dfloat11` package is installed: its format of the same weight
(benchmarks/dfloat11_baseline.py), its own decoder alone and into a scratch W before cuBLAS, on
rotating copies as well.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import kvzip.weights as kw
from kvzip.bench import torch_gpu_tag
from kvzip.bench_cpu import code_commit
from kvzip.weights import tiled
from kvzip.weights.linear import fused_product

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the baselines and candidates beside this file
import dfloat11_baseline as df11  # noqa: E402
from weights_sliced import SlicedProduct  # noqa: E402

SHAPES = {"llama3-8b": [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1024, 4096)],
          "llama3-70b": [(10240, 8192), (8192, 8192), (57344, 8192), (8192, 28672)]}
NS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WORKING_SET = 400e6
REPLAYS = 5
ENCODE_REPS = 5   # the encoder's time: the median of this many synchronised calls
# The targets (speedup over the best cuBLAS path, same run).
TARGETS = {"n1_largest": 1.20, "n1_4096": 1.0, "n16": 1.15, "n64": 1.0, "n128": 0.95, "n256_time": 1.10,
           "decode_tbs": 2.2, "encode_gbs": 50.0, "ratio": 1.333}


def synthetic(m, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.distributions.StudentT(torch.tensor(5.0, device="cuda")).sample((m, k))
    scale = torch.exp(torch.randn(m, 1, device="cuda", generator=g) * 0.3) * 0.02
    return (t * scale).to(torch.bfloat16)


def graph_ms(calls) -> float:
    """ms of one call: a graph of ``calls`` (zero-argument functions), replayed REPLAYS times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    g.replay()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / len(calls))
    del g
    return statistics.median(times)


def rotation(nbytes) -> int:
    return max(1, math.ceil(WORKING_SET / nbytes))


def encode_s(w) -> float:
    """Seconds of one tiled.encode(w) on the GPU, synchronised before and after."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tiled.encode(w)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_shape(m, k, seed, progress, ns=NS):
    w = synthetic(m, k, seed)
    tw = tiled.encode(w)  # first-use costs (kernel loads), and w's generation, off the clock
    encode_times = [encode_s(w) for _ in range(ENCODE_REPS)]
    zl = kw.ZipLinear(tw)
    raw_copies = [w] + [w.clone() for _ in range(rotation(w.numel() * 2) - 1)]
    zip_copies = [zl] + [kw.ZipLinear(tiled.TiledWeight(tw.shape, *(a.clone() for a in tw.arrays())))
                         for _ in range(rotation(tw.nbytes) - 1)]
    row = {"shape": [m, k], "ratio": tw.ratio, "escapes": tw.escapes,
           "encode_gbs": m * k * 2 / statistics.median(encode_times) / 1e9, "copies": [len(raw_copies), len(zip_copies)], "n": {}}

    decoded = [torch.empty(m, k, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    decode_ms = graph_ms([lambda z=z, o=decoded[i % 2]: _decode_into(z, o) for i, z in enumerate(_cycle(zip_copies, 20))])
    copy_ms = graph_ms([lambda r=r, o=decoded[i % 2]: o.copy_(r) for i, r in enumerate(_cycle(raw_copies, 20))])
    row["decode"] = {"ms": decode_ms, "tbs_out": m * k * 2 / decode_ms / 1e9, "copy_ms": copy_ms,
                     "copy_tbs_out": m * k * 2 / copy_ms / 1e9}
    assert torch.equal(zl.decompress_weight(), w)
    progress(f"  {m}x{k} decode: {row['decode']['tbs_out']:.3f} TB/s of BF16 (a copy of W: {row['decode']['copy_tbs_out']:.3f})")
    df11_copies = _dfloat11_copies(w, row, decoded, progress)
    sliced = [SlicedProduct(z.tiled) for z in zip_copies]
    x_check = torch.randn(64, k, device="cuda").to(torch.bfloat16)
    assert _close(sliced[0](x_check), F.linear(x_check, w)), "the sliced route's product is not the Linear's"

    for n in ns:
        x = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        calls = max(20, len(raw_copies))
        cublas = graph_ms([lambda r=r: F.linear(x, r) for r in _cycle(raw_copies, calls)])
        entry = {"cublas_linear_ms": cublas}
        if n == 1:
            entry["cublas_mv_ms"] = graph_ms([lambda r=r: torch.mv(r, x[0]) for r in _cycle(raw_copies, calls)])
        best_cublas = min(v for key, v in entry.items() if key.startswith("cublas"))
        calls = max(20, len(zip_copies))
        if n <= kw.ZipLinear.route_n:
            entry["fused_ms"] = graph_ms([lambda z=z: z(x) for z in _cycle(zip_copies, calls)])
        # kvz_w_gemm_wide at every N, routed by ZipLinear or not (NOTES w8): the candidate's time
        entry["wide_ms"] = graph_ms([lambda z=z: wide_product(z, x) for z in _cycle(zip_copies, calls)])
        entry["wide_speedup"] = best_cublas / entry["wide_ms"]
        entry["decode_cublas_ms"] = graph_ms([lambda z=z: F.linear(x, z.decompress_weight()) for z in
                                              _cycle(zip_copies, calls)])
        if n > kw.ZipLinear.route_n:  # the candidate wide-x route (weights_sliced.py), not ZipLinear's yet
            entry["sliced_ms"] = graph_ms([lambda p=p: p(x) for p in _cycle(sliced, calls)])
            entry["sliced_speedup"] = best_cublas / entry["sliced_ms"]
        if df11_copies:  # DFloat11's decoder into a scratch W, then cuBLAS: its way of running a Linear
            entry["dfloat11_cublas_ms"] = graph_ms([lambda d=d: F.linear(x, _dfloat11_decoded(d, decoded[0]))
                                                    for d in _cycle(df11_copies, max(20, len(df11_copies)))])
        ours = min(v for key, v in entry.items() if key in ("fused_ms", "decode_cublas_ms"))
        entry.update(best_cublas_ms=best_cublas, kvzip_ms=ours, speedup=best_cublas / ours,
                     route="fused" if ours == entry.get("fused_ms") else "decode_cublas")
        if n in (16, 128):  # kvz_w_gemm's and kvz_w_gemm_wide's sums
            ref = x.float() @ w.float().T
            scale = ref.abs().max()
            assert _close(wide_product(zl, x), F.linear(x, w)), "kvz_w_gemm_wide's product is not the Linear's"
            entry["max_err_rel_to_max"] = {"kvzip": float((zl(x).float() - ref).abs().max() / scale),
                                           "wide": float((wide_product(zl, x).float() - ref).abs().max() / scale),
                                           "cublas": float((F.linear(x, w).float() - ref).abs().max() / scale)}
        row["n"][str(n)] = entry
        others = "".join(f", {name} {entry[key] * 1e3:.1f} us" for name, key in
                         (("wide", "wide_ms"), ("sliced", "sliced_ms"), ("DFloat11+cuBLAS", "dfloat11_cublas_ms")) if key in entry)
        progress(f"  {m}x{k} N={n}: cuBLAS {best_cublas * 1e3:.1f} us, kvzip {ours * 1e3:.1f} us "
                 f"({entry['route']}), {best_cublas / ours:.3f}x{others}")
    return row


def wide_product(z, x):
    """x W^T by kvz_w_gemm_wide whatever N is (tiled_linear takes it above N = 32; no bias)."""
    return fused_product(z.tiled, x, None, z.tickets, wide=True)


def _close(a, b) -> bool:
    """Within BF16 rounding of each other (the sliced route's GEMMs may order sums differently)."""
    return bool(torch.allclose(a.float(), b.float(), rtol=2 ** -7, atol=1e-3 * float(b.float().abs().max())))


def _dfloat11_copies(w, row, decoded, progress) -> list:
    """DFloat11's format of w on rotating copies (row["dfloat11"]: ratio, its standalone decoder's
    time, checked exact), or [] where the dfloat11 package is not installed."""
    if df11.package_dir() is None:
        return []
    m, k = w.shape
    state = df11.encode(w)
    df11.decode(state, decoded[0].view(-1))
    assert torch.equal(decoded[0].view(torch.int16), w.view(torch.int16)), "DFloat11 did not decode w exactly"
    size = df11.nbytes(state)
    copies = [state] + [{key: v.clone() if torch.is_tensor(v) else v for key, v in state.items()}
                        for _ in range(rotation(size) - 1)]
    ms = graph_ms([lambda d=d, o=decoded[i % 2]: df11.decode(d, o.view(-1)) for i, d in enumerate(_cycle(copies, 20))])
    row["dfloat11"] = {"ratio": 2 * m * k / size, "copies": len(copies), "decode_ms": ms,
                       "decode_tbs_out": 2 * m * k / ms / 1e9}
    progress(f"  {m}x{k} DFloat11: ratio {2 * m * k / size:.4f}, decode {2 * m * k / ms / 1e9:.2f} TB/s")
    return copies


def _dfloat11_decoded(state, out):
    df11.decode(state, out.view(-1))
    return out


def _decode_into(z, out):
    from kvzip.gpu import weights as gpu

    gpu.decode(z.tiled, out, tiled.cuda_stream(out.device.index))


def _cycle(items, count):
    return [items[i % len(items)] for i in range(count)]


def summary(rows):
    by_shape = {tuple(r["shape"]): r for r in rows}
    largest = sorted(by_shape, key=lambda s: -s[0] * s[1])[:4]
    sp = lambda s, n: by_shape[s]["n"][str(n)]["speedup"]  # noqa: E731
    out = {
        "n1_largest": {f"{s[0]}x{s[1]}": sp(s, 1) for s in largest},
        "n1_4096": sp((4096, 4096), 1) if (4096, 4096) in by_shape else None,
        "n16_min": min(sp(s, 16) for s in by_shape), "n64_min": min(sp(s, 64) for s in by_shape),
        "n128_min": min(sp(s, 128) for s in by_shape),
        "n256_time_max": max(1 / sp(s, 256) for s in by_shape),
        "decode_tbs_min": min(r["decode"]["tbs_out"] for r in rows),
        "encode_gbs_min": min(r["encode_gbs"] for r in rows),
    }
    out["sliced_min"] = {n: min(r["n"][n]["sliced_speedup"] for r in rows) for n in rows[0]["n"]
                         if "sliced_speedup" in rows[0]["n"][n]}
    # the wide kernel at every N, routed or not: what routing N > 32 to it would give (NOTES w8)
    out["wide_min"] = {n: min(r["n"][n]["wide_speedup"] for r in rows) for n in rows[0]["n"]
                       if "wide_speedup" in rows[0]["n"][n]}
    if all("dfloat11" in r for r in rows):  # the same run's DFloat11: its decoder, and kvzip's time against its Linear
        out["dfloat11_decode_tbs_max"] = max(r["dfloat11"]["decode_tbs_out"] for r in rows)
        out["vs_dfloat11_min"] = {n: min(r["n"][n]["dfloat11_cublas_ms"] / r["n"][n]["kvzip_ms"] for r in rows)
                                  for n in rows[0]["n"]}
    out["met"] = {"n1_largest": min(out["n1_largest"].values()) >= TARGETS["n1_largest"],
                  "n1_4096": out["n1_4096"] is not None and out["n1_4096"] >= TARGETS["n1_4096"],
                  "n16": out["n16_min"] >= TARGETS["n16"], "n64": out["n64_min"] >= TARGETS["n64"],
                  "n128": out["n128_min"] >= TARGETS["n128"], "n256": out["n256_time_max"] <= TARGETS["n256_time"],
                  "decode": out["decode_tbs_min"] >= TARGETS["decode_tbs"],
                  "encode": out["encode_gbs_min"] >= TARGETS["encode_gbs"]}
    return out


def real_ratio(path):
    from safetensors.torch import load_file

    tensors = load_file(path)
    per = {}
    raw = stored = 0
    for name, w in tensors.items():
        if w.dtype != torch.bfloat16 or w.dim() != 2:
            continue
        tw = tiled.encode(w)
        assert torch.equal(tiled.decode(tw).view(torch.int16), w.view(torch.int16))
        per[name] = {"shape": list(w.shape), "ratio": tw.ratio, "escapes": tw.escapes}
        raw += w.numel() * 2
        stored += tw.nbytes
    return {"file": Path(path).name, "matrices": len(per), "pooled": raw / stored,
            "min": min(v["ratio"] for v in per.values()), "per_matrix": per}


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        ns = [int(n) for n in r["n"]]
        ax.plot(ns, [r["n"][str(n)]["speedup"] for n in ns], marker="o", label=f"{r['shape'][0]}x{r['shape'][1]}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (tokens in the batch)")
    ax.set_ylabel("speedup over the best cuBLAS path")
    ax.set_title("ZipLinear (kvzip tiled layout) vs cuBLAS, BF16, CUDA graphs")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def environment():
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    env["commit"] = code_commit()
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count, cuda=torch.version.cuda)
        try:
            import cupy

            env["cupy"] = cupy.__version__
        except ImportError:
            pass
    return env


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--real", type=Path, help="a .safetensors of real BF16 weights: the layout's ratio on them")
    ap.add_argument("--shapes", default="all", help="'all', or a comma list like 4096x4096,1024x4096")
    ap.add_argument("--tag", default=None,
                    help="the result files' suffix (default: the GPU's short name, kvzip.bench.gpu_tag)")
    ap.add_argument("--profile", metavar="MxK", help="run the fused kernel once for each N of --ns (eagerly, for "
                    "ncu) and the decoder once, then stop")
    ap.add_argument("--ns", help="comma list of N (default: every N of the issue's list; with --profile 1,16,64)")
    args = ap.parse_args(argv)
    args.tag = args.tag or torch_gpu_tag()
    if args.profile:
        m, k = (int(v) for v in args.profile.split("x"))
        zl = kw.ZipLinear(tiled.encode(synthetic(m, k, 0)))
        for n in (int(v) for v in (args.ns or "1,16,64").split(",")):
            zl(torch.randn(n, k, device="cuda").to(torch.bfloat16))
        zl.decompress_weight()
        torch.cuda.synchronize()
        return
    progress = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    result = {"environment": environment(), "targets": TARGETS}
    if args.real:
        result["real_ratio"] = real_ratio(args.real)
        progress(f"ratio on {args.real.name}: pooled {result['real_ratio']['pooled']:.4f}, "
                 f"min {result['real_ratio']['min']:.4f}")
    args.out.mkdir(parents=True, exist_ok=True)
    name = f"weights-{args.tag}.json" if torch.cuda.is_available() else "weights-ratio-cpu.json"
    write = lambda: (args.out / name).write_text(json.dumps(result, indent=1) + "\n")  # noqa: E731
    if torch.cuda.is_available():
        shapes = [s for group in SHAPES.values() for s in group]
        if args.shapes != "all":
            shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
        ns = tuple(int(v) for v in args.ns.split(",")) if args.ns else NS
        result["shapes"], result["summary"] = [], None
        for i, (m, k) in enumerate(shapes):
            progress(f"[{i + 1}/{len(shapes)}] {m}x{k}")
            result["shapes"].append(bench_shape(m, k, seed=i, progress=progress, ns=ns))
            write()  # a run stopped part-way keeps the shapes it finished (the summary stays null)
            torch.cuda.empty_cache()
        if args.shapes == "all" and ns == NS:
            result["summary"] = summary(result["shapes"])
        plot(result["shapes"], args.out / f"weights-{args.tag}.png")
    write()
    progress(f"wrote {args.out / name}")
    if result.get("summary"):
        progress(json.dumps(result["summary"], indent=1))


if __name__ == "__main__":
    main()
