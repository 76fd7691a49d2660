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


def twin_compile(funcs, target: str) -> SimpleNamespace:
    if target == "cpu":
        from numba import njit

        decorate = njit(cache=False)
    elif target == "cuda":
        from numba import cuda

        decorate = cuda.jit(device=True)
    else:
        raise ValueError(target)
    funcs = list(funcs)
    shared_globals = dict(funcs[0].__globals__)
    compiled = {}
    for f in funcs:
        clone = types.FunctionType(f.__code__, shared_globals, f.__name__, f.__defaults__, f.__closure__)
        compiled[f.__name__] = shared_globals[f.__name__] = decorate(clone)
    return SimpleNamespace(**compiled)
