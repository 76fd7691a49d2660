// ChannelPack (the ratio mode, docs/format.md section 15) on the device: the same bytes as the CPU
// reference (stages/channel_pack_cpu.py), launched by kvzip/gpu/channel_pack.py.
//
// Encode: kvz_ch_histogram counts the auto codebook's sample per channel, kvz_ch_tables ranks it
// into the tables (kvzip/channel_codebook.py's rule, rank_exponents), kvz_ch_encode writes codes,
// rest and esc_count in place in the payload and each chunk's variable runs (second-level
// indices, escapes, high exponent bits) into a slot of its own, kvz_ch_scan scans the
// per-chunk sizes and kvz_ch_compact moves every run to its place in the payload and completes
// it.  Decode: kvz_ch_scan computes the offsets from the two count streams and checks them,
// kvz_ch_decode decodes the chunks before the first bad count and checks their second-level
// counts and escapes.  A warp a chunk throughout (the chunk's lanes take 32 consecutive 8-value
// groups a step), as kvz_encode / kvz_decode do.

#include "auto_codebook.cu"  // SamplePlan, rank_exponents
#include "group_io.cuh"

#define CH_WIDTH 15          // channel_codebook.TABLE_WIDTH: entries of a channel's table
#define CH_PRIMARY 7         // channel_codebook.PRIMARY: codes 0..6; code 7 = a second-level index follows
#define CH_MAX_CHANNELS 256  // channel_codebook.MAX_CHANNELS
// A warp's second-level bits in flight: a step's 32 GPL groups hold at most 256 GPL indices
// (768 GPL bits), after up to 31 bits carried from the step before: 24 GPL + 1 words, one more
// that stays zero.
#define CH_SEC_WORDS(GPL) (24 * (GPL) + 2)

#include "channel_offsets.cuh"  // kvz_ch_scan, kvz_ch_compact

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
    rank_exponents<BINS, CH_WIDTH>(c, rank);
    if (e < BINS && rank[e] < CH_WIDTH) tables[d * CH_WIDTH + rank[e]] = (u8)e;
}

// ------------------------------------------------------------------ stream pieces of a group
// A group's 24 bits (its 3-bit codes, or E5M2's 3-bit rest fields) to bytes [3g, 3g + 3) of a
// stream: across the warp as whole words on a whole step (store_rest24_warp; step_g = the step's
// first group, so 3 step_g is 4-byte aligned), else bytes.
__device__ __forceinline__ void put24(u8* __restrict__ stream, long long g, long long step_g, u32 word, bool whole,
                                      bool valid, int lane) {
    if (whole) {
        store_rest24_warp(stream + 3 * step_g, word, lane);
    } else if (valid) {
        u8* p = stream + 3 * g;
        p[0] = (u8)word; p[1] = (u8)(word >> 8); p[2] = (u8)(word >> 16);
    }
}

__device__ __forceinline__ u32 get24(const u8* __restrict__ stream, long long g) {
    const u8* p = stream + 3 * g;
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16);
}

// A group's rest fields of more than 8 bits (Top16Pack's layout; FP16's 11, FP32's 24): R = 11 as
// whole words across the warp on a whole step (its byte stores were the slow ones in kvz_encode),
// 24 as the aligned words store_rest writes.
template <int R>
__device__ __forceinline__ void put_rest(u8* __restrict__ rest, long long g, long long step_g, const u32 r[8],
                                         bool whole, bool valid, int lane) {
    if constexpr (R == 11) {
        if (whole) {
            u64 lo, hi;
            pack_rest<R>(r, &lo, &hi);
            store_rest11_warp(rest + 11 * step_g, lo, (u32)hi, lane);
            return;
        }
    }
    if (valid) store_rest<R>(rest, g, r);
}

// A group's rest fields packed whole (R <= 8: ChannelGroup::rest_bits): BF16's 8 and E4M3's 4
// bytes as one aligned word, E5M2's 3 across the warp on a whole step (store_rest24_warp).
template <int R>
__device__ __forceinline__ void put_rest_bits(u8* __restrict__ rest, long long g, long long step_g, u64 bits,
                                              bool whole, bool valid, int lane) {
    if constexpr (R == 8) {
        if (valid) *reinterpret_cast<u64*>(rest + 8 * g) = bits;
    } else if constexpr (R == 4) {
        if (valid) *reinterpret_cast<u32*>(rest + 4 * g) = (u32)bits;
    } else {
        static_assert(R == 3, "the rest widths of at most 8 bits: 3, 4, 8");
        put24(rest, g, step_g, (u32)bits, whole, valid, lane);
    }
}

template <int R>
__device__ __forceinline__ void get_rest_raw(const u8* __restrict__ rest, long long g, long long step_g, RestRaw<R>& rr,
                                             bool whole, bool valid, int lane) {
    if constexpr (R == 11) {
        if (whole) {
            load_rest11_warp(rest + 11 * step_g, lane, &rr.q[0], &rr.q[1]);
            return;
        }
    }
    if (valid) load_rest_raw<R>(rest, g, rr);
    else for (int k = 0; k < (R + 7) / 8; k++) rr.q[k] = 0;
}

template <int R>
__device__ __forceinline__ void get_rest(const u8* __restrict__ rest, long long g, long long step_g, u32 r[8],
                                         bool whole, bool valid, int lane) {
    RestRaw<R> rr;
    get_rest_raw<R>(rest, g, step_g, rr, whole, valid, lane);
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

// The encode LUT's byte for an exponent of a channel's table: the value's 3-bit code in bits 0-2
// (its place k for the 7 primary entries, 7 for the 8 second-level ones), bit 3 set for a
// second-level entry with its index in bits 4-6; CH_LUT_ESCAPE (code 0, bit 7) for an exponent
// outside the table.  One shared load a value gives everything the value codes to.
#define CH_LUT_ESCAPE 0x80u
__device__ __forceinline__ u8 lut_entry(int k) {
    return (u8)(k < CH_PRIMARY ? k : 0x0F | ((k - CH_PRIMARY) << 4));
}

// Bit `bit` of each of x's 4 bytes, as 4 bits (byte i -> bit i).
__device__ __forceinline__ u32 byte_flags(u32 x, int bit) {
    return (((x >> bit) & 0x01010101u) * 0x01020408u) >> 24;
}

// 4 bytes < 8 packed 3 bits a byte (byte i -> bits 3i..3i+2).
__device__ __forceinline__ u32 pack3x4(u32 c) {
    const u32 t = c | (c >> 5);  // bytes 0 and 2 now hold 6 bits each: c0 | c1 << 3, c2 | c3 << 3
    return (t & 0x3Fu) | ((t >> 10) & 0xFC0u);
}

// 4 bytes < 16 packed 4 bits a byte (byte i -> bits 4i..4i+3).
__device__ __forceinline__ u32 pack4x4(u32 c) {
    return __byte_perm(c | (c >> 4), 0u, 0x4420u);  // bytes 0 and 2 hold c0 | c1 << 4, c2 | c3 << 4
}

// The inverses, for the 12 (16) low bits of x: bits 3i..3i+2 (4i..4i+3) -> byte i.
__device__ __forceinline__ u32 unpack3x4(u32 x) {
    const u32 t = (x & 0x3Fu) | ((x & 0xFC0u) << 10);  // c0 | c1 << 3 in byte 0, c2 | c3 << 3 in byte 2
    return (t & 0x00070007u) | ((t << 5) & 0x07000700u);
}
__device__ __forceinline__ u32 unpack4x4(u32 x) {
    const u32 t = __byte_perm(x, 0u, 0x4140u);  // c0 | c1 << 4 in byte 0, c2 | c3 << 4 in byte 2
    return (t & 0x000F000Fu) | ((t << 4) & 0x0F000F00u);
}

// Rest fields of at most 8 bits (BF16: 8, E5M2: 3, E4M3: 4) are built a word at a time, packed as
// store_rest packs them (value j at bits R j of the group's 8 R bits); wider ones a value at a time.
template <int R>
constexpr bool WORD_REST = R <= 8;

// A group's codes and rest through its channels' LUT (lut[e * D + d]: lut_entry of e's place in
// channel d's table), with its second-level indices (nsec of them, 3 bits each, in value order)
// and its escapes' mask; values at or past n: code 0, rest 0, neither.  WHOLE: the group holds 8
// values.  NO_WRAP (D >= 8): its channels are base..base+7, at constant offsets from one row.
struct ChannelGroup {
    u32 word, sec, nsec, esc;
    u64 rest_bits;  // WORD_REST: the packed rest fields
    u32 r[8];       // otherwise: each value's rest field
};
template <int E, int M, typename T, bool WHOLE, bool NO_WRAP>
__device__ __forceinline__ void encode_channel_group(const Raw<T>& v, long long g, long long n, const u8* lut, int D,
                                                     ChannelGroup& o) {
    constexpr u32 EMASK = (1u << E) - 1u, MMASK = (1u << M) - 1u;
    const u32 DM = (u32)D - 1u, base = (u32)(g << 3) & DM;
    const long long left = WHOLE ? 8 : n - g * 8;
    const u8* t = NO_WRAP ? lut + base : lut;
    u32 pk[2] = {0u, 0u};  // the values' LUT bytes, 4 a word
    u32 e4[2];              // FP8: the values' exponents, a byte each, 4 a word
    if constexpr (sizeof(T) == 2 && M + 1 == 8) {  // BF16: two rest bytes a word of input, four a word of rest
        u32 r2[4];
#pragma unroll
        for (int k = 0; k < 4; k++) r2[k] = (v.w[k] & 0x007F007Fu) | ((v.w[k] >> 8) & 0x00800080u);
        o.rest_bits = (u64)__byte_perm(r2[0], r2[1], 0x6420u) | ((u64)__byte_perm(r2[2], r2[3], 0x6420u) << 32);
    } else if constexpr (sizeof(T) == 1) {  // FP8, four values a word: the sign (bit 7) to bit M of its byte
        constexpr u32 ONES = 0x01010101u;
        u32 r4[2];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            e4[k] = (v.w[k] >> M) & (ONES * EMASK);  // the bits shifted in from the next byte sit above E
            r4[k] = ((v.w[k] >> E) & (ONES << M)) | (v.w[k] & (ONES * MMASK));
        }
        static_assert(M + 1 == 3 || M + 1 == 4, "E5M2 or E4M3");
        if constexpr (M + 1 == 3) o.rest_bits = pack3x4(r4[0]) | (pack3x4(r4[1]) << 12);
        else o.rest_bits = pack4x4(r4[0]) | (pack4x4(r4[1]) << 16);
    }
#pragma unroll
    for (int j = 0; j < 8; j++) {
        u32 e;
        if constexpr (sizeof(T) == 1) {
            e = __byte_perm(e4[j >> 2], 0u, 0x4440u | (j & 3));
        } else {
            const u32 x = raw_value(v, j);
            e = (x >> M) & EMASK;
            if constexpr (!WORD_REST<M + 1>) o.r[j] = ((x >> (E + M)) << M) | (x & MMASK);
        }
        const u32 b = NO_WRAP ? t[e * D + j] : lut[e * D + ((base + j) & DM)];
        if (WHOLE || j < left) pk[j >> 2] |= b << (8 * (j & 3));
    }
    o.word = pack3x4(pk[0] & 0x07070707u) | (pack3x4(pk[1] & 0x07070707u) << 12);
    const u32 secs = byte_flags(pk[0], 3) | (byte_flags(pk[1], 3) << 4);
    o.esc = byte_flags(pk[0], 7) | (byte_flags(pk[1], 7) << 4);
    o.nsec = __popc(secs);
    o.sec = 0;
    const u64 all = (u64)pk[0] | ((u64)pk[1] << 32);
    int at = 0;
    for (u32 m = secs; m; m &= m - 1, at += 3) o.sec |= (u32)((all >> (8 * (__ffs(m) - 1) + 4)) & 7u) << at;
}

// The warp's second-level indices of one step, in group order (the step's q-th 32 groups after
// its (q-1)-th), appended to the chunk's run: lane l's group of part q holds nsec[q] indices,
// 3 bits each in sec[q].  sb (the warp's shared words; word 0 holds the run's bits past its last
// whole word, the rest are zero) collects them, whole words go to the chunk's slot sw.  Returns
// the run's new length in bits.
template <int GPL>
__device__ __forceinline__ int append_second(u32* sb, u32* __restrict__ sw, int bits, const u32 sec[GPL],
                                             const u32 nsec[GPL], int lane) {
    static_assert(GPL == 1 || GPL == 2, "a step's counts share one packed scan");
    u32 packed = 0, sums;
#pragma unroll
    for (int q = 0; q < GPL; q++) packed |= nsec[q] << (16 * q);
    const u32 before = warp_exclusive_pair(packed, lane, &sums);
    const int first = (int)(sums & 0xFFFFu), total = first + (int)(sums >> 16);
    if (total == 0) return bits;  // warp-uniform
    const int carry = bits & 31, end = carry + 3 * total, full = end >> 5;
#pragma unroll
    for (int q = 0; q < GPL; q++) {
        if (nsec[q]) {
            const int at = carry + 3 * ((int)((before >> (16 * q)) & 0xFFFFu) + (q ? first : 0));
            atomicOr(&sb[at >> 5], sec[q] << (at & 31));
            if ((at & 31) + 3 * (int)nsec[q] > 32) atomicOr(&sb[(at >> 5) + 1], sec[q] >> (32 - (at & 31)));
        }
    }
    __syncwarp();  // full <= 24 GPL: GPL words a lane cover the whole words and the partial one
#pragma unroll
    for (int k = 0; k < GPL; k++) if (lane + 32 * k < full) sw[(bits >> 5) + lane + 32 * k] = sb[lane + 32 * k];
    const u32 left = sb[full];
    __syncwarp();
#pragma unroll
    for (int k = 0; k < GPL; k++) if (lane + 32 * k <= full) sb[lane + 32 * k] = lane + k == 0 ? left : 0u;
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
// Blocks an SM the encoder's registers must allow: FP8's 5 (48 registers, no spill); the wider
// formats would spill at 48, so 0 leaves them the compiler's choice.
template <typename T>
constexpr int CH_ENCODE_MIN_BLOCKS = sizeof(T) == 1 ? 5 : 0;
template <int E, int M, typename T, int GPL>
__global__ void __launch_bounds__(WARPS * 32, CH_ENCODE_MIN_BLOCKS<T>) kvz_ch_encode(const T* __restrict__ src, long long n, int channels,
                                                            const u8* __restrict__ tables, int chunk, long long nchunks,
                                                            u8* __restrict__ codes, u8* __restrict__ rest,
                                                            u16* __restrict__ esc_count, u16* __restrict__ sec_count,
                                                            u32* __restrict__ sec_slots, u16* __restrict__ pos_slots,
                                                            u8* __restrict__ exp_slots, u8* __restrict__ high_slots) {
    constexpr int R = M + 1, HB = E - 3, EMASK = (1 << E) - 1, STEP = 32 * GPL;
    extern __shared__ u32 lut_words[];
    __shared__ u32 sec_words[WARPS][CH_SEC_WORDS(GPL)];
    u8* lut = reinterpret_cast<u8*>(lut_words);
    const int D = channels;
    for (int i = threadIdx.x; i < (D << E) / 4; i += blockDim.x) lut_words[i] = 0x01010101u * CH_LUT_ESCAPE;
    for (int i = threadIdx.x; i < WARPS * CH_SEC_WORDS(GPL); i += blockDim.x) (&sec_words[0][0])[i] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < D * CH_WIDTH; i += blockDim.x) lut[tables[i] * D + i / CH_WIDTH] = lut_entry(i % CH_WIDTH);
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
            ChannelGroup o[GPL];
#pragma unroll
            for (int q = 0; q < GPL; q++) {
                const int first = s0 + q * 32, gi = first + lane;
                const bool valid = gi < ng, whole = first + 32 <= ng && (g0 + first + 32) * 8 <= n;
                if (whole && D >= 8) encode_channel_group<E, M, T, true, true>(v[q], g0 + gi, n, lut, D, o[q]);
                else encode_channel_group<E, M, T, false, false>(v[q], g0 + gi, valid ? n : 0, lut, D, o[q]);
                put24(codes, g0 + gi, g0 + first, o[q].word, whole, valid, lane);
                if constexpr (WORD_REST<R>) put_rest_bits<R>(rest, g0 + gi, g0 + first, o[q].rest_bits, whole, valid, lane);
                else put_rest<R>(rest, g0 + gi, g0 + first, o[q].r, whole, valid, lane);
            }
            u32 sec[GPL], nsec[GPL];
#pragma unroll
            for (int q = 0; q < GPL; q++) sec[q] = o[q].sec, nsec[q] = o[q].nsec;
            bits = append_second<GPL>(sb, sw, bits, sec, nsec, lane);
#pragma unroll
            for (int q = 0; q < GPL; q++) {
                if (__any_sync(FULL_MASK, o[q].esc)) {  // rare: in position order, the first cap kept
                    const int gi = s0 + q * 32 + lane;
                    int total;
                    int at = esc + warp_exclusive_count(__popc(o[q].esc), lane, &total);
                    for (u32 m = o[q].esc; m; m &= m - 1, at++) {
                        const int j = __ffs(m) - 1;
                        if (at < cap) {
                            spos[at] = (u16)(gi * 8 + j);
                            sexp[at] = (u8)((raw_value(v[q], j) >> M) & EMASK);
                        }
                    }
                    esc += total;
                }
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
                put24(codes, g, g0, word, false, true, lane);
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

// ------------------------------------------------------------------ decode
// A value's bits from its rest field r (sign above the mantissa) and its exponent e.
template <int E, int M>
__device__ __forceinline__ u32 assemble_value(u32 r, u32 e) {
    return ((r >> M) << (E + M)) | (e << M) | (r & ((1u << M) - 1u));
}

// The exponents of a listed group from its codes (word), its code-7 marks (sevens: bit 3j for
// value j) and its second-level indices (sec, 3 bits each in value order): value j's exponent is
// tab[k * D + its channel] with k its code, or for a code 7, 7 plus the group's next index.
// Branch-free: KV has a code-7 value in about every other group.  NO_WRAP (D >= 8): the group's
// channels are base..base+7, so value j's entry is at a constant offset j from row k.
template <bool NO_WRAP>
__device__ __forceinline__ void listed_exponents(u32 word, u32 sevens, u32 sec, const u8* tab, u32 base, int D, u32 DM,
                                                 u32 e[8]) {
    const u8* t = NO_WRAP ? tab + base : tab;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const u32 code = (word >> (3 * j)) & 7u, seven = (sevens >> (3 * j)) & 1u;
        const u32 k = code + (sec & (0u - seven) & 7u);
        sec >>= 3 * seven;
        e[j] = NO_WRAP ? t[k * D + j] : tab[k * D + ((base + j) & DM)];
    }
}

// Two BF16 values (one output word) from four rest bytes (half 0: bytes 0, 1; half 1: bytes 2, 3)
// and their exponents: each value's sign (bit 7 of its rest byte) to bit 15, exponent to bits
// 7-14, mantissa (bits 0-6) in place.  A pair at a time: one output word, its two bytes of rest
// and two exponents placed by byte permutes (benchmarks/NOTES.md r3).
__device__ __forceinline__ u32 bf16_pair(u32 rest4, int half, u32 e0, u32 e1) {
    const u32 rr = __byte_perm(rest4, 0u, half ? 0x4342u : 0x4140u);  // [r_a, 0, r_b, 0]
    const u32 ee = __byte_perm(e0, e1, 0x5410u);                        // [e_a, 0, e_b, 0]
    return (rr & 0x007F007Fu) | (ee << 7) | ((rr << 8) & 0x80008000u);
}

// A group's values from its raw rest fields and exponents, stored (the values before n).
template <int E, int M, typename T>
__device__ __forceinline__ void store_values(T* __restrict__ dst, long long n, long long g, const RestRaw<M + 1>& rr,
                                             const u32 e[8]) {
    constexpr u32 MMASK = (1u << M) - 1u;
    if constexpr (E == 8 && M == 7) {
        const u32 lo = (u32)rr.q[0], hi = (u32)(rr.q[0] >> 32);
        const uint4 w = make_uint4(bf16_pair(lo, 0, e[0], e[1]), bf16_pair(lo, 1, e[2], e[3]),
                                   bf16_pair(hi, 0, e[4], e[5]), bf16_pair(hi, 1, e[6], e[7]));
        if (g * 8 + 8 <= n) {
            *reinterpret_cast<uint4*>(dst + g * 8) = w;
        } else {
            const u32 words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
            for (int j = 0; j < 8; j++) if (g * 8 + j < n) dst[g * 8 + j] = (T)(words[j >> 1] >> (16 * (j & 1)));
        }
    } else if constexpr (sizeof(T) == 1) {  // FP8, four values a word: the rest fields spread to bytes
        constexpr u32 ONES = 0x01010101u;
        const u32 bits = (u32)rr.q[0];
        u32 w[2];
#pragma unroll
        for (int k = 0; k < 2; k++) {
            const u32 r4 = M + 1 == 3 ? unpack3x4(bits >> (12 * k)) : unpack4x4(bits >> (16 * k));
            const u32 e4 = e[4 * k] | (e[4 * k + 1] << 8) | (e[4 * k + 2] << 16) | (e[4 * k + 3] << 24);
            w[k] = ((r4 & (ONES << M)) << E) | (e4 << M) | (r4 & (ONES * MMASK));  // sign: bit M -> bit 7
        }
        if (g * 8 + 8 <= n) {
            *reinterpret_cast<uint2*>(dst + g * 8) = make_uint2(w[0], w[1]);
        } else {
#pragma unroll
            for (int j = 0; j < 8; j++) if (g * 8 + j < n) dst[g * 8 + j] = (T)(w[j >> 2] >> (8 * (j & 3)));
        }
    } else {
        u32 r[8], v[8];
        unpack_rest<M + 1>(rr, r);
#pragma unroll
        for (int j = 0; j < 8; j++) v[j] = assemble_value<E, M>(r[j], e[j]);
        store_group(dst, n, g, v);
    }
}

// grid-stride over the chunks before result[0]'s (kvz_ch_scan's first bad count), a warp a
// chunk.  A chunk's error (its code-7 values against its second-level count, then its escapes in
// order: position, then exponent) goes to result[0] by atomicMin of 8 c + code, so the error
// kept is the lowest chunk's, as the CPU reference reports it.  dst: 16-byte aligned.
// Blocks an SM the decoder's registers must allow: BF16's keeps 6 (40 registers, as it had before
// the one scan a step, and no spills); the other formats would spill at 40, so 0 leaves them the
// compiler's choice.
template <int E, int M>
constexpr int CH_DECODE_MIN_BLOCKS = E == 8 && M == 7 ? 6 : 0;
template <int E, int M, typename T, int GPL>
__global__ void __launch_bounds__(WARPS * 32, CH_DECODE_MIN_BLOCKS<E, M>) kvz_ch_decode(const u8* __restrict__ codes, const u8* __restrict__ rest,
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
    const int lane = threadIdx.x & 31, gpc = chunk >> 3;
    // kvz_ch_scan's error, or a lower one another warp has found since: lane 0's reading for the
    // whole warp, so that every lane runs the same chunks (the warp's ballots need all 32).
    const u64 first_bad = __shfl_sync(FULL_MASK, lane == 0 ? result[0] : 0ull, 0);
    const long long stop = first_bad == ~0ull ? nchunks : min(nchunks, (long long)(first_bad / 8));
    const long long G = (n + 7) >> 3;
    for (long long c = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5); c < stop; c += (long long)gridDim.x * WARPS) {
        const long long g0 = c * gpc;
        const int ng = (int)min((long long)gpc, G - g0);
        const u32 cnt = esc_count[c], want = sec_count[c];
        const bool plane = cnt == PLANE;
        const u8* __restrict__ run = sec_codes + offsets[c];
        const u8* __restrict__ highs = exp_high + offsets[2 * nchunks + c];
        int hits = 0;  // the chunk's code-7 values so far (warp-uniform)
        if (plane) {  // rare in KV: codes hold each exponent's low 3 bits, exp_high the rest
            for (int s0 = 0; s0 < ng; s0 += 32) {
                const int gi = s0 + lane;
                const bool valid = gi < ng;
                u32 r[8], v[8];
                get_rest<R>(rest, g0 + gi, g0 + s0, r, s0 + 32 <= ng, valid, lane);
                const u32 word = valid ? get24(codes, g0 + gi) : 0u;
                u64 high = 0;
#pragma unroll
                for (int k = 0; k < HB; k++) high |= valid ? (u64)highs[HB * gi + k] << (8 * k) : 0ull;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const u32 e = ((word >> (3 * j)) & 7u) | ((((u32)(high >> (HB * j))) & ((1u << HB) - 1u)) << 3);
                    v[j] = assemble_value<E, M>(r[j], e);
                }
                if (valid) store_group(dst, n, g0 + gi, v);
            }
        } else {
            for (int s0 = 0; s0 < ng; s0 += STEP) {
                u32 word[GPL];
                RestRaw<R> rr[GPL];
#pragma unroll
                for (int q = 0; q < GPL; q++) {  // the step's loads first
                    const int first = s0 + q * 32, gi = first + lane;
                    const bool valid = gi < ng, whole = first + 32 <= ng;
                    word[q] = valid ? get24(codes, g0 + gi) : 0u;
                    get_rest_raw<R>(rest, g0 + gi, g0 + first, rr[q], whole, valid, lane);
                }
                // bit 3j of sevens[q]: value j's code is 7 (values past n: padding, not counted)
                u32 sevens[GPL], packed = 0, sums;
#pragma unroll
                for (int q = 0; q < GPL; q++) {
                    const long long g = g0 + s0 + q * 32 + lane;
                    const int left = s0 + q * 32 + lane < ng ? (int)min(8ll, n - g * 8) : 0;
                    sevens[q] = word[q] & (word[q] >> 1) & (word[q] >> 2) & 0x249249u & ((1u << (3 * left)) - 1u);
                    packed |= (u32)__popc(sevens[q]) << (16 * q);
                }
                const u32 before = warp_exclusive_pair(packed, lane, &sums);
#pragma unroll
                for (int q = 0; q < GPL; q++) {
                    const int first = s0 + q * 32, gi = first + lane;
                    const long long g = g0 + gi;
                    const int nsev = __popc(sevens[q]);
                    const int t = hits + (int)((before >> (16 * q)) & 0xFFFFu) + (q ? (int)(sums & 0xFFFFu) : 0);
                    // the group's indices, unless the run is shorter (an error: hits != want below)
                    const u32 sec = nsev && t + nsev <= (int)want ? read_bits(run, 3 * t, 3 * nsev) : 0u;
                    const u32 base = (u32)(g << 3) & DM;
                    u32 e[8];
                    if (D >= 8) listed_exponents<true>(word[q], sevens[q], sec, tab, base, D, DM, e);
                    else listed_exponents<false>(word[q], sevens[q], sec, tab, base, D, DM, e);
                    if (gi < ng) store_values<E, M, T>(dst, n, g, rr[q], e);
                }
                hits += (int)(sums & 0xFFFFu) + (int)(sums >> 16);
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
