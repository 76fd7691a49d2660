// Loading and storing 8-value groups (values, raw words, quantized on load, dequantized on
// store) and packing the rest fields (kvzip/bitpack.py's layout).
#pragma once

#include "common.cuh"
#include "quantize_lookup.cuh"

// ------------------------------------------------------------------ loading and storing groups
template <typename T>
__device__ __forceinline__ void load_group(const T* __restrict__ src, long long n, long long g, u32 v[8]) {
    const long long i0 = g * 8;
    if (i0 + 8 <= n) {
        if constexpr (sizeof(T) == 1) {
            uint2 q = *reinterpret_cast<const uint2*>(src + i0);
#pragma unroll
            for (int j = 0; j < 4; j++) { v[j] = (q.x >> (8 * j)) & 0xFF; v[4 + j] = (q.y >> (8 * j)) & 0xFF; }
        } else if constexpr (sizeof(T) == 2) {
            uint4 q = *reinterpret_cast<const uint4*>(src + i0);
            v[0] = q.x & 0xFFFF; v[1] = q.x >> 16; v[2] = q.y & 0xFFFF; v[3] = q.y >> 16;
            v[4] = q.z & 0xFFFF; v[5] = q.z >> 16; v[6] = q.w & 0xFFFF; v[7] = q.w >> 16;
        } else {
            uint4 a = *reinterpret_cast<const uint4*>(src + i0);
            uint4 b = *reinterpret_cast<const uint4*>(src + i0 + 4);
            v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = (i0 + j < n) ? (u32)src[i0 + j] : 0u;
    }
}

template <typename T>
__device__ __forceinline__ void store_group(T* __restrict__ dst, long long n, long long g, const u32 v[8]) {
    const long long i0 = g * 8;
    if (i0 + 8 <= n) {
        if constexpr (sizeof(T) == 1) {
            uint2 q;
            q.x = v[0] | (v[1] << 8) | (v[2] << 16) | (v[3] << 24);
            q.y = v[4] | (v[5] << 8) | (v[6] << 16) | (v[7] << 24);
            *reinterpret_cast<uint2*>(dst + i0) = q;
        } else if constexpr (sizeof(T) == 2) {
            uint4 q;
            q.x = v[0] | (v[1] << 16); q.y = v[2] | (v[3] << 16); q.z = v[4] | (v[5] << 16); q.w = v[6] | (v[7] << 16);
            *reinterpret_cast<uint4*>(dst + i0) = q;
        } else {
            *reinterpret_cast<uint4*>(dst + i0) = make_uint4(v[0], v[1], v[2], v[3]);
            *reinterpret_cast<uint4*>(dst + i0 + 4) = make_uint4(v[4], v[5], v[6], v[7]);
        }
    } else {
#pragma unroll
        for (int j = 0; j < 8; j++) if (i0 + j < n) dst[i0 + j] = (T)v[j];
    }
}

// A group's 8 values as loaded, still packed in 32-bit words (W = 1, 2, 4 bytes a value), so a
// lane can hold the next step's groups in few registers while it works on the current ones.
template <typename T>
struct Raw {
    u32 w[2 * sizeof(T)];
};

// A group known to hold 8 values: plain vector loads, no bounds checks.
template <typename T>
__device__ __forceinline__ void load_raw_full(const T* __restrict__ src, long long g, Raw<T>& r) {
    const long long i0 = g * 8;
    if constexpr (sizeof(T) == 1) {
        const uint2 q = *reinterpret_cast<const uint2*>(src + i0);
        r.w[0] = q.x; r.w[1] = q.y;
    } else if constexpr (sizeof(T) == 2) {
        const uint4 q = *reinterpret_cast<const uint4*>(src + i0);
        r.w[0] = q.x; r.w[1] = q.y; r.w[2] = q.z; r.w[3] = q.w;
    } else {
        const uint4 a = *reinterpret_cast<const uint4*>(src + i0);
        const uint4 b = *reinterpret_cast<const uint4*>(src + i0 + 4);
        r.w[0] = a.x; r.w[1] = a.y; r.w[2] = a.z; r.w[3] = a.w; r.w[4] = b.x; r.w[5] = b.y; r.w[6] = b.z; r.w[7] = b.w;
    }
}

template <typename T>
__device__ __forceinline__ void load_raw(const T* __restrict__ src, long long n, long long g, Raw<T>& r) {
    const long long i0 = g * 8;
    if (i0 + 8 <= n) {
        load_raw_full(src, g, r);
    } else {
#pragma unroll
        for (int k = 0; k < 2 * (int)sizeof(T); k++) r.w[k] = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            if (i0 + j < n) {
                const u32 v = (u32)src[i0 + j];
                if constexpr (sizeof(T) == 1) r.w[j >> 2] |= v << (8 * (j & 3));
                else if constexpr (sizeof(T) == 2) r.w[j >> 1] |= v << (16 * (j & 1));
                else r.w[j] = v;
            }
        }
    }
}

// QuantizeFP8 (one scale per tensor) fused into the encode: the input is 16-bit (bf16/fp16) bits
// and each value becomes its FP8 code as it loads, through quantize_pair (quantize_lookup.cuh,
// which the loader puts in front of this file), the lookup kvz_quantize makes.

// A whole group's 16-bit values (as load_raw_full loads them) -> their FP8 codes.
__device__ __forceinline__ void quantize_raw(const Raw<u16>& in, Raw<u8>& r, const u8* table) {
    r.w[0] = quantize_pair(in.w[0], table) | (quantize_pair(in.w[1], table) << 16);
    r.w[1] = quantize_pair(in.w[2], table) | (quantize_pair(in.w[3], table) << 16);
}

__device__ __forceinline__ void load_quantized(const u16* __restrict__ src, long long n, long long g, Raw<u8>& r,
                                               const u8* table) {
    const long long i0 = g * 8;
    if (i0 + 8 <= n) {
        Raw<u16> raw;
        load_raw_full(src, g, raw);
        quantize_raw(raw, r, table);
        return;
    }
    r.w[0] = r.w[1] = 0;
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (i0 + j < n) r.w[j >> 2] |= (quantize_pair(src[i0 + j], table) & 0xFFu) << (8 * (j & 3));
}

// kvz_encode's plane pass: group g of the input as Raw<T> (QT: the 16-bit input's FP8 codes
// through table, T being the FP8 format's u8), zeros past n.
template <typename T, bool QT>
__device__ __forceinline__ void load_redo(const void* src, long long n, long long g, Raw<T>& r, const u8* table) {
    if constexpr (QT) load_quantized(static_cast<const u16*>(src), n, g, r, table);
    else load_raw(static_cast<const T*>(src), n, g, r);
}

// kvz_encode's plane pass: B groups a lane of the ng at src (lane's b-th: s + 32 b + lane), those
// below ng, every load issued before any value is used.
template <typename T, bool QT, int B>
__device__ __forceinline__ void load_redo_batch(const void* src, long long n, int s, int ng, int lane, Raw<T> (&v)[B],
                                                const u8* table) {
#pragma unroll
    for (int b = 0; b < B; b++)
        if (s + 32 * b + lane < ng) load_redo<T, QT>(src, n, s + 32 * b + lane, v[b], table);
}

template <typename T>
__device__ __forceinline__ u32 raw_value(const Raw<T>& r, int j) {
    if constexpr (sizeof(T) == 1) return (r.w[j >> 2] >> (8 * (j & 3))) & 0xFF;
    else if constexpr (sizeof(T) == 2) return (r.w[j >> 1] >> (16 * (j & 1))) & 0xFFFF;
    else return r.w[j];
}

// E5M2 rest fields (24 bits a group) of the warp's 32 consecutive groups, one a lane, to the 96
// bytes at p as 24 whole words: word k holds bytes 4k..4k+3, which lie in groups 4k / 3 and the
// one after (two shuffles).  Three byte stores a group were slower in the E5M2 encode
// (benchmarks/NOTES.md, v15; the same for loads in the decoder made it slower).  p must be
// 4-byte aligned.
__device__ __forceinline__ void store_rest24_warp(u8* __restrict__ p, u32 bits, int lane) {
    const int g = (4 * lane) / 3, off = 4 * lane - 3 * g;
    const u32 a = __shfl_sync(FULL_MASK, bits, g & 31), b = __shfl_sync(FULL_MASK, bits, (g + 1) & 31);
    if (lane < 24) reinterpret_cast<u32*>(p)[lane] = (u32)((((u64)b << 24) | a) >> (8 * off));
}

// FP16 rest fields (11 bits a value, 88 a group: 11 bytes) of the warp's 32 consecutive groups,
// one a lane (bits 0-63 in lo, 64-87 in hi), to the 352 bytes at p as 88 whole words.  A lane
// stores the words that start among its 11 bytes (two or three); the last of them may run into
// the next lane's first bytes, which one shuffle brings.  Eleven byte stores a group, each warp
// store touching 352 bytes for 32 of them, held the FP16 encoder at about half BF16's speed
// (benchmarks/NOTES.md, v19).  p must be 4-byte aligned.
__device__ __forceinline__ u32 bits32_at(u64 a, u64 b, int x) {  // bits x..x+31 of b:a, x <= 96
    return (u32)(x == 0 ? a : x >= 64 ? b >> (x - 64) : (a >> x) | (b << (64 - x)));
}

__device__ __forceinline__ void store_rest11_warp(u8* __restrict__ p, u64 lo, u32 hi, int lane) {
    const u32 next = __shfl_down_sync(FULL_MASK, (u32)lo, 1);  // the next lane's first four bytes
    const u64 b = (u64)hi | ((u64)next << 24);                 // this lane's bytes 8-10, then next's 0-3
    const int skip = (4 - ((11 * lane) & 3)) & 3;              // bytes before this lane's first word start
    u32* __restrict__ w = reinterpret_cast<u32*>(p) + (11 * lane + skip) / 4;
    w[0] = bits32_at(lo, b, 8 * skip);
    w[1] = bits32_at(lo, b, 8 * skip + 32);
    if (skip < 3) w[2] = bits32_at(lo, b, 8 * skip + 64);
}

// The mirror: each lane loads the words that start among its group's 11 bytes, and takes the
// previous lane's last word for the bytes before them.
__device__ __forceinline__ void load_rest11_warp(const u8* __restrict__ p, int lane, u64* lo, u64* hi) {
    const int skip = (4 - ((11 * lane) & 3)) & 3;
    const u32* __restrict__ w = reinterpret_cast<const u32*>(p) + (11 * lane + skip) / 4;
    const u32 w0 = w[0], w1 = w[1], w2 = skip < 3 ? w[2] : 0u;
    const u32 prev = __shfl_up_sync(FULL_MASK, skip < 3 ? w2 : w1, 1);  // lane 0 starts on a word: unused
    const u64 a = (u64)prev | ((u64)w0 << 32), b = (u64)w1 | ((u64)w2 << 32);  // bytes from 11 * lane + skip - 4
    const int x = 8 * (4 - skip);  // where this lane's bytes start in b:a
    *lo = (u64)bits32_at(a, b, x) | ((u64)bits32_at(a, b, x + 32) << 32);
    *hi = bits32_at(a, b, x + 64) & 0xFFFFFFu;
}

// Eight rest fields of R bits (R <= 16) packed LSB first, value j at bits j*R (kvzip/bitpack.py's
// layout): bits 0-63 to *lo, the rest to *hi.
template <int R>
__device__ __forceinline__ void pack_rest(const u32 r[8], u64* lo, u64* hi) {
    u64 l = 0, h = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int b = j * R;
        if (b < 64) { l |= (u64)r[j] << b; if (b + R > 64) h |= (u64)r[j] >> (64 - b); }
        else h |= (u64)r[j] << (b - 64);
    }
    *lo = l;
    *hi = h;
}

// R bytes of packed rest bits (kvzip/bitpack.py layout: LSB first, value j at bits j*R).
template <int R>
__device__ __forceinline__ void store_rest(u8* __restrict__ rest, long long g, const u32 r[8]) {
    u8* p = rest + g * R;
    if constexpr (R == 8) {
        u64 w = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) w |= (u64)r[j] << (8 * j);
        *reinterpret_cast<u64*>(p) = w;
    } else if constexpr (R == 4) {
        u32 w = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) w |= r[j] << (4 * j);
        *reinterpret_cast<u32*>(p) = w;
    } else if constexpr (R == 24) {
        u64 w0 = (u64)r[0] | ((u64)r[1] << 24) | ((u64)(r[2] & 0xFFFF) << 48);
        u64 w1 = ((u64)r[2] >> 16) | ((u64)r[3] << 8) | ((u64)r[4] << 32) | ((u64)(r[5] & 0xFF) << 56);
        u64 w2 = ((u64)r[5] >> 8) | ((u64)r[6] << 16) | ((u64)r[7] << 40);
        reinterpret_cast<u64*>(p)[0] = w0; reinterpret_cast<u64*>(p)[1] = w1; reinterpret_cast<u64*>(p)[2] = w2;
    } else {  // R = 3 (e5m2), 11 (fp16): assemble in a 128-bit accumulator, store bytes
        u64 lo, hi;
        pack_rest<R>(r, &lo, &hi);
#pragma unroll
        for (int k = 0; k < R; k++) p[k] = (u8)(k < 8 ? lo >> (8 * k) : hi >> (8 * (k - 8)));
    }
}

// A group's packed rest bytes as loaded (R bytes).
template <int R>
struct RestRaw {
    u64 q[(R + 7) / 8];
};

template <int R>
__device__ __forceinline__ void load_rest_raw(const u8* __restrict__ rest, long long g, RestRaw<R>& rr) {
    const u8* p = rest + g * R;
    if constexpr (R == 8) {
        rr.q[0] = *reinterpret_cast<const u64*>(p);
    } else if constexpr (R == 4) {
        rr.q[0] = *reinterpret_cast<const u32*>(p);
    } else if constexpr (R == 24) {
        rr.q[0] = reinterpret_cast<const u64*>(p)[0];
        rr.q[1] = reinterpret_cast<const u64*>(p)[1];
        rr.q[2] = reinterpret_cast<const u64*>(p)[2];
    } else {
#pragma unroll
        for (int k = 0; k < (R + 7) / 8; k++) rr.q[k] = 0;
#pragma unroll
        for (int k = 0; k < R; k++) rr.q[k >> 3] |= (u64)p[k] << (8 * (k & 7));
    }
}

template <int R>
__device__ __forceinline__ void unpack_rest(const RestRaw<R>& rr, u32 r[8]) {
    constexpr u32 MASK = (1u << R) - 1u;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const int b = j * R, w = b >> 6, o = b & 63;
        u64 x = rr.q[w] >> o;
        if (o + R > 64 && w + 1 < (R + 7) / 8) x |= rr.q[w + 1] << (64 - o);
        r[j] = (u32)x & MASK;
    }
}

// Eight FP8 codes (packed in two words) -> eight 16-bit values through table, one 16-byte store.
__device__ __forceinline__ void store_dequantized(u16* __restrict__ dst, const u32 w[2], const u16* __restrict__ table) {
    u32 o[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const u32 x = w[k >> 1] >> (16 * (k & 1));
        o[k] = __ldg(table + (x & 0xFFu)) | ((u32)__ldg(table + ((x >> 8) & 0xFFu)) << 16);
    }
    *reinterpret_cast<uint4*>(dst) = make_uint4(o[0], o[1], o[2], o[3]);
}
