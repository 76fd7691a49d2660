// Warp and queue primitives every kernel of the fused module uses: the word types, the status
// words' masks, programmatic dependent launch, global-memory hints, warp sums, the decoupled
// look-back, the job search and the dense passes' chunk queues.
#pragma once

#include "tuning.cuh"

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

// The job tables' stream pointers are plain generic pointers to the compiler, which then emitted
// generic LD/ST for the dense passes' data; telling it they point to global memory gives LDG/STG
// (benchmarks/NOTES.md, v17).
template <typename P>
__device__ __forceinline__ void assume_global(const P* p) { __builtin_assume(__isGlobal(p)); }

// The 128-byte lines of [p, p + bytes) into L2, a line a lane (lines lane, lane + 32, ...):
// prefetches hold no registers, so a warp can put a whole chunk's reads in flight at its start.
// (On the host, without __CUDA_ARCH__, a prefetch is nothing: tests/cuda_host.)
__device__ __forceinline__ void prefetch_l2(const void* p, long long bytes, int lane) {
    const unsigned long long a = reinterpret_cast<unsigned long long>(p), end = a + (unsigned long long)bytes;
    for (unsigned long long l = (a & ~127ull) + 128ull * lane; l < end; l += 32 * 128) {
#ifdef __CUDA_ARCH__
        asm volatile("{ .reg .u64 g; cvta.to.global.u64 g, %0; prefetch.global.L2 [g]; }" :: "l"(l));
#endif
    }
}

template <bool B, typename A, typename C> struct Pick { using type = A; };  // std::conditional, NVRTC has no <type_traits>
template <typename A, typename C> struct Pick<false, A, C> { using type = C; };

// ------------------------------------------------------------------ decoupled look-back
// status[c] = flag << 62 | value; flag 1: this chunk's own value, 2: inclusive prefix; 0 (and,
// with ANY_FILL, 3) not published yet, so the caller starts the array zeroed (ANY_FILL: zeroed or
// filled with 0xFF bytes).  Called by the whole warp; returns chunk c's exclusive prefix (in every
// lane) and publishes the inclusive one.  The warp inspects 32 predecessors at a time (lane i reads
// chunk base - i), as single-pass scans do, so a chain of chunks still working costs one read per
// 32 of them.
template <bool ANY_FILL = false>
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
        if (__any_sync(FULL_MASK, lane <= stop && (ANY_FILL ? flag - 1u > 1u : flag == 0))) continue;  // unpublished
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
// one ballot per bit of the count.  No shuffle chain: a shuffle scan per step stalled kvz_encode's
// escape slots (benchmarks/NOTES.md, v15).
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

// Two per-lane counts packed in one word (lo | hi << 16, each half's warp sum < 2^16): both
// halves' exclusive prefixes over the lanes, and (in *total) the warp's sums, by one shuffle scan
// of the packed word: a step's GPL groups a lane cost one scan, not GPL ballot counts.
__device__ __forceinline__ u32 warp_exclusive_pair(u32 packed, int lane, u32* total) {
    u32 x = packed;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const u32 y = __shfl_up_sync(FULL_MASK, x, d);
        if (lane >= d) x += y;
    }
    *total = __shfl_sync(FULL_MASK, x, 31);
    return x - packed;
}

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
// escapes finishing last.  The bytes never depend on which warp takes which chunk.
// KVZ_QUEUES counters, QUEUE_STRIDE words apart (QUEUE_WORDS words of work from queue_at, zeroed;
// programs.py sizes the region): warp w takes queue q = w % KVZ_QUEUES, whose k-th claim is
// chunk W + q + KVZ_QUEUES * k, so each chunk is claimed exactly once.  Several counters because
// one for 2112 to 3168 warps held the encoders back
// (benchmarks/NOTES.md, kernel source split: chunk queues).
// Both halves are inline PTX, volatile with a memory clobber, so the compiler keeps the atomic at
// the chunk's start and its use (next_chunk, a shuffle from lane 0) after the chunk's work.
// Written as atomicAdd and __shfl_sync, the compiler aggregated the atomic across the warp (a
// leader election and a shuffle of its result right after it; ptxas does this to an atom.add in
// inline PTX too, not to atom.inc, whose wrap-around it cannot combine) and hoisted the loop's
// shuffle to the top: every chunk waited out the round trip.  The queue is picked inside the asm
// too (W is a multiple of WARPS, so it is the warp's place in its block modulo KVZ_QUEUES): held
// in a register across the loop it cost the BF16 decoder 24 bytes of spills.
#define QUEUE_STRIDE 16  // 128 bytes: each counter a line of its own
#define QUEUE_WORDS 128  // the queues' region of work (KVZ_QUEUES * QUEUE_STRIDE at most)
static_assert(KVZ_QUEUES >= 1 && KVZ_QUEUES * QUEUE_STRIDE <= QUEUE_WORDS && WARPS % KVZ_QUEUES == 0,
              "the queues fit their region and divide the warps");
// claim_chunk returns the counter's old value as the atomic gives it (lane 0's; the counter's low
// word, little-endian: fewer than 2^32 chunks, MAX_VALUES), and next_chunk makes it a chunk, W + q
// + KVZ_QUEUES * old, in its own asm: with that arithmetic outside, ptxas put a multiply of old
// right after the atomic, so lane 0, and with it the warp at the branch's end, waited out the
// claim's round trip at every chunk's start after all (benchmarks/NOTES.md, v27).  W (the grid's
// warps) comes from %nctaid in the asm too: one register less across the chunk.
// (Without __CUDA_ARCH__ both are plain C++ doing what the PTX does, atom.inc's wrap included:
// tests/cuda_host runs the fused kernels on the CPU.  NVRTC always defines it, so the device code
// is the same either way.)
__device__ __forceinline__ u32 claim_chunk(u64* queues, int lane) {
    u32 old = 0;
    if (lane == 0)
#ifdef __CUDA_ARCH__
        asm volatile("{ .reg .u64 g, o; .reg .u32 t, q; mov.u32 t, %%tid.x; shr.u32 t, t, 5; rem.u32 q, t, %2;"
                     " mul.wide.u32 o, q, %3; add.u64 g, %1, o; cvta.to.global.u64 g, g;"
                     " atom.global.inc.u32 %0, [g], 0xfffffffe; }"
                     : "=r"(old) : "l"(queues), "n"(KVZ_QUEUES), "n"(QUEUE_STRIDE * 8) : "memory");
#else
        old = atomicInc(reinterpret_cast<u32*>(queues + (threadIdx.x >> 5) % KVZ_QUEUES * QUEUE_STRIDE), 0xfffffffeu);
#endif
    return old;
}

// The chunk lane 0 claimed (claim_chunk's value), in every lane.
__device__ __forceinline__ long long next_chunk(u32 claim) {
    long long r;
#ifdef __CUDA_ARCH__
    asm volatile("{ .reg .u32 k, t, q, w; .reg .u64 a, b; shfl.sync.idx.b32 k, %1, 0, 0x1f, 0xffffffff;"
                 " mov.u32 t, %%tid.x; shr.u32 t, t, 5; rem.u32 q, t, %2; mov.u32 w, %%nctaid.x;"
                 " mul.wide.u32 a, w, %3; mul.wide.u32 b, k, %2; add.u64 a, a, b; cvt.u64.u32 b, q;"
                 " add.u64 %0, a, b; }"
                 : "=l"(r) : "r"(claim), "n"(KVZ_QUEUES), "n"(WARPS) : "memory");
#else
    const u32 k = __shfl_sync(FULL_MASK, claim, 0);
    r = (long long)gridDim.x * WARPS + (long long)k * KVZ_QUEUES + (long long)((threadIdx.x >> 5) % KVZ_QUEUES);
#endif
    return r;
}

// err codes match stages/fused.py: 1 over capacity, 2 escape totals, 3 position, 4 exponent, 5 plane totals.
__device__ __forceinline__ void set_error(u64* err, u64 code) { atomicCAS(err, 0ull, code); }

