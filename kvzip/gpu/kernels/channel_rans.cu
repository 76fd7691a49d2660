// ChannelRans (the storage mode, docs/format.md section 16) on the device: the same bytes as the
// CPU reference (stages/channel_rans_cpu.py), launched by kvzip/gpu/channel_rans.py.
//
// Encode: kvz_rans_histogram counts every value's exponent per channel, kvz_rans_tables
// (rans_tables.cuh) turns the counts into the tables stream and the RansTables words with the
// writer's rule of stages/channel_rans.py, kvz_rans_encode codes a chunk a warp into per-chunk
// slots, kvz_rans_offsets scans the counts and kvz_rans_compact moves every chunk's runs to their
// place.  Decode: kvz_rans_offsets
// computes the offsets from the two count streams and checks them, kvz_rans_decode decodes the
// chunks before the first bad count with every check of 16.3.
//
// A warp a chunk, lane l holding the state of the chunk's values j = l (mod 32), as the format's
// interleaving intends: a step is the warp's 32 consecutive values, one a lane, and a word
// read or written a step is placed by a ballot's prefix count.  The chunk is walked in blocks
// of RANS_BLOCK values: a group pass (lane l takes the block's group l of 8 values: whole-group
// loads and stores, the rest fields) and the 8 rANS steps meet in a per-warp shared buffer of
// the block's exponents.

#include "group_io.cuh"

#define RANS_PROB_BITS 12
#define RANS_SLOT_MASK 4095u
#define RANS_TOTAL 4096u
#define RANS_LOW 65536u              // a state lies in [RANS_LOW, 2**32) between symbols
#define RANS_BOUND_SHIFT 20          // 32 - PROB_BITS: x encodes a symbol of frequency f iff x < f << 20
#define RANS_WARPS 4                 // warps a block of the encoder and decoder (channel_rans.py: THREADS)
#define RANS_BLOCK 256               // values between group passes: a group of 8 a lane
#define RANS_SCAN_THREADS 1024       // kvz_rans_offsets: one block
#define RANS_HIST_THREADS 256
#define RANS_HIST_COUNTERS 8192      // kvz_rans_histogram's shared counters: (channels of a slice) << E
#define RANS_NO_ERROR 0xFFFFFFFFFFFFFFFFull

#include "rans_tables.cuh"  // kvz_rans_tables (uses RANS_TOTAL)

// ------------------------------------------------------------------ tables
// The tables as kvzip/gpu/channel_rans.py's device_tables lays them out (words, in shared memory):
// desc[2 g] = off_g, the index in cum of group g's first entry; desc[2 g + 1] = lo_g | width_g << 8
// | F_g[ESC] << 20 (width_g = hi_g - lo_g + 1); cum[off_g + k], k = 0 .. width_g + 1: the first slot
// of symbol k (0 the escape, k >= 1 the exponent lo_g + k - 1: the slot order of 16.2), then
// TOTAL.  An exponent inside [lo_g, hi_g] may have frequency 0 (equal neighbours in cum).
struct RansGroup {
    u32 off, lo, width, fesc;
};

__device__ __forceinline__ RansGroup rans_group(const u32* desc, u32 g) {
    const u32 d = desc[2 * g + 1];
    return {desc[2 * g], d & 0xFFu, (d >> 8) & 0x1FFu, d >> 20};
}

// What the encoder and decoder keep in shared memory: the tables (desc, cum; dynamic shared
// memory, copied from the words of `tables` by the whole block, which has returned only once they
// are all there) and this warp's buffer of a block's exponents, a byte each.
struct RansShared {
    const u32* desc;
    const u16* cum;
    u8* exps;
};
__device__ __forceinline__ RansShared rans_shared(const u32* __restrict__ tables, int words, int ngroups) {
    extern __shared__ u32 rans_tables[];
    __shared__ u64 block_exps[RANS_WARPS][RANS_BLOCK / 8];
    for (int i = threadIdx.x; i < words; i += blockDim.x) rans_tables[i] = tables[i];
    __syncthreads();
    return {rans_tables, reinterpret_cast<const u16*>(rans_tables + 2 * ngroups),
            reinterpret_cast<u8*>(block_exps[threadIdx.x >> 5])};
}

// The symbol exponent e codes as in group t: (frequency, first slot, escaped?).
struct RansSymbol {
    u32 f, start;
    bool esc;
};
__device__ __forceinline__ RansSymbol encode_symbol(const u16* cum, const RansGroup& t, u32 e) {
    const u32 k = e - t.lo < t.width ? e - t.lo + 1u : 0u;  // unsigned: below lo wraps past width
    const u32 c0 = cum[t.off + k], f = (u32)cum[t.off + k + 1] - c0;
    if (k == 0 || f == 0) return {t.fesc, 0u, true};
    return {f, c0, false};
}

// The group of value i: its channel's (channels a power of two, DM = channels - 1) >> shift.
__device__ __forceinline__ u32 group_of(long long i, u32 DM, int shift) { return ((u32)i & DM) >> shift; }

// ------------------------------------------------------------------ histogram
// grid: slices * parts blocks, RANS_HIST_THREADS threads.  hist[(channel << E) | e] (zeroed) += the
// values of the channel with exponent e, every value counted (channel_rans_cpu.histogram).  Block b
// takes the slice of S = slice_channels channels b % slices (S << E <= RANS_HIST_COUNTERS shared
// counters, laid out [e][channel of the slice] so a warp's distinct channels hit distinct banks)
// and the part b / slices of its values (per_block of them, a multiple of the block), visited
// channel-fastest: consecutive threads read consecutive values of a row of `channels`.
template <int E, int M, typename T>
__global__ void __launch_bounds__(RANS_HIST_THREADS) kvz_rans_histogram(const T* __restrict__ src, long long n,
                                                                         int channels, int slice_channels,
                                                                         long long per_block, u32* __restrict__ hist) {
    __shared__ u32 counts[RANS_HIST_COUNTERS];
    const int S = slice_channels, slices = channels / S, log_s = __ffs(S) - 1;
    const int slice = blockIdx.x % slices;
    // the slice's values: S a whole row of `channels`, and those of a last, partial row
    const long long part = blockIdx.x / slices,
                    slice_values = (n / channels) * S + min((long long)S, max(0ll, n % channels - slice * S));
    for (int i = threadIdx.x; i < (S << E); i += blockDim.x) counts[i] = 0;
    __syncthreads();
    const long long u1 = min(slice_values, (part + 1) * per_block);
    for (long long u = part * per_block + threadIdx.x; u - threadIdx.x < u1; u += blockDim.x) {
        const int s = (int)(u & (S - 1));
        const long long i = (u >> log_s) * channels + slice * S + s;
        const bool in = u < u1 && i < n;
        const u32 key = in ? ((((u32)src[i] >> M) & ((1u << E) - 1u)) * (u32)S + (u32)s) : 0xFFFFFFFFu;
        if (S >= 32) {  // the warp's lanes read 32 distinct channels: distinct counters
            if (in) atomicAdd(counts + key, 1u);
        } else {        // lanes share channels (and KV's exponents): one atomic a distinct key
            const u32 same = __match_any_sync(FULL_MASK, key);
            if (in && (threadIdx.x & 31) == __ffs(same) - 1) atomicAdd(counts + key, (u32)__popc(same));
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < (S << E); i += blockDim.x) {
        const u32 c = counts[i];
        if (c) atomicAdd(hist + (((u32)(slice * S + (i & (S - 1))) << E) | (u32)(i / S)), c);
    }
}

// ------------------------------------------------------------------ encode
// grid-stride over chunks, a warp a chunk; dynamic shared memory: the tables (table_words words).
// Chunk c (values [c C, c C + len_c)) writes its rest fields and LANES states in place, its words
// backward from the end of its slot [c C, c C + len_c) of word_slots (so they lie in reading
// order: a chunk emits at most one word a value) and its escapes likewise in esc_slots (in value
// order), and the two counts; kvz_rans_compact moves the runs from the slots' ends.
// src: 16-byte aligned.
template <int E, int M, typename T>
__global__ void __launch_bounds__(RANS_WARPS * 32) kvz_rans_encode(const T* __restrict__ src, long long n,
                                                                    int channels, int shift,
                                                                    const u32* __restrict__ tables, int table_words,
                                                                    int ngroups, int chunk, long long nchunks,
                                                                    u8* __restrict__ rest, u32* __restrict__ states,
                                                                    u32* __restrict__ word_count,
                                                                    u32* __restrict__ esc_count,
                                                                    u16* __restrict__ word_slots,
                                                                    u8* __restrict__ esc_slots) {
    constexpr int R = M + 1;
    constexpr u32 EMASK = (1u << E) - 1u, MMASK = (1u << M) - 1u;
    const RansShared sh = rans_shared(tables, table_words, ngroups);
    const int lane = threadIdx.x & 31;
    const u32 DM = (u32)channels - 1u, above = ~0u << lane;  // above: this lane and the ones after it
    const long long G = (n + 7) >> 3;
    for (long long c = (long long)blockIdx.x * RANS_WARPS + (threadIdx.x >> 5); c < nchunks;
         c += (long long)gridDim.x * RANS_WARPS) {
        const long long base = c * chunk;
        const int len = (int)min((long long)chunk, n - base), nblocks = (len + RANS_BLOCK - 1) / RANS_BLOCK;
        long long wp = base + len, ep = base + len;  // the next word / escape goes just below
        u32 x = RANS_LOW;
        Raw<T> v;  // the block's group of this lane, loaded one block ahead
        auto load_block = [&](int b, Raw<T>& into) {
            const long long g = (base + (long long)b * RANS_BLOCK) / 8 + lane;
            if (g < G && g * 8 < base + len) load_raw(src, n, g, into);
        };
        load_block(nblocks - 1, v);
        for (int b = nblocks - 1; b >= 0; b--) {
            const long long b0 = base + (long long)b * RANS_BLOCK, g = b0 / 8 + lane;
            const int blen = min(RANS_BLOCK, len - b * RANS_BLOCK);
            const bool valid = lane * 8 < blen;
            Raw<T> next;
            if (b > 0) load_block(b - 1, next);
            if (valid) {  // the group pass: rest fields in place, exponents to the warp's buffer
                u32 r[8];
                u64 e8 = 0;
#pragma unroll
                for (int j = 0; j < 8; j++) {
                    const u32 val = g * 8 + j < n ? raw_value(v, j) : 0u;
                    r[j] = ((val >> (E + M)) << M) | (val & MMASK);
                    e8 |= (u64)((val >> M) & EMASK) << (8 * j);
                }
                store_rest<R>(rest, g, r);
                *reinterpret_cast<u64*>(sh.exps + 8 * lane) = e8;
            }
            __syncwarp();
            for (int s = (blen + 31) / 32 - 1; s >= 0; s--) {  // the block's steps, last first
                const int j = 32 * s + lane;
                const bool live = j < blen;
                const u32 e = sh.exps[j];
                RansSymbol sym = {1u, 0u, false};
                if (live) sym = encode_symbol(sh.cum, rans_group(sh.desc, group_of(b0 + j, DM, shift)), e);
                const bool emit = live && x >= (sym.f << RANS_BOUND_SHIFT);
                const u32 out = __ballot_sync(FULL_MASK, emit);
                if (emit) {  // the lanes' words in value order below wp
                    word_slots[wp - __popc(out & above)] = (u16)(x & 0xFFFFu);
                    x >>= 16;
                }
                wp -= __popc(out);
                if (live) {
                    const u32 q = x / sym.f;
                    x = (q << RANS_PROB_BITS) + (x - q * sym.f) + sym.start;
                }
                const u32 esc = __ballot_sync(FULL_MASK, live && sym.esc);
                if (esc) {  // rare
                    if (live && sym.esc) esc_slots[ep - __popc(esc & above)] = (u8)e;
                    ep -= __popc(esc);
                }
            }
            __syncwarp();  // the buffer's exponents read before the next block's pass writes it
            v = next;
        }
        states[c * 32 + lane] = x;
        if (lane == 0) {
            word_count[c] = (u32)(base + len - wp);
            esc_count[c] = (u32)(base + len - ep);
        }
    }
}

// ------------------------------------------------------------------ offsets
// One block of RANS_SCAN_THREADS; thread t takes a range of chunks, sums its counts, a block scan
// gives each range its start and a second walk writes offsets[c] / offsets[nchunks + c] (chunk
// c's first word / escape).  checked (decode): each chunk's counts against its length and the
// streams' lengths in channel_rans_cpu._decode_offsets's order, the lowest failing chunk's 8 c +
// code kept; none failing, the totals'.  result: [0] 8 c + code of the first error or
// RANS_NO_ERROR, [1] the chunks before the first bad count (the ones kvz_rans_decode decodes),
// [2], [3] the words' and escapes' totals.
__global__ void __launch_bounds__(RANS_SCAN_THREADS) kvz_rans_offsets(const u32* __restrict__ word_count,
                                                                       const u32* __restrict__ esc_count,
                                                                       long long nchunks, long long n, int chunk,
                                                                       int checked, long long n_words, long long n_esc,
                                                                       long long* __restrict__ offsets,
                                                                       u64* __restrict__ result) {
    __shared__ long long warp_sums[2][32];
    __shared__ u64 first;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long per = (nchunks + RANS_SCAN_THREADS - 1) / RANS_SCAN_THREADS;
    const long long c0 = min(nchunks, (long long)threadIdx.x * per), c1 = min(nchunks, c0 + per);
    if (threadIdx.x == 0) first = RANS_NO_ERROR;
    long long mine[2] = {0, 0};
    for (long long c = c0; c < c1; c++) { mine[0] += word_count[c]; mine[1] += esc_count[c]; }
    long long at[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const long long inc = warp_inclusive_sum(mine[k], lane);
        if (lane == 31) warp_sums[k][warp] = inc;
        at[k] = inc - mine[k];
    }
    __syncthreads();
    if (warp == 0) {
#pragma unroll
        for (int k = 0; k < 2; k++) warp_sums[k][lane] = warp_inclusive_sum(warp_sums[k][lane], lane);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < 2; k++) at[k] += warp ? warp_sums[k][warp - 1] : 0;
    u64 err = RANS_NO_ERROR;
    for (long long c = c0; c < c1; c++) {
        const long long w = word_count[c], k = esc_count[c], len = min((long long)chunk, n - c * chunk);
        if (checked && err == RANS_NO_ERROR) {
            const int code = (w > len || at[0] + w > n_words) ? 2 : (k > len || at[1] + k > n_esc) ? 3 : 0;
            if (code) err = 8ull * (u64)c + (u64)code;
        }
        offsets[c] = at[0];
        offsets[nchunks + c] = at[1];
        at[0] += w;
        at[1] += k;
    }
    if (err != RANS_NO_ERROR) atomicMin(&first, err);
    __syncthreads();
    if (threadIdx.x == 0) {
        const long long words = warp_sums[0][31], escapes = warp_sums[1][31];
        u64 e = first;
        const long long stop = e == RANS_NO_ERROR ? nchunks : (long long)(e / 8);
        if (checked && e == RANS_NO_ERROR) {
            const u64 past = 8ull * (u64)nchunks;
            e = words != n_words ? past + 2 : escapes != n_esc ? past + 3 : RANS_NO_ERROR;
        }
        result[0] = e;
        result[1] = (u64)stop;
        result[2] = (u64)words;
        result[3] = (u64)escapes;
    }
}

// grid-stride over chunks, a warp a chunk: each chunk's runs from the ends of its slots
// (kvz_rans_encode) to the offsets kvz_rans_offsets found.
__global__ void __launch_bounds__(RANS_WARPS * 32) kvz_rans_compact(const u32* __restrict__ word_count,
                                                                     const u32* __restrict__ esc_count,
                                                                     long long nchunks, long long n, int chunk,
                                                                     const long long* __restrict__ offsets,
                                                                     const u16* __restrict__ word_slots,
                                                                     const u8* __restrict__ esc_slots,
                                                                     u16* __restrict__ words, u8* __restrict__ esc_exp) {
    const int lane = threadIdx.x & 31;
    for (long long c = (long long)blockIdx.x * RANS_WARPS + (threadIdx.x >> 5); c < nchunks;
         c += (long long)gridDim.x * RANS_WARPS) {
        const long long end = c * chunk + min((long long)chunk, n - c * chunk);
        const long long nw = word_count[c], ne = esc_count[c], w0 = offsets[c], e0 = offsets[nchunks + c];
        for (long long k = lane; k < nw; k += 32) words[w0 + k] = word_slots[end - nw + k];
        for (long long k = lane; k < ne; k += 32) esc_exp[e0 + k] = esc_slots[end - ne + k];
    }
}

// ------------------------------------------------------------------ decode
// The warp's window on its chunk's words: lane t holds words[at + t] (lo) and words[at + 32 + t]
// (hi), 0 past the run's end; rel (< 32) is the next word's place in the window.  A step reads
// at most 32 words, all inside the window; the window moves on by 32 once rel passes 32, loading
// its next 32 words then, so that load has the 32 words of lo to be consumed before it is waited for.
struct WordWindow {
    u32 lo, hi;
    long long at;
    int rel;
};

__device__ __forceinline__ u32 window_word(const u16* __restrict__ words, long long at, long long end) {
    return at < end ? (u32)words[at] : 0u;
}

// grid-stride over the chunks before result[1] (kvz_rans_offsets's first bad count), a warp a
// chunk; dynamic shared memory: the tables.  The checks of 16.3 in the reference's order (a
// step's values in value order: a value's word, then its escape, then the escape's exponent; the
// chunk's end: words, escapes, states); a chunk's first error goes to result[0] by atomicMin of 8
// c + code, so the error kept is the lowest chunk's, as the CPU reference reports it.  search_top:
// the largest power of two <= the widest group's symbols (width + 1): the binary search's first
// step.  dst: 16-byte aligned.
template <int E, int M, typename T>
__global__ void __launch_bounds__(RANS_WARPS * 32) kvz_rans_decode(const u8* __restrict__ rest,
                                                                    const u32* __restrict__ states,
                                                                    const u16* __restrict__ words,
                                                                    const u32* __restrict__ word_count,
                                                                    const u8* __restrict__ esc_exp,
                                                                    const u32* __restrict__ esc_count,
                                                                    const long long* __restrict__ offsets,
                                                                    const u32* __restrict__ tables, int table_words,
                                                                    int ngroups, int search_top, int channels,
                                                                    int shift, long long n, int chunk,
                                                                    long long nchunks, u64* __restrict__ result,
                                                                    T* __restrict__ dst) {
    constexpr int R = M + 1;
    constexpr u32 EMASK = (1u << E) - 1u, MMASK = (1u << M) - 1u;
    const RansShared sh = rans_shared(tables, table_words, ngroups);
    const long long stop = (long long)result[1];
    const int lane = threadIdx.x & 31;
    const u32 DM = (u32)channels - 1u, below = (1u << lane) - 1u;
    const long long G = (n + 7) >> 3;
    for (long long c = (long long)blockIdx.x * RANS_WARPS + (threadIdx.x >> 5); c < stop;
         c += (long long)gridDim.x * RANS_WARPS) {
        const long long base = c * chunk;
        const int len = (int)min((long long)chunk, n - base), nblocks = (len + RANS_BLOCK - 1) / RANS_BLOCK;
        const long long wend = offsets[c] + word_count[c], eend = offsets[nchunks + c] + esc_count[c];
        long long ep = offsets[nchunks + c];
        u32 x = states[c * 32 + lane];
        int code = __ballot_sync(FULL_MASK, x < RANS_LOW) ? 1 : 0;
        WordWindow win{0u, 0u, offsets[c], 0};
        win.lo = window_word(words, win.at + lane, wend);
        win.hi = window_word(words, win.at + 32 + lane, wend);
        RestRaw<R> rr;  // the block's rest fields of this lane's group, loaded one block ahead
        auto load_block = [&](int b, RestRaw<R>& into) {
            const long long g = (base + (long long)b * RANS_BLOCK) / 8 + lane;
            if (g < G && g * 8 < base + len) load_rest_raw<R>(rest, g, into);
        };
        if (!code) load_block(0, rr);
        for (int b = 0; b < nblocks && !code; b++) {
            const long long b0 = base + (long long)b * RANS_BLOCK;
            const int blen = min(RANS_BLOCK, len - b * RANS_BLOCK);
            RestRaw<R> next;
            if (b + 1 < nblocks) load_block(b + 1, next);
            for (int s = 0; s < (blen + 31) / 32; s++) {
                const int j = 32 * s + lane;
                const bool live = j < blen;
                const RansGroup t = rans_group(sh.desc, group_of(b0 + j, DM, shift));
                const u32 slot = x & RANS_SLOT_MASK;
                u32 k = 0, c0 = 0;  // the symbol whose slots hold slot: the last k with cum[k] <= slot
                for (int step = search_top; step; step >>= 1) {
                    const u32 kk = k + (u32)step;
                    if (kk <= t.width + 1u) {
                        const u32 ck = sh.cum[t.off + kk];
                        if (ck <= slot) { k = kk; c0 = ck; }
                    }
                }
                const u32 f = (u32)sh.cum[t.off + k + 1] - c0;
                int bad = 0;
                if (live) x = f * (x >> RANS_PROB_BITS) + slot - c0;
                const bool need = live && x < RANS_LOW;
                const u32 reads = __ballot_sync(FULL_MASK, need);
                const int total = __popc(reads), p = win.rel + __popc(reads & below);
                u32 w = __shfl_sync(FULL_MASK, win.lo, p & 31);
                if (win.rel + total > 32) {  // warp-uniform: the step reaches into hi
                    const u32 w_hi = __shfl_sync(FULL_MASK, win.hi, p & 31);
                    if (p >= 32) w = w_hi;
                }
                if (need) {
                    if (win.at + p >= wend) bad = 2;
                    x = (x << 16) | w;
                }
                win.rel += total;
                if (win.rel >= 32) {
                    win.at += 32;
                    win.rel -= 32;
                    win.lo = win.hi;
                    win.hi = window_word(words, win.at + 32 + lane, wend);
                }
                const bool esc = live && k == 0;
                u32 e = t.lo + k - 1u;
                const u32 escs = __ballot_sync(FULL_MASK, esc);
                if (escs) {  // rare
                    const long long at = ep + __popc(escs & below);
                    if (esc && !bad) {
                        if (at >= eend) {
                            bad = 3;
                        } else {
                            e = esc_exp[at];
                            const u32 i = e - t.lo;  // the exponent's frequency must be 0
                            if (e > EMASK || (i < t.width && sh.cum[t.off + i + 2] != sh.cum[t.off + i + 1])) bad = 4;
                        }
                    }
                    ep += __popc(escs);
                }
                const u32 fails = __ballot_sync(FULL_MASK, bad != 0);
                if (fails) {
                    code = __shfl_sync(FULL_MASK, bad, __ffs(fails) - 1);
                    break;
                }
                sh.exps[j] = (u8)e;
            }
            __syncwarp();
            if (code) break;
            const long long g = b0 / 8 + lane;
            if (lane * 8 < blen) {  // the group pass: exponents and rest fields to the values
                u32 r[8], out[8];
                unpack_rest<R>(rr, r);
                const u64 e8 = *reinterpret_cast<const u64*>(sh.exps + 8 * lane);
#pragma unroll
                for (int q = 0; q < 8; q++)
                    out[q] = ((r[q] >> M) << (E + M)) | ((u32)((e8 >> (8 * q)) & 0xFFu) << M) | (r[q] & MMASK);
                store_group(dst, n, g, out);
            }
            __syncwarp();  // the buffer read before the next block's steps write it
            rr = next;
        }
        if (!code) {
            code = win.at + win.rel != wend ? 2 : ep != eend ? 3 : __ballot_sync(FULL_MASK, x != RANS_LOW) ? 5 : 0;
        }
        if (code && lane == 0) atomicMin(reinterpret_cast<unsigned long long*>(result), 8ull * (u64)c + (u64)code);
        __syncwarp();
    }
}
