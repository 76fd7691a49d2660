"""The CUDA sources' shape (kvzip/gpu/kernels/) and the kernel loader's options, without a GPU:
every file small enough to read, every header included somewhere, every Tuning field reaching
the compile options, the name expressions or the host code that reads it; and, where NVRTC is
importable (cuda-bindings and libnvrtc), the whole set of name expressions compiles to PTX."""
import dataclasses
import re

import pytest

from kvzip.formats import FORMATS
from kvzip.gpu import loader, programs, tuning

MAX_LINES = 600
INCLUDE = re.compile(r'^#include "([^"]+)"', re.M)


def test_each_kernel_file_is_short_and_guarded():
    for name, text in loader.sources().items():
        assert text.count("\n") <= MAX_LINES, f"{name}: {text.count(chr(10))} lines"
        if name.endswith(".cuh") or name not in loader.TOP_LEVEL:
            assert "#pragma once" in text, f"{name} has no include guard"


def test_every_file_is_reached_from_a_top_level_source():
    src = loader.sources()
    reached, todo = set(), list(loader.TOP_LEVEL)
    while todo:
        name = todo.pop()
        if name in reached:
            continue
        reached.add(name)
        for inc in INCLUDE.findall(src[name]):
            assert inc in src, f"{name} includes {inc}, which is not in kvzip/gpu/kernels"
            todo.append(inc)
    assert reached == set(src), f"never included: {sorted(set(src) - reached)}"


def test_no_kernel_file_defaults_a_tuning_macro():
    macros = [f.metadata["name"] for f in dataclasses.fields(tuning.Tuning) if f.metadata["to"] == "macro"]
    guard = loader.sources()["tuning.cuh"]
    for m in macros:
        assert f"defined({m})" in guard, f"tuning.cuh does not require {m}"
        for name, text in loader.sources().items():
            assert not re.search(rf"#define\s+{m}\b", text), f"{name} defines {m}: only tuning.py sets it"


def _changed(t: tuning.Tuning, f) -> object:
    v = getattr(t, f.name)
    if isinstance(v, tuple):
        return (v[0] * 2, v[1] + 1)
    if isinstance(v, bool):
        return not v
    return v + 1


def test_every_tuning_field_is_rendered():
    """Changing any field changes what the loader builds (macro: the options; template: the name
    expressions) or what programs reads (host fields)."""
    fmt = FORMATS["e5m2"]

    def seen():
        units = loader.fused_units()
        (macros,) = {m for m, names in units if loader.instances(fmt)[0] in names}
        host = (programs._decode_split(fmt, 10_000, 3168), programs.slot_size(1024, "e5m2"), programs.slot_size(8192, "e5m2"),
                tuning.tuning_for("e5m2").early_return, tuning.tuning_for("e5m2").early_verdict,
                programs.heavy_escapes(fmt, 10_000))
        return macros, loader._format_names(fmt), host

    before = seen()
    for f in dataclasses.fields(tuning.Tuning):
        with tuning.override(formats=("e5m2",), **{f.name: _changed(tuning.tuning_for("e5m2"), f)}):
            macros, names, host = seen()
        where = {"macro": macros != before[0], "template": names != before[1], "host": host != before[2]}
        assert where[f.metadata["to"]], f"{f.name} ({f.metadata['to']}) changed nothing the loader or programs uses"
        if f.metadata["to"] == "macro":
            assert f"-D{f.metadata['name']}=" in " ".join(macros)
    assert seen() == before  # override restored the shipped tunings


def test_shipped_tunings_share_one_fused_module_and_options_carry_the_digest():
    (unit,) = loader.fused_units()
    opts = loader.options(unit[0])
    assert f"-DKVZ_SOURCES={loader.digest()}" in opts and any(o.startswith("-I") for o in opts)
    assert set(loader.HEAD_KERNELS) <= set(unit[1])


def _nvrtc():
    try:
        from cuda.bindings import nvrtc

        return nvrtc if int(nvrtc.nvrtcVersion()[0]) == 0 else None
    except Exception:
        return None


def _ptx_tools():
    """benchmarks/ptx_identity.py: compile_ptx through NVRTC, for compute_90."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "ptx_identity", Path(__file__).resolve().parents[1] / "benchmarks" / "ptx_identity.py")
    ptx = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ptx)
    return ptx


@pytest.mark.skipif(_nvrtc() is None, reason="NVRTC not importable (cuda-bindings with libnvrtc)")
def test_tca_tbe_decoder_compiles():
    """The weights' decoder compiles alone, as tca_tbe_gpu.py compiles it, with 16-byte loads and stores."""
    from kvzip.weights import tca_tbe_gpu

    text, _ = _ptx_tools().compile_ptx(tca_tbe_gpu.source(), ["-std=c++17"], [])
    assert f".entry {tca_tbe_gpu.KERNEL}(" in text
    assert "ld.global.nc.v4.u32" in text and "st.global.v4.u32" in text


@pytest.mark.skipif(_nvrtc() is None, reason="NVRTC not importable (cuda-bindings with libnvrtc)")
def test_every_name_expression_compiles():
    ptx = _ptx_tools()
    for u in loader.units():
        text, lowered = ptx.compile_ptx(u["code"], u["options"], u["names"])
        assert set(lowered) == set(u["names"]) and all(f".entry {s}(" in text for s in lowered.values())
    from kvzip.gpu import graphs  # the call shapes' own kernels: staging, and the into calls' first and last nodes

    for code, names in ((graphs._STAGE_SOURCE, ["kvz_stage"]), (graphs._INTO_SOURCE, ["kvz_into_start", "kvz_into_result"])):
        text, lowered = ptx.compile_ptx(code, ["-std=c++17"], names)
        assert all(f".entry {s}(" in text for s in lowered.values())
    # without the loader's -D options the fused module refuses to build
    with pytest.raises(RuntimeError, match="tuning.py"):
        ptx.compile_ptx(loader.sources()[loader.FUSED], [f"-I{loader.kernels_dir()}", "-std=c++17"], [])
