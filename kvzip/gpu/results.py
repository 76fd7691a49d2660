"""Where a call's results go: device memory the kernels write, handed out as arrays.

The fused GPU path never builds a caller framework's array itself: it is handed the caller
(a kvzip.arrays.Origin), whose ``results(nbytes)`` allocates in that framework (a torch caller's
memory comes from torch's allocator) and hands out its arrays.  Without a caller, the results are
raw CuPy arrays over a DeviceBuffer.
"""
from __future__ import annotations

import numpy as np

_U8 = np.dtype(np.uint8)


class DeviceBuffer:
    """nbytes of device memory from CuPy's pool: .ptr its address for the kernels, .memory the
    cupy.cuda.MemoryPointer, .array a CuPy uint8 array over it (built only when asked for: an
    empty() array is a large share of an allocation's host time)."""

    __slots__ = ("_array", "memory", "nbytes", "ptr")

    def __init__(self, nbytes: int):
        import cupy

        self._array, self.nbytes = None, max(nbytes, 1)
        self.memory = cupy.cuda.alloc(self.nbytes)
        self.ptr = self.memory.ptr

    @property
    def array(self):
        if self._array is None:
            import cupy

            self._array = cupy.ndarray((self.nbytes,), _U8, self.memory)
        return self._array

    def places(self, starts) -> list:
        """What blobs() needs of each start, worked out ahead (while the GPU runs): the memory
        pointers, ~15 % of building a CuPy array."""
        at = self.memory
        return [at + s if s else at for s in starts]

    def blobs(self, starts, lengths, places=None) -> list:
        """The bytes [start, start + length) as 1-D CuPy uint8 arrays; None where length is None.
        lengths: any iterable, read as the blobs are built.  places: self.places(starts)."""
        import cupy

        return [None if n is None else cupy.ndarray((n,), _U8, p) for p, n in zip(places or self.places(starts), lengths)]


def allocate(nbytes: int, origin=None):
    """A buffer for nbytes of results: origin's (its framework's arrays) or a DeviceBuffer."""
    return origin.results(nbytes) if origin is not None else DeviceBuffer(nbytes)
