// kvz_encode, the encode's dense pass.
#pragma once

#include "common.cuh"
#include "abi.cuh"
#include "group_io.cuh"
#include "formats.cuh"
#include "escapes.cuh"

// kvz_encode's per-tensor sums, by lane 0 of a warp: the warp's escapes << 31 | plane-coded groups
// of its `chunks` chunks of tensor `job` go into work[1 + job] at once; with ready, the chunks are
// noted in the warp's pending list (shared memory), whose counts go into each tensor's done count
// (work[queue_at + QUEUE_WORDS + job]) once PENDING tensors are noted or the warp ends
// (release_counts), and the lane that completes a count puts that tensor's totals in ready[job],
// flagged.  One fence orders a whole list's sums before its counts, and the completing lane's
// orders its count before its read, so the totals it reads hold every warp's.  A fence waits for
// the lane's stores of the chunk in flight too, so a fence a chunk (a batch's warps cross tensors
// often) costs the graph; a longer list publishes later, and the host builds the blobs still
// unpublished when the encoder ends after it, so the call wants the shortest list that takes the
// fences off the graph (KVZ_PENDING; benchmarks/NOTES.md, kernel source split: pending counts).
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

// A plane-coded chunk's second pass, by its warp as soon as the dense pass has counted its escapes
// past the threshold (its input, just read, still in L2): each group's low exponent nibbles over
// the codes the dense pass wrote, and its high bits (HB bytes, group g's at byte HB g) to the
// chunk's slot, bytes [0, 2 slot) in slot_pos's entries and the rest in slot_exp's:
// programs.slot_size makes the slot's 3 * slot bytes hold them, and slot a multiple of 16 keeps
// both parts and every group's bytes in them aligned to HB.  Where they go in exp_high
// depends on the plane-coded groups before the chunk and on the tensor's escapes, known only to
// kvz_scan, which copies them there (place_plane_high).  B groups a lane are loaded before any
// is encoded (load_redo_batch): 4 bytes of values a lane (two BF16 groups; with four, kvz_encode
// BF16 went from 112 registers to 128 and spilled), one group quantizing (two spilled in its 64).
// c: the chunk, g0 its first group, ng its groups.
template <int E, int M, typename T, bool QT, int B>
__device__ __forceinline__ void plane_pass(const EncodeJob& J, long long c, long long g0, int slot, int ng,
                                        const u8* qtable, int lane) {
    constexpr int HB = E - 4;
    using L = typename Pick<QT, u16, T>::type;
    const L* src = static_cast<const L*>(J.src) + g0 * 8;
    const long long n = J.n - g0 * 8;
    u8* __restrict__ codes = J.codes + g0 * 4;
    u8* __restrict__ high_a = reinterpret_cast<u8*>(J.slot_pos + c * slot);
    u8* __restrict__ high_b = J.slot_exp + c * slot;
    assume_global(src); assume_global(codes); assume_global(high_a); assume_global(high_b);
    const int split = 2 * slot;
    __syncwarp();  // the escapes other lanes put in the slot, before the high bytes over them
    for (int s = 0; s < ng; s += 32 * B) {
        Raw<T> v[B];
        load_redo_batch<T, QT>(src, n, s, ng, lane, v, qtable);
#pragma unroll
        for (int b = 0; b < B; b++) {
            const int g = s + 32 * b + lane;
            if (g < ng) encode_plane<E, M>(v[b], g, codes, HB * g < split ? high_a + HB * g : high_b + (HB * g - split));
        }
    }
}

// Dense pass.  Chunks come from the queue above; a warp walks its chunk in steps of 32 * GPL
// groups, each lane loading its GPL groups with vector loads, encoding them and storing codes
// and rest in place.  Escapes go to a per-chunk slot in position order (step_escapes); kvz_scan
// moves them to their final place.  A chunk with more than a third of its high exponent bytes'
// worth of escapes is plane-coded: its warp rewrites it at once (plane_pass), leaving kvz_scan
// only its high bytes to copy.
// The loop is kept this plain on purpose: earlier versions of this kernel with prefetching
// across chunks, a cursor per warp, or a cp.async ring in shared memory spent their instructions
// on bookkeeping and stalled well below DRAM bandwidth (benchmarks/NOTES.md, v3-v4).
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
                                                                u64* __restrict__ work,
                                                                long long queue_at, u64* __restrict__ ready) {
    await_predecessor();
    release_dependents();
    constexpr int HB = E - 4, R = M + 1, STEP = 32 * GPL;
    // Each warp's copy of its current tensor's LUT (and E5M2's position tables, encode_e5m2_full),
    // loaded when the warp's chunk belongs to another tensor than its last (load_warp_lut): a batch
    // whose tensors have codebooks of their own (auto) encodes in one launch.
    constexpr bool E5M2 = E == 5 && M == 2 && sizeof(T) == 1;
    __shared__ u32 slut_words[WARPS][((1 << E) + 3) / 4];
    __shared__ u32 tables_all[WARPS][E5M2 ? POSITION_TABLE_WORDS : 1];
    u8* slut = reinterpret_cast<u8*>(slut_words[threadIdx.x >> 5]);
    u32* tables = tables_all[threadIdx.x >> 5];
    int lut_job = -1;
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
        if (job != lut_job) {  // warp-uniform: every lane has this chunk
            load_warp_lut<E, E5M2>(J.lut, slut, tables, lane);
            lut_job = job;
        }
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
        // warp keeps reads in flight while it encodes (the encoders were latency-bound).  Not the
        // quantizing encoder, which would hold 16-bit values: slower with it
        // (benchmarks/NOTES.md, kernel source split: encoder's step ahead).
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
            // Past the plane-coding threshold the chunk's escapes are no longer listed: it is
            // plane-coded whatever the rest holds.
            if (count <= HB * ng / 3 && __any_sync(FULL_MASK, any != 0)) {
                u16* __restrict__ spos = J.slot_pos + c * slot;
                u8* __restrict__ sexp = J.slot_exp + c * slot;
                assume_global(spos); assume_global(sexp);
                count = step_escapes<E, M>(v, m, (s0 + lane) * 8, count, slot, spos, sexp, lane);
            }
            if constexpr (PREFETCH) {
#pragma unroll
                for (int q = 0; q < GPL; q++) cur[q] = ahead[q];
            }
            whole = next_whole;
        }
        const bool plane = count > HB * ng / 3;
        if (plane) plane_pass<E, M, T, QT, QT ? 1 : 4 / sizeof(T)>(J, c, g0, slot, ng, qtable, lane);
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
