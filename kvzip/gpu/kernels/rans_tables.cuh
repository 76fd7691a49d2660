// kvz_rans_tables: the storage mode's writer's rule (docs/format.md 16.2; stages/channel_rans.py's
// choose_shift, group_tables, tables_bytes and kvzip/gpu/channel_rans.py's device_tables) on the
// device, from kvz_rans_histogram's counts to the tables stream and the encoder's RansTables words,
// so an encode needs no host step but one small read (the tables' sizes: the encoder's dynamic
// shared memory).  Every number is an integer and every sum order-free, so the bytes are the
// reference's exactly.
#pragma once

#include "common.cuh"
#include "rans_rule.cuh"

#define RANS_TABLES_THREADS 1024
#define RANS_MAX_GROUPS 256   // channel_codebook.MAX_CHANNELS: groups of the finest grouping
#define RANS_MAX_SHIFTS 9     // shifts 0 .. log2(RANS_MAX_GROUPS)
#define RANS_INFO_WORDS 5     // info: shift, the stream's bytes, the table words, groups, search_top
// The largest tables (every group of every exponent: K = 2**8 + 1 numbers, K + 1 entries): the
// stream's bytes and the table words (kvzip/gpu/channel_rans.py sizes the buffers by them).
#define RANS_MAX_STREAM_BYTES (1 + 2 * RANS_MAX_GROUPS + (RANS_FREQ_BITS * RANS_MAX_GROUPS * 257 + 7) / 8)
#define RANS_MAX_TABLE_WORDS (2 * RANS_MAX_GROUPS + RANS_MAX_GROUPS * 258 / 2)

// L(x) of 16.2 for x >= 1: floor(log2 x) << 16 | frac[the 11 bits of x below its leading one].
__device__ __forceinline__ u64 rans_log2(const u16* frac, u64 x) {
    const int msb = 63 - __clzll((long long)x);
    const u64 top = msb >= RANS_LOG2_INDEX_BITS ? x >> (msb - RANS_LOG2_INDEX_BITS) : x << (RANS_LOG2_INDEX_BITS - msb);
    return ((u64)msb << RANS_LOG2_ONE_BITS) | frac[top & ((1u << RANS_LOG2_INDEX_BITS) - 1u)];
}

template <typename T>
__device__ __forceinline__ T rans_warp_sum(T x) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(FULL_MASK, x, d);
    return x;
}

template <typename T>
__device__ __forceinline__ T rans_warp_max(T x) {
#pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
        const T y = __shfl_xor_sync(FULL_MASK, x, d);
        x = y > x ? y : x;
    }
    return x;
}

// A group's merged counts, a warp a group: lane l holds exponents l * EPL .. l * EPL + EPL - 1 (E = 4:
// lanes 16..31 hold none), so lane order is exponent order and "the lowest exponent" is the lowest
// lane's lowest k.
template <int E>
struct RansRow {
    static constexpr int BINS = 1 << E, EPL = BINS >= 32 ? BINS / 32 : 1;
    u64 c[EPL];
    u32 e0;       // this lane's first exponent
    bool held;    // the lane holds exponents (e0 < BINS)
    u32 lo, hi;   // the table's range
    u64 total;    // N: the group's values (1 for a group without values)
    u64 inside;   // the values of [lo, hi]; the escape's count is total - inside
    __device__ __forceinline__ bool in(int k) const { return held && e0 + k >= lo && e0 + k <= hi; }
};

// Group g of 2**shift channels: its counts summed over its channels (u64: 256 uint32 channels), the
// empty group's exponent 0 counted once, mode = the lowest exponent of the largest count, [lo, hi]
// = the least / greatest of the mode and the exponents of count >= RANS_MIN_COUNT (_merged, _ranges).
template <int E>
__device__ __forceinline__ void rans_group_row(const u32* __restrict__ hist, int g, int shift, int lane, RansRow<E>& r) {
    constexpr int EPL = RansRow<E>::EPL;
    r.e0 = (u32)(lane * EPL);
    r.held = r.e0 < (u32)RansRow<E>::BINS;
#pragma unroll
    for (int k = 0; k < EPL; k++) r.c[k] = 0;
    if (r.held) {
        for (long long d = (long long)g << shift; d < (long long)(g + 1) << shift; d++) {
            const u32* row = hist + (d << E) + r.e0;
            if constexpr (EPL == 8) {  // 32 bytes a lane, 32-byte aligned: two 16-byte loads
                const uint4 a = *reinterpret_cast<const uint4*>(row), b = *reinterpret_cast<const uint4*>(row + 4);
                r.c[0] += a.x; r.c[1] += a.y; r.c[2] += a.z; r.c[3] += a.w;
                r.c[4] += b.x; r.c[5] += b.y; r.c[6] += b.z; r.c[7] += b.w;
            } else {
#pragma unroll
                for (int k = 0; k < EPL; k++) r.c[k] += row[k];
            }
        }
    }
    u64 mine = 0, top = 0;
#pragma unroll
    for (int k = 0; k < EPL; k++) { mine += r.c[k]; top = r.c[k] > top ? r.c[k] : top; }
    r.total = rans_warp_sum(mine);
    if (r.total == 0) {  // warp-uniform
        if (lane == 0) r.c[0] = 1;
        top = lane == 0 ? 1 : 0;
        r.total = 1;
    }
    top = rans_warp_max(top);
    int at_top = -1, first = -1, last = -1;  // this lane's lowest k of the largest count, of a kept count; highest kept
#pragma unroll
    for (int k = EPL - 1; k >= 0; k--) {
        if (r.c[k] == top) at_top = k;
        if (r.c[k] >= RANS_MIN_COUNT) first = k;
    }
#pragma unroll
    for (int k = 0; k < EPL; k++) if (r.c[k] >= RANS_MIN_COUNT) last = k;
    const u32 tops = __ballot_sync(FULL_MASK, at_top >= 0), kept = __ballot_sync(FULL_MASK, first >= 0);
    const u32 mode = (u32)__shfl_sync(FULL_MASK, (int)r.e0 + at_top, __ffs(tops) - 1);
    const u32 lo_kept = (u32)__shfl_sync(FULL_MASK, (int)r.e0 + first, kept ? __ffs(kept) - 1 : 0);
    const u32 hi_kept = (u32)__shfl_sync(FULL_MASK, (int)r.e0 + last, kept ? 31 - __clz((int)kept) : 0);
    r.lo = kept && lo_kept < mode ? lo_kept : mode;
    r.hi = kept && hi_kept > mode ? hi_kept : mode;
    mine = 0;
#pragma unroll
    for (int k = 0; k < EPL; k++) mine += r.in(k) ? r.c[k] : 0;
    r.inside = rans_warp_sum(mine);
}

// The group's frequencies (_freqs: counts escape first, fewer than two non-zero -> the escape's
// count + 1; F = max(1, c * 4096 / sum) where c > 0; then the difference to 4096 at the largest F,
// the lowest index on ties, the escape's index 0, none taken below 1).  f[k] is exponent e0 + k's
// (0 outside [lo, hi]); returns the escape's.  Warp-uniform.
template <int E>
__device__ __forceinline__ u32 rans_group_freqs(const RansRow<E>& r, int lane, u32 f[RansRow<E>::EPL]) {
    constexpr int EPL = RansRow<E>::EPL;
    u64 esc = r.total - r.inside;
    int nonzero = 0;
#pragma unroll
    for (int k = 0; k < EPL; k++) nonzero += r.in(k) && r.c[k] > 0;
    nonzero = rans_warp_sum(nonzero) + (esc > 0);
    if (nonzero < 2) esc += 1;
    const u64 sum = r.inside + esc;
    u32 fesc = esc > 0 ? (u32)max(1ull, esc * RANS_TOTAL / sum) : 0u, mine = 0;
#pragma unroll
    for (int k = 0; k < EPL; k++) {
        f[k] = r.in(k) && r.c[k] > 0 ? (u32)max(1ull, r.c[k] * RANS_TOTAL / sum) : 0u;
        mine += f[k];
    }
    int d = (int)RANS_TOTAL - (int)(fesc + rans_warp_sum(mine));
    while (d) {
        u32 top = 0;
#pragma unroll
        for (int k = 0; k < EPL; k++) top = f[k] > top ? f[k] : top;
        top = rans_warp_max(top);
        if (fesc >= top) {  // the escape (index 0) first on ties
            const int step = d > 0 ? d : max(d, 1 - (int)fesc);
            fesc += step;
            d -= step;
            continue;
        }
        int at = -1;
#pragma unroll
        for (int k = EPL - 1; k >= 0; k--) if (f[k] == top) at = k;
        const int owner = __ffs(__ballot_sync(FULL_MASK, at >= 0)) - 1;
        const int step = d > 0 ? d : max(d, 1 - (int)top);
        if (lane == owner) {
#pragma unroll
            for (int k = 0; k < EPL; k++) if (k == at) f[k] += step;
        }
        d -= step;
    }
    return fesc;
}

// OR nbits of v into a little-endian bit string of words at bit `at` (the tables stream: bit k is
// bit k % 8 of byte k / 8).  Groups share words at their ends: atomic, and OR is order-free.
__device__ __forceinline__ void rans_put_bits(u32* __restrict__ words, long long at, u32 v, int nbits) {
    const int r = (int)(at & 31);
    atomicOr(words + (at >> 5), v << r);
    if (r + nbits > 32) atomicOr(words + (at >> 5) + 1, v >> (32 - r));
}

// One block of RANS_TABLES_THREADS, a warp a group.  hist: kvz_rans_histogram's uint32[channels <<
// E] ([channel][exponent]); channels a power of two <= RANS_MAX_GROUPS.  Pass 1: every (shift,
// group) -- task t, heap order: t + 1 in [D >> s, 2 (D >> s)), so the coarsest (largest) groups
// start first -- adds its estimate (in 2**-16 bits, _estimate_bits: (16 + 12 K + E esc) << 16 +
// sum c (L(N) - L(c)), an exact integer, so the shared atomics' order does not matter) to its
// shift's and keeps its range.  The smallest estimate wins, the lowest shift on ties.  Then the
// chosen groups' K = hi - lo + 2 are scanned for their offsets and pass 2 writes each group's
// frequencies.  Outputs: stream (uint32 words, at least ceil(RANS_MAX_STREAM_BYTES / 4)): the
// tables stream's bytes (zeroed here up to its length, which info[1] gives); words (at least
// RANS_MAX_TABLE_WORDS): device_tables' words -- desc[2 g] = off_g, desc[2 g + 1] = lo | width << 8 |
// F[ESC] << 20, then the uint16 entries (0, the exponents' first slots, 4096) a group, a zero
// entry making them whole words; info[RANS_INFO_WORDS]: shift, stream bytes, table words, groups,
// search_top (the largest power of two <= the most symbols, K, of a group).
template <int E>
__global__ void __launch_bounds__(RANS_TABLES_THREADS) kvz_rans_tables(const u32* __restrict__ hist, int channels,
                                                                        u32* __restrict__ stream,
                                                                        u32* __restrict__ words,
                                                                        u32* __restrict__ info) {
    constexpr int EPL = RansRow<E>::EPL;
    __shared__ u16 frac[1 << RANS_LOG2_INDEX_BITS];
    __shared__ u64 estimate[RANS_MAX_SHIFTS];
    __shared__ u16 ranges[2 * RANS_MAX_GROUPS - 1];  // task t's lo | hi << 8
    __shared__ u32 before[RANS_MAX_GROUPS + 1];      // the chosen groups' frequencies before group g
    __shared__ u32 warp_totals[RANS_MAX_GROUPS / 32];
    __shared__ u32 widest;
    __shared__ int chosen;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int D = channels, shifts = __ffs(D);  // log2(D) + 1 groupings
    for (int i = threadIdx.x; i < (1 << RANS_LOG2_INDEX_BITS); i += blockDim.x) frac[i] = rans_log2_frac[i];
    if (threadIdx.x < RANS_MAX_SHIFTS) estimate[threadIdx.x] = 0;
    if (threadIdx.x == 0) widest = 0;
    __syncthreads();

    for (int t = warp; t < 2 * D - 1; t += warps) {
        const int top = 31 - __clz(t + 1), shift = shifts - 1 - top, g = t + 1 - (1 << top);
        RansRow<E> r;
        rans_group_row<E>(hist, g, shift, lane, r);
        const u64 esc = r.total - r.inside, total_log = rans_log2(frac, r.total);
        u64 bits = 0;
#pragma unroll
        for (int k = 0; k < EPL; k++)
            if (r.in(k) && r.c[k] > 0) bits += r.c[k] * (total_log - rans_log2(frac, r.c[k]));
        bits = rans_warp_sum(bits);
        if (lane == 0) {
            if (esc > 0) bits += esc * (total_log - rans_log2(frac, esc));
            bits += (16ull + RANS_FREQ_BITS * (r.hi - r.lo + 2ull) + (u64)E * esc) << RANS_LOG2_ONE_BITS;
            atomicAdd(&estimate[shift], bits);
            ranges[t] = (u16)(r.lo | r.hi << 8);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int best = 0;
        for (int s = 1; s < shifts; s++) best = estimate[s] < estimate[best] ? s : best;
        chosen = best;
    }
    __syncthreads();
    const int shift = chosen, ng = D >> shift, first_task = ng - 1;
    if (threadIdx.x < RANS_MAX_GROUPS) {  // whole warps: the scan of the groups' K
        const int g = threadIdx.x;
        u32 K = 0;
        if (g < ng) {
            const u32 lh = ranges[first_task + g];
            K = (lh >> 8) - (lh & 0xFFu) + 2u;
            atomicMax(&widest, K);
        }
        const u32 inc = warp_inclusive_sum(K, lane);
        if (lane == 31) warp_totals[warp] = inc;
        before[g + 1] = inc;  // this warp's part; the warps before it are added below
    }
    __syncthreads();
    if (threadIdx.x < RANS_MAX_GROUPS) {
        u32 add = 0;
        for (int w = 0; w < warp; w++) add += warp_totals[w];
        before[threadIdx.x + 1] += add;
    }
    if (threadIdx.x == 0) before[0] = 0;
    __syncthreads();
    const u32 nfreq = before[ng], entries = nfreq + (u32)ng;  // the device tables: K + 1 entries a group
    const long long head_bits = 8ll * (1 + 2 * ng);
    const u32 bytes = (u32)(1 + 2 * ng) + (RANS_FREQ_BITS * nfreq + 7u) / 8u;
    const u32 table_words = 2u * (u32)ng + (entries + 1u) / 2u;
    for (u32 i = threadIdx.x; i < (bytes + 3u) / 4u; i += blockDim.x) stream[i] = 0;
    if (threadIdx.x == 0) {
        if (entries & 1u) reinterpret_cast<u16*>(words + 2 * ng)[entries] = 0;
        info[0] = (u32)shift;
        info[1] = bytes;
        info[2] = table_words;
        info[3] = (u32)ng;
        info[4] = 1u << (31 - __clz((int)widest));
    }
    __syncthreads();

    if (threadIdx.x == 0) rans_put_bits(stream, 0, (u32)shift, 8);
    u16* cum = reinterpret_cast<u16*>(words + 2 * ng);
    for (int g = warp; g < ng; g += warps) {
        RansRow<E> r;
        rans_group_row<E>(hist, g, shift, lane, r);
        u32 f[EPL];
        const u32 fesc = rans_group_freqs<E>(r, lane, f);
        const u32 off = before[g] + (u32)g;  // the group's first entry
        const long long at = head_bits + (long long)RANS_FREQ_BITS * before[g];  // its escape's frequency
        u32 mine = 0;
#pragma unroll
        for (int k = 0; k < EPL; k++) mine += f[k];
        u32 slot = fesc + warp_inclusive_sum(mine, lane) - mine;  // the first slot of this lane's exponents
#pragma unroll
        for (int k = 0; k < EPL; k++) {
            if (r.in(k)) {
                const u32 j = r.e0 + k - r.lo + 1u;  // the symbol's index: 0 the escape
                rans_put_bits(stream, at + (long long)RANS_FREQ_BITS * j, f[k], RANS_FREQ_BITS);
                cum[off + j] = (u16)slot;
                slot += f[k];
            }
        }
        if (lane == 0) {
            rans_put_bits(stream, 8ll * (1 + 2 * g), r.lo, 8);
            rans_put_bits(stream, 8ll * (2 + 2 * g), r.hi, 8);
            rans_put_bits(stream, at, fesc, RANS_FREQ_BITS);
            cum[off] = 0;
            cum[off + r.hi - r.lo + 2u] = (u16)RANS_TOTAL;
            words[2 * g] = off;
            words[2 * g + 1] = r.lo | (r.hi - r.lo + 1u) << 8 | fesc << 20;
        }
    }
}
