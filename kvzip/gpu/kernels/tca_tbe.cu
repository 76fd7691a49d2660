// TCA-TBE decode: a blob of ZipServ's weight format (docs/weights-format.md, "TCA-TBE") to its
// row-major BF16 matrix.  Self-contained: kvzip/weights/tca_tbe_gpu.py compiles this file alone.
//
// One block of 128 threads decodes one 64x64 global tile:
//   1. 96 threads load the tile's 3 x 64 bitmap words (three 512-byte runs, 16 bytes a thread),
//      three more its global and median offsets;
//   2. warp 0 counts each small tile's in-window weights (popcount of the three bitmaps' OR) and
//      scans the 64 counts; the tile's offsets must be exactly what the counts imply, and its runs
//      must lie inside their streams, before anything else is read (a forged blob gets an error
//      flag, never an out-of-range access);
//   3. the block copies the tile's sign-mantissa and fallback runs into shared memory, 16 bytes a
//      thread at a time (each run starts 16-byte aligned: the offsets are checked for it), and
//      checks the zeros that close each run;
//   4. each thread rebuilds 4 rows of 8 weights (one row of one small tile each) and stores each as
//      one 16-byte store; a warp's 32 stores cover 4 whole 128-byte rows of the tile.  Padding
//      weights are not stored: each must be the filler.
// Nothing is read twice from global memory: bitmaps, offsets and runs once each, per tile.

#define TBE_THREADS 128
#define TBE_BAD_GLOBAL_OFFSETS 1u  // kvzip/weights/tca_tbe_gpu.py names these
#define TBE_BAD_MEDIAN_OFFSETS 2u
#define TBE_BAD_FILLER 4u
#define TBE_BAD_ZEROS 8u           // a run's closing zeros, or the alignment bytes after the global offsets

typedef unsigned char tbe_u8;
typedef unsigned short tbe_u16;
typedef unsigned int tbe_u32;
typedef unsigned long long tbe_u64;

extern "C" __global__ void __launch_bounds__(TBE_THREADS) kvz_tca_tbe_decode(
    const tbe_u64* __restrict__ bitmaps,         // the three bitmap streams, back to back: plane p, small tile t at p * 64 * tiles + t
    const tbe_u32* __restrict__ global_offsets,  // (tiles + 1) pairs (sign-mantissa, fallback)
    const tbe_u32* __restrict__ median_offsets,  // 4 pairs a tile, from the tile's own start
    const tbe_u8* __restrict__ sign_mantissa, tbe_u32 sm_count,
    const tbe_u16* __restrict__ fallback, tbe_u32 fb_count,
    tbe_u16* __restrict__ out, tbe_u32 rows, tbe_u32 cols, tbe_u32 tiles_k, int base,
    tbe_u32* __restrict__ error)                 // OR of the TBE_BAD_* of every block
{
    __shared__ __align__(16) tbe_u64 plane[3][64];
    __shared__ __align__(16) tbe_u8 sm[4096];
    __shared__ __align__(16) tbe_u16 fb[4096];
    __shared__ tbe_u32 tile_sm_start[64];  // in-window weights before small tile s, in this global tile
    __shared__ tbe_u32 offs[12];           // this tile's pair, the next tile's, then 4 median pairs
    __shared__ tbe_u32 run[5];             // sign-mantissa start and span, fallback start and span, in-window count
    __shared__ tbe_u32 bad;

    const tbe_u32 g = blockIdx.x, tiles = gridDim.x, t = threadIdx.x;

    // 1. bitmaps and offsets (the streams are 16-byte aligned in the blob, a tile's words too)
    if (t < 96) {
        const tbe_u32 p = t >> 5, part = t & 31;
        reinterpret_cast<uint4*>(plane[p])[part] =
            reinterpret_cast<const uint4*>(bitmaps + (size_t)p * tiles * 64 + (size_t)g * 64)[part];
    } else if (t == 96) {
        const uint2 here = reinterpret_cast<const uint2*>(global_offsets)[g];
        const uint2 next = reinterpret_cast<const uint2*>(global_offsets)[g + 1];
        offs[0] = here.x, offs[1] = here.y, offs[2] = next.x, offs[3] = next.y;
        bad = 0;
    } else if (t == 97 || t == 98) {
        const uint4 m = reinterpret_cast<const uint4*>(median_offsets + (size_t)g * 8)[t - 97];
        const tbe_u32 at = 4 + 4 * (t - 97);
        offs[at] = m.x, offs[at + 1] = m.y, offs[at + 2] = m.z, offs[at + 3] = m.w;
    } else if (t == 99 && g == tiles - 1 && (tiles & 1) == 0) {
        // the 8 alignment bytes after an even count of tiles' global offsets must be zero
        const uint2 gap = reinterpret_cast<const uint2*>(global_offsets)[tiles + 1];
        if (gap.x | gap.y) atomicOr(error, TBE_BAD_ZEROS);
    }
    __syncthreads();

    // 2. counts, their scan, and the checks of this tile's offsets
    if (t < 32) {
        const tbe_u32 c0 = __popcll(plane[0][2 * t] | plane[1][2 * t] | plane[2][2 * t]);
        const tbe_u32 c1 = __popcll(plane[0][2 * t + 1] | plane[1][2 * t + 1] | plane[2][2 * t + 1]);
        tbe_u32 inclusive = c0 + c1;
        for (int d = 1; d < 32; d <<= 1) {
            const tbe_u32 v = __shfl_up_sync(0xffffffffu, inclusive, d);
            if (t >= (tbe_u32)d) inclusive += v;
        }
        const tbe_u32 start = inclusive - c0 - c1;
        tile_sm_start[2 * t] = start;
        tile_sm_start[2 * t + 1] = start + c0;
        const tbe_u32 total = __shfl_sync(0xffffffffu, inclusive, 31);
        if ((t & 7) == 0) {  // lane 8m holds small tile 16m: median tile m's first
            const tbe_u32 m = t >> 3;
            if (offs[4 + 2 * m] != start || offs[5 + 2 * m] != 1024 * m - start) atomicOr(&bad, TBE_BAD_MEDIAN_OFFSETS);
        }
        if (t == 0) {
            const tbe_u32 sm_span = (total + 15) & ~15u, fb_span = (4096 - total + 7) & ~7u;
            const tbe_u32 s0 = offs[0], f0 = offs[1], s1 = offs[2], f1 = offs[3];
            // spans exact (unsigned: a next start below this one wraps and differs), starts aligned,
            // ends inside the streams; the first tile starts at 0, the last ends at the streams' ends
            bool ok = s1 - s0 == sm_span && f1 - f0 == fb_span && (s0 & 15) == 0 && (f0 & 7) == 0 &&
                      s1 <= sm_count && f1 <= fb_count;
            ok = ok && (g != 0 || (s0 == 0 && f0 == 0)) && (g != tiles - 1 || (s1 == sm_count && f1 == fb_count));
            if (!ok) atomicOr(&bad, TBE_BAD_GLOBAL_OFFSETS);
            run[0] = s0, run[1] = sm_span, run[2] = f0, run[3] = fb_span, run[4] = total;
        }
    }
    __syncthreads();
    if (bad) {
        if (t == 0) atomicOr(error, bad);
        return;
    }

    // 3. the tile's runs into shared memory
    {
        const uint4* src = reinterpret_cast<const uint4*>(sign_mantissa + run[0]);
        for (tbe_u32 i = t; i < run[1] / 16; i += TBE_THREADS) reinterpret_cast<uint4*>(sm)[i] = src[i];
        const uint4* fsrc = reinterpret_cast<const uint4*>(fallback + run[2]);
        for (tbe_u32 i = t; i < run[3] / 8; i += TBE_THREADS) reinterpret_cast<uint4*>(fb)[i] = fsrc[i];
    }
    __syncthreads();
    {   // a run closes with zeros: fewer than 16 bytes after the sign-mantissa bytes, 8 values after the fallbacks
        const tbe_u32 total = run[4];
        const bool nonzero = t < 16 ? total + t < run[1] && sm[total + t] != 0
                                    : t < 24 && 4096 - total + (t - 16) < run[3] && fb[4096 - total + (t - 16)] != 0;
        if (nonzero) atomicOr(error, TBE_BAD_ZEROS);
    }

    // 4. rows of 8: tile row `row` (0..63), small column kt (0..7)
    const tbe_u32 gm = g / tiles_k, gk = g - gm * tiles_k;
    const tbe_u16 filler = (tbe_u16)((base + 1) << 7);
    const bool whole_rows = (cols & 7) == 0;  // 16-byte stores stay aligned
    tbe_u32 flags = 0;
#pragma unroll
    for (tbe_u32 j = 0; j < 4; ++j) {
        const tbe_u32 q = j * TBE_THREADS + t, row = q >> 3, kt = q & 7, r = row & 7;
        const tbe_u32 s = (row >> 4) * 16 + kt * 2 + ((row >> 3) & 1);  // small tile, ZipServ's order
        const tbe_u64 p0 = plane[0][s], p1 = plane[1][s], p2 = plane[2][s];
        const tbe_u32 before = __popcll((p0 | p1 | p2) & ((1ull << (8 * r)) - 1));  // in-window, earlier rows
        tbe_u32 si = tile_sm_start[s] + before;
        tbe_u32 fi = s * 64 - tile_sm_start[s] + 8 * r - before;
        const tbe_u32 b0 = (tbe_u32)(p0 >> (8 * r)) & 0xFF, b1 = (tbe_u32)(p1 >> (8 * r)) & 0xFF,
                      b2 = (tbe_u32)(p2 >> (8 * r)) & 0xFF;
        tbe_u16 v[8];
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            const tbe_u32 code = ((b0 >> c) & 1) | (((b1 >> c) & 1) << 1) | (((b2 >> c) & 1) << 2);
            if (code) {
                const tbe_u32 x = sm[si++];
                v[c] = (tbe_u16)(((x & 0x80) << 8) | ((tbe_u32)(base + (int)code) << 7) | (x & 0x7F));
            } else {
                v[c] = fb[fi++];
            }
        }
        const tbe_u32 grow = gm * 64 + row, gcol = gk * 64 + kt * 8;
        if (grow < rows && gcol + 8 <= cols && whole_rows) {
            uint4 word;
            word.x = v[0] | ((tbe_u32)v[1] << 16), word.y = v[2] | ((tbe_u32)v[3] << 16);
            word.z = v[4] | ((tbe_u32)v[5] << 16), word.w = v[6] | ((tbe_u32)v[7] << 16);
            *reinterpret_cast<uint4*>(out + (size_t)grow * cols + gcol) = word;
        } else {
#pragma unroll
            for (int c = 0; c < 8; ++c) {
                if (grow < rows && gcol + c < cols) out[(size_t)grow * cols + gcol + c] = v[c];
                else if (v[c] != filler) flags |= TBE_BAD_FILLER;  // padding decodes to the filler only
            }
        }
    }
    if (flags) atomicOr(error, flags);
}
