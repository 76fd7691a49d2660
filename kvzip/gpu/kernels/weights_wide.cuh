// kvz_w_gemm_wide: y[n, m] = sum_k x[n, k] W[m, k] + bias[m] for x wider than kvz_w_gemm's
// (N > 32), W in the tiled layout.
//
// A thread block owns W_WARPS bands (a warp each: 16 rows) and 8 NT columns of x (its n block),
// over one split of the chunks.  A chunk at a time, the block stages in shared memory its bands'
// blocks of that chunk and x's 64 columns for its n block (cp.async, W_WIDE_STAGES - 1 chunks
// ahead, a barrier a chunk); each warp decodes its block into mma A fragments once and multiplies
// them by all NT n tiles, its B fragments read from the staged x.  So each weight byte is read
// from HBM once per n block, and x once per block from L2, shared by the block's 8 bands.
//
// Decoding needs no table: a lane keeps the 16-byte codebook in registers and looks up four
// codes at a time with byte permutes (expand_codes).  Escapes (decoded as +0) are written into
// the A fragments before the mma from the band's list, which the warp walks in step with its
// chunks (EscapeWalk), so the tensor cores multiply every weight exactly and nothing is added
// after the loop.
//
// The sum of each output is in a fixed order whatever the schedule: the split's chunks in order
// (the tensor core's own order within a step), the splits in order (the last block of a tile to
// finish, by a ticket, adds them from `partial`), the bias; then rounded to BF16 once.
// K % 16 == 0; x 16-byte aligned, ldx % 8 == 0.
#pragma once

#include "weights_tile.cuh"

#define W_WIDE_STAGES 3  // chunks staged a block: the one multiplied and two in flight
#define W_X_ROW 72       // BF16 a staged row of x: 64 + 8, so that each quarter-warp's 16-byte B
                         // loads (rows g, columns 16 q + 8 p) fall in 32 distinct banks

// The staged chunk j of a block: its W_WARPS blocks of W (a warp's at w * W_BLOCK_U4), then x's
// rows n0 .. n0 + 8 NT - 1, columns 64 c .. 64 c + 63, each W_X_ROW BF16 long.
template <int NT>
struct WideStage {
    static constexpr int W_U4 = W_WARPS * W_BLOCK_U4;
    static constexpr int X_U4 = 8 * NT * W_X_ROW / 8;
    static constexpr int U4 = W_U4 + X_U4;
};

// cp.async of 16 bytes, or 16 zero bytes where !real (x past N or K: zeros keep W's zero padding
// a zero product, where stale bytes could hold a NaN).
__device__ __forceinline__ void copy16_async_or_zero(uint4* smem_dst, const void* src, bool real) {
#ifdef __CUDA_ARCH__
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(real ? 16 : 0) : "memory");
#else
    *smem_dst = real ? *static_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}

__device__ __forceinline__ void async_commit() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int PENDING>
__device__ __forceinline__ void async_wait() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#endif
}

// A thread's share of staging x: pieces of 16 bytes (8 columns of a row), the same ones every
// chunk.  Found once per block: its row of x at the piece's column in chunk 0 (nullptr past N or
// where the thread has no piece), that column, its place in a stage.
template <int NT>
struct XPieces {
    static constexpr int PIECES = 8 * NT * 8, EACH = (PIECES + W_WARPS * 32 - 1) / (W_WARPS * 32);
    const u16* src[EACH];
    int col[EACH];
    int dst[EACH];  // uint4 index from the stage's x part
};

template <int NT>
__device__ __forceinline__ XPieces<NT> x_pieces(const u16* __restrict__ x, int ldx, int N, int n0) {
    XPieces<NT> xp;
#pragma unroll
    for (int i = 0; i < XPieces<NT>::EACH; ++i) {
        const int p = threadIdx.x + i * W_WARPS * 32, r = p >> 3, j = p & 7;
        const bool real = p < XPieces<NT>::PIECES && n0 + r < N;
        xp.src[i] = real ? x + (size_t)(n0 + r) * ldx + 8 * j : nullptr;
        xp.col[i] = 8 * j;
        xp.dst[i] = r * (W_X_ROW / 8) + j;
    }
    return xp;
}

// Chunk c into stage `stage`: each warp its band's block, every thread its pieces of x.  One
// commit a thread whatever it copied, so that wait_group counts chunks.
template <int NT>
__device__ __forceinline__ void stage_chunk(uint4* stage, const uint4* __restrict__ band_blocks, bool band_real,
                                            const XPieces<NT>& xp, const u16* __restrict__ x, int K, int c, int lane,
                                            int warp) {
    if (band_real) {
        const uint4* src = band_blocks + (size_t)c * W_BLOCK_U4;
        uint4* dst = stage + warp * W_BLOCK_U4;
        copy16_async_or_zero(dst + lane, src + lane, true);
        copy16_async_or_zero(dst + 32 + lane, src + 32 + lane, true);
        copy16_async_or_zero(dst + 64 + lane, src + 64 + lane, true);
    }
    uint4* xs = stage + WideStage<NT>::W_U4;
#pragma unroll
    for (int i = 0; i < XPieces<NT>::EACH; ++i) {
        if (XPieces<NT>::PIECES % (W_WARPS * 32) && threadIdx.x + i * W_WARPS * 32 >= XPieces<NT>::PIECES) continue;
        const int k = c * W_CHUNK + xp.col[i];
        const bool real = xp.src[i] != nullptr && k < K;  // K % 8 == 0: a piece is all in or all out
        copy16_async_or_zero(xs + xp.dst[i], real ? xp.src[i] + c * W_CHUNK : x, real);
    }
    async_commit();
}

// Grid (row blocks of W_WARPS bands, splits, n blocks of 8 NT columns).  partial: the splits'
// sums, [tile][split][band of the block][16 rows][8 NT] floats (tile = row block x n blocks +
// n block); tickets: one a tile, zero before and after (used only when splits > 1).
// 16 tiles' sums take 64 registers a thread: that instance runs one block a multiprocessor (at two, 128
// registers spilled in the chunk loop), the 8-tile one two, the narrower ones three.
template <int NT>
__global__ void __launch_bounds__(W_WARPS * 32, NT > 8 ? 1 : NT > 4 ? 2 : 3) kvz_w_gemm_wide(
        const uint4* __restrict__ blocks, const u8* __restrict__ codebook, const u32* __restrict__ esc_off,
        const u32* __restrict__ esc_pos, const u16* __restrict__ esc_val, const u16* __restrict__ x, int ldx,
        const u16* __restrict__ bias, u16* __restrict__ y, int ldy, float* __restrict__ partial,
        u32* __restrict__ tickets, int M, int K, int N, int chunks, int per_split) {
    constexpr int BN = 8 * NT, TILE_ROW = BN + 4;  // a warp's sums in shared memory: 16 rows of BN (+4: banks)
    static_assert(W_WARPS * 16 * TILE_ROW * 4 <= W_WIDE_STAGES * WideStage<NT>::U4 * 16,
                  "the warps' sums must fit where the stages were");
    extern __shared__ uint4 smem[];
    __shared__ int last;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const int bands = (M + 15) / 16, band = blockIdx.x * W_WARPS + warp;
    const bool band_real = band < bands;
    const int split = blockIdx.y, splits = gridDim.y, n0 = blockIdx.z * BN;
    const int c0 = split * per_split, nc = min(chunks, c0 + per_split) - c0;
    const uint4* band_blocks = blocks + (size_t)min(band, bands - 1) * chunks * W_BLOCK_U4;

    u32 book[4];
    load_book(codebook, book);
    const XPieces<NT> xp = x_pieces<NT>(x, ldx, N, n0);
    const u32 e0 = band_real ? __ldg(esc_off + band) : 0u, e1 = band_real ? __ldg(esc_off + band + 1) : 0u;
    EscapeWalk ew = start_escapes(esc_pos, esc_val, e0, e1, (u32)c0 * W_CHUNK * 16, lane);
    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;

#pragma unroll
    for (int j = 0; j < W_WIDE_STAGES - 1; ++j) {
        if (j < nc) stage_chunk<NT>(smem + j * WideStage<NT>::U4, band_blocks, band_real, xp, x, K, c0 + j, lane, warp);
        else async_commit();
    }
    for (int j = 0; j < nc; ++j) {
        async_wait<W_WIDE_STAGES - 2>();  // chunk j's copies of this thread have landed
        __syncthreads();                  // ... and every thread's; every warp is done with chunk j - 1
        const int ahead = j + W_WIDE_STAGES - 1;
        if (ahead < nc)
            stage_chunk<NT>(smem + (ahead % W_WIDE_STAGES) * WideStage<NT>::U4, band_blocks, band_real, xp, x, K,
                            c0 + ahead, lane, warp);
        else
            async_commit();
        const uint4* st = smem + (j % W_WIDE_STAGES) * WideStage<NT>::U4;
        const uint4* wb = st + warp * W_BLOCK_U4;
        const uint4 codes = wb[lane], sm01 = wb[32 + lane], sm23 = wb[64 + lane];
        const u16* xs = reinterpret_cast<const u16*>(st + WideStage<NT>::W_U4) + g * W_X_ROW + 16 * q;
        const u32 limit = (u32)(c0 + j + 1) * W_CHUNK * 16;  // this chunk's escapes: p below it
#pragma unroll
        for (int p = 0; p < 2; ++p) {  // steps 2 p and 2 p + 1: one 16-byte B load a tile serves both
            u32 a0[4], a1[4];
            decode_step_regs(book, p ? codes.z : codes.x, p ? sm23.x : sm01.x, p ? sm23.y : sm01.y, a0);
            decode_step_regs(book, p ? codes.w : codes.y, p ? sm23.z : sm01.z, p ? sm23.w : sm01.w, a1);
            // The chunk's escapes (warp-uniform), walked again for each pair of steps from where the
            // chunk began; the second walk's end is where the next chunk begins.
            EscapeWalk walk = ew;
            chunk_escapes(walk, 0u, limit, esc_pos, esc_val, lane, [&](u32 pos, u32 val) {
                patch_escape(pos, val, 2 * p, lane, a0);
                patch_escape(pos, val, 2 * p + 1, lane, a1);
            });
            if (p == 1) ew = walk;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const uint4 b = *reinterpret_cast<const uint4*>(xs + 8 * t * W_X_ROW + 8 * p);
                mma_bf16(acc[t], a0, b.x, b.y);
                mma_bf16(acc[t], a1, b.z, b.w);
            }
        }
    }
    async_wait<0>();
    __syncthreads();  // the stages are free: the warps' sums go there

    // c0 c1: row g, columns 8 t + 2 q, + 1; c2 c3: row g + 8.
    float* tile = reinterpret_cast<float*>(smem) + warp * 16 * TILE_ROW;
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) tile[(g + 8 * (i >> 1)) * TILE_ROW + 8 * t + 2 * q + (i & 1)] = acc[t][i];
    __syncwarp();

    if (splits > 1) {
        const int tile_id = blockIdx.x * gridDim.z + blockIdx.z;
        constexpr int OUT = 16 * BN;  // a warp's outputs: row i / BN, column i % BN
        float* mine = partial + (((size_t)tile_id * splits + split) * W_WARPS + warp) * OUT;
        for (int i = lane; i < OUT; i += 32) mine[i] = tile[(i / BN) * TILE_ROW + i % BN];
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(tickets + tile_id, 1u) == (u32)(splits - 1);
        __syncthreads();
        if (!last) return;
        __threadfence();
        const float* all = partial + (size_t)tile_id * splits * W_WARPS * OUT + warp * OUT;
        for (int i = lane; i < OUT; i += 32) {
            float v = 0.f;
            for (int sp = 0; sp < splits; ++sp) v += __ldcg(all + (size_t)sp * W_WARPS * OUT + i);
            tile[(i / BN) * TILE_ROW + i % BN] = v;
        }
        if (threadIdx.x == 0) tickets[tile_id] = 0;
        __syncwarp();
    }
    if (!band_real) return;

    // Lane l writes row l % 16 of columns l / 16, l / 16 + 2, ...: each half-warp 16 consecutive BF16 of y.
    const int r = lane & 15, m = band * 16 + r;
    if (m >= M) return;
    const float b = bias ? bf16_value(__ldg(bias + m)) : 0.f;
    for (int col = lane >> 4; col < BN && n0 + col < N; col += 2)
        y[(size_t)(n0 + col) * ldy + m] = bf16_bits(tile[r * TILE_ROW + col] + b);
}
