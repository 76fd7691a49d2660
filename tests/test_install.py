"""A CPU-only install: kvzip imports and runs without numba-cuda or CuPy (the GPU extras), and
asking for the CUDA backend then says which extra to install."""
import subprocess
import sys
import textwrap

# Run in a fresh interpreter in which numba_cuda and cupy cannot be imported (sys.modules entries
# of None make every import of them fail), as on an install without the GPU extras.
SCRIPT = textwrap.dedent("""
    import sys
    for name in ("numba_cuda", "cupy"):
        sys.modules[name] = None
    import numpy as np
    import kvzip
    from kvzip.data import load_sample
    from kvzip.cli import main

    x = load_sample("code")["code/layer00.k"]
    for checksum in (False, True):
        blob = kvzip.compress(x, checksum=checksum)
        assert np.array_equal(kvzip.decompress(blob).view(np.uint16), x.view(np.uint16))
    assert main(["demo", "--repeat", "1"]) == 0
    loaded = sorted(m for m, mod in sys.modules.items()
                    if mod is not None and (m == "numba.cuda" or m.startswith(("numba.cuda.", "numba_cuda", "cupy"))))
    assert not loaded, loaded
    try:
        kvzip.compress(x, backend="cuda")
    except ImportError as e:
        print("CUDA:", e)
    else:
        raise AssertionError("the CUDA backend ran without numba-cuda")
""")


def test_cpu_path_needs_no_gpu_packages():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "backend cpu" in out.stdout
    assert "CUDA: kvzip's CUDA backend needs numba-cuda" in out.stdout
    assert "kvzip[cuda12]" in out.stdout and "kvzip[cuda13]" in out.stdout
