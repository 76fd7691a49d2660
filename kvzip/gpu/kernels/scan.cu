// kvz_scan: the escape and plane-group offsets of every chunk (encode and decode).
#pragma once

#include "common.cuh"
#include "abi.cuh"
#include "header.cuh"
#include "escapes.cuh"

// ------------------------------------------------------------------ scan (encode and decode)
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
// (await_offsets) instead of the scan's end, so the scan's escape checks (check_block_escapes;
// benchmarks/NOTES.md, v26) overlap the decoder's start rather than delay it.  Those
// checks' errors (3, 4) reach the host through the scan's verdict; the decoder makes the same
// checks as it applies the escapes, so its reads and writes stay inside the blob and the output
// either way.

// A scan block's count (every thread calls it; the fence after the barrier orders the block's
// writes, seen by thread 0 there, before the count, as in verdict_block_done).
__device__ __forceinline__ void offsets_block_done(u64* work, int njobs) {
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
//   Encode: moves the escapes from kvz_encode's slots to their final place, a thread per escape,
//   MOVE_BATCH of them a round (load_slot_escapes) (positions in esc_pos, exponents in esc_exp,
//   which starts where kvz_encode's totals put it), and copies each plane-coded chunk's high
//   bytes from its slot to exp_high (place_plane_high), a warp a chunk: kvz_encode wrote
//   everything else of those chunks.  The first njobs blocks (by ticket) finish the blobs
//   instead, one each (finish_blob: padding, header, sizes[3t ..]), alongside the others:
//   kvz_encode's totals are all they need.
// Decode: also checks the block's escapes as kvz_decode does (check_block_escapes).
// work: [0] ticket, [1 + t] tensor t's totals (encode: kvz_encode's sums) or error (decode),
// (decode: [1 + njobs] the deferred checks, check_block_escapes; [2 + njobs] the blocks done,
// verdict_block_done; [offsets_ready_at] the blocks whose offsets are written) then status, [sb]
// of it (encode from 1 + njobs, decode from decode_status_at).  down, flag, runs: a decode's
// verdict (below).  fin, sizes: encode only.  heads, expect, span: a decode on guessed
// layouts, whose first njobs blocks run guess_head for each blob; the blocks that set a blob's
// errors or check its totals wait for that verdict first (a wrong guess's counts mean nothing).
// Tickets hand the guesses out first, so no block waits on one that has not started.
// QT: the quantizing encode's instance, which the loader names (kvzip/gpu/loader.py); the scan no
// longer reads the input (kvz_encode rewrites plane-coded chunks itself), so it is the same code.
template <int E, int M, typename T, typename Job, bool QT = false>
__global__ void __launch_bounds__(SB_CHUNKS) kvz_scan(const Job* jobs, int njobs, int chunk, int slot,
                                                     u64* __restrict__ work,
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
    __shared__ u16 s_plane[SB_CHUNKS];   // the block's plane-coded chunks (encode)
    __shared__ int s_nplane;
    const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5;
    if (tid == 0) { s_ticket = (long long)atomicAdd(&work[0], 1ull); s_nplane = 0; }
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
    // could alias).  The first round's loads go out before the look-back, whose wait they overlap
    // (benchmarks/NOTES.md, v18).
    const u32 listed = (u32)(agg >> 31);
    const long long c0 = lsb * SB_CHUNKS;
    u16 pos[MOVE_BATCH];
    u8 ex[MOVE_BATCH];
    u32 loaded = 0;
    if constexpr (ENC) {
        s_eoff[tid] = (u32)(excl >> 31);
        s_goff[tid] = (u32)(excl & GROUPS_MASK);
        if (c < nchunks && stored == PLANE) s_plane[atomicAdd(&s_nplane, 1)] = (u16)tid;
        __syncthreads();
        loaded = load_slot_escapes(tid, listed, s_eoff, slot, c0, J.slot_pos, J.slot_exp, pos, ex);
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
        // each escape reloaded three.
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
            loaded = load_slot_escapes(k0, listed, s_eoff, slot, c0, J.slot_pos, J.slot_exp, pos, ex);
        }
        // Plane-coded chunks: kvz_encode left each one's high bytes in its slot (encode.cu,
        // plane_pass); a warp a chunk copies them to their place in exp_high.
        for (int r = wid; r < s_nplane; r += WARPS) {
            const long long cc = c0 + s_plane[r];
            place_plane_high<HB>(high_out + (long long)HB * (long long)((prefix & GROUPS_MASK) + s_goff[s_plane[r]]),
                                 J.slot_pos + cc * slot, J.slot_exp + cc * slot, slot, gpc,
                                 HB * (int)min((long long)gpc, G - cc * gpc), lane);
        }
    }
}
