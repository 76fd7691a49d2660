// kvz_w_gemm: y[n, m] = sum_k x[n, k] W[m, k] + bias[m] for n < N <= 8 NT, W in the tiled layout.
#pragma once

#include "weights_tile.cuh"

// The B fragments of a lane come straight from row-major x: the layout places lane q's weights
// of a chunk in its columns 16 q .. 16 q + 15 (step s: 16 q + 4 s .. + 3), so the lane multiplies
// them by x[n][64 c + 16 q ..], 32 contiguous bytes of one row (n = 8 t + g of n tile t).  The
// mma's k order inside a step is a permutation of the columns; the sum does not mind.
template <int NT>
struct XChunk {
    u32 w[NT][8];  // x[8 t + g][64 c + 16 q + 2 i .. + 1] in w[t][i]; zero past N or K
};

// For NT <= 2 a lane loads its whole x chunk a chunk ahead (two 16-byte loads a tile); wider N
// loads each step's 8 bytes as the step comes, to keep registers for the accumulators.
template <int NT>
__device__ __forceinline__ void load_x(XChunk<NT>& xc, const u16* __restrict__ x, int ldx, int N, int K, int c,
                                       int g, int q) {
    const int k = c * W_CHUNK + 16 * q;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        const int n = 8 * t + g;
        uint4 a = make_uint4(0, 0, 0, 0), b = a;
        if (n < N && k < K) {  // K % 16 == 0: the lane's 16 columns are all in or all out
            const uint4* p = reinterpret_cast<const uint4*>(x + (size_t)n * ldx + k);
            a = __ldg(p);
            b = __ldg(p + 1);
        }
        xc.w[t][0] = a.x; xc.w[t][1] = a.y; xc.w[t][2] = a.z; xc.w[t][3] = a.w;
        xc.w[t][4] = b.x; xc.w[t][5] = b.y; xc.w[t][6] = b.z; xc.w[t][7] = b.w;
    }
}

// One block's four steps: x from xc (loaded a chunk ahead) for NT <= 2, else step by step.
template <int NT>
__device__ __forceinline__ void multiply_block(const u32* lane_table, const Block& blk, const XChunk<NT>& xc,
                                               const u16* __restrict__ x, int ldx, int N, int K, int c, int g, int q,
                                               float acc[NT][4]) {
    const u32 codes[4] = {blk.codes.x, blk.codes.y, blk.codes.z, blk.codes.w};
    const u32 sm[8] = {blk.sm01.x, blk.sm01.y, blk.sm01.z, blk.sm01.w, blk.sm23.x, blk.sm23.y, blk.sm23.z, blk.sm23.w};
    if constexpr (NT <= 2) {
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            u32 a[4];
            decode_step(lane_table, codes[s], sm[2 * s], sm[2 * s + 1], a);
#pragma unroll
            for (int t = 0; t < NT; ++t) mma_bf16(acc[t], a, xc.w[t][2 * s], xc.w[t][2 * s + 1]);
        }
    } else {
        const int k = c * W_CHUNK + 16 * q;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            u32 a[4];
            uint2 b[NT];
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const int n = 8 * t + g;
                b[t] = (n < N && k < K) ? __ldg(reinterpret_cast<const uint2*>(x + (size_t)n * ldx + k + 4 * s))
                                        : make_uint2(0, 0);
            }
            decode_step(lane_table, codes[s], sm[2 * s], sm[2 * s + 1], a);
#pragma unroll
            for (int t = 0; t < NT; ++t) mma_bf16(acc[t], a, b[t].x, b[t].y);
        }
    }
}

// The escapes, the bias and the rounding of one band: the lane's outputs are v[t][i] at row
// g + 8 (i >> 1), column 8 t + 2 q + (i & 1).  Escapes are added in list order, each to the
// outputs of its row.
template <int NT>
__device__ __forceinline__ void finish_band(float v[NT][4], int band, int g, int q, const u32* __restrict__ esc_off,
                                            const u32* __restrict__ esc_pos, const u16* __restrict__ esc_val,
                                            const u16* __restrict__ x, int ldx, const u16* __restrict__ bias,
                                            u16* __restrict__ y, int ldy, int M, int N) {
    const u32 e1 = __ldg(esc_off + band + 1);
    for (u32 e = __ldg(esc_off + band); e < e1; ++e) {
        const u32 p = __ldg(esc_pos + e);
        const int r = p & 15u;
        if (r != g && r != g + 8) continue;
        const float w = bf16_value(__ldg(esc_val + e));
        const bool upper = r == g;  // rows g (outputs 0, 1) or g + 8 (outputs 2, 3)
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int n = 8 * t + 2 * q + i;
                if (n >= N) continue;
                const float add = w * bf16_value(__ldg(x + (size_t)n * ldx + (p >> 4)));
                if (upper) v[t][i] += add; else v[t][2 + i] += add;
            }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int m = band * 16 + g + 8 * h;
        if (m >= M) continue;
        const float b = bias ? bf16_value(__ldg(bias + m)) : 0.f;
#pragma unroll
        for (int t = 0; t < NT; ++t)
#pragma unroll
            for (int i = 0; i < 2; ++i) {
                const int n = 8 * t + 2 * q + i;
                if (n < N) y[(size_t)n * ldy + m] = bf16_bits(v[t][2 * h + i] + b);
            }
    }
}

// Work items are (band, split of the chunks), items = bands x splits, band = item / splits.
// Every warp works alone: warp w of the grid takes items w, w + warps, ... (thread blocks stay
// resident, so the pair table is built once a block) and streams its item's blocks through its
// ring (W_GEMM_STAGES - 1 in flight).  A band with splits > 1 leaves each split's sums in
// partial[band][split] (16 x N) and the last of its warps to finish (a ticket) adds them in
// split order, so the sums, and y, do not depend on which split ran when; it resets the ticket
// (tickets are zero between calls).  K % 16 == 0; x 16-byte aligned, ldx % 8 == 0.
template <int NT>
__global__ void __launch_bounds__(W_WARPS * 32) kvz_w_gemm(
        const uint4* __restrict__ blocks, const u8* __restrict__ codebook, const u32* __restrict__ esc_off,
        const u32* __restrict__ esc_pos, const u16* __restrict__ esc_val, const u16* __restrict__ x, int ldx,
        const u16* __restrict__ bias, u16* __restrict__ y, int ldy, float* __restrict__ partial,
        u32* __restrict__ tickets, int M, int K, int N, int chunks, int splits, int per_split, int items) {
    extern __shared__ uint4 smem[];  // the pair table, then each warp's ring
    u32* table = reinterpret_cast<u32*>(smem);
    build_pair_table(table, codebook);
    __syncthreads();

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const u32* lane_table = table + lane;
    uint4* ring = smem + W_LUT_WORDS / 4 + warp * W_GEMM_STAGES * W_BLOCK_U4;
    const int warps = gridDim.x * W_WARPS;
    for (int item = blockIdx.x * W_WARPS + warp; item < items; item += warps) {
        const int band = item / splits, split = item % splits;
        const int c0 = split * per_split, c1 = min(chunks, c0 + per_split);
        const uint4* mine = blocks + (size_t)band * chunks * W_BLOCK_U4;
        float acc[NT][4];
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;

#pragma unroll
        for (int i = 0; i < W_GEMM_STAGES - 1; ++i)
            ring_issue(ring, i, mine + (size_t)(c0 + i) * W_BLOCK_U4, c0 + i < c1, lane);
        XChunk<NT> xc;
        if constexpr (NT <= 2) load_x<NT>(xc, x, ldx, N, K, c0, g, q);
        for (int c = c0, slot = 0; c < c1; ++c) {
            const Block cur = ring_take<W_GEMM_STAGES>(ring, slot, lane);
            const int ahead = c + W_GEMM_STAGES - 1;
            ring_issue(ring, slot == 0 ? W_GEMM_STAGES - 1 : slot - 1, mine + (size_t)ahead * W_BLOCK_U4, ahead < c1,
                       lane);
            XChunk<NT> xn;
            if constexpr (NT <= 2)
                if (c + 1 < c1) load_x<NT>(xn, x, ldx, N, K, c + 1, g, q);
            multiply_block<NT>(lane_table, cur, xc, x, ldx, N, K, c, g, q, acc);
            if constexpr (NT <= 2) xc = xn;
            slot = slot + 1 == W_GEMM_STAGES ? 0 : slot + 1;
        }

        if (splits > 1) {
            float* sums = partial + ((size_t)band * splits + split) * 16 * N;
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = g + 8 * (i >> 1), n = 8 * t + 2 * q + (i & 1);
                    if (n < N) sums[r * N + n] = acc[t][i];
                }
            __threadfence();
            __syncwarp();
            u32 ticket = 0;
            if (lane == 0) ticket = atomicAdd(tickets + band, 1u);
            if (__shfl_sync(0xffffffffu, ticket, 0) != (u32)(splits - 1)) continue;
            __threadfence();
            const float* all = partial + (size_t)band * splits * 16 * N;
#pragma unroll
            for (int t = 0; t < NT; ++t)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = g + 8 * (i >> 1), n = 8 * t + 2 * q + (i & 1);
                    float v = 0.f;
                    if (n < N)
                        for (int sp = 0; sp < splits; ++sp) v += __ldcg(all + ((size_t)sp * 16 + r) * N + n);
                    acc[t][i] = v;
                }
            if (lane == 0) tickets[band] = 0;
        }
        finish_band<NT>(acc, band, g, q, esc_off, esc_pos, esc_val, x, ldx, bias, y, ldy, M, N);
    }
}
