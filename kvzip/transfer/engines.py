"""Transfer engines: what moves bytes from one process's memory into another's.

An engine is small on purpose (register, write, close), so that Mooncake, NIXL or
torch.distributed can stand behind the same transfer layer:

- ``register(ptr, nbytes, device)`` makes a buffer a source or target of writes;
- ``write(peer, local_ptr, remote_ptr, nbytes)`` copies bytes into a peer's registered memory and
  returns once they are there (it raises ``EngineError`` on failure, never returns short);
- ``write_async(...)``, the same write left in flight: its ``wait(timeout)`` says when it has
  landed, so the Sender encodes the next group meanwhile (the default writes at once, as
  loopback does; Mooncake's runs on the engine's own threads, torch.distributed's on a thread of
  the engine's);
- ``session`` names this engine to its peers (a peer passes it as ``peer`` to ``write``).

Engines are one-sided: the receiver learns that bytes arrived from the control channel
(kvzip/transfer/protocol.py), which also carries credits and detects a dead peer.  Mooncake's
own notifications are not used for that: they differ between its published builds and give no
liveness signal.

``LoopbackEngine`` connects engines of one process (tests and the CPU demo's in-process mode) and
can inject faults; ``MooncakeEngine`` wraps Mooncake Transfer Engine's Python binding;
kvzip/transfer/torch_engine.py serves writes over torch.distributed (gloo, NCCL).
"""
from __future__ import annotations

import ctypes
import itertools
import os
import threading
import time
from dataclasses import dataclass, field

from .engine import Engine, EngineError, Write


def _copy(dst: int, src: int, nbytes: int, device: str) -> None:
    if device == "cpu":
        ctypes.memmove(dst, src, nbytes)
    else:
        import cupy

        cupy.cuda.runtime.memcpy(dst, src, nbytes, cupy.cuda.runtime.memcpyDefault)


@dataclass
class Faults:
    """Faults a LoopbackEngine injects, counted over its writes (0 = the first write).

    flip_bit: (write index, byte offset in that write, bit) flipped in the target after the copy.
    fail_at: the index of the first write that raises EngineError (and every later one).
    """

    flip_bit: tuple[int, int, int] | None = None
    fail_at: int | None = None
    writes: int = field(default=0, init=False)


class LoopbackEngine(Engine):
    """In-process engine: a write is a memcpy into a buffer another LoopbackEngine registered.

    Peers are found by session name in a process-wide table, so a Sender and a Receiver of one
    process talk through it exactly as two processes talk through Mooncake."""

    name = "loopback"
    _peers: dict[str, "LoopbackEngine"] = {}
    _ids = itertools.count()
    _lock = threading.Lock()

    def __init__(self, faults: Faults | None = None):
        self.session = f"loopback-{os.getpid()}-{next(self._ids)}"
        self.faults = faults or Faults()
        self._registered: dict[int, tuple[int, str]] = {}
        with self._lock:
            self._peers[self.session] = self

    def register(self, ptr, nbytes, device):
        self._registered[ptr] = (nbytes, device)

    def unregister(self, ptr):
        self._registered.pop(ptr, None)

    def _inside(self, ptr: int, nbytes: int) -> str:
        for base, (size, device) in self._registered.items():
            if base <= ptr and ptr + nbytes <= base + size:
                return device
        raise EngineError(f"{nbytes} bytes at {ptr:#x} are not inside memory registered with {self.session}")

    def write(self, peer, local_ptr, remote_ptr, nbytes):
        with self._lock:
            target = self._peers.get(peer)
        if target is None:
            raise EngineError(f"no loopback engine named {peer!r} in this process")
        f = self.faults
        index, f.writes = f.writes, f.writes + 1
        if f.fail_at is not None and index >= f.fail_at:
            raise EngineError(f"injected failure of write {index} to {peer}")
        src_device = self._inside(local_ptr, nbytes)
        dst_device = target._inside(remote_ptr, nbytes)
        _copy(remote_ptr, local_ptr, nbytes, "cpu" if src_device == dst_device == "cpu" else "cuda")
        if f.flip_bit is not None and f.flip_bit[0] == index:
            _, offset, bit = f.flip_bit
            _flip(remote_ptr + offset % max(nbytes, 1), bit, dst_device)

    def close(self):
        super().close()
        with self._lock:
            self._peers.pop(self.session, None)


def _flip(ptr: int, bit: int, device: str) -> None:
    byte = ctypes.c_uint8()
    _copy(ctypes.addressof(byte), ptr, 1, device)
    byte.value ^= 1 << (bit % 8)
    _copy(ptr, ctypes.addressof(byte), 1, device)


class MooncakeEngine(Engine):
    """Mooncake Transfer Engine (PyPI: mooncake-transfer-engine-non-cuda on CPU machines,
    mooncake-transfer-engine-cuda13 on GPU ones), peer to peer (P2PHANDSHAKE, no metadata server).

    The transport is Mooncake's choice, not the ``protocol`` argument's: TCP unless
    ``MC_FORCE_TCP`` says otherwise, CUDA IPC between processes of one host with
    ``MC_INTRANODE_NVLINK=1`` (GPU memory from plain cudaMalloc only), RDMA where a NIC is found.
    Only calls both published builds share are used."""

    name = "mooncake"

    def __init__(self, host: str = "127.0.0.1", protocol: str = "tcp"):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:  # the wheel, or libibverbs.so.1 under it, is missing
            raise ImportError(
                "engine='mooncake' needs Mooncake Transfer Engine: pip install "
                "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine-cuda13 (GPU), "
                f"and the Debian package libibverbs1 ({e})") from e
        self._engine = TransferEngine()
        rc = self._engine.initialize(host, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise EngineError(f"Mooncake failed to start on {host} ({protocol}): return code {rc}")
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._registered: dict[int, tuple[int, str]] = {}

    def register(self, ptr, nbytes, device):
        location = "cpu:0" if device == "cpu" else f"cuda:{_cuda_index(device)}"
        rc = self._engine.register_memory(ptr, nbytes, location)
        if rc != 0:
            raise EngineError(f"Mooncake could not register {nbytes} bytes of {device} memory: return code {rc}")
        self._registered[ptr] = (nbytes, device)

    def unregister(self, ptr):
        if self._registered.pop(ptr, None) is not None:
            self._engine.unregister_memory(ptr)

    def write(self, peer, local_ptr, remote_ptr, nbytes):
        rc = self._engine.transfer_sync_write(peer, local_ptr, remote_ptr, nbytes)
        if rc != 0:
            raise EngineError(f"Mooncake write of {nbytes} bytes to {peer} failed (return code {rc}): "
                              "the peer is gone or unreachable")

    def write_async(self, peer, local_ptr, remote_ptr, nbytes):
        batch = self._engine.transfer_submit_write(peer, local_ptr, remote_ptr, nbytes)
        if batch in _NO_BATCH:
            raise EngineError(f"Mooncake could not start a write of {nbytes} bytes to {peer}: "
                              "the peer is gone or unreachable")
        return _MooncakeWrite(self._engine, batch, peer, nbytes)


_NO_BATCH = (0, (1 << 64) - 1)  # what a failed submit returns: 0, or -1 as the unsigned batch id


class _MooncakeWrite(Write):
    """A Mooncake write in flight, polled with transfer_check_status (which frees the batch once
    it has completed or failed; the blocking get_batch_transfer_status would log a line a write).
    The poll yields the GIL between looks, as the engine's own synchronous write spins between
    them without it."""

    def __init__(self, engine, batch: int, peer: str, nbytes: int):
        self._engine, self._batch, self._peer, self._nbytes = engine, batch, peer, nbytes
        self._landed = False

    def wait(self, timeout):
        deadline = time.perf_counter() + timeout
        while not self._landed:
            rc = self._engine.transfer_check_status(self._batch)  # 1 done, 0 in flight, -1 failed, -2 timed out
            if rc == 1:
                self._landed = True
            elif rc != 0:
                raise EngineError(f"Mooncake write of {self._nbytes} bytes to {self._peer} failed (status {rc}): "
                                  "the peer is gone or unreachable")
            elif time.perf_counter() >= deadline:
                return False
            else:
                time.sleep(0)
        return True


def _cuda_index(device: str) -> int:
    return int(device.partition(":")[2] or 0)


def _torch_engine() -> Engine:
    from .torch_engine import TorchDistEngine  # imported on use: the module needs torch

    return TorchDistEngine()


ENGINES = {"loopback": LoopbackEngine, "mooncake": MooncakeEngine, "torch": _torch_engine}


def make_engine(engine) -> Engine:
    """An Engine from a name in ENGINES or an Engine instance (used as it is)."""
    if isinstance(engine, Engine):
        return engine
    if engine not in ENGINES:
        raise ValueError(f"unknown transfer engine {engine!r}: choose one of {sorted(ENGINES)} or pass an Engine")
    return ENGINES[engine]()
