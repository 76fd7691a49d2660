// ChannelPack's offsets (kernels/channel.cu): the scan of the chunks' variable-run sizes
// (kvz_ch_scan, one pass: the encoder's stream lengths, the decoder's count checks) and the
// encoder's last step, which completes the payload (kvz_ch_compact: the runs from their slots to
// their places, the small streams, the padding).
#pragma once

#include "common.cuh"
#include "header.cuh"  // build_crc_tables, warp_crc32, put_u32
#include "layout.cuh"  // PLANE

#define CH_TILE_THREADS 256  // the offsets scan: threads a block, 8 chunks a thread
#define CH_TILE (8 * CH_TILE_THREADS)

struct ChunkSizes {
    long long sec, esc, high;  // sec_codes bytes, escapes, exp_high bytes
};

// Chunk sizes of the counts (cnt = esc_count[c], sec = sec_count[c]) of a chunk of ng groups.
__device__ __forceinline__ ChunkSizes chunk_sizes(u32 cnt, u32 sec, int ng, int HB) {
    if (cnt == PLANE) return {0, 0, (long long)HB * ng};
    return {(3ll * sec + 7) / 8, (long long)cnt, 0};
}

// The count check of a chunk whose runs start at `at` (channel_pack_cpu._decode_offsets, its
// order): the error code, or 0.
__device__ __forceinline__ int count_error(u32 cnt, u32 sec, long long len, int ng, int HB, ChunkSizes at, ChunkSizes s,
                                           long long n_sec, long long n_pos, long long n_high) {
    if (cnt == PLANE) return sec != 0 ? 6 : at.high + s.high > n_high ? 5 : 0;
    if ((long long)sec > len || s.sec + 3ll * cnt > (long long)HB * ng) return 1;
    if (at.esc + s.esc > n_pos) return 2;
    if (at.sec + s.sec > n_sec) return 6;
    return 0;
}

// The offsets scan: tile t is chunks [CH_TILE t, CH_TILE (t + 1)), 8 a thread of CH_TILE_THREADS
// (its counts loaded as one 16-byte word of each stream: the warp's loads are contiguous).
// kvz_ch_scan writes offsets[c], offsets[nchunks + c], offsets[2 nchunks + c] (chunk c's first
// sec_codes byte, escape, exp_high byte) and result (uint64[4]; checked, uint64[5]): [0] 8 c +
// code of the lowest failing chunk (checked, decode: every chunk's count check against the
// streams' lengths, channel_pack_cpu._decode_offsets's order; then the totals' check, past the
// last chunk), left at the caller's ~0 where none fails; [1..3] the three totals; [4] (checked)
// the tables' check, as [0] left at ~0 where they are sound.

// fn(c, esc count, sec count, groups, sizes) for this thread's chunks of the tile, in order.
template <typename F>
__device__ __forceinline__ void each_tile_chunk(const u16* __restrict__ esc_count, const u16* __restrict__ sec_count,
                                                long long nchunks, long long n, int chunk, int HB, F&& fn) {
    const long long c0 = (long long)blockIdx.x * CH_TILE + 8 * threadIdx.x;
    if (c0 >= nchunks) return;
    u32 cnt[8], sec[8];
    if (c0 + 8 <= nchunks) {
        const uint4 a = *reinterpret_cast<const uint4*>(esc_count + c0), b = *reinterpret_cast<const uint4*>(sec_count + c0);
        const u32 wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
        for (int k = 0; k < 8; k++) { cnt[k] = (wa[k >> 1] >> (16 * (k & 1))) & 0xFFFFu; sec[k] = (wb[k >> 1] >> (16 * (k & 1))) & 0xFFFFu; }
    } else {
#pragma unroll
        for (int k = 0; k < 8; k++) { cnt[k] = c0 + k < nchunks ? esc_count[c0 + k] : 0u; sec[k] = c0 + k < nchunks ? sec_count[c0 + k] : 0u; }
    }
    const int gpc = chunk >> 3;
    const long long G = (n + 7) >> 3;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        if (c0 + k >= nchunks) break;
        const int ng = (int)min((long long)gpc, G - (c0 + k) * gpc);
        fn(c0 + k, cnt[k], sec[k], ng, chunk_sizes(cnt[k], sec[k], ng, HB));
    }
}

// The block's exclusive prefix of x over the threads (in thread order), and in *total the block's
// sum (every thread).  part: CH_TILE_THREADS / 32 words.
__device__ __forceinline__ long long block_exclusive_sum(long long x, long long* part, long long* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const long long inc = warp_inclusive_sum(x, lane);
    __syncthreads();  // part is free again
    if (lane == 31) part[warp] = inc;
    __syncthreads();
    long long below = 0, all = 0;
#pragma unroll
    for (int w = 0; w < CH_TILE_THREADS / 32; w++) {
        below += w < warp ? part[w] : 0;
        all += part[w];
    }
    *total = all;
    return below + inc - x;
}

// The tiles' look-back: look_back over words that start as all 0x00 or all 0xFF bytes (the
// encoder's zeroed with its histogram, the decoder's filled with its error word).
__device__ __forceinline__ u64 tile_look_back(u64* status, long long tile, u64 mine, int lane) {
    return look_back<true>(status, tile, mine, lane);
}

// channel_codebook.check_tables on one channel's table: 1 (TABLE_OUT_OF_RANGE) where an entry is
// not an exponent of the format, else 2 (TABLE_REPEAT) where one repeats, else 0.
__device__ __forceinline__ int table_error(const u8* __restrict__ row, int E) {
    u32 e[CH_WIDTH], outside = 0, repeat = 0;
#pragma unroll
    for (int i = 0; i < CH_WIDTH; i++) {
        e[i] = row[i];
        outside |= e[i] >> E;
#pragma unroll
        for (int j = 0; j < i; j++) repeat |= e[j] == e[i];
    }
    return outside ? 1 : repeat ? 2 : 0;
}

// The blob's version-3 header in front of its payload, as container.with_counts writes it: the
// host's template for this tensor (KVZ_COMPACT_SIZE bytes, any counts) with the totals as its
// counts (escapes = result[2], high_bytes = result[3], second_bytes = result[1]; each below 2^32,
// which the host checks once it has them) and its CRC-32 (header.cuh's, as finish_blob seals the
// speed mode's headers).  Its checksum field is the template's (0: a blob with a payload checksum
// gets its header from the host).  By one whole block (it synchronises).
__device__ void seal_ratio_header(const u8* __restrict__ tmpl, const u64* __restrict__ result, u8* __restrict__ out) {
    __shared__ u32 crc_table[4][256];
    __shared__ __align__(16) u8 h[KVZ_COMPACT_SIZE];
    for (int i = threadIdx.x; i < KVZ_COMPACT_SIZE; i += blockDim.x) h[i] = tmpl[i];
    build_crc_tables(crc_table);  // ends with a barrier: h is in place too
    if (threadIdx.x < 32) {
        if (threadIdx.x == 0) {
            put_u32(h + KVZ_COMPACT_ESCAPES_AT, (u32)result[2]);
            put_u32(h + KVZ_COMPACT_HIGH_BYTES_AT, (u32)result[3]);
            put_u32(h + KVZ_RATIO_SECOND_BYTES_AT, (u32)result[1]);
        }
        __syncwarp();
        // The CRC field (a word) counts as 0.
        const u32 crc = warp_crc32(crc_table, reinterpret_cast<const u32*>(h), KVZ_COMPACT_SIZE / 4,
                                   KVZ_HEADER_CRC_AT / 4, threadIdx.x) ^ 0xFFFFFFFFu;
        if (threadIdx.x == 0) put_u32(h + KVZ_HEADER_CRC_AT, crc);
    }
    __syncthreads();
    for (int i = threadIdx.x; i < KVZ_COMPACT_SIZE; i += blockDim.x) out[i] = h[i];
}

// grid: exactly a block a tile.  One pass: a tile sums its chunks' sizes, learns the sizes of the
// tiles before it by a decoupled look-back (common.cuh's look_back, warp k on stream k of the
// three: status[k * ntiles + t], every word unpublished at the launch, i.e. the whole array
// zeroed or filled with 0xFF bytes) and writes its chunks' offsets; the last tile writes the totals
// (result[1..3]).  A tile waits only on lower tiles, which the GPU dispatches first, so every wait
// ends.  checked (decode): the count checks, against the streams' lengths n_sec, n_pos, n_high,
// into result[0] (which the caller sets to ~0) by atomicMin, the totals' check the last tile's;
// and block 0 checks the tables (channels of CH_WIDTH entries), the lowest finding in result[4]
// (the caller's ~0 where all are sound), so the host needs no copy of them.  head_tmpl (encode,
// a blob without a payload checksum): the last tile, once it has the totals, writes the blob's
// header at head (seal_ratio_header), here and not in kvz_ch_compact, whose many blocks would pay
// the CRC's registers in occupancy.
__global__ void __launch_bounds__(CH_TILE_THREADS) kvz_ch_scan(const u16* __restrict__ esc_count,
                                                               const u16* __restrict__ sec_count, long long nchunks,
                                                               long long n, int chunk, int HB, int checked,
                                                               long long n_sec, long long n_pos, long long n_high,
                                                               const u8* __restrict__ tables, int channels,
                                                               u64* __restrict__ status, long long* __restrict__ offsets,
                                                               u64* __restrict__ result, const u8* __restrict__ head_tmpl,
                                                               u8* __restrict__ head) {
    __shared__ long long part[CH_TILE_THREADS / 32];
    if (checked && blockIdx.x == 0) {
        for (int d = threadIdx.x; d < channels; d += blockDim.x) {
            const int code = table_error(tables + d * CH_WIDTH, HB + 3);
            if (code) atomicMin(reinterpret_cast<unsigned long long*>(result + 4), (u64)code);
        }
    }
    __shared__ long long before[3];  // the tiles before this one: sec_codes bytes, escapes, exp_high bytes
    ChunkSizes mine = {0, 0, 0};
    each_tile_chunk(esc_count, sec_count, nchunks, n, chunk, HB, [&](long long, u32, u32, int, const ChunkSizes& s) {
        mine.sec += s.sec; mine.esc += s.esc; mine.high += s.high;
    });
    long long tile[3];
    ChunkSizes at = {block_exclusive_sum(mine.sec, part, &tile[0]), block_exclusive_sum(mine.esc, part, &tile[1]),
                     block_exclusive_sum(mine.high, part, &tile[2])};
    if (threadIdx.x < 3 * 32) {  // warp k looks back on stream k: the three at once
        const int k = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const long long own = k == 0 ? tile[0] : k == 1 ? tile[1] : tile[2];  // no local-memory array
        const u64 p = tile_look_back(status + (long long)k * gridDim.x, blockIdx.x, (u64)own, lane);
        if (lane == 0) before[k] = (long long)p;
    }
    __syncthreads();
    at.sec += before[0]; at.esc += before[1]; at.high += before[2];
    u64 err = ~0ull;
    each_tile_chunk(esc_count, sec_count, nchunks, n, chunk, HB, [&](long long c, u32 cnt, u32 sec, int ng, const ChunkSizes& s) {
        if (checked && err == ~0ull) {
            const long long len = min((long long)chunk, n - c * chunk);
            const int code = count_error(cnt, sec, len, ng, HB, at, s, n_sec, n_pos, n_high);
            if (code) err = 8ull * (u64)c + (u64)code;
        }
        offsets[c] = at.sec;
        offsets[nchunks + c] = at.esc;
        offsets[2 * nchunks + c] = at.high;
        at.sec += s.sec; at.esc += s.esc; at.high += s.high;
    });
    if (threadIdx.x == 0 && blockIdx.x == gridDim.x - 1) {
        long long tot[3];
        for (int k = 0; k < 3; k++) result[1 + k] = (u64)(tot[k] = before[k] + tile[k]);
        const u64 past = 8ull * (u64)nchunks;  // the totals' error: past the last chunk, so a chunk's own wins
        const u64 bad = tot[0] != n_sec ? past + 6 : tot[1] != n_pos ? past + 2 : tot[2] != n_high ? past + 5 : ~0ull;
        if (checked && bad < err) err = bad;
    }
    if (err != ~0ull) atomicMin(reinterpret_cast<unsigned long long*>(result), err);
    if (head_tmpl && blockIdx.x == gridDim.x - 1) {  // block-uniform
        __syncthreads();  // thread 0's totals in result, for the whole block
        seal_ratio_header(head_tmpl, result, head);
    }
}

// The payload of format.md 15.4: its nine streams in canonical order (codes, rest, esc_count,
// esc_pos, esc_exp, exp_high, sec_codes, sec_count, tables), each at the next 16-byte boundary
// (the layout rule of 2.4); kvzip/gpu/channel_pack.py's payload_layout is the same rule.
#define CH_STREAMS 9
struct ChPayload {
    long long at[CH_STREAMS + 1], len[CH_STREAMS];  // at[CH_STREAMS]: the payload's length
};

__device__ __forceinline__ ChPayload ch_payload(long long n, int R, long long nchunks, int channels, const u64* result) {
    const long long G = (n + 7) >> 3, ns = (long long)result[1], ne = (long long)result[2], nh = (long long)result[3];
    ChPayload p;
    const long long len[CH_STREAMS] = {3 * G, R * G, 2 * nchunks, 2 * ne, ne, nh, ns, 2 * nchunks, CH_WIDTH * (long long)channels};
    long long pos = 0;
#pragma unroll
    for (int k = 0; k < CH_STREAMS; k++) {
        p.at[k] = pos;
        p.len[k] = len[k];
        pos = (pos + len[k] + 15) & ~15ll;
    }
    p.at[CH_STREAMS] = pos;
    return p;
}

// grid-stride over chunks, a warp a chunk, at least one block: completes the payload whose codes,
// rest and esc_count kvz_ch_encode wrote in place.  Each chunk's runs move from their slots to the
// offsets kvz_ch_scan found, inside the variable streams' places, which follow from the totals
// (result[1..3]); each chunk's sec_count goes in from the encoder's; block 0 copies the tables and
// zeroes every padding byte (between the streams and after the last).
__global__ void __launch_bounds__(WARPS * 32) kvz_ch_compact(const u16* __restrict__ sec_count, long long nchunks,
                                                             long long n, int chunk, int HB, int R, int channels,
                                                             const long long* __restrict__ offsets,
                                                             const u32* __restrict__ sec_slots,
                                                             const u16* __restrict__ pos_slots,
                                                             const u8* __restrict__ exp_slots,
                                                             const u8* __restrict__ high_slots,
                                                             const u8* __restrict__ tables,
                                                             const u64* __restrict__ result, u8* __restrict__ payload) {
    const int lane = threadIdx.x & 31;
    const int gpc = chunk >> 3, full_cap = (HB * gpc) / 3, slot_words = (3 * chunk + 31) >> 5;
    const long long G = (n + 7) >> 3;
    const ChPayload p = ch_payload(n, R, nchunks, channels, result);
    const u16* esc_count = reinterpret_cast<const u16*>(payload + p.at[2]);
    u16* esc_pos = reinterpret_cast<u16*>(payload + p.at[3]);
    u8 *esc_exp = payload + p.at[4], *exp_high = payload + p.at[5], *sec_codes = payload + p.at[6];
    u16* sec_count_out = reinterpret_cast<u16*>(payload + p.at[7]);
    if (blockIdx.x == 0) {
        for (int k = threadIdx.x; k < CH_WIDTH * channels; k += blockDim.x) payload[p.at[8] + k] = tables[k];
        for (int s = 0; s < CH_STREAMS; s++)
            for (long long b = p.at[s] + p.len[s] + threadIdx.x; b < p.at[s + 1]; b += blockDim.x) payload[b] = 0;
    }
    for (long long c = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5); c < nchunks; c += (long long)gridDim.x * WARPS) {
        const u32 cnt = esc_count[c], sec = sec_count[c];
        if (lane == 0) sec_count_out[c] = (u16)sec;
        const ChunkSizes s = chunk_sizes(cnt, sec, (int)min((long long)gpc, G - c * gpc), HB);
        if (cnt == PLANE) {
            const u8* from = high_slots + c * gpc * HB;
            u8* to = exp_high + offsets[2 * nchunks + c];
            for (long long k = lane; k < s.high; k += 32) to[k] = from[k];
            continue;
        }
        const u8* from = reinterpret_cast<const u8*>(sec_slots + c * slot_words);
        u8* to = sec_codes + offsets[c];
        for (long long k = lane; k < s.sec; k += 32) to[k] = from[k];
        const long long e0 = offsets[nchunks + c];
        for (long long k = lane; k < s.esc; k += 32) {
            esc_pos[e0 + k] = pos_slots[c * full_cap + k];
            esc_exp[e0 + k] = exp_slots[c * full_cap + k];
        }
    }
}
