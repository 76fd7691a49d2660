"""Start-up: what `import kvzip` loads, and Numba's on-disk cache of the CPU kernels.

Each test runs fresh interpreters: what one process imported or compiled must not leak into the
next.  No timing is asserted (benchmarks/startup.py measures it); cache use is read from Numba's
own counters (``Dispatcher.stats``).
"""
import importlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap

import kvzip

# Loaded on first GPU use, or by the caller, never by `import kvzip` (ml_dtypes takes ~0.5 s).
HEAVY = ("numba.cuda", "numba_cuda", "cupy", "cupyx", "cuda.bindings", "cuda.core", "ml_dtypes", "torch", "jax")

IMPORT_SCRIPT = textwrap.dedent("""
    import json, sys
    import kvzip
    heavy = json.loads(sys.argv[1])
    print(json.dumps(sorted(m for m in sys.modules if any(m == h or m.startswith(h + ".") for h in heavy))))
""")

# Compress and decompress in every CPU kernel family: BF16 (the word-wise loops), FP16 (group by
# group), the checksum, and QuantizeFP8 in front of SplitZip.  Prints, for every kvzip dispatcher that
# holds compiled code, its name, cache hits, cache misses and cache directory.
USE_SCRIPT = textwrap.dedent("""
    import gc, json, sys
    import numpy as np
    import kvzip
    from kvzip import stages
    from kvzip.testing import kv_like_bits

    for name, checksum in (("bf16", False), ("fp16", True)):
        bits = kv_like_bits(name, 5000, escape_rate=0.02, seed=3)
        blob = kvzip.compress(bits, dtype=name, checksum=checksum)
        assert np.asarray(kvzip.decompress(blob)).view(bits.dtype).tobytes() == bits.tobytes()
    pipe = kvzip.Pipeline([stages.QuantizeFP8("e5m2"), stages.ExponentSplit(), stages.Top16Pack(),
                           stages.EscapeStream(), stages.Serialize(False)])
    bits = kv_like_bits("bf16", 4096, seed=4).reshape(64, 64)
    pipe.decode(pipe.encode(bits, dtype="bf16"))

    from numba.core.dispatcher import Dispatcher
    used = [d for d in gc.get_objects() if isinstance(d, Dispatcher) and d.overloads
            and (d.py_func.__module__ or "").startswith("kvzip")]  # not Numba's own overloads
    print(json.dumps([[d.py_func.__qualname__, sum(d.stats.cache_hits.values()),
                       sum(d.stats.cache_misses.values()), d.stats.cache_path] for d in used]))
""")

# The kernels a compress / decompress of the script above runs at the top level.
TOP_KERNELS = {"kernels.<locals>.encode_range", "kernels.<locals>.decode_range", "_compact", "_decode_offsets",
               "sum_terms", "_cpu_kernels.<locals>.amax", "_cpu_kernels.<locals>.scales",
               "_cpu_kernels.<locals>.encode", "_cpu_kernels.<locals>.decode"}


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_ENABLE_CUDASIM", "NUMBA_CACHE_DIR",
                                                              "NUMBA_DISABLE_JIT", "XDG_CACHE_HOME")}
    env.update(extra)
    return env


def _run(script, *args, env, cwd=None):
    out = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=env,
                         cwd=cwd, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_kvzip_loads_no_gpu_package_nor_ml_dtypes():
    assert _run(IMPORT_SCRIPT, json.dumps(HEAVY), env=_env()) == []


def test_torch_and_float16_callers_never_load_ml_dtypes():
    """ml_dtypes loads only when a bf16 / fp8 result goes to NumPy (it is that result's dtype)."""
    script = textwrap.dedent("""
        import json, sys
        import numpy as np
        import torch
        import kvzip
        for dtype in (torch.bfloat16, torch.float8_e5m2, torch.float16):
            x = torch.arange(-300, 300, dtype=torch.float32).to(dtype)
            assert kvzip.decompress(kvzip.compress(x, checksum=True)).view(torch.uint8).equal(x.view(torch.uint8))
        x = np.linspace(-3, 3, 999, dtype=np.float16)
        assert kvzip.decompress(kvzip.compress(x)).tobytes() == x.tobytes()
        before = "ml_dtypes" in sys.modules
        y = kvzip.decompress(kvzip.compress(np.arange(999, dtype=np.uint16), dtype="bf16"))
        print(json.dumps([before, "ml_dtypes" in sys.modules, str(y.dtype)]))
    """)
    assert _run(script, env=_env()) == [False, True, "bfloat16"]


def test_gpu_modules_load_on_first_gpu_use():
    """Under the CUDA simulator too, `import kvzip` leaves numba.cuda alone; the first call on the
    CUDA backend loads it (and no CuPy: the simulator keeps the buffers in NumPy)."""
    script = textwrap.dedent("""
        import json, sys
        import numpy as np
        import kvzip
        before = "numba.cuda" in sys.modules
        bits = np.arange(4096, dtype=np.uint16)
        blob = kvzip.compress(bits, dtype="bf16", backend="cuda")
        assert np.asarray(kvzip.decompress(blob, backend="cuda")).view(np.uint16).tobytes() == bits.tobytes()
        print(json.dumps([before, "numba.cuda" in sys.modules, "cupy" in sys.modules]))
    """)
    assert _run(script, env=_env(NUMBA_ENABLE_CUDASIM="1")) == [False, True, False]


def _uses(env, cwd=None):
    rows = _run(USE_SCRIPT, env=env, cwd=cwd)
    names = {r[0] for r in rows}
    assert TOP_KERNELS <= names, TOP_KERNELS - names
    return rows


def test_second_process_loads_the_cpu_kernels_from_the_disk_cache(tmp_path):
    env = _env(NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    first = _uses(env)
    assert all(misses > 0 and hits == 0 for _, hits, misses, _ in first), first  # an empty cache: all compiled
    second = _uses(env)
    # Every kernel that ran came from the disk (its helpers were not even compiled), none compiled.
    assert {r[0] for r in second} == TOP_KERNELS, second
    assert all(hits > 0 and misses == 0 for _, hits, misses, _ in second), second
    assert all(path.startswith(str(tmp_path / "numba")) for *_, path in second), second


def _read_only_copy(dest):
    """kvzip's package as an install in a read-only site-packages would be: a copy (stages/ and
    codebooks/ inside it, as pyproject.toml maps them) in which no __pycache__ can be made.  A
    file named __pycache__ blocks the directory for root too, who may write into read-only
    directories; write permission is removed as well."""
    pkg = os.path.dirname(kvzip.__file__)
    ignore = shutil.ignore_patterns("__pycache__", "*.npz")
    shutil.copytree(pkg, dest / "kvzip", ignore=ignore)
    for sub in ("stages", "codebooks"):  # in a source checkout they lie beside kvzip/, not in it
        if not os.path.isdir(dest / "kvzip" / sub):
            src = os.path.dirname(importlib.import_module(f"kvzip.{sub}").__file__)
            shutil.copytree(src, dest / "kvzip" / sub, ignore=ignore)
    for d, dirs, files in os.walk(dest / "kvzip"):
        with open(os.path.join(d, "__pycache__"), "w"):
            pass
    for d, dirs, files in os.walk(dest / "kvzip"):
        for f in files:
            os.chmod(os.path.join(d, f), stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
        os.chmod(d, stat.S_IRUSR | stat.S_IXUSR | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
    return dest


def _writable(root):
    for d, dirs, files in os.walk(root):
        os.chmod(d, stat.S_IRWXU)
        for f in files:
            os.chmod(os.path.join(d, f), stat.S_IRUSR | stat.S_IWUSR)


def test_read_only_package_caches_in_the_user_cache_dir(tmp_path):
    """Installed where __pycache__ cannot be written, Numba caches under ~/.cache/numba (or
    $NUMBA_CACHE_DIR); with no writable place at all kvzip still runs, compiling every time."""
    site = _read_only_copy(tmp_path / "site")
    try:
        home = tmp_path / "home"
        home.mkdir()
        env = _env(PYTHONPATH=str(site), HOME=str(home))
        cwd = str(tmp_path)  # not the checkout: its kvzip/ would shadow the copy
        assert _run("import json, kvzip; print(json.dumps(kvzip.__file__))", env=env, cwd=cwd).startswith(str(site))
        first = _uses(env, cwd)
        user_cache = str(home / ".cache" / "numba")
        assert all(path.startswith(user_cache) for *_, path in first), first
        second = _uses(env, cwd)
        assert all(hits > 0 and misses == 0 for _, hits, misses, _ in second), second

        nowhere = tmp_path / "nowhere"  # a HOME whose .cache cannot be a directory either
        nowhere.mkdir()
        (nowhere / ".cache").write_text("")
        script = textwrap.dedent("""
            import json
            import numpy as np
            import kvzip
            from kvzip.stages import fused_cpu
            bits = np.arange(3000, dtype=np.uint16)
            assert np.asarray(kvzip.decompress(kvzip.compress(bits, dtype="fp16"))).view(np.uint16).tobytes() == bits.tobytes()
            print(json.dumps([fused_cpu._compact.stats.cache_path, sum(fused_cpu._compact.stats.cache_hits.values())]))
        """)
        assert _run(script, env=_env(PYTHONPATH=str(site), HOME=str(nowhere)), cwd=cwd) == [None, 0]  # compiled, no cache
    finally:
        _writable(site)  # so that pytest can remove tmp_path
