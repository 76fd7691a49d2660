// kvz_gather_heads and kvz_check_heads: a batched decode's header read-back and checks.
#pragma once

#include "common.cuh"
#include "abi.cuh"
#include "header.cuh"

// ------------------------------------------------------------------ header gather (batched decode)
// dst[t * span .. ] = the first min(span, len_t) bytes of blob t: one read-back for a batch's headers.
__global__ void kvz_gather_heads(const u64* __restrict__ jobs /* (ntensors, 2): ptr, len */, int span, u8* __restrict__ dst) {
    await_predecessor();
    release_dependents();
    const int t = blockIdx.y;
    const u8* src = reinterpret_cast<const u8*>(jobs[2 * t]);
    const long long len = min((long long)span, (long long)jobs[2 * t + 1]);
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < len; i += (long long)gridDim.x * blockDim.x)
        dst[(long long)t * span + i] = src[i];
}

// grid = ntensors.  For blob t (16-byte aligned), checks[8t .. 8t+7] = {1 if its header hangs
// together, then esc_pos's, esc_exp's and exp_high's payload offsets, the escapes, the
// high-exponent bytes; its header length; its stream count}.  "Hangs together": the header
// fits the span and the blob, its CRC matches, the three escape streams follow one another as
// container.layout places them, the payload ends after the last, at the blob's end.  Word 0 and
// words 1-5 are 0 otherwise; words 6-7 are 0 for a blob shorter than the prefix.
// layout_cache.head_checks is the host twin, and the reference this is tested against.
__global__ void __launch_bounds__(256) kvz_check_heads(const u64* __restrict__ heads /* (ntensors, 2): ptr, len */,
                                                       int span /* at most HEADER_SMEM */, u64* __restrict__ checks) {
    await_predecessor();
    release_dependents();
    __shared__ u32 crc_table[4][256];
    __shared__ __align__(16) u8 head[HEADER_SMEM];
    const u8* b;
    long long len;
    const long long staged = stage_head(heads, blockIdx.x, span, head, crc_table, b, len);
    if (threadIdx.x >= 32) return;
    u64 out[8];
    head_facts(b, len, span, head, staged, crc_table, out);
    if (threadIdx.x == 0)
        for (int k = 0; k < 8; k++) checks[8 * blockIdx.x + k] = out[k];
}
