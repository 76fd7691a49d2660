"""Which path the calling thread's last encode or decode took, for tests and benchmarks.

    "fast"    the fused GPU executor's kernels (kvzip/gpu/executor.py)
    "fused"   the staged executor with ExponentSplit, Top16Pack and EscapeStream run as one fused
              step (its CPU twin or its Numba-CUDA kernels: stages/fused.py)
    "staged"  the staged executor, stage by stage
    "stored"  the values stored raw (the size fallback)

Per thread, so concurrent callers never see each other's answer; nothing is written onto the
(shared, immutable) Pipeline.
"""
from __future__ import annotations

import threading

_local = threading.local()


def last_path() -> str | None:
    """The path of this thread's last call (None before any)."""
    return getattr(_local, "path", None)


def note(path: str) -> None:
    _local.path = path
