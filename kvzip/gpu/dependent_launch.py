"""Programmatic dependent launch (Hopper and later): let a kernel's blocks start while the kernel
before it in the stream is still running, so they sit resident at their first instruction when it
ends instead of being launched after it.

Our kernels (kvzip/gpu/kernels/ and graphs' staging kernel) all begin with `await_predecessor()`
(PTX `griddepcontrol.wait`, which returns once the previous grid has completed and its memory is
visible), then release their own successor (`griddepcontrol.launch_dependents`).  Launched the
ordinary way, both instructions do nothing, so the same kernels run correctly either way; only the
launch differs.  CuPy has no launch with attributes, so this calls the driver's cuLaunchKernelEx
through ctypes.  It is used when graphs records a call's CUDA graph (and in the call's eager
first run), where stream capture turns the attribute into a programmatic edge of the graph: the
Python cost of a launch here is paid once per call shape, not per call.
"""
from __future__ import annotations

import ctypes
from functools import lru_cache

import numpy as np

ENABLED = True  # benchmarks (benchmarks/dependent_launch_ab.py) and tests switch it off to compare

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID (cuda.h)
_MIN_DRIVER = 12030  # CUDA 12.3: stream capture records programmatic edges in graphs
_MIN_MAJOR = 9       # griddepcontrol needs sm_90


class _Attribute(ctypes.Structure):  # CUlaunchAttribute: an id, padding to 8, a 64-byte union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_Attribute)), ("num_attrs", ctypes.c_uint)]


@lru_cache(maxsize=None)
def _driver_launch():
    """cuLaunchKernelEx from the driver library, or None where the driver has none."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(_Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    return fn


@lru_cache(maxsize=None)
def supported(device_id: int) -> bool:
    """Whether device_id and the driver can launch dependents (compute capability 9.0+, CUDA 12.3+)."""
    import cupy

    major = cupy.cuda.Device(device_id).compute_capability[:-1]
    return (int(major) >= _MIN_MAJOR and cupy.cuda.runtime.driverGetVersion() >= _MIN_DRIVER
            and _driver_launch() is not None)


def usable() -> bool:
    """Launch dependents now (ENABLED, on a device and driver that support it)?"""
    if not ENABLED:
        return False
    import cupy

    return supported(cupy.cuda.Device().id)


def launch(kernel, grid: tuple, block: tuple, args: tuple, stream) -> None:
    """Launch kernel (a cupy.cuda.Function or RawKernel) on stream as a programmatic dependent of
    the stream's previous kernel.  args: numpy scalars (their dtype is the C type)."""
    function = getattr(kernel, "kernel", kernel)  # RawKernel -> its Function
    values = [np.array(a) for a in args]           # held until the driver has copied them
    params = (ctypes.c_void_p * max(len(values), 1))(*[v.ctypes.data for v in values])
    attr = _Attribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
    config = _Config((ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*block), 0, ctypes.c_void_p(stream.ptr),
                     ctypes.pointer(attr), 1)
    status = _driver_launch()(ctypes.byref(config), ctypes.c_void_p(function.ptr), params, None)
    if status != 0:
        import cupy

        raise cupy.cuda.driver.CUDADriverError(status)
