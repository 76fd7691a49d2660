// The escape record in both directions: kvz_encode's per-chunk slots, kvz_scan's moves and
// checks, and kvz_decode's loads and patches.
#pragma once

#include "common.cuh"
#include "abi.cuh"
#include "formats.cuh"
#include "header.cuh"

// kvz_encode: a step's escapes (lane l's group q holds values p0 + 256 q .. + 7 of the chunk, p0 =
// 8 l plus the step's first position; m[q] bit j: value j is an escape) to the chunk's slot after
// the count already there, in position order (group q's lanes after group q - 1's); returns the
// new count (every lane).  Places past `slot` are dropped: a chunk that lists more is plane-coded
// (the slot holds a third of its high bytes, programs.slot_size).
// Each lane's place in each group comes first, for all the step's groups at once: when no lane
// holds two escapes in one group (at 1 % escapes, 7 steps in 10) it is a ballot's population count
// below the lane, otherwise the lanes' counts, 8 bits a group (at most 8 a lane, so at most 248
// below it), go through one shuffle scan for all the groups.  Then each lane stores its first
// escape of each group (slot_first) with no warp-wide step between the groups, and the lanes that
// hold more go on in a loop (benchmarks/NOTES.md, e5).
template <int E, int M, typename T>
__device__ __forceinline__ void slot_first(const Raw<T>& v, u32 m, int p, int idx, int slot, u16* __restrict__ spos,
                                           u8* __restrict__ sexp) {
    const int j = __ffs(m) - 1;
    if (m != 0u && idx < slot) {
        spos[idx] = (u16)(p + j);
        sexp[idx] = (u8)(exponent_bytes<E, M>(v) >> (8 * j));
    }
}
template <int E, int M, typename T, int GPL>
__device__ __forceinline__ int step_escapes(const Raw<T> (&v)[GPL], const u32 (&m)[GPL], int p0, int count, int slot,
                                            u16* __restrict__ spos, u8* __restrict__ sexp, int lane) {
    u32 several = 0;
#pragma unroll
    for (int q = 0; q < GPL; q++) several |= m[q] & (m[q] - 1u);
    if (!__any_sync(FULL_MASK, several != 0u)) {
        const u32 below = (1u << lane) - 1u;
        u32 some[GPL];
#pragma unroll
        for (int q = 0; q < GPL; q++) some[q] = __ballot_sync(FULL_MASK, m[q] != 0u);
#pragma unroll
        for (int q = 0; q < GPL; q++) {
            if (some[q] == 0u) continue;  // warp-uniform: a step of few escapes skips most groups
            slot_first<E, M>(v[q], m[q], p0 + 256 * q, count + __popc(some[q] & below), slot, spos, sexp);
            count += __popc(some[q]);
        }
        return count;
    }
    constexpr int NW = (GPL + 3) / 4;  // words of packed counts
    u32 k[NW], x[NW];
#pragma unroll
    for (int w = 0; w < NW; w++) k[w] = 0;
#pragma unroll
    for (int q = 0; q < GPL; q++) k[q / 4] |= (u32)__popc(m[q]) << (8 * (q % 4));
#pragma unroll
    for (int w = 0; w < NW; w++) {
        x[w] = k[w];
#pragma unroll
        for (int d = 1; d < 32; d <<= 1) {
            const u32 y = __shfl_up_sync(FULL_MASK, x[w], d);
            if (lane >= d) x[w] += y;
        }
        // exclusive: exact, the sums being exact modulo 2^32 (only lane 31's inclusive field can
        // reach 256), and every exclusive field <= 248, so each stays in its byte
        x[w] -= k[w];
    }
#pragma unroll
    for (int w = 0; w < NW; w++) {
        // lane 31's fields: the warp's escapes in group q are its exclusive count plus its own
        const u32 xl = __shfl_sync(FULL_MASK, x[w], 31), kl = __shfl_sync(FULL_MASK, k[w], 31);
#pragma unroll
        for (int q = 4 * w; q < GPL && q < 4 * w + 4; q++) {
            const int f = 8 * (q % 4), p = p0 + 256 * q;
            int idx = count + (int)((x[w] >> f) & 0xFFu);
            slot_first<E, M>(v[q], m[q], p, idx, slot, spos, sexp);
            count += (int)((xl >> f) & 0xFFu) + (int)((kl >> f) & 0xFFu);
            u32 more = m[q] & (m[q] - 1u);
            if (more) {  // the group's second escape and on
                const u64 ex = exponent_bytes<E, M>(v[q]);
                do {
                    const int j = __ffs(more) - 1;
                    if (++idx < slot) {
                        spos[idx] = (u16)(p + j);
                        sexp[idx] = (u8)(ex >> (8 * j));
                    }
                    more &= more - 1u;
                } while (more);
            }
        }
    }
    return count;
}

// The chunk of a scan block holding the block's escape k: the last with s_eoff <= k (s_eoff:
// escapes before each of the block's chunks; a chunk holding escape k has escapes, so k < its
// offset + count).  check_block_escapes (load_slot_escapes makes the same search, interleaved).
__device__ __forceinline__ int chunk_of_escape(const u32* s_eoff, u32 k) {
    int lo = 0, hi = SB_CHUNKS - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (s_eoff[mid] <= k) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// kvz_scan's encode: escapes k, k + SB_CHUNKS, .. (MOVE_BATCH of them, those below listed) of a
// block, read from their chunks' slots into pos / ex; returns a bit per escape read.  s_eoff:
// escapes before each of the block's chunks (a plane-coded chunk lists none, so no escape's search
// ends on one: the chunk after it has the same offset); c0: the block's first chunk.
// The escapes go MOVE_GROUP at a time: a group's chunk searches run interleaved, step by step (a
// search is log2 SB_CHUNKS dependent shared-memory reads, the same steps for every escape, so no
// branch between them), and its loads are issued before the next group's searches, so a thread
// waits for one shared-memory read a step of a group, not a step of each escape, and has all its
// MOVE_BATCH escapes' loads in flight at once (at 1 % escapes a block of 4096-value chunks holds
// ~11 000: three rounds; benchmarks/NOTES.md, e5).  A group wholly past listed ends the batch.
#define MOVE_BATCH 16
#define MOVE_GROUP 4
static_assert((SB_CHUNKS & (SB_CHUNKS - 1)) == 0 && MOVE_BATCH % MOVE_GROUP == 0, "halving search, whole groups");
__device__ __forceinline__ u32 load_slot_escapes(u32 k0, u32 listed, const u32* s_eoff, int slot,
                                            long long c0, const u16* slot_pos, const u8* slot_exp,
                                            u16 pos[MOVE_BATCH], u8 ex[MOVE_BATCH]) {
    assume_global(slot_pos); assume_global(slot_exp);
    u32 loaded = 0;
#pragma unroll
    for (int g = 0; g < MOVE_BATCH; g += MOVE_GROUP) {
        if (k0 + g * SB_CHUNKS >= listed) break;
        // the chunk holding escape k: the last with s_eoff <= k (s_eoff[0] = 0 <= k; s_eoff is
        // nondecreasing), as chunk_of_escape finds it
        int lo[MOVE_GROUP];
#pragma unroll
        for (int u = 0; u < MOVE_GROUP; u++) lo[u] = 0;
#pragma unroll
        for (int step = SB_CHUNKS / 2; step > 0; step >>= 1) {
#pragma unroll
            for (int u = 0; u < MOVE_GROUP; u++)
                if (s_eoff[lo[u] + step] <= k0 + (g + u) * SB_CHUNKS) lo[u] += step;
        }
#pragma unroll
        for (int u = 0; u < MOVE_GROUP; u++) {
            const u32 k = k0 + (g + u) * SB_CHUNKS;
            if (k < listed) {
                const long long at = (c0 + lo[u]) * slot + (k - s_eoff[lo[u]]);
                pos[g + u] = slot_pos[at];
                ex[g + u] = slot_exp[at];
                loaded |= 1u << (g + u);
            }
        }
    }
    return loaded;
}

// kvz_scan's encode: a plane-coded chunk's len high bytes (HB a group) from its slot, where
// kvz_encode left them (encode.cu, plane_pass: bytes [0, 2 slot) in the slot's positions, the
// rest in its exponents), to dst in exp_high, by the warp.  The slot's two parts start on 16-byte
// boundaries (slot is a multiple of 16; the workspace regions start on 256), exp_high too, and
// every chunk before the tensor's last is whole, so dst is 16-byte aligned when a chunk's high
// bytes, HB * gpc, are a multiple of 16 (chunks of 128 values up): whole 16-byte words then.
template <int HB>
__device__ __forceinline__ void place_plane_high(u8* __restrict__ dst, const u16* __restrict__ slot_pos,
                                                 const u8* __restrict__ slot_exp, int slot, int gpc, int len,
                                                 int lane) {
    const u8* a = reinterpret_cast<const u8*>(slot_pos);
    const int split = 2 * slot;
    int k = lane;
    if ((HB * gpc) % 16 == 0) {
        const uint4* a16 = reinterpret_cast<const uint4*>(a);
        const uint4* b16 = reinterpret_cast<const uint4*>(slot_exp);
        for (; k < len / 16; k += 32) reinterpret_cast<uint4*>(dst)[k] = k < split / 16 ? a16[k] : b16[k - split / 16];
        k = len / 16 * 16 + lane;
    }
    for (; k < len; k += 32) dst[k] = k < split ? a[k] : slot_exp[k - split];
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
    // KVZ_CHECK_BATCH escapes a round, their searches and loads independent of one another.
    u32 bad = 0;
    const long long end = min((long long)listed, n_esc - esc_base);  // block-relative escapes to read
    for (long long k0 = threadIdx.x; k0 < end && !bad; k0 += KVZ_CHECK_BATCH * SB_CHUNKS) {
        int len[KVZ_CHECK_BATCH], pos[KVZ_CHECK_BATCH], prev[KVZ_CHECK_BATCH];
        u32 e[KVZ_CHECK_BATCH];
#pragma unroll
        for (int u = 0; u < KVZ_CHECK_BATCH; u++) {
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
        for (int u = 0; u < KVZ_CHECK_BATCH; u++) {
            if (bad || len[u] == 0) continue;
            if (pos[u] >= len[u] || pos[u] <= prev[u]) bad = 3;
            else if (e[u] >= (1u << E)) bad = 4;
        }
    }
    if (bad) set_error(err, bad);
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

// A chunk's escapes, 32 at a time in registers: lane k holds escape base + k (position within the
// chunk, or NONE past the end, and its exponent).  request_escapes loads them, check_escapes checks
// them (load_escapes: both).
#define NONE 0x7FFFFFFF
__device__ __forceinline__ void request_escapes(const DecodeJob& J, long long off, int base, int cnt, int lane, int& pos,
                                                u32& exp) {
    const int k = base + lane;
    pos = NONE;
    exp = 0;
    if (k < cnt) { pos = J.esc_pos[off + k]; exp = J.esc_exp[off + k]; }
}

// The checks of load_escapes on a round in registers (lane k: escape base + k): positions inside
// the chunk (len values) and above the one before (before: the previous round's last; -1 for the
// chunk's first), exponents in range.  A broken round sets *err (3: position, 4: exponent; the
// first broken escape's), leaves pos NONE in every lane and returns false.
template <int E>
__device__ __forceinline__ bool check_escapes(int base, int cnt, int len, int before, int lane, int& pos, u32 exp,
                                              u64* err) {
    const int k = base + lane;
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

// Lane k's escape base + k, loaded and checked: positions inside the chunk and strictly
// increasing, exponents in range.
template <int E>
__device__ __forceinline__ bool load_escapes(const DecodeJob& J, long long off, int base, int cnt, int len, int before,
                                             int lane, int& pos, u32& exp, u64* err) {
    request_escapes(J, off, base, cnt, lane, pos, exp);
    return check_escapes<E>(base, cnt, len, before, lane, pos, exp, err);
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

// The escape-heavy decoder's round asked for ahead (decode.cu, decode_chunk<..., SCATTER>): lane k's
// escape base + k as one word, position << 8 | exponent (positions are 16-bit, exponents 8-bit), or
// NO_ESCAPE past cnt: one register, not request_escapes' two, held across a step's decode, where
// the decoders' registers run out first.
#define NO_ESCAPE 0xFFFFFFFFu
__device__ __forceinline__ u32 request_escape_word(const DecodeJob& J, long long off, int base, int cnt, int lane) {
    const int k = base + lane;
    return k < cnt ? (u32)J.esc_pos[off + k] << 8 | J.esc_exp[off + k] : NO_ESCAPE;
}

// kvz_decode's escape-heavy chunks (decode.cu, decode_chunk<..., SCATTER>): the escapes at
// positions in [lo, hi) written over their values in a step's stage (the step's values in shared
// memory, value lo at stage[0]), each by the lane holding it, 32 a round and no broadcast.  The
// lanes hold a round (pos, exp: checked) and the round after it already asked for (next:
// request_escape_word, not yet checked), so the step that needs it finds its loads done; when the
// lanes' round runs out below hi the next one is checked and taken, and the one after asked for.
// Broken escapes (check_escapes sets *err) drop the chunk's rest: cnt = 0.
template <int E, int M, typename T>
__device__ __forceinline__ void patch_staged_escapes(const DecodeJob& J, long long esc_off, int lo, int hi, int len,
                                                     int lane, int& base, int& cnt, int& pos, u32& exp, u32& next,
                                                     u64* err, T* stage) {
    while (true) {
        if (pos >= lo && pos < hi) stage[pos - lo] = (T)with_exponent<E, M>(stage[pos - lo], exp);
        const int last = __shfl_sync(FULL_MASK, pos, 31);
        if (last >= hi || base + 32 >= cnt) return;
        base += 32;
        pos = next == NO_ESCAPE ? NONE : (int)(next >> 8);
        exp = next & 0xFFu;
        if (!check_escapes<E>(base, cnt, len, last, lane, pos, exp, err)) { cnt = 0; return; }
        next = request_escape_word(J, esc_off, base + 32, cnt, lane);
    }
}
