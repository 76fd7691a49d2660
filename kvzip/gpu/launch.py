"""Launching a stage's kernels (channel.cu, channel_rans.cu) on CuPy arrays, on the current
device and stream: grids bounded per multiprocessor, dynamic shared memory past the static limit
opted into once per kernel and size, and the 16-byte alignment the kernels' vector loads need.
CuPy is imported on first use."""
from __future__ import annotations

from functools import lru_cache

BLOCKS_PER_SM = 16       # grid-stride kernels: at most this many blocks a multiprocessor
STATIC_SHARED = 48 * 1024  # dynamic shared memory past this needs the kernel's opt-in
NO_ERROR = (1 << 64) - 1   # an error word that no check has lowered


def cupy():
    import cupy

    return cupy


@lru_cache(maxsize=None)
def _kernel(get, name: str, device: int, shared: int):
    """Kernel `name` of the module `get` (a loader function: name, device -> kernel) on `device`,
    allowed `shared` bytes of dynamic shared memory."""
    f = get(name, device)
    if shared > STATIC_SHARED:
        f.max_dynamic_shared_size_bytes = shared
    return f


@lru_cache(maxsize=None)
def max_grid(device: int) -> int:
    return BLOCKS_PER_SM * cupy().cuda.Device(device).attributes["MultiProcessorCount"]


def launch(get, name: str, blocks: int, threads: int, args: tuple, shared: int = 0, opt_in: int | None = None,
           grid_stride: bool = True):
    """Kernel `name` of `get`'s module on `blocks` blocks (none where blocks <= 0), at most
    max_grid of them for a grid-stride kernel, with `shared` bytes of dynamic shared memory;
    opt_in (default shared): the bytes the kernel is allowed, one value for calls whose sizes vary."""
    if blocks <= 0:
        return
    device = cupy().cuda.Device().id
    f = _kernel(get, name, device, shared if opt_in is None else opt_in)
    f((min(blocks, max_grid(device)) if grid_stride else blocks,), (threads,), args, shared_mem=shared)


def aligned(a):
    """a as a C-contiguous array whose data is 16-byte aligned (the kernels' vector loads)."""
    cp = cupy()
    a = cp.ascontiguousarray(a)
    return a if a.data.ptr % 16 == 0 else a.copy()
