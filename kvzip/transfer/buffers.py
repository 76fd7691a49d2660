"""Registered memory and byte views of tensors, for torch tensors (CPU or CUDA) and NumPy arrays.

A ``Buffer`` is one allocation an engine writes from or into: NumPy memory on the CPU, plain
``cudaMalloc`` memory on a GPU (CUDA IPC, which Mooncake uses between processes of one host,
needs a whole cudaMalloc allocation, which a caching allocator's block is not).  Slots are views
of it in torch (CUDA, or CPU for torch tensors) or NumPy.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from ..arrays import resolve_lazy_bits


def framework(t) -> str:
    mod = type(t).__module__
    if mod.startswith("torch"):
        return "torch"
    if isinstance(t, np.ndarray):
        return "numpy"
    raise TypeError(f"kvzip.transfer sends torch tensors and NumPy arrays, not {type(t).__module__}.{type(t).__name__}")


def dtype_name(t) -> str:
    return str(t.dtype).removeprefix("torch.")


def raw_bytes(t):
    """The tensor's bytes as a 1-D uint8 array of its framework (a view when contiguous)."""
    if framework(t) == "torch":
        import torch

        return resolve_lazy_bits(t).contiguous().reshape(-1).view(torch.uint8)
    return np.ascontiguousarray(t).reshape(-1).view(np.uint8)


def message_bytes(t, device: str):
    """What Buffer.gather / scatter on ``device`` copies for tensor t: on a GPU the tensor itself
    when its memory is its bytes (contiguous, no lazy bits), else (and on the CPU) raw_bytes."""
    if device != "cpu" and framework(t) == "torch" and t.is_contiguous() and not t.is_neg() and not t.is_conj():
        return t
    return raw_bytes(t)


def nbytes(t) -> int:
    return math.prod(t.shape) * t.element_size() if framework(t) == "torch" else t.nbytes


def device_of(t) -> str:
    return str(t.device) if framework(t) == "torch" else "cpu"


def np_dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name)) if hasattr(ml_dtypes, name) and name not in np.sctypeDict else np.dtype(name)


class Buffer:
    """``nbytes`` of registered-able memory on ``device`` ("cpu" or "cuda[:i]")."""

    def __init__(self, nbytes: int, device: str):
        self.nbytes, self.device = nbytes, device
        if device == "cpu":
            self._np = np.empty(nbytes, dtype=np.uint8)
            self.ptr = self._np.ctypes.data
            self._torch = None
        else:
            import cupy
            import torch

            index = int(device.partition(":")[2] or 0)
            with cupy.cuda.Device(index):
                self._mem = cupy.cuda.Memory(nbytes)  # a cudaMalloc of its own, never pooled
            self.ptr = self._mem.ptr
            arr = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(self._mem, 0))
            self._torch = torch.as_tensor(arr, device=f"cuda:{index}")
            self._np = None
            self._tables: dict[int, list] = {}  # message offset -> [pinned host, device table, copy event]

    def array(self, offset: int, n: int):
        """Bytes [offset, offset + n) as a NumPy (CPU) or CuPy (GPU) uint8 array."""
        if self._np is not None:
            return self._np[offset:offset + n]
        import cupy

        return cupy.ndarray((n,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(self._mem, offset))

    def gather(self, offset: int, n: int, parts, stream=None):
        """Lay out a message of n bytes (a multiple of 8) at ``offset``: each part, (a 1-D uint8
        array, or on a GPU any contiguous tensor without lazy bits, and its offset in the message:
        a multiple of 8, increasing), copied there and zeros in between; returns the message's
        sum64_start.  On a GPU one kernel does it all, queued on ``stream`` (a torch stream) and
        not waited for: the parts must stay alive in that stream's order (torch's allocator sees
        to it for memory the stream's own work made)."""
        from ..checksum import sum64_start

        if self._np is not None:
            msg = self._np[offset:offset + n]
            end = 0
            for src, at in parts:
                msg[end:at] = 0
                src = src.numpy() if framework(src) == "torch" else src
                msg[at:at + src.shape[0]] = src
                end = at + src.shape[0]
            msg[end:] = 0
            return sum64_start(np, msg)
        return self._launch("kvz_gather_sum64", offset, n, [(*_span(src), at) for src, at in parts], stream)

    def scatter(self, offset: int, n: int, parts, stream=None):
        """The message of n bytes at ``offset``'s sum64_start, and each part, (a 1-D uint8 array
        to fill, its offset in the message), filled from the message; queued on ``stream`` on a
        GPU (one kernel) and not waited for."""
        from ..checksum import sum64_start

        if self._np is not None:
            msg = self._np[offset:offset + n]
            for dst, at in parts:
                (dst.numpy() if framework(dst) == "torch" else dst)[...] = msg[at:at + dst.shape[0]]
            return sum64_start(np, msg)
        return self._launch("kvz_scatter_sum64", offset, n, [(*_span(dst), at) for dst, at in parts], stream)

    def _launch(self, kernel: str, offset: int, n: int, rows: list, stream):
        import cupy

        from ..checksum import device_launch

        if n % 8 or any(at % 8 for *_, at in rows):
            raise ValueError("a message and its parts start and end on 8-byte words")
        with _cupy_stream(stream) as s:
            table = self._part_table(offset, rows, s)
            return device_launch(kernel, n // 8, table, np.int32(len(rows)), self.array(offset, n).view(cupy.uint64),
                                 cupy.uint64(n // 8))

    def _part_table(self, offset: int, rows: list, stream):
        """The part table on the device, copied on ``stream`` from pinned host memory of its own
        per message offset.  A copy from pageable memory would make the host wait for all the
        stream's earlier work (CUDA synchronises the stream before such a copy), which is the
        encode this message is built from."""
        import cupy
        import cupyx

        held = self._tables.get(offset)
        if held is None or held[0].shape[0] < len(rows):
            cap = 1 << max(6, (len(rows) - 1).bit_length())
            held = self._tables[offset] = [cupyx.empty_pinned((cap, 3), np.int64), cupy.empty((cap, 3), cupy.int64),
                                           None]
        host, dev, copied = held
        if copied is not None:
            copied.synchronize()  # the last copy out of this host table has run: it may be rewritten
        if rows:
            host[:len(rows)] = [(ptr, at, n) for ptr, n, at in rows]  # sum64.cu's row: address, offset, length
            dev[:len(rows)].set(host[:len(rows)], stream=stream)
        held[2] = stream.record()
        return dev

    def view(self, offset: int, n: int, fw: str = "torch"):
        """Bytes [offset, offset + n) as a uint8 array: torch on a GPU; on the CPU, NumPy or
        torch (zero-copy over the same memory) as ``fw`` asks."""
        if self._torch is not None:
            return self._torch[offset:offset + n]
        v = self._np[offset:offset + n]
        if fw == "torch":
            import torch

            return torch.from_numpy(v)
        return v

    def contains(self, ptr: int) -> bool:
        return self.ptr <= ptr < self.ptr + self.nbytes


def _cupy_stream(stream):
    """A torch stream as CuPy's current stream (CuPy 14 names it Stream.from_external)."""
    import cupy

    try:
        return cupy.cuda.Stream.from_external(stream)
    except (AttributeError, TypeError):  # CuPy 13, or a torch without the stream protocol
        return cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)


def _span(a) -> tuple[int, int]:
    """(address, length in bytes) of a GPU part: a torch tensor whose memory is its bytes (a
    uint8 blob, or a contiguous tensor without lazy bits), taken as it is because on the GPU
    host every torch call that made a byte view would cost microseconds a tensor."""
    if framework(a) == "torch":
        return a.data_ptr(), a.nbytes
    raise TypeError(f"a GPU message part must be a torch tensor, not {type(a).__name__}")


def data_ptr(a) -> int:
    if framework(a) == "torch":
        return a.data_ptr()
    return a.ctypes.data if a.size else 0


def empty_like_entry(entry: dict, device: str):
    """An uninitialised tensor for a TensorEntry, on ``device``: torch for torch entries and for
    every entry on a GPU receiver (NumPy has no GPU arrays), NumPy for NumPy entries on the CPU."""
    shape = tuple(entry["shape"])
    if entry["framework"] == "numpy" and device == "cpu":
        return np.empty(shape, dtype=np_dtype(entry["dtype"]))
    import torch

    dt = getattr(torch, entry["dtype"], None)
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"torch has no dtype {entry['dtype']!r}")
    return torch.empty(shape, dtype=dt, device=device)
