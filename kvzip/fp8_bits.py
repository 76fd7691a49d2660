"""Scalar bit logic of FP8 quantization, written once for both backends.

Every function here is plain Python that ``kvzip.jit.twin_compile`` compiles for the CPU
(@njit) and for CUDA (device functions), so the CPU twin and the GPU kernel run the same
rounding code and cannot drift apart bit by bit.

Formats are passed as field widths (``exp_bits``, ``mant_bits``, from ``kvzip.formats``) plus
``finite_only`` for the "fn" FP8 flavour (e4m3fn: no Inf, the all-ones exponent holds normal
values, only S.1111.111 is NaN).  Bits travel as int64: the first thing each function does
is widen its argument with ``np.int64`` so neither Numba's unsigned typing nor NumPy scalar
wrap-around (under the CUDA simulator) can bite.  Rounding is integer arithmetic; the only
float operations are the quantizer's one float32 division and the dequantizer's one float32
multiply, both IEEE round-to-nearest-even on every target (no fast-math, no FTZ).

NaN results are canonical, sign kept: FP8 NaN is S.1...1 (0x7F/0xFF, what torch produces),
wider formats get their quiet NaN (bf16 0x7FC0, fp16 0x7E00, fp32 0x7FC00000).
"""
from __future__ import annotations

import numpy as np

F32_EXP_BITS = 8
F32_MANT_BITS = 23


def bits_as_f32(bits):
    """Reinterpret the low 32 bits as a float32."""
    return np.uint32(bits).view(np.float32)


def f32_as_bits(x):
    """The bits of a float32, as int64."""
    return np.int64(np.float32(x).view(np.uint32))


def max_finite_code(exp_bits, mant_bits, finite_only):
    """Magnitude bits of the largest finite value (e4m3fn 0x7E = 448, e5m2 0x7B = 57344)."""
    if finite_only:
        return (((1 << exp_bits) - 1) << mant_bits) | ((1 << mant_bits) - 2)
    return (((1 << exp_bits) - 2) << mant_bits) | ((1 << mant_bits) - 1)


def inf_code(exp_bits, mant_bits):
    """Magnitude bits of +Inf in an IEEE-style format (all-ones exponent, zero mantissa)."""
    return ((1 << exp_bits) - 1) << mant_bits


def quiet_nan_code(exp_bits, mant_bits):
    """Magnitude bits of the canonical quiet NaN of an IEEE-style format."""
    return inf_code(exp_bits, mant_bits) | (1 << (mant_bits - 1))


def fp8_nan_code(exp_bits, mant_bits):
    """Magnitude bits of the FP8 NaN we emit: all ones (the only NaN e4m3fn has)."""
    return (1 << (exp_bits + mant_bits)) - 1


def finite_magnitude(bits, exp_bits, mant_bits):
    """|x| as bits for a finite IEEE-style value, 0 for ±Inf and NaN.  For finite values the
    magnitude bits grow with |x|, so their maximum is the bits of max |x| over finite values."""
    mag = np.int64(bits) & ((1 << (exp_bits + mant_bits)) - 1)
    if mag >= inf_code(exp_bits, mant_bits):
        return 0
    return mag


def widen_to_f32(bits, exp_bits, mant_bits, finite_only):
    """Bits of a narrower float (or float32 itself) -> float32 bits.  Exact for every finite
    value; NaN becomes float32's quiet NaN with its sign."""
    b = np.int64(bits)
    sign = ((b >> (exp_bits + mant_bits)) & 1) << 31
    e = (b >> mant_bits) & ((1 << exp_bits) - 1)
    m = b & ((1 << mant_bits) - 1)
    bias = (1 << (exp_bits - 1)) - 1
    if e == (1 << exp_bits) - 1:
        if finite_only:
            if m == (1 << mant_bits) - 1:
                return sign | 0x7FC00000
        elif m == 0:
            return sign | 0x7F800000
        else:
            return sign | 0x7FC00000
    if e == 0:
        if m == 0:
            return sign
        # Subnormal: normalise so the value is 1.m * 2^(e - bias).
        e = 1
        while m < (1 << mant_bits):
            m <<= 1
            e -= 1
        m -= 1 << mant_bits
    f32_exp = e - bias + 127
    if f32_exp <= 0:
        # Only 8-bit-exponent subnormals (bf16, fp32) land here: they are float32 subnormals,
        # and the right shift drops only zero bits.
        return sign | ((((1 << mant_bits) | m) << (F32_MANT_BITS - mant_bits)) >> (1 - f32_exp))
    return sign | (f32_exp << F32_MANT_BITS) | (m << (F32_MANT_BITS - mant_bits))


def round_from_f32(bits, exp_bits, mant_bits, max_code, inf_result, nan_result):
    """float32 bits -> a format of at most float32's widths, round to nearest even.

    Finite values beyond the largest finite value (after rounding) saturate to ``max_code``;
    ±Inf becomes ``inf_result`` and NaN ``nan_result`` (magnitudes; the sign is always kept).
    """
    b = np.int64(bits)
    sign = ((b >> 31) & 1) << (exp_bits + mant_bits)
    mag = b & 0x7FFFFFFF
    if mag > 0x7F800000:
        return sign | nan_result
    if mag == 0x7F800000:
        return sign | inf_result
    f32_exp = mag >> F32_MANT_BITS
    if f32_exp == 0:
        sig = mag                      # float32 subnormal: 0.m * 2^-126
        e = -126
    else:
        sig = (mag & 0x7FFFFF) | 0x800000
        e = f32_exp - 127              # value = sig * 2^(e - 23)
    bias = (1 << (exp_bits - 1)) - 1
    emin = 1 - bias
    target_exp = e if e > emin else emin   # below emin the target's quantum stops shrinking
    shift = F32_MANT_BITS - mant_bits + (target_exp - e)
    if shift > 25:
        shift = 25                     # sig < 2^24 <= half: rounds to zero either way
    r = sig >> shift
    if shift > 0:
        rem = sig & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        if rem > half or (rem == half and (r & 1) == 1):
            r += 1
    # r holds the significand with its implicit bit (or a subnormal's, whose implicit bit is
    # 0), so adding it to (biased exponent - 1) << M carries a rounding overflow into the
    # exponent and turns a subnormal that rounds up into the smallest normal.
    code = ((target_exp + bias - 1) << mant_bits) + r
    if code > max_code:
        code = max_code
    return sign | code


def quantize(src_bits, src_exp_bits, src_mant_bits, scale, exp_bits, mant_bits, finite_only):
    """One source value (bf16/fp16/fp32 bits) -> FP8 bits of RNE(float32(x) / scale), saturating."""
    x = widen_to_f32(src_bits, src_exp_bits, src_mant_bits, False)
    sign = ((x >> 31) & 1) << 7
    mag = x & 0x7FFFFFFF
    top = max_finite_code(exp_bits, mant_bits, finite_only)
    # Specials are decided on the input bits, never on the quotient: GPUs return a sign-less
    # canonical NaN from NaN / scale, so the sign would differ between backends.
    if mag > 0x7F800000:
        return sign | fp8_nan_code(exp_bits, mant_bits)
    if mag == 0x7F800000:
        if finite_only:
            return sign | top
        return sign | inf_code(exp_bits, mant_bits)
    q = bits_as_f32(x) / scale
    # A finite input stays finite: an overflowing quotient saturates like any large value.
    return round_from_f32(f32_as_bits(q), exp_bits, mant_bits, top, top, fp8_nan_code(exp_bits, mant_bits))


def dequantize(code, scale, exp_bits, mant_bits, finite_only, dst_exp_bits, dst_mant_bits):
    """FP8 bits -> bits of RNE_dst(float32(v) * scale) in the destination format."""
    v = widen_to_f32(code, exp_bits, mant_bits, finite_only)
    dst_sign = ((v >> 31) & 1) << (dst_exp_bits + dst_mant_bits)
    mag = v & 0x7FFFFFFF
    if mag > 0x7F800000:
        return dst_sign | quiet_nan_code(dst_exp_bits, dst_mant_bits)
    if mag == 0x7F800000:
        return dst_sign | inf_code(dst_exp_bits, dst_mant_bits)
    top = max_finite_code(dst_exp_bits, dst_mant_bits, False)
    y = f32_as_bits(bits_as_f32(v) * scale)
    if (y & 0x7FFFFFFF) > 0x7F800000:
        # Only a forged scale (NaN, or Inf times zero) gets here; the product's NaN sign is
        # backend-specific, so emit one fixed NaN.
        return quiet_nan_code(dst_exp_bits, dst_mant_bits)
    # A finite FP8 value decodes to a finite value: a product that overflows saturates.
    return round_from_f32(y, dst_exp_bits, dst_mant_bits, top, top, quiet_nan_code(dst_exp_bits, dst_mant_bits))


def scale_from_amax(amax_bits, src_exp_bits, src_mant_bits, exp_bits, mant_bits, finite_only):
    """Per-tensor/per-channel scale from the largest finite magnitude (source-format bits).

    float32(amax) / float32(fmax), IEEE division; 1.0 when amax is 0 (all zeros, no finite
    values, or no values).  The scale never drops below 2^-126: a subnormal scale would carry
    few significant bits and x / scale could then exceed fmax by far; at 2^-126 the division
    is an exact power-of-two shift and every quotient stays below fmax.
    """
    amax = bits_as_f32(widen_to_f32(amax_bits, src_exp_bits, src_mant_bits, False))
    if amax == 0:
        return np.float32(1.0)
    fmax = bits_as_f32(widen_to_f32(max_finite_code(exp_bits, mant_bits, finite_only),
                                    exp_bits, mant_bits, finite_only))
    scale = amax / fmax
    smallest_normal = bits_as_f32(0x00800000)
    if scale < smallest_normal:
        scale = smallest_normal
    return scale


HELPERS = (
    bits_as_f32, f32_as_bits, max_finite_code, inf_code, quiet_nan_code, fp8_nan_code,
    finite_magnitude, widen_to_f32, round_from_f32, quantize, dequantize, scale_from_amax,
)
