"""kvzip.transfer on a GPU: CUDA tensors through the loopback engine (one process) and through
Mooncake's CUDA IPC transport between two processes on one GPU, bit for bit."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import cupy  # noqa: F401  tests/conftest.py collects tests/gpu only where CuPy sees a GPU

import kvzip
from kvzip import transfer
from kvzip.testing import real_kv_layers
from kvzip.transfer.sender import PROBE_WRITES

if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA", allow_module_level=True)


def real_layers(n=8, tokens=2048, device="cuda"):
    """(k, v) pairs, [8, tokens, 128] bf16, tiled from the shipped real KV."""
    return real_kv_layers(n, tokens, device)


def same(a, b):
    return all(x.dtype == y.dtype and x.shape == y.shape and x.device == y.device
               and torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))


def message_parts(device, seed):
    """Parts of random lengths (0 and non-multiples of 8 among them) at odd source addresses,
    and the offsets a message gives them (kvzip.transfer.protocol.align)."""
    from kvzip.transfer.protocol import align

    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (1 << 20,), generator=g, dtype=torch.uint8).to(device)
    parts, end = [], 0
    for k in range(int(torch.randint(1, 40, (1,), generator=g))):
        n = int(torch.randint(0, 20000, (1,), generator=g)) if k % 5 else 0
        start = int(torch.randint(0, pool.shape[0] - n, (1,), generator=g))
        parts.append((pool[start:start + n], end))  # any alignment
        end = align(end + n)
    return parts, end


@pytest.mark.parametrize("seed", range(6))
def test_gather_and_scatter_kernels_give_the_cpu_bytes_and_digest(seed):
    """Buffer.gather / scatter on a GPU (kvz_gather_sum64 / kvz_scatter_sum64) against the CPU
    Buffer's NumPy copies and sum64, which are the specification."""
    from kvzip.checksum import sum64_finish
    from kvzip.transfer.buffers import Buffer

    parts, n = message_parts("cuda", seed)
    host_parts = [(p.cpu(), at) for p, at in parts]
    gpu, cpu = Buffer(n + 4096, "cuda"), Buffer(n + 4096, "cpu")
    gpu.view(0, n + 4096).fill_(0xAB)  # stale bytes: the padding must come out zero
    cpu.view(0, n + 4096).fill_(0xCD)
    base = 256 * (seed % 3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the parts and the fill were made there
    t_gpu = gpu.gather(base, n, parts, stream)
    t_cpu = cpu.gather(base, n, host_parts)
    stream.synchronize()
    assert torch.equal(gpu.view(base, n).cpu(), cpu.view(base, n))
    assert sum64_finish(t_gpu, n) == sum64_finish(t_cpu, n)
    # scatter into fresh tensors at odd addresses, from the message just built
    outs = [torch.zeros(p.shape[0] + 3, dtype=torch.uint8, device="cuda")[3:] for p, _ in parts]
    stream.wait_stream(torch.cuda.current_stream())
    t_back = gpu.scatter(base, n, [(o, at) for o, (_, at) in zip(outs, parts)], stream)
    stream.synchronize()
    assert sum64_finish(t_back, n) == sum64_finish(t_cpu, n)
    assert all(torch.equal(o, p) for o, (p, _) in zip(outs, parts))


@pytest.mark.parametrize("codec", ["kvzip", "kvzip-ratio", "raw", "auto"])
def test_loopback_cuda_round_trip(codec):
    layers = real_layers()
    with transfer.Receiver(engine="loopback", device="cuda", slot_bytes=16 << 20) as rx, \
            transfer.Sender(rx.address, engine="loopback", codec=codec, link_gbps=50.0) as tx:
        stats = tx.send("r", layers).wait(timeout=60)
        back = rx.receive("r")
    assert all(same(a, b) for a, b in zip(layers, back))
    assert stats["groups"] >= 2
    if stats["codec"] == "kvzip":
        assert stats["raw_bytes"] / stats["sent_bytes"] > 1.3
    if stats["codec"] == "kvzip-ratio":
        assert stats["raw_bytes"] / stats["sent_bytes"] > 1.38


@pytest.mark.parametrize("form", ["as-is", "wide", "chan-scaled"])
def test_speed_estimate_on_the_gpu_is_the_cpus(form):
    """codec.speed_estimate samples and counts the same values on a GPU (torch) as on the CPU, and
    codec="auto" over CUDA KV of a wide exponent range goes as the ratio mode from its first group."""
    import numpy as np

    from kvzip.testing import kv_variant
    from kvzip.transfer.codec import speed_estimate

    layers = [tuple(torch.from_numpy(kv_variant(t.cpu().view(torch.int16).numpy().view(np.uint16), form)
                                     .view(np.int16)).view(torch.bfloat16) for t in pair) for pair in real_layers(8)]
    flat = [t for pair in layers for t in pair]
    assert speed_estimate([t.cuda() for t in flat]) == speed_estimate(flat)
    if form == "wide":
        cuda_layers = [tuple(t.cuda() for t in pair) for pair in layers]
        with transfer.Receiver(engine="loopback", device="cuda", slot_bytes=16 << 20) as rx, \
                transfer.Sender(rx.address, engine="loopback", codec="auto", link_gbps=1.0) as tx:
            stats = tx.send("w", cuda_layers).wait(timeout=60)
            assert all(same(a, b) for a, b in zip(cuda_layers, rx.receive("w")))
        assert stats["group_codecs"][0] != "kvzip", stats["auto"]


def test_streaming_from_a_side_stream_waits_for_the_producer():
    """Layers produced on another stream: the sender's encode waits for them (event fence)."""
    layers = real_layers(4)
    side = torch.cuda.Stream()
    with transfer.Receiver(engine="loopback", device="cuda", slot_bytes=16 << 20) as rx, \
            transfer.Sender(rx.address, engine="loopback") as tx:
        s = tx.begin("s", len(layers))
        with torch.cuda.stream(side):
            for i, (k, v) in enumerate(layers):
                torch.cuda._sleep(2_000_000)  # the copies below finish well after send_layer returns
                k2, v2 = k.clone(), v.clone()
                s.send_layer(i, k2, v2)
        s.wait(timeout=60)
        assert all(same(a, b) for a, b in zip(layers, rx.receive("s")))


def test_bit_flip_on_cuda_is_caught():
    faults = transfer.Faults(flip_bit=(PROBE_WRITES + 1, 123457, 5))  # the second message, after the link's probe
    with transfer.Receiver(engine="loopback", device="cuda", slot_bytes=16 << 20) as rx, \
            transfer.Sender(rx.address, engine=transfer.LoopbackEngine(faults)) as tx:
        tx.send("bad", real_layers())
        with pytest.raises(kvzip.FormatError):
            rx.receive("bad", timeout=60)


RX = textwrap.dedent("""
    import sys, torch
    from kvzip import transfer
    rx = transfer.Receiver(engine="mooncake", device="cuda", slot_bytes=32 << 20)
    print(rx.address, flush=True)
    kv = rx.receive("r", timeout=120)
    print(" ".join(str(int(t.view(torch.int16).to(torch.int64).sum())) for l in kv for t in l), flush=True)
""")


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="Mooncake Transfer Engine not installed")
@pytest.mark.parametrize("codec", ["kvzip", "raw"])
def test_mooncake_cuda_ipc_between_processes(codec):
    env = dict(os.environ, MC_INTRANODE_NVLINK="1")
    env.pop("MC_FORCE_TCP", None)
    os.environ.update(MC_INTRANODE_NVLINK="1")
    p = subprocess.Popen([sys.executable, "-c", RX], stdout=subprocess.PIPE, text=True, env=env)
    try:
        addr = p.stdout.readline().strip()
        layers = real_layers(6, 4096)
        with transfer.Sender(addr, engine="mooncake", codec=codec) as tx:
            stats = tx.send("r", layers).wait(timeout=120)
        sums = p.stdout.readline().split()
        assert sums == [str(int(t.view(torch.int16).to(torch.int64).sum())) for l in layers for t in l]
        assert stats["groups"] >= 2
    finally:
        p.kill()


NCCL_RX = textwrap.dedent("""
    import torch
    from kvzip import transfer
    rx = transfer.Receiver(engine="torch", device="cuda:1", slot_bytes=32 << 20)
    print(rx.address, flush=True)
    kv = rx.receive("r", timeout=120)
    print(" ".join(str(int(t.view(torch.int16).to(torch.int64).sum())) for l in kv for t in l), flush=True)
""")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs one GPU a process: two GPUs")
def test_torch_engine_nccl_between_two_gpus():
    """engine='torch' between GPU 0 (sender) and GPU 1 (receiver) over NCCL, bit for bit."""
    env = dict(os.environ, NCCL_NVLS_ENABLE="0")
    p = subprocess.Popen([sys.executable, "-c", NCCL_RX], stdout=subprocess.PIPE, text=True, env=env)
    try:
        addr = p.stdout.readline().strip()
        layers = real_layers(6, 4096, device="cuda:0")
        with transfer.Sender(addr, engine="torch", codec="kvzip") as tx:
            tx.send("r", layers).wait(timeout=120)
        assert p.stdout.readline().split() == [str(int(t.view(torch.int16).to(torch.int64).sum()))
                                               for l in layers for t in l]
    finally:
        p.kill()
