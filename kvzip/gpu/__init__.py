"""The fused GPU executor's runtime: CUDA C++ kernels (kernels/) run through CuPy on the caller's
stream, as programs cached per call shape and replayed as CUDA graphs.

Nothing here is imported by ``import kvzip``; CuPy loads on first GPU use.  docs/internals.md maps
the modules.
"""
