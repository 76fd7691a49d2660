"""kvzip/gpu/abi.py, the job tables by field name, against the C structs of kernels/abi.cuh and
the static_asserts generated for them (kvzip/gpu/kernels/abi_check.cuh)."""
import re
from pathlib import Path

import numpy as np
import pytest

import kvzip
from kvzip.gpu import abi

KERNELS = Path(kvzip.__file__).parent / "gpu" / "kernels"
SOURCE = (KERNELS / "abi.cuh").read_text()  # the job structs


def c_fields(struct: str) -> list:
    """(name, words) of each data member of struct in abi.cuh (every member 8 bytes wide)."""
    m = re.search(r"^struct " + struct + r" \{[^\n]*\n(.*?)^\};", SOURCE, re.S | re.M)
    assert m, f"struct {struct} not found in abi.cuh"
    out = []
    for line in m.group(1).splitlines():
        line = re.sub(r"//.*", "", line).strip()
        if not line or line.startswith("static "):
            continue
        for part in line.rstrip(";").split(","):  # "type a", then "b" of "type a, b"; "pad[6]"
            name, count = re.fullmatch(r".*?(\w+)\s*(?:\[(\d+)\])?\s*", part).groups()
            out.append((name, int(count) if count else 1))
    return out


@pytest.mark.parametrize("table", abi.STRUCTS, ids=lambda t: t.struct)
def test_fields_are_the_c_structs(table):
    assert list(table.fields) == c_fields(table.struct)


def test_abi_check_cuh_is_generated():
    """abi_check.cuh is what kvzip.gpu.abi.cuh() gives (regenerate: `python -m kvzip.gpu.headers --write`), and
    abi.cuh includes it after the last job struct."""
    assert abi.cuh_path().read_text() == abi.cuh()
    at = SOURCE.index('#include "abi_check.cuh"')
    assert all(SOURCE.index(f"struct {t.struct} ") < at for t in abi.STRUCTS)


def test_abi_check_cuh_asserts_every_field():
    text = abi.cuh()
    for t in abi.STRUCTS:
        assert f"static_assert(sizeof({t.struct}) == {8 * t.columns}," in text
        for name, words in t.fields:
            assert f"static_assert(sizeof({t.struct}::{name}) == {8 * words}, \"{t.struct}::{name}: column " \
                   f"{t.col(name)}," in text


def test_dtypes_are_rows_of_words():
    for t in (*abi.STRUCTS, abi.HEADS, abi.CHECKS, abi.SIZES):
        assert t.dtype.itemsize == t.nbytes == 8 * t.columns == 8 * len(t.words)
        at = 0
        for name, words in t.fields:
            assert t.dtype.fields[name][1] == at and t.col(name) == at // 8
            at += 8 * words
        assert at == t.nbytes


def test_columns_the_host_writes():
    """The columns programs.py and layout_cache.py write, by name, are the ones the kernels have
    always read (the literals they replaced)."""
    from kvzip.gpu import layout_cache, programs

    assert (programs.ENCODE_COLUMNS, programs.Q_SCALE, programs.FINISH_COLUMNS) == (13, 11, 14)
    assert (programs.DECODE_COLUMNS, programs.DQ_TABLE, programs.DQ_SCALE, programs._DST) == (16, 14, 15, 9)
    assert programs._STREAMS == slice(0, 6) and programs._BASES == slice(12, 14)
    assert programs._ENCODE_OUT == [2, 3, 4, 5] and programs._SRC == 0
    assert (abi.HEADS.nbytes, abi.CHECKS.nbytes, abi.SIZES.nbytes) == (16, 64, 24)
    assert layout_cache._ESCAPE_STREAMS == slice(3, 6) and layout_cache._ESCAPE_LENGTHS == slice(7, 9)
    assert (layout_cache._ESC_POS, layout_cache._N_HIGH) == (3, 8)
    assert layout_cache._AT == slice(1, 4) and layout_cache._COUNTS == slice(4, 6)
    assert (layout_cache._H, layout_cache._NS) == (6, 7) and layout_cache._FACTS == slice(0, 6)


def test_rows_by_name():
    d = abi.DECODE
    row = d.row(codes=1, rest=2, esc_count=3, n=7, dlo=10, dhi=11)
    assert row.dtype == np.uint64 and row.shape == (1, 16)
    assert row[0].tolist() == [1, 2, 3, 0, 0, 0, 7, 0, 0, 0, 10, 11, 0, 0, 0, 0]
    make = d.maker("codes", "rest", "esc_count", "esc_pos", "esc_exp", "exp_high", "n", "n_esc", "n_high", "dlo", "dhi")
    assert list(make(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11)) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 10, 11, 0, 0, 0, 0]
    f = abi.FINISH.rows([dict(blob=5, tmpl=6, header_len=7, table_at=8, var_base=9, pad=tuple(range(20, 26)),
                              write_header=1, compact=1, codebook=3)])
    assert f.shape == (1, 14) and f[0].tolist() == [5, 6, 7, 8, 9, 20, 21, 22, 23, 24, 25, 1, 1, 3]
    view = abi.DECODE.view(np.repeat(row, 3, axis=0))
    assert view.shape == (3,) and view["n"].tolist() == [7, 7, 7] and view["dhi"][0] == 11
    with pytest.raises(ValueError):
        d.span("n_high", "esc_pos")


def kernel_params(kernel: str) -> list[tuple[str, str]]:
    """(name, kind) of each parameter of the __global__ kernel in kernels/ (.cu or .cuh): "ptr"
    for a pointer, "i32" for int, "i64" for long long / i64."""
    sources = "\n".join(p.read_text() for p in sorted(KERNELS.iterdir()) if p.suffix in (".cu", ".cuh"))
    sources = re.sub(r"/\*.*?\*/", "", sources, flags=re.S)
    m = re.search(r"__global__[^;{]*?\b" + kernel + r"\s*\(([^)]*)\)\s*\{", sources, re.S)
    assert m, f"no __global__ {kernel} in kernels/"
    out = []
    for param in m.group(1).split(","):
        param = " ".join(param.split())
        name = re.search(r"(\w+)$", param).group(1)
        kind = "ptr" if "*" in param else "i64" if re.search(r"\b(long long|i64)\b", param) else "i32"
        assert "*" in param or re.search(r"\b(int|long long|i64)\b", param), param
        out.append((name, kind))
    return out


@pytest.mark.parametrize("spec", abi.KERNEL_ARGS, ids=lambda s: s.kernel)
def test_kernel_arguments_are_the_signatures(spec):
    assert list(spec.params) == kernel_params(spec.kernel)


def test_kernel_arguments_by_name():
    from kvzip.gpu.graphs import Region

    args = abi.CHECK_HEADS_ARGS(heads=Region(0), span=2048, checks=7)
    assert type(args[0]) is Region and args[1].dtype == np.int32 and args[2].dtype == np.uint64 and args[2] == 7
    with pytest.raises(TypeError, match="missing.*span"):
        abi.CHECK_HEADS_ARGS(heads=0, checks=0)


def test_auto_codebook_kernel_constants_are_the_rules():
    """kernels/auto_codebook.cu restates kvzip/auto_codebook.py's constants and programs.py's
    sizes of its launch: they must agree (the GPU's codebooks are the CPU reference's only then)."""
    import re

    from kvzip import auto_codebook
    from kvzip.gpu import loader, programs

    text = (loader.kernels_dir() / "auto_codebook.cu").read_text()
    defined = {k: int(v, 0) for k, v in re.findall(r"#define (AUTO_\w+) (0x[0-9A-Fa-f]+|\d+)", text)}
    assert defined["AUTO_RUN"] == auto_codebook.RUN_LENGTH
    assert defined["AUTO_ALIGN"] == auto_codebook.ALIGN
    assert defined["AUTO_MAX_SHIFT"] == auto_codebook.MAX_SHIFT
    assert defined["AUTO_FULL_BITS"] == auto_codebook.FULL_READ_BELOW.bit_length()
    assert defined["AUTO_WEYL"] == auto_codebook.WEYL
    assert defined["AUTO_LUT_BYTES"] == programs.AUTO_LUT_BYTES
    assert defined["AUTO_UNROLL"] == programs.AUTO_UNROLL


def test_guess_constants_are_the_hosts():
    """abi.cuh's guess constants, which programs.py restates for the job rows it stages."""
    import re

    from kvzip.gpu import loader, programs

    text = (loader.kernels_dir() / "abi.cuh").read_text()
    assert int(re.search(r"#define GUESS_MISSED (\d+)", text).group(1)) == programs.GUESS_MISSED
    assert re.search(r"#define GUESS_PENDING \(-1ll\)", text) and programs.GUESS_PENDING == np.uint64(2**64 - 1)
    assert 1 << int(re.search(r"#define HEAD_LEN_CAPACITY \(1ull << (\d+)\)", text).group(1)) == \
        programs.HEAD_LEN_CAPACITY
