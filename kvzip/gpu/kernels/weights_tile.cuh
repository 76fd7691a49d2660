// What every weights kernel shares: the word types, the tiled layout's constants, loads, the
// decoding of one lane's 16-column step (by the per-lane pair table, or by byte permutes of the
// codebook held in registers) and the tensor-core product.
#pragma once

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

#define W_CHUNK 64             // columns of a block
#define W_BLOCK_U4 96          // 16-byte words of a block (1536 bytes)
#define W_WARPS 8              // warps of a thread block of every kernel here
#define W_LUT_WORDS (256 * 32) // the pair table, one copy per lane (see build_pair_table)
#define W_TILE_WORDS 33        // a row of 64 BF16 in shared memory, 32 words + 1: lane (g, q)'s word
                               // 8 q + c of row g + const is bank g + 8 q + const (no conflicts)

// Streams read once bypass L1, which keeps x (read by every band) there.
// (Without __CUDA_ARCH__ these helpers are plain C++: tests/cuda_host runs the weights kernels on the
// CPU.  NVRTC always defines it, so the device code is the same either way.)
__device__ __forceinline__ uint4 load_once(const uint4* p) {
#ifdef __CUDA_ARCH__
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
#else
    return *p;
#endif
}

// Whether this thread block is the last of the grid to get here, by a ticket (a counter, zero before
// the launch, that every block takes once): what any block wrote to global memory before its ticket
// is then visible to the last one, which reads it past L1 (__ldcg).  Every thread of the block calls
// it, once.
__device__ __forceinline__ bool last_block(u32* ticket) {
    __shared__ bool last;
    __threadfence();  // this thread's writes, visible to the grid before the block's ticket
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(ticket, 1u) == gridDim.x - 1;
    __syncthreads();
    if (last) __threadfence();  // the other blocks' writes, before this block's reads
    return last;
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
// 32 b + lane, always bank `lane`), so the random lookups never conflict.  Thread t of the first
// 256 computes entry t once and writes its 32 copies, copy (i + t) % 32 at store i, so that a
// warp's 32 stores of one round fall in 32 banks.
__device__ __forceinline__ void build_pair_table(u32* table, const u8* __restrict__ codebook) {
    const int t = threadIdx.x;
    if (t < 256) {
        const u32 entry = ((u32)__ldg(codebook + (t & 15)) << 7) | ((u32)__ldg(codebook + (t >> 4)) << 23);
        u32* row = table + t * 32;
#pragma unroll 8
        for (int i = 0; i < 32; ++i) row[(i + t) & 31] = entry;
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

// The codebook's 16 bytes as four words (byte i of the book is byte i % 4 of book[i / 4]).
__device__ __forceinline__ void load_book(const u8* __restrict__ codebook, u32 book[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i)
        book[i] = (u32)__ldg(codebook + 4 * i) | (u32)__ldg(codebook + 4 * i + 1) << 8 |
                  (u32)__ldg(codebook + 4 * i + 2) << 16 | (u32)__ldg(codebook + 4 * i + 3) << 24;
}

// The exponents of the four codes in the low 16 bits of `codes` (nibble i: code i), as bytes
// 0-3: codes 0-7 from book words 0-1 and 8-15 from words 2-3 by two byte permutes, each byte
// then taken from the one its code's bit 3 names by a third (selector nibble i: i, or i + 4).
// Every selector nibble keeps its bit 3 clear: set, PRMT would replicate a sign instead.
__device__ __forceinline__ u32 expand_codes(const u32 book[4], u32 codes) {
    const u32 sel = codes & 0x7777u;
    const u32 low = __byte_perm(book[0], book[1], sel), high = __byte_perm(book[2], book[3], sel);
    return __byte_perm(low, high, 0x3210u | ((codes >> 1) & 0x4444u));
}

// One 16-column step of a lane (decode_step's result, by expand_codes): exponent bytes e0 e1 of
// a BF16 pair go to bits 7-14 and 23-30 (byte_perm [e0, 0, e1, 0], shifted by 7).
__device__ __forceinline__ void decode_step_regs(const u32 book[4], u32 codes, u32 sm01, u32 sm23, u32 a[4]) {
    const u32 e03 = expand_codes(book, codes), e47 = expand_codes(book, codes >> 16);
    a[0] = (__byte_perm(sm01, 0, 0x1100) & 0x807F807Fu) | (__byte_perm(e03, 0, 0x4140) << 7);
    a[1] = (__byte_perm(sm01, 0, 0x3322) & 0x807F807Fu) | (__byte_perm(e03, 0, 0x4342) << 7);
    a[2] = (__byte_perm(sm23, 0, 0x1100) & 0x807F807Fu) | (__byte_perm(e47, 0, 0x4140) << 7);
    a[3] = (__byte_perm(sm23, 0, 0x3322) & 0x807F807Fu) | (__byte_perm(e47, 0, 0x4342) << 7);
}

// A warp's walk through its band's escape list (positions p = 16 column + row, increasing),
// 32 at a time in registers: lane l holds escape `base + l` (p = ~0u past the list's end).  A
// chunk's escapes are those below the chunk's end from `next` on; they go into the A fragments
// where the decoder left +0, so the tensor cores multiply the weights exactly and nothing is
// added after the loop.
struct EscapeWalk {
    u32 base, next, end;  // the batch's first escape, the first not yet taken, the band's end
    u32 pos, val;         // lane l's escape of the batch
};

__device__ __forceinline__ void load_escapes(EscapeWalk& ew, const u32* __restrict__ esc_pos,
                                             const u16* __restrict__ esc_val, int lane) {
    const u32 e = ew.base + lane;
    ew.pos = e < ew.end ? __ldg(esc_pos + e) : ~0u;
    ew.val = e < ew.end ? (u32)__ldg(esc_val + e) : 0u;
}

// The walk of a band's escapes [e0, e1) from the first with p >= from (its column >= from / 16):
// found by the warp probing 32 evenly spaced positions a round, then the last 32 one by one.
__device__ __forceinline__ EscapeWalk start_escapes(const u32* __restrict__ esc_pos, const u16* __restrict__ esc_val,
                                                    u32 e0, u32 e1, u32 from, int lane) {
    u32 lo = e0, hi = e1;  // the first p >= from is in [lo, hi]
    while (hi - lo > 32) {
        const u32 step = (hi - lo + 31) / 32, at = lo + lane * step;
        const int below = __popc(__ballot_sync(0xffffffffu, at < hi && __ldg(esc_pos + at) < from));
        const u32 new_lo = below ? lo + (below - 1) * step + 1 : lo;
        hi = min(hi, lo + below * step);
        lo = new_lo;
    }
    const u32 at = lo + lane;
    lo += __popc(__ballot_sync(0xffffffffu, at < hi && __ldg(esc_pos + at) < from));
    EscapeWalk ew{lo, lo, e1, 0u, 0u};
    load_escapes(ew, esc_pos, esc_val, lane);
    return ew;
}

// The next of the escapes below p = limit (a chunk's end) that the batch holds are passed; those
// at or above `from` (the chunk's start: a warp that owns every k-th chunk passes the others')
// are returned as a mask of its lanes (position order).  The batch is first refilled where it is
// used up; callers take again while the batch ran out (a chunk may hold more than 32 escapes).
__device__ __forceinline__ u32 take_escapes(EscapeWalk& ew, u32 from, u32 limit, const u32* __restrict__ esc_pos,
                                            const u16* __restrict__ esc_val, int lane) {
    if (ew.next - ew.base == 32) {  // the batch is used up: the next 32
        ew.base = ew.next;
        load_escapes(ew, esc_pos, esc_val, lane);
    }
    const u32 passed = __ballot_sync(0xffffffffu, ew.base + lane >= ew.next && ew.pos < limit);
    ew.next += __popc(passed);
    return passed & __ballot_sync(0xffffffffu, ew.pos >= from);
}

// Each escape of a chunk (positions [from, limit)) from walk w on, in position order, as
// patch(position, value); w ends past the chunk's end.
template <typename Patch>
__device__ __forceinline__ void chunk_escapes(EscapeWalk& w, u32 from, u32 limit, const u32* __restrict__ esc_pos,
                                              const u16* __restrict__ esc_val, int lane, Patch patch) {
    do {
        for (u32 left = take_escapes(w, from, limit, esc_pos, esc_val, lane); left; left &= left - 1) {
            const int i = __ffs(left) - 1;
            patch(__shfl_sync(0xffffffffu, w.pos, i), __shfl_sync(0xffffffffu, w.val, i));
        }
    } while (w.next - w.base == 32);  // the batch ran out: the chunk may go on in the next
}

// Escape (p, v) of a chunk into the A fragment a of step `step`, if this lane owns it there:
// column c = p / 16 % 64 of the chunk and row r = p % 16 belong to lane 4 (r % 8) + c / 16, step
// (c / 4) % 4, register r / 8 + 2 ((c % 4) / 2), half c % 2 (the fragment order of decode_step).
__device__ __forceinline__ void patch_escape(u32 p, u32 v, int step, int lane, u32 a[4]) {
    const u32 c = (p >> 4) & 63, r = p & 15;
    if ((int)(4 * (r & 7) + (c >> 4)) != lane || (int)((c >> 2) & 3) != step) return;
    const u32 reg = (r >> 3) + 2 * ((c & 3) >> 1), shift = 16 * (c & 1);
#pragma unroll
    for (int i = 0; i < 4; ++i)
        if ((u32)i == reg) a[i] = (a[i] & ~(0xFFFFu << shift)) | (v << shift);
}

__device__ __forceinline__ void mma_bf16(float c[4], const u32 a[4], u32 b0, u32 b1) {
#ifdef __CUDA_ARCH__
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    // The PTX ISA's fragments of m16n8k16 (lane = 4 g + q): a[i] holds A[g + 8 (i & 1)][2 q + 8 (i >> 1) ..
    // + 1], b0 / b1 B[2 q .. + 1][g] / B[2 q + 8 .. + 1][g], c[i] C[g + 8 (i >> 1)][2 q + (i & 1)]; the
    // warp's 32 lanes meet (emu.h) and each sums its four outputs over k in order, in FP32.
    u32 all_a[4][32], all_b[2][32];
    for (int i = 0; i < 4; ++i) emu_gather(a[i], all_a[i]);
    emu_gather(b0, all_b[0]);
    emu_gather(b1, all_b[1]);
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l >> 2, q = l & 3;
        for (int i = 0; i < 4; ++i)
            for (int h = 0; h < 2; ++h)
                A[g + 8 * (i & 1)][2 * q + 8 * (i >> 1) + h] = bf16_value(all_a[i][l] >> (16 * h) & 0xFFFFu);
        for (int i = 0; i < 2; ++i)
            for (int h = 0; h < 2; ++h) B[2 * q + 8 * i + h][g] = bf16_value(all_b[i][l] >> (16 * h) & 0xFFFFu);
    }
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    for (int i = 0; i < 4; ++i) {
        const int r = g + 8 * (i >> 1), n = 2 * q + (i & 1);
        float v = c[i];
        for (int k = 0; k < 16; ++k) v += A[r][k] * B[k][n];
        c[i] = v;
    }
#endif
}

struct Block {
    uint4 codes, sm01, sm23;  // this lane's words: codes; sign+mantissa of steps 0-1; of steps 2-3
};

__device__ __forceinline__ Block load_block(const uint4* __restrict__ block, int lane) {
    return Block{load_once(block + lane), load_once(block + 32 + lane), load_once(block + 64 + lane)};
}


// ------------------------------------------------------------------ the per-warp block ring
// A warp streams its blocks through a ring of STAGES slots in shared memory with cp.async (L2
// to shared, no registers held), STAGES - 1 blocks ahead of the one it works on.  A lane copies
// and later reads only its own three 16-byte pieces of a block, so the ring needs no
// synchronisation beyond each thread's own cp.async.wait_group.  Every issue commits one group,
// empty past the end, so the block issued STAGES - 1 issues ago is complete after
// wait_group(STAGES - 2).  A slot is refilled one issue after it was taken, once the values
// taken from it have been used.
#define W_DECODE_STAGES 4

__device__ __forceinline__ void copy16_async(uint4* smem_dst, const uint4* src) {
#ifdef __CUDA_ARCH__
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
#else
    *smem_dst = *src;
#endif
}

__device__ __forceinline__ void ring_issue(uint4* ring, int slot, const uint4* __restrict__ block, bool real, int lane) {
    if (real) {
        uint4* dst = ring + slot * W_BLOCK_U4;
        copy16_async(dst + lane, block + lane);
        copy16_async(dst + 32 + lane, block + 32 + lane);
        copy16_async(dst + 64 + lane, block + 64 + lane);
    }
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int STAGES>
__device__ __forceinline__ Block ring_take(const uint4* ring, int slot, int lane) {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.wait_group %0;" ::"n"(STAGES - 2) : "memory");
#endif
    const uint4* src = ring + slot * W_BLOCK_U4;
    return Block{src[lane], src[32 + lane], src[64 + lane]};
}
