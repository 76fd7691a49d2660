// kvzip fast GPU path: fused ExponentSplit + Top16Pack + EscapeStream, encode and decode.
//
// Why CUDA C++ and not Numba: Numba-CUDA has no 128-bit loads or stores.  On this workplace's
// H200 a Numba dense pack with 64-bit loads reached 1671 GB/s encode / 1526 GB/s decode, a CUDA C
// one with 128-bit loads 2071 GB/s (shared/DESIGN.md), and our first Numba fused kernels
// (stages/fused.py, one thread per group, a thread per chunk for escapes) 58 GB/s
// (benchmarks/NOTES.md).  The Numba kernels remain the generic path and, with the @njit twin,
// the reference this file is tested against byte for byte (tests/gpu).
//
// Work split.  Encode: kvz_encode's warps take chunks from queues (claim_chunk: four atomic
// counters, claimed a chunk ahead); a warp walks its chunk in steps,
// each lane loading a few 8-value groups with vector loads, writing 4 code bytes and R rest bytes a
// group in place in the blob and noting escapes, which ballots put in position order into a
// per-chunk slot.  kvz_scan (a block per 256 chunks, chained per tensor by a decoupled look-back)
// turns the per-chunk counts into offsets, moves the escapes to their final place (the totals,
// which fix where the escape exponents go, are kvz_encode's sums) and redoes plane-coded or
// over-full chunks from the input; its first blocks, one a tensor, zero the blob's padding and
// write its header meanwhile.  Decode: kvz_scan computes every chunk's offsets and checks the counts
// (on guessed layouts its first blocks check the headers), kvz_decode walks the chunks like the
// encoder and applies escapes from registers (whole E5M2 chunks a lane per four groups:
// decode_e5m2_quads); launched as the scan's programmatic dependent, it decodes each warp's first
// chunk while the scan still runs.
// No dense pass ever waits on another warp.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#include "layout.cuh"  // the container layout (generated from kvzip/layout.py): prefix offsets, PLANE, ...

#define FULL_MASK 0xffffffffu
#define WARPS 8            // warps per block
#define FLAG_SHIFT 62
#define VALUE_MASK ((1ull << FLAG_SHIFT) - 1)
#define GROUPS_MASK 0x7FFFFFFFull  // status value = escapes << 31 | plane-coded groups

// ------------------------------------------------------------------ programmatic dependent launch
// In a call's graph every kernel here is the programmatic dependent of the kernel before it
// (kvzip/gpu/dependent_launch.py), so its blocks may be resident, and running, before that one
// ends.  await_predecessor returns once the predecessor has completed and its memory is visible;
// release_dependents lets the successor's blocks be scheduled (they wait likewise).  Each kernel
// does both first, except kvz_decode, which decodes a chunk before it waits, and then waits for
// the scan's offsets only (await_offsets).  Both are no-ops when the kernel was launched the
// ordinary way.
__device__ __forceinline__ void await_predecessor() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void release_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

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

// The job tables' stream pointers are plain generic pointers to the compiler, which then emitted
// generic LD/ST for the dense passes' data; telling it they point to global memory gives LDG/STG
// (ncu, 2^28: the E5M2 decoder 189 -> 184 us, the encoders within run-to-run noise; NOTES v17).
template <typename P>
__device__ __forceinline__ void assume_global(const P* p) { __builtin_assume(__isGlobal(p)); }

// The 128-byte lines of [p, p + bytes) into L2, a line a lane (lines lane, lane + 32, ...):
// prefetches hold no registers, so a warp can put a whole chunk's reads in flight at its start.
__device__ __forceinline__ void prefetch_l2(const void* p, long long bytes, int lane) {
    const unsigned long long a = reinterpret_cast<unsigned long long>(p), end = a + (unsigned long long)bytes;
    for (unsigned long long l = (a & ~127ull) + 128ull * lane; l < end; l += 32 * 128)
        asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %0; prefetch.global.L2 [g]; }" :: "l"(l));
}

template <bool B, typename A, typename C> struct Pick { using type = A; };  // std::conditional, NVRTC has no <type_traits>
template <typename A, typename C> struct Pick<false, A, C> { using type = C; };

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

// load_group for the scan's redo paths: plain bits, or (table given) quantized ones.
template <typename T>
__device__ __forceinline__ void load_values(const void* src, long long n, long long g, u32 v[8], const u8* table) {
    if (table) {
        const u16* s16 = static_cast<const u16*>(src);
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = g * 8 + j < n ? quantize_pair(s16[g * 8 + j], table) & 0xFFu : 0u;
    } else {
        load_group(static_cast<const T*>(src), n, g, v);
    }
}

template <typename T>
__device__ __forceinline__ u32 raw_value(const Raw<T>& r, int j) {
    if constexpr (sizeof(T) == 1) return (r.w[j >> 2] >> (8 * (j & 3))) & 0xFF;
    else if constexpr (sizeof(T) == 2) return (r.w[j >> 1] >> (16 * (j & 1))) & 0xFFFF;
    else return r.w[j];
}

// E5M2 rest fields (24 bits a group) of the warp's 32 consecutive groups, one a lane, to the 96
// bytes at p as 24 whole words: word k holds bytes 4k..4k+3, which lie in groups 4k / 3 and the
// one after (two shuffles).  Three byte stores a group took 11 us more of the E5M2 encode (ncu,
// NOTES v15; the same for loads in the decoder made it slower).  p must be 4-byte aligned.
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
// (NOTES v19).  p must be 4-byte aligned.
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

// ------------------------------------------------------------------ decoupled look-back
// status[c] = flag << 62 | value; flag 1: this chunk's own value, 2: inclusive prefix.
// Called by the whole warp; returns chunk c's exclusive prefix (in every lane) and publishes the
// inclusive one.  The warp inspects 32 predecessors at a time (lane i reads chunk base - i), as
// single-pass scans do, so a chain of chunks still working costs one read per 32 of them.
__device__ __forceinline__ u64 look_back(u64* status, long long c, u64 mine, int lane) {
    if (c == 0) {
        if (lane == 0) atomicExch(&status[0], (2ull << FLAG_SHIFT) | mine);
        return 0;
    }
    if (lane == 0) atomicExch(&status[c], (1ull << FLAG_SHIFT) | mine);
    u64 prefix = 0;
    long long base = c - 1;
    while (true) {
        const long long j = base - lane;
        u64 s = j >= 0 ? *reinterpret_cast<volatile u64*>(&status[j]) : (2ull << FLAG_SHIFT);  // before chunk 0: 0
        u32 flag = (u32)(s >> FLAG_SHIFT);
        // Wait until every lane up to the nearest inclusive prefix sees a published value.
        const u32 inclusive = __ballot_sync(FULL_MASK, flag == 2);
        const int stop = inclusive ? __ffs(inclusive) - 1 : 31;  // lanes 0..stop matter
        if (__any_sync(FULL_MASK, lane <= stop && flag == 0)) continue;
        u64 v = lane <= stop ? (s & VALUE_MASK) : 0;
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(FULL_MASK, v, d);
        prefix += v;
        if (inclusive) break;
        base -= 32;
    }
    if (lane == 0) atomicExch(&status[c], (2ull << FLAG_SHIFT) | (prefix + mine));
    return prefix;
}

template <typename T>
__device__ __forceinline__ T warp_inclusive_sum(T x, int lane) {
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const T y = __shfl_up_sync(FULL_MASK, x, d);
        if (lane >= d) x += y;
    }
    return x;
}

// A per-lane count 0..15: its exclusive prefix over the lanes, and (in *total) the warp's sum, from
// one ballot per bit of the count.  No shuffle chain: kvz_encode's escape slots took 18 % of its
// stall samples with a shuffle scan per step (ncu, NOTES v15).
__device__ __forceinline__ int warp_exclusive_count(u32 k, int lane, int* total) {
    const u32 below = (1u << lane) - 1u;
    int before = 0, all = 0;
#pragma unroll
    for (int b = 0; b < 4; b++) {
        const u32 v = __ballot_sync(FULL_MASK, (k >> b) & 1u);
        before += __popc(v & below) << b;
        all += __popc(v) << b;
    }
    *total = all;
    return before;
}

// ------------------------------------------------------------------ encode
// The device LUT maps an exponent to its code (0..15) or to ESC_FLAG for "not in the codebook", so a
// code is (c & 0xF) and the escape bit (c >> 7): no compare or select per value.
#define ESC_FLAG 0x80u

// Four LUT results (bytes: a code 0-15, or ESC_FLAG) -> their codes as a 16-bit nibble word in the
// low half and the escape bits at 7, 15, 23, 31 of the packed bytes (returned in *flags).
__device__ __forceinline__ u32 pack4(u32 c0, u32 c1, u32 c2, u32 c3, u32* flags) {
    const u32 b = __byte_perm(__byte_perm(c0, c1, 0x0040), __byte_perm(c2, c3, 0x0040), 0x5410);  // c0..c3 as bytes
    *flags = b & 0x80808080u;
    const u32 t = b & 0x0F0F0F0Fu;
    return t | (t >> 4);  // bytes 0 and 2 hold codes 0|1 and 2|3
}

// pack4's escape flags of values 0-3 (fa) and 4-7 (fb) -> bit j for value j.  The product gathers
// bits 0, 8, 16, 24 of f >> 7 into bits 24-27 with nothing above them or in bits 20-23 (its
// partial products land on distinct bits, so nothing carries): six instructions, no branch.
__device__ __forceinline__ u32 escape_mask(u32 fa, u32 fb) {
    return (((fa >> 7) * 0x01020408u) >> 24) | (((fb >> 7) * 0x01020408u) >> 20);
}

// The exponent bytes of four BF16 values from their two words: two shifts and a byte permute (a
// value's exponent is bits 7-14 of its half, so bits 8-15 / 24-31 of the word shifted left once).
__device__ __forceinline__ u32 bf16_exponents4(u32 w0, u32 w1) { return __byte_perm(w0 << 1, w1 << 1, 0x7531); }

// BF16, a whole group, SIMD-within-a-register.  The exponents of all 8 values are gathered into two
// words (bf16_exponents4); the 8 LUT results are packed into the codes word with byte permutes;
// the escape mask is only worked out when a LUT result is an escape.
// ncu showed the v3 encoder issue-bound (62 % of cycles issuing) at ~100 instructions a group;
// this is ~55.
__device__ __forceinline__ u32 encode_bf16_full(const Raw<u16>& raw, long long g, const u8* slut,
                                                u8* __restrict__ codes, u8* __restrict__ rest) {
    const u32 ea = bf16_exponents4(raw.w[0], raw.w[1]);  // exponents of values 0-3
    const u32 eb = bf16_exponents4(raw.w[2], raw.w[3]);  // and 4-7
    u32 fa, fb;
    const u32 ta = pack4(slut[ea & 0xFF], slut[(ea >> 8) & 0xFF], slut[(ea >> 16) & 0xFF], slut[ea >> 24], &fa);
    const u32 tb = pack4(slut[eb & 0xFF], slut[(eb >> 8) & 0xFF], slut[(eb >> 16) & 0xFF], slut[eb >> 24], &fb);
    reinterpret_cast<u32*>(codes)[g] = __byte_perm(ta, tb, 0x6420);
    // Rest byte = sign << 7 | mantissa: the value's low byte with its top bit taken from the high
    // byte's (the sign).  Per four values: their low bytes, their high bytes (one permute each)
    // and one bit-select, instead of a shift and two masks per pair of values.
    const u32 lo0 = __byte_perm(raw.w[0], raw.w[1], 0x6420), lo1 = __byte_perm(raw.w[2], raw.w[3], 0x6420);
    const u32 hi0 = __byte_perm(raw.w[0], raw.w[1], 0x7531), hi1 = __byte_perm(raw.w[2], raw.w[3], 0x7531);
    *reinterpret_cast<uint2*>(rest + g * 8) = make_uint2((lo0 & 0x7F7F7F7Fu) | (hi0 & 0x80808080u),
                                                         (lo1 & 0x7F7F7F7Fu) | (hi1 & 0x80808080u));
    return escape_mask(fa, fb);
}

// The rest fields (sign << 2 | mantissa) of four E5M2 values (the bytes of w), packed 3 bits a
// value at bits 20-31, by two products: every partial product lands on bits of its own or outside
// 20-31, so nothing carries into them (tests/test_kernel_identities.py: all 4096 field values,
// each with random other bits).  Two logic ops and two multiplies (FMA pipe) instead of nine logic ops: the
// E5M2 encoder was ALU-bound (ncu: ALU pipe 74 %, 106 instructions a group; NOTES v17).
__device__ __forceinline__ u32 e5m2_rest12(u32 w) {
    return (w & 0x80038003u) * 0x00100401u + (w & 0x03800380u) * 0x00008020u;
}

// E5M2 position tables: eight 32-word tables in kvz_encode's shared memory, table j (byte offset
// 128 j) holding for exponent e value j's code already in its nibble of the group's codes
// half-word (bits 4 (j & 3) up) and its escape flag at bit 16 + j.  A group's codes and escape
// mask are then the OR of its eight lookups, where packing LUT bytes into nibbles (pack4) and
// gathering the flags (escape_mask) took ~14 more integer instructions a group.  Lanes looking
// up one table with different exponents hit different banks (entry e is word e of its table),
// with equal ones the same word: no conflicts.  2^28 graphs: E5M2 encode 182.3-184.2 ->
// 178.8-179.8 us, the quantizing encoder 378.4-380.4 -> 371.5-372.3, its spills 24 bytes -> none
// (benchmarks/macro_ab.py, NOTES v24).  Partial groups (a tensor's tail) take encode_raw's
// generic loop and the byte LUT.
#define POSITION_TABLE_WORDS (8 * 32)
__device__ __forceinline__ void build_position_tables(u32* tabs, const u8* __restrict__ lut) {
    for (int i = threadIdx.x; i < POSITION_TABLE_WORDS; i += blockDim.x) {
        const int j = i >> 5;
        const u32 c = lut[i & 31];
        tabs[i] = ((c & 0xFu) << (4 * (j & 3))) | ((c >> 7) << (16 + j));
    }
}
__device__ __forceinline__ u32 table_word(const u8* tabs, u32 byte_offset) {
    return *reinterpret_cast<const u32*>(tabs + byte_offset);
}
// E5M2, a whole group, through the position tables: codes to codes[g], the rest fields (3 bits a
// value, 24 a group) to *rest24 (for store_rest24_warp); returns the escape mask.
__device__ __forceinline__ u32 encode_e5m2_full(const Raw<u8>& raw, long long g, const u8* tabs,
                                                u8* __restrict__ codes, u32* rest24) {
    u32 r[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const u32 e4 = raw.w[k] & 0x7C7C7C7Cu;  // each value's exponent times 4: its entry's offset
        const u8* t = tabs + 512 * k;
        r[k] = table_word(t, e4 & 0xFF) | table_word(t + 128, __byte_perm(e4, 0, 0x4441)) |
               table_word(t + 256, __byte_perm(e4, 0, 0x4442)) | table_word(t + 384, e4 >> 24);
    }
    reinterpret_cast<u32*>(codes)[g] = __byte_perm(r[0], r[1], 0x5410);
    *rest24 = (e5m2_rest12(raw.w[0]) >> 20) | ((e5m2_rest12(raw.w[1]) >> 8) & 0xFFF000u);
    return (r[0] | r[1]) >> 16;
}

// FP16, a whole group: codes to codes[g]; the rest fields (sign << 10 | mantissa, 11 bits a
// value) packed LSB first into *lo (bits 0-63) and *hi (64-87), for store_rest11_warp.
__device__ __forceinline__ u32 encode_fp16_full(const Raw<u16>& raw, long long g, const u8* slut,
                                                u8* __restrict__ codes, u64* lo, u32* hi) {
    u32 word = 0, mask = 0, r[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const u32 v = (raw.w[j >> 1] >> (16 * (j & 1))) & 0xFFFFu;
        const u32 c = slut[(v >> 10) & 0x1Fu];
        r[j] = ((v >> 15) << 10) | (v & 0x3FFu);
        mask |= (c >> 7) << j;
        word |= (c & 0xFu) << (4 * j);
    }
    reinterpret_cast<u32*>(codes)[g] = word;
    u64 h;
    pack_rest<11>(r, lo, &h);
    *hi = (u32)h;
    return mask;
}

// FULL: the caller knows the group holds 8 values (whole steps of kvz_encode).
template <int E, int M, typename T, bool FULL = false>
__device__ __forceinline__ u32 encode_raw(const Raw<T>& raw, long long n, long long g, const u8* slut,
                                          u8* __restrict__ codes, u8* __restrict__ rest) {
    constexpr int R = M + 1;
    if constexpr (E == 8 && M == 7 && sizeof(T) == 2) {
        if (FULL || g * 8 + 8 <= n) return encode_bf16_full(raw, g, slut, codes, rest);
    }
    u32 word = 0, mask = 0, r[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const u32 v = raw_value(raw, j);
        const u32 e = (v >> M) & ((1u << E) - 1u);
        r[j] = ((v >> (E + M)) << M) | (v & ((1u << M) - 1u));
        const bool valid = g * 8 + j < n;
        const u32 c = valid ? (u32)slut[e] : 0u;  // padding values: code 0, never an escape
        mask |= (c >> 7) << j;
        word |= (c & 0xF) << (4 * j);
    }
    reinterpret_cast<u32*>(codes)[g] = word;
    store_rest<R>(rest, g, r);
    return mask;
}

// Rewrite one group of a plane-coded chunk: low exponent nibbles as codes, high bits in exp_high.
template <int E, int M, typename T>
__device__ __forceinline__ void encode_plane(const void* src, long long n, long long g, u8* __restrict__ codes,
                                             u8* __restrict__ high_out, const u8* qtable) {
    constexpr int HB = E - 4;
    u32 v[8];
    load_values<T>(src, n, g, v, qtable);
    u32 word = 0;
    u64 high = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const u32 e = (g * 8 + j < n) ? (v[j] >> M) & ((1u << E) - 1u) : 0u;
        word |= (e & 0xF) << (4 * j);
        high |= (u64)(e >> 4) << (HB * j);
    }
    reinterpret_cast<u32*>(codes)[g] = word;
#pragma unroll
    for (int k = 0; k < HB; k++) high_out[k] = (u8)(high >> (8 * k));
}

// The biased exponents of a group's 8 values as the bytes of a word (value j: byte j), so an escape
// loop can take value j's with a shift whatever j is (indexing Raw's words by a j known only at
// run time puts them in local memory).
template <int E, int M, typename T>
__device__ __forceinline__ u64 exponent_bytes(const Raw<T>& v) {
    constexpr u32 EMASK = (1u << E) - 1u;
    if constexpr (sizeof(T) == 1 && E + M <= 8) {  // FP8: one shift and mask for all 8 (sign bits masked off)
        const u64 x = (u64)v.w[0] | ((u64)v.w[1] << 32);
        return (x >> M) & (0x0101010101010101ull * EMASK);
    } else if constexpr (sizeof(T) == 2 && E == 8 && M == 7) {  // BF16: as encode_bf16_full gathers them
        return (u64)bf16_exponents4(v.w[0], v.w[1]) | ((u64)bf16_exponents4(v.w[2], v.w[3]) << 32);
    } else {
        u64 e = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) e |= (u64)((raw_value(v, j) >> M) & EMASK) << (8 * j);
        return e;
    }
}

// kvz_encode: the escapes of one group a lane (bits of m; the group's first value at position p0 of
// the chunk) to the chunk's slot after the count already there, in position order.  Returns the
// new count (every lane).  Slots past `slot` are dropped: kvz_scan collects such chunks again.
// Usually one lane of the warp holds one escape, so a lane's place is a ballot's population
// count below it unless some lane holds several (then one ballot per bit of the counts).
template <int E, int M, typename T>
__device__ __forceinline__ int slot_escapes(const Raw<T>& v, u32 m, int p0, int count, int slot, u16* __restrict__ spos,
                                            u8* __restrict__ sexp, int lane) {
    const u32 k = __popc(m);
    int idx, total;
    const u32 some = __ballot_sync(FULL_MASK, k != 0), several = __ballot_sync(FULL_MASK, k > 1);
    if (several) {
        idx = warp_exclusive_count(k, lane, &total);
    } else {
        idx = __popc(some & ((1u << lane) - 1u));
        total = __popc(some);
    }
    idx += count;
    if (m) {
        const u64 ex = exponent_bytes<E, M>(v);
        do {
            const int j = __ffs(m) - 1;
            if (idx < slot) {
                spos[idx] = (u16)(p0 + j);
                sexp[idx] = (u8)(ex >> (8 * j));
            }
            idx++;
            m &= m - 1u;
        } while (m);
    }
    return count + total;
}

// One tensor of a batch.  All fields are 8 bytes wide: the host fills a uint64 array (ntensors, 12).
struct EncodeJob {
    static constexpr bool ENCODE = true;
    const void* src;        // the values' bits
    long long n;            // value count
    u8* codes;              // output streams, in place in the blob
    u8* rest;
    u16* esc_count;
    u16* esc_pos;           // esc_exp and exp_high follow it, where the escape totals put them
    u16* slot_pos;          // kvz_encode's per-chunk escape slots (SLOT entries a chunk) for this tensor
    u8* slot_exp;
    long long chunk_base;   // this tensor's first chunk in the batch-wide chunk numbering
    long long sb_base;      // and its first scan block (SB_CHUNKS chunks each)
    const u8* q_table;      // QT kernels: the quantize table (src is then 16-bit bits)
    float* q_scale;         // QT: where the blob's scales stream goes (kvz_quant_table writes it)
};

// One blob of a decode batch (the mirror of EncodeJob).
struct DecodeJob {  // all 8-byte fields: the host fills a uint64 array (ntensors, 16)
    static constexpr bool ENCODE = false;
    const u8* codes;
    const u8* rest;
    const u16* esc_count;
    const u16* esc_pos;
    const u8* esc_exp;
    const u8* exp_high;
    long long n;
    long long n_esc;        // lengths of esc_pos/esc_exp and exp_high as the container says
    long long n_high;
    void* dst;
    u64 dlo, dhi;           // the codebook: code c -> exponent byte c of dlo:dhi
    long long chunk_base;
    long long sb_base;
    const u16* dq_table;    // kvz_decode<..., DQ = true>: FP8 code -> 16-bit value (QuantizeFP8's decode)
    const float* dq_scale;  // and the blob's scale it is built from (quantize_fast.cu's kvz_dequant_tables)
};

// The tensor that batch-wide index key (a chunk, or a scan block) belongs to: the last job whose
// base <= key (jobs are in order; empty tensors share their successor's base and are skipped).
// PAST_L1: the bases read with ld.global.cg (kvz_decode's early chunk: decode_early_chunk).
template <bool PAST_L1 = false, typename Job>
__device__ __forceinline__ int find_job(const Job* jobs, int njobs, long long key, long long Job::*base) {
    int lo = 0, hi = njobs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        const long long b = PAST_L1 ? __ldcg(&(jobs[mid].*base)) : jobs[mid].*base;
        if (b <= key) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// The dense passes' chunks: the first W (one a warp) dealt out statically, then each warp's next
// from a queue, an atomic counter that lane 0 claims from at the start of the chunk before, so
// the claim's round trip overlaps that chunk's work and no warp waits on another.
// Dealing every chunk statically (warp w: w, w + W, ...) left the warps whose chunks held many
// escapes finishing last (ncu, E5M2 decode: 82 % of the warps active on average against 91 %
// without escapes; NOTES v15).  The bytes never depend on which warp takes which chunk.
// KVZ_QUEUES counters, QUEUE_STRIDE words apart (QUEUE_WORDS words of work from queue_at, zeroed;
// programs.py sizes the region): warp w takes queue q = w % KVZ_QUEUES, whose k-th claim is
// chunk W + q + KVZ_QUEUES * k, so each chunk is claimed exactly once.  One counter for 2112 to
// 3168 warps held the encoders back: with the E5M2 arithmetic stubbed out, 185-189 us a 2^28
// graph with the queue against 155 with the chunks dealt statically (NOTES v23).  Four: 2^28
// graphs, BF16 encode 279.7-283.4 -> 271.3-274.9 us, decode 262.9-266.8 -> 258.3-261.4; with the
// E5M2 encoder's position tables (below) and single chunks a claim where it took two, E5M2 encode
// 182.3-184.2 -> 174.5-176.8; E5M2 decode unchanged (~180); two queues gained little, eight no
// more than four (benchmarks/macro_ab.py, NOTES v24).  KVZ_QUEUES: for A/B runs.
// Both halves are inline PTX, volatile with a memory clobber, so the compiler keeps the atomic at
// the chunk's start and its use (next_chunk, a shuffle from lane 0) after the chunk's work.
// Written as atomicAdd and __shfl_sync, the compiler aggregated the atomic across the warp (a
// leader election and a shuffle of its result right after it; ptxas does this to an atom.add in
// inline PTX too, not to atom.inc, whose wrap-around it cannot combine) and hoisted the loop's
// shuffle to the top: every chunk waited out the round trip, 19 % of the E5M2 encoder's stall
// samples (ncu source view, NOTES v17).  The queue is picked inside the asm too (W is a multiple
// of WARPS, so it is the warp's place in its block modulo KVZ_QUEUES): held in a register across
// the loop it cost the BF16 decoder 24 bytes of spills.
#ifndef KVZ_QUEUES
#define KVZ_QUEUES 4
#endif
#define QUEUE_STRIDE 16  // 128 bytes: each counter a line of its own
#define QUEUE_WORDS 128  // the queues' region of work (KVZ_QUEUES * QUEUE_STRIDE at most)
static_assert(KVZ_QUEUES >= 1 && KVZ_QUEUES * QUEUE_STRIDE <= QUEUE_WORDS && WARPS % KVZ_QUEUES == 0,
              "the queues fit their region and divide the warps");
// claim_chunk returns the counter's old value as the atomic gives it (lane 0's; the counter's low
// word, little-endian: fewer than 2^32 chunks, MAX_VALUES), and next_chunk makes it a chunk, W + q
// + KVZ_QUEUES * old, in its own asm: with that arithmetic outside (v24-v26) ptxas put a multiply
// of old right after the atomic, so lane 0, and with it the warp at the branch's end, waited out
// the claim's round trip at every chunk's start after all (SASS, NOTES v27).  W (the grid's
// warps) comes from %nctaid in the asm too: one register less across the chunk.
__device__ __forceinline__ u32 claim_chunk(u64* queues, int lane) {
    u32 old = 0;
    if (lane == 0)
        asm volatile("{ .reg .u64 g, o; .reg .u32 t, q; mov.u32 t, %%tid.x; shr.u32 t, t, 5; rem.u32 q, t, %2;"
                     " mul.wide.u32 o, q, %3; add.u64 g, %1, o; cvta.to.global.u64 g, g;"
                     " atom.global.inc.u32 %0, [g], 0xfffffffe; }"
                     : "=r"(old) : "l"(queues), "n"(KVZ_QUEUES), "n"(QUEUE_STRIDE * 8) : "memory");
    return old;
}

// The chunk lane 0 claimed (claim_chunk's value), in every lane.
__device__ __forceinline__ long long next_chunk(u32 claim) {
    long long r;
    asm volatile("{ .reg .u32 k, t, q, w; .reg .u64 a, b; shfl.sync.idx.b32 k, %1, 0, 0x1f, 0xffffffff;"
                 " mov.u32 t, %%tid.x; shr.u32 t, t, 5; rem.u32 q, t, %2; mov.u32 w, %%nctaid.x;"
                 " mul.wide.u32 a, w, %3; mul.wide.u32 b, k, %2; add.u64 a, a, b; cvt.u64.u32 b, q;"
                 " add.u64 %0, a, b; }"
                 : "=l"(r) : "r"(claim), "n"(KVZ_QUEUES), "n"(WARPS) : "memory");
    return r;
}

// kvz_encode's per-tensor sums, by lane 0 of a warp: the warp's escapes << 31 | plane-coded groups
// of its `chunks` chunks of tensor `job` go into work[1 + job] at once; with ready, the chunks are
// noted in the warp's pending list (shared memory), whose counts go into each tensor's done count
// (work[queue_at + QUEUE_WORDS + job]) once PENDING tensors are noted or the warp ends
// (release_counts), and the lane that completes a count puts that tensor's totals in ready[job],
// flagged.  One fence orders a whole list's sums before its counts, and the completing lane's
// orders its count before its read, so the totals it reads hold every warp's.  A fence waits for
// the lane's stores of the chunk in flight too (~1 us): in a batch, where a warp's consecutive
// chunks lie in different tensors, a fence a chunk cost the 64 x 8 MiB encode graph 33 us
// (322.6-322.9 against 289.8 with none, and wrong totals).  A longer list publishes later, and the
// host builds the blobs still unpublished when the encoder ends after it (~1.3 us each), so the
// call wants the shortest list that takes the fences off the graph.  H200, macro_ab.py batch,
// KVZ_PENDING 1 / 2 / 4 / 8 / 16: graph 324.3-327.7 / 312.5-313.5 / 310.8-312.0 / 312.2-314.1 /
// 327.7-327.9 us, call (on one host) - / 369.0-391.8 / 390.8-398.8 / 412.4-413.7 / 430.8-449.1.
#ifndef KVZ_PENDING
#define KVZ_PENDING 2
#endif
struct PendingCounts {
    int n;                      // tensors noted
    u32 job[KVZ_PENDING], chunks[KVZ_PENDING];
};
__device__ __noinline__ void release_counts(const EncodeJob* jobs, int chunk, u64* work, long long queue_at, u64* ready,
                                            PendingCounts* pend) {
    if (pend->n == 0) return;
    __threadfence();
    for (int i = 0; i < pend->n; i++) {
        const int job = (int)pend->job[i];
        const long long chunks = pend->chunks[i], nchunks = (jobs[job].n + chunk - 1) / chunk;
        if ((long long)atomicAdd(work + queue_at + QUEUE_WORDS + job, (u64)chunks) + chunks == nchunks) {
            __threadfence();
            const u64 totals = atomicAdd(work + 1 + job, 0ull);
            *reinterpret_cast<volatile u64*>(ready + job) = totals | (1ull << 63);
        }
    }
    pend->n = 0;
}
__device__ __noinline__ void flush_totals(const EncodeJob* jobs, int job, u64 sum, int chunks, int chunk,
                                          u64* work, long long queue_at, u64* ready, PendingCounts* pend) {
    if (chunks == 0) return;
    if (sum) atomicAdd(work + 1 + job, sum);
    if (ready == nullptr) return;
    pend->job[pend->n] = (u32)job;
    pend->chunks[pend->n] = (u32)chunks;
    if (++pend->n == KVZ_PENDING) release_counts(jobs, chunk, work, queue_at, ready, pend);
}

// Dense pass.  Chunks come from the queue above; a warp walks its chunk in steps of 32 * GPL
// groups, each lane loading its GPL groups with vector loads, encoding them and storing codes
// and rest in place.  Escapes go to a per-chunk slot in position order (slot_escapes); kvz_scan
// moves them to their final place.
// The loop is kept this plain on purpose: the same traffic with nothing else (benchmarks/
// access_patterns.py) moves 3.8 TB/s on the H200, while earlier versions of this kernel with
// prefetching across chunks, a cursor per warp, or a cp.async ring in shared memory spent ~170
// instructions a group on bookkeeping and stalled at 52-60 % of DRAM bandwidth (NOTES.md, v3-v4).
// Each warp also sums its chunks' escapes and plane-coded groups per tensor into work[1 + t] (one
// atomic per warp and tensor), so kvz_scan knows the totals, and with them where the escape
// exponents go, from its start.  ready (pinned host memory, or null): word t becomes tensor t's
// totals | 1 << 63 soon after its last chunk is counted (flush_totals), so the host sizes and
// hands out each blob while the rest of the batch, and the scan, still run.
// GPL: groups a lane handles per step; MINB: blocks per multiprocessor to fit.
// QT (FP8 formats, one job): the values come in as 16-bit bits and are quantized as they load,
// through jobs[0].q_table copied to shared memory (QuantizeFP8 per tensor fused in: the FP8
// codes never go to memory).
template <int E, int M, typename T, int GPL, int MINB, bool QT = false>
__global__ void __launch_bounds__(WARPS * 32, MINB) kvz_encode(const EncodeJob* __restrict__ jobs, int njobs,
                                                                long long total_chunks, int chunk, int slot,
                                                                const u8* __restrict__ lut, u64* __restrict__ work,
                                                                long long queue_at, u64* __restrict__ ready) {
    await_predecessor();
    release_dependents();
    constexpr int HB = E - 4, R = M + 1, STEP = 32 * GPL;
    __shared__ u32 slut_words[((1 << E) + 3) / 4];
    u8* slut = reinterpret_cast<u8*>(slut_words);
    for (int i = threadIdx.x; i < (1 << E); i += blockDim.x) slut[i] = lut[i];
    constexpr bool E5M2 = E == 5 && M == 2 && sizeof(T) == 1;
    __shared__ u32 tables[E5M2 ? POSITION_TABLE_WORDS : 1];  // E5M2's position tables (encode_e5m2_full)
    if constexpr (E5M2) build_position_tables(tables, lut);
    __shared__ PendingCounts pending[WARPS];  // each warp's list of counts not yet released (lane 0's)
    if ((threadIdx.x & 31) == 0) pending[threadIdx.x >> 5].n = 0;
    const u8* qtable = nullptr;
    if constexpr (QT) {
        __shared__ uint4 qtab[(1 << 15) / 16];
        const uint4* tg = reinterpret_cast<const uint4*>(jobs[0].q_table);
        for (int i = threadIdx.x; i < (1 << 15) / 16; i += blockDim.x) qtab[i] = tg[i];
        qtable = reinterpret_cast<const u8*>(qtab);
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    const int gpc = chunk / 8;
    u32 next = 0;
    u64 sum = 0;  // escapes << 31 | plane-coded groups of this warp's chunks of tensor sum_job
    int sum_job = 0, sum_chunks = 0;
    PendingCounts* pend = &pending[threadIdx.x >> 5];
    for (long long gc = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5); gc < total_chunks; gc = next_chunk(next)) {
        next = claim_chunk(work + queue_at, lane);
        const int job = find_job(jobs, njobs, gc, &EncodeJob::chunk_base);
        const EncodeJob& J = jobs[job];
        const long long c = gc - J.chunk_base, g0 = c * gpc;
        const long long n = J.n - g0 * 8;  // values from the chunk's start to the tensor's end
        const int ng = (int)min((long long)gpc, (n + 7) / 8);
        // this chunk's data, and group i of it at index i (QT: the 16-bit values it quantizes)
        using L = typename Pick<QT, u16, T>::type;
        const L* __restrict__ src = static_cast<const L*>(J.src) + g0 * 8;
        u8* __restrict__ codes = J.codes + g0 * 4;
        u8* __restrict__ rest = J.rest + g0 * R;
        assume_global(src); assume_global(codes); assume_global(rest);
        int count = 0;
        // Whole steps (every group 8 values) load with no checks.  Unquantizing, the next whole
        // step's loads are issued before this step's work, into a second set of registers, so a
        // warp keeps reads in flight while it encodes: the E5M2 encoder, latency-bound once its
        // instructions were cut (ncu: 61 % of stall samples waiting on loads), went 183-187 ->
        // 172-180 us, BF16 260-265 -> 253-259 (at the shapes ENCODE_SHAPE names; NOTES v17).  The
        // quantizing encoder, which would hold 16-bit values, was slower with it (242 -> 255).
        constexpr bool PREFETCH = !QT;
        Raw<T> cur[PREFETCH ? GPL : 1], ahead[PREFETCH ? GPL : 1];
        bool whole = STEP <= ng && (long long)STEP * 8 <= n;
        if constexpr (PREFETCH) {
            if (whole) {
#pragma unroll
                for (int q = 0; q < GPL; q++) load_raw_full(src, q * 32 + lane, cur[q]);
            }
        }
        for (int s0 = 0; s0 < ng; s0 += STEP) {
            const bool next_whole = s0 + 2 * STEP <= ng && (long long)(s0 + 2 * STEP) * 8 <= n;
            if constexpr (PREFETCH) {
                if (next_whole) {
#pragma unroll
                    for (int q = 0; q < GPL; q++) load_raw_full(src, s0 + STEP + q * 32 + lane, ahead[q]);
                }
            }
            Raw<T> v[GPL];
            u32 m[GPL], any = 0;
            if (whole) {
#pragma unroll
                for (int q = 0; q < GPL; q++) {
                    if constexpr (PREFETCH) {
                        v[q] = cur[q];
                    } else {  // QT: quantized as they arrive
                        Raw<L> raw;
                        load_raw_full(src, s0 + q * 32 + lane, raw);
                        quantize_raw(raw, v[q], qtable);
                    }
                }
                if constexpr (E5M2) {  // rest as whole words (store_rest24_warp)
                    u32 bits[GPL];
#pragma unroll
                    for (int q = 0; q < GPL; q++) {
                        m[q] = encode_e5m2_full(v[q], s0 + q * 32 + lane, reinterpret_cast<const u8*>(tables), codes,
                                                &bits[q]);
                        any |= m[q];
                    }
#pragma unroll
                    for (int q = 0; q < GPL; q++) store_rest24_warp(rest + (s0 + q * 32) * 3, bits[q], lane);
                } else if constexpr (E == 5 && M == 10 && sizeof(T) == 2) {  // FP16: rest as whole words
#pragma unroll
                    for (int q = 0; q < GPL; q++) {
                        u64 lo;
                        u32 hi;
                        m[q] = encode_fp16_full(v[q], s0 + q * 32 + lane, slut, codes, &lo, &hi);
                        any |= m[q];
                        // word-aligned: the stream is, and whole steps start every 128 groups (1408 bytes)
                        store_rest11_warp(rest + (s0 + q * 32) * 11, lo, hi, lane);
                    }
                } else {
#pragma unroll
                    for (int q = 0; q < GPL; q++) {
                        m[q] = encode_raw<E, M, T, true>(v[q], n, s0 + q * 32 + lane, slut, codes, rest);
                        any |= m[q];
                    }
                }
            } else {
#pragma unroll
                for (int q = 0; q < GPL; q++)
                    if (s0 + q * 32 + lane < ng) {
                        if constexpr (QT) load_quantized(src, n, s0 + q * 32 + lane, v[q], qtable);
                        else load_raw(src, n, s0 + q * 32 + lane, v[q]);
                    }
#pragma unroll
                for (int q = 0; q < GPL; q++) {
                    const int i = s0 + q * 32 + lane;
                    m[q] = i < ng ? encode_raw<E, M, T>(v[q], n, i, slut, codes, rest) : 0u;
                    any |= m[q];
                }
            }
            if (__any_sync(FULL_MASK, any != 0)) {
                u16* __restrict__ spos = J.slot_pos + c * slot;
                u8* __restrict__ sexp = J.slot_exp + c * slot;
                assume_global(spos); assume_global(sexp);
#pragma unroll
                for (int q = 0; q < GPL; q++)
                    if (__any_sync(FULL_MASK, m[q] != 0u))
                        count = slot_escapes<E, M>(v[q], m[q], (s0 + q * 32 + lane) * 8, count, slot, spos, sexp, lane);
            }
            if constexpr (PREFETCH) {
#pragma unroll
                for (int q = 0; q < GPL; q++) cur[q] = ahead[q];
            }
            whole = next_whole;
        }
        const bool plane = count > HB * ng / 3;
        if (lane == 0) J.esc_count[c] = plane ? (u16)PLANE : (u16)count;
        if (job != sum_job) {
            if (lane == 0) flush_totals(jobs, sum_job, sum, sum_chunks, chunk, work, queue_at, ready, pend);
            sum = 0;
            sum_chunks = 0;
            sum_job = job;
        }
        sum += plane ? (u64)ng : (u64)count << 31;
        sum_chunks++;
    }
    if (lane == 0) {
        flush_totals(jobs, sum_job, sum, sum_chunks, chunk, work, queue_at, ready, pend);
        release_counts(jobs, chunk, work, queue_at, ready, pend);
    }
}

// ------------------------------------------------------------------ blob epilogue (encode)
// Once the escape totals are known (on the device): zero every padding byte between streams and
// write the header, a host-built template whose payload length, last three stream-table entries
// and CRC-32 are filled in here, so the host never waits to build headers.
struct FinishJob {  // all 8-byte fields: uint64 array (ntensors, 12)
    u8* blob;               // header at blob[0], payload at blob[header_len]
    const u8* tmpl;         // header template
    long long header_len;
    long long table_at;     // header offset of esc_pos's stream-table entry (esc_exp, exp_high follow)
    long long var_base;     // payload offset of esc_pos (the escape streams close the payload)
    long long pad[6];       // three (start, end) payload ranges of padding known before encoding
    long long write_header; // 0 when the host writes the header itself (payload checksum)
};

#include "abi_check.cuh"  // EncodeJob, DecodeJob, FinishJob as kvzip/gpu/abi.py writes them (generated)

__device__ __forceinline__ void put_u64(u8* p, u64 v) {
#pragma unroll
    for (int k = 0; k < 8; k++) p[k] = (u8)(v >> (8 * k));
}

#define HEADER_SMEM 4096  // headers up to this size are built in shared memory (ours are < 2 KiB)

// zlib's CRC-32, slicing-by-4: four 256-entry tables the whole block builds in shared memory, for
// warp_crc32 below to walk a header a word at a time.
__device__ void build_crc_tables(u32 crc_table[4][256]) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        u32 c = (u32)i;
        for (int k = 0; k < 8; k++) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        u32 c = crc_table[0][i];
        for (int k = 1; k < 4; k++) { c = (c >> 8) ^ crc_table[0][c & 0xFF]; crc_table[k][i] = c; }
    }
    __syncthreads();
}

__device__ __forceinline__ u32 crc_word(const u32 crc_table[4][256], u32 crc, u32 word) {
    crc ^= word;
    return crc_table[3][crc & 0xFF] ^ crc_table[2][(crc >> 8) & 0xFF] ^ crc_table[1][(crc >> 16) & 0xFF] ^
           crc_table[0][crc >> 24];
}

// A header's CRC by one warp.  The register after A then B is reg(A) * x^(8 |B|) ^ reg0(B), where
// reg0 starts from 0 and the product is modulo the CRC polynomial in zlib's reflected bit order
// (bit 31 is x^0; zlib's crc32_combine).  So each lane runs the tables over CRC_WORDS words and
// shifts its register over the words of the lanes after it: a product with a constant,
// CRC_SHIFT[j] = x^(8 * 4 * CRC_WORDS * j) mod P (from zlib's x2nmodp).  Rounds of 32 * CRC_WORDS
// words, the last one aligned to the end, so the shifts stay these constants.
#define CRC_WORDS 16
__constant__ u32 CRC_SHIFT[32] = {0x80000000u, 0x88d14467u, 0xd7bbfe6au, 0x62b6ca4bu, 0xec447f11u, 0x7c69160du, 0xb72d2b3cu, 0xb34988bbu, 0x8e7ea170u, 0x54e00eefu, 0x7e91368au, 0x9b577d5cu, 0x05616c82u, 0x6b85d8d7u, 0x3277f3e0u, 0x979966f5u, 0x6427800eu, 0x4a080ee0u, 0xb1436b58u, 0x7242d7fau, 0x5ef840e2u, 0x56c3cb9cu, 0xb3a2be1cu, 0x36b74585u, 0xbf110f7eu, 0xa52f4d76u, 0x3ea21cf9u, 0x5e665234u, 0x118f848eu, 0xc7916f54u, 0x34163bd1u, 0xb58f9792u};

__device__ __forceinline__ u32 multmodp(u32 a, u32 b) {
    u32 m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1u) ? (b >> 1) ^ 0xEDB88320u : b >> 1;
    }
    return p;
}

// zlib's CRC-32 register (initial 0xFFFFFFFF, not yet inverted) after the nwords words of w (word
// skip read as 0), by one warp; every lane gets it.  ~1 000 cycles for a 1 KiB header where one
// thread walking it takes several thousand.
__device__ u32 warp_crc32(const u32 crc_table[4][256], const u32* w, long long nwords, long long skip, int lane) {
    u32 reg = 0xFFFFFFFFu;
    for (long long start = 0; start < nwords;) {
        const long long len = min((long long)(32 * CRC_WORDS), nwords - start);
        const long long e = start + len - CRC_WORDS * (31 - lane);
        const long long a = max(start, e - CRC_WORDS);
        u32 r = 0;
        if (a < e) {
            r = a == start ? reg : 0u;  // the lane the round starts in carries the register so far
            for (long long i = a; i < e; i++) r = crc_word(crc_table, r, i == skip ? 0u : w[i]);
            if (lane != 31) r = multmodp(CRC_SHIFT[31 - lane], r);
        }
#pragma unroll
        for (int d = 16; d; d >>= 1) r ^= __shfl_xor_sync(FULL_MASK, r, d);
        reg = r;
        start += len;
    }
    return reg;
}

__device__ __forceinline__ long long align16(long long x) { return (x + KVZ_ALIGN - 1) & ~(KVZ_ALIGN - 1); }

// Blob J's padding, header and sizes (escapes, exp_high bytes, payload length) from its totals
// (escapes << 31 | plane-coded groups), by one whole block (it synchronises).  The streams after
// esc_pos start on 16-byte boundaries of the payload (var_base is one): esc_exp at
// align16(var_base + 2 * escapes), exp_high after it.
__device__ void finish_blob(const FinishJob& J, u64 totals, int hb, u64* __restrict__ sizes) {
    __shared__ u32 crc_table[4][256];
    __shared__ __align__(16) u8 head[HEADER_SMEM];
    const long long ne = (long long)(totals >> 31), nh = (long long)hb * (long long)(totals & GROUPS_MASK);
    const long long a_end = J.var_base + KVZ_ESC_POS_BYTES * ne;
    const long long b = align16(a_end), b_end = b + ne;
    const long long cc = align16(b_end), c_end = cc + nh;
    const long long end = align16(c_end);
    u8* __restrict__ payload = J.blob + J.header_len;
    if (threadIdx.x == 0) { sizes[0] = ne; sizes[1] = nh; sizes[2] = end; }
    if (threadIdx.x < 16) {
        const long long k = threadIdx.x;
        for (int r = 0; r < 3; r++)
            if (J.pad[2 * r] + k < J.pad[2 * r + 1]) payload[J.pad[2 * r] + k] = 0;
        if (a_end + k < b) payload[a_end + k] = 0;
        if (b_end + k < cc) payload[b_end + k] = 0;
        if (c_end + k < end) payload[c_end + k] = 0;
    }
    if (!J.write_header) return;  // the host writes it (payload checksum)
    // The template with the fields that depend on the totals, then its CRC-32 by a warp with the CRC
    // field zeroed.
    const long long H = J.header_len;
    const bool in_smem = H <= HEADER_SMEM;
    u8* h = in_smem ? head : J.blob;
    for (long long i = threadIdx.x; i < H; i += blockDim.x) h[i] = J.tmpl[i];
    build_crc_tables(crc_table);
    if (threadIdx.x < 32) {
        if (threadIdx.x == 0) {
            // The escape entries at table_at: (offset, length) of esc_pos, esc_exp, exp_high.
            put_u64(h + KVZ_PAYLOAD_LEN_AT, (u64)end);
            put_u64(h + J.table_at, (u64)J.var_base);       put_u64(h + J.table_at + 8, (u64)(KVZ_ESC_POS_BYTES * ne));
            put_u64(h + J.table_at + KVZ_ENTRY_SIZE, (u64)b);      put_u64(h + J.table_at + KVZ_ENTRY_SIZE + 8, (u64)ne);
            put_u64(h + J.table_at + 2 * KVZ_ENTRY_SIZE, (u64)cc); put_u64(h + J.table_at + 2 * KVZ_ENTRY_SIZE + 8, (u64)nh);
        }
        __syncwarp();  // the fields are in place for the whole warp
        // H is a multiple of 16 and h 16-byte aligned; the CRC field (a word) counts as 0.
        const u32 crc = warp_crc32(crc_table, reinterpret_cast<const u32*>(h), H / 4, KVZ_HEADER_CRC_AT / 4, threadIdx.x) ^ 0xFFFFFFFFu;
        u8* const c = h + KVZ_HEADER_CRC_AT;
        if (threadIdx.x == 0) { c[0] = (u8)crc; c[1] = (u8)(crc >> 8); c[2] = (u8)(crc >> 16); c[3] = (u8)(crc >> 24); }
    }
    __syncthreads();
    if (in_smem)
        for (long long i = threadIdx.x; i < H; i += blockDim.x) J.blob[i] = head[i];
}

// ------------------------------------------------------------------ header gather (batched decode)
// dst[t * span .. ] = the first min(span, len_t) bytes of blob t: one read-back for a batch's headers.
__global__ void kvz_gather_heads(const u64* __restrict__ jobs /* (ntensors, 2): ptr, len */, int span, u8* __restrict__ dst) {
    await_predecessor();
    release_dependents();
    const int t = blockIdx.y;
    const u8* src = reinterpret_cast<const u8*>(jobs[2 * t]);
    const long long len = min((long long)span, (long long)jobs[2 * t + 1]);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (long long)gridDim.x * blockDim.x)
        dst[(long long)t * span + i] = src[i];
}

// ------------------------------------------------------------------ header checks (batched decode)
// Blob t of heads ((ntensors, 2): address, length): its address and length, its first
// min(span, len) bytes (16-byte vectors) staged in head, and the CRC tables built; ends with a
// barrier.  Returns how many bytes were staged.
__device__ __forceinline__ long long stage_head(const u64* heads, int t, int span, u8* head, u32 crc_table[4][256],
                                                const u8*& b, long long& len) {
    b = reinterpret_cast<const u8*>(heads[2 * t]);
    len = (long long)heads[2 * t + 1];
    const long long staged = min((long long)span, len) / 16 * 16;
    for (long long i = threadIdx.x; i < staged / 16; i += blockDim.x)
        reinterpret_cast<uint4*>(head)[i] = reinterpret_cast<const uint4*>(b)[i];
    build_crc_tables(crc_table);  // ends with a barrier: head is complete too
    return staged;
}

// One warp (every lane gets the result): what kvz_check_heads reports of the header staged in
// head (out: 8 words).
__device__ void head_facts(const u8* b, long long len, int span, const u8* head, long long staged,
                           const u32 crc_table[4][256], u64 out[8]) {
    for (int k = 0; k < 8; k++) out[k] = 0;
    if (len < KVZ_PREFIX_SIZE) return;
    const u32* w = reinterpret_cast<const u32*>(head);
    const long long h = w[KVZ_HEADER_LEN_AT / 4], ns = w[KVZ_STREAM_COUNT_AT / 4];
    const long long at = KVZ_TABLE_AT + KVZ_ENTRY_SIZE * (ns - KVZ_ESCAPE_STREAMS);
    out[6] = (u64)h; out[7] = (u64)ns;
    if (!(ns >= KVZ_ESCAPE_STREAMS && h <= span && h <= len && at + KVZ_ESCAPE_ENTRIES_SIZE <= h)) return;
    const long long words = min(h, staged) / 4;  // the staged words; the CRC field (a word) as 0
    u32 crc = warp_crc32(crc_table, w, words, KVZ_HEADER_CRC_AT / 4, threadIdx.x & 31);
    for (long long i = 4 * words; i < h; i++) crc = crc_table[0][(crc ^ (i < staged ? head[i] : b[i])) & 0xFF] ^ (crc >> 8);
    const u64* e = reinterpret_cast<const u64*>(head + at);  // (offset, bytes) of esc_pos, esc_exp, exp_high
    const u64 payload = reinterpret_cast<const u64*>(head)[KVZ_PAYLOAD_LEN_AT / 8];
    const u64 big = 1ull << 48;  // every field below this before any sum: no wrap-around
    bool ok = (crc ^ 0xFFFFFFFFu) == w[KVZ_HEADER_CRC_AT / 4] && payload < big;
    for (int k = 0; k < 6; k++) ok = ok && e[k] < big;
    // The layout finish_blob writes (every term below 2^49 once ok holds: && stops before the sums).
    ok = ok && e[2] == (u64)align16((long long)(e[0] + e[1])) && e[4] == (u64)align16((long long)(e[2] + e[3])) &&
         payload == (u64)align16((long long)(e[4] + e[5])) && e[1] == KVZ_ESC_POS_BYTES * e[3] && (u64)h + payload == (u64)len;
    if (ok) { out[0] = 1; out[1] = e[0]; out[2] = e[2]; out[3] = e[4]; out[4] = e[3]; out[5] = e[5]; }
}

// grid = ntensors.  For blob t (16-byte aligned), checks[8t .. 8t+7] = {1 if its header hangs
// together, then esc_pos's, esc_exp's and exp_high's payload offsets, the escapes, the
// high-exponent bytes; its header length; its stream count}.  "Hangs together": the header
// fits the span and the blob, its CRC matches, the three escape streams follow one another as
// container.layout places them, the payload ends after the last, at the blob's end.  Word 0 and
// words 1-5 are 0 otherwise; words 6-7 are 0 for a blob shorter than the prefix.
// layout_cache.head_checks is the host twin, and the reference this is tested against.
__global__ void __launch_bounds__(256) kvz_check_heads(const u64* __restrict__ heads /* (ntensors, 2): ptr, len */,
                                                       int span /* at most HEADER_SMEM */, u64* __restrict__ checks) {
    await_predecessor();
    release_dependents();
    __shared__ u32 crc_table[4][256];
    __shared__ __align__(16) u8 head[HEADER_SMEM];
    const u8* b;
    long long len;
    const long long staged = stage_head(heads, blockIdx.x, span, head, crc_table, b, len);
    if (threadIdx.x >= 32) return;
    u64 out[8];
    head_facts(b, len, span, head, staged, crc_table, out);
    if (threadIdx.x == 0)
        for (int k = 0; k < 8; k++) checks[8 * blockIdx.x + k] = out[k];
}

// ------------------------------------------------------------------ guessed layouts (decode)
// A decode launched on guessed layouts (layout_cache.guess) starts its scan with one block a blob
// doing this: blob t's header must hang together (as kvz_check_heads says), equal expect's row t
// once the fields that follow the escape count are blanked (payload length, CRC, escape entries),
// and put esc_pos where J already points.  Then J's escape fields are filled in from the header;
// otherwise its escape streams are emptied and its error set to GUESS_MISSED, so the scan reads
// only the fixed streams the host made sure lie inside the blob and kvz_decode skips it, and the
// host decodes that blob the checked way.  J.n_high, staged as GUESS_PENDING, is written last:
// the scan blocks that need the verdict wait for it (await_guess).
#define GUESS_MISSED 255
#define GUESS_PENDING (-1ll)
__device__ void guess_head(const u64* heads, int t, int span, const u8* expect, DecodeJob& J, u64* work) {
    __shared__ u32 crc_table[4][256];
    __shared__ __align__(16) u8 head[HEADER_SMEM];
    const u8* b;
    long long len;
    const long long staged = stage_head(heads, t, span, head, crc_table, b, len);
    const u32* w = reinterpret_cast<const u32*>(head);
    const bool prefix = len >= KVZ_PREFIX_SIZE;
    const long long h = prefix ? w[KVZ_HEADER_LEN_AT / 4] : 0;
    const long long at = prefix ? KVZ_TABLE_AT + KVZ_ENTRY_SIZE * ((long long)w[KVZ_STREAM_COUNT_AT / 4] - KVZ_ESCAPE_STREAMS) : 0;
    bool same = prefix && h <= span && h <= len;  // within expect's row: i < h <= span
    for (long long i = threadIdx.x; same && i < h; i += blockDim.x) {
        // The fields that follow the escape count, blanked in expect (kvzip/layout.py's VARYING, escape entries).
        const bool blank = (i >= KVZ_PAYLOAD_LEN_AT && i < KVZ_PAYLOAD_LEN_AT + KVZ_PAYLOAD_LEN_SIZE) ||
                           (i >= KVZ_HEADER_CRC_AT && i < KVZ_HEADER_CRC_AT + KVZ_HEADER_CRC_SIZE) ||
                           (i >= at && i < at + KVZ_ESCAPE_ENTRIES_SIZE);
        same = (blank ? 0 : i < staged ? head[i] : b[i]) == expect[(long long)t * span + i];
    }
    same = __syncthreads_and(same);
    if (threadIdx.x >= 32) return;
    u64 out[8];
    head_facts(b, len, span, head, staged, crc_table, out);
    if (threadIdx.x != 0) return;
    const u8* payload = b + h;
    const bool hit = same && out[0] == 1 && reinterpret_cast<const u8*>(J.esc_pos) == payload + out[1];
    if (hit) {
        J.esc_exp = payload + out[2];
        J.exp_high = payload + out[3];
        J.n_esc = (long long)out[4];
    } else {
        J.n_esc = 0;
        work[1 + t] = GUESS_MISSED;
    }
    __threadfence();
    *reinterpret_cast<volatile long long*>(&J.n_high) = hit ? (long long)out[5] : 0;
}

// Wait for guess_head's verdict on J (one thread).
__device__ __forceinline__ void await_guess(const DecodeJob& J) {
    while (*reinterpret_cast<const volatile long long*>(&J.n_high) == GUESS_PENDING) __nanosleep(64);
    __threadfence();
}

// ------------------------------------------------------------------ scan (encode and decode)
// err codes match stages/fused.py: 1 over capacity, 2 escape totals, 3 position, 4 exponent, 5 plane totals.
__device__ __forceinline__ void set_error(u64* err, u64 code) { atomicCAS(err, 0ull, code); }

#define SB_CHUNKS 256      // chunks per scan block: one thread each

// Exclusive prefix over a block of SB_CHUNKS threads; returns it and sets *total to the block's sum.
__device__ __forceinline__ u64 block_exclusive_sum(u64 mine, u64* total) {
    __shared__ u64 warp_sums[WARPS];
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const u64 incl = warp_inclusive_sum(mine, lane);
    if (lane == 31) warp_sums[wid] = incl;
    __syncthreads();
    if (wid == 0) {
        u64 w = lane < WARPS ? warp_sums[lane] : 0;
        w = warp_inclusive_sum(w, lane);
        if (lane < WARPS) warp_sums[lane] = w;
    }
    __syncthreads();
    *total = warp_sums[WARPS - 1];
    return incl - mine + (wid ? warp_sums[wid - 1] : 0);
}

// The chunk of a scan block holding the block's escape k: the last with s_eoff <= k (s_eoff:
// escapes before each of the block's chunks; a chunk holding escape k has escapes, so k < its
// offset + count).  load_slot_escapes and check_block_escapes.
__device__ __forceinline__ int chunk_of_escape(const u32* s_eoff, u32 k) {
    int lo = 0, hi = SB_CHUNKS - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s_eoff[mid] <= k) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// kvz_scan's encode: escapes k, k + SB_CHUNKS, .. (MOVE_BATCH of them, those below listed) of a
// block, read from their chunks' slots into pos / ex; returns a bit per escape read (none for a
// chunk redone from the input).  s_eoff: escapes before each of the block's chunks; s_cnt: their
// counts; c0: the block's first chunk.
#define MOVE_BATCH 4
__device__ __forceinline__ u32 load_slot_escapes(u32 k0, u32 listed, const u32* s_eoff, const u16* s_cnt, int slot,
                                            long long c0, const u16* slot_pos, const u8* slot_exp,
                                            u16 pos[MOVE_BATCH], u8 ex[MOVE_BATCH]) {
    assume_global(slot_pos); assume_global(slot_exp);
    u32 loaded = 0;
#pragma unroll
    for (int u = 0; u < MOVE_BATCH; u++) {
        const u32 k = k0 + u * SB_CHUNKS;
        if (k >= listed) break;
        const int lo = chunk_of_escape(s_eoff, k);
        if (s_cnt[lo] > (u32)slot) continue;  // redone from the input
        const long long at = (c0 + lo) * slot + (k - s_eoff[lo]);
        pos[u] = slot_pos[at];
        ex[u] = slot_exp[at];
        loaded |= 1u << u;
    }
    return loaded;
}

// The decode scan's check of its block's escapes, the checks kvz_decode makes as it applies them
// (load_escapes: positions inside their chunk and increasing, exponents in range), so that the
// call's errors are known once the scan is done: its last block sends them to the host
// (verdict_block_done), which returns while the decoder still runs (programs.py,
// EARLY_VERDICT).  A thread per escape, SB_CHUNKS apart, its chunk found in s_eoff (escapes before
// each chunk of the block; the chunk holding escape k is the last with s_eoff <= k).  A block of
// more than CHECK_MAX escapes (data far from the codebook: the shared real KV has 3-4 a chunk,
// under 1200 a block) leaves them to kvz_decode and sets *deferred: the host then waits for the
// decoder's verdict.  Escapes past the tensor's n_esc are not read (their count is error 2, which
// the tensor's last block sets).  c0: the block's first chunk; excl: escapes before this thread's
// chunk in the block; listed: the block's escapes; esc_base: escapes before the block.
#ifndef KVZ_CHECK_MAX
#define KVZ_CHECK_MAX (8 * SB_CHUNKS)
#endif
#ifndef CHECK_BATCH
#define CHECK_BATCH 4
#endif
template <int E>
__device__ __forceinline__ void check_block_escapes(const DecodeJob& J, long long n, int chunk, long long c0, u32 excl,
                                                    u32 listed, long long esc_base, bool guessed, u64* err,
                                                    u64* deferred, u32* s_eoff) {
    if (listed == 0) return;
    if (listed > KVZ_CHECK_MAX) {
        if (threadIdx.x == 0) *deferred = 1;
        return;
    }
    s_eoff[threadIdx.x] = excl;
    if (guessed && threadIdx.x == 0) await_guess(J);  // esc_exp and n_esc come from the header guess
    __syncthreads();
    // read past L1: this block read J's row (one line) before the guess may have written them
    const long long n_esc = *reinterpret_cast<const volatile long long*>(&J.n_esc);
    const u8* esc_exp = *reinterpret_cast<const u8* const volatile*>(&J.esc_exp);
    const u16* esc_pos = J.esc_pos;
    // CHECK_BATCH escapes a round, their searches and loads independent of one another.
    u32 bad = 0;
    const long long end = min((long long)listed, n_esc - esc_base);  // block-relative escapes to read
    for (long long k0 = threadIdx.x; k0 < end && !bad; k0 += CHECK_BATCH * SB_CHUNKS) {
        int len[CHECK_BATCH], pos[CHECK_BATCH], prev[CHECK_BATCH];
        u32 e[CHECK_BATCH];
#pragma unroll
        for (int u = 0; u < CHECK_BATCH; u++) {
            const long long k = k0 + u * SB_CHUNKS;
            len[u] = 0;  // no escape: never bad
            if (k >= end) continue;
            const int lo = chunk_of_escape(s_eoff, (u32)k);
            const long long at = esc_base + k;
            len[u] = (int)min((long long)chunk, n - (c0 + lo) * chunk);
            pos[u] = esc_pos[at];
            prev[u] = k == s_eoff[lo] ? -1 : (int)esc_pos[at - 1];
            e[u] = esc_exp[at];
        }
#pragma unroll
        for (int u = 0; u < CHECK_BATCH; u++) {
            if (bad || len[u] == 0) continue;
            if (pos[u] >= len[u] || pos[u] <= prev[u]) bad = 3;
            else if (e[u] >= (1u << E)) bad = 4;
        }
    }
    if (bad) set_error(err, bad);
}

// The decode scan's verdict, sent by its last block: each block, once every thread is done,
// counts itself (work[2 + njobs], zeroed by the upload), and the last of them copies work[0, 2 +
// njobs) (the ticket, each tensor's error, the deferred checks) to down (pinned, mapped) and
// raises the host's flag to the shape's next run count (runs: a workspace word), as a download
// kernel would a node later (graphs' "early" op): kvz_decode then waits for this kernel
// alone.  The fence before a block's count puts its writes ahead of it; the last block's, after
// its count, ahead of its reads.
__device__ void verdict_block_done(u64* work, int njobs, u64* down, unsigned int* flag, unsigned int* runs) {
    __shared__ int s_last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        s_last = atomicAdd(reinterpret_cast<unsigned long long*>(work + 2 + njobs), 1ull) == gridDim.x - 1ull;
        if (s_last) __threadfence();
    }
    __syncthreads();
    if (!s_last) return;
    for (int i = threadIdx.x; i < 2 + njobs; i += blockDim.x) down[i] = __ldcg(work + i);
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned int run = __ldcg(runs) + 1;
        *runs = run;
        __threadfence_system();  // the words, seen by thread 0 at the barrier, land first
        *reinterpret_cast<volatile unsigned int*>(flag) = run;
    }
}

// The decode scan's offsets, ready: each block, once its chunk offsets, its count checks
// (errors 1, 2, 5) and any header guess are written, counts itself at work[offsets_ready_at
// (njobs)] (a line of its own: kvz_decode's blocks poll it), and kvz_decode waits for that count
// (await_offsets) instead of the scan's end, so the scan's escape checks (check_block_escapes:
// 2-3 us of a 2^28 graph, NOTES v26) overlap the decoder's start rather than delay it.  Those
// checks' errors (3, 4) reach the host through the scan's verdict; the decoder makes the same
// checks as it applies the escapes, so its reads and writes stay inside the blob and the output
// either way.  KVZ_OFFSETS_WAIT=0: the decoder waits for the scan's end (griddepcontrol.wait).
#ifndef KVZ_OFFSETS_WAIT
#define KVZ_OFFSETS_WAIT 1
#endif
#ifndef KVZ_POLL_NS
#define KVZ_POLL_NS 256
#endif
__host__ __device__ constexpr long long offsets_ready_at(int njobs) { return (3ll + njobs + 15) & ~15ll; }
__host__ __device__ constexpr long long decode_status_at(int njobs) { return offsets_ready_at(njobs) + 16; }

// A scan block's count (every thread calls it; the fence after the barrier orders the block's
// writes, seen by thread 0 there, before the count, as in verdict_block_done).
__device__ __forceinline__ void offsets_block_done(u64* work, int njobs) {
    if (!KVZ_OFFSETS_WAIT) return;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(reinterpret_cast<unsigned long long*>(work + offsets_ready_at(njobs)), 1ull);
    }
}

// The escape and plane-group offsets of every chunk, from esc_count: a block per SB_CHUNKS chunks
// of one tensor, blocks chained per tensor by the decoupled look-back (tickets hand the blocks out
// in order).  A chunk's value is escapes << 31 | plane-coded groups.
//   Decode: writes each chunk's exclusive offset to chunk_off and checks every count against the
//   listing capacity and the tensor's totals against its stream lengths (error per tensor).
//   Encode: moves the escapes from kvz_encode's slots to their final place, a thread per escape
//   (positions in esc_pos, exponents in esc_exp, which starts where kvz_encode's totals put it);
//   chunks with more escapes than a slot, or plane-coded ones, are redone from the input by a warp
//   each (only escape-heavy data).  The first njobs blocks (by ticket) finish the blobs instead,
//   one each (finish_blob: padding, header, sizes[3t ..]), alongside the others: kvz_encode's
//   totals are all they need.  (A kernel of its own before, 10 us and a graph node.)
// Decode: also checks the block's escapes as kvz_decode does (check_block_escapes).
// work: [0] ticket, [1 + t] tensor t's totals (encode: kvz_encode's sums) or error (decode),
// (decode: [1 + njobs] the deferred checks, check_block_escapes; [2 + njobs] the blocks done,
// verdict_block_done; [offsets_ready_at] the blocks whose offsets are written) then status, [sb]
// of it (encode from 1 + njobs, decode from decode_status_at).  down, flag, runs: a decode's
// verdict (below).  fin, sizes: encode only.  heads, expect, span: a decode on guessed
// layouts, whose first njobs blocks run guess_head for each blob; the blocks that set a blob's
// errors or check its totals wait for that verdict first (a wrong guess's counts mean nothing).
// Tickets hand the guesses out first, so no block waits on one that has not started.  (The guess
// used to be a kernel of its own too: ~8 us and a graph node before the scan.)
template <int E, int M, typename T, typename Job, bool QT = false>
__global__ void __launch_bounds__(SB_CHUNKS) kvz_scan(const Job* jobs, int njobs, int chunk, int slot,
                                                     const u8* __restrict__ lut, u64* __restrict__ work,
                                                     u64* __restrict__ chunk_off, const FinishJob* __restrict__ fin,
                                                     u64* __restrict__ sizes, const u64* __restrict__ heads,
                                                     const u8* __restrict__ expect, int span, u64* __restrict__ down,
                                                     unsigned int* __restrict__ flag, unsigned int* __restrict__ runs) {
    await_predecessor();
    release_dependents();
    constexpr int HB = E - 4;
    constexpr bool ENC = Job::ENCODE;
    __shared__ long long s_ticket;
    __shared__ u64 s_prefix;
    __shared__ u32 s_eoff[SB_CHUNKS];   // escapes before each chunk, within the block
    __shared__ u32 s_goff[SB_CHUNKS];   // plane-coded groups before it
    __shared__ u16 s_cnt[SB_CHUNKS];
    __shared__ u16 s_redo[SB_CHUNKS];
    __shared__ int s_nredo;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    if (tid == 0) { s_ticket = (long long)atomicAdd(&work[0], 1ull); s_nredo = 0; }
    __syncthreads();
    long long sb = s_ticket;
    if constexpr (ENC) {
        if (sb < njobs) {
            finish_blob(fin[sb], work[1 + sb], HB, sizes + 3 * sb);
            return;
        }
        sb -= njobs;
    } else {
        if (heads != nullptr) {
            if (sb < njobs) {
                guess_head(heads, (int)sb, span, expect, const_cast<Job&>(jobs[sb]), work);
                offsets_block_done(work, njobs);
                if (flag != nullptr) verdict_block_done(work, njobs, down, flag, runs);
                return;
            }
            sb -= njobs;
        }
    }
    const int job = find_job(jobs, njobs, sb, &Job::sb_base);
    const Job& J = jobs[job];
    const long long n = J.n, G = (n + 7) / 8, nchunks = (n + chunk - 1) / chunk;
    const int gpc = chunk / 8;
    const long long lsb = sb - J.sb_base, nsb = (nchunks + SB_CHUNKS - 1) / SB_CHUNKS;
    const long long c = lsb * SB_CHUNKS + tid;
    u64* err = work + 1 + job;
    u32 stored = 0;
    u64 mine = 0;
    bool over = false;  // decode: a count past what a chunk can list (error 1)
    if (c < nchunks) {
        const int ng = (int)min((long long)gpc, G - c * gpc);
        stored = J.esc_count[c];
        if (stored == PLANE) {
            mine = (u64)ng;
        } else {
            if (!ENC && stored > (u32)(HB * ng / 3)) { over = true; stored = 0; }
            mine = (u64)stored << 31;
        }
    }
    u64 agg;
    const u64 excl = block_exclusive_sum(mine, &agg);
    // Encode: the block's escapes leave the slots in rounds of MOVE_BATCH a thread, every load of
    // a round in flight before its stores (which the compiler may not hoist loads above: they
    // could alias).  The first round's loads go out before the look-back, whose wait they overlap.
    // (A load and its dependent store an escape took 52 % of the scan's stall samples, the
    // look-back's barrier 14 %: NOTES v18.)
    const u32 listed = (u32)(agg >> 31);
    const long long c0 = lsb * SB_CHUNKS;
    u16 pos[MOVE_BATCH];
    u8 ex[MOVE_BATCH];
    u32 loaded = 0;
    if constexpr (ENC) {
        s_eoff[tid] = (u32)(excl >> 31);
        s_goff[tid] = (u32)(excl & GROUPS_MASK);
        s_cnt[tid] = (u16)stored;
        if (c < nchunks && (stored == PLANE || stored > (u32)slot)) s_redo[atomicAdd(&s_nredo, 1)] = (u16)tid;
        __syncthreads();
        loaded = load_slot_escapes(tid, listed, s_eoff, s_cnt, slot, c0, J.slot_pos, J.slot_exp, pos, ex);
    }
    if (wid == 0) {
        const u64 p = look_back(work + (ENC ? 1 + njobs : decode_status_at(njobs)) + J.sb_base, lsb, agg, lane);
        if (lane == 0) s_prefix = p;
    }
    const bool any_over = __syncthreads_or(over);
    const u64 prefix = s_prefix;
    if constexpr (!ENC) {
        if (tid == 0 && (any_over || lsb == nsb - 1)) {
            if (heads != nullptr) await_guess(J);
            if (any_over) set_error(err, 1);
            if (lsb == nsb - 1) {
                const u64 tot = prefix + agg;
                const long long n_esc = *reinterpret_cast<const volatile long long*>(&J.n_esc);
                const long long n_high = *reinterpret_cast<const volatile long long*>(&J.n_high);
                if ((long long)(tot >> 31) != n_esc) set_error(err, 2);
                if ((long long)HB * (long long)(tot & GROUPS_MASK) != n_high) set_error(err, 5);
            }
        }
        if (c < nchunks) chunk_off[J.chunk_base + c] = prefix + excl;
        offsets_block_done(work, njobs);
        check_block_escapes<E>(J, n, chunk, lsb * SB_CHUNKS, (u32)(excl >> 31), (u32)(agg >> 31), prefix >> 31,
                               heads != nullptr, err, work + 1 + njobs, s_eoff);
        if (flag != nullptr) verdict_block_done(work, njobs, down, flag, runs);
    } else {
        const u64 totals = work[1 + job];
        u8* __restrict__ exp_out = reinterpret_cast<u8*>(J.esc_pos) + align16(2 * (long long)(totals >> 31));
        u8* __restrict__ high_out = exp_out + align16((long long)(totals >> 31));
        const long long esc_base = (long long)(prefix >> 31);
        // The job's pointers in registers: read through J, every store below could alias them and
        // each escape reloaded three (ncu: 38 % of the scan's stall samples on this loop's stores).
        u16* __restrict__ esc_pos = J.esc_pos;
        assume_global(esc_pos); assume_global(exp_out);
        for (u32 k0 = tid;;) {
#pragma unroll
            for (int u = 0; u < MOVE_BATCH; u++) {
                const long long k = k0 + u * SB_CHUNKS;
                if (loaded >> u & 1) { esc_pos[esc_base + k] = pos[u]; exp_out[esc_base + k] = ex[u]; }
            }
            k0 += MOVE_BATCH * SB_CHUNKS;
            if (k0 >= listed) break;
            loaded = load_slot_escapes(k0, listed, s_eoff, s_cnt, slot, c0, J.slot_pos, J.slot_exp, pos, ex);
        }
        const void* src = J.src;
        const u8* qtable = nullptr;  // QT: redo from the 16-bit input through the table (global: rare path)
        if constexpr (ENC && QT) qtable = J.q_table;
        for (int r = wid; r < s_nredo; r += WARPS) {
            const int i = s_redo[r];
            const long long g0 = (c0 + i) * gpc;
            const int ng = (int)min((long long)gpc, G - g0);
            if (s_cnt[i] == PLANE) {
                u8* high = high_out + (long long)HB * (long long)((prefix & GROUPS_MASK) + s_goff[i]);
                for (int g = lane; g < ng; g += 32)
                    encode_plane<E, M, T>(src, n, g0 + g, J.codes, high + (long long)HB * g, qtable);
                continue;
            }
            // More escapes than a slot holds: collect them again, in order, straight to the output.
            const long long out = esc_base + s_eoff[i];
            int idx0 = 0;
            for (int s = 0; s < ng; s += 32) {
                const int g = s + lane;
                u32 v[8], m = 0;
                if (g < ng) {
                    load_values<T>(src, n, g0 + g, v, qtable);
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        m |= (u32)((g0 + g) * 8 + j < n && (lut[(v[j] >> M) & ((1u << E) - 1u)] & ESC_FLAG)) << j;
                }
                int total;
                int idx = idx0 + warp_exclusive_count(__popc(m), lane, &total);
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if ((m >> j) & 1u) {
                        esc_pos[out + idx] = (u16)(g * 8 + j);
                        exp_out[out + idx] = (u8)((v[j] >> M) & ((1u << E) - 1u));
                        idx++;
                    }
                }
                idx0 += total;
            }
        }
    }
}

// ------------------------------------------------------------------ decode
template <int E, int M>
__device__ __forceinline__ void decode_raw(u32 word, const RestRaw<M + 1>& rr, u64 dlo, u64 dhi, bool plane,
                                          const u8* __restrict__ high_in, u32 v[8]) {
    constexpr int HB = E - 4;
    u32 r[8];
    unpack_rest<M + 1>(rr, r);
    u64 high = 0;
    if (plane) {
#pragma unroll
        for (int k = 0; k < HB; k++) high |= (u64)high_in[k] << (8 * k);
    }
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const u32 c = (word >> (4 * j)) & 0xF;
        u32 e;
        if (plane) e = c | ((u32)((high >> (HB * j)) & ((1u << HB) - 1u)) << 4);
        else e = (u32)((c < 8 ? dlo >> (8 * c) : dhi >> (8 * (c - 8))) & 0xFF);
        v[j] = ((r[j] >> M) << (E + M)) | (e << M) | (r[j] & ((1u << M) - 1u));
    }
}

// Four codes (16 bits) -> their four exponent bytes: byte-permute lookups in the low and high
// halves of the 16-entry codebook (d0..d3), then a third permute picks byte k of hi (selector
// k + 4) where code k has bit 3 set, else byte k of lo: five instructions where a mask built from
// the bits took eleven (the E5M2 decoder was ALU-bound, ncu: ALU pipe 72 %; NOTES v17).
__device__ __forceinline__ u32 lookup4(u32 n4, u32 d0, u32 d1, u32 d2, u32 d3) {
    const u32 sel = n4 & 0x7777u;  // prmt selector bit 3 would mean sign replication: keep 0-7
    const u32 lo = __byte_perm(d0, d1, sel), hi = __byte_perm(d2, d3, sel);
    return __byte_perm(lo, hi, 0x3210u | ((n4 >> 1) & 0x4444u));
}

// BF16, a whole group, non-plane, SIMD-within-a-register: out[k] holds values 2k and 2k+1 as
// stored.  The generic decode (unpack to 8 values, repack) spent ~130 instructions a group and
// was compute-bound on the H200 (ncu: 69-77 % SM, 47 % DRAM); this one ~45.
__device__ __forceinline__ void decode_bf16_words(u32 word, const RestRaw<8>& rr, u32 d0, u32 d1, u32 d2, u32 d3,
                                                  u32 out[4]) {
    const u32 ea = lookup4(word & 0xFFFFu, d0, d1, d2, d3), eb = lookup4(word >> 16, d0, d1, d2, d3);
    const u32 rlo = (u32)rr.q[0], rhi = (u32)(rr.q[0] >> 32);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const u32 sel = (k & 1) ? 0x4342u : 0x4140u;  // bytes 2k, 2k+1 of the group into 16-bit lanes
        const u32 r = __byte_perm(k < 2 ? rlo : rhi, 0, sel);
        const u32 e = __byte_perm(k < 2 ? ea : eb, 0, sel);
        out[k] = ((r & 0x00800080u) << 8) | (r & 0x007F007Fu) | (e << 7);
    }
}

// The rest fields of four E5M2 values (3 bits each at bits 0-11 of x; higher bits ignored) spread
// to their places in the stored bytes: mantissas to bits 8k..8k+1 by two products (the even and
// the odd values' fields; their partial products land on bits of their own, so they add without
// carries), signs to bit 8k + 7 by one (tests/test_kernel_identities.py: all 4096 fields).  It
// replaced ten shifts and masks (NOTES v17).
__device__ __forceinline__ u32 e5m2_spread_rest(u32 x) {
    const u32 mm = (x & 0x0C3u) * 0x401u + (x & 0x618u) * 0x8020u;
    const u32 s = (x & 0x924u) * 0x108420u;
    return (mm & 0x03030303u) | (s & 0x80808080u);
}

// E5M2, a whole group, non-plane, SIMD-within-a-register: out[h] holds values 4h..4h+3 as stored
// (byte = sign << 7 | exponent << 2 | mantissa; rest = sign << 2 | mantissa, 3 bits a value).
// The generic path spent ~130 instructions a group (ncu: 333 us for 2^28 values).
// d0..d3: the codebook's exponents shifted left by 2, in place in the stored byte (E5M2 exponents
// are below 64, so a shift of the table keeps its bytes apart).
__device__ __forceinline__ void decode_e5m2_words(u32 word, u32 rest24, u32 d0, u32 d1, u32 d2, u32 d3, u32 out[2]) {
    out[0] = e5m2_spread_rest(rest24) | lookup4(word & 0xFFFFu, d0, d1, d2, d3);
    out[1] = e5m2_spread_rest(rest24 >> 12) | lookup4(word >> 16, d0, d1, d2, d3);
}

// Replace the exponents of the escaped values (pmask bit j; exponent byte j of pexp) in a group
// stored as packed words: VPW values a word, each value's exponent (EMASK) at bit ESHIFT of it.
// BF16: 2 values a word, exponent at bit 7; E5M2: 4 a word, at bit 2.
template <int VPW, int ESHIFT, u32 EMASK>
__device__ __forceinline__ void patch_words(u32 w[8 / VPW], u32 pmask, u64 pexp) {
#pragma unroll
    for (int j = 0; j < 8; j++) {
        if ((pmask >> j) & 1u) {
            const int sh = (32 / VPW) * (j % VPW) + ESHIFT;
            w[j / VPW] = (w[j / VPW] & ~(EMASK << sh)) | ((u32)((pexp >> (8 * j)) & EMASK) << sh);
        }
    }
}

// Value v's bits with its exponent field replaced by e (an escape's exponent).
template <int E, int M>
__device__ __forceinline__ u32 with_exponent(u32 v, u32 e) { return (v & ~(((1u << E) - 1u) << M)) | (e << M); }

// Apply this lane's escapes (pmask bit j set: value j's exponent is byte j of pexp), then store
// (DQ: FP8 codes turned into 16-bit values through table first).
template <int E, int M, typename T, bool DQ>
__device__ __forceinline__ void patch_store(void* __restrict__ dst, long long n, long long g, u32 v[8], u32 pmask,
                                            u64 pexp, const u16* __restrict__ table) {
    if (pmask) {
#pragma unroll
        for (int j = 0; j < 8; j++)
            if ((pmask >> j) & 1u) v[j] = with_exponent<E, M>(v[j], (u32)((pexp >> (8 * j)) & 0xFF));
    }
    if constexpr (DQ) {
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = __ldg(table + (v[j] & 0xFFu));
        store_group(static_cast<u16*>(dst), n, g, v);
    } else {
        store_group(static_cast<T*>(dst), n, g, v);
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

// A chunk's escapes, 32 at a time in registers: lane k holds escape base + k (position within the
// chunk, or NONE past the end, and its exponent).  Checked as they are loaded: positions inside
// the chunk and strictly increasing, exponents in range.
#define NONE 0x7FFFFFFF
template <int E>
__device__ __forceinline__ bool load_escapes(const DecodeJob& J, long long off, int base, int cnt, int len, int before,
                                             int lane, int& pos, u32& exp, u64* err) {
    const int k = base + lane;
    pos = NONE;
    exp = 0;
    if (k < cnt) { pos = J.esc_pos[off + k]; exp = J.esc_exp[off + k]; }
    int prev = __shfl_up_sync(FULL_MASK, pos, 1);
    if (lane == 0) prev = before;
    const u32 bad_pos = __ballot_sync(FULL_MASK, k < cnt && (pos >= len || pos <= prev));
    const u32 bad_exp = __ballot_sync(FULL_MASK, k < cnt && exp >= (1u << E));
    if (bad_pos | bad_exp) {
        const u32 first = __ffs(bad_pos | bad_exp) - 1;
        if (lane == 0) set_error(err, (bad_pos >> first) & 1u ? 3 : 4);
        pos = NONE;
        return false;
    }
    return true;
}

// kvz_decode: apply(position, exponent), in every lane and in position order, for each of the
// chunk's escapes at a position in [lo, hi).  The lanes hold 32 escapes (lane k: escape base + k
// in pos and exp); while the last of them lies below hi the next 32 are loaded.  Broken escapes
// (load_escapes sets *err) drop the chunk's rest: cnt = 0.
template <int E, typename Apply>
__device__ __forceinline__ void each_escape(const DecodeJob& J, long long esc_off, int lo, int hi, int len, int lane,
                                            int& base, int& cnt, int& pos, u32& exp, u64* err, Apply apply) {
    while (true) {
        u32 hit = __ballot_sync(FULL_MASK, pos >= lo && pos < hi);
        while (hit) {
            const int l = __ffs(hit) - 1;
            hit &= hit - 1;
            apply(__shfl_sync(FULL_MASK, pos, l), __shfl_sync(FULL_MASK, exp, l));
        }
        const int last = __shfl_sync(FULL_MASK, pos, 31);
        if (last >= hi || base + 32 >= cnt) return;
        base += 32;
        if (!load_escapes<E>(J, esc_off, base, cnt, len, last, lane, pos, exp, err)) { cnt = 0; return; }
    }
}

// E5M2, a whole non-plane chunk of nq quads, a lane per quad (4 consecutive groups, 32 values) and
// QPL quads a lane a step: one 16-byte codes load, the quad's 12 rest bytes as three aligned words
// and two 16-byte stores, where a lane per group took four loads, its address arithmetic and a
// store a group.  The step's values are decoded into registers first; its escapes (the chunk's,
// 32 at a time in lanes: pos, exp) then patch them there, the owning lane changing one word; then
// the stores.  ncu, 2^28 real E5M2: kvz_decode 180 -> 169 us (NOTES v19).  Not for DQ: four
// 16-byte stores a lane 64 bytes apart took the dequantizing decoder from 249 to 427 us; nor in
// the encoder, where the mirror (two 16-byte loads, the rest words through shared memory) was
// slower than store_rest24_warp's groups (170-176 -> 179-180 us; 186 storing the words direct).
template <int QPL>
__device__ __forceinline__ void decode_e5m2_quads(const DecodeJob& J, const u8* __restrict__ codes,
                                                  const u8* __restrict__ rest, void* __restrict__ dst, int nq,
                                                  long long esc_off, int cnt, int len, u32 d0, u32 d1, u32 d2, u32 d3,
                                                  int lane, u64* err) {
    constexpr int QSTEP = 32 * QPL;
    int base = 0, pos = NONE;
    u32 exp = 0;
    for (int s0 = 0; s0 < nq; s0 += QSTEP) {
        uint4 cw[QPL];
        u32 rw[QPL][3];
#pragma unroll
        for (int q = 0; q < QPL; q++) {
            const int i = s0 + q * 32 + lane;
            cw[q] = make_uint4(0u, 0u, 0u, 0u);
            rw[q][0] = rw[q][1] = rw[q][2] = 0u;
            if (i < nq) {
                cw[q] = reinterpret_cast<const uint4*>(codes)[i];
                const u32* r = reinterpret_cast<const u32*>(rest) + 3 * i;
                rw[q][0] = r[0]; rw[q][1] = r[1]; rw[q][2] = r[2];
            }
        }
        if (s0 == 0 && cnt > 0 && !load_escapes<5>(J, esc_off, 0, cnt, len, -1, lane, pos, exp, err)) cnt = 0;
        u32 out[QPL][8];
#pragma unroll
        for (int q = 0; q < QPL; q++) {
            // group g's 24 rest bits start at bit 24g of the three words (decode_e5m2_words reads
            // bits 0-23 of what it is given)
            const u32 r24[4] = {rw[q][0], __funnelshift_r(rw[q][0], rw[q][1], 24), __funnelshift_r(rw[q][1], rw[q][2], 16),
                                rw[q][2] >> 8};
            const u32 c4[4] = {cw[q].x, cw[q].y, cw[q].z, cw[q].w};
#pragma unroll
            for (int g = 0; g < 4; g++) decode_e5m2_words(c4[g], r24[g], d0, d1, d2, d3, &out[q][2 * g]);
        }
        // This step's escapes patch the owning lane's word.
        each_escape<5>(J, esc_off, s0 * 32, (s0 + QSTEP) * 32, len, lane, base, cnt, pos, exp, err, [&](int p, u32 e) {
            const int rel = (p >> 5) - s0, word = (p & 31) >> 2, sh = 8 * (p & 3) + 2;
#pragma unroll
            for (int q = 0; q < QPL; q++) {
                if (rel == q * 32 + lane) {
#pragma unroll
                    for (int k = 0; k < 8; k++)
                        if (word == k) out[q][k] = (out[q][k] & ~(0x1Fu << sh)) | (e << sh);
                }
            }
        });
#pragma unroll
        for (int q = 0; q < QPL; q++) {
            const int i = s0 + q * 32 + lane;
            if (i >= nq) continue;
            uint4* o = reinterpret_cast<uint4*>(static_cast<u8*>(dst) + i * 32);
            o[0] = make_uint4(out[q][0], out[q][1], out[q][2], out[q][3]);
            o[1] = make_uint4(out[q][4], out[q][5], out[q][6], out[q][7]);
        }
    }
}

// kvz_decode's wait for the scan's offsets (offsets_block_done; with KVZ_OFFSETS_WAIT=0 for the
// scan's end).  The first warp of a block to arrive polls the scan's count; the block's other
// warps watch its word in shared memory (a poller a warp put 2000 and more loads on one L2 line).
// Acquire loads, by lane 0 before the warp's barrier, put the warp's later reads after the scan
// blocks' writes.  s_offsets: 0 nobody polls, 1 a warp polls, 2 ready (zeroed as kvz_decode starts);
// read and written by atomics with acquire and release (plain ld.acquire / st.release were right
// too, but compute-sanitizer's racecheck reports them as shared-memory races).
struct OffsetsWait {
    const u64* count;  // work[offsets_ready_at(njobs)]
    long long blocks;  // the scan's blocks
};
__shared__ u32 s_offsets;
__device__ __forceinline__ void await_offsets(OffsetsWait w) {
#if KVZ_OFFSETS_WAIT
    if ((threadIdx.x & 31) == 0) {
        const u32 at = (u32)__cvta_generic_to_shared(&s_offsets);
        for (;;) {
            u32 state;
            asm volatile("atom.acquire.cta.shared::cta.or.b32 %0, [%1], 0;" : "=r"(state) : "r"(at) : "memory");
            if (state == 2) break;
            if (state == 0 && atomicCAS(&s_offsets, 0u, 1u) == 0u) {
                for (;;) {
                    u64 done;
                    asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(done) : "l"(w.count) : "memory");
                    if ((long long)done >= w.blocks) break;
                    __nanosleep(KVZ_POLL_NS);
                }
                u32 was;
                asm volatile("atom.release.cta.shared::cta.exch.b32 %0, [%1], 2;" : "=r"(was) : "r"(at) : "memory");
                break;
            }
            __nanosleep(32);
        }
    }
    __syncwarp();
#else
    await_predecessor();
#endif
}

// kvz_decode's early chunk gc of tensor job (below), its dense decode stored: wait for kvz_scan's
// offsets (await_offsets), then, unless it found the tensor broken, write each escape's exponent
// over its value (stored with code 0's); a lane per escape, 32 at a time, checked as load_escapes
// checks them.
template <int E, int M, typename T>
__device__ __forceinline__ void finish_early_chunk(const DecodeJob* __restrict__ jobs, int job, long long gc, int chunk,
                                                   const u64* __restrict__ chunk_off, u64* __restrict__ work, int lane,
                                                   OffsetsWait ow) {
    await_offsets(ow);
    const DecodeJob& J = jobs[job];
    u64* err = work + 1 + job;
    if (*reinterpret_cast<volatile u64*>(err) != 0) return;
    const long long c = gc - J.chunk_base;
    const int cnt = J.esc_count[c], len = (int)min((long long)chunk, J.n - c * chunk);
    const long long esc_off = (long long)(chunk_off[gc] >> 31);
    T* __restrict__ dst = static_cast<T*>(J.dst) + c * chunk;
    __syncwarp();  // every lane's stores of the chunk come before any lane rewrites a value
    int before = -1;
    for (int base = 0; base < cnt; base += 32) {
        int pos;
        u32 exp;
        if (!load_escapes<E>(J, esc_off, base, cnt, len, before, lane, pos, exp, err)) return;
        if (pos != NONE) dst[pos] = (T)with_exponent<E, M>(dst[pos], exp);
        before = __shfl_sync(FULL_MASK, pos, 31);
    }
}

// kvz_decode's work on chunk gc (a batch-wide index) of tensor job, whose row is J: all its groups,
// or with part (kvz_decode's tail) a share of its steps.  EARLY:
// the warp's first chunk, which it may reach before kvz_scan is done (not for DQ, whose values
// cannot be patched after the table).
template <int E, int M, typename T, int GPL, bool DQ, bool EARLY>
__device__ __forceinline__ void decode_chunk(const DecodeJob& J, const DecodeJob* __restrict__ jobs, int job,
                                             long long gc, int chunk, const u64* __restrict__ chunk_off,
                                             u64* __restrict__ work, int lane, OffsetsWait ow = OffsetsWait{nullptr, 0},
                                             int part = 0) {
    constexpr int HB = E - 4, R = M + 1, STEP = 32 * GPL;
    constexpr bool BF16 = E == 8 && M == 7 && sizeof(T) == 2;
    constexpr bool E5M2 = E == 5 && M == 2 && sizeof(T) == 1;
    static_assert(!(DQ && EARLY), "a dequantized value cannot be patched");
    const int gpc = chunk / 8;
    u64* err = work + 1 + job;
    const long long c = gc - J.chunk_base, g0 = c * gpc;
    const long long n = J.n - g0 * 8;  // values from the chunk's start to the tensor's end
    int ng = (int)min((long long)gpc, (n + 7) / 8);  // the chunk's groups (a part's: its end, below)
    const u32 stored = J.esc_count[c];
    const bool plane = stored == PLANE;
    const bool early = EARLY && !plane;  // a plane-coded chunk needs its offset first
    if (EARLY && plane) await_offsets(ow);
    u64 off = 0;
    if (!early) {
        off = chunk_off[gc];
        if (*reinterpret_cast<volatile u64*>(err) != 0) return;  // kvz_scan found this tensor broken
    }
    int cnt = plane || early ? 0 : (int)stored;
    const long long esc_off = (long long)(off >> 31);
    // (EARLY: J is the row as read before the wait, which a header guess may have changed since;
    // plane-coded chunks read exp_high after it)
    const u8* __restrict__ high = early ? nullptr
        : (EARLY ? jobs[job].exp_high : J.exp_high) + (long long)HB * (long long)(off & GROUPS_MASK);
    const int len = (int)min((long long)chunk, n);
    // part p of 2^shift (part = p << 8 | shift; 0: the whole chunk): its share of whole steps,
    // groups [g_begin, ng).  (No register more in the step loop: one there spilled BF16's claim.)
    int g_begin = 0;
    if (part) {
        const int shift = part & 0xFF, p = part >> 8, steps = (ng + STEP - 1) / STEP;
        g_begin = ((p * steps) >> shift) * STEP;
        ng = min(ng, (((p + 1) * steps) >> shift) * STEP);
    }
    int base = 0, pos = NONE;
    u32 exp = 0;
    // this chunk's data, and group i of it at index i
    const u8* __restrict__ codes = J.codes + g0 * 4;
    const u8* __restrict__ rest = J.rest + g0 * R;
    using Out = typename Pick<DQ, u16, T>::type;
    Out* __restrict__ dst = static_cast<Out*>(J.dst) + g0 * 8;
    if constexpr (sizeof(T) == 1) {  // E5M2 decode 189 -> 184 us with global loads and stores; BF16 spilled
        assume_global(codes); assume_global(rest); assume_global(dst);
    }
    // FP8 and float16: the chunk's codes and rest into L2 as it starts, so the steps' loads find
    // their lines there or on their way.  ncu put the E5M2 decoder at 59 % of DRAM bandwidth with
    // 64 % of its stall samples waiting on loads (24 warps a multiprocessor, a quarter of a chunk
    // in flight each).  2^28 graphs: E5M2 decode 178.8-179.9 -> 168.2-170.9 us, the dequantizing
    // decoder 276.4-277.3 -> 267.7-268.8, float16 418.1-418.4 -> 400.4-400.7; but BF16's
    // 257.9-258.3 -> 268.2-268.6 and float32's 544.4-547.6 -> 673.8-676.8, so not theirs
    // (benchmarks/macro_ab.py, NOTES v24).  KVZ_DECODE_PREFETCH=0: off.
#ifndef KVZ_DECODE_PREFETCH
#define KVZ_DECODE_PREFETCH 1
#endif
    if constexpr (KVZ_DECODE_PREFETCH && (sizeof(T) == 1 || (sizeof(T) == 2 && !BF16))) {
        prefetch_l2(codes, 4ll * ng, lane);
        prefetch_l2(rest, (long long)R * ng, lane);
    }
    const u16* __restrict__ table = J.dq_table;
    const u64 dlo = J.dlo, dhi = J.dhi;
    if constexpr (E5M2 && !DQ) {  // whole chunks a lane per quad, GPL / 2 quads a step (as many registers)
        if (!plane && n >= chunk && (chunk & 31) == 0 && part == 0) {
            decode_e5m2_quads<GPL >= 2 ? GPL / 2 : 1>(J, codes, rest, dst, gpc / 4, esc_off, cnt, len, (u32)(dlo << 2),
                                                      (u32)(dlo >> 30), (u32)(dhi << 2), (u32)(dhi >> 30), lane, err);
            if (early) finish_early_chunk<E, M, T>(jobs, job, gc, chunk, chunk_off, work, lane, ow);
            return;
        }
    }
    // a later part's first escapes before its loop (a whole chunk's once its first loads are out)
    if (g_begin > 0 && cnt > 0 && !load_escapes<E>(J, esc_off, 0, cnt, len, -1, lane, pos, exp, err)) cnt = 0;
    for (int s0 = g_begin; s0 < ng; s0 += STEP) {
        u32 w[GPL];
        RestRaw<R> rr[GPL];
#pragma unroll
        for (int q = 0; q < GPL; q++) {
            const int i = s0 + q * 32 + lane;
            // FP16: 32 whole groups read whole words (word-aligned: the stream is, and a chunk
            // of 32 groups or more is a power of two of them, so the warp's start is too)
            if constexpr (R == 11) {
                if (s0 + q * 32 + 32 <= ng) {
                    w[q] = reinterpret_cast<const u32*>(codes)[i];
                    load_rest11_warp(rest + (s0 + q * 32) * 11, lane, &rr[q].q[0], &rr[q].q[1]);
                    continue;
                }
            }
            if (i < ng) { w[q] = reinterpret_cast<const u32*>(codes)[i]; load_rest_raw<R>(rest, i, rr[q]); }
        }
        // The chunk's first 32 escapes, loaded once its first step's loads are in flight (their
        // address waits on chunk_off; ncu, 2^28: E5M2 243 -> 237 us, BF16 the same, NOTES v15).
        if (s0 == 0 && cnt > 0 && !load_escapes<E>(J, esc_off, 0, cnt, len, -1, lane, pos, exp, err)) cnt = 0;
        // This step's escapes: the lanes holding positions below the step's end (earlier ones
        // were used by earlier steps).  Warp-uniform loop, a shuffle per escape.
        u32 pm[GPL];
        u64 pe[GPL];
#pragma unroll
        for (int q = 0; q < GPL; q++) { pm[q] = 0; pe[q] = 0; }
        each_escape<E>(J, esc_off, s0 * 8, (s0 + STEP) * 8, len, lane, base, cnt, pos, exp, err, [&](int p, u32 e) {
            const int rel = (p >> 3) - s0, j = p & 7;  // group within the step, value within it
#pragma unroll
            for (int q = 0; q < GPL; q++)
                if (rel == q * 32 + lane) { pm[q] |= 1u << j; pe[q] |= (u64)e << (8 * j); }
        });
#pragma unroll
        for (int q = 0; q < GPL; q++) {
            const int i = s0 + q * 32 + lane;
            if (i >= ng) continue;
            if constexpr (BF16) {
                if (!plane && i * 8 + 8 <= n) {
                    u32 out[4];
                    decode_bf16_words(w[q], rr[q], (u32)dlo, (u32)(dlo >> 32), (u32)dhi, (u32)(dhi >> 32), out);
                    if (pm[q]) patch_words<2, 7, 0xFFu>(out, pm[q], pe[q]);
                    *reinterpret_cast<uint4*>(dst + i * 8) = make_uint4(out[0], out[1], out[2], out[3]);
                    continue;
                }
            }
            if constexpr (E5M2) {
                if (!plane && i * 8 + 8 <= n) {
                    u32 out[2];
                    decode_e5m2_words(w[q], (u32)rr[q].q[0], (u32)(dlo << 2), (u32)(dlo >> 30), (u32)(dhi << 2),
                                      (u32)(dhi >> 30), out);
                    if (pm[q]) patch_words<4, 2, 0x1Fu>(out, pm[q], pe[q]);
                    if constexpr (DQ) store_dequantized(dst + i * 8, out, table);
                    else *reinterpret_cast<uint2*>(dst + i * 8) = make_uint2(out[0], out[1]);
                    continue;
                }
            }
            u32 v[8];
            decode_raw<E, M>(w[q], rr[q], dlo, dhi, plane, high + HB * i, v);
            patch_store<E, M, T, DQ>(dst, n, i, v, pm[q], pe[q], table);
        }
    }
    if (early) finish_early_chunk<E, M, T>(jobs, job, gc, chunk, chunk_off, work, lane, ow);
}

// A warp's first chunk, gc, before kvz_scan is known to be done.  The job table is read past L1
// (ld.global.cg: its rows were written by the upload, complete before any scan block released
// this grid), so no line of it sits in this multiprocessor's L1 when the scan's header guesses
// write their fields of it: the loads after the wait (await_offsets) then see them.  (Volatile loads,
// one at a time, made every warp's start ~10 us later.)  A call, not inlined: a second inlined
// copy of the chunk's code cost the decoders' loop spills (BF16 0 -> 28 bytes, E5M2 16 -> 68).
template <int E, int M, typename T, int GPL>
__device__ __noinline__ void decode_early_chunk(const DecodeJob* __restrict__ jobs, int njobs, long long gc, int chunk,
                                                const u64* __restrict__ chunk_off, u64* __restrict__ work, int lane,
                                                OffsetsWait ow) {
    const int job = find_job<true>(jobs, njobs, gc, &DecodeJob::chunk_base);
    union { uint4 words[sizeof(DecodeJob) / 16]; DecodeJob row; } J;
    const uint4* src = reinterpret_cast<const uint4*>(jobs + job);
#pragma unroll
    for (int k = 0; k < (int)(sizeof(DecodeJob) / 16); k++) J.words[k] = __ldcg(src + k);
    decode_chunk<E, M, T, GPL, false, true>(J.row, jobs, job, gc, chunk, chunk_off, work, lane, ow);
}

// Dense pass, the mirror of kvz_encode: chunks from a queue, a warp walking its chunk in
// steps of 32 * GPL groups, escapes applied in registers before one store per group.  Offsets
// come from kvz_scan (chunk_off); a tensor it found broken is skipped.  DQ (FP8 only): write each
// value as J.dq_table maps it, QuantizeFP8's decode fused into the store (the codes never go to
// memory: 2 bytes a value less traffic than decoding and then dequantizing).
// Early chunk: launched as the scan's programmatic dependent, the kernel starts while the scan
// still runs, and each warp decodes its first chunk (listed, not DQ) before it waits for the
// scan's offsets (decode_chunk<..., EARLY>): no escapes applied, the values stored, then the wait,
// the scan's verdict on the tensor and the escapes patched in memory (finish_early_chunk).  The
// later chunks go through decode_chunk<..., false>, with no wait in the loop (one there cost
// every decoder spills).  scan_blocks: the scan's grid (the count await_offsets waits for).
// The tail: the queue's last units are parts of chunks, so the kernel's last round, where warps
// that found the queue empty idle while the others finish, lasts a part's time, not a chunk's:
// chunks from split_at on are dealt as 2^part_shift parts each (unit split_at + (c - split_at) *
// 2^part_shift + p: part p of chunk c, its share of whole steps).  Each part reads the chunk's
// escapes from its first and skips those before its steps (each_escape), as whole chunks do
// step by step.  split_at >= the grid's warps (the early chunks are whole).  (The part's state
// fits the BF16 decoder's 80 registers only since the claim holds one: NOTES v27.)
// Each thread ends with griddepcontrol.wait (the scan long done by then), so the kernel's end
// still implies the scan's for what follows it in the stream.
template <int E, int M, typename T, int GPL, int MINB, bool DQ = false>
__global__ void __launch_bounds__(WARPS * 32, MINB) kvz_decode(const DecodeJob* __restrict__ jobs, int njobs,
                                                                long long units, int chunk,
                                                                const u64* __restrict__ chunk_off, u64* __restrict__ work,
                                                                long long queue_at, long long scan_blocks,
                                                                long long split_at, int part_shift) {
    release_dependents();
    if (KVZ_OFFSETS_WAIT) {
        if (threadIdx.x == 0) s_offsets = 0;
        __syncthreads();
    }
    const OffsetsWait ow{work + offsets_ready_at(njobs), scan_blocks};
    const int lane = threadIdx.x & 31;
    u32 next = 0;
    long long gc = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (!DQ && gc < units) {
        next = claim_chunk(work + queue_at, lane);  // from the queue, a chunk a claim
        decode_early_chunk<E, M, T, GPL>(jobs, njobs, gc, chunk, chunk_off, work, lane, ow);
        gc = next_chunk(next);
    }
    await_offsets(ow);  // returns at once where the first chunk waited already
    for (long long u = gc; u < units; u = next_chunk(next)) {
        next = claim_chunk(work + queue_at, lane);
        int part = 0;
        gc = u;
        if (u >= split_at) {
            const long long r = u - split_at;
            gc = split_at + (r >> part_shift);
            part = (int)(r & ((1 << part_shift) - 1)) << 8 | part_shift;
        }
        const int job = find_job(jobs, njobs, gc, &DecodeJob::chunk_base);
        decode_chunk<E, M, T, GPL, DQ, false>(jobs[job], jobs, job, gc, chunk, chunk_off, work, lane, ow, part);
    }
    await_predecessor();
}
