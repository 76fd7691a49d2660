"""QuantizeFP8 on the CPU backend: scalar bit helpers against ml_dtypes/NumPy casts, the stage
against an independent NumPy oracle, the documented error bound, specials, edge shapes, decode
validation and config round trip."""
from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from numba import njit

from kvzip import FormatError, fp8_bits
from kvzip.backends import get_backend
from kvzip.formats import FORMATS
from kvzip.frame import Frame
from kvzip.jit import twin_compile
from kvzip.stages.base import stage_from_config
from kvzip.stages.quantize_fp8 import QuantizeFP8

ML_DTYPE = {
    "bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32,
    "e5m2": ml_dtypes.float8_e5m2, "e4m3": ml_dtypes.float8_e4m3fn,
}
FMAX = {"e5m2": 57344.0, "e4m3": 448.0}
FP8_PARAMS = {"e5m2": (5, 2, 0), "e4m3": (4, 3, 1)}  # exp bits, mantissa bits, finite-only
SOURCES = ("bf16", "fp16", "fp32")
CASES = [(src, fp8, g) for src in SOURCES for fp8 in ("e5m2", "e4m3") for g in ("tensor", "channel")]

# ---------------------------------------------------------------------------------------------
# Scalar helpers, compiled for the CPU exactly as the stage compiles them.

H = twin_compile(fp8_bits.HELPERS, "cpu")
_widen, _round, _quantize = H.widen_to_f32, H.round_from_f32, H.quantize


@njit
def widen_all(bits, e, m, fn):
    out = np.empty(bits.size, np.uint32)
    for i in range(bits.size):
        out[i] = _widen(bits[i], e, m, fn)
    return out


@njit
def round_all(bits, e, m, max_code, inf_result, nan_result):
    out = np.empty(bits.size, np.uint32)
    for i in range(bits.size):
        out[i] = _round(bits[i], e, m, max_code, inf_result, nan_result)
    return out


@njit
def quantize_all(bits, src_e, src_m, scale, e, m, fn):
    out = np.empty(bits.size, np.uint8)
    for i in range(bits.size):
        out[i] = _quantize(bits[i], src_e, src_m, scale, e, m, fn)
    return out


def all_codes(fmt):
    f = FORMATS[fmt]
    return np.arange(1 << f.width, dtype=f.uint_dtype)


def f32_test_patterns():
    """Every sign and exponent, with mantissas on and around each target's rounding ties,
    plus random patterns."""
    mants = {0, 1, 2, 3, (1 << 23) - 1, (1 << 22)}
    for m in (2, 3, 7, 10):  # e5m2, e4m3, bf16, fp16 mantissa widths
        half = 1 << (22 - m)
        for k in (0, 1, 2, 3, 5, (1 << m) - 1):
            base = k << (23 - m)
            mants |= {base + half - 1, base + half, base + half + 1, base + 1, base + 2 * half - 1}
    mants = np.array(sorted(x for x in mants if x < (1 << 23)), np.uint32)
    sign_exp = np.arange(512, dtype=np.uint32) << 23
    grid = (sign_exp[:, None] | mants[None, :]).ravel()
    rand = np.random.default_rng(1).integers(0, 1 << 32, 1 << 18, dtype=np.uint32)
    return np.concatenate([grid, rand])


def nan_mask_f32(bits):
    return (bits & 0x7FFFFFFF) > 0x7F800000


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3", "bf16", "fp16"])
def test_widen_every_code_matches_ml_dtypes(fmt):
    f = FORMATS[fmt]
    codes = all_codes(fmt)
    ours = widen_all(codes, f.exp_bits, f.mant_bits, int(fmt == "e4m3"))
    ref = codes.view(ML_DTYPE[fmt]).astype(np.float32).view(np.uint32)
    nan = nan_mask_f32(ref)
    np.testing.assert_array_equal(ours[~nan], ref[~nan])
    # NaN: float32's quiet NaN, sign kept.
    np.testing.assert_array_equal(ours[nan], (ref[nan] & 0x80000000) | 0x7FC00000)


def test_widen_fp32_is_identity_except_nan_canonicalised():
    bits = f32_test_patterns()
    ours = widen_all(bits, 8, 23, 0)
    nan = nan_mask_f32(bits)
    np.testing.assert_array_equal(ours[~nan], bits[~nan])
    np.testing.assert_array_equal(ours[nan], (bits[nan] & 0x80000000) | 0x7FC00000)


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "e5m2", "fp32"])
def test_round_is_ieee_rne_with_overflow_to_inf(fmt):
    # max_code = the Inf pattern turns saturation into IEEE overflow-to-Inf, which is what
    # ml_dtypes/NumPy casts do for these formats.
    f = FORMATS[fmt]
    bits = f32_test_patterns()
    inf = fp8_bits.inf_code(f.exp_bits, f.mant_bits)
    ours = round_all(bits, f.exp_bits, f.mant_bits, inf, inf, 0x7FFFFFFF >> (31 - f.exp_bits - f.mant_bits))
    ref = to_bits(bits.view(np.float32), fmt).astype(np.uint32)
    nan = nan_mask_f32(bits)
    np.testing.assert_array_equal(ours[~nan], ref[~nan])
    sign = (bits[nan] >> 31).astype(np.uint32) << (f.width - 1)
    np.testing.assert_array_equal(ours[nan], sign | ((1 << (f.width - 1)) - 1))


def test_round_e4m3fn_matches_ml_dtypes_in_range_and_saturates_beyond():
    bits = f32_test_patterns()
    ours = round_all(bits, 4, 3, 0x7E, 0x7E, 0x7F)
    ref = to_bits(bits.view(np.float32), "e4m3").astype(np.uint32)
    x = bits.view(np.float32)
    finite = np.isfinite(x)
    in_range = finite & ((ref & 0x7F) != 0x7F)   # ml_dtypes overflows finite values to NaN
    np.testing.assert_array_equal(ours[in_range], ref[in_range])
    sign = (bits >> 31).astype(np.uint32) << 7
    beyond = ~np.isnan(x) & ~in_range            # overflowing finite values and ±Inf
    assert beyond.any()
    np.testing.assert_array_equal(ours[beyond], sign[beyond] | 0x7E)
    np.testing.assert_array_equal(ours[np.isnan(x)], sign[np.isnan(x)] | 0x7F)


@pytest.mark.parametrize("fp8", ["e5m2", "e4m3"])
def test_quantize_scalar_specials_and_saturation(fp8):
    e, m, fn = FP8_PARAMS[fp8]
    x = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e6, -1e6, 3e38, FMAX[fp8], -FMAX[fp8]], np.float32)
    q = quantize_all(x.view(np.uint32), 8, 23, np.float32(1.0), e, m, fn)
    top = 0x7E if fp8 == "e4m3" else 0x7B
    inf = 0x7E if fp8 == "e4m3" else 0x7C       # e4m3fn has no Inf: ±Inf saturates to ±448
    assert list(q) == [0x7F, 0xFF, inf, 0x80 | inf, 0x00, 0x80, top, 0x80 | top, top, top, 0x80 | top]


def test_scale_clamp_and_default():
    assert H.scale_from_amax(0, 8, 7, 5, 2, 0) == np.float32(1.0)
    assert fp8_bits.scale_from_amax(0, 8, 7, 5, 2, 0) == np.float32(1.0)  # plain Python runs too
    tiny = np.float32(1e-39).view(np.uint32)  # float32 subnormal amax: amax / fmax underflows
    assert H.scale_from_amax(tiny, 8, 23, 4, 3, 1) == np.float32(2.0 ** -126)
    big = np.float32(448.0 * 3).view(np.uint32)
    assert H.scale_from_amax(big, 8, 23, 4, 3, 1) == np.float32(3.0)


# ---------------------------------------------------------------------------------------------
# The stage against a NumPy/ml_dtypes oracle.

CPU = get_backend("cpu")


def frame_of(bits, fmt, shape, backend=CPU, **streams):
    f = FORMATS[fmt]
    bits = np.ascontiguousarray(bits, dtype=f.uint_dtype).ravel()
    meta = {"dtype": f.dtype_name, "shape": list(shape), "n": bits.size, "format": fmt}
    return Frame(backend, {"data": backend.from_numpy(bits), **streams}, meta)


def to_bits(values, fmt):
    """float values -> bits of fmt (RNE cast)."""
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to Inf is the point
        return np.asarray(values, np.float32).astype(ML_DTYPE[fmt]).view(FORMATS[fmt].uint_dtype)


def as_f32(bits, fmt):
    return bits.view(ML_DTYPE[fmt]).astype(np.float32)


def ref_scales(x, shape, fp8, granularity):
    """amax over finite values -> float32 scale, computed with NumPy float32 arithmetic."""
    n_channels = shape[-1] if granularity == "channel" and len(shape) else 1
    amax = np.zeros(n_channels, np.float32)
    if x.size:
        amax = np.where(np.isfinite(x), np.abs(x), np.float32(0)).reshape(-1, n_channels).max(axis=0)
    scale = amax / np.float32(FMAX[fp8])
    scale = np.maximum(scale, np.float32(2.0 ** -126))
    return np.where(amax == 0, np.float32(1.0), scale).astype(np.float32)


def broadcast_scales(scales, n):
    return np.resize(scales, n) if scales.size else np.zeros(0, np.float32)


def ref_quantize(x, s, fp8):
    """FP8 bits: ml_dtypes RNE for |q| <= fmax, explicit saturation / NaN / Inf otherwise."""
    with np.errstate(all="ignore"):
        q = (x / s).astype(np.float32)
    out = q.astype(ML_DTYPE[fp8]).view(np.uint8).copy()
    sign = np.signbit(x).astype(np.uint8) << 7
    top = 0x7E if fp8 == "e4m3" else 0x7B
    over = np.isfinite(x) & (np.abs(q) > FMAX[fp8])
    out[over] = sign[over] | top
    out[np.isnan(x)] = sign[np.isnan(x)] | 0x7F
    inf = np.isinf(x)
    out[inf] = sign[inf] | (0x7E if fp8 == "e4m3" else 0x7C)
    return out


def ref_dequantize(codes, s, fp8, src):
    """Source-format bits of RNE_src(float32(q) * s), non-NaN positions only meaningful."""
    with np.errstate(all="ignore"):
        y = (codes.view(ML_DTYPE[fp8]).astype(np.float32) * s).astype(np.float32)
    return to_bits(y, src)


shapes = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=6)


@st.composite
def tensors(draw, src, finite=False):
    """(shape, source bits): random bit patterns (every special and subnormal), floats of all
    magnitudes, or values clustered in a band so most of them survive quantization."""
    shape = draw(shapes)
    n = math.prod(shape)
    f = FORMATS[src]
    kind = draw(st.sampled_from(["bits", "floats", "band"]))
    if kind == "bits":
        bits = draw(hnp.arrays(f.uint_dtype, n))
    elif kind == "floats":  # every float32 magnitude, RNE-cast to the source format
        bits = to_bits(draw(hnp.arrays(np.float32, n, elements=st.floats(width=32))), src)
    else:
        rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
        center = draw(st.integers(-20, 10))
        vals = rng.standard_normal(n).astype(np.float32) * np.float32(2.0 ** center)
        bits = to_bits(vals, src)
    if finite:  # non-finite values (including fp16 cast overflow) become zeros
        x = as_f32(bits, src)
        bits = np.where(np.isfinite(x), bits, f.uint_dtype.type(0))
    return list(shape), bits


@pytest.mark.parametrize("src,fp8,granularity", CASES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_stage_matches_oracle(src, fp8, granularity, data):
    shape, bits = data.draw(tensors(src))
    stage = QuantizeFP8(fp8, granularity)
    enc = stage.encode(frame_of(bits, src, shape))
    x = as_f32(bits, src)

    scales = ref_scales(x, shape, fp8, granularity)
    np.testing.assert_array_equal(enc.streams["scales"], scales)
    s = broadcast_scales(scales, x.size)
    np.testing.assert_array_equal(enc.streams["data"], ref_quantize(x, s, fp8))
    assert enc.meta["format"] == fp8 and enc.meta["quantize_fp8"] == {"source_format": src}

    dec = stage.decode(enc)
    got = dec.streams["data"]
    assert got.dtype == FORMATS[src].uint_dtype and dec.meta["format"] == src
    assert "scales" not in dec.streams and "quantize_fp8" not in dec.meta
    codes = enc.streams["data"]
    nan = np.isnan(codes.view(ML_DTYPE[fp8]))
    ref = ref_dequantize(codes, s, fp8, src)
    np.testing.assert_array_equal(got[~nan], ref[~nan])
    f = FORMATS[src]
    quiet = fp8_bits.quiet_nan_code(f.exp_bits, f.mant_bits)
    sign = (codes[nan] >> 7).astype(f.uint_dtype) << (f.width - 1)
    np.testing.assert_array_equal(got[nan], sign | f.uint_dtype.type(quiet))


# ---------------------------------------------------------------------------------------------
# The error bound of docs/quantize.md.

U = 2.0 ** -24
SOURCE_ROUNDING = {"bf16": (2.0 ** -8, 2.0 ** -134), "fp16": (2.0 ** -11, 2.0 ** -25), "fp32": (0.0, 0.0)}


def error_bound(x, s, fp8, src):
    e, m, _ = FP8_PARAMS[fp8]
    emin = 2 - (1 << (e - 1))
    u8, a8 = 2.0 ** -(m + 1), 2.0 ** (emin - m - 1)
    us, a_src = SOURCE_ROUNDING[src]
    r = (1 + U) ** 2 * (1 + u8) * (1 + us) - 1
    return r * np.abs(x) + 1.01 * s * a8 + a_src + 2.0 ** -149


@pytest.mark.parametrize("src,fp8,granularity", CASES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_error_bound(src, fp8, granularity, data):
    shape, bits = data.draw(tensors(src, finite=True))
    stage = QuantizeFP8(fp8, granularity)
    enc = stage.encode(frame_of(bits, src, shape))
    y = as_f32(stage.decode(enc).streams["data"], src).astype(np.float64)
    x = as_f32(bits, src).astype(np.float64)
    s = broadcast_scales(enc.streams["scales"], x.size).astype(np.float64)
    assert np.isfinite(y).all()
    bound = error_bound(x, s, fp8, src)
    bad = np.abs(y - x) > bound * (1 + 1e-12)
    assert not bad.any(), (x[bad][:5], y[bad][:5], s[bad][:5])
    # The headline: values in the FP8 normal range keep a relative error of 2^-(M+1), plus
    # the source format's own rounding (relative, or absolute for its subnormals).
    e, m, _ = FP8_PARAMS[fp8]
    normal = np.abs(x) >= s * 2.0 ** (2 - (1 << (e - 1)))
    us, a_src = SOURCE_ROUNDING[src]
    rel = 2.0 ** -(m + 1) * (1 + us) + us + 2.0 ** -21
    assert (np.abs(y - x)[normal] <= rel * np.abs(x[normal]) + a_src).all()


# ---------------------------------------------------------------------------------------------
# Specials, subnormals and edge shapes through the stage.


@pytest.mark.parametrize("src", SOURCES)
@pytest.mark.parametrize("fp8", ["e5m2", "e4m3"])
def test_specials_through_stage(src, fp8):
    vals = np.array([FMAX[fp8], np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0], np.float32)
    bits = to_bits(vals, src)
    enc = QuantizeFP8(fp8).encode(frame_of(bits, src, [vals.size]))
    assert enc.streams["scales"].tolist() == [1.0]  # amax == fmax exactly
    top, inf = (0x7E, 0x7E) if fp8 == "e4m3" else (0x7B, 0x7C)
    one = 0x38 if fp8 == "e4m3" else 0x3C
    assert enc.streams["data"].tolist() == [top, 0x7F, 0xFF, inf, 0x80 | inf, 0x00, 0x80, one, 0x80 | one]
    dec = as_f32(QuantizeFP8(fp8).decode(enc).streams["data"], src)
    ref_inf = FMAX[fp8] if fp8 == "e4m3" else np.inf
    np.testing.assert_array_equal(dec[[0, 3, 4, 5, 7, 8]], [FMAX[fp8], ref_inf, -ref_inf, 0.0, 1.0, -1.0])
    assert np.isnan(dec[1]) and not np.signbit(dec[1]) and np.isnan(dec[2]) and np.signbit(dec[2])
    assert dec[6] == 0 and np.signbit(dec[6]) and not np.signbit(dec[5])


@pytest.mark.parametrize("fp8", ["e5m2", "e4m3"])
def test_fp8_subnormals_round_to_nearest_even(fp8):
    e, m, _ = FP8_PARAMS[fp8]
    tiny = 2.0 ** (2 - (1 << (e - 1)) - m)    # smallest FP8 subnormal (scale is 1 here)
    # k/2 * tiny for k < 2^(M+2): every subnormal, every tie between them, and the first
    # binade of normals (where the step is still tiny, so the code is round(k/2)).
    count = 1 << (m + 2)
    halves = np.arange(count) * (tiny / 2)
    vals = np.concatenate([[FMAX[fp8]], halves, -halves, [tiny / 4, tiny * 0.75, tiny / 2 * 1.0000001]])
    enc = QuantizeFP8(fp8).encode(frame_of(to_bits(vals, "fp32"), "fp32", [vals.size]))
    assert enc.streams["scales"].tolist() == [1.0]
    codes = enc.streams["data"]
    ref = vals.astype(np.float32).astype(ML_DTYPE[fp8]).view(np.uint8)
    np.testing.assert_array_equal(codes, ref)
    k = np.arange(1, count)
    # Explicit RNE: tie k/2 (odd k) goes to the even neighbour.
    expect = np.where(k % 2 == 0, k // 2, np.where((k // 2) % 2 == 0, k // 2, k // 2 + 1))
    np.testing.assert_array_equal(codes[2:1 + count], expect.astype(np.uint8))
    assert codes[-3] == 0 and codes[-2] == 1 and codes[-1] == 1


def test_all_zero_and_all_nonfinite_tensors_get_scale_one():
    for vals in ([0.0, -0.0, 0.0], [np.nan, np.inf, -np.inf]):
        enc = QuantizeFP8().encode(frame_of(to_bits(vals, "bf16"), "bf16", [3]))
        assert enc.streams["scales"].tolist() == [1.0]


def test_tiny_amax_uses_smallest_normal_scale():
    vals = np.array([2.0 ** -133, -(2.0 ** -128), 2.0 ** -130], np.float32)  # bf16 subnormals
    stage = QuantizeFP8("e4m3", "tensor")
    enc = stage.encode(frame_of(to_bits(vals, "bf16"), "bf16", [3]))
    assert enc.streams["scales"].tolist() == [2.0 ** -126]
    np.testing.assert_array_equal(as_f32(stage.decode(enc).streams["data"], "bf16"), vals)


def test_fp32_near_max_decodes_finite():
    vals = np.array([np.finfo(np.float32).max, -np.finfo(np.float32).max, 1.0], np.float32)
    for fp8 in ("e5m2", "e4m3"):
        stage = QuantizeFP8(fp8)
        y = as_f32(stage.decode(stage.encode(frame_of(to_bits(vals, "fp32"), "fp32", [3]))).streams["data"], "fp32")
        assert np.isfinite(y).all() and abs(y[0] - vals[0]) <= 2.0 ** -(FP8_PARAMS[fp8][1] + 1) * vals[0]


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize("shape", [[0], [0, 4], [4, 0], [2, 0, 3], []])
def test_empty_and_scalar_shapes(shape, granularity):
    n = math.prod(shape)
    bits = to_bits(np.full(n, -3.0), "fp16")
    stage = QuantizeFP8("e4m3", granularity)
    enc = stage.encode(frame_of(bits, "fp16", shape))
    n_channels = shape[-1] if granularity == "channel" and shape else 1
    assert enc.streams["data"].shape == (n,) and enc.streams["data"].dtype == np.uint8
    # Channels that hold no values (and 0-d or empty tensors) get scale 1.0.
    scale = np.float32(3) / np.float32(448) if n else np.float32(1)
    np.testing.assert_array_equal(enc.streams["scales"], np.full(n_channels, scale, np.float32))
    dec = stage.decode(enc)
    np.testing.assert_array_equal(as_f32(dec.streams["data"], "fp16"), np.full(n, -3.0, np.float32))
    assert dec.meta["shape"] == shape


def test_per_channel_scales_follow_last_axis():
    x = np.array([[1.0, -200.0, 0.0], [-4.0, 100.0, 0.0]], np.float32)
    enc = QuantizeFP8("e4m3", "channel").encode(frame_of(to_bits(x, "fp32"), "fp32", x.shape))
    expect = np.array([4, 200, 448], np.float32) / np.float32(448)  # an all-zero channel gets 1.0
    np.testing.assert_array_equal(enc.streams["scales"], expect)


def test_other_streams_and_meta_untouched():
    extra = np.arange(5, dtype=np.uint8)
    frame = frame_of(to_bits([1.0, 2.0], "bf16"), "bf16", [2], side=extra)
    frame.meta["codebook"] = {"keep": 1}
    stage = QuantizeFP8()
    enc = stage.encode(frame)
    assert frame.meta["format"] == "bf16" and "quantize_fp8" not in frame.meta  # input not mutated
    assert enc.streams["side"] is extra and enc.meta["codebook"] == {"keep": 1}
    assert enc.meta["dtype"] == "bfloat16" and enc.meta["shape"] == [2]
    dec = stage.decode(enc)
    assert dec.streams["side"] is extra and dec.meta == frame.meta
    assert set(dec.streams) == {"data", "side"}


def test_max_encoded_size_bounds_output():
    for granularity, shape in (("tensor", [7, 5]), ("channel", [1, 9]), ("channel", [3, 4])):
        stage = QuantizeFP8("e5m2", granularity)
        bits = to_bits(np.ones(math.prod(shape)), "bf16")
        enc = stage.encode(frame_of(bits, "bf16", shape))
        out = enc.streams["data"].nbytes + enc.streams["scales"].nbytes
        assert out <= stage.max_encoded_size(bits.nbytes)


# ---------------------------------------------------------------------------------------------
# Errors and configuration.


def test_encode_rejects_fp8_and_unknown_inputs():
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        QuantizeFP8().encode(frame_of(np.zeros(3, np.uint8), "e5m2", [3]))
    frame = frame_of(np.zeros(3, np.uint16), "bf16", [3])
    frame.meta["format"] = "int8"
    with pytest.raises(TypeError):
        QuantizeFP8().encode(frame)


def encoded(granularity="channel"):
    return QuantizeFP8("e4m3", granularity).encode(frame_of(to_bits(np.arange(12.0), "bf16"), "bf16", [3, 4]))


def with_meta(frame, **meta):
    out = frame.replace()
    out.meta.update(meta)
    return out


@pytest.mark.parametrize("granularity", ["tensor", "channel"])
@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda f: f.replace(data=f.streams["data"][:-1]), "uint8\\[12\\]"),
        (lambda f: f.replace(data=np.zeros(13, np.uint8)), "uint8\\[12\\]"),
        (lambda f: f.replace(data=f.streams["data"].astype(np.uint16)), "uint8"),
        (lambda f: f.replace(data=f.streams["data"].reshape(3, 4)), "uint8"),
        (lambda f: f.replace(scales=np.ones(7, np.float32)), "scales must be float32"),
        (lambda f: f.replace(scales=f.streams["scales"].astype(np.float64)), "scales must be float32"),
        (lambda f: f.replace(scales=np.ones(0, np.float32)), "scales must be float32"),
        (lambda f: f.replace(drop=("scales",)), "missing stream"),
        (lambda f: f.replace(drop=("data",)), "missing stream"),
        (lambda f: with_meta(f, quantize_fp8={"source_format": "e5m2"}), "source format"),
        (lambda f: with_meta(f, quantize_fp8=None), "source format"),
        (lambda f: with_meta(f, format="e5m2"), "cannot decode"),
        (lambda f: with_meta(f, n=13), "holds 12 values"),
        (lambda f: with_meta(f, n=-1), "non-negative"),
        (lambda f: with_meta(f, n="12"), "non-negative"),
        (lambda f: with_meta(f, shape=[3, -4]), "shape"),
    ],
)
def test_decode_validation_raises_format_error(granularity, corrupt, message):
    with pytest.raises(FormatError, match=message):
        QuantizeFP8("e4m3", granularity).decode(corrupt(encoded(granularity)))


def test_decode_validation_checks_channel_count_against_shape():
    frame = with_meta(encoded("channel"), shape=[2, 6])  # 12 values, but 6 channels, 4 scales
    with pytest.raises(FormatError, match="float32\\[6\\]"):
        QuantizeFP8("e4m3", "channel").decode(frame)


def test_format_error_is_value_error():
    assert issubclass(FormatError, ValueError)


@pytest.mark.parametrize(
    "kwargs, config",
    [
        ({}, {"id": "quantize_fp8", "format": "e5m2", "granularity": "tensor"}),
        ({"format": "float8_e4m3fn", "granularity": "channel"}, {"id": "quantize_fp8", "format": "e4m3", "granularity": "channel"}),
        ({"format": "float8_e5m2"}, {"id": "quantize_fp8", "format": "e5m2", "granularity": "tensor"}),
    ],
)
def test_config_round_trips_through_json(kwargs, config):
    stage = QuantizeFP8(**kwargs)
    assert stage.get_config() == config
    again = stage_from_config(json.loads(json.dumps(stage.get_config())))
    assert type(again) is QuantizeFP8 and again == stage
    assert not stage.lossless and stage.input_kind == ("tensor",) and stage.output_kind == "tensor"


@pytest.mark.parametrize("kwargs", [{"format": "bf16"}, {"format": "int4"}, {"granularity": "row"}, {"scale": 2}])
def test_bad_config_rejected(kwargs):
    with pytest.raises(ValueError):
        stage_from_config({"id": "quantize_fp8", **kwargs})
