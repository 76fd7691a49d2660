"""Where the bits live: the CPU backend (NumPy + Numba @njit) and the CUDA backend
(CuPy buffers + Numba-CUDA kernels on the caller's current stream).

Under the Numba CUDA simulator (``NUMBA_ENABLE_CUDASIM=1``) the CUDA backend keeps its buffers
in NumPy and runs the very same kernels in the simulator, so CI without a GPU still exercises
every GPU kernel.
"""
from __future__ import annotations

import os
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
        from numba import cuda

        self._cuda = cuda
        self.simulated = cuda_simulated()
        if self.simulated:
            self.xp = np
        else:
            import cupy

            self.xp = cupy

    def to_numpy(self, a) -> np.ndarray:
        if self.simulated:
            return np.asarray(a)
        return self.xp.asnumpy(a)

    def from_numpy(self, a: np.ndarray):
        return a if self.simulated else self.xp.asarray(a)

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
