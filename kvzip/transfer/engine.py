"""The engine interface of the transfer layer (kvzip/transfer/engines.py describes the contract
and holds the engines; kvzip/transfer/torch_engine.py the torch.distributed one)."""
from __future__ import annotations

import concurrent.futures
import time


class EngineError(RuntimeError):
    """A write or registration failed in the engine (peer gone, memory not registered, ...)."""


class Write:
    """A write in flight (Engine.write_async)."""

    ended: float | None = None  # perf_counter seconds when the bytes landed, where the engine knows it

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True once the bytes are in the peer's memory.  Raises
        EngineError if they never will be."""
        raise NotImplementedError


class Landed(Write):
    """A write that was made before write_async returned."""

    def __init__(self, ended: float):
        self.ended = ended

    def wait(self, timeout: float) -> bool:
        return True


class WriterThread:
    """One thread of an engine's that runs its synchronous writes in order, for engines whose
    writes cannot be polled: write_async hands the write over and returns at once."""

    def __init__(self, name: str):
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)  # started on first use

    def start(self, write, *args) -> Write:
        def run():
            write(*args)
            return time.perf_counter()
        return _OnThread(self._pool.submit(run))

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class _OnThread(Write):
    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    def wait(self, timeout):
        try:
            self.ended = self._future.result(timeout)  # EngineError as the write raised it
        except concurrent.futures.TimeoutError:
            return False
        return True


class Engine:
    """The interface the transfer layer needs; subclasses implement register, unregister and write,
    and write_async where the engine can leave a write in flight."""

    name = "engine"
    session: str

    def register(self, ptr: int, nbytes: int, device: str) -> None:
        raise NotImplementedError

    def unregister(self, ptr: int) -> None:
        raise NotImplementedError

    def write(self, peer: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        raise NotImplementedError

    def write_async(self, peer: str, local_ptr: int, remote_ptr: int, nbytes: int) -> "Write":
        """Start a write and return it in flight; the local and remote memory must stay as they
        are until it has landed.  An engine without asynchronous writes writes here, at once."""
        self.write(peer, local_ptr, remote_ptr, nbytes)
        return Landed(time.perf_counter())

    def close(self) -> None:
        """Unregister whatever is still registered; the engine is unusable afterwards."""
        for ptr in list(self.registered):
            self.unregister(ptr)

    @property
    def registered(self) -> dict[int, tuple[int, str]]:
        """Registered buffers: ptr -> (nbytes, device).  Tests check it returns to empty."""
        return self._registered

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
