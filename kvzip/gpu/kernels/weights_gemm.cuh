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

// Grid (bands, splits): a thread block multiplies one band over its split's chunks, warp w
// taking chunks w, w + W_WARPS, ... with the next two blocks' loads in flight in registers (as
// many warps as fit stay resident: the blocks in flight are what keeps HBM busy).  The warps'
// sums meet in shared memory and are added in warp order.  With splits > 1 each thread block
// leaves its sums in partial[band][split] and the last of a band's blocks to finish (a ticket)
// adds them in split order: the result does not depend on which block ran when.  That block
// then adds the band's escapes in list order and the bias, rounds to BF16 and resets the
// ticket, so tickets are all zero again between calls.  K % 16 == 0; x 16-byte aligned,
// ldx % 8 == 0.
template <int NT>
__global__ void __launch_bounds__(W_WARPS * 32, NT == 1 ? 4 : 2) kvz_w_gemm(
        const uint4* __restrict__ blocks, const u8* __restrict__ codebook, const u32* __restrict__ esc_off,
        const u32* __restrict__ esc_pos, const u16* __restrict__ esc_val, const u16* __restrict__ x, int ldx,
        const u16* __restrict__ bias, u16* __restrict__ y, int ldy, float* __restrict__ partial,
        u32* __restrict__ tickets, int M, int K, int N, int chunks, int per_split) {
    extern __shared__ uint4 smem[];  // the pair table; after the loop, the warps' tiles
    u32* table = reinterpret_cast<u32*>(smem);
    float* tiles = reinterpret_cast<float*>(smem);  // [W_WARPS][16][8 NT]
    static_assert(W_WARPS * 16 * 8 * NT <= W_LUT_WORDS, "the warps' tiles must fit where the table was");
    __shared__ int last;
    build_pair_table(table, codebook);
    __syncthreads();

    const int band = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const u32* lane_table = table + lane;
    const uint4* mine = blocks + (size_t)band * chunks * W_BLOCK_U4;
    const int c_end = min(chunks, (split + 1) * per_split);

    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;
    int c = split * per_split + warp;
    Block cur, nxt;
    XChunk<NT> xc;
    if (c < c_end) {
        cur = load_block(mine + (size_t)c * W_BLOCK_U4, lane);
        if constexpr (NT <= 2) load_x<NT>(xc, x, ldx, N, K, c, g, q);
    }
    if (c + W_WARPS < c_end) nxt = load_block(mine + (size_t)(c + W_WARPS) * W_BLOCK_U4, lane);
    for (; c < c_end; c += W_WARPS) {
        Block later;
        XChunk<NT> xn;
        if (c + 2 * W_WARPS < c_end) later = load_block(mine + (size_t)(c + 2 * W_WARPS) * W_BLOCK_U4, lane);
        if constexpr (NT <= 2)
            if (c + W_WARPS < c_end) load_x<NT>(xn, x, ldx, N, K, c + W_WARPS, g, q);
        multiply_block<NT>(lane_table, cur, xc, x, ldx, N, K, c, g, q, acc);
        cur = nxt;
        nxt = later;
        if constexpr (NT <= 2) xc = xn;
    }

    __syncthreads();  // every warp is done with the table
    // c0 c1: row g, columns 2q, 2q+1 of the n tile; c2 c3: row g + 8.
    float* tile = tiles + warp * 16 * 8 * NT;
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) tile[(g + 8 * (i >> 1)) * 8 * NT + t * 8 + 2 * q + (i & 1)] = acc[t][i];
    __syncthreads();

    constexpr int PER_THREAD = (16 * 8 * NT + W_WARPS * 32 - 1) / (W_WARPS * 32);
    const int outputs = 16 * N;  // output i: row i % 16, column i / 16
    float sums[PER_THREAD];
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int i = threadIdx.x + j * W_WARPS * 32;
        float v = 0.f;
        if (i < outputs)
            for (int w = 0; w < W_WARPS; ++w) v += tiles[w * 16 * 8 * NT + (i % 16) * 8 * NT + i / 16];
        sums[j] = v;
    }
    if (splits > 1) {
        float* own = partial + ((size_t)band * splits + split) * outputs;
#pragma unroll
        for (int j = 0; j < PER_THREAD; ++j) {
            const int i = threadIdx.x + j * W_WARPS * 32;
            if (i < outputs) own[i] = sums[j];
        }
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(tickets + band, 1u) == (u32)(splits - 1);
        __syncthreads();
        if (!last) return;
        __threadfence();
        const float* all = partial + (size_t)band * splits * outputs;
#pragma unroll
        for (int j = 0; j < PER_THREAD; ++j) {
            const int i = threadIdx.x + j * W_WARPS * 32;
            float v = 0.f;
            if (i < outputs)
                for (int sp = 0; sp < splits; ++sp) v += __ldcg(all + (size_t)sp * outputs + i);
            sums[j] = v;
        }
        if (threadIdx.x == 0) tickets[band] = 0;
    }

    const u32 e0 = __ldg(esc_off + band), e1 = __ldg(esc_off + band + 1);
#pragma unroll
    for (int j = 0; j < PER_THREAD; ++j) {
        const int i = threadIdx.x + j * W_WARPS * 32;
        const int r = i % 16, n = i / 16, m = band * 16 + r;
        if (i >= outputs || m >= M) continue;
        float v = sums[j];
        for (u32 e = e0; e < e1; ++e) {  // the band's escapes in list order, those of row r
            const u32 p = __ldg(esc_pos + e);
            if ((int)(p & 15u) == r) v += bf16_value(__ldg(esc_val + e)) * bf16_value(__ldg(x + (size_t)n * ldx + (p >> 4)));
        }
        if (bias) v += bf16_value(__ldg(bias + m));
        y[(size_t)n * ldy + m] = bf16_bits(v);
    }
}
