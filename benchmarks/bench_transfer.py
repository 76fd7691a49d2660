"""KV transfer benchmark: raw vs kvzip (speed mode) vs kvzip-ratio (ratio mode) vs codec="auto" (and
nvCOMP ANS) through kvzip.transfer.

Two processes: this one sends, a child receives (``--role rx``), both through Mooncake Transfer
Engine.  On a GPU the engine moves bytes by CUDA IPC between the two processes on the one GPU
(MC_INTRANODE_NVLINK=1), and the links of 10-200 GB/s are EMULATED by kvzip.transfer's pacer (a
token bucket over the bytes actually sent, so a raw transfer measures the nominal rate); "ipc" is
the unpaced CUDA IPC copy itself, and "tcp" Mooncake's real, unemulated TCP transport
(MC_FORCE_TCP=1, GPU memory staged through the host).  With --mps (the default on a GPU) both
processes are clients of one CUDA MPS server, so their kernels share the GPU as two GPUs' kernels
would run side by side; without it the GPU time-slices between the two contexts, which slows
every codec call 1.5-2.4x (benchmarks/transfer_diag.py, benchmarks/NOTES.md).

KV: real BF16 KV (the SmolLM2 sample shipped in kvzip, and MiniLM-L6 KV when --minilm points at
its safetensors file), tiled into Llama-3-8B (32 layers) and Llama-3-70B (80 layers) shapes: per
layer K and V of [8 KV heads, tokens, 128].  Each layer starts at a different offset of the real
values.  Time is from ``send`` until ``wait`` returns, which is when the receiver has decoded
every layer; every received request is checked bit for bit (a checksum of every tensor, computed
on both sides).  The analytical model, fill + (groups - 1) x max(encode, wire, decode) with the
per-group times this run measured, is written beside each measurement.

    python benchmarks/bench_transfer.py                       # the full sweep on a GPU
    python benchmarks/bench_transfer.py --device cpu --quick  # a small CPU run (Mooncake TCP)
    python benchmarks/bench_transfer.py --gpus 2 --engine torch   # GPU 0 -> GPU 1 over NCCL
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time

import numpy as np

from kvzip.bench import gpu_tag
from kvzip.testing import real_kv_layers

SHAPES = {"llama3-8b": 32, "llama3-70b": 80}
KV_HEADS, HEAD_DIM = 8, 128
LINKS = [10, 25, 50, 100, 200]
RAW_AGAIN = "raw-again"  # --aa: raw a second time, a control: what identical transfers differ by
SMALL_GIB, SMALL_REPS = 2.0, 11  # requests this small take a few ms, and one run varies by ~10 %


# ---------------------------------------------------------------------------------- KV data
def real_values(minilm: str | None):
    """{family: 1-D uint16 array of real BF16 KV bits}."""
    from kvzip.data import load_sample

    fams = {"smollm2": np.concatenate([v.view(np.uint16).reshape(-1) for v in load_sample("prose").values()])}
    if minilm and os.path.exists(minilm):
        from safetensors.numpy import load_file

        d = load_file(minilm)
        fams["minilm"] = np.concatenate([d[k].view(np.uint16).reshape(-1) for k in sorted(d)])
    return fams


def digest(layers) -> str:
    """A checksum of every tensor's bytes (kvzip's sum64, on the tensor's device)."""
    import torch

    from kvzip.checksum import sum64
    parts = []
    for layer in layers:
        for t in (layer if isinstance(layer, tuple) else (layer,)):
            u8 = t.contiguous().reshape(-1).view(torch.uint8)
            if t.is_cuda:
                import cupy

                parts.append(sum64(cupy, cupy.asarray(u8)))
            else:
                parts.append(sum64(np, u8.numpy()))
    return f"{hash(tuple(parts)) & (2**64 - 1):016x}"


def free_gpu_pools(device: str, torch_cache: bool) -> None:
    """Give cached GPU memory back.  CuPy's pool (nvCOMP's outputs) after every request, or it
    and torch's cache would each keep the largest request's worth; torch's cache only between
    shapes, since emptying it per request makes every later allocation a cudaMalloc, which
    costs raw (a tensor per allocation) more than kvzip (one buffer per call)."""
    if device == "cpu":
        return
    import cupy
    import torch

    cupy.get_default_memory_pool().free_all_blocks()
    if torch_cache:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- nvCOMP
def nvcomp_codec():
    """nvCOMP ANS (data_type '<f2', its best setting for BF16 KV) as a kvzip.transfer wire codec,
    or None when nvidia.nvcomp is not importable."""
    try:
        import cupy
        from nvidia import nvcomp
    except ImportError:
        return None
    import torch

    from kvzip import transfer

    class NvcompAns(transfer.WireCodec):
        name = "nvcomp-ans"

        def __init__(self):
            self.codec = nvcomp.Codec(algorithm="ANS", data_type="<f2")

        def encode(self, tensors):
            out = []
            for t in tensors:
                if t.dtype != torch.bfloat16 or not t.is_cuda:
                    out.append(None)
                    continue
                arr = cupy.asarray(t.contiguous().reshape(-1).view(torch.int16)).view(cupy.float16)
                comp = self.codec.encode(nvcomp.as_array(arr))
                cupy.cuda.Device().synchronize()
                u8 = cupy.asarray(comp).view(cupy.uint8).reshape(-1)[: comp.buffer_size]
                out.append(torch.as_tensor(u8, device=t.device))
            return out

        def decode(self, views, entries):
            # Into torch memory, as the other codecs' outputs are: a 40 GiB request's outputs in
            # CuPy's pool beside torch's cache of the previous request's would not fit one GPU.
            out = []
            for v, e in zip(views, entries):
                d = self.codec.decode(nvcomp.as_array(cupy.asarray(v)))
                cupy.cuda.Device().synchronize()
                t = torch.empty(e["shape"], dtype=torch.bfloat16, device=v.device)
                cupy.asarray(t.view(torch.int16)).reshape(-1)[...] = cupy.asarray(d).view(cupy.int16).reshape(-1)
                out.append(t)
            cupy.cuda.Device().synchronize()
            return out

    return NvcompAns()


# ---------------------------------------------------------------------------------- profiling
class Profile:
    """--profile: yappi's CPU clock over every thread of this process while ``on``; ``dump``
    writes each thread's functions by their own time (where a stage's host time goes)."""

    def __init__(self, path: str | None):
        self.path, self.running = path, False
        if path:
            import importlib

            importlib.import_module("yappi")  # fail at start, not after the run

    def on(self) -> None:
        if self.path and not self.running:
            import yappi

            yappi.set_clock_type("cpu")
            yappi.start(profile_threads=True)
            self.running = True

    def dump(self, top: int = 30) -> None:
        if not self.running:
            return
        import threading

        import yappi

        yappi.stop()
        names = {t.ident: t.name for t in threading.enumerate()}
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with open(self.path, "w") as f:
            for th in sorted(yappi.get_thread_stats(), key=lambda th: -th.ttot):
                funcs = yappi.get_func_stats(ctx_id=th.id)
                f.write(f"== thread {names.get(th.tid, th.name)}: {th.ttot * 1e3:.1f} ms CPU\n")
                for x in sorted(funcs, key=lambda x: -x.tsub)[:top]:
                    f.write(f"  {x.tsub * 1e3:9.2f} ms own {x.ttot * 1e3:9.2f} ms total {x.ncall:7d} calls  "
                            f"{x.name} {os.path.relpath(x.module) if x.module.startswith('/') else x.module}:{x.lineno}\n")
        yappi.clear_stats()
        self.running = False


# ---------------------------------------------------------------------------------- receiver
def receiver_main(args) -> None:
    from kvzip import transfer

    wire = nvcomp_codec()
    if wire is not None:
        transfer.register_codec(wire)
    rx = transfer.Receiver(engine=args.engine, device=args.device, slot_bytes=args.slot_mib << 20,
                           ring_bytes=args.slots * (args.slot_mib << 20))
    print(rx.address, flush=True)
    prof = Profile(args.profile and os.path.join(args.profile, "rx.txt"))
    for line in sys.stdin:
        cmd, _, name = line.strip().partition(" ")
        if cmd == "quit":
            break
        if cmd == "profile":  # the sender's timed requests begin
            prof.on()
            continue
        if cmd == "free":  # the sender moves to another shape
            free_gpu_pools(args.device, torch_cache=True)
            continue
        try:
            kv = rx.receive(name, timeout=600)
            print(f"ok {name} {digest(kv)}", flush=True)
            del kv
            free_gpu_pools(args.device, torch_cache=False)
        except Exception as e:  # noqa: BLE001  the sender reports it
            print(f"error {name} {type(e).__name__}: {str(e)[:200]}", flush=True)
    prof.dump()
    rx.close()


class Peer:
    """The receiver child process, spoken to over its stdin/stdout."""

    def __init__(self, args, env):
        cmd = [sys.executable, os.path.abspath(__file__), "--role", "rx", "--device", rx_device(args),
               "--engine", args.engine,
               "--slot-mib", str(args.slot_mib), "--slots", str(args.slots)]
        if args.profile:
            cmd += ["--profile", args.profile]
        if args.switch_interval is not None:
            cmd += ["--switch-interval", str(args.switch_interval)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.address = self.proc.stdout.readline().strip()
        if ":" not in self.address:
            raise RuntimeError(f"receiver did not start: {self.address!r}")

    def expect(self, name: str) -> None:
        self.proc.stdin.write(f"recv {name}\n")
        self.proc.stdin.flush()

    def free(self) -> None:
        self.proc.stdin.write("free\n")
        self.proc.stdin.flush()

    def profile(self) -> None:
        self.proc.stdin.write("profile\n")
        self.proc.stdin.flush()

    def result(self) -> tuple[str, str]:
        status, _, rest = self.proc.stdout.readline().strip().partition(" ")
        return status, rest.partition(" ")[2]

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


# ---------------------------------------------------------------------------------- sender
def rx_device(args) -> str:
    """The receiver's device: the sender's GPU, or the second GPU with --gpus 2."""
    return "cuda:1" if args.gpus == 2 else args.device


def transports_of(args) -> list[str]:
    """The real links this run measures (emulated rates are paced on the first)."""
    if args.engine == "torch":
        return ["gloo" if args.device == "cpu" else "nccl"]
    got = ["tcp", "ipc"] if args.device != "cpu" else ["tcp"]  # tcp (short requests only) before the time budget runs out
    if args.only_tcp:
        got = ["tcp"]
    if args.no_tcp:
        got = [t for t in got if t != "tcp"]
    return got


def paced_transport(args) -> str:
    """The real link the emulated rates are paced on: the first measured that is not TCP."""
    return next((t for t in transports_of(args) if t != "tcp"), "tcp")


def engine_env(transport: str) -> dict:
    env = dict(os.environ)
    env.pop("MC_FORCE_TCP", None)
    env.pop("MC_INTRANODE_NVLINK", None)
    if transport == "tcp":
        env["MC_FORCE_TCP"] = "1"
    elif transport == "ipc":
        env["MC_INTRANODE_NVLINK"] = "1"
    return env


def model(stats: dict, link_gbps: float | None) -> dict:
    """The pipelined model from this run's own per-group times."""
    g = max(stats["groups"], 1)
    enc = stats["encode_s"] / g
    dec = stats["decode_s"] / g
    wire = stats["sent_bytes"] / g / (link_gbps * 1e9) if link_gbps else stats["write_s"] / g
    return {"encode_ms": enc * 1e3, "decode_ms": dec * 1e3, "wire_ms": wire * 1e3,
            "predicted_ms": (enc + dec + (g - 1) * max(enc, wire, dec) + wire) * 1e3}


# Segments of a group's way, between the perf_counter marks kvzip.transfer records (sender:
# stats["timeline"], receiver: stats["receiver_timeline"]; one host, so one clock for both).
# "tx to writer" is the wait for the encode's GPU work and for the writer to be free; "rx drain"
# the receiver's stream synchronisation (its GPU work) and the digest's check.  On the CPU the
# host times hold the copies themselves.
SEGMENTS = {"tx slot wait": ("queued", "slot"), "tx codec (host)": ("slot", "coded"),
            "tx pack+digest (host)": ("coded", "packed"), "tx to writer": ("packed", "encoded"),
            "tx credit wait": ("encoded", "credit"), "tx engine write": ("credit", "written"),
            "tx pacing": ("written", "arrival"), "tx notify": ("arrival", "notified"),
            "rx control lag": ("notified", "received"), "rx queue": ("received", "decode_from"),
            "rx unpack (host)": ("decode_from", "unpacked"), "rx drain": ("unpacked", "decoded")}


def stage_breakdown(stats: dict) -> dict:
    """Per segment, the median over the request's groups of its length in ms; plus the whole
    request's span from the first group queued to the last decoded."""
    tx, rx = stats.get("timeline") or [], stats.get("receiver_timeline") or []
    groups = [{**a, **b} for a, b in zip(tx, rx)]
    out = {}
    for name, (a, b) in SEGMENTS.items():
        spans = [g[b] - g[a] for g in groups if a in g and b in g]
        if spans:
            out[name] = round(statistics.median(spans) * 1e3, 4)
    if groups and "queued" in groups[0] and "decoded" in groups[-1]:
        out["first queued to last decoded"] = round((groups[-1]["decoded"] - groups[0]["queued"]) * 1e3, 4)
    return out


def run_link(tx, peer, layers, want: str, link, link_gbps, codecs, reps, tag, log, stages=False) -> list[dict]:
    rows = []
    for rep in range(reps):
        # Each rep runs the codecs in an order of its own (shuffled, seeded by the row and rep),
        # so no codec always follows the same one: a request's allocations land in the
        # receiver's caches as the previous request left them, and a rotation would keep every
        # codec's predecessor fixed (NOTES t12).
        order = list(codecs)
        random.Random(f"{tag}-{link}-{rep}").shuffle(order)
        for c in order:
            name = f"{tag}-{link}-{c}-{rep}"
            peer.expect(name)
            t0 = time.perf_counter()
            h = tx.send(name, layers, codec="raw" if c == RAW_AGAIN else c)
            try:
                stats = h.wait(timeout=900)
            except Exception as e:  # noqa: BLE001
                peer.result()
                rows.append({"codec": c, "rep": rep, "error": f"{type(e).__name__}: {e}"[:300]})
                log(f"  {c:11s} rep {rep}: FAILED {e}")
                continue
            dt = time.perf_counter() - t0
            status, got = peer.result()
            exact = status == "ok" and got == want
            row = {"codec": c, "chosen": stats["codec"], "rep": rep, "seconds": dt, "exact": exact,
                   "raw_bytes": stats["raw_bytes"], "sent_bytes": stats["sent_bytes"], "groups": stats["groups"],
                   "ratio": stats["raw_bytes"] / max(stats["sent_bytes"], 1), "auto": stats.get("auto"),
                   "effective_GBps": stats["raw_bytes"] / dt / 1e9, "model": model(stats, link_gbps),
                   "stages_ms": stage_breakdown(stats)}
            if link_gbps:
                wire = stats["sent_bytes"] / (link_gbps * 1e9)
                row["wire_s"] = wire
                row["exposed_codec_s"] = dt - wire
            rows.append(row)
            if stages and rep == reps - 1:
                log(f"  {c:11s} per group, ms: " + ", ".join(f"{k} {v:.3f}" for k, v in row["stages_ms"].items()))
            if not exact:
                log(f"  {c:11s} rep {rep}: NOT BIT-EXACT ({status} {got} vs {want})")
    return rows


def summarize(rows, codecs) -> dict:
    out = {}
    for c in codecs:
        ok = [r for r in rows if r["codec"] == c and "seconds" in r]
        if ok:
            out[c] = {"median_s": statistics.median(r["seconds"] for r in ok),
                      "all_s": [round(r["seconds"], 6) for r in ok],
                      "exact": all(r["exact"] for r in ok), "ratio": ok[0]["ratio"], "chosen": ok[-1]["chosen"]}
            if "exposed_codec_s" in ok[0]:
                out[c]["exposed_codec_s"] = statistics.median(r["exposed_codec_s"] for r in ok)
                out[c]["wire_s"] = ok[0]["wire_s"]
    if "raw" in out:
        for c, v in out.items():
            v["speedup_vs_raw"] = out["raw"]["median_s"] / v["median_s"]
            if c != "raw":
                v["paired_vs_raw"] = paired_speedup(rows, c)
    return out


def paired_speedup(rows, codec: str, resamples: int = 2000) -> dict | None:
    """raw's time over codec's, rep by rep (the reps interleave the codecs, so a pair ran close
    in time and shares the machine's drift): their median and a bootstrap 90 % interval of it,
    which says whether a codec is within a few per cent of raw when single runs spread more."""
    raw = {r["rep"]: r["seconds"] for r in rows if r["codec"] == "raw" and "seconds" in r}
    pairs = np.array([raw[r["rep"]] / r["seconds"] for r in rows
                      if r["codec"] == codec and "seconds" in r and r["rep"] in raw])
    if pairs.size < 2:
        return None
    picks = np.random.default_rng(0).integers(0, pairs.size, (resamples, pairs.size))
    lo, hi = np.percentile(np.median(pairs[picks], axis=1), [5, 95])
    return {"median": float(np.median(pairs)), "ci90": [float(lo), float(hi)], "pairs": int(pairs.size)}


def sender_main(args) -> int:
    import torch

    from kvzip import transfer

    t_start = time.monotonic()
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    wire = nvcomp_codec() if args.device != "cpu" and not args.no_nvcomp else None
    if wire is not None:
        transfer.register_codec(wire)
    codecs = (["raw", *args.codecs, "auto"] + (["nvcomp-ans"] if wire is not None else [])
              + ([RAW_AGAIN] if args.aa else []))
    fams = real_values(args.minilm)
    res = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"), "host": platform.node(),
           "device": torch.cuda.get_device_name() if args.device != "cpu" else platform.processor() or "cpu",
           "versions": _versions(), "args": vars(args), "codecs": codecs,
           "mps": bool(args.mps and args.device != "cpu"),
           "engine": args.engine, "gpus": args.gpus,
           "emulation": f"links given in GB/s are emulated: real {args.engine} writes ({paced_transport(args)}, "
                        f"{'GPU 0 to GPU 1' if args.gpus == 2 else 'one device'}) paced by a token bucket over the "
                        "bytes sent; 'ipc', 'nccl' and 'gloo' are those writes unpaced; 'tcp' is Mooncake's real "
                        "TCP transport, unemulated",
           "runs": []}
    out_path = args.out
    prof = Profile(args.profile and os.path.join(args.profile, "tx.txt"))
    for transport in transports_of(args):
        env = engine_env(transport)
        os.environ.clear()
        os.environ.update(env)
        peer = Peer(args, env)
        tx = transfer.Sender(peer.address, engine=args.engine, group_bytes=args.group_mib << 20 if args.group_mib else None)
        try:
            for fam, values in fams.items():
                for shape, n_layers in SHAPES.items():
                    for tokens in args.tokens:
                        if transport == "tcp" and tokens > args.tcp_max_tokens:
                            continue
                        if fam != "smollm2" and (tokens != min(args.tokens) or shape != "llama3-8b"):
                            continue  # the second family on the smallest shape only
                        if time.monotonic() - t_start > args.max_seconds:
                            log(f"time budget of {args.max_seconds} s spent: skipping the rest")
                            break
                        layers = real_kv_layers(n_layers, tokens, args.device, values, KV_HEADS, HEAD_DIM)
                        want = digest(layers)
                        gib = sum(t.nbytes for l in layers for t in l) / 2**30
                        tag = f"{fam}-{shape}-{tokens}"
                        links = [None] if transport == "tcp" else [transport] + args.links
                        # One untimed request per codec first: the engine's first write to a new
                        # buffer, kernels' first launch and the allocators' first blocks of this
                        # size would otherwise land in whichever codec is measured first.
                        tx.set_link(None)
                        run_link(tx, peer, layers, want, "warm-up", None, codecs, 1, tag, log)
                        if args.profile:
                            peer.profile()
                            prof.on()
                        for link in links:
                            gbps = link if isinstance(link, (int, float)) else None
                            tx.set_link(gbps)
                            label = f"{link}GBps" if isinstance(link, (int, float)) else transport
                            reps = args.reps if gib >= SMALL_GIB else max(args.reps, SMALL_REPS)
                            rows = run_link(tx, peer, layers, want, label, gbps, codecs, reps, tag, log, args.stages)
                            summ = summarize(rows, codecs)
                            res["runs"].append({"family": fam, "shape": shape, "layers": n_layers, "tokens": tokens,
                                                "GiB": gib, "link": label, "transport": transport,
                                                "emulated": isinstance(link, (int, float)), "summary": summ,
                                                "rows": rows})
                            log(f"{tag:28s} {gib:6.2f} GiB {label:>8s}: " + "  ".join(
                                f"{c} {v['median_s'] * 1e3:8.2f} ms x{v.get('speedup_vs_raw', 0):.3f}"
                                f"{'' if v['exact'] else ' INEXACT'}" for c, v in summ.items()))
                            for c in ("auto", RAW_AGAIN):
                                paired = summ.get(c, {}).get("paired_vs_raw")
                                if paired:
                                    log(f"{'':28s} {c} vs raw, rep by rep: x{paired['median']:.3f} "
                                        f"(90 % interval {paired['ci90'][0]:.3f}-{paired['ci90'][1]:.3f}, "
                                        f"{paired['pairs']} pairs)")
                            _write(out_path, res)
                        del layers
                        free_gpu_pools(args.device, torch_cache=True)
                        peer.free()
        finally:
            prof.dump()
            tx.close()
            peer.close()
    res["seconds"] = time.monotonic() - t_start
    _write(out_path, res)
    plot(out_path, out_path.removesuffix(".json") + ".png")
    print(f"wrote {out_path} and its plot")
    bad = [r for run in res["runs"] for r in run["rows"] if not r.get("exact", False)]
    return 1 if bad else 0


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import kvzip

    from kvzip.bench_cpu import code_commit

    v = {"kvzip": kvzip.__version__, "python": platform.python_version(), "commit": code_commit()}
    for p in ("torch", "cupy-cuda13x", "numpy", "mooncake-transfer-engine-cuda13",
              "mooncake-transfer-engine-non-cuda", "nvidia-nvcomp-cu13"):
        try:
            v[p] = version(p)
        except PackageNotFoundError:
            pass
    return v


def _write(path, res) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)


class Mps:
    """A CUDA MPS control daemon for this run (pipe and log directories of its own)."""

    def __init__(self):
        import shutil

        self.ctl = shutil.which("nvidia-cuda-mps-control")
        if self.ctl is None:
            raise RuntimeError("--mps: nvidia-cuda-mps-control is not on PATH (use --no-mps)")
        d = f"/tmp/kvzip-mps-{os.getpid()}"
        os.environ["CUDA_MPS_PIPE_DIRECTORY"], os.environ["CUDA_MPS_LOG_DIRECTORY"] = d + "/pipe", d + "/log"
        os.makedirs(d + "/pipe", exist_ok=True)
        os.makedirs(d + "/log", exist_ok=True)
        subprocess.run([self.ctl, "-d"], check=True, timeout=30)

    def stop(self):
        """Ask the daemon to quit once its clients are gone: this process still is one, so the
        request must not be waited for."""
        p = subprocess.Popen([self.ctl], stdin=subprocess.PIPE, text=True)
        p.stdin.write("quit\n")
        p.stdin.close()


def plot(json_path: str, png_path: str) -> None:
    """Speedup over raw against link rate, one panel per KV size, one line per codec."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.load(open(json_path))
    runs = [r for r in res["runs"] if r["emulated"] and r["family"] == "smollm2"]
    sizes = sorted({(r["GiB"], r["shape"], r["tokens"]) for r in runs})
    if not sizes:
        print(f"no emulated links in {json_path}: no plot")
        return
    fig, axes = plt.subplots(1, len(sizes), figsize=(3.2 * len(sizes), 3.4), sharey=True, squeeze=False)
    for ax, (gib, shape, tokens) in zip(axes[0], sizes):
        mine = sorted((float(r["link"].removesuffix("GBps")), r["summary"]) for r in runs
                      if (r["GiB"], r["shape"], r["tokens"]) == (gib, shape, tokens))
        for codec, style in (("kvzip", "o-"), ("kvzip-ratio", "D-"), ("auto", "s--"), ("nvcomp-ans", "^:"),
                             (RAW_AGAIN, "x:")):
            pts = [(link, s[codec]["speedup_vs_raw"]) for link, s in mine if codec in s]
            if pts:
                ax.plot(*zip(*pts), style, label=codec)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(f"{shape}, {tokens // 1024}K tokens\n{gib:.2f} GiB", fontsize=9)
        ax.set_xlabel("emulated link, GB/s")
    axes[0][0].set_ylabel("transfer speedup over raw")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(f"kvzip.transfer on {res['device']}: {res['emulation'].split(':')[1].split(';')[0].strip()}, "
                 f"{res['date'][:10]}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)



def device_tag(device: str) -> str:
    """The result file's device name: "cpu", or the sender's GPU's short name (kvzip.bench.gpu_tag)
    as nvidia-smi gives it, which creates no CUDA context (MPS must start before any does)."""
    if device == "cpu":
        return "cpu"
    index = device.partition(":")[2] or "0"
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", index],
                              capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        name = ""
    return gpu_tag(name)

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--role", choices=["tx", "rx"], default="tx", help=argparse.SUPPRESS)
    ap.add_argument("--device", default="cuda", help="cuda or cpu (the sender's; see --gpus)")
    ap.add_argument("--engine", choices=["mooncake", "torch"], default="mooncake",
                    help="transfer engine: Mooncake (CUDA IPC and TCP) or torch.distributed (NCCL, gloo)")
    ap.add_argument("--gpus", type=int, choices=[1, 2], default=1,
                    help="2: the sender on GPU 0, the receiver on GPU 1 (no MPS needed)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768, 131072], help="context lengths")
    ap.add_argument("--links", type=float, nargs="+", default=LINKS, help="emulated link rates, GB/s")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each (link, codec), interleaved (at least 11 under 2 GiB)")
    ap.add_argument("--slot-mib", type=int, default=512, help="receive ring slot size, MiB (a layer must fit)")
    ap.add_argument("--slots", type=int, default=4, help="receive ring slots")
    ap.add_argument("--group-mib", type=int, default=0, help="raw MiB per message (0: the sender's default)")
    ap.add_argument("--tcp-max-tokens", type=int, default=4096, help="longest context sent over real TCP")
    ap.add_argument("--only-tcp", action="store_true", help="only the real TCP transport")
    ap.add_argument("--no-tcp", action="store_true", help="skip the real TCP transport")
    ap.add_argument("--no-nvcomp", action="store_true", help="leave nvCOMP ANS out")
    ap.add_argument("--codecs", nargs="+", default=["kvzip", "kvzip-ratio"], choices=["kvzip", "kvzip-ratio"],
                    help="kvzip's wire codecs to measure beside raw and auto")
    ap.add_argument("--minilm", default=None, help="MiniLM-L6 KV safetensors file: a second KV family")
    ap.add_argument("--max-seconds", type=float, default=420, help="stop starting new shapes after this")
    ap.add_argument("--aa", action="store_true",
                    help=f"also send raw a second time as {RAW_AGAIN!r}: its paired_vs_raw is the spread of "
                         "identical transfers, against which auto's is judged")
    ap.add_argument("--stages", action="store_true", help="print each codec's per-group stage times (last rep)")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="profile both processes' threads (yappi, CPU clock) over the timed requests into "
                         "DIR/tx.txt and DIR/rx.txt; the timings are then not representative")
    ap.add_argument("--switch-interval", type=float, default=None, metavar="S",
                    help="set both processes' sys.setswitchinterval (Python's default: 0.005 s): does the GIL's hand-over "
                         "between the pipeline's threads bound small requests? (NOTES t14)")
    ap.add_argument("--quick", action="store_true", help="small CPU-sized run: 512 tokens, 10 and 25 GB/s")
    ap.add_argument("--no-mps", dest="mps", action="store_false",
                    help="let the GPU time-slice between the two processes instead of sharing it through MPS")
    ap.add_argument("--out", default=None, help="JSON to write (default benchmarks/results/transfer-GPU.json, "
                                                 "transfer-GPUx2.json with --gpus 2, GPU the card's short name "
                                                 "as kvzip.bench.gpu_tag gives it: h200, h100; transfer-cpu.json "
                                                 "with --device cpu)")
    ap.add_argument("--replot", metavar="JSON", help="only draw JSON's plot (next to it, .png)")
    args = ap.parse_args(argv)
    if args.replot:
        plot(args.replot, args.replot.removesuffix(".json") + ".png")
        return 0
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    if args.role == "rx":
        receiver_main(args)
        return 0
    if args.gpus == 2:
        if args.device == "cpu":
            ap.error("--gpus 2 needs --device cuda")
        args.device, args.mps = "cuda:0", False
    args.out = args.out or f"benchmarks/results/transfer-{device_tag(args.device)}{'x2' if args.gpus == 2 else ''}.json"
    if args.quick:
        args.tokens, args.links, args.reps, args.slot_mib = [512], [10, 25], 2, 16
    mps = Mps() if args.mps and args.device != "cpu" else None  # before any CUDA context exists
    try:
        return sender_main(args)
    finally:
        if mps is not None:
            mps.stop()


if __name__ == "__main__":
    sys.exit(main())
