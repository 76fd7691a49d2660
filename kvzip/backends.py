"""Where the bits live: the CPU backend (NumPy + Numba @njit) and the CUDA backend
(CuPy buffers + Numba-CUDA kernels on the caller's current stream).

Under the Numba CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the CUDA backend keeps its buffers
in NumPy and runs the very same kernels in the simulator, so CI without a GPU still exercises
every GPU kernel.
"""
from __future__ import annotations

import os
import threading
from functools import lru_cache

import numpy as np


def cuda_simulated() -> bool:
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


class Backend:
    """Array allocation and kernel launch for one kind of device."""

    name: str
    xp = np

    def to_numpy(self, a) -> np.ndarray:
        return np.asarray(a)

    def from_numpy(self, a: np.ndarray):
        return a

    def empty(self, n, dtype):
        return self.xp.empty(n, dtype=dtype)

    def zeros(self, n, dtype):
        return self.xp.zeros(n, dtype=dtype)

    def __repr__(self):
        return f"<kvzip backend {self.name}>"


class CPUBackend(Backend):
    name = "cpu"


class CUDABackend(Backend):
    """Numba-CUDA kernels over CuPy arrays (NumPy arrays under the simulator)."""

    name = "cuda"

    def __init__(self):
        from .jit import GPU_INSTALL_HINT, numba_cuda

        self._cuda = numba_cuda()
        self._staging = threading.local()
        self.simulated = cuda_simulated()
        if self.simulated:
            self.xp = np
        else:
            try:
                import cupy
            except ImportError as e:
                raise ImportError(f"kvzip's CUDA backend needs CuPy, which is not installed: {GPU_INSTALL_HINT}") from e

            self.xp = cupy

    def to_numpy(self, a) -> np.ndarray:
        if self.simulated:
            return np.asarray(a)
        return self.xp.asnumpy(a)

    def from_numpy(self, a: np.ndarray):
        if self.simulated:
            # The simulator copies kernel arguments back after a launch, which fails on read-only
            # memory (a blob that came from bytes): give it a private copy then.
            return a if a.flags.writeable else a.copy()
        return self.xp.asarray(a)

    def pinned(self, nbytes: int) -> np.ndarray:
        """This thread's page-locked host staging buffer, at least nbytes long.  Uploads and
        read-backs go through it with asynchronous copies: a pageable copy costs tens of
        microseconds and synchronises the device."""
        buf = getattr(self._staging, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            import cupyx

            buf = self._staging.buf = cupyx.empty_pinned(max(nbytes, 1 << 16, 2 * (0 if buf is None else buf.nbytes)), np.uint8)
        return buf

    def read_bytes(self, a, nbytes: int) -> bytes:
        """The first nbytes of device array a, copied to the host once the caller's stream gets
        there (this waits: it is a synchronisation point)."""
        if self.simulated:
            return np.asarray(a).reshape(-1).view(np.uint8)[:nbytes].tobytes()
        stream = self.xp.cuda.get_current_stream()
        host = self.pinned(nbytes)
        if nbytes:
            self.xp.cuda.runtime.memcpyAsync(host.ctypes.data, a.data.ptr, nbytes, 2, stream.ptr)
        stream.synchronize()
        return host[:nbytes].tobytes()

    def stream(self):
        """The caller's current stream as a Numba stream (CuPy's current one, which the API
        layer points at torch's current stream when the input came from torch)."""
        if self.simulated:
            return 0
        return self._cuda.external_stream(self.xp.cuda.get_current_stream().ptr)

    def launch(self, kernel, blocks: int, threads: int, *args):
        """Launch on the caller's stream without the implicit synchronisation Numba performs
        when it imports a CUDA-array-interface object."""
        if blocks <= 0:
            return
        if not self.simulated:
            args = tuple(
                self._cuda.as_cuda_array(a, sync=False) if hasattr(a, "__cuda_array_interface__") else a
                for a in args
            )
        kernel[blocks, threads, self.stream()](*args)


@lru_cache(maxsize=None)
def get_backend(name: str) -> Backend:
    if name == "cpu":
        return CPUBackend()
    if name == "cuda":
        return CUDABackend()
    raise ValueError(f"unknown backend {name!r}; use 'cpu' or 'cuda'")


def backend_of(a) -> Backend:
    """The backend an array belongs to: NumPy arrays are CPU, CUDA-array-interface objects CUDA."""
    if isinstance(a, np.ndarray):
        return get_backend("cpu")
    if hasattr(a, "__cuda_array_interface__"):
        return get_backend("cuda")
    raise TypeError(f"expected a NumPy or CUDA array, got {type(a).__name__}")
