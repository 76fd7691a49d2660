"""A small request's host latency on the CPU: the sender's pipeline against a baseline sender.

Requests of 64 layers of (k, v) in groups of 8 tensors (4 layers a message), CPU torch tensors,
sent and received whole, one after another; a request's time is from ``send`` to ``wait``
returning (the receiver's "done"), so it holds every hop of every group and the latency chain of
the first and last.  Engines:

- loopback: Sender and Receiver in this process (the engine is a memcpy);
- mooncake: the Receiver in a child process, Mooncake's TCP transport over 127.0.0.1.

Two senders (or with ``--side receiver``, two receivers) are compared: ``current``
(kvzip/transfer/sender.py as it is in the tree) and ``baseline`` (sender.py at the git revision
``--baseline``, loaded as a module of its own beside the current one), interleaved rep by rep
with the order alternating, on a fresh Sender / Receiver pair per (engine, tensor size, codec)
so neither inherits the other's connection.  The other side is the tree's in both.

    python benchmarks/transfer_hops.py                       # tiny and 1 MiB tensors, raw and kvzip
    python benchmarks/transfer_hops.py --sizes 4096 --reps 200 --engines loopback

Prints, per row and variant, the median and the 10-90 % spread of a request's time and of a
group's share of it (request time / groups), and the paired ratio current / baseline (each rep's
pair ran back to back, so load from other processes on the machine mostly cancels in it).  The
JSON adds this process's CPU time a group (with loopback, both ends; with mooncake, the sender).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from kvzip import transfer

LAYERS = 64
GROUP_TENSORS = 8


def load_baseline(side: str, rev: str):
    """kvzip/transfer/<side>.py at git revision ``rev`` as module kvzip.transfer._baseline_<side>
    (its relative imports resolve into the current package)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = subprocess.run(["git", "show", f"{rev}:kvzip/transfer/{side}.py"], cwd=root, check=True,
                          capture_output=True, text=True).stdout
    path = os.path.join(tempfile.mkdtemp(prefix="kvzip-baseline-"), f"{side}.py")
    with open(path, "w") as f:
        f.write(text)
    name = f"kvzip.transfer._baseline_{side}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def make_layers(size: int):
    g = torch.Generator().manual_seed(size)
    n = size // 2
    return [tuple(torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(2)) for _ in range(LAYERS)]


def slot_for(size: int) -> int:
    need = GROUP_TENSORS * (size + 256)
    return max(1 << 16, -(-need // 256) * 256)


def _serve(conn, engine: str, slot_bytes: int, rev: str | None):
    """The child's Receiver (the current one, or the baseline's of git revision ``rev``): answers
    its address, then receives "r<i>" in order until told stop."""
    torch.set_num_threads(1)
    module = load_baseline("receiver", rev) if rev else transfer.receiver
    rx = module.Receiver(engine=engine, slot_bytes=slot_bytes, ring_bytes=4 * slot_bytes)
    conn.send(rx.address)
    while True:
        req = conn.recv()
        if req is None:
            break
        rx.receive(req, timeout=60)
    rx.close()


class Link:
    """A Receiver (here or in a child) and a Sender; the variant's module is the side it tests,
    the other side is the current one."""

    def __init__(self, variant, side: str, engine: str, size: int, codec: str, link_gbps):
        module, rev = variant
        self.engine = engine
        slot = slot_for(size)
        rx_module = module if side == "receiver" else transfer.receiver
        if engine == "loopback":
            self.rx = rx_module.Receiver(engine=engine, slot_bytes=slot, ring_bytes=4 * slot)
            address = self.rx.address
        else:
            self.rx = None
            self.conn, child = mp.Pipe()
            child_rev = rev if side == "receiver" else None
            self.proc = mp.get_context("spawn").Process(target=_serve, args=(child, engine, slot, child_rev), daemon=True)
            self.proc.start()
            address = self.conn.recv()
        tx_module = module if side == "sender" else transfer.sender
        self.tx = tx_module.Sender(address, engine=engine, codec=codec, link_gbps=link_gbps,
                                   group_bytes=GROUP_TENSORS // 2 * 2 * size)
        self.n = 0

    def request(self, layers) -> tuple[float, float, int]:
        """(wall seconds, this process's CPU seconds, groups) of one request."""
        name = f"r{self.n}"
        self.n += 1
        if self.rx is None:
            self.conn.send(name)
        c0, t0 = time.process_time(), time.perf_counter()
        stats = self.tx.send(name, layers).wait(timeout=60)
        took, cpu = time.perf_counter() - t0, time.process_time() - c0
        if self.rx is not None:
            self.rx.receive(name, timeout=60)
        return took, cpu, stats["groups"]

    def close(self):
        self.tx.close()
        if self.rx is not None:
            self.rx.close()
        else:
            self.conn.send(None)
            self.proc.join(timeout=10)


def spread(xs):
    xs = sorted(xs)
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]
    return statistics.median(xs), q(0.1), q(0.9)


def run_row(variants, side, engine, size, codec, reps, warm, link_gbps):
    layers = make_layers(size)
    links = {name: Link(v, side, engine, size, codec, link_gbps) for name, v in variants.items()}
    times = {name: [] for name in variants}
    cpus = {name: [] for name in variants}
    groups = {}
    try:
        for _ in range(warm):
            for name in variants:
                links[name].request(layers)
        for r in range(reps):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                took, cpu, g = links[name].request(layers)
                times[name].append(took)
                cpus[name].append(cpu)
                groups[name] = g
    finally:
        for link in links.values():
            link.close()
    row = {"side": side, "engine": engine, "tensor_bytes": size, "codec": codec, "link_gbps": link_gbps, "reps": reps}
    for name in variants:
        med, lo, hi = spread(times[name])
        g = groups[name]
        cmed, clo, chi = spread(cpus[name])
        row[name] = {"groups": g, "request_ms": [med * 1e3, lo * 1e3, hi * 1e3],
                     "group_us": [med / g * 1e6, lo / g * 1e6, hi / g * 1e6],
                     "cpu_us_per_group": [cmed / g * 1e6, clo / g * 1e6, chi / g * 1e6]}
    if len(variants) == 2:
        a, b = list(variants)
        ratios = [x / y for x, y in zip(times[a], times[b])]
        row[f"{a}/{b}"] = list(spread(ratios))
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", nargs="+", default=["loopback", "mooncake"])
    ap.add_argument("--sizes", nargs="+", type=int, default=[4096, 1 << 20], help="bytes a tensor")
    ap.add_argument("--codecs", nargs="+", default=["raw", "kvzip"])
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--link", type=float, default=None, help="emulated GB/s (default: unpaced)")
    ap.add_argument("--side", choices=["sender", "receiver"], default="sender", help="the module compared")
    ap.add_argument("--baseline", default="HEAD", help="git revision of the baseline module; 'none': current only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    current = getattr(transfer, args.side)
    variants = {"current": (current, None)}
    if args.baseline != "none":
        variants["baseline"] = (load_baseline(args.side, args.baseline), args.baseline)
    rows = []
    for engine in args.engines:
        for size in args.sizes:
            for codec in args.codecs:
                reps = args.reps if size <= 1 << 16 else max(5, args.reps // 4)
                row = run_row(variants, args.side, engine, size, codec, reps, args.warm, args.link)
                rows.append(row)
                line = f"{engine:8} {size:>8} B {codec:5}"
                for name in variants:
                    v = row[name]
                    line += (f" | {name} {v['request_ms'][0]:7.2f} ms ({v['request_ms'][1]:.2f}-{v['request_ms'][2]:.2f})"
                             f" {v['group_us'][0]:6.0f} us/group")
                if "current/baseline" in row:
                    r = row["current/baseline"]
                    line += f" | cur/base {r[0]:.3f} ({r[1]:.3f}-{r[2]:.3f})"
                print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
