// The weights' kernels over the tiled 12-bit split layout (docs/weights-format.md, "The tiled
// layout"): kvz_w_gemm, the fused decode+GEMM y = x W^T + bias for small N on tensor cores
// (mma.sync m16n8k16, BF16 in, FP32 accumulate); kvz_w_decode, W back in row-major BF16; and
// kvz_w_patch, which writes the escapes into a decoded W.
//
// The layout in one paragraph.  W (M x K) is padded with zeros to whole bands of 16 rows and
// chunks of 64 columns; block (band, chunk) is 1536 bytes: 512 bytes of 4-bit codes, then 1024
// sign+mantissa bytes (sign << 7 | mantissa).  Lane l of a warp owns 32 weights of the block, in
// the order of the mma A fragment of its four 16-column steps, so one 16-byte load per stream
// gives it everything it multiplies: codes at byte 16 l, sign+mantissa of steps 0-1 at 512 + 16 l,
// of steps 2-3 at 1024 + 16 l.  Code 0 means exponent 0 (zero, subnormal); codes 1-15 the
// matrix's codebook.  An escape (an exponent outside the codebook) is stored as code 0 with a
// zero byte, so it decodes to +0 here, and its value sits in a per-band list that kvz_w_gemm adds
// in FP32 after the tensor-core loop (the weight stays exact, only the summation order changes)
// and kvz_w_patch writes over the decoded zero.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

#define W_CHUNK 64             // columns of a block
#define W_BLOCK_U4 96          // 16-byte words of a block (1536 bytes)
#define W_WARPS 8              // warps of a thread block of every kernel here
#define W_LUT_WORDS (256 * 32) // the pair table, one copy per lane (see build_pair_table)
#define W_TILE_WORDS 36        // a decoded row of 64 BF16 in shared memory: 32 words + 4 of padding

// Streams read once bypass L1, which keeps x (read by every band) there.
__device__ __forceinline__ uint4 load_once(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}

__device__ __forceinline__ float bf16_value(u32 bits) { return __uint_as_float(bits << 16); }

// FP32 to BF16, rounding to nearest even; NaN stays a (quiet) NaN of the same sign.
__device__ __forceinline__ u16 bf16_bits(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u16)((u >> 16) | 0x40u);
    return (u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The pair table: entry b (a byte holding two codes, low nibble first) is both weights' exponent
// fields in place, (E[b & 15] << 7) | (E[b >> 4] << 23).  Each lane reads its own copy (word
// 32 b + lane, always bank `lane`), so the random lookups never conflict.
__device__ __forceinline__ void build_pair_table(u32* table, const u8* __restrict__ codebook) {
    for (int i = threadIdx.x; i < W_LUT_WORDS; i += blockDim.x) {
        const int b = i >> 5;
        table[i] = ((u32)__ldg(codebook + (b & 15)) << 7) | ((u32)__ldg(codebook + (b >> 4)) << 23);
    }
}

// One 16-column step of a lane: four words of two BF16 each (the mma A registers a0a1, a2a3,
// a4a5, a6a7) from a word of four code bytes and two words of sign+mantissa bytes.  A byte s is
// copied into both bytes of its half (byte_perm); mask 0x807F keeps its sign at bit 15 and its
// mantissa at bits 0-6, and the table fills bits 7-14.
__device__ __forceinline__ void decode_step(const u32* lane_table, u32 codes, u32 sm01, u32 sm23, u32 a[4]) {
    a[0] = (__byte_perm(sm01, 0, 0x1100) & 0x807F807Fu) | lane_table[(codes & 0xFFu) << 5];
    a[1] = (__byte_perm(sm01, 0, 0x3322) & 0x807F807Fu) | lane_table[((codes >> 8) & 0xFFu) << 5];
    a[2] = (__byte_perm(sm23, 0, 0x1100) & 0x807F807Fu) | lane_table[((codes >> 16) & 0xFFu) << 5];
    a[3] = (__byte_perm(sm23, 0, 0x3322) & 0x807F807Fu) | lane_table[(codes >> 24) << 5];
}

__device__ __forceinline__ void mma_bf16(float c[4], const u32 a[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

struct Block {
    uint4 codes, sm01, sm23;  // this lane's words: codes; sign+mantissa of steps 0-1; of steps 2-3
};

__device__ __forceinline__ Block load_block(const uint4* __restrict__ block, int lane) {
    return Block{load_once(block + lane), load_once(block + 32 + lane), load_once(block + 64 + lane)};
}

// ------------------------------------------------------------------------------ kvz_w_gemm
// y[n, m] = sum_k x[n, k] W[m, k] + bias[m], for n < N <= 8 NT.  Grid (bands, splits): a thread
// block multiplies one band over its split's chunks, its warps taking every W_WARPS-th chunk
// (the next one's loads in flight while one is multiplied), and sums the warps' tiles in warp
// order.  With splits > 1 each block leaves its sum in partial[band][split] and the last of a
// band's blocks to finish (a ticket) adds them in split order: the result does not depend on
// which block ran when.  That block then adds the band's escapes in list order and the bias,
// rounds to BF16 and resets the ticket, so tickets are all zero again between calls.
// x rows are ldx apart; K and ldx are even (a lane loads x two values at a time).
template <int NT>
__global__ void __launch_bounds__(W_WARPS * 32) kvz_w_gemm(
        const uint4* __restrict__ blocks, const u8* __restrict__ codebook, const u32* __restrict__ esc_off,
        const u32* __restrict__ esc_pos, const u16* __restrict__ esc_val, const u16* __restrict__ x, int ldx,
        const u16* __restrict__ bias, u16* __restrict__ y, int ldy, float* __restrict__ partial,
        u32* __restrict__ tickets, int M, int K, int N, int chunks, int per_split) {
    extern __shared__ u32 smem[];  // the pair table, then (after the loop) the warps' tiles
    u32* table = smem;
    float* tiles = reinterpret_cast<float*>(smem);  // [W_WARPS][16][8 NT]: 32 KB at NT = 8, as the table
    static_assert(W_WARPS * 16 * 8 * NT <= W_LUT_WORDS, "the warps' tiles must fit where the table was");
    __shared__ int last;
    build_pair_table(table, codebook);
    __syncthreads();

    const int band = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const u32* lane_table = table + lane;
    const uint4* band_blocks = blocks + (size_t)band * chunks * W_BLOCK_U4;
    const int c_end = min(chunks, (split + 1) * per_split);

    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.f;

    int c = split * per_split + warp;
    Block cur;
    if (c < c_end) cur = load_block(band_blocks + (size_t)c * W_BLOCK_U4, lane);
    while (c < c_end) {
        const int next = c + W_WARPS;
        Block nxt;
        if (next < c_end) nxt = load_block(band_blocks + (size_t)next * W_BLOCK_U4, lane);
        const u32 codes[4] = {cur.codes.x, cur.codes.y, cur.codes.z, cur.codes.w};
        const u32 sm[8] = {cur.sm01.x, cur.sm01.y, cur.sm01.z, cur.sm01.w, cur.sm23.x, cur.sm23.y, cur.sm23.z, cur.sm23.w};
        const bool whole = (c + 1) * W_CHUNK <= K;
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            u32 a[4];
            decode_step(lane_table, codes[s], sm[2 * s], sm[2 * s + 1], a);
            const int k = c * W_CHUNK + s * 16 + 2 * q;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                const int n = t * 8 + g;
                u32 b0 = 0, b1 = 0;
                if (n < N) {
                    const u32* row = reinterpret_cast<const u32*>(x + (size_t)n * ldx);
                    if (whole || k < K) b0 = __ldg(row + (k >> 1));
                    if (whole || k + 8 < K) b1 = __ldg(row + ((k + 8) >> 1));
                }
                mma_bf16(acc[t], a, b0, b1);
            }
        }
        cur = nxt;
        c = next;
    }

    // c0 c1: row g, columns 2q, 2q+1 of the n tile; c2 c3: row g + 8.
    __syncthreads();  // every warp is done with the table
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        float* tile = tiles + warp * 16 * 8 * NT;
        tile[g * 8 * NT + t * 8 + 2 * q] = acc[t][0];
        tile[g * 8 * NT + t * 8 + 2 * q + 1] = acc[t][1];
        tile[(g + 8) * 8 * NT + t * 8 + 2 * q] = acc[t][2];
        tile[(g + 8) * 8 * NT + t * 8 + 2 * q + 1] = acc[t][3];
    }
    __syncthreads();

    const int outputs = 16 * N;  // (r, n) = (i % 16, i / 16)
    float sums[(16 * 8 * NT + W_WARPS * 32 - 1) / (W_WARPS * 32)];
#pragma unroll
    for (int j = 0; j < (int)(sizeof(sums) / sizeof(float)); ++j) {
        const int i = threadIdx.x + j * W_WARPS * 32;
        float v = 0.f;
        if (i < outputs)
            for (int w = 0; w < W_WARPS; ++w) v += tiles[w * 16 * 8 * NT + (i % 16) * 8 * NT + i / 16];
        sums[j] = v;
    }

    if (splits > 1) {
        float* mine = partial + ((size_t)band * splits + split) * outputs;
#pragma unroll
        for (int j = 0; j < (int)(sizeof(sums) / sizeof(float)); ++j) {
            const int i = threadIdx.x + j * W_WARPS * 32;
            if (i < outputs) mine[i] = sums[j];
        }
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) last = atomicAdd(tickets + band, 1u) == (u32)(splits - 1);
        __syncthreads();
        if (!last) return;
        __threadfence();
        const float* all = partial + (size_t)band * splits * outputs;
#pragma unroll
        for (int j = 0; j < (int)(sizeof(sums) / sizeof(float)); ++j) {
            const int i = threadIdx.x + j * W_WARPS * 32;
            float v = 0.f;
            if (i < outputs)
                for (int s = 0; s < splits; ++s) v += __ldcg(all + (size_t)s * outputs + i);
            sums[j] = v;
        }
        if (threadIdx.x == 0) tickets[band] = 0;
    }

    const u32 e0 = __ldg(esc_off + band), e1 = __ldg(esc_off + band + 1);
#pragma unroll
    for (int j = 0; j < (int)(sizeof(sums) / sizeof(float)); ++j) {
        const int i = threadIdx.x + j * W_WARPS * 32;
        const int r = i % 16, n = i / 16, m = band * 16 + r;
        if (i >= outputs || m >= M) continue;
        float v = sums[j];
        for (u32 e = e0; e < e1; ++e) {
            const u32 p = __ldg(esc_pos + e);
            if ((int)(p & 15u) == r) v += bf16_value(__ldg(esc_val + e)) * bf16_value(__ldg(x + (size_t)n * ldx + (p >> 4)));
        }
        if (bias) v += bf16_value(__ldg(bias + m));
        y[(size_t)n * ldy + m] = bf16_bits(v);
    }
}

// ------------------------------------------------------------------------------ kvz_w_decode
// W (M x K, row-major BF16, rows K apart) from its blocks, escapes as +0 (kvz_w_patch follows).
// Each warp decodes blocks warp-strided over the grid, through a 16 x 64 tile in shared memory
// (rows W_TILE_WORDS words apart: lane (g, q) writes bank 4g + q + const, no conflicts), and
// stores whole rows of the tile: 16-byte stores where the block is whole and K % 8 == 0.
__global__ void __launch_bounds__(W_WARPS * 32) kvz_w_decode(const uint4* __restrict__ blocks,
        const u8* __restrict__ codebook, u16* __restrict__ out, int M, int K, int bands, int chunks) {
    extern __shared__ u32 smem[];
    u32* table = smem;
    build_pair_table(table, codebook);
    __syncthreads();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const u32* lane_table = table + lane;
    u32* tile = smem + W_LUT_WORDS + warp * 16 * W_TILE_WORDS;
    const long long total = (long long)bands * chunks;
    const bool vector_rows = (K & 7) == 0;
    for (long long b = (long long)blockIdx.x * W_WARPS + warp; b < total; b += (long long)gridDim.x * W_WARPS) {
        const Block blk = load_block(blocks + b * W_BLOCK_U4, lane);
        const u32 codes[4] = {blk.codes.x, blk.codes.y, blk.codes.z, blk.codes.w};
        const u32 sm[8] = {blk.sm01.x, blk.sm01.y, blk.sm01.z, blk.sm01.w, blk.sm23.x, blk.sm23.y, blk.sm23.z, blk.sm23.w};
        __syncwarp();
#pragma unroll
        for (int s = 0; s < 4; ++s) {
            u32 a[4];
            decode_step(lane_table, codes[s], sm[2 * s], sm[2 * s + 1], a);
#pragma unroll
            for (int p = 0; p < 4; ++p) tile[(g + 8 * (p & 1)) * W_TILE_WORDS + 8 * s + 4 * (p >> 1) + q] = a[p];
        }
        __syncwarp();
        const int band = (int)(b / chunks), chunk = (int)(b % chunks);
        const int col0 = chunk * W_CHUNK;
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            const int i = lane + 32 * t, row = i >> 3, part = i & 7;  // part: 8 columns of the row
            const int m = band * 16 + row, col = col0 + part * 8;
            if (m >= M || col >= K) continue;
            const uint4 v = *reinterpret_cast<const uint4*>(tile + row * W_TILE_WORDS + part * 4);
            u16* dst = out + (size_t)m * K + col;
            if (vector_rows && col + 8 <= K) {
                __stcs(reinterpret_cast<uint4*>(dst), v);
            } else {
                const u32 w[4] = {v.x, v.y, v.z, v.w};
                for (int e = 0; e < 8 && col + e < K; ++e) dst[e] = (u16)(w[e >> 1] >> (16 * (e & 1)));
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
