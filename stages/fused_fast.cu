// kvzip fast GPU path: fused ExponentSplit + Top16Pack + EscapeStream, encode and decode.
//
// Why CUDA C++ and not Numba: Numba-CUDA has no 128-bit loads or stores.  On this workplace's
// H200 a Numba dense pack with 64-bit loads reached 1671 GB/s encode / 1526 GB/s decode, a CUDA C
// one with 128-bit loads 2071 GB/s (shared/DESIGN.md), and our first Numba fused kernels
// (stages/fused.py, one thread per group, a thread per chunk for escapes) 58 GB/s
// (benchmarks/NOTES.md).  The Numba kernels remain the generic path and, with the @njit twin,
// the reference this file is tested against byte for byte (tests/gpu).
//
// Work split: one warp owns one chunk (claimed from an atomic tile counter, so every chunk it
// waits on belongs to a warp that is already running).  Per step each lane owns one 8-value
// group: it loads the group with vector loads, writes 4 code bytes and R rest bytes in place in
// the blob, and notes its escapes.  A warp-wide prefix sum keeps escapes in position order.  At
// the end of the chunk a decoupled look-back over the chunks before it gives the chunk's offset
// in the escape streams, so escapes go straight to their final place: one pass over the input,
// no compaction kernel.  Chunks with too many escapes for the shared buffer or for an escape list
// (plane-coded) re-read their own input; that only happens on escape-heavy data.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define FULL_MASK 0xffffffffu
#define WARPS 8            // warps per block
#define SBUF 128           // escapes a warp buffers in shared memory per chunk
#define PLANE 0xFFFFu
#define ESCAPE 255u
#define FLAG_SHIFT 62
#define VALUE_MASK ((1ull << FLAG_SHIFT) - 1)
#define GROUPS_MASK 0x7FFFFFFFull  // status value = escapes << 31 | plane-coded groups

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

template <typename T>
__device__ __forceinline__ void load_raw(const T* __restrict__ src, long long n, long long g, Raw<T>& r) {
    const long long i0 = g * 8;
    if (i0 + 8 <= n) {
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

template <typename T>
__device__ __forceinline__ u32 raw_value(const Raw<T>& r, int j) {
    if constexpr (sizeof(T) == 1) return (r.w[j >> 2] >> (8 * (j & 3))) & 0xFF;
    else if constexpr (sizeof(T) == 2) return (r.w[j >> 1] >> (16 * (j & 1))) & 0xFFFF;
    else return r.w[j];
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
        u64 lo = 0, hi = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int b = j * R;
            if (b < 64) { lo |= (u64)r[j] << b; if (b + R > 64) hi |= (u64)r[j] >> (64 - b); }
            else hi |= (u64)r[j] << (b - 64);
        }
#pragma unroll
        for (int k = 0; k < R; k++) p[k] = (u8)(k < 8 ? lo >> (8 * k) : hi >> (8 * (k - 8)));
    }
}

template <int R>
__device__ __forceinline__ void load_rest(const u8* __restrict__ rest, long long g, u32 r[8]) {
    const u8* p = rest + g * R;
    constexpr u32 MASK = (R == 32) ? 0xFFFFFFFFu : ((1u << R) - 1u);
    u64 lo = 0, hi = 0;
    if constexpr (R == 24) {
        const u64 w0 = reinterpret_cast<const u64*>(p)[0], w1 = reinterpret_cast<const u64*>(p)[1],
                  w2 = reinterpret_cast<const u64*>(p)[2];
        r[0] = w0 & MASK; r[1] = (w0 >> 24) & MASK; r[2] = ((w0 >> 48) | (w1 << 16)) & MASK;
        r[3] = (w1 >> 8) & MASK; r[4] = (w1 >> 32) & MASK; r[5] = ((w1 >> 56) | (w2 << 8)) & MASK;
        r[6] = (w2 >> 16) & MASK; r[7] = (w2 >> 40) & MASK;
    } else {
        if constexpr (R == 8) {
            lo = *reinterpret_cast<const u64*>(p);
        } else if constexpr (R == 4) {
            lo = *reinterpret_cast<const u32*>(p);
        } else {
#pragma unroll
            for (int k = 0; k < R; k++) { if (k < 8) lo |= (u64)p[k] << (8 * k); else hi |= (u64)p[k] << (8 * (k - 8)); }
        }
#pragma unroll
        for (int j = 0; j < 8; j++) {
            const int b = j * R;
            const u64 x = (b < 64) ? (lo >> b) | ((b > 0 && b + R > 64) ? hi << (64 - b) : 0ull) : hi >> (b - 64);
            r[j] = (u32)x & MASK;
        }
    }
}

// A group's packed rest bytes as loaded (R bytes), for prefetching in the decoder.
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

__device__ __forceinline__ int warp_inclusive_sum(int x, int lane) {
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int y = __shfl_up_sync(FULL_MASK, x, d);
        if (lane >= d) x += y;
    }
    return x;
}

// ------------------------------------------------------------------ encode
// The device LUT maps an exponent to its code (0..15) or to ESC_FLAG for "not in the codebook", so a
// code is (c & 0xF) and the escape bit (c >> 7): no compare or select per value.
#define ESC_FLAG 0x80u

// BF16, a whole group: SIMD-within-a-register on the four 32-bit words (two values each).  The
// generic path below spends ~200 instructions a group, which made the first version of this kernel
// issue-bound at ~800 GB/s on the H200 (ncu: 25-30 % of DRAM bandwidth); this one ~70.
__device__ __forceinline__ u32 encode_bf16_full(const Raw<u16>& raw, long long g, const u8* slut,
                                                u8* __restrict__ codes, u8* __restrict__ rest) {
    u32 word = 0, mask = 0, r[4];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const u32 w = raw.w[k];
        // rest byte = sign << 7 | mantissa, for the value in each 16-bit half
        r[k] = (w & 0x007F007Fu) | ((w >> 8) & 0x00800080u);
        const u32 c0 = slut[(w >> 7) & 0xFF], c1 = slut[(w >> 23) & 0xFF];
        word |= ((c0 & 0xF) << (8 * k)) | ((c1 & 0xF) << (8 * k + 4));
        mask |= ((c0 >> 7) << (2 * k)) | ((c1 >> 7) << (2 * k + 1));
    }
    reinterpret_cast<u32*>(codes)[g] = word;
    *reinterpret_cast<uint2*>(rest + g * 8) = make_uint2(__byte_perm(r[0], r[1], 0x6420), __byte_perm(r[2], r[3], 0x6420));
    return mask;
}

// E5M2, a whole group: two words of four values.  Rest is 3 bits a value, 24 bits a group.
__device__ __forceinline__ u32 encode_e5m2_full(const Raw<u8>& raw, long long g, const u8* slut,
                                                u8* __restrict__ codes, u8* __restrict__ rest) {
    u32 word = 0, mask = 0, bits = 0;
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const u32 w = raw.w[k];
        const u32 rb = ((w >> 5) & 0x04040404u) | (w & 0x03030303u);  // sign << 2 | mantissa, per byte
        bits |= ((rb & 7) | ((rb >> 5) & 0x38) | ((rb >> 10) & 0x1C0) | ((rb >> 15) & 0xE00)) << (12 * k);
#pragma unroll
        for (int b = 0; b < 4; b++) {
            const u32 c = slut[(w >> (8 * b + 2)) & 0x1F];
            word |= (c & 0xF) << (4 * (4 * k + b));
            mask |= (c >> 7) << (4 * k + b);
        }
    }
    reinterpret_cast<u32*>(codes)[g] = word;
    u8* p = rest + g * 3;
    p[0] = (u8)bits; p[1] = (u8)(bits >> 8); p[2] = (u8)(bits >> 16);
    return mask;
}

template <int E, int M, typename T>
__device__ __forceinline__ u32 encode_raw(const Raw<T>& raw, long long n, long long g, const u8* slut,
                                          u8* __restrict__ codes, u8* __restrict__ rest) {
    constexpr int R = M + 1;
    if constexpr (E == 8 && M == 7 && sizeof(T) == 2) {
        if (g * 8 + 8 <= n) return encode_bf16_full(raw, g, slut, codes, rest);
    }
    if constexpr (E == 5 && M == 2 && sizeof(T) == 1) {
        if (g * 8 + 8 <= n) return encode_e5m2_full(raw, g, slut, codes, rest);
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
__device__ __forceinline__ void encode_plane(const T* __restrict__ src, long long n, long long g, u8* __restrict__ codes,
                                             u8* __restrict__ high_out) {
    constexpr int HB = E - 4;
    u32 v[8];
    load_group(src, n, g, v);
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

// One tensor of a batch.  All fields are 8 bytes wide: the host fills a uint64 array (ntensors, 9).
struct EncodeJob {
    const void* src;        // the values' bits
    long long n;            // value count
    u8* codes;              // output streams, in place in the blob
    u8* rest;
    u16* esc_count;
    u16* esc_pos;
    u8* exp_scratch;        // esc_exp and exp_high go here first (their offsets depend on the total)
    u8* high_scratch;
    long long chunk_base;   // this tensor's first chunk in the batch-wide chunk numbering
};

// The tensor that batch-wide chunk gc belongs to: the last job whose chunk_base <= gc (jobs are in
// chunk order; empty tensors share their successor's base and are skipped this way).
template <typename Job>
__device__ __forceinline__ int find_job(const Job* jobs, int njobs, long long gc) {
    int lo = 0, hi = njobs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (jobs[mid].chunk_base <= gc) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// work: [0] tile counter, [1 + t] tensor t's totals (escapes << 31 | plane groups),
// [1 + njobs + gc] chunk status.  Zeroed by the caller.
template <int E, int M, typename T>
__global__ void __launch_bounds__(WARPS * 32) kvz_encode(const EncodeJob* __restrict__ jobs, int njobs,
                                                          long long total_chunks, int chunk, const u8* __restrict__ lut,
                                                          u64* __restrict__ work) {
    constexpr int HB = E - 4;
    __shared__ u8 slut[1 << E];
    __shared__ u16 spos[WARPS][SBUF];
    __shared__ u8 sexp[WARPS][SBUF];
    for (int i = threadIdx.x; i < (1 << E); i += blockDim.x) slut[i] = lut[i];
    __syncthreads();
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5;
    const int gpc = chunk / 8;
    u64* status_all = work + 1 + njobs;

    long long gc = 0;
    if (lane == 0) gc = (long long)atomicAdd(&work[0], 1ull);
    gc = __shfl_sync(FULL_MASK, gc, 0);
    while (gc < total_chunks) {
        long long next = 0;  // claim the following chunk now: the atomic's latency hides behind this one
        if (lane == 0) next = (long long)atomicAdd(&work[0], 1ull);
        const int job = find_job(jobs, njobs, gc);
        const T* __restrict__ src = static_cast<const T*>(jobs[job].src);
        const long long n = jobs[job].n;
        u8* __restrict__ codes = jobs[job].codes;
        u8* __restrict__ rest = jobs[job].rest;
        u64* status = status_all + jobs[job].chunk_base;
        const long long c = gc - jobs[job].chunk_base;
        const long long G = (n + 7) / 8, nchunks = (n + chunk - 1) / chunk;
        const long long g0 = c * gpc;
        const int ng = (int)min((long long)gpc, G - g0);
        const int cap = HB * ng / 3;
        int count = 0;
        // Dense pass: two groups per lane per step, the next step's loads issued before this step's
        // work, so every lane keeps four 16-byte loads in flight.
        Raw<T> ca, cb, na, nb;
        if (lane < ng) load_raw(src, n, g0 + lane, ca);
        if (32 + lane < ng) load_raw(src, n, g0 + 32 + lane, cb);
        for (int s0 = 0; s0 < ng; s0 += 64) {
            const int ia = s0 + lane, ib = s0 + 32 + lane;
            if (ia + 64 < ng) load_raw(src, n, g0 + ia + 64, na);
            if (ib + 64 < ng) load_raw(src, n, g0 + ib + 64, nb);
            u32 ma = 0, mb = 0;
            if (ia < ng) ma = encode_raw<E, M, T>(ca, n, g0 + ia, slut, codes, rest);
            if (ib < ng) mb = encode_raw<E, M, T>(cb, n, g0 + ib, slut, codes, rest);
            if (__any_sync(FULL_MASK, (ma | mb) != 0)) {
#pragma unroll
                for (int half = 0; half < 2; half++) {
                    const u32 m = half ? mb : ma;
                    const int gi = half ? ib : ia;
                    const int k = __popc(m);
                    const int incl = warp_inclusive_sum(k, lane);
                    int idx = count + incl - k;
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        if ((m >> j) & 1u) {
                            if (idx < SBUF) {
                                spos[wid][idx] = (u16)(gi * 8 + j);
                                sexp[wid][idx] = (u8)(((half ? raw_value(cb, j) : raw_value(ca, j)) >> M) & ((1u << E) - 1u));
                            }
                            idx++;
                        }
                    }
                    count += __shfl_sync(FULL_MASK, incl, 31);
                }
            }
            ca = na;
            cb = nb;
        }
        const bool plane = count > cap;
        const u64 mine = plane ? (u64)ng : ((u64)count << 31);
        const u64 prefix = look_back(status, c, mine, lane);
        if (lane == 0) {
            if (c == nchunks - 1) work[1 + job] = prefix + mine;
            jobs[job].esc_count[c] = plane ? (u16)PLANE : (u16)count;
        }
        const long long esc_off = (long long)(prefix >> 31);
        const long long plane_off = (long long)HB * (long long)(prefix & GROUPS_MASK);
        __syncwarp();
        if (plane) {
            for (int i = lane; i < ng; i += 32)
                encode_plane<E, M, T>(src, n, g0 + i, codes, jobs[job].high_scratch + plane_off + (long long)HB * i);
        } else if (count <= SBUF) {
            for (int k = lane; k < count; k += 32) {
                jobs[job].esc_pos[esc_off + k] = spos[wid][k];
                jobs[job].exp_scratch[esc_off + k] = sexp[wid][k];
            }
        } else {  // escape-heavy but still listed: collect again from the input, straight to the output
            int idx0 = 0;
            for (int s0 = 0; s0 < ng; s0 += 32) {
                const int i = s0 + lane;
                u32 v[8], m = 0;
                if (i < ng) {
                    load_group(src, n, g0 + i, v);
#pragma unroll
                    for (int j = 0; j < 8; j++)
                        m |= (u32)((g0 + i) * 8 + j < n && (slut[(v[j] >> M) & ((1u << E) - 1u)] & ESC_FLAG)) << j;
                }
                const int k = __popc(m);
                const int incl = warp_inclusive_sum(k, lane);
                int idx = idx0 + incl - k;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    if ((m >> j) & 1u) {
                        jobs[job].esc_pos[esc_off + idx] = (u16)(i * 8 + j);
                        jobs[job].exp_scratch[esc_off + idx] = (u8)((v[j] >> M) & ((1u << E) - 1u));
                        idx++;
                    }
                }
                idx0 += __shfl_sync(FULL_MASK, incl, 31);
            }
        }
        __syncwarp();  // the shared escape buffer is reused by the next chunk
        gc = __shfl_sync(FULL_MASK, next, 0);
    }
}

// ------------------------------------------------------------------ decode
// err codes match stages/fused.py: 1 over capacity, 2 escape totals, 3 position, 4 exponent, 5 plane totals.
__device__ __forceinline__ void set_error(u64* err, u64 code) { atomicCAS(err, 0ull, code); }

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

// BF16, a whole group, non-plane: SIMD-within-a-register on value pairs.  The generic decode spends
// ~130 instructions a group and was compute-bound on the H200 (ncu: 77 % SM, 47 % DRAM).
__device__ __forceinline__ void decode_bf16_full(u32 word, const RestRaw<8>& rr, u32 d0, u32 d1, u32 d2, u32 d3,
                                                 u32 v[8]) {
    const u32 rlo = (u32)rr.q[0], rhi = (u32)(rr.q[0] >> 32);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const u32 rw = k < 2 ? rlo : rhi;
        const u32 r = __byte_perm(rw, 0, (k & 1) ? 0x4342 : 0x4140);  // rest bytes 2k, 2k+1 in 16-bit lanes
        const u32 c0 = (word >> (8 * k)) & 0xF, c1 = (word >> (8 * k + 4)) & 0xF;
        // prmt: selector bits 0-2 pick one of 8 bytes (bit 3 would mean sign replication, so mask it)
        const u32 e0 = (c0 & 8 ? __byte_perm(d2, d3, c0 & 7) : __byte_perm(d0, d1, c0)) & 0xFF;
        const u32 e1 = (c1 & 8 ? __byte_perm(d2, d3, c1 & 7) : __byte_perm(d0, d1, c1)) & 0xFF;
        const u32 pair = ((r & 0x00800080u) << 8) | (r & 0x007F007Fu) | (e0 << 7) | (e1 << 23);
        v[2 * k] = pair & 0xFFFF;
        v[2 * k + 1] = pair >> 16;
    }
}

// Apply this lane's escapes (pmask bit j set: value j's exponent is byte j of pexp), then store.
template <int E, int M, typename T>
__device__ __forceinline__ void patch_store(T* __restrict__ dst, long long n, long long g, u32 v[8], u32 pmask, u64 pexp) {
#pragma unroll
    for (int j = 0; j < 8; j++)
        if ((pmask >> j) & 1u) v[j] = (v[j] & ~(((1u << E) - 1u) << M)) | ((u32)((pexp >> (8 * j)) & 0xFF) << M);
    store_group(dst, n, g, v);
}

struct DecodeJob {  // all 8-byte fields: the host fills a uint64 array (ntensors, 13)
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
};

// work: [0] tile counter, [1 + t] tensor t's error code, [1 + njobs + gc] chunk status.  Zeroed by the caller.
template <int E, int M, typename T>
__global__ void __launch_bounds__(WARPS * 32) kvz_decode(const DecodeJob* __restrict__ jobs, int njobs,
                                                          long long total_chunks, int chunk, u64* __restrict__ work) {
    constexpr int HB = E - 4;
    const int lane = threadIdx.x & 31;
    const int gpc = chunk / 8;
    u64* status_all = work + 1 + njobs;
    while (true) {
        long long gc = 0;
        if (lane == 0) gc = (long long)atomicAdd(&work[0], 1ull);
        gc = __shfl_sync(FULL_MASK, gc, 0);
        if (gc >= total_chunks) break;
        const int job = find_job(jobs, njobs, gc);
        const DecodeJob& J = jobs[job];
        const u8* __restrict__ codes = J.codes;
        const u8* __restrict__ rest = J.rest;
        const u16* __restrict__ esc_pos = J.esc_pos;
        const u8* __restrict__ esc_exp = J.esc_exp;
        const u8* __restrict__ exp_high = J.exp_high;
        T* __restrict__ dst = static_cast<T*>(J.dst);
        const long long n = J.n, n_esc = J.n_esc, n_high = J.n_high;
        const u64 dlo = J.dlo, dhi = J.dhi;
        const u32 d0 = (u32)dlo, d1 = (u32)(dlo >> 32), d2 = (u32)dhi, d3 = (u32)(dhi >> 32);
        u64* status = status_all + J.chunk_base;
        u64* err = work + 1 + job;
        const long long c = gc - J.chunk_base;
        const long long G = (n + 7) / 8, nchunks = (n + chunk - 1) / chunk;
        const long long g0 = c * gpc;
        const int ng = (int)min((long long)gpc, G - g0);
        const long long len = min((long long)chunk, n - c * chunk);
        const u32 stored = J.esc_count[c];
        const bool plane = stored == PLANE;
        int cnt = plane ? 0 : (int)stored;
        if (cnt > HB * ng / 3) { if (lane == 0) set_error(err, 1); cnt = 0; }
        const u64 mine = plane ? (u64)ng : ((u64)cnt << 31);
        const u64 prefix = look_back(status, c, mine, lane);
        if (lane == 0 && c == nchunks - 1) {
            if ((long long)((prefix + mine) >> 31) != n_esc) set_error(err, 2);
            if ((long long)HB * (long long)((prefix + mine) & GROUPS_MASK) != n_high) set_error(err, 5);
        }
        const long long esc_off = (long long)(prefix >> 31);
        const long long plane_off = (long long)HB * (long long)(prefix & GROUPS_MASK);
        if (esc_off + cnt > n_esc) { if (lane == 0) set_error(err, 2); cnt = 0; }
        const bool plane_ok = !plane || plane_off + (long long)HB * ng <= n_high;
        if (!plane_ok && lane == 0) set_error(err, 5);

        // Two groups per lane per step; the next step's codes and rest are loaded before this
        // step's work.  Escapes are sorted, so a cursor (the next escape's position, in a register)
        // walks them; a lane patches the values of its own groups before one store per group.
        constexpr int R = M + 1;
        const bool use_plane = plane && plane_ok;
        int p = 0, prev = -1;
        int next_pos = cnt > 0 ? (int)esc_pos[esc_off] : 0x7FFFFFFF;
        u32 wa = 0, wb = 0, nwa = 0, nwb = 0;
        RestRaw<R> ra, rb, nra, nrb;
        if (lane < ng) { wa = reinterpret_cast<const u32*>(codes)[g0 + lane]; load_rest_raw<R>(rest, g0 + lane, ra); }
        if (32 + lane < ng) { wb = reinterpret_cast<const u32*>(codes)[g0 + 32 + lane]; load_rest_raw<R>(rest, g0 + 32 + lane, rb); }
        for (int s0 = 0; s0 < ng; s0 += 64) {
            const int ia = s0 + lane, ib = s0 + 32 + lane;
            if (ia + 64 < ng) { nwa = reinterpret_cast<const u32*>(codes)[g0 + ia + 64]; load_rest_raw<R>(rest, g0 + ia + 64, nra); }
            if (ib + 64 < ng) { nwb = reinterpret_cast<const u32*>(codes)[g0 + ib + 64]; load_rest_raw<R>(rest, g0 + ib + 64, nrb); }
            u32 va[8], vb[8];
            if constexpr (E == 8 && M == 7 && sizeof(T) == 2) {
                if (!use_plane) {
                    if (ia < ng) decode_bf16_full(wa, ra, d0, d1, d2, d3, va);
                    if (ib < ng) decode_bf16_full(wb, rb, d0, d1, d2, d3, vb);
                } else {
                    if (ia < ng) decode_raw<E, M>(wa, ra, dlo, dhi, true, exp_high + plane_off + (long long)HB * ia, va);
                    if (ib < ng) decode_raw<E, M>(wb, rb, dlo, dhi, true, exp_high + plane_off + (long long)HB * ib, vb);
                }
            } else {
                if (ia < ng) decode_raw<E, M>(wa, ra, dlo, dhi, use_plane, exp_high + plane_off + (long long)HB * ia, va);
                if (ib < ng) decode_raw<E, M>(wb, rb, dlo, dhi, use_plane, exp_high + plane_off + (long long)HB * ib, vb);
            }
            u32 pma = 0, pmb = 0;
            u64 pea = 0, peb = 0;
            const int limit = (s0 + 64) * 8;
            while (next_pos < limit) {  // warp-uniform: every lane reads the same escape
                const int pos = next_pos;
                const u32 e = esc_exp[esc_off + p];
                if (pos <= prev || pos >= len) { if (lane == 0) set_error(err, 3); p = cnt; next_pos = 0x7FFFFFFF; break; }
                if (e >= (1u << E)) { if (lane == 0) set_error(err, 4); p = cnt; next_pos = 0x7FFFFFFF; break; }
                const int gi = pos >> 3, j = pos & 7;
                if (gi == ia) { pma |= 1u << j; pea = (pea & ~(0xFFull << (8 * j))) | ((u64)e << (8 * j)); }
                if (gi == ib) { pmb |= 1u << j; peb = (peb & ~(0xFFull << (8 * j))) | ((u64)e << (8 * j)); }
                prev = pos;
                p++;
                next_pos = p < cnt ? (int)esc_pos[esc_off + p] : 0x7FFFFFFF;
            }
            if (ia < ng) patch_store<E, M, T>(dst, n, g0 + ia, va, pma, pea);
            if (ib < ng) patch_store<E, M, T>(dst, n, g0 + ib, vb, pmb, peb);
            wa = nwa; wb = nwb; ra = nra; rb = nrb;
        }
        if (p < cnt && lane == 0) set_error(err, 3);  // positions past the chunk's groups
    }
}

// ------------------------------------------------------------------ encode epilogue
// After kvz_encode: move esc_exp and exp_high from scratch to their final offsets (which depend on
// the escape totals, known on the device), zero every padding byte between streams, and write the
// header: a host-built template whose payload length, last three stream-table entries and CRC-32
// are filled in here, so the host never waits to build headers.
struct FinishJob {  // all 8-byte fields: uint64 array (ntensors, 14)
    u8* blob;               // header at blob[0], payload at blob[header_len]
    const u8* tmpl;         // header template
    long long header_len;
    long long table_at;     // header offset of esc_pos's stream-table entry (esc_exp, exp_high follow)
    const u8* exp_src;
    const u8* high_src;
    long long var_base;     // payload offset of esc_pos (the escape streams close the payload)
    long long pad[6];       // three (start, end) payload ranges of padding known before encoding
    long long write_header; // 0 when the host writes the header itself (payload checksum)
};

__device__ __forceinline__ void put_u64(u8* p, u64 v) {
#pragma unroll
    for (int k = 0; k < 8; k++) p[k] = (u8)(v >> (8 * k));
}

#define HEADER_SMEM 4096  // headers up to this size are built in shared memory (ours are < 2 KiB)

// grid = (x, ntensors).  sizes[3t..3t+2] = escapes, exp_high bytes, payload length.
__global__ void __launch_bounds__(256) kvz_finish_encode(const FinishJob* __restrict__ jobs, const u64* __restrict__ work,
                                                         int njobs, int hb, u64* __restrict__ sizes) {
    __shared__ u32 crc_table[4][256];
    __shared__ __align__(16) u8 head[HEADER_SMEM];
    const int t = blockIdx.y;
    const FinishJob& J = jobs[t];
    const u64 totals = work[1 + t];
    const long long ne = (long long)(totals >> 31), nh = (long long)hb * (long long)(totals & GROUPS_MASK);
    const long long a_end = J.var_base + 2 * ne;
    const long long b = (a_end + 15) / 16 * 16, b_end = b + ne;
    const long long cc = (b_end + 15) / 16 * 16, c_end = cc + nh;
    const long long end = (c_end + 15) / 16 * 16;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    u8* __restrict__ payload = J.blob + J.header_len;
    if (tid == 0) { sizes[3 * t] = ne; sizes[3 * t + 1] = nh; sizes[3 * t + 2] = end; }
    for (long long i = tid; i < ne; i += stride) payload[b + i] = J.exp_src[i];
    for (long long i = tid; i < nh; i += stride) payload[cc + i] = J.high_src[i];
    if (tid < 16) {
        const long long k = tid;
        for (int r = 0; r < 3; r++)
            if (J.pad[2 * r] + k < J.pad[2 * r + 1]) payload[J.pad[2 * r] + k] = 0;
        if (a_end + k < b) payload[a_end + k] = 0;
        if (b_end + k < cc) payload[b_end + k] = 0;
        if (c_end + k < end) payload[c_end + k] = 0;
    }
    if (blockIdx.x != 0 || !J.write_header) return;
    // Header: the template with the fields that depend on the totals, then its CRC-32 (zlib's,
    // slicing-by-4 over shared memory: one thread, a few microseconds) with the CRC field zeroed.
    const long long H = J.header_len;
    const bool in_smem = H <= HEADER_SMEM;
    u8* h = in_smem ? head : J.blob;
    for (long long i = threadIdx.x; i < H; i += blockDim.x) h[i] = J.tmpl[i];
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
    if (threadIdx.x == 0) {
        put_u64(h + 16, (u64)end);
        put_u64(h + J.table_at, (u64)J.var_base);       put_u64(h + J.table_at + 8, (u64)(2 * ne));
        put_u64(h + J.table_at + 16, (u64)b);           put_u64(h + J.table_at + 24, (u64)ne);
        put_u64(h + J.table_at + 32, (u64)cc);          put_u64(h + J.table_at + 40, (u64)nh);
        h[40] = h[41] = h[42] = h[43] = 0;
        u32 crc = 0xFFFFFFFFu;
        for (long long i = 0; i < H; i += 4) {  // H is a multiple of 16
            crc ^= (u32)h[i] | ((u32)h[i + 1] << 8) | ((u32)h[i + 2] << 16) | ((u32)h[i + 3] << 24);
            crc = crc_table[3][crc & 0xFF] ^ crc_table[2][(crc >> 8) & 0xFF] ^ crc_table[1][(crc >> 16) & 0xFF] ^
                  crc_table[0][crc >> 24];
        }
        crc ^= 0xFFFFFFFFu;
        h[40] = (u8)crc; h[41] = (u8)(crc >> 8); h[42] = (u8)(crc >> 16); h[43] = (u8)(crc >> 24);
    }
    __syncthreads();
    if (in_smem)
        for (long long i = threadIdx.x; i < H; i += blockDim.x) J.blob[i] = head[i];
}

// ------------------------------------------------------------------ header gather (batched decode)
// dst[t * span .. ] = the first min(span, len_t) bytes of blob t: one read-back for a batch's headers.
__global__ void kvz_gather_heads(const u64* __restrict__ jobs /* (ntensors, 2): ptr, len */, int span, u8* __restrict__ dst) {
    const int t = blockIdx.y;
    const u8* src = reinterpret_cast<const u8*>(jobs[2 * t]);
    const long long len = min((long long)span, (long long)jobs[2 * t + 1]);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (long long)gridDim.x * blockDim.x)
        dst[(long long)t * span + i] = src[i];
}
