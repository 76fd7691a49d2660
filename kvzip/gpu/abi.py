"""The host-kernel ABI of the fused kernels (kernels/abi.cuh): the job tables' rows by field name.

Every row the host hands the kernels is a run of 8-byte words (pointers, counts), so the host
keeps them as (k, columns) uint64 arrays: the cheapest thing to fill per call.  Here each table's
fields are named as in its C struct, with a NumPy structured dtype over the same bytes; host code
takes column numbers from the names (``DECODE.col("dst")``: the field's offset // 8) and slices
of neighbouring fields (``DECODE.span("esc_pos", "exp_high")``), never literals.

kvzip/gpu/kernels/abi_check.cuh, generated from this module (``python -m kvzip.gpu.headers --write``;
tests/test_abi.py fails when the committed file differs), static_asserts every struct's size and
every field's offset and size after the struct definitions, so a struct edited without this
module fails to compile.

Tables without a C struct (the kernels index them as words) are named here all the same: HEADS,
(address, length) a blob, what kvz_gather_heads, kvz_check_heads and guess_head read; CHECKS,
what kvz_check_heads writes a blob (head_facts' out[8]); SIZES, what finish_blob writes a blob.
"""
from __future__ import annotations

import operator

import numpy as np

WORD = 8


class Table:
    """One row type: its C struct's name (None where the kernels index words) and its fields
    (name, or (name, words) for an array field), each WORD bytes a word."""

    def __init__(self, struct: str | None, fields):
        self.struct = struct
        self.fields = tuple((f, 1) if isinstance(f, str) else tuple(f) for f in fields)
        self.dtype = np.dtype([(name, "<u8") if n == 1 else (name, "<u8", (n,)) for name, n in self.fields])
        self.names = tuple(name for name, _ in self.fields)
        self.columns = self.dtype.itemsize // WORD
        self.nbytes = self.dtype.itemsize
        self._col = {name: self.dtype.fields[name][1] // WORD for name in self.names}
        self._words = dict(self.fields)
        # The field each word belongs to, in order.
        self.words = tuple(name for name, n in self.fields for _ in range(n))

    def col(self, name: str) -> int:
        """The column (word index in a row) of field name."""
        return self._col[name]

    def span(self, first: str, last: str | None = None) -> slice:
        """The columns of fields first .. last (in order, adjacent), as a slice."""
        last = first if last is None else last
        lo, hi = self._col[first], self._col[last] + self._words[last]
        if hi <= lo:
            raise ValueError(f"{self.struct}: {first} .. {last} is no run of fields")
        return slice(lo, hi)

    def row(self, k: int = 1, **values) -> np.ndarray:
        """A (k, columns) uint64 table, every row with the named fields set (the others 0)."""
        out = np.zeros(k, self.dtype)
        for name, value in values.items():
            out[name] = value
        return out.view(np.uint64).reshape(k, self.columns)

    def rows(self, records) -> np.ndarray:
        """A (len(records), columns) uint64 table from dicts of field values (missing ones 0)."""
        out = np.zeros(len(records), self.dtype)
        for name in self.names:
            out[name] = [r.get(name, 0) for r in records]
        return out.view(np.uint64).reshape(len(records), self.columns)

    def maker(self, *names):
        """A function of the values of fields names (in that order; array fields not allowed)
        giving the whole row as a tuple of columns, the other fields 0: rows for
        np.array(..., np.uint64) built by name at the cost of one call a row."""
        where = {name: i for i, name in enumerate(names)}
        if len(where) != len(names) or any(self._words[name] != 1 for name in names):
            raise ValueError(f"{self.struct}: fields {names} must be distinct single words")
        get = operator.itemgetter(*(where.get(name, len(names)) for name in self.words))
        return lambda *values: get(values + (0,))

    def view(self, table: np.ndarray) -> np.ndarray:
        """The (k,) structured view of a (k, columns) uint64 table (C-contiguous)."""
        return table.view(self.dtype).reshape(table.shape[0])


ENCODE = Table("EncodeJob", ("src", "n", "codes", "rest", "esc_count", "esc_pos", "slot_pos", "slot_exp",
                             "chunk_base", "sb_base", "q_table", "q_scale", "lut"))
DECODE = Table("DecodeJob", ("codes", "rest", "esc_count", "esc_pos", "esc_exp", "exp_high", "n", "n_esc", "n_high",
                             "dst", "dlo", "dhi", "chunk_base", "sb_base", "dq_table", "dq_scale"))
FINISH = Table("FinishJob", ("blob", "tmpl", "header_len", "table_at", "var_base", ("pad", 6), "write_header",
                                 "compact", "codebook"))
HEADS = Table(None, ("ptr", "len"))
CHECKS = Table(None, ("ok", "esc_pos", "esc_exp", "exp_high", "n_esc", "n_high", "header_len", "stream_count"))
SIZES = Table(None, ("n_esc", "n_high", "payload_len"))
STRUCTS = (ENCODE, DECODE, FINISH)


def cuh() -> str:
    """kvzip/gpu/kernels/abi_check.cuh: static_asserts of STRUCTS' layouts."""
    lines = [
        "// kvzip/gpu/kernels/abi_check.cuh: the job structs' layout as the host writes them.",
        "// Generated from kvzip/gpu/abi.py by `python -m kvzip.gpu.headers --write`: do not edit (tests/test_abi.py",
        "// checks that this file is that text).  Included after the struct definitions.",
        "// Every field is whole 8-byte words and there is no padding, so with each field's size and the",
        "// struct's size asserted here, the fields' order fixes every offset; tests/test_abi.py checks that",
        "// order in abi.cuh against kvzip/gpu/abi.py.  (NVRTC of CUDA 13.0 has no __builtin_offsetof.)",
        "#pragma once",
    ]
    for t in STRUCTS:
        s = t.struct
        lines += ["", f"static_assert(sizeof({s}) == {t.nbytes}, \"{s}: {t.columns} words, as kvzip/gpu/abi.py\");"]
        for name, n in t.fields:
            lines.append(f"static_assert(sizeof({s}::{name}) == {n * WORD}, \"{s}::{name}: column {t.col(name)}, "
                         f"{n} word{'s' if n > 1 else ''}\");")
    lines += [""]
    return "\n".join(lines)


def cuh_path():
    from pathlib import Path

    return Path(__file__).parent / "kernels" / "abi_check.cuh"


def aligned(a) -> bool:
    """Whether a CuPy array starts on a 16-byte boundary: the kernels' vector loads need it of
    every stream they read in place."""
    return a.data.ptr % 16 == 0


# ----------------------------------------------------------------------------- kernel arguments
# Each kernel's parameters by name, in its signature's order, and how each travels: "ptr" a device
# address (a uint64; graphs.Region and graphs.Mapped, which CallShape resolves to addresses, pass
# unchanged), "i32" an int, "i64" a long long.  tests/test_abi.py reads every signature in
# kernels/ and checks these against it, so a launch is written by name and cannot drift from the
# kernel.  (A params struct a kernel was tried and not taken: benchmarks/NOTES.md, r1.)
def _address(v):
    return v if type(v) is not int and isinstance(v, int) else np.uint64(v)  # Region, Mapped: as they are


class KernelArgs:
    __slots__ = ("kernel", "params", "names", "_casts")

    _CASTS = {"ptr": _address, "i32": np.int32, "i64": np.int64}

    def __init__(self, kernel: str, params: str):
        self.kernel = kernel
        self.params = tuple(tuple(p.split(":")) for p in params.split())
        self.names = tuple(name for name, _ in self.params)
        self._casts = tuple((name, self._CASTS[kind]) for name, kind in self.params)

    def __call__(self, **values) -> tuple:
        """The launch's argument tuple from one value per parameter name."""
        try:
            if len(values) == len(self._casts):
                return tuple([cast(values[name]) for name, cast in self._casts])
        except KeyError:
            pass
        missing, extra = set(self.names) - values.keys(), values.keys() - set(self.names)
        raise TypeError(f"{self.kernel}: missing {sorted(missing)}, unknown {sorted(extra)}")


ENCODE_ARGS = KernelArgs("kvz_encode", "jobs:ptr njobs:i32 total_chunks:i64 chunk:i32 slot:i32 work:ptr "
                                       "queue_at:i64 ready:ptr")
AUTO_CODEBOOK_ARGS = KernelArgs("kvz_auto_codebook", "jobs:ptr work:ptr hist_at:i64 luts:ptr books:ptr")
SCAN_ARGS = KernelArgs("kvz_scan", "jobs:ptr njobs:i32 chunk:i32 slot:i32 work:ptr chunk_off:ptr fin:ptr "
                                   "sizes:ptr heads:ptr expect:ptr span:i32 down:ptr flag:ptr runs:ptr")
DECODE_ARGS = KernelArgs("kvz_decode", "jobs:ptr njobs:i32 units:i64 chunk:i32 chunk_off:ptr work:ptr queue_at:i64 "
                                       "scan_blocks:i64 split_at:i64 part_shift:i32")
GATHER_HEADS_ARGS = KernelArgs("kvz_gather_heads", "jobs:ptr span:i32 dst:ptr")
CHECK_HEADS_ARGS = KernelArgs("kvz_check_heads", "heads:ptr span:i32 checks:ptr")
AMAX_ARGS = KernelArgs("kvz_amax", "src:ptr src_at:ptr n:i64 out:ptr")
QUANT_TABLE_ARGS = KernelArgs("kvz_quant_table", "amax:ptr scale:ptr addrs:ptr scale_word:i32 scale_span:i32 table:ptr")
QUANTIZE_ARGS = KernelArgs("kvz_quantize", "src:ptr n:i64 table_g:ptr out:ptr")
DEQUANT_TABLES_ARGS = KernelArgs("kvz_dequant_tables", "addrs:ptr word:i32 stride:i32 single:ptr tables:ptr")
DEQUANTIZE_ARGS = KernelArgs("kvz_dequantize", "codes:ptr n:i64 scale:ptr out:ptr")
W_GEMM_ARGS = KernelArgs("kvz_w_gemm", "blocks:ptr codebook:ptr esc_off:ptr esc_pos:ptr esc_val:ptr x:ptr ldx:i32 "
                                       "bias:ptr y:ptr ldy:i32 partial:ptr tickets:ptr M:i32 K:i32 N:i32 chunks:i32 "
                                       "per_split:i32")
W_GEMM_WIDE_ARGS = KernelArgs("kvz_w_gemm_wide", " ".join(f"{n}:{k}" for n, k in W_GEMM_ARGS.params))
W_DECODE_ARGS = KernelArgs("kvz_w_decode", "blocks:ptr codebook:ptr out:ptr M:i32 K:i32 bands:i32 chunks:i32")
W_PATCH_ARGS = KernelArgs("kvz_w_patch", "esc_off:ptr esc_pos:ptr esc_val:ptr bands:i32 out:ptr K:i32")
W_HISTOGRAM_ARGS = KernelArgs("kvz_w_histogram", "w:ptr n:i64 hist:ptr ticket:ptr book:ptr code_of:ptr")
W_ENCODE_ARGS = KernelArgs("kvz_w_encode", "w:ptr M:i32 K:i32 code_of:ptr blocks:ptr counts:ptr band_counts:ptr "
                                           "ticket:ptr esc_off:ptr bands:i32 chunks:i32")
W_ESCAPES_ARGS = KernelArgs("kvz_w_escapes", "w:ptr M:i32 K:i32 code_of:ptr counts:ptr esc_off:ptr esc_pos:ptr "
                                             "esc_val:ptr bands:i32 chunks:i32")
W_KERNEL_ARGS = (W_GEMM_ARGS, W_GEMM_WIDE_ARGS, W_DECODE_ARGS, W_PATCH_ARGS, W_HISTOGRAM_ARGS, W_ENCODE_ARGS, W_ESCAPES_ARGS)

KERNEL_ARGS = (ENCODE_ARGS, AUTO_CODEBOOK_ARGS, SCAN_ARGS, DECODE_ARGS, GATHER_HEADS_ARGS, CHECK_HEADS_ARGS, AMAX_ARGS, QUANT_TABLE_ARGS,
               QUANTIZE_ARGS, DEQUANT_TABLES_ARGS, DEQUANTIZE_ARGS, *W_KERNEL_ARGS)
