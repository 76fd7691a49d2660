// ChannelPack (the ratio mode, docs/format.md section 15) on the device: the same bytes as the CPU
// reference (stages/channel_pack_cpu.py), launched by kvzip/gpu/channel_pack.py.
//
// Encode: kvz_ch_histogram counts the auto codebook's sample per channel, kvz_ch_tables ranks it
// into the tables (kvzip/channel_codebook.py's rule, rank_exponents), kvz_ch_encode writes codes
// and rest in place and each chunk's variable runs (second-level indices, escapes, high exponent
// bits) into a slot of its own, kvz_ch_offsets scans the per-chunk sizes and kvz_ch_compact moves
// every run to its place.  Decode: kvz_ch_offsets computes the offsets from the two count streams
// and checks them, kvz_ch_decode decodes the chunks before the first bad count and checks their
// second-level counts and escapes.  A warp a chunk throughout (the chunk's lanes take 32
// consecutive 8-value groups a step), as kvz_encode / kvz_decode do.

#include "auto_codebook.cu"  // SamplePlan, rank_exponents
#include "group_io.cuh"

#define CH_WIDTH 15          // channel_codebook.TABLE_WIDTH: entries of a channel's table
#define CH_PRIMARY 7         // channel_codebook.PRIMARY: codes 0..6; code 7 = a second-level index follows
#define CH_ESCAPE 0xFF       // channel_codebook.ESCAPE: the LUT's mark of an exponent outside the table
#define CH_MAX_CHANNELS 256  // channel_codebook.MAX_CHANNELS
#define CH_SCAN_THREADS 1024 // kvz_ch_offsets: one block
// A warp's second-level bits in flight: a step's 32 groups hold at most 256 indices (768 bits),
// after up to 31 bits carried from the step before: 25 words, one more that stays zero.
#define CH_SEC_WORDS 26

// ------------------------------------------------------------------ tables
// grid: enough blocks for the sample's runs (grid-stride), AUTO_RUN threads: a thread a run value.
// hist[(channel << E) | exponent] (zeroed) += the sampled values' counts
// (channel_pack_cpu.histogram).  One global atomic a distinct key a warp.
template <int E, int M, typename T>
__global__ void __launch_bounds__(AUTO_RUN) kvz_ch_histogram(const T* __restrict__ src, long long n, int channels,
                                                             u32* __restrict__ hist) {
    const SamplePlan plan(n);
    const u32 DM = (u32)channels - 1u, none = 0xFFFFFFFFu;
    const int lane = threadIdx.x & 31;
    for (long long r = blockIdx.x; r < plan.blocks; r += gridDim.x) {
        const long long at = plan.start(r) + threadIdx.x;
        const u32 key = at < n ? (((u32)at & DM) << E) | ((u32)(src[at] >> M) & ((1u << E) - 1u)) : none;
        const u32 same = __match_any_sync(FULL_MASK, key);
        if (key != none && lane == __ffs(same) - 1) atomicAdd(hist + key, (u32)__popc(same));
    }
}

// grid: a block a channel, AUTO_RUN threads.  tables[15 d ..] = channel d's first 15 exponents by
// rank (channel_codebook.rank_tables: the same key as the auto codebook's).
template <int E>
__global__ void __launch_bounds__(AUTO_RUN) kvz_ch_tables(const u32* __restrict__ hist, u8* __restrict__ tables) {
    constexpr int BINS = 1 << E;
    static_assert(BINS <= AUTO_RUN, "a thread an exponent");
    __shared__ u32 c[BINS];
    __shared__ u32 rank[BINS];
    const int d = blockIdx.x, e = threadIdx.x;
    if (e < BINS) c[e] = hist[((long long)d << E) | e];
    rank_exponents<BINS>(c, rank);
    if (e < BINS && rank[e] < CH_WIDTH) tables[d * CH_WIDTH + rank[e]] = (u8)e;
}

// ------------------------------------------------------------------ stream pieces of a group
// A group's 3-bit codes (one 24-bit word) to codes: across the warp as whole words on a whole step
// (store_rest24_warp; step_g = the step's first group, so 3 step_g is 4-byte aligned), else bytes.
__device__ __forceinline__ void put_codes(u8* __restrict__ codes, long long g, long long step_g, u32 word, bool whole,
                                          bool valid, int lane) {
    if (whole) {
        store_rest24_warp(codes + 3 * step_g, word, lane);
    } else if (valid) {
        u8* p = codes + 3 * g;
        p[0] = (u8)word; p[1] = (u8)(word >> 8); p[2] = (u8)(word >> 16);
    }
}

__device__ __forceinline__ u32 get_codes(const u8* __restrict__ codes, long long g) {
    const u8* p = codes + 3 * g;
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16);
}

// A group's rest fields (Top16Pack's layout): R = 3 and 11 as whole words across the warp on a
// whole step (their byte stores were the slow ones in kvz_encode), the other widths as the aligned
// words store_rest writes.
template <int R>
__device__ __forceinline__ void put_rest(u8* __restrict__ rest, long long g, long long step_g, const u32 r[8],
                                         bool whole, bool valid, int lane) {
    if constexpr (R == 3 || R == 11) {
        if (whole) {
            u64 lo, hi;
            pack_rest<R>(r, &lo, &hi);
            if constexpr (R == 3) store_rest24_warp(rest + 3 * step_g, (u32)lo, lane);
            else store_rest11_warp(rest + 11 * step_g, lo, (u32)hi, lane);
            return;
        }
    }
    if (valid) store_rest<R>(rest, g, r);
}

template <int R>
__device__ __forceinline__ void get_rest(const u8* __restrict__ rest, long long g, long long step_g, u32 r[8],
                                         bool whole, bool valid, int lane) {
    RestRaw<R> rr;
    if constexpr (R == 11) {
        if (whole) {
            load_rest11_warp(rest + 11 * step_g, lane, &rr.q[0], &rr.q[1]);
            unpack_rest<R>(rr, r);
            return;
        }
    }
    if (valid) load_rest_raw<R>(rest, g, rr);
    else for (int k = 0; k < (R + 7) / 8; k++) rr.q[k] = 0;
    unpack_rest<R>(rr, r);
}

// nbits (<= 24) bits of the byte stream p from bit `bit` (bit k = bit k % 8 of byte k / 8).
__device__ __forceinline__ u32 read_bits(const u8* __restrict__ p, int bit, int nbits) {
    const u8* b = p + (bit >> 3);
    const int last = ((bit + nbits - 1) >> 3) - (bit >> 3);
    u32 acc = 0;
    for (int k = 0; k <= last; k++) acc |= (u32)b[k] << (8 * k);
    return (acc >> (bit & 7)) & ((1u << nbits) - 1u);
}

// A group's codes and rest through its channels' LUT (lut[e * D + d]: e's place in channel d's
// table, or CH_ESCAPE), with its second-level indices (nsec of them, 3 bits each, in value order)
// and its escapes' mask; values at or past n: code 0, rest 0, neither.
struct ChannelGroup {
    u32 word, r[8], sec, nsec, esc;
};
template <int E, int M, typename T>
__device__ __forceinline__ void encode_channel_group(const Raw<T>& v, long long g, long long n, const u8* lut, int D,
                                                     ChannelGroup& o) {
    constexpr u32 EMASK = (1u << E) - 1u, MMASK = (1u << M) - 1u;
    const u32 DM = (u32)D - 1u, base = (u32)(g << 3) & DM;
    const long long left = n - g * 8;
    o.word = o.sec = o.nsec = o.esc = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const u32 x = raw_value(v, j), e = (x >> M) & EMASK;
        o.r[j] = ((x >> (E + M)) << M) | (x & MMASK);
        const u32 k = lut[e * D + ((base + j) & DM)];
        if (j < left) {
            if (k < CH_PRIMARY) {
                o.word |= k << (3 * j);
            } else if (k < CH_WIDTH) {
                o.word |= (u32)CH_PRIMARY << (3 * j);
                o.sec |= (k - CH_PRIMARY) << (3 * o.nsec);
                o.nsec++;
            } else {
                o.esc |= 1u << j;
            }
        }
    }
}

// The warp's second-level indices of one step, in lane order, appended to the chunk's run: sb (the
// warp's shared words; word 0 holds the run's bits past its last whole word, the rest are zero)
// collects them, whole words go to the chunk's slot sw.  Returns the run's new length in bits.
__device__ __forceinline__ int append_second(u32* sb, u32* __restrict__ sw, int bits, u32 sec, u32 nsec, int lane) {
    int total;
    const int before = warp_exclusive_count(nsec, lane, &total);
    if (total == 0) return bits;  // warp-uniform
    const int at = (bits & 31) + 3 * before, end = (bits & 31) + 3 * total, full = end >> 5;
    if (nsec) {
        atomicOr(&sb[at >> 5], sec << (at & 31));
        if ((at & 31) + 3 * (int)nsec > 32) atomicOr(&sb[(at >> 5) + 1], sec >> (32 - (at & 31)));
    }
    __syncwarp();
    if (lane < full) sw[(bits >> 5) + lane] = sb[lane];
    const u32 left = sb[full];
    __syncwarp();
    if (lane <= full) sb[lane] = lane == 0 ? left : 0u;
    __syncwarp();
    return bits + 3 * total;
}

// ------------------------------------------------------------------ encode
// grid-stride over chunks, a warp a chunk; dynamic shared memory: the LUT, channels << E bytes.
// Chunk c's slots: second-level bits at sec_slots + c * ceil(3 chunk / 32) words, escapes at
// pos_slots / exp_slots + c * full_cap (full_cap = (E - 3) * (chunk / 8) / 3, the most a listed
// chunk holds: the first cap of them are kept, and a chunk with more is plane-coded), high bits at
// high_slots + (E - 3) g of each group g (plane-coded chunks only).  Every chunk's runs are shorter
// than its slots, so kvz_ch_compact may move them forward in chunk order.
template <int E, int M, typename T, int GPL>
__global__ void __launch_bounds__(WARPS * 32) kvz_ch_encode(const T* __restrict__ src, long long n, int channels,
                                                            const u8* __restrict__ tables, int chunk, long long nchunks,
                                                            u8* __restrict__ codes, u8* __restrict__ rest,
                                                            u16* __restrict__ esc_count, u16* __restrict__ sec_count,
                                                            u32* __restrict__ sec_slots, u16* __restrict__ pos_slots,
                                                            u8* __restrict__ exp_slots, u8* __restrict__ high_slots) {
    constexpr int R = M + 1, HB = E - 3, EMASK = (1 << E) - 1, STEP = 32 * GPL;
    extern __shared__ u32 lut_words[];
    __shared__ u32 sec_words[WARPS][CH_SEC_WORDS];
    u8* lut = reinterpret_cast<u8*>(lut_words);
    const int D = channels;
    for (int i = threadIdx.x; i < (D << E) / 4; i += blockDim.x) lut_words[i] = 0x01010101u * CH_ESCAPE;
    for (int i = threadIdx.x; i < WARPS * CH_SEC_WORDS; i += blockDim.x) (&sec_words[0][0])[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < D * CH_WIDTH; i += blockDim.x) lut[tables[i] * D + i / CH_WIDTH] = (u8)(i % CH_WIDTH);
    __syncthreads();
    const int lane = threadIdx.x & 31;
    u32* sb = sec_words[threadIdx.x >> 5];
    const int gpc = chunk >> 3, full_cap = HB * gpc / 3, slot_words = (3 * chunk + 31) >> 5;
    const long long G = (n + 7) >> 3;
    for (long long c = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5); c < nchunks; c += (long long)gridDim.x * WARPS) {
        const long long g0 = c * gpc;
        const int ng = (int)min((long long)gpc, G - g0), cap = HB * ng / 3;
        u16* __restrict__ spos = pos_slots + c * full_cap;
        u8* __restrict__ sexp = exp_slots + c * full_cap;
        u32* __restrict__ sw = sec_slots + c * slot_words;
        int esc = 0, bits = 0;  // the chunk's escapes and second-level bits so far
        for (int s0 = 0; s0 < ng; s0 += STEP) {
            Raw<T> v[GPL];
#pragma unroll
            for (int q = 0; q < GPL; q++) {  // the step's loads first, all in flight
                const int first = s0 + q * 32, gi = first + lane;
                if (first + 32 <= ng && (g0 + first + 32) * 8 <= n) load_raw_full(src, g0 + gi, v[q]);
                else load_raw(src, gi < ng ? n : 0, g0 + gi, v[q]);  // past the chunk: zeros
            }
#pragma unroll
            for (int q = 0; q < GPL; q++) {
                const int first = s0 + q * 32, gi = first + lane;
                const bool valid = gi < ng, whole = first + 32 <= ng && (g0 + first + 32) * 8 <= n;
                ChannelGroup o;
                encode_channel_group<E, M, T>(v[q], g0 + gi, valid ? n : 0, lut, D, o);
                put_codes(codes, g0 + gi, g0 + first, o.word, whole, valid, lane);
                put_rest<R>(rest, g0 + gi, g0 + first, o.r, whole, valid, lane);
                bits = append_second(sb, sw, bits, o.sec, o.nsec, lane);
                int total;
                int at = esc + warp_exclusive_count(__popc(o.esc), lane, &total);
                for (u32 m = o.esc; m; m &= m - 1, at++) {  // rare: in position order, the first cap kept
                    const int j = __ffs(m) - 1;
                    if (at < cap) {
                        spos[at] = (u16)(gi * 8 + j);
                        sexp[at] = (u8)((raw_value(v[q], j) >> M) & EMASK);
                    }
                }
                esc += total;
            }
        }
        if ((bits & 31) && lane == 0) sw[bits >> 5] = sb[0];  // the run's last, partial word
        __syncwarp();
        if (lane == 0) sb[0] = 0;
        const bool plane = (bits + 7) / 8 + 3 * esc > HB * ng;  // listed_bytes > plane_bytes
        if (plane) {  // rare in KV: the chunk again, from L2, codes = e & 7 and its high bits
            for (int gi = lane; gi < ng; gi += 32) {
                const long long g = g0 + gi;
                Raw<T> x;
                load_raw(src, n, g, x);
                u32 word = 0;
                u64 high = 0;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const u32 e = (raw_value(x, j) >> M) & EMASK;  // 0 past n
                    word |= (e & 7u) << (3 * j);
                    high |= (u64)(e >> 3) << (HB * j);
                }
                put_codes(codes, g, g0, word, false, true, lane);
                u8* h = high_slots + HB * g;
#pragma unroll
                for (int k = 0; k < HB; k++) h[k] = (u8)(high >> (8 * k));
            }
        }
        if (lane == 0) {
            esc_count[c] = plane ? (u16)PLANE : (u16)esc;
            sec_count[c] = plane ? (u16)0 : (u16)(bits / 3);
        }
        __syncwarp();
    }
}

// ------------------------------------------------------------------ offsets
struct ChunkSizes {
    long long sec, esc, high;  // sec_codes bytes, escapes, exp_high bytes
};

// Chunk sizes of the counts (cnt = esc_count[c], sec = sec_count[c]) of a chunk of ng groups.
__device__ __forceinline__ ChunkSizes chunk_sizes(u32 cnt, u32 sec, int ng, int HB) {
    if (cnt == PLANE) return {0, 0, (long long)HB * ng};
    return {(3ll * sec + 7) / 8, (long long)cnt, 0};
}

// The count check of a chunk whose runs start at `at` (channel_pack_cpu._decode_offsets, its
// order): the error code, or 0.
__device__ __forceinline__ int count_error(u32 cnt, u32 sec, long long len, int ng, int HB, ChunkSizes at, ChunkSizes s,
                                           long long n_sec, long long n_pos, long long n_high) {
    if (cnt == PLANE) return sec != 0 ? 6 : at.high + s.high > n_high ? 5 : 0;
    if ((long long)sec > len || s.sec + 3ll * cnt > (long long)HB * ng) return 1;
    if (at.esc + s.esc > n_pos) return 2;
    if (at.sec + s.sec > n_sec) return 6;
    return 0;
}

// One block of CH_SCAN_THREADS; thread t takes a range of chunks (a multiple of 8: the counts load
// 8 at a time, 16-byte aligned), sums its sizes, a block scan gives each range its start, and a
// second walk writes offsets[c], offsets[nchunks + c], offsets[2 nchunks + c] (chunk c's first
// sec_codes byte, escape, exp_high byte).  checked (decode): every chunk's count check against the
// streams' lengths, the lowest failing chunk's 8 c + code kept; none failing, the totals'.
// result: [0] 8 c + code of the first error or ~0, [1] the chunks before the first bad count
// (the ones kvz_ch_decode decodes), [2..4] the three totals.
__global__ void __launch_bounds__(CH_SCAN_THREADS) kvz_ch_offsets(const u16* __restrict__ esc_count,
                                                                  const u16* __restrict__ sec_count, long long nchunks,
                                                                  long long n, int chunk, int HB, int checked,
                                                                  long long n_sec, long long n_pos, long long n_high,
                                                                  long long* __restrict__ offsets, u64* __restrict__ result) {
    __shared__ long long warp_sums[3][32];
    __shared__ u64 first;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gpc = chunk >> 3;
    const long long G = (n + 7) >> 3;
    const long long per = ((nchunks + CH_SCAN_THREADS - 1) / CH_SCAN_THREADS + 7) & ~7ll;
    const long long c0 = min(nchunks, (long long)threadIdx.x * per), c1 = min(nchunks, c0 + per);
    if (threadIdx.x == 0) first = ~0ull;
    auto counts8 = [&](long long c, u32 cnt[8], u32 sec[8]) {
        if (c + 8 <= c1) {
            const uint4 a = *reinterpret_cast<const uint4*>(esc_count + c), b = *reinterpret_cast<const uint4*>(sec_count + c);
            const u32 wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int k = 0; k < 8; k++) { cnt[k] = (wa[k >> 1] >> (16 * (k & 1))) & 0xFFFFu; sec[k] = (wb[k >> 1] >> (16 * (k & 1))) & 0xFFFFu; }
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) { cnt[k] = c + k < c1 ? esc_count[c + k] : 0u; sec[k] = c + k < c1 ? sec_count[c + k] : 0u; }
        }
    };
    // visit(c, esc count, sec count, groups, sizes) for each of this thread's chunks, in order.
    auto each_chunk = [&](auto&& visit) {
        for (long long c = c0; c < c1; c += 8) {
            u32 cnt[8], sec[8];
            counts8(c, cnt, sec);
#pragma unroll
            for (int k = 0; k < 8; k++) {
                if (c + k >= c1) break;
                const int ng = (int)min((long long)gpc, G - (c + k) * gpc);
                visit(c + k, cnt[k], sec[k], ng, chunk_sizes(cnt[k], sec[k], ng, HB));
            }
        }
    };
    ChunkSizes mine = {0, 0, 0};
    each_chunk([&](long long, u32, u32, int, const ChunkSizes& s) {
        mine.sec += s.sec; mine.esc += s.esc; mine.high += s.high;
    });
    long long inc[3] = {mine.sec, mine.esc, mine.high};
#pragma unroll
    for (int k = 0; k < 3; k++) {
        inc[k] = warp_inclusive_sum(inc[k], lane);
        if (lane == 31) warp_sums[k][warp] = inc[k];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int k = 0; k < 3; k++) warp_sums[k][lane] = warp_inclusive_sum(warp_sums[k][lane], lane);
    }
    __syncthreads();
    const long long below[3] = {warp ? warp_sums[0][warp - 1] : 0, warp ? warp_sums[1][warp - 1] : 0,
                                warp ? warp_sums[2][warp - 1] : 0};
    ChunkSizes at = {below[0] + inc[0] - mine.sec, below[1] + inc[1] - mine.esc, below[2] + inc[2] - mine.high};
    u64 err = ~0ull;
    each_chunk([&](long long c, u32 cnt, u32 sec, int ng, const ChunkSizes& s) {
        if (checked && err == ~0ull) {
            const long long len = min((long long)chunk, n - c * chunk);
            const int code = count_error(cnt, sec, len, ng, HB, at, s, n_sec, n_pos, n_high);
            if (code) err = 8ull * (u64)c + (u64)code;
        }
        offsets[c] = at.sec;
        offsets[nchunks + c] = at.esc;
        offsets[2 * nchunks + c] = at.high;
        at.sec += s.sec; at.esc += s.esc; at.high += s.high;
    });
    if (err != ~0ull) atomicMin(&first, err);
    __syncthreads();
    if (threadIdx.x == 0) {
        const long long tot[3] = {warp_sums[0][31], warp_sums[1][31], warp_sums[2][31]};
        u64 e = first;
        const long long stop = e == ~0ull ? nchunks : (long long)(e / 8);
        if (checked && e == ~0ull) {
            const u64 past = 8ull * (u64)nchunks;
            e = tot[0] != n_sec ? past + 6 : tot[1] != n_pos ? past + 2 : tot[2] != n_high ? past + 5 : ~0ull;
        }
        result[0] = e;
        result[1] = (u64)stop;
        for (int k = 0; k < 3; k++) result[2 + k] = (u64)tot[k];
    }
}

// grid-stride over chunks, a warp a chunk: each chunk's runs from its slots (kvz_ch_encode) to
// the offsets kvz_ch_offsets found, in the streams of exactly the totals' lengths.
__global__ void __launch_bounds__(WARPS * 32) kvz_ch_compact(const u16* __restrict__ esc_count,
                                                             const u16* __restrict__ sec_count, long long nchunks,
                                                             long long n, int chunk, int HB,
                                                             const long long* __restrict__ offsets,
                                                             const u32* __restrict__ sec_slots,
                                                             const u16* __restrict__ pos_slots,
                                                             const u8* __restrict__ exp_slots,
                                                             const u8* __restrict__ high_slots, u8* __restrict__ sec_codes,
                                                             u16* __restrict__ esc_pos, u8* __restrict__ esc_exp,
                                                             u8* __restrict__ exp_high) {
    const int lane = threadIdx.x & 31;
    const int gpc = chunk >> 3, full_cap = (HB * gpc) / 3, slot_words = (3 * chunk + 31) >> 5;
    const long long G = (n + 7) >> 3;
    for (long long c = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5); c < nchunks; c += (long long)gridDim.x * WARPS) {
        const u32 cnt = esc_count[c];
        const ChunkSizes s = chunk_sizes(cnt, sec_count[c], (int)min((long long)gpc, G - c * gpc), HB);
        if (cnt == PLANE) {
            const u8* from = high_slots + c * gpc * HB;
            u8* to = exp_high + offsets[2 * nchunks + c];
            for (long long k = lane; k < s.high; k += 32) to[k] = from[k];
            continue;
        }
        const u8* from = reinterpret_cast<const u8*>(sec_slots + c * slot_words);
        u8* to = sec_codes + offsets[c];
        for (long long k = lane; k < s.sec; k += 32) to[k] = from[k];
        const long long e0 = offsets[nchunks + c];
        for (long long k = lane; k < s.esc; k += 32) {
            esc_pos[e0 + k] = pos_slots[c * full_cap + k];
            esc_exp[e0 + k] = exp_slots[c * full_cap + k];
        }
    }
}

// ------------------------------------------------------------------ decode
// grid-stride over the chunks before result[1] (kvz_ch_offsets's first bad count), a warp a
// chunk.  A chunk's error (its code-7 values against its second-level count, then its escapes in
// order: position, then exponent) goes to result[0] by atomicMin of 8 c + code, so the error
// kept is the lowest chunk's, as the CPU reference reports it.  dst: 16-byte aligned.
template <int E, int M, typename T, int GPL>
__global__ void __launch_bounds__(WARPS * 32) kvz_ch_decode(const u8* __restrict__ codes, const u8* __restrict__ rest,
                                                            const u8* __restrict__ tables, int channels,
                                                            const u16* __restrict__ esc_count,
                                                            const u16* __restrict__ sec_count,
                                                            const long long* __restrict__ offsets,
                                                            const u8* __restrict__ sec_codes,
                                                            const u16* __restrict__ esc_pos,
                                                            const u8* __restrict__ esc_exp,
                                                            const u8* __restrict__ exp_high, long long n, int chunk,
                                                            long long nchunks, u64* __restrict__ result,
                                                            T* __restrict__ dst) {
    constexpr int R = M + 1, HB = E - 3, STEP = 32 * GPL;
    constexpr u32 EMASK = (1u << E) - 1u, MMASK = (1u << M) - 1u;
    __shared__ u8 tab[CH_WIDTH * CH_MAX_CHANNELS];  // tab[k * D + d] = T_d[k]: lanes read spread channels
    const int D = channels;
    const u32 DM = (u32)D - 1u;
    for (int i = threadIdx.x; i < D * CH_WIDTH; i += blockDim.x) tab[(i % CH_WIDTH) * D + i / CH_WIDTH] = tables[i];
    __syncthreads();
    const long long stop = (long long)result[1];
    const int lane = threadIdx.x & 31, gpc = chunk >> 3;
    const long long G = (n + 7) >> 3;
    for (long long c = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5); c < stop; c += (long long)gridDim.x * WARPS) {
        const long long g0 = c * gpc;
        const int ng = (int)min((long long)gpc, G - g0);
        const u32 cnt = esc_count[c], want = sec_count[c];
        const bool plane = cnt == PLANE;
        const u8* __restrict__ run = sec_codes + offsets[c];
        const u8* __restrict__ highs = exp_high + offsets[2 * nchunks + c];
        int hits = 0;  // the chunk's code-7 values so far (warp-uniform)
        for (int s0 = 0; s0 < ng; s0 += STEP) {
            u32 word[GPL], r[GPL][8];
            u64 high[GPL];
#pragma unroll
            for (int q = 0; q < GPL; q++) {  // the step's loads first
                const int first = s0 + q * 32, gi = first + lane;
                const bool valid = gi < ng, whole = first + 32 <= ng;
                word[q] = valid ? get_codes(codes, g0 + gi) : 0u;
                get_rest<R>(rest, g0 + gi, g0 + first, r[q], whole, valid, lane);
                high[q] = 0;
                if (plane && valid) {
#pragma unroll
                    for (int k = 0; k < HB; k++) high[q] |= (u64)highs[HB * gi + k] << (8 * k);
                }
            }
#pragma unroll
            for (int q = 0; q < GPL; q++) {
                const int gi = s0 + q * 32 + lane;
                const long long g = g0 + gi, left = gi < ng ? n - g * 8 : 0;
                u32 sevens = 0;  // the group's code-7 values in the tensor (listed chunks)
#pragma unroll
                for (int j = 0; j < 8; j++)
                    if (!plane && j < left && ((word[q] >> (3 * j)) & 7u) == CH_PRIMARY) sevens |= 1u << j;
                const int nsev = __popc(sevens);
                int total;
                const int t = hits + warp_exclusive_count((u32)nsev, lane, &total);
                // the group's indices, unless the run is shorter (an error: hits != want below)
                u32 sec = nsev && t + nsev <= (int)want ? read_bits(run, 3 * t, 3 * nsev) : 0u;
                hits += total;
                const u32 base = (u32)(g << 3) & DM;
                u32 v[8];
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const u32 code = (word[q] >> (3 * j)) & 7u;
                    u32 e;
                    if (plane) {
                        e = code | ((((u32)(high[q] >> (HB * j))) & ((1u << HB) - 1u)) << 3);
                    } else {
                        u32 k = code;
                        if ((sevens >> j) & 1u) { k = CH_PRIMARY + (sec & 7u); sec >>= 3; }
                        e = tab[k * D + ((base + j) & DM)];
                    }
                    v[j] = ((r[q][j] >> M) << (E + M)) | (e << M) | (r[q][j] & MMASK);
                }
                if (gi < ng) store_group(dst, n, g, v);
            }
        }
        int code = 0;
        if (!plane && hits != (int)want) code = 6;
        if (!plane && code == 0 && cnt) {
            __syncwarp();  // the chunk's values stored before any escape patches one
            const long long len = min((long long)chunk, n - c * chunk), e0 = offsets[nchunks + c];
            for (int k0 = 0; k0 < (int)cnt && code == 0; k0 += 32) {
                const int k = k0 + lane;
                int bad = 0;
                u32 pos = 0, e = 0;
                if (k < (int)cnt) {
                    pos = esc_pos[e0 + k];
                    e = esc_exp[e0 + k];
                    const long long prev = k > 0 ? (long long)esc_pos[e0 + k - 1] : -1;
                    bad = ((long long)pos >= len || (long long)pos <= prev) ? 3 : e > EMASK ? 4 : 0;
                }
                const u32 m = __ballot_sync(FULL_MASK, bad != 0);
                if (m) {
                    code = __shfl_sync(FULL_MASK, bad, __ffs(m) - 1);
                } else if (k < (int)cnt) {
                    T* p = dst + c * chunk + pos;
                    *p = (T)(((u32)*p & ~(EMASK << M)) | (e << M));
                }
            }
        }
        if (code && lane == 0) atomicMin(reinterpret_cast<unsigned long long*>(result), 8ull * (u64)c + (u64)code);
        __syncwarp();
    }
}
