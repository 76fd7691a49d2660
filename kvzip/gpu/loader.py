"""The kernel loader: reads the CUDA sources in kvzip/gpu/kernels/, builds the NVRTC options
(the headers' folder, the tuning's -D macros, a digest of every kernel file) and the name
expressions, and caches one CuPy RawModule per (device, options, names).

Top-level sources: fused.cu (kvz_encode, kvz_scan, kvz_decode and the header kernels, which
include the .cuh headers), quantize.cu (QuantizeFP8 per tensor), weights.cu (the weights'
decode+GEMM and decode, self-contained), channel.cu (the ratio mode's ChannelPack, on the fused
module's headers and base options), channel_rans.cu (the storage mode's ChannelRans, likewise)
and tca_tbe.cu (compiled by kvzip/weights/tca_tbe_gpu.py).  CuPy's compile cache keys a
module by its top-level text and options only, so the digest of all kernel files
(-DKVZ_SOURCES=...) goes into the options: an edited header is a new key.

The fused module's name expressions come from each format's Tuning (kvzip/gpu/tuning.py): shapes
as template arguments, macros as options.  Formats whose macros agree share one module (the
shipped tunings all do: one module, as before the kernels were split into files).
"""
from __future__ import annotations

import hashlib
from functools import lru_cache
from importlib.resources import files

from kvzip.formats import FORMATS

from . import tuning

BASE_OPTIONS = ("-std=c++17", "-lineinfo")
FUSED, QUANTIZE, WEIGHTS = "fused.cu", "quantize.cu", "weights.cu"
TCA_TBE = "tca_tbe.cu"  # the weights' TCA-TBE decoder: self-contained, compiled by kvzip/weights/tca_tbe_gpu.py
SUM64 = "sum64.cu"      # sum64 and transfer messages' gather/scatter: self-contained, compiled by kvzip/checksum.py
CHANNEL = "channel.cu"  # the ratio mode's ChannelPack kernels (kvzip/gpu/channel_pack.py launches them)
CHANNEL_RANS = "channel_rans.cu"  # the storage mode's ChannelRans kernels (kvzip/gpu/channel_rans.py launches them)
TOP_LEVEL = (FUSED, QUANTIZE, WEIGHTS, TCA_TBE, SUM64, CHANNEL, CHANNEL_RANS)  # the sources modules are built from; the rest are headers
HEAD_KERNELS = ("kvz_gather_heads", "kvz_check_heads")
TYPES = {1: "unsigned char", 2: "unsigned short", 4: "unsigned int"}


def kernels_dir():
    return files("kvzip.gpu").joinpath("kernels")


@lru_cache(maxsize=None)
def sources() -> dict:
    """{file name: text} of every kernel source (.cu, .cuh)."""
    return {p.name: p.read_text() for p in sorted(kernels_dir().iterdir(), key=lambda p: p.name)
            if p.name.endswith((".cu", ".cuh"))}


@lru_cache(maxsize=None)
def digest() -> str:
    h = hashlib.sha256()
    for name, text in sources().items():
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:16]


def options(macros: tuple = ()) -> tuple:
    return BASE_OPTIONS + (f"-I{kernels_dir()}",) + tuple(macros) + (f"-DKVZ_SOURCES={digest()}",)


# ----------------------------------------------------------------------------- name expressions
def _args(fmt) -> str:
    return f"{fmt.exp_bits},{fmt.mant_bits},{TYPES[fmt.itemsize]}"


def instances(fmt) -> tuple:
    """The kernel names of one format: encode, encode-side scan, decode-side scan, decode."""
    t = tuning.tuning_for(fmt.name)
    args = _args(fmt)
    (eg, eb), (dg, db) = t.encode_shape, t.decode_shape
    return (f"kvz_encode<{args},{eg},{eb}>", f"kvz_scan<{args},EncodeJob>", f"kvz_scan<{args},DecodeJob>",
            f"kvz_decode<{args},{dg},{db}>")


def heavy_decode(fmt) -> str:
    """kvz_decode's escape-heavy instance of a format (decode.cu's SCATTER_MIN: chunks of many
    escapes patched in memory)."""
    t = tuning.tuning_for(fmt.name)
    g, b = t.decode_shape
    return f"kvz_decode<{_args(fmt)},{g},{b},false,{t.scatter_min}>"


def auto_codebook(fmt) -> str:
    """kvz_auto_codebook of a format: each tensor's own codebook, chosen on the device."""
    return f"kvz_auto_codebook<{_args(fmt)}>"


def quantizing_encode(fmt) -> tuple:
    """kvz_encode and its scan for an FP8 format reading 16-bit values and quantizing them as
    they load (QuantizeFP8 per tensor fused in)."""
    g, b = tuning.tuning_for(fmt.name).quantizing_encode_shape
    args = _args(fmt)
    return f"kvz_encode<{args},{g},{b},true>", f"kvz_scan<{args},EncodeJob,true>"


def dequantizing_decode(fmt) -> str:
    """kvz_decode of an FP8 format writing 16-bit values through each job's dq_table."""
    g, b = tuning.tuning_for(fmt.name).dequantizing_decode_shape
    return f"kvz_decode<{_args(fmt)},{g},{b},true>"


def _format_names(fmt) -> tuple:
    names = instances(fmt)
    if fmt.itemsize == 1:
        names += (dequantizing_decode(fmt), *quantizing_encode(fmt))
    return names + (heavy_decode(fmt),)


@lru_cache(maxsize=None)
def fused_units() -> tuple:
    """((macros, names), ...): the fused modules the tunings in force need, the names in the
    order the single module of the shipped tunings has always listed them."""
    groups: dict = {}
    for fmt in FORMATS.values():
        groups.setdefault(tuning.tuning_for(fmt.name).macros(), []).append(fmt)
    base = tuning.tuning_for(None).macros()
    groups.setdefault(base, [])
    out = []
    for macros, fmts in groups.items():
        names = tuple(x for fmt in fmts for x in instances(fmt))
        names += HEAD_KERNELS if macros == base else ()
        names += tuple(x for fmt in fmts if fmt.itemsize == 1
                       for x in (dequantizing_decode(fmt), *quantizing_encode(fmt)))
        names += tuple(auto_codebook(fmt) for fmt in fmts)
        names += tuple(heavy_decode(fmt) for fmt in fmts)
        out.append((macros, names))
    return tuple(out)


@lru_cache(maxsize=None)
def _unit_of(name: str) -> tuple:
    for macros, names in fused_units():
        if name in names:
            return macros, names
    raise KeyError(f"{name} is no kernel of the fused module's tunings in force")


# ----------------------------------------------------------------------------- modules
@lru_cache(maxsize=None)
def _module(device_id: int, top: str, opts: tuple, names: tuple):
    import cupy

    return cupy.RawModule(code=sources()[top], options=opts, name_expressions=list(names))


def fused_kernel(name: str, device_id: int):
    """A kernel of the fused module (a name from instances() and the like, or HEAD_KERNELS)."""
    macros, names = _unit_of(name)
    return _module(device_id, FUSED, options(macros), names).get_function(name)


def quantize_kernel(name: str, names: tuple, device_id: int):
    """A kernel of quantize.cu's module of name expressions names."""
    return _module(device_id, QUANTIZE, options(), names).get_function(name)


WEIGHT_N_TILES = (1, 2, 4)  # kvz_w_gemm's instances: N <= 8 x tiles columns of x
WEIGHT_WIDE_N_TILES = (1, 2, 4, 8, 16)  # kvz_w_gemm_wide's: 8 x tiles columns of x a thread block
WEIGHT_NAMES = (tuple(f"kvz_w_gemm<{t}>" for t in WEIGHT_N_TILES)
                + tuple(f"kvz_w_gemm_wide<{t}>" for t in WEIGHT_WIDE_N_TILES)
                + ("kvz_w_decode", "kvz_w_patch", "kvz_w_histogram", "kvz_w_encode", "kvz_w_escapes"))


def weights_kernel(name: str, device_id: int):
    """A kernel of weights.cu's module (kvzip/gpu/weights.py launches them)."""
    return _module(device_id, WEIGHTS, options(), WEIGHT_NAMES).get_function(name)


QUANTIZE_SOURCES = ("bf16", "fp16")  # the 16-bit formats quantize.cu's kernels read
QUANTIZE_TARGETS = {"e5m2": "false", "e4m3": "true"}  # FP8 format -> finite-only ("fn") flag of the kernels


def quantize_fields(name: str) -> str:
    f = FORMATS[name]
    return f"{f.exp_bits},{f.mant_bits}"


def amax_name(source: str) -> str:
    """kvz_amax of a 16-bit source format: a tensor's largest magnitude."""
    return f"kvz_amax<{quantize_fields(source)}>"


def quant_table_name(source: str, fp8: str) -> str:
    """kvz_quant_table of a format pair: the scale and the quantizing table from the amax."""
    return f"kvz_quant_table<{quantize_fields(source)},{quantize_fields(fp8)},{QUANTIZE_TARGETS[fp8]}>"


def dequantize_name(fp8: str, source: str) -> str:
    """kvz_dequantize of a format pair: FP8 codes back to 16-bit values with one scale."""
    return f"kvz_dequantize<{quantize_fields(fp8)},{QUANTIZE_TARGETS[fp8]},{quantize_fields(source)}>"


def dequant_tables_name(fp8: str, source: str) -> str:
    """kvz_dequant_tables of a format pair: the dequantizing decode's tables from each scale."""
    return f"kvz_dequant_tables<{quantize_fields(fp8)},{QUANTIZE_TARGETS[fp8]},{quantize_fields(source)}>"


@lru_cache(maxsize=None)
def quantize_names() -> tuple:
    """The name expressions of quantize.cu's module."""
    names = ["kvz_quantize"]
    for src in QUANTIZE_SOURCES:
        names.append(amax_name(src))
        for fp8 in QUANTIZE_TARGETS:
            names.append(quant_table_name(src, fp8))
            names.append(dequantize_name(fp8, src))
            names.append(dequant_tables_name(fp8, src))
    return tuple(names)


def channel_gpl(fmt) -> int:
    """Groups a lane takes a step in channel.cu's encode and decode: two, one for 32-bit values
    (whose 8-value group is already two 16-byte loads)."""
    return 1 if fmt.itemsize == 4 else 2


def channel_names() -> tuple:
    """The name expressions of channel.cu's module: its kernels for every format."""
    names = ["kvz_ch_scan", "kvz_ch_compact"]
    for e in sorted({f.exp_bits for f in FORMATS.values()}):
        names.append(f"kvz_ch_tables<{e}>")
    for fmt in FORMATS.values():
        args, gpl = _args(fmt), channel_gpl(fmt)
        names += [f"kvz_ch_histogram<{args}>", f"kvz_ch_encode<{args},{gpl}>", f"kvz_ch_decode<{args},{gpl}>"]
    return tuple(names)


def channel_kernel(name: str, device_id: int):
    """A kernel of channel.cu's module (a name of channel_names())."""
    return _module(device_id, CHANNEL, options(tuning.tuning_for(None).macros()), channel_names()).get_function(name)


def channel_rans_names() -> tuple:
    """The name expressions of channel_rans.cu's module: its kernels for every format."""
    names = ["kvz_rans_offsets", "kvz_rans_compact"]
    names += [f"kvz_rans_tables<{e}>" for e in sorted({f.exp_bits for f in FORMATS.values()})]
    for fmt in FORMATS.values():
        args = _args(fmt)
        names += [f"kvz_rans_histogram<{args}>", f"kvz_rans_encode<{args}>", f"kvz_rans_decode<{args}>"]
    return tuple(names)


def channel_rans_kernel(name: str, device_id: int):
    """A kernel of channel_rans.cu's module (a name of channel_rans_names())."""
    return _module(device_id, CHANNEL_RANS, options(tuning.tuning_for(None).macros()),
                   channel_rans_names()).get_function(name)


def units() -> list:
    """Every module the tunings in force build, as benchmarks/ptx_identity.py compiles them:
    [{unit, code, options, names}]."""
    out = [{"unit": "fused" if i == 0 else f"fused{i}", "code": sources()[FUSED], "options": list(options(macros)),
            "names": list(names)} for i, (macros, names) in enumerate(fused_units())]
    out.append({"unit": "quantize", "code": sources()[QUANTIZE], "options": list(options()),
                "names": list(quantize_names())})
    out.append({"unit": "weights", "code": sources()[WEIGHTS], "options": list(options()),
                "names": list(WEIGHT_NAMES)})
    base = list(options(tuning.tuning_for(None).macros()))
    out.append({"unit": "channel", "code": sources()[CHANNEL], "options": base, "names": list(channel_names())})
    out.append({"unit": "channel_rans", "code": sources()[CHANNEL_RANS], "options": base,
                "names": list(channel_rans_names())})
    return out


def _forget() -> None:
    fused_units.cache_clear()
    _unit_of.cache_clear()


tuning.on_change(_forget)
