"""A transfer engine over torch.distributed: gloo between CPU buffers, NCCL between GPU buffers.

torch.distributed is two-sided (send / recv), the transfer layer wants one-sided writes, so each
engine serves its registered memory itself:

- every engine listens on a TCPStore of its own; ``session`` is that store's "host:port";
- a peer's first write announces a pair in that store (a counter and the pair's backend) and
  makes a two-process group with it, the writer rank 1; the engine's acceptor thread makes rank
  0 of the same group and a thread that serves the pair's writes;
- a write is three messages on the pair's group: a header (target address, length), the bytes,
  received straight into the registered memory at that address, and a one-word answer (0: done;
  1: the range was not registered, the bytes were dropped).  ``write`` returns after the answer,
  so the bytes are in the peer's memory when it returns, as the transfer layer requires;
  ``write_async`` hands the same write to a thread of the engine's (gloo's send reports its
  completion only to ``wait``, so there is nothing to poll), so the Sender encodes meanwhile.

The backend follows the writer's memory: gloo for CPU buffers, NCCL for CUDA ones (one process
per GPU, both ends on GPUs).  NVLink multicast is not used (NCCL_NVLS_ENABLE=0 is set here if
unset): point-to-point sends need none.
"""
from __future__ import annotations

import ctypes
import datetime
import os
import threading

from .engine import Engine, EngineError, WriterThread

_TIMEOUT = datetime.timedelta(seconds=60)   # a pair's operations
_CONNECT = datetime.timedelta(seconds=5)
_IDLE = datetime.timedelta(hours=1)         # the acceptor's wait for the next peer    # reaching a peer's store: the control connection has
                                            # just reached its process, so it is there or gone


def _tensor_at(ptr: int, nbytes: int, device: str):
    """A uint8 torch tensor over existing memory (no copy): CPU memory through a ctypes array,
    CUDA memory through CuPy's view of it."""
    import torch

    if device == "cpu":
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8)
    import cupy

    index = int(device.partition(":")[2] or 0)
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, owner=None, device_id=index)
    arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(mem, 0))
    return torch.as_tensor(arr, device=f"cuda:{index}")


class TorchDistEngine(Engine):
    name = "torch"

    def __init__(self, host: str = "127.0.0.1"):
        import torch.distributed as dist

        if not dist.is_available():
            raise ImportError("engine='torch' needs a torch built with torch.distributed")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        self._dist = dist
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=_TIMEOUT)
        self.session = f"{host}:{self._store.port}"
        self._registered: dict[int, tuple[int, str]] = {}
        self._pairs: dict[str, tuple[object, str, object]] = {}  # peer -> (group, device, lock)
        self._lock = threading.Lock()
        self._closed = False
        self._writer = WriterThread("kvzip-torch-engine-write")
        threading.Thread(target=self._accept, name="kvzip-torch-engine-accept", daemon=True).start()

    # ---------------------------------------------------------------- Engine
    def register(self, ptr, nbytes, device):
        if device != "cpu" and not self._dist.is_nccl_available():
            raise EngineError(f"engine='torch' moves {device} memory with NCCL, which this torch lacks")
        self._registered[ptr] = (nbytes, device)

    def unregister(self, ptr):
        self._registered.pop(ptr, None)

    def write(self, peer, local_ptr, remote_ptr, nbytes):
        import torch

        device = self._device_of(local_ptr, nbytes)
        if device is None:
            raise EngineError(f"{nbytes} bytes at {local_ptr:#x} are not inside memory registered with this engine")
        group, pair_device, lock = self._pair(peer, device)
        if pair_device != device:
            raise EngineError(f"the pair with {peer} moves {pair_device} memory, not {device}")
        header = torch.tensor([remote_ptr, nbytes], dtype=torch.int64, device=device)
        answer = torch.empty(1, dtype=torch.int64, device=device)
        try:
            with lock:  # one write at a time on a pair: its three messages must not interleave
                group.send([header], 0, 0).wait()
                if nbytes:
                    group.send([_tensor_at(local_ptr, nbytes, device)], 0, 1).wait()
                group.recv([answer], 0, 2).wait()
        except RuntimeError as e:
            raise EngineError(f"torch.distributed write of {nbytes} bytes to {peer} failed: {e}") from None
        if int(answer[0]) != 0:
            raise EngineError(f"{nbytes} bytes at {remote_ptr:#x} are not inside memory {peer} registered")

    def write_async(self, peer, local_ptr, remote_ptr, nbytes):
        return self._writer.start(self.write, peer, local_ptr, remote_ptr, nbytes)

    def close(self):
        super().close()
        self._closed = True
        self._writer.close()

    # ---------------------------------------------------------------- pairs
    def _device_of(self, ptr: int, nbytes: int) -> str | None:
        for base, (size, device) in self._registered.items():
            if base <= ptr and ptr + nbytes <= base + size:
                return device
        return None

    def _pair(self, peer: str, device: str):
        with self._lock:
            if peer in self._pairs:
                return self._pairs[peer]
            host, _, port = peer.rpartition(":")
            try:
                store = self._dist.TCPStore(host, int(port), is_master=False, timeout=_CONNECT)
            except (RuntimeError, ValueError) as e:
                raise EngineError(f"no torch engine at {peer}: {e}") from None
            store.set_timeout(_TIMEOUT)  # the rendezvous below waits for the peer's acceptor
            n = store.add("pairs", 1) - 1
            store.set(f"pair/{n}", device)
            group = self._group(store, n, 1, device)
            self._pairs[peer] = (group, device, threading.Lock())
            return self._pairs[peer]

    def _group(self, store, n: int, rank: int, device: str):
        prefixed = self._dist.PrefixStore(f"pg/{n}", store)
        if device == "cpu":
            return self._dist.ProcessGroupGloo(prefixed, rank, 2, _TIMEOUT)
        return self._dist.ProcessGroupNCCL(prefixed, rank, 2)

    def _accept(self) -> None:
        n = 0
        while not self._closed:
            try:  # blocks until a peer pairs (a daemon thread: a closed engine's stays blocked)
                self._store.wait([f"pair/{n}"], _IDLE)
            except RuntimeError:  # an hour without a new peer: look again (torch logs each timeout)
                continue
            device = self._store.get(f"pair/{n}").decode()
            group = self._group(self._store, n, 0, device)
            threading.Thread(target=self._serve, args=(group, device), name=f"kvzip-torch-engine-pair{n}",
                             daemon=True).start()
            n += 1

    def _serve(self, group, device: str) -> None:
        """Answer one writer's writes until it goes away."""
        import torch

        header = torch.empty(2, dtype=torch.int64, device=device)
        answer = torch.empty(1, dtype=torch.int64, device=device)
        while True:
            try:
                group.recv([header], 1, 0).wait()
                ptr, nbytes = (int(v) for v in header.tolist())
                inside = self._device_of(ptr, nbytes) == device
                if nbytes:
                    target = _tensor_at(ptr, nbytes, device) if inside else \
                        torch.empty(nbytes, dtype=torch.uint8, device=device)  # drained, dropped
                    group.recv([target], 1, 1).wait()
                answer.fill_(0 if inside else 1)
                group.send([answer], 1, 2).wait()
            except RuntimeError:  # the writer's process or connection is gone
                return
