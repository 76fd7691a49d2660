"""Shared test configuration.

Hypothesis profiles (pick one with HYPOTHESIS_PROFILE=...; default "ci"):
  ci        moderate example counts (tests set their own max_examples, scaled by this profile's
            factor through ``examples()``), no deadline (Numba compiles on first use), no
            database writes outside .hypothesis/;
  thorough  ten times the examples, for a long local or nightly run;
  quick     a fifth, for a fast smoke run.

tests/cuda_sim runs only in its own process with NUMBA_ENABLE_CUDASIM=1 set before numba is
imported (the simulator replaces numba.cuda at import time); in the normal run it is not even
collected.  tests/gpu is collected only where CuPy sees a CUDA GPU.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_SCALE = {"ci": 1.0, "thorough": 10.0, "quick": 0.2}
PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
if PROFILE not in _SCALE:
    raise ValueError(f"HYPOTHESIS_PROFILE must be one of {sorted(_SCALE)}, got {PROFILE!r}")

for _name, _scale in _SCALE.items():
    settings.register_profile(
        _name,
        deadline=None,
        max_examples=max(5, int(50 * _scale)),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
    )
settings.load_profile(PROFILE)


def examples(n: int) -> int:
    """``n`` examples scaled by the active profile (at least 3)."""
    return max(3, int(n * _SCALE[PROFILE]))


collect_ignore: list[str] = []
if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    collect_ignore.append("cuda_sim")


def _cuda_gpu() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


if not _cuda_gpu():  # tests/gpu imports CuPy at the top and needs a real GPU
    collect_ignore.append("gpu")
