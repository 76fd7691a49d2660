"""Write scalar bit logic once; compile it for the CPU (@njit) and for CUDA (device functions).

A module of helpers is plain Python functions.  ``twin_compile(funcs, target)`` clones each
function into a private globals dict in which every helper name points at its compiled
version for that target, so helpers calling helpers resolve to the same target.  The CPU
kernels and the CUDA kernels then call the very same source, and the two backends cannot
drift apart bit by bit.
"""
from __future__ import annotations

import types
from types import SimpleNamespace

GPU_INSTALL_HINT = "pip install 'kvzip[cuda12]' (CUDA 12) or 'kvzip[cuda13]' (CUDA 13)"


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


def twin_compile(funcs, target: str) -> SimpleNamespace:
    if target == "cpu":
        from numba import njit

        decorate = njit(cache=False)
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
