"""Write scalar bit logic once; compile it for the CPU (@njit) and for CUDA (device functions).

A module of helpers is plain Python functions.  ``twin_compile(funcs, target)`` clones each
function into a private globals dict in which every helper name points at its compiled
version for that target, so helpers calling helpers resolve to the same target.  The CPU
kernels and the CUDA kernels then call the very same source, and the two backends cannot
drift apart bit by bit.

CPU code is compiled by ``cpu_jit``: Numba's @njit with its on-disk cache (``cache=True``), so a
second process loads the machine code instead of compiling it (~1-3 s a format on the 2-core
CI machine, docs/guide.md "Start-up").  Numba keys a cached function on its own bytecode, the
values its closure holds and a hash of its own source file only; a kernel whose helpers live in
another file (kvzip/bitlogic.py, kvzip/fp8_bits.py) would keep old helper code after an edit of
that file.  ``cpu_jit``'s cache therefore also keys on a hash of every file of kvzip's CPU
kernels (``KERNEL_MODULES``): any edit of any of them recompiles them all, once.

Rules that keep a CPU kernel cacheable: it is a module-level function, or a closure over ints
and bools only (the per-format field widths, frozen into the code as constants); everything it
calls is a module-level ``cpu_jit`` function referenced as a global of its module.  A closure
over another compiled function would never hit: Numba pickles closure values into the key, and
a dispatcher pickles with a per-process id.  CUDA device functions and kernels are not cached;
they compile on first CUDA use, so importing kvzip never needs numba-cuda.
"""
from __future__ import annotations

import hashlib
import importlib
import types
from functools import lru_cache
from types import SimpleNamespace

GPU_INSTALL_HINT = "pip install 'kvzip[cuda12]' (CUDA 12) or 'kvzip[cuda13]' (CUDA 13)"

# The modules whose functions the CPU kernels compile (theirs or their helpers): their sources'
# hash is part of every cpu_jit cache key.
KERNEL_MODULES = ("kvzip.jit", "kvzip.bitlogic", "kvzip.fp8_bits", "kvzip.checksum", "kvzip.stages.fused_cpu",
                  "kvzip.stages.quantize_fp8", "kvzip.stages.channel_pack_cpu",
                  "kvzip.stages.channel_rans_cpu")


def numba_cuda():
    """numba.cuda from the numba-cuda package, which only the GPU extras install.  Numba's own
    deprecated numba.cuda (still in numba 0.6x) is refused: the kernels and the simulator tests
    are written against numba-cuda, and a half-working built-in target would fail later and
    less clearly."""
    try:
        import numba_cuda  # noqa: F401
    except ImportError as e:
        raise ImportError(f"kvzip's CUDA backend needs numba-cuda, which is not installed: {GPU_INSTALL_HINT}") from e
    from numba import cuda

    return cuda


@lru_cache(maxsize=None)
def kernel_sources_digest() -> str:
    """sha256 over the sources of KERNEL_MODULES (read on the first cache look-up, not at import)."""
    h = hashlib.sha256()
    for name in KERNEL_MODULES:
        path = importlib.import_module(name).__file__
        with open(path, "rb") as f:
            h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


@lru_cache(maxsize=None)
def _cache_class():
    """Numba's FunctionCache with kernel_sources_digest() in the index key; None where this
    Numba lays its cache out otherwise (cpu_jit then falls back to plain cache=True)."""
    try:
        from numba.core.caching import FunctionCache
    except ImportError:
        return None
    if not callable(getattr(FunctionCache, "_index_key", None)):
        return None

    class KernelCache(FunctionCache):
        def _index_key(self, sig, codegen):
            return super()._index_key(sig, codegen) + (kernel_sources_digest(),)

    return KernelCache


class _LazyCache:
    """A dispatcher's cache, made on its first use (a compile, or .stats), not at import: Numba
    makes its cache when it decorates, and that finds and creates the cache directory.  Where no
    directory is writable (NUMBA_CACHE_DIR unset, the package's __pycache__ read-only and no
    user cache directory either) the kernels still run, compiled in every process, instead of
    ``import kvzip`` failing as a plain ``cache=True`` would."""

    def __init__(self, cache_class, py_func):
        self._cache_class, self._py_func, self._cache = cache_class, py_func, None

    def _get(self):
        if self._cache is None:
            try:
                self._cache = self._cache_class(self._py_func)
            except RuntimeError:  # "cannot cache function ...: no locator available"
                from numba.core.caching import NullCache

                self._cache = NullCache()
        return self._cache

    def __getattr__(self, name):
        return getattr(self._get(), name)


def cpu_jit(fn=None, **options):
    """@njit(**options) with the on-disk cache described above.  ``@cpu_jit`` or ``@cpu_jit(nogil=True)``."""
    from numba import njit

    def decorate(f):
        cache = _cache_class()
        if cache is None:
            return njit(cache=True, **options)(f)
        dispatcher = njit(cache=False, **options)(f)
        dispatcher._cache = _LazyCache(cache, dispatcher.py_func)  # what Dispatcher.enable_caching sets, made lazily
        return dispatcher

    return decorate if fn is None else decorate(fn)


def twin_compile(funcs, target: str) -> SimpleNamespace:
    if target == "cpu":
        decorate = cpu_jit
    elif target == "cuda":
        decorate = numba_cuda().jit(device=True)
    else:
        raise ValueError(target)
    funcs = list(funcs)
    shared_globals = dict(funcs[0].__globals__)
    compiled = {}
    for f in funcs:
        clone = types.FunctionType(f.__code__, shared_globals, f.__name__, f.__defaults__, f.__closure__)
        compiled[f.__name__] = shared_globals[f.__name__] = decorate(clone)
    return SimpleNamespace(**compiled)
