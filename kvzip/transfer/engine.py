"""The engine interface of the transfer layer (kvzip/transfer/engines.py describes the contract
and holds the engines; kvzip/transfer/torch_engine.py the torch.distributed one)."""
from __future__ import annotations


class EngineError(RuntimeError):
    """A write or registration failed in the engine (peer gone, memory not registered, ...)."""


class Engine:
    """The interface the transfer layer needs; subclasses implement the four methods."""

    name = "engine"
    session: str

    def register(self, ptr: int, nbytes: int, device: str) -> None:
        raise NotImplementedError

    def unregister(self, ptr: int) -> None:
        raise NotImplementedError

    def write(self, peer: str, local_ptr: int, remote_ptr: int, nbytes: int) -> None:
        raise NotImplementedError

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
