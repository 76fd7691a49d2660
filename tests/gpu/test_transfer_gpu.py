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

if not torch.cuda.is_available():
    pytest.skip("torch has no CUDA", allow_module_level=True)


def real_layers(n=8, tokens=2048, device="cuda"):
    """(k, v) pairs, [8, tokens, 128] bf16, tiled from the shipped real KV."""
    return real_kv_layers(n, tokens, device)


def same(a, b):
    return all(x.dtype == y.dtype and x.shape == y.shape and x.device == y.device
               and torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))


@pytest.mark.parametrize("codec", ["kvzip", "raw", "auto"])
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
    faults = transfer.Faults(flip_bit=(1, 123457, 5))
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
