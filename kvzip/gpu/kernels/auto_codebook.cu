// kvz_auto_codebook: each tensor's own Top-16 codebook (codebook="auto"), chosen on the device
// before kvz_encode runs, by the rule kvzip/auto_codebook.py specifies (the CPU reference, byte
// for byte): a sampled exponent histogram, then the calibration ranking.
#pragma once

#include "common.cuh"
#include "abi.cuh"
#include "formats.cuh"

#define AUTO_RUN 256        // values a run (auto_codebook.RUN_LENGTH): one a thread
#define AUTO_ALIGN 16       // run starts are multiples of 16 values (ALIGN)
#define AUTO_MAX_SHIFT 8    // blocks of AUTO_RUN << k values, k <= 8 (MAX_SHIFT)
#define AUTO_FULL_BITS 21   // bit_length(FULL_READ_BELOW = 2^20)
#define AUTO_WEYL 0x9E3779B9u
#define AUTO_LUT_BYTES 256  // a tensor's LUT row in luts (2^E <= 256)
#define AUTO_UNROLL 8       // runs a thread reads a step

// The sample of a tensor of n values (auto_codebook.sample_plan): blocks of S = AUTO_RUN << k
// values, one run of AUTO_RUN values in each at a Weyl offset (a multiple of AUTO_ALIGN).
struct SamplePlan {
    long long S, blocks;  // block size, blocks (= runs)
    u32 offsets;          // M: the offsets a run can take in its block
    __device__ __forceinline__ explicit SamplePlan(long long n) {
        const int bits = n > 0 ? 64 - __clzll(n) : 0;
        const int k = min(AUTO_MAX_SHIFT, max(0, bits - AUTO_FULL_BITS + 1));
        S = (long long)AUTO_RUN << k;
        blocks = (n + S - 1) / S;
        offsets = (u32)((S - AUTO_RUN) / AUTO_ALIGN + 1);
    }
    // run r's first value; the run is [start, start + AUTO_RUN) cut at n
    __device__ __forceinline__ long long start(long long r) const {
        const u32 j = __umulhi((u32)r * AUTO_WEYL, offsets);  // (r mod 2^32) * WEYL mod 2^32, times M, >> 32
        return r * S + (long long)AUTO_ALIGN * j;
    }
};

// rank[e] for each of the BINS exponents of histogram c (shared memory, c[e] written by thread e),
// by the key (unseen, seen ? -count : |e - mode|, e) ascending, with mode the lowest exponent of
// the largest count (0 when nothing was seen): the rule of kvzip/calibrate.py and
// kvzip/channel_codebook.py.  Exact for the ranks below TOP, the only ones the callers keep (the
// first TOP exponents); an exponent ranked TOP or later may get any value >= TOP (BINS).  Seen
// exponents rank among themselves by count (ties to the lower exponent), each thread against the
// list of the seen ones (KV has a few dozen of 256); the mode is the first of them; the unseen
// ones follow by their distance to it, ranked only where fewer than TOP were seen.  Called by
// every thread of a block of at least BINS threads (it has barriers); rank is valid after it
// returns.
template <int BINS, int TOP>
__device__ __forceinline__ void rank_exponents(const u32* c, u32* rank) {
    __shared__ int mode, nseen;
    __shared__ u32 seen_e[BINS], seen_c[BINS];  // the seen exponents and their counts, in no order
    const int e = threadIdx.x;
    if (e == 0) { mode = 0; nseen = 0; }
    __syncthreads();
    const bool is_seen = e < BINS && c[e] != 0;
    if (is_seen) {
        const int j = atomicAdd(&nseen, 1);
        seen_e[j] = (u32)e;
        seen_c[j] = c[e];
    }
    __syncthreads();
    const int seen = nseen;
    if (is_seen) {
        const u32 ce = c[e];
        u32 r = 0;
#pragma unroll 4
        for (int j = 0; j < seen; j++) r += seen_c[j] > ce || (seen_c[j] == ce && seen_e[j] < (u32)e);
        rank[e] = r;
        if (r == 0) mode = e;  // the one seen exponent of rank 0
    }
    __syncthreads();
    if (e < BINS && !is_seen) {
        u32 r = BINS;  // ranked seen or later: >= TOP
        if (seen < TOP) {
            const int d = abs(e - mode);
            r = (u32)seen;
#pragma unroll 16
            for (int f = 0; f < BINS; f++) {
                const int df = abs(f - mode);
                r += c[f] == 0 && (df < d || (df == d && f < e));
            }
        }
        rank[e] = r;
    }
    __syncthreads();
}

// grid (x, njobs), AUTO_RUN threads.  Block (x, t) counts the sampled values of tensor t's runs
// AUTO_UNROLL at a time (runs x * AUTO_UNROLL .., then gridDim.x * AUTO_UNROLL on) into a shared histogram, then adds it to tensor t's in work (2^E words a
// tensor from word hist_at of work, zeroed, then a ticket a tensor); the tensor's last block
// ranks the exponents and writes luts[t] (exponent -> code or ESC_FLAG) and books[t] (code ->
// exponent: the header's 16 bytes).
template <int E, int M, typename T>
__global__ void __launch_bounds__(AUTO_RUN) kvz_auto_codebook(const EncodeJob* __restrict__ jobs, u64* __restrict__ work,
                                                              long long hist_at, u8* __restrict__ luts,
                                                              u8* __restrict__ books) {
    static_assert(AUTO_RUN == WARPS * 32, "launched as the fused module's other kernels: a thread a run value");
    await_predecessor();
    release_dependents();  // kvz_encode's await_predecessor still waits for this grid to finish
    constexpr int BINS = 1 << E;
    const int t = blockIdx.y;
    const long long n = jobs[t].n;
    const T* __restrict__ src = static_cast<const T*>(jobs[t].src);
    const SamplePlan plan(n);
    __shared__ u32 h[BINS];
    for (int i = threadIdx.x; i < BINS; i += blockDim.x) h[i] = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    // AUTO_UNROLL runs a step, their loads issued before any is counted (the reads are few and
    // scattered: latency, not bandwidth, is what they cost).
    for (long long r0 = (long long)blockIdx.x * AUTO_UNROLL; r0 < plan.blocks; r0 += (long long)gridDim.x * AUTO_UNROLL) {
        u32 e[AUTO_UNROLL];
#pragma unroll
        for (int u = 0; u < AUTO_UNROLL; u++) {
            const long long r = r0 + u;
            const long long at = plan.start(r) + threadIdx.x;
            e[u] = r < plan.blocks && at < n ? (u32)(src[at] >> M) & (BINS - 1) : BINS;  // BINS: no value
        }
#pragma unroll
        for (int u = 0; u < AUTO_UNROLL; u++) {
            // One shared atomic a distinct exponent a warp (KV has a handful of exponents: lanes agree).
            const u32 same = __match_any_sync(FULL_MASK, e[u]);
            if (e[u] < BINS && lane == __ffs(same) - 1) atomicAdd(&h[e[u]], (u32)__popc(same));
        }
    }
    __syncthreads();
    u32* __restrict__ hist = reinterpret_cast<u32*>(work + hist_at);
    u32* __restrict__ tickets = hist + (long long)gridDim.y * BINS;
    u32* __restrict__ th = hist + (long long)t * BINS;
    for (int i = threadIdx.x; i < BINS; i += blockDim.x)
        if (h[i]) atomicAdd(&th[i], h[i]);
    __threadfence();
    __syncthreads();
    __shared__ bool last;
    if (threadIdx.x == 0) last = atomicAdd(&tickets[t], 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    // The ranking (calibrate.choose_exponents with exponent 0 always in): rank_exponents, the
    // first 16; 0 replaces the 16th if it is not among them; code c = the c-th by rank.
    __shared__ u32 c[BINS];
    __shared__ u32 rank[BINS];
    static_assert(BINS <= AUTO_RUN, "rank_exponents: a thread an exponent");
    const int e = threadIdx.x;
    if (e < BINS) c[e] = *reinterpret_cast<volatile u32*>(&th[e]);
    rank_exponents<BINS, 16>(c, rank);
    const bool zero_out = rank[0] >= 16;  // exponent 0 takes code 15 from the exponent ranked 16th
    __syncthreads();
    if (zero_out && e < BINS) rank[e] = e == 0 ? 15u : rank[e] == 15 ? (u32)BINS : rank[e];
    __syncthreads();
    u8* __restrict__ lut = luts + (long long)t * AUTO_LUT_BYTES;
    u8* __restrict__ book = books + (long long)t * 16;
    if (e < BINS) {
        const u32 r = rank[e];
        lut[e] = r < 16 ? (u8)r : (u8)ESC_FLAG;
        if (r < 16) book[r] = (u8)e;
    }
}
