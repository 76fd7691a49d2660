// QuantizeFP8 per tensor on 16-bit sources (bf16, fp16): the fast GPU path.
//
// With one scale per tensor, quantizing a 16-bit value is a pure function of its 15 magnitude
// bits (the sign is copied), and dequantizing an FP8 code a pure function of its 8 bits.  So a
// call builds the two functions as tables with a straight port of kvzip/fp8_bits.py (the CPU
// twin's code, run once per table entry), and the per-value kernels only look values up:
//
//   kvz_amax           max finite magnitude, 8 values per 16-byte load, SIMD on half-words
//   kvz_quant_table    scale from the amax, then code = quantize(magnitude) for all 2^15
//   kvz_quantize       8 values per 16-byte load through the table in shared memory
//   kvz_dequantize     the 256-entry table built per block from the scale, 8 codes per load
//   kvz_dequant_tables tables alone, for the fused module's kvz_decode to apply as it stores
//
// The Numba kernels computed the rounding per value and were compute-bound (benchmarks/NOTES.md,
// v8).

#include "quantize_lookup.cuh"

typedef unsigned char u8;
typedef unsigned short u16;
typedef long long i64;

// ---------------------------------------------------------------- port of kvzip/fp8_bits.py
// Same names, same integer arithmetic (int64), same single IEEE float32 division / multiply.

#ifdef __CUDA_ARCH__
#define KVZ_HD __device__
__device__ __forceinline__ float bits_as_f32(i64 b) { return __uint_as_float((unsigned)b); }
__device__ __forceinline__ i64 f32_as_bits(float x) { return (i64)__float_as_uint(x); }
// IEEE round-to-nearest with subnormals kept, whatever flush-to-zero mode the module is built in
// (a subnormal amax was flushed to 0 through the intrinsics, giving scale 1 instead of 2^-126).
__device__ __forceinline__ float f32_div(float a, float b) {
    float q;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(q) : "f"(a), "f"(b));
    return q;
}
__device__ __forceinline__ float f32_mul(float a, float b) {
    float p;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(p) : "f"(a), "f"(b));
    return p;
}
#else  // the host build is only for checking the port against the Python twin off the GPU
#define KVZ_HD
#include <cstring>
inline float bits_as_f32(i64 b) { unsigned u = (unsigned)b; float f; std::memcpy(&f, &u, 4); return f; }
inline i64 f32_as_bits(float x) { unsigned u; std::memcpy(&u, &x, 4); return (i64)u; }
inline float f32_div(float a, float b) { return a / b; }
inline float f32_mul(float a, float b) { return a * b; }
#endif

KVZ_HD i64 max_finite_code(int E, int M, bool fn) {
    if (fn) return ((((i64)1 << E) - 1) << M) | (((i64)1 << M) - 2);
    return ((((i64)1 << E) - 2) << M) | (((i64)1 << M) - 1);
}
KVZ_HD i64 inf_code(int E, int M) { return (((i64)1 << E) - 1) << M; }
KVZ_HD i64 quiet_nan_code(int E, int M) { return inf_code(E, M) | ((i64)1 << (M - 1)); }
KVZ_HD i64 fp8_nan_code(int E, int M) { return ((i64)1 << (E + M)) - 1; }

KVZ_HD i64 widen_to_f32(i64 b, int E, int M, bool fn) {
    i64 sign = ((b >> (E + M)) & 1) << 31;
    i64 e = (b >> M) & (((i64)1 << E) - 1);
    i64 m = b & (((i64)1 << M) - 1);
    i64 bias = ((i64)1 << (E - 1)) - 1;
    if (e == ((i64)1 << E) - 1) {
        if (fn) {
            if (m == ((i64)1 << M) - 1) return sign | 0x7FC00000;
        } else if (m == 0) {
            return sign | 0x7F800000;
        } else {
            return sign | 0x7FC00000;
        }
    }
    if (e == 0) {
        if (m == 0) return sign;
        e = 1;
        while (m < ((i64)1 << M)) { m <<= 1; e -= 1; }
        m -= (i64)1 << M;
    }
    i64 f32_exp = e - bias + 127;
    if (f32_exp <= 0) return sign | (((((i64)1 << M) | m) << (23 - M)) >> (1 - f32_exp));
    return sign | (f32_exp << 23) | (m << (23 - M));
}

KVZ_HD i64 round_from_f32(i64 b, int E, int M, i64 max_code, i64 inf_result, i64 nan_result) {
    i64 sign = ((b >> 31) & 1) << (E + M);
    i64 mag = b & 0x7FFFFFFF;
    if (mag > 0x7F800000) return sign | nan_result;
    if (mag == 0x7F800000) return sign | inf_result;
    i64 f32_exp = mag >> 23, sig, e;
    if (f32_exp == 0) { sig = mag; e = -126; }
    else { sig = (mag & 0x7FFFFF) | 0x800000; e = f32_exp - 127; }
    i64 bias = ((i64)1 << (E - 1)) - 1;
    i64 emin = 1 - bias;
    i64 target_exp = e > emin ? e : emin;
    i64 shift = 23 - M + (target_exp - e);
    if (shift > 25) shift = 25;
    i64 r = sig >> shift;
    if (shift > 0) {
        i64 rem = sig & (((i64)1 << shift) - 1);
        i64 half = (i64)1 << (shift - 1);
        if (rem > half || (rem == half && (r & 1) == 1)) r += 1;
    }
    i64 code = ((target_exp + bias - 1) << M) + r;
    if (code > max_code) code = max_code;
    return sign | code;
}

KVZ_HD i64 quantize(i64 src, int SE, int SM, float scale, int E, int M, bool fn) {
    i64 x = widen_to_f32(src, SE, SM, false);
    i64 sign = ((x >> 31) & 1) << 7;
    i64 mag = x & 0x7FFFFFFF;
    i64 top = max_finite_code(E, M, fn);
    if (mag > 0x7F800000) return sign | fp8_nan_code(E, M);
    if (mag == 0x7F800000) return fn ? (sign | top) : (sign | inf_code(E, M));
    float q = f32_div(bits_as_f32(x), scale);
    return round_from_f32(f32_as_bits(q), E, M, top, top, fp8_nan_code(E, M));
}

KVZ_HD i64 dequantize(i64 code, float scale, int E, int M, bool fn, int DE, int DM) {
    i64 v = widen_to_f32(code, E, M, fn);
    i64 dst_sign = ((v >> 31) & 1) << (DE + DM);
    i64 mag = v & 0x7FFFFFFF;
    if (mag > 0x7F800000) return dst_sign | quiet_nan_code(DE, DM);
    if (mag == 0x7F800000) return dst_sign | inf_code(DE, DM);
    i64 top = max_finite_code(DE, DM, false);
    i64 y = f32_as_bits(f32_mul(bits_as_f32(v), scale));
    if ((y & 0x7FFFFFFF) > 0x7F800000) return quiet_nan_code(DE, DM);
    return round_from_f32(y, DE, DM, top, top, quiet_nan_code(DE, DM));
}

KVZ_HD float scale_from_amax(i64 amax_bits, int SE, int SM, int E, int M, bool fn) {
    // Both comparisons on the bits (amax and the scale are non-negative): a float comparison
    // would treat a subnormal amax or scale as 0 under flush-to-zero.
    i64 amax = widen_to_f32(amax_bits, SE, SM, false);
    if (amax == 0) return 1.0f;
    float fmax = bits_as_f32(widen_to_f32(max_finite_code(E, M, fn), E, M, fn));
    i64 scale = f32_as_bits(f32_div(bits_as_f32(amax), fmax));
    if (scale < 0x00800000) scale = 0x00800000;  // the smallest normal, 2^-126
    return bits_as_f32(scale);
}

// ---------------------------------------------------------------- kernels
#ifdef __CUDACC__
// Inputs and outputs of the per-value kernels are 16-byte aligned (quantize_kernels.usable checks);
// the values past the last whole 16-byte unit are done one at a time.

constexpr int THREADS = 256;

// Max finite magnitude bits of n 16-bit values of a format with SE exponent and SM mantissa bits,
// folded into *out (zeroed by the caller) with one atomicMax per block.
// src_at (when not null) holds src's address: a job table that a replayed CUDA graph updates per call.
template <int SE, int SM>
__global__ void __launch_bounds__(THREADS) kvz_amax(const u16* src, const unsigned long long* src_at, i64 n,
                                                    unsigned* out) {
    if (src_at) src = reinterpret_cast<const u16*>(*src_at);
    constexpr unsigned INF = ((1u << SE) - 1) << SM;
    const unsigned INF2 = INF | (INF << 16);
    const uint4* v = reinterpret_cast<const uint4*>(src);
    i64 units = n / 8, t = (i64)blockIdx.x * THREADS + threadIdx.x, stride = (i64)gridDim.x * THREADS;
    unsigned best2 = 0;  // two half-word maxima
    for (i64 u = t; u < units; u += stride) {
        uint4 w = v[u];
        unsigned ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            unsigned m = ws[k] & 0x7FFF7FFFu;
            best2 = __vmaxu2(best2, m & __vcmpltu2(m, INF2));  // Inf and NaN count as 0
        }
    }
    unsigned best = max(best2 & 0xFFFFu, best2 >> 16);
    for (i64 i = units * 8 + t; i < n; i += stride) {
        unsigned m = src[i] & 0x7FFFu;
        if (m < INF) best = max(best, m);
    }
    best = __reduce_max_sync(0xFFFFFFFFu, best);
    __shared__ unsigned warp_best[THREADS / 32];
    if (threadIdx.x % 32 == 0) warp_best[threadIdx.x / 32] = best;
    __syncthreads();
    if (threadIdx.x < 32) {
        best = threadIdx.x < THREADS / 32 ? warp_best[threadIdx.x] : 0;
        best = __reduce_max_sync(0xFFFFFFFFu, best);
        if (threadIdx.x == 0 && best) atomicMax(out, best);
    }
}

// The scale of the tensor into *scale, and the FP8 code (sign bit clear) of every 15-bit source
// magnitude into table[0 .. 2^15): quantizing is symmetric, so a value's code is its magnitude's
// with the sign bit copied.
// addrs (when not null): the scale's address is word scale_word of it instead (the blob's scales
// stream, from the job table of programs's quantizing encode), and the scale_span - 4 bytes
// after the scale are zeroed (the stream's padding).
template <int SE, int SM, int E, int M, bool FN>
__global__ void __launch_bounds__(THREADS) kvz_quant_table(const unsigned* amax, float* scale,
                                                           const unsigned long long* addrs, int scale_word,
                                                           int scale_span, u8* table) {
    float s = scale_from_amax(*amax, SE, SM, E, M, FN);
    int mag = blockIdx.x * THREADS + threadIdx.x;
    if (addrs) scale = reinterpret_cast<float*>(addrs[scale_word]);
    if (mag == 0) *scale = s;
    if (mag > 0 && mag < scale_span / 4) reinterpret_cast<unsigned*>(scale)[mag] = 0;
    if (mag < (1 << 15)) table[mag] = (u8)quantize(mag, SE, SM, s, E, M, FN);
}

extern "C" __global__ void __launch_bounds__(THREADS) kvz_quantize(const u16* src, i64 n, const u8* table_g, u8* out) {
    __shared__ unsigned table_w[(1 << 15) / 4];
    const uint4* tg = reinterpret_cast<const uint4*>(table_g);
    for (int i = threadIdx.x; i < (1 << 15) / 16; i += THREADS) reinterpret_cast<uint4*>(table_w)[i] = tg[i];
    __syncthreads();
    const u8* table = reinterpret_cast<const u8*>(table_w);
    const uint4* v = reinterpret_cast<const uint4*>(src);
    uint2* o = reinterpret_cast<uint2*>(out);
    i64 units = n / 8, t = (i64)blockIdx.x * THREADS + threadIdx.x, stride = (i64)gridDim.x * THREADS;
    for (i64 u = t; u < units; u += stride) {
        uint4 w = v[u];
        o[u] = make_uint2(quantize_pair(w.x, table) | (quantize_pair(w.y, table) << 16),
                          quantize_pair(w.z, table) | (quantize_pair(w.w, table) << 16));
    }
    for (i64 i = units * 8 + t; i < n; i += stride) out[i] = (u8)quantize_pair(src[i], table);
}

// Block b: table b (256 entries: FP8 code -> 16-bit value) for the scale whose address is word
// word + b * stride of addrs (a job table of programs's decode program), or at single when
// addrs is null.  For kvz_decode's dequantizing instance (decode.cu).
template <int E, int M, bool FN, int DE, int DM>
__global__ void __launch_bounds__(THREADS) kvz_dequant_tables(const unsigned long long* addrs, int word, int stride,
                                                              const float* single, u16* tables) {
    const float* s = addrs ? reinterpret_cast<const float*>(addrs[word + (long long)blockIdx.x * stride]) : single;
    tables[256 * blockIdx.x + threadIdx.x] = (u16)dequantize(threadIdx.x, *s, E, M, FN, DE, DM);  // THREADS == 256
}

template <int E, int M, bool FN, int DE, int DM>
__global__ void __launch_bounds__(THREADS) kvz_dequantize(const u8* codes, i64 n, const float* scale, u16* out) {
    __shared__ u16 table[256];
    table[threadIdx.x] = (u16)dequantize(threadIdx.x, *scale, E, M, FN, DE, DM);  // THREADS == 256
    __syncthreads();
    // 8 codes a load, 8 values a store: both warp-contiguous (16 codes a thread with two 16-byte
    // stores 32 bytes apart ran at 53 % of DRAM bandwidth).
    const uint2* v = reinterpret_cast<const uint2*>(codes);
    uint4* o = reinterpret_cast<uint4*>(out);
    i64 units = n / 8, t = (i64)blockIdx.x * THREADS + threadIdx.x, stride = (i64)gridDim.x * THREADS;
    for (i64 u = t; u < units; u += stride) {
        uint2 w = v[u];
        o[u] = make_uint4(table[w.x & 0xFF] | ((unsigned)table[(w.x >> 8) & 0xFF] << 16),
                          table[(w.x >> 16) & 0xFF] | ((unsigned)table[w.x >> 24] << 16),
                          table[w.y & 0xFF] | ((unsigned)table[(w.y >> 8) & 0xFF] << 16),
                          table[(w.y >> 16) & 0xFF] | ((unsigned)table[w.y >> 24] << 16));
    }
    for (i64 i = units * 8 + t; i < n; i += stride) out[i] = table[codes[i]];
}
#endif  // __CUDACC__
