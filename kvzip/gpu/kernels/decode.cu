// kvz_decode, the decode's dense pass.
#pragma once

#include "common.cuh"
#include "abi.cuh"
#include "group_io.cuh"
#include "formats.cuh"
#include "escapes.cuh"

// The escape-heavy decoder's stage (decode_chunk<..., SCATTER>): a warp's step of decoded values in
// shared memory, where each escape is written over its value by the lane that holds it, before the
// step's one store of each group to dst.  BYTES: the largest step of the kernel (stage_bytes), the
// same for every step of it, so that its warps share one array.
template <int BYTES>
__device__ __forceinline__ u8* warp_stage() {
    __shared__ uint4 stage[WARPS][BYTES / 16];
    return reinterpret_cast<u8*>(stage[threadIdx.x >> 5]);
}

// The stage's size for a format and decoder shape: the larger of decode_chunk's step (32 * GPL
// groups of 8 values) and, where whole E5M2 chunks go a lane per quad, decode_e5m2_quads' step
// (32 lanes' QPL quads of 32 values).
template <int E, int M, typename T, int GPL>
__host__ __device__ constexpr int stage_bytes() {
    constexpr int groups = 32 * GPL * 8 * (int)sizeof(T);
    constexpr int quads = E == 5 && M == 2 && sizeof(T) == 1 && KVZ_E5M2_QUADS ? 32 * (GPL >= 2 ? GPL / 2 : 1) * 32 : 0;
    return groups > quads ? groups : quads;
}

// A staged group (its 8 values at staged) to dst's group i of a chunk of len values: one vector
// copy where the group is whole.
template <typename T>
__device__ __forceinline__ void unstage_group(const T* staged, T* __restrict__ dst, int len, int i) {
    if (i * 8 + 8 <= len) {
        const uint4* from = reinterpret_cast<const uint4*>(staged);
        if constexpr (sizeof(T) == 1) {
            *reinterpret_cast<uint2*>(dst + i * 8) = *reinterpret_cast<const uint2*>(staged);
        } else if constexpr (sizeof(T) == 2) {
            *reinterpret_cast<uint4*>(dst + i * 8) = from[0];
        } else {
            reinterpret_cast<uint4*>(dst + i * 8)[0] = from[0];
            reinterpret_cast<uint4*>(dst + i * 8)[1] = from[1];
        }
    } else {
        for (int j = 0; i * 8 + j < len; j++) dst[i * 8 + j] = staged[j];
    }
}

// E5M2, a whole non-plane chunk of nq quads, a lane per quad (4 consecutive groups, 32 values) and
// QPL quads a lane a step: one 16-byte codes load, the quad's 12 rest bytes as three aligned words
// and two 16-byte stores, where a lane per group took four loads, its address arithmetic and a
// store a group.  The step's values are decoded into registers first; its escapes (the chunk's,
// 32 at a time in lanes: pos, exp) then patch them there, the owning lane changing one word; then
// the stores.  Not for DQ (four 16-byte stores a lane 64 bytes apart were much slower); nor in
// the encoder, where the mirror (two 16-byte loads, the rest words through shared memory) was
// slower than store_rest24_warp's groups (benchmarks/NOTES.md, kernel source split: E5M2 quads).
// STAGED (the escape-heavy decoder's chunks, decode_chunk<..., SCATTER>): the step's words go to
// the warp's stage (STAGE_BYTES: warp_stage), its escapes are written there by the lanes holding
// them (patch_staged_escapes), and then each quad to dst.
template <int QPL, bool STAGED = false, int STAGE_BYTES = 0>
__device__ __forceinline__ void decode_e5m2_quads(const DecodeJob& J, const u8* __restrict__ codes,
                                                  const u8* __restrict__ rest, void* __restrict__ dst, int nq,
                                                  long long esc_off, int cnt, int len, u32 d0, u32 d1, u32 d2, u32 d3,
                                                  int lane, u64* err) {
    constexpr int QSTEP = 32 * QPL;
    int base = 0, pos = NONE;
    u32 exp = 0, next = NO_ESCAPE;  // next: STAGED's round asked for ahead
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
        if constexpr (STAGED) {  // the second round asked for with the first, before the first's check waits
            if (s0 == 0) next = request_escape_word(J, esc_off, 32, cnt, lane);
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
        if constexpr (STAGED) {
            u8* stage = warp_stage<STAGE_BYTES>();  // quad q * 32 + lane of the step at 32 (q * 32 + lane)
#pragma unroll
            for (int q = 0; q < QPL; q++) {
                uint4* o = reinterpret_cast<uint4*>(stage + (q * 32 + lane) * 32);
                o[0] = make_uint4(out[q][0], out[q][1], out[q][2], out[q][3]);
                o[1] = make_uint4(out[q][4], out[q][5], out[q][6], out[q][7]);
            }
            __syncwarp();  // the step staged before any lane writes an escape into another's quad
            patch_staged_escapes<5, 2, u8>(J, esc_off, s0 * 32, (s0 + QSTEP) * 32, len, lane, base, cnt, pos, exp,
                                           next, err, stage);
            __syncwarp();  // and every escape written before its quad is stored
#pragma unroll
            for (int q = 0; q < QPL; q++) {
                const int i = s0 + q * 32 + lane;
                if (i >= nq) continue;
                const uint4* from = reinterpret_cast<const uint4*>(stage + (q * 32 + lane) * 32);
                uint4* o = reinterpret_cast<uint4*>(static_cast<u8*>(dst) + i * 32);
                o[0] = from[0];
                o[1] = from[1];
            }
            continue;
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

// kvz_decode's wait for the scan's offsets (offsets_block_done).  The first warp of a block to arrive polls the scan's count; the block's other
// warps watch its word in shared memory (a poller a warp put 2000 and more loads on one L2 line).
// Acquire loads, by lane 0 before the warp's barrier, put the warp's later reads after the scan
// blocks' writes.  s_offsets: 0 nobody polls, 1 a warp polls, 2 ready (zeroed as kvz_decode starts);
// read and written by atomics with acquire and release (plain ld.acquire / st.release were right
// too, but compute-sanitizer's racecheck reports them as shared-memory races).  (Without
// __CUDA_ARCH__ each asm has a plain C++ twin: tests/cuda_host runs the kernels on the CPU.)
struct OffsetsWait {
    const u64* count;  // work[offsets_ready_at(njobs)]
    long long blocks;  // the scan's blocks
};
__shared__ u32 s_offsets;
__device__ __forceinline__ void await_offsets(OffsetsWait w) {
    if ((threadIdx.x & 31) == 0) {
        const u32 at = (u32)__cvta_generic_to_shared(&s_offsets);
        for (;;) {
            u32 state;
#ifdef __CUDA_ARCH__
            asm volatile("atom.acquire.cta.shared::cta.or.b32 %0, [%1], 0;" : "=r"(state) : "r"(at) : "memory");
#else
            state = atomicOr(&s_offsets, 0u);
#endif
            if (state == 2) break;
            if (state == 0 && atomicCAS(&s_offsets, 0u, 1u) == 0u) {
                for (;;) {
                    u64 done;
#ifdef __CUDA_ARCH__
                    asm volatile("ld.acquire.gpu.u64 %0, [%1];" : "=l"(done) : "l"(w.count) : "memory");
#else
                    done = __atomic_load_n(w.count, __ATOMIC_ACQUIRE);
#endif
                    if ((long long)done >= w.blocks) break;
                    __nanosleep(KVZ_POLL_NS);
                }
                u32 was;
#ifdef __CUDA_ARCH__
                asm volatile("atom.release.cta.shared::cta.exch.b32 %0, [%1], 2;" : "=r"(was) : "r"(at) : "memory");
#else
                was = atomicExch(&s_offsets, 2u);
#endif
                break;
            }
            __nanosleep(32);
        }
    }
    __syncwarp();
}

// A stored chunk's cnt escapes (its first at esc_off of the escape streams), each exponent written
// over its value in dst (the chunk's values, stored with code 0's exponent there) by the lane
// holding it, 32 escapes a round, checked as load_escapes checks them.
template <int E, int M, typename T>
__device__ __forceinline__ void patch_escapes(const DecodeJob& J, long long esc_off, int cnt, int len,
                                              T* __restrict__ dst, int lane, u64* err) {
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

// kvz_decode's early chunk gc of tensor job (below), its dense decode stored: wait for kvz_scan's
// offsets (await_offsets), then, unless it found the tensor broken, patch its escapes in memory.
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
    patch_escapes<E, M, T>(J, (long long)(chunk_off[gc] >> 31), cnt, len, static_cast<T*>(J.dst) + c * chunk, lane, err);
}

// kvz_decode's work on chunk gc (a batch-wide index) of tensor job, whose row is J: all its groups,
// or with part (kvz_decode's tail) a share of its steps.  EARLY:
// the warp's first chunk, which it may reach before kvz_scan is done (not for DQ, whose values
// cannot be patched after the table).  SCATTER (a whole chunk, not plane-coded, not DQ, of many
// escapes: decode_scattered_chunk): each step's values go to the warp's stage in shared memory
// (warp_stage), where the lane holding an escape writes it over its value (patch_staged_escapes:
// 32 escapes a round, where each_escape's warp-wide broadcast pays a round an escape), and then
// each group to dst, once.
template <int E, int M, typename T, int GPL, bool DQ, bool EARLY, bool SCATTER = false>
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
    const bool plane = !SCATTER && stored == PLANE;  // (kvz_decode never gives SCATTER a plane-coded chunk)
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
    u32 exp = 0, next = NO_ESCAPE;  // next: SCATTER's round asked for ahead
    constexpr int STAGE_BYTES = stage_bytes<E, M, T, GPL>();
    // this chunk's data, and group i of it at index i
    const u8* __restrict__ codes = J.codes + g0 * 4;
    const u8* __restrict__ rest = J.rest + g0 * R;
    using Out = typename Pick<DQ, u16, T>::type;
    Out* __restrict__ dst = static_cast<Out*>(J.dst) + g0 * 8;
    if constexpr (sizeof(T) == 1) {  // FP8 only: BF16 spilled with global loads and stores
        assume_global(codes); assume_global(rest); assume_global(dst);
    }
    // FP8 and float16: the chunk's codes and rest into L2 as it starts, so the steps' loads find
    // their lines there or on their way (those decoders wait on loads).  BF16 and float32 were
    // slower with it, so not theirs (benchmarks/NOTES.md, kernel source split: decode prefetch).
    // KVZ_DECODE_PREFETCH=0: off.
    if constexpr (KVZ_DECODE_PREFETCH && (sizeof(T) == 1 || (sizeof(T) == 2 && !BF16))) {
        prefetch_l2(codes, 4ll * ng, lane);
        prefetch_l2(rest, (long long)R * ng, lane);
    }
    const u16* __restrict__ table = J.dq_table;
    const u64 dlo = J.dlo, dhi = J.dhi;
    if constexpr (E5M2 && !DQ && KVZ_E5M2_QUADS) {  // whole chunks a lane per quad, GPL / 2 quads a step (as many registers)
        if (!plane && n >= chunk && (chunk & 31) == 0 && part == 0) {
            decode_e5m2_quads<GPL >= 2 ? GPL / 2 : 1, SCATTER, STAGE_BYTES>(
                J, codes, rest, dst, gpc / 4, esc_off, cnt, len, (u32)(dlo << 2), (u32)(dlo >> 30), (u32)(dhi << 2),
                (u32)(dhi >> 30), lane, err);
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
        // address waits on chunk_off; benchmarks/NOTES.md, v15).
        // (SCATTER: the second round asked for with the first, before the first's check waits)
        if constexpr (SCATTER) {
            if (s0 == 0) next = request_escape_word(J, esc_off, 32, cnt, lane);
        }
        if (s0 == 0 && cnt > 0 && !load_escapes<E>(J, esc_off, 0, cnt, len, -1, lane, pos, exp, err)) cnt = 0;
        // This step's escapes: the lanes holding positions below the step's end (earlier ones
        // were used by earlier steps).  Warp-uniform loop, a shuffle per escape.  (SCATTER: none
        // here; they are written into the stage below.)
        u32 pm[GPL];
        u64 pe[GPL];
#pragma unroll
        for (int q = 0; q < GPL; q++) { pm[q] = 0; pe[q] = 0; }
        if constexpr (!SCATTER) {
            each_escape<E>(J, esc_off, s0 * 8, (s0 + STEP) * 8, len, lane, base, cnt, pos, exp, err, [&](int p, u32 e) {
                const int rel = (p >> 3) - s0, j = p & 7;  // group within the step, value within it
#pragma unroll
                for (int q = 0; q < GPL; q++)
                    if (rel == q * 32 + lane) { pm[q] |= 1u << j; pe[q] |= (u64)e << (8 * j); }
            });
        }
        // where group i's values go: dst's group i (to_n: the values there), or (SCATTER) group
        // i - s0 of the warp's stage, always whole: a tensor's last group is decoded whole there
        // (its codes and rest are whole groups; the values past n come from their padding) and
        // unstage_group copies only its values
        Out* const to = SCATTER ? reinterpret_cast<Out*>(warp_stage<STAGE_BYTES>()) : dst;
        const int to_first = SCATTER ? s0 : 0;
        const long long to_n = SCATTER ? 8 * STEP : n;
#pragma unroll
        for (int q = 0; q < GPL; q++) {
            const int i = s0 + q * 32 + lane;
            if (i >= ng) continue;
            if constexpr (BF16) {
                if (SCATTER || i * 8 + 8 <= n) {
                    u32 out[4];
                    if (plane)  // no escapes: a plane-coded chunk codes every exponent
                        decode_bf16_plane_words(w[q], reinterpret_cast<const u32*>(high)[i], rr[q], out);
                    else
                        decode_bf16_words(w[q], rr[q], (u32)dlo, (u32)(dlo >> 32), (u32)dhi, (u32)(dhi >> 32), out);
                    if (pm[q]) patch_words<2, 7, 0xFFu>(out, pm[q], pe[q]);
                    *reinterpret_cast<uint4*>(to + (i - to_first) * 8) = make_uint4(out[0], out[1], out[2], out[3]);
                    continue;
                }
            }
            if constexpr (E5M2) {
                if (!plane && (SCATTER || i * 8 + 8 <= n)) {
                    u32 out[2];
                    decode_e5m2_words(w[q], (u32)rr[q].q[0], (u32)(dlo << 2), (u32)(dlo >> 30), (u32)(dhi << 2),
                                      (u32)(dhi >> 30), out);
                    if (pm[q]) patch_words<4, 2, 0x1Fu>(out, pm[q], pe[q]);
                    if constexpr (DQ) store_dequantized(dst + i * 8, out, table);
                    else *reinterpret_cast<uint2*>(to + (i - to_first) * 8) = make_uint2(out[0], out[1]);
                    continue;
                }
            }
            u32 v[8];
            decode_raw<E, M>(w[q], rr[q], dlo, dhi, plane, high + HB * i, v);
            patch_store<E, M, T, DQ>(to, to_n, i - to_first, v, pm[q], pe[q], table);
        }
        if constexpr (SCATTER) {
            T* const stage = reinterpret_cast<T*>(warp_stage<STAGE_BYTES>());
            __syncwarp();  // the step staged before any lane writes an escape into another's group
            patch_staged_escapes<E, M, T>(J, esc_off, s0 * 8, (s0 + STEP) * 8, len, lane, base, cnt, pos, exp, next, err,
                                          stage);
            __syncwarp();  // and every escape written before its group is stored
#pragma unroll
            for (int q = 0; q < GPL; q++) {
                const int i = s0 + q * 32 + lane;
                if (i < ng) unstage_group(stage + (q * 32 + lane) * 8, dst, len, i);
            }
        }
    }
    if (early) finish_early_chunk<E, M, T>(jobs, job, gc, chunk, chunk_off, work, lane, ow);
}

// decode_chunk<..., SCATTER> for chunk gc of tensor job (kvz_decode's escape-heavy instance asks,
// for chunks of SCATTER_MIN escapes or more): a call, not inlined, so that instance's common
// chunks keep their code and registers.
template <int E, int M, typename T, int GPL>
__device__ __noinline__ void decode_scattered_chunk(const DecodeJob* __restrict__ jobs, int job, long long gc,
                                                    int chunk, const u64* __restrict__ chunk_off,
                                                    u64* __restrict__ work, int lane) {
    decode_chunk<E, M, T, GPL, false, false, true>(jobs[job], jobs, job, gc, chunk, chunk_off, work, lane);
}

// A warp's first chunk, gc, before kvz_scan is known to be done.  The job table is read past L1
// (ld.global.cg: its rows were written by the upload, complete before any scan block released
// this grid), so no line of it sits in this multiprocessor's L1 when the scan's header guesses
// write their fields of it: the loads after the wait (await_offsets) then see them.  (Not volatile
// loads: one at a time, they delayed every warp's start.)  A row staged with dlo = 0 takes its
// blob's own codebook: that chunk waits until the scan's header guess has put it in the row
// (publish_book, before the guess checks the header) and reads the row again.  A call, not
// inlined: a second inlined copy of the chunk's code made the decoders' loops spill.
template <int E, int M, typename T, int GPL>
__device__ __noinline__ void decode_early_chunk(const DecodeJob* __restrict__ jobs, int njobs, long long gc, int chunk,
                                                const u64* __restrict__ chunk_off, u64* __restrict__ work, int lane,
                                                OffsetsWait ow) {
    const int job = find_job<true>(jobs, njobs, gc, &DecodeJob::chunk_base);
    union { uint4 words[sizeof(DecodeJob) / 16]; DecodeJob row; } J;
    const uint4* src = reinterpret_cast<const uint4*>(jobs + job);
#pragma unroll
    for (int k = 0; k < (int)(sizeof(DecodeJob) / 16); k++) J.words[k] = __ldcg(src + k);
    if (J.row.dlo == 0) {  // the blob's own codebook, which the scan's header guess writes first (publish_book)
        if (lane == 0) await_book(jobs[job]);
        __syncwarp();
#pragma unroll
        for (int k = 0; k < (int)(sizeof(DecodeJob) / 16); k++) J.words[k] = __ldcg(src + k);
    }
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
// fits the BF16 decoder's 80 registers only since the claim holds one: benchmarks/NOTES.md, v27.)
// Each thread ends with griddepcontrol.wait (the scan long done by then), so the kernel's end
// still implies the scan's for what follows it in the stream.
// SCATTER_MIN > 0: the escape-heavy instance (programs.heavy_decode chooses it per call): a whole
// later chunk of that many escapes or more is decoded a step at a time through shared memory, its
// escapes written there before each group's one store (decode_scattered_chunk; its shared stage
// is this instance's alone).  The common instance (0) has no such path: its presence alone slowed
// the decoder on common KV (benchmarks/NOTES.md, e1).
template <int E, int M, typename T, int GPL, int MINB, bool DQ = false, int SCATTER_MIN = 0>
__global__ void __launch_bounds__(WARPS * 32, MINB) kvz_decode(const DecodeJob* __restrict__ jobs, int njobs,
                                                                long long units, int chunk,
                                                                const u64* __restrict__ chunk_off, u64* __restrict__ work,
                                                                long long queue_at, long long scan_blocks,
                                                                long long split_at, int part_shift) {
    release_dependents();
    if (threadIdx.x == 0) s_offsets = 0;
    __syncthreads();
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
        if constexpr (!DQ && SCATTER_MIN > 0) {
            const u32 listed = jobs[job].esc_count[gc - jobs[job].chunk_base];
            if (part == 0 && listed >= SCATTER_MIN && listed != PLANE) {
                decode_scattered_chunk<E, M, T, GPL>(jobs, job, gc, chunk, chunk_off, work, lane);
                continue;
            }
        }
        decode_chunk<E, M, T, GPL, DQ, false>(jobs[job], jobs, job, gc, chunk, chunk_off, work, lane, ow, part);
    }
    await_predecessor();
}
