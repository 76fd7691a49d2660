// The tiled layout's decoder (kvz_w_decode, then kvz_w_patch for the escapes) and its encoder
// (kvz_w_histogram for the histogram and the codebook, kvz_w_encode for the blocks and the escape
// offsets, kvz_w_escapes for the lists): the bytes of kvzip/weights/tiled.py's reference.
#pragma once

#include "weights_tile.cuh"
#include "weights_book.cuh"

__device__ __forceinline__ u32 warp_sum(u32 v) {
#pragma unroll
    for (int d = 16; d; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    return v;
}

// ------------------------------------------------------------------------------ kvz_w_decode
// W (M x K, row-major BF16, rows K apart) from its blocks, escapes as +0 (kvz_w_patch follows).
// Each warp decodes blocks warp-strided over the grid, streamed through its ring, through a
// 16 x 64 tile in shared memory (weight (row, column) at word 33 row + column / 2, see
// W_TILE_WORDS), and stores whole rows of the tile: 16-byte stores where the part is whole and
// K % 8 == 0.
__global__ void __launch_bounds__(W_WARPS * 32) kvz_w_decode(const uint4* __restrict__ blocks,
        const u8* __restrict__ codebook, u16* __restrict__ out, int M, int K, int bands, int chunks) {
    extern __shared__ uint4 smem[];  // the pair table, each warp's ring, each warp's tile
    u32* table = reinterpret_cast<u32*>(smem);
    build_pair_table(table, codebook);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const u32* lane_table = table + lane;
    uint4* ring = smem + W_LUT_WORDS / 4 + warp * W_DECODE_STAGES * W_BLOCK_U4;
    u32* tile = reinterpret_cast<u32*>(smem + W_LUT_WORDS / 4 + W_WARPS * W_DECODE_STAGES * W_BLOCK_U4) +
                warp * 16 * W_TILE_WORDS;
    const long long total = (long long)bands * chunks, stride = (long long)gridDim.x * W_WARPS;
    const bool vector_rows = (K & 7) == 0;
    const long long first = (long long)blockIdx.x * W_WARPS + warp;
#pragma unroll
    for (int i = 0; i < W_DECODE_STAGES - 1; ++i)
        ring_issue(ring, i, blocks + (first + i * stride) * W_BLOCK_U4, first + i * stride < total, lane);
    int slot = 0;
    for (long long b = first; b < total; b += stride) {
        const Block cur = ring_take<W_DECODE_STAGES>(ring, slot, lane);
        const long long ahead = b + (W_DECODE_STAGES - 1) * stride;
        ring_issue(ring, slot == 0 ? W_DECODE_STAGES - 1 : slot - 1, blocks + ahead * W_BLOCK_U4, ahead < total, lane);
        slot = slot + 1 == W_DECODE_STAGES ? 0 : slot + 1;
        const u32 codes[4] = {cur.codes.x, cur.codes.y, cur.codes.z, cur.codes.w};
        const u32 sm[8] = {cur.sm01.x, cur.sm01.y, cur.sm01.z, cur.sm01.w, cur.sm23.x, cur.sm23.y, cur.sm23.z, cur.sm23.w};
        __syncwarp();  // the tile's last rows are stored
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            u32 a[4];
            decode_step(lane_table, codes[s], sm[2 * s], sm[2 * s + 1], a);
#pragma unroll
            for (int p = 0; p < 4; ++p) tile[(g + 8 * (p & 1)) * W_TILE_WORDS + 8 * q + 2 * s + (p >> 1)] = a[p];
        }
        __syncwarp();
        const int band = (int)(b / chunks), col0 = (int)(b % chunks) * W_CHUNK;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int i = lane + 32 * t, row = i >> 3, part = i & 7;  // part: 8 columns of the row
            const int m = band * 16 + row, col = col0 + part * 8;
            if (m >= M || col >= K) continue;
            const u32* src = tile + row * W_TILE_WORDS + part * 4;
            const uint4 v = make_uint4(src[0], src[1], src[2], src[3]);
            u16* dst = out + (size_t)m * K + col;
            if (vector_rows && col + 8 <= K) {
                __stcs(reinterpret_cast<uint4*>(dst), v);
            } else {
                for (int e = 0; e < 8 && col + e < K; ++e) dst[e] = (u16)(src[e >> 1] >> (16 * (e & 1)));
            }
        }
    }
}

// ------------------------------------------------------------------------------ kvz_w_patch
// Escape e of band b (esc_off[b] <= e < esc_off[b + 1]) back into a decoded W: one thread each.
__global__ void __launch_bounds__(256) kvz_w_patch(const u32* __restrict__ esc_off, const u32* __restrict__ esc_pos,
        const u16* __restrict__ esc_val, int bands, u16* __restrict__ out, int K) {
    const u32 e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= __ldg(esc_off + bands)) return;
    int lo = 0, hi = bands;  // the band b with esc_off[b] <= e < esc_off[b + 1]
    while (hi - lo > 1) {
        const int mid = (lo + hi) >> 1;
        if (__ldg(esc_off + mid) <= e) lo = mid; else hi = mid;
    }
    const u32 p = __ldg(esc_pos + e);
    out[(size_t)(lo * 16 + (p & 15u)) * K + (p >> 4)] = __ldg(esc_val + e);
}

// ------------------------------------------------------------------------------ kvz_w_histogram
// hist[e] = the number of weights with exponent e, then by the grid's last block (ticket) the
// codebook: book (16 bytes) and code_of (256 bytes, each exponent's code) by choose_codebook_block.
// hist (256 words) and ticket zeroed by the caller.  w is n BF16, 16-byte aligned; each warp counts
// into its own shared histogram.
static_assert(W_WARPS * 32 == 256, "the histogram's last block is choose_codebook_block's 256 threads");
__global__ void __launch_bounds__(W_WARPS * 32) kvz_w_histogram(const u16* __restrict__ w, long long n,
        u32* __restrict__ hist, u32* __restrict__ ticket, u8* __restrict__ book, u8* __restrict__ code_of) {
    __shared__ u32 h[W_WARPS][256];
    for (int i = threadIdx.x; i < W_WARPS * 256; i += blockDim.x) (&h[0][0])[i] = 0;
    __syncthreads();
    u32* mine = h[threadIdx.x >> 5];
    const long long parts = n >> 3, stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < parts; i += stride) {
        const uint4 v = load_once(reinterpret_cast<const uint4*>(w) + i);
        const u32 words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            atomicAdd(mine + ((words[j] >> 7) & 0xFFu), 1u);
            atomicAdd(mine + ((words[j] >> 23) & 0xFFu), 1u);
        }
    }
    if (blockIdx.x == 0)
        for (long long i = parts * 8 + threadIdx.x; i < n; i += blockDim.x) atomicAdd(mine + ((w[i] >> 7) & 0xFFu), 1u);
    __syncthreads();
    const int e = threadIdx.x;  // one exponent a thread
    u32 v = 0;
    for (int k = 0; k < W_WARPS; ++k) v += h[k][e];
    if (v) atomicAdd(hist + e, v);
    if (last_block(ticket)) choose_codebook_block(__ldcg(hist + e), book, code_of);
}

// ------------------------------------------------------------------------------ kvz_w_encode
// esc_off[0] = 0 and esc_off[b + 1] = band_counts[0] + .. + band_counts[b], by one thread block:
// each thread sums a run of consecutive bands, and the runs' sums are scanned across the block.
__device__ __forceinline__ void band_offsets(const u32* band_counts, int bands, u32* __restrict__ esc_off) {
    __shared__ u32 warp_sums[W_WARPS];
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, per = (bands + W_WARPS * 32 - 1) / (W_WARPS * 32);
    const int lo = min(t * per, bands), hi = min(lo + per, bands);
    u32 run = 0;
#pragma unroll 1
    for (int b = lo; b < hi; ++b) run += __ldcg(band_counts + b);
    u32 inclusive = run;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const u32 v = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += v;
    }
    if (lane == 31) warp_sums[warp] = inclusive;
    __syncthreads();
    u32 at = inclusive - run;  // the escapes of bands before lo
    for (int i = 0; i < warp; ++i) at += warp_sums[i];
    if (t == 0) esc_off[0] = 0;
#pragma unroll 1
    for (int b = lo; b < hi; ++b) {
        at += __ldcg(band_counts + b);
        esc_off[b + 1] = at;
    }
}

// The blocks of W (M x K, rows K apart), each block's number of escapes (counts[block]), and by
// the grid's last thread block (ticket) the escape lists' offsets esc_off (bands + 1 words) from
// each band's escapes (band_counts, added to by the blocks that have some).  code_of[e] is the
// code of exponent e, 0 for exponent 0 and for escapes.  band_counts and ticket zeroed by the
// caller.  A warp per block: the 16 x 64 tile through shared memory (coalesced rows), then each
// lane packs its 32 weights.  Five thread blocks an SM (48 registers, no spills on sm_90) keep 40
// warps' loads in flight; left to itself ptxas takes 54 registers for the last block's scan, and
// four blocks.
__global__ void __launch_bounds__(W_WARPS * 32, 5) kvz_w_encode(const u16* __restrict__ w, int M, int K,
        const u8* __restrict__ code_of, uint4* __restrict__ blocks, u32* __restrict__ counts, u32* band_counts,
        u32* __restrict__ ticket, u32* __restrict__ esc_off, int bands, int chunks) {
    __shared__ u8 code_s[256];
    __shared__ u32 tiles[W_WARPS][16 * W_TILE_WORDS];
    for (int i = threadIdx.x; i < 256; i += blockDim.x) code_s[i] = code_of[i];
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    u32* tile = tiles[warp];
    const long long total = (long long)bands * chunks, stride = (long long)gridDim.x * W_WARPS;
    const bool vector_rows = (K & 7) == 0;
    for (long long b = (long long)blockIdx.x * W_WARPS + warp; b < total; b += stride) {
        const int band = (int)(b / chunks), col0 = (int)(b % chunks) * W_CHUNK;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int i = lane + 32 * t, row = i >> 3, part = i & 7;
            const int m = band * 16 + row, col = col0 + part * 8;
            u32 v[4] = {0, 0, 0, 0};
            if (m < M && col < K) {
                const u16* src = w + (size_t)m * K + col;
                if (vector_rows) {
                    const uint4 u = load_once(reinterpret_cast<const uint4*>(src));
                    v[0] = u.x; v[1] = u.y; v[2] = u.z; v[3] = u.w;
                } else {
                    for (int e = 0; e < 8 && col + e < K; ++e) v[e >> 1] |= (u32)src[e] << (16 * (e & 1));
                }
            }
            u32* at = tile + row * W_TILE_WORDS + part * 4;
            at[0] = v[0]; at[1] = v[1]; at[2] = v[2]; at[3] = v[3];
        }
        __syncwarp();
        u32 codes[4] = {0, 0, 0, 0}, sm[8] = {0, 0, 0, 0, 0, 0, 0, 0}, escapes = 0;
#pragma unroll
        for (int s = 0; s < 4; ++s)
#pragma unroll
            for (int p = 0; p < 4; ++p) {
                const u32 pair = tile[(g + 8 * (p & 1)) * W_TILE_WORDS + 8 * q + 2 * s + (p >> 1)];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const u32 bits = (pair >> (16 * h)) & 0xFFFFu, e = (bits >> 7) & 0xFFu, code = code_s[e];
                    const bool escape = code == 0 && e != 0;
                    const int t = 8 * s + 2 * p + h;
                    codes[s] |= code << (8 * p + 4 * h);
                    sm[t >> 2] |= (escape ? 0u : ((bits >> 8) & 0x80u) | (bits & 0x7Fu)) << (8 * (t & 3));
                    escapes += escape;
                }
            }
        __syncwarp();  // the tile read before the next one lands
        uint4* dst = blocks + b * W_BLOCK_U4;
        __stcs(dst + lane, make_uint4(codes[0], codes[1], codes[2], codes[3]));
        __stcs(dst + 32 + lane, make_uint4(sm[0], sm[1], sm[2], sm[3]));
        __stcs(dst + 64 + lane, make_uint4(sm[4], sm[5], sm[6], sm[7]));
        escapes = warp_sum(escapes);
        if (lane == 0) {
            counts[b] = escapes;
            if (escapes) atomicAdd(band_counts + band, escapes);
        }
    }
    if (last_block(ticket)) band_offsets(band_counts, bands, esc_off);
}

// ------------------------------------------------------------------------------ kvz_w_escapes
// The escape lists: band b's at esc_pos/esc_val[esc_off[b] ..] (kvz_w_encode's offsets), ordered
// by position 16 column + row: a band's blocks in column order, each block's columns in lane
// order, each column's rows in order (by a warp scan).  A block's list starts after its band's
// earlier blocks' escapes (counts, summed by the warp).
__global__ void __launch_bounds__(W_WARPS * 32) kvz_w_escapes(const u16* __restrict__ w, int M, int K,
        const u8* __restrict__ code_of, const u32* __restrict__ counts, const u32* __restrict__ esc_off,
        u32* __restrict__ esc_pos, u16* __restrict__ esc_val, int bands, int chunks) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long total = (long long)bands * chunks, stride = (long long)gridDim.x * W_WARPS;
    for (long long b = (long long)blockIdx.x * W_WARPS + warp; b < total; b += stride) {
        if (__ldg(counts + b) == 0) continue;
        const int band = (int)(b / chunks), chunk = (int)(b % chunks), col0 = chunk * W_CHUNK;
        u32 earlier = 0;  // escapes of the band's blocks before this one
        for (int c = lane; c < chunk; c += 32) earlier += __ldg(counts + (b - chunk) + c);
        u32 at = __ldg(esc_off + band) + warp_sum(earlier);
        for (int half = 0; half < 2; ++half) {
            const int col = col0 + half * 32 + lane;
            u32 mask = 0;
            for (int r = 0; r < 16; ++r) {
                const int m = band * 16 + r;
                const u32 bits = (m < M && col < K) ? w[(size_t)m * K + col] : 0u, e = (bits >> 7) & 0xFFu;
                if (__ldg(code_of + e) == 0 && e != 0) mask |= 1u << r;
            }
            const u32 mine = __popc(mask);
            u32 before = mine;  // inclusive scan over lanes, then exclusive
#pragma unroll
            for (int d = 1; d < 32; d <<= 1) {
                const u32 v = __shfl_up_sync(0xffffffffu, before, d);
                if (lane >= d) before += v;
            }
            u32 i = at + before - mine;
            for (int r = 0; r < 16; ++r)
                if (mask >> r & 1u) {
                    esc_pos[i] = (u32)col * 16u + r;
                    esc_val[i++] = w[(size_t)(band * 16 + r) * K + col];
                }
            at += __shfl_sync(0xffffffffu, before, 31);
        }
    }
}
