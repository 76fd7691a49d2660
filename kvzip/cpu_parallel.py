"""Threads for the CPU kernels: chunks split into contiguous ranges, one range per thread.

The CPU kernels are compiled with ``nogil=True``, so Python threads running them run at the
same time.  The work is cut into whole chunks, and every chunk's output position is known
before it is written (or is fixed up by a serial pass afterwards), so the bytes do not depend
on the number of threads: tests compare 1, 2 and 3 threads with the serial reference.

The thread count defaults to the cores this process may run on; ``set_threads`` changes it
for the process and ``threads`` for a block of code in the calling thread only.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

# Below this many input bytes a range is not worth a thread hand-off (~20-50 us on the 2-core CI
# machine, about what one thread needs for 128 KiB of BF16 values).
MIN_BYTES_PER_THREAD = 1 << 17

_local = threading.local()
_lock = threading.Lock()
_process_threads: int | None = None  # None: every core this process may run on
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def available_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _check(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"a thread count must be a positive int, got {n!r}")
    return n


def set_threads(n: int | None) -> None:
    """Threads the CPU path uses from now on, in every thread of the process (None: all cores)."""
    global _process_threads
    _process_threads = None if n is None else _check(n)


def get_threads() -> int:
    """Threads the CPU path uses for a call made now from this thread."""
    n = getattr(_local, "threads", None)
    if n is not None:
        return n
    return _process_threads if _process_threads is not None else available_cores()


@contextmanager
def threads(n: int):
    """Run the CPU path with n threads inside the block (this thread only)."""
    _check(n)
    before = getattr(_local, "threads", None)
    _local.threads = n
    try:
        yield
    finally:
        _local.threads = before


def _executor(workers: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < workers:
            # A smaller pool is dropped, not shut down: a call in another thread may be submitting
            # to it; its threads end once the last such call lets go of it.
            _pool, _pool_size = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvzip-cpu"), workers
        return _pool


def split(nitems: int, item_bytes: int) -> list[tuple[int, int]]:
    """Contiguous ranges of nitems items (chunks, words) of item_bytes input bytes each, one per
    thread that gets enough work; always at least one."""
    want = min(get_threads(), max(1, (nitems * item_bytes) // MIN_BYTES_PER_THREAD), max(nitems, 1))
    bounds = [nitems * k // want for k in range(want + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def run_ranges(fn, ranges: list[tuple[int, int]]) -> list:
    """fn(c0, c1) for every range, the last in the calling thread; results in range order."""
    if len(ranges) == 1:
        return [fn(*ranges[0])]
    pool = _executor(len(ranges) - 1)
    futures = [pool.submit(fn, c0, c1) for c0, c1 in ranges[:-1]]
    last = fn(*ranges[-1])
    return [f.result() for f in futures] + [last]
