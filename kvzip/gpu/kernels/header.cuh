// The blob header on the device: finish_blob (padding, header template, CRC-32) for the encode
// scan, and reading headers back for the decode side (stage_head, head_facts, guess_head).
#pragma once

#include "common.cuh"
#include "abi.cuh"

// ------------------------------------------------------------------ blob epilogue (encode)
// Once the escape totals are known (on the device): zero every padding byte between streams and
// write the header, a host-built template whose payload length, last three stream-table entries
// and CRC-32 are filled in here, so the host never waits to build headers.

__device__ __forceinline__ void put_u64(u8* p, u64 v) {
#pragma unroll
    for (int k = 0; k < 8; k++) p[k] = (u8)(v >> (8 * k));
}

__device__ __forceinline__ void put_u32(u8* p, u32 v) {
#pragma unroll
    for (int k = 0; k < 4; k++) p[k] = (u8)(v >> (8 * k));
}

// Whether a staged header (16-byte aligned, at least a prefix) is a version-2 (compact) one.
__device__ __forceinline__ bool compact_head(const u8* head) {
    return (head[KVZ_VERSION_AT] | (u32)head[KVZ_VERSION_AT + 1] << 8) == KVZ_COMPACT_VERSION;
}

// The fields of a header that follow the escape count (blanked in a remembered layout's,
// kvzip/layout.py's VARYING and COMPACT_VARYING): byte i of a version-1 header with its escape
// entries at `at`, or of a compact one; with book, a compact one's codebook too (a layout whose
// blobs each carry their own: Layout.own_codebook).
__device__ __forceinline__ bool varying_byte(long long i, bool compact, long long at, bool book) {
    const bool crc = i >= KVZ_HEADER_CRC_AT && i < KVZ_HEADER_CRC_AT + KVZ_HEADER_CRC_SIZE;
    if (compact)
        return crc || (i >= KVZ_COMPACT_ESCAPES_AT && i < KVZ_COMPACT_HIGH_BYTES_AT + KVZ_COMPACT_HIGH_BYTES_SIZE) ||
               (book && i >= KVZ_COMPACT_CODEBOOK_AT && i < KVZ_COMPACT_CODEBOOK_AT + KVZ_COMPACT_CODEBOOK_SIZE);
    return crc || (i >= KVZ_PAYLOAD_LEN_AT && i < KVZ_PAYLOAD_LEN_AT + KVZ_PAYLOAD_LEN_SIZE) ||
           (i >= at && i < at + KVZ_ESCAPE_ENTRIES_SIZE);
}

#define HEADER_SMEM 4096  // headers up to this size are built in shared memory (ours are < 2 KiB)

// zlib's CRC-32, slicing-by-4: four 256-entry tables the whole block builds in shared memory, for
// warp_crc32 below to walk a header a word at a time.
__device__ void build_crc_tables(u32 crc_table[4][256]) {
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        u32 c = (u32)i;
        for (int k = 0; k < 8; k++) c = (c & 1u) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 256; i += blockDim.x) {
        u32 c = crc_table[0][i];
        for (int k = 1; k < 4; k++) { c = (c >> 8) ^ crc_table[0][c & 0xFF]; crc_table[k][i] = c; }
    }
    __syncthreads();
}

__device__ __forceinline__ u32 crc_word(const u32 crc_table[4][256], u32 crc, u32 word) {
    crc ^= word;
    return crc_table[3][crc & 0xFF] ^ crc_table[2][(crc >> 8) & 0xFF] ^ crc_table[1][(crc >> 16) & 0xFF] ^
           crc_table[0][crc >> 24];
}

// A header's CRC by one warp.  The register after A then B is reg(A) * x^(8 |B|) ^ reg0(B), where
// reg0 starts from 0 and the product is modulo the CRC polynomial in zlib's reflected bit order
// (bit 31 is x^0; zlib's crc32_combine).  So each lane runs the tables over CRC_WORDS words and
// shifts its register over the words of the lanes after it: a product with a constant,
// CRC_SHIFT[j] = x^(8 * 4 * CRC_WORDS * j) mod P (from zlib's x2nmodp).  Rounds of 32 * CRC_WORDS
// words, the last one aligned to the end, so the shifts stay these constants.
#define CRC_WORDS 16
__constant__ u32 CRC_SHIFT[32] = {0x80000000u, 0x88d14467u, 0xd7bbfe6au, 0x62b6ca4bu, 0xec447f11u, 0x7c69160du, 0xb72d2b3cu, 0xb34988bbu, 0x8e7ea170u, 0x54e00eefu, 0x7e91368au, 0x9b577d5cu, 0x05616c82u, 0x6b85d8d7u, 0x3277f3e0u, 0x979966f5u, 0x6427800eu, 0x4a080ee0u, 0xb1436b58u, 0x7242d7fau, 0x5ef840e2u, 0x56c3cb9cu, 0xb3a2be1cu, 0x36b74585u, 0xbf110f7eu, 0xa52f4d76u, 0x3ea21cf9u, 0x5e665234u, 0x118f848eu, 0xc7916f54u, 0x34163bd1u, 0xb58f9792u};

__device__ __forceinline__ u32 multmodp(u32 a, u32 b) {
    u32 m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1u) ? (b >> 1) ^ 0xEDB88320u : b >> 1;
    }
    return p;
}

// zlib's CRC-32 register (initial 0xFFFFFFFF, not yet inverted) after the nwords words of w (word
// skip read as 0), by one warp; every lane gets it.  ~1 000 cycles for a 1 KiB header where one
// thread walking it takes several thousand.
__device__ u32 warp_crc32(const u32 crc_table[4][256], const u32* w, long long nwords, long long skip, int lane) {
    u32 reg = 0xFFFFFFFFu;
    for (long long start = 0; start < nwords;) {
        const long long len = min((long long)(32 * CRC_WORDS), nwords - start);
        const long long e = start + len - CRC_WORDS * (31 - lane);
        const long long a = max(start, e - CRC_WORDS);
        u32 r = 0;
        if (a < e) {
            r = a == start ? reg : 0u;  // the lane the round starts in carries the register so far
            for (long long i = a; i < e; i++) r = crc_word(crc_table, r, i == skip ? 0u : w[i]);
            if (lane != 31) r = multmodp(CRC_SHIFT[31 - lane], r);
        }
#pragma unroll
        for (int d = 16; d; d >>= 1) r ^= __shfl_xor_sync(FULL_MASK, r, d);
        reg = r;
        start += len;
    }
    return reg;
}

__device__ __forceinline__ long long align16(long long x) { return (x + KVZ_ALIGN - 1) & ~(KVZ_ALIGN - 1); }

// Blob J's padding, header and sizes (escapes, exp_high bytes, payload length) from its totals
// (escapes << 31 | plane-coded groups), by one whole block (it synchronises).  The streams after
// esc_pos start on 16-byte boundaries of the payload (var_base is one): esc_exp at
// align16(var_base + 2 * escapes), exp_high after it.
__device__ void finish_blob(const FinishJob& J, u64 totals, int hb, u64* __restrict__ sizes) {
    __shared__ u32 crc_table[4][256];
    __shared__ __align__(16) u8 head[HEADER_SMEM];
    const long long ne = (long long)(totals >> 31), nh = (long long)hb * (long long)(totals & GROUPS_MASK);
    const long long a_end = J.var_base + KVZ_ESC_POS_BYTES * ne;
    const long long b = align16(a_end), b_end = b + ne;
    const long long cc = align16(b_end), c_end = cc + nh;
    const long long end = align16(c_end);
    u8* __restrict__ payload = J.blob + J.header_len;
    if (threadIdx.x == 0) { sizes[0] = ne; sizes[1] = nh; sizes[2] = end; }
    if (threadIdx.x < 16) {
        const long long k = threadIdx.x;
        for (int r = 0; r < 3; r++)
            if (J.pad[2 * r] + k < J.pad[2 * r + 1]) payload[J.pad[2 * r] + k] = 0;
        if (a_end + k < b) payload[a_end + k] = 0;
        if (b_end + k < cc) payload[b_end + k] = 0;
        if (c_end + k < end) payload[c_end + k] = 0;
    }
    if (!J.write_header) return;  // the host writes it (payload checksum)
    // The template with the fields that depend on the totals, then its CRC-32 by a warp with the CRC
    // field zeroed.
    const long long H = J.header_len;
    const bool in_smem = H <= HEADER_SMEM;
    u8* h = in_smem ? head : J.blob;
    for (long long i = threadIdx.x; i < H; i += blockDim.x) h[i] = J.tmpl[i];
    build_crc_tables(crc_table);
    if (threadIdx.x < 32) {
        if (threadIdx.x == 0 && J.compact) {
            // A compact header's escape fields (the layout follows from them; n < 2^32 bounds both),
            // and the tensor's own codebook where it has one.
            put_u32(h + KVZ_COMPACT_ESCAPES_AT, (u32)ne);
            put_u32(h + KVZ_COMPACT_HIGH_BYTES_AT, (u32)nh);
            if (J.codebook != nullptr)
                for (int c = 0; c < KVZ_COMPACT_CODEBOOK_SIZE; c++) h[KVZ_COMPACT_CODEBOOK_AT + c] = J.codebook[c];
        } else if (threadIdx.x == 0) {
            // The escape entries at table_at: (offset, length) of esc_pos, esc_exp, exp_high.
            put_u64(h + KVZ_PAYLOAD_LEN_AT, (u64)end);
            put_u64(h + J.table_at, (u64)J.var_base);       put_u64(h + J.table_at + 8, (u64)(KVZ_ESC_POS_BYTES * ne));
            put_u64(h + J.table_at + KVZ_ENTRY_SIZE, (u64)b);      put_u64(h + J.table_at + KVZ_ENTRY_SIZE + 8, (u64)ne);
            put_u64(h + J.table_at + 2 * KVZ_ENTRY_SIZE, (u64)cc); put_u64(h + J.table_at + 2 * KVZ_ENTRY_SIZE + 8, (u64)nh);
        }
        __syncwarp();  // the fields are in place for the whole warp
        // H is a multiple of 16 and h 16-byte aligned; the CRC field (a word) counts as 0.
        const u32 crc = warp_crc32(crc_table, reinterpret_cast<const u32*>(h), H / 4, KVZ_HEADER_CRC_AT / 4, threadIdx.x) ^ 0xFFFFFFFFu;
        u8* const c = h + KVZ_HEADER_CRC_AT;
        if (threadIdx.x == 0) { c[0] = (u8)crc; c[1] = (u8)(crc >> 8); c[2] = (u8)(crc >> 16); c[3] = (u8)(crc >> 24); }
    }
    __syncthreads();
    if (in_smem)
        for (long long i = threadIdx.x; i < H; i += blockDim.x) J.blob[i] = head[i];
}

// ------------------------------------------------------------------ header checks (batched decode)
// Blob t of heads ((ntensors, 2): address, length): its address and length, its first
// min(span, len) bytes (16-byte vectors) staged in head, and the CRC tables built; ends with a
// barrier.  Returns how many bytes were staged.
__device__ __forceinline__ long long stage_head(const u64* heads, int t, int span, u8* head, u32 crc_table[4][256],
                                                const u8*& b, long long& len) {
    b = reinterpret_cast<const u8*>(heads[2 * t]);
    len = (long long)(heads[2 * t + 1] & ~HEAD_LEN_CAPACITY);
    const long long staged = min((long long)span, len) / 16 * 16;
    for (long long i = threadIdx.x; i < staged / 16; i += blockDim.x)
        reinterpret_cast<uint4*>(head)[i] = reinterpret_cast<const uint4*>(b)[i];
    build_crc_tables(crc_table);  // ends with a barrier: head is complete too
    return staged;
}

// One warp (every lane gets the result): what kvz_check_heads reports of the header staged in
// head (out: 8 words).
__device__ void head_facts(const u8* b, long long len, int span, const u8* head, long long staged,
                           const u32 crc_table[4][256], u64 out[8]) {
    for (int k = 0; k < 8; k++) out[k] = 0;
    if (len < KVZ_PREFIX_SIZE) return;
    const u32* w = reinterpret_cast<const u32*>(head);
    const long long h = w[KVZ_HEADER_LEN_AT / 4];
    if (compact_head(head)) {
        // A compact header: its CRC, its length, the payload a multiple of 16; escapes and
        // exp_high bytes as it says; the stream offsets follow from the shape, which the host
        // knows (words 1-3 stay 0) and the stream count is none.
        out[6] = (u64)h;
        if (!(h == KVZ_COMPACT_SIZE && h <= span && h <= len)) return;
        const u32 crc = warp_crc32(crc_table, w, h / 4, KVZ_HEADER_CRC_AT / 4, threadIdx.x & 31) ^ 0xFFFFFFFFu;
        if (crc == w[KVZ_HEADER_CRC_AT / 4] && (len - h) % KVZ_ALIGN == 0) {
            out[0] = 1; out[4] = w[KVZ_COMPACT_ESCAPES_AT / 4]; out[5] = w[KVZ_COMPACT_HIGH_BYTES_AT / 4];
        }
        return;
    }
    const long long ns = w[KVZ_STREAM_COUNT_AT / 4];
    const long long at = KVZ_TABLE_AT + KVZ_ENTRY_SIZE * (ns - KVZ_ESCAPE_STREAMS);
    out[6] = (u64)h; out[7] = (u64)ns;
    if (!(ns >= KVZ_ESCAPE_STREAMS && h <= span && h <= len && at + KVZ_ESCAPE_ENTRIES_SIZE <= h)) return;
    const long long words = min(h, staged) / 4;  // the staged words; the CRC field (a word) as 0
    u32 crc = warp_crc32(crc_table, w, words, KVZ_HEADER_CRC_AT / 4, threadIdx.x & 31);
    for (long long i = 4 * words; i < h; i++) crc = crc_table[0][(crc ^ (i < staged ? head[i] : b[i])) & 0xFF] ^ (crc >> 8);
    const u64* e = reinterpret_cast<const u64*>(head + at);  // (offset, bytes) of esc_pos, esc_exp, exp_high
    const u64 payload = reinterpret_cast<const u64*>(head)[KVZ_PAYLOAD_LEN_AT / 8];
    const u64 big = 1ull << 48;  // every field below this before any sum: no wrap-around
    bool ok = (crc ^ 0xFFFFFFFFu) == w[KVZ_HEADER_CRC_AT / 4] && payload < big;
    for (int k = 0; k < 6; k++) ok = ok && e[k] < big;
    // The layout finish_blob writes (every term below 2^49 once ok holds: && stops before the sums).
    ok = ok && e[2] == (u64)align16((long long)(e[0] + e[1])) && e[4] == (u64)align16((long long)(e[2] + e[3])) &&
         payload == (u64)align16((long long)(e[4] + e[5])) && e[1] == KVZ_ESC_POS_BYTES * e[3] && (u64)h + payload == (u64)len;
    if (ok) { out[0] = 1; out[1] = e[0]; out[2] = e[2]; out[3] = e[4]; out[4] = e[3]; out[5] = e[5]; }
}

// ------------------------------------------------------------------ guessed layouts (decode)
// The length the staged header claims for its blob, given a buffer of `capacity` bytes whose
// esc_pos lies `esc_pos_at` bytes in (where the guessed layout puts it): a version-1 header's
// length plus payload length; a compact one's length plus the payload its escape counts close
// (finish_blob's arithmetic).  0 where the claim does not fit the buffer (the guess then misses).
__device__ __forceinline__ long long claimed_length(const u8* head, long long capacity, long long esc_pos_at) {
    if (capacity < KVZ_PREFIX_SIZE) return 0;
    const u32* w = reinterpret_cast<const u32*>(head);
    const long long h = w[KVZ_HEADER_LEN_AT / 4];
    long long claim;
    if (compact_head(head)) {
        const long long ne = w[KVZ_COMPACT_ESCAPES_AT / 4], nh = w[KVZ_COMPACT_HIGH_BYTES_AT / 4];
        const long long var = esc_pos_at - h;
        const long long high_at = align16(align16(var + KVZ_ESC_POS_BYTES * ne) + ne);
        claim = var < 0 ? -1 : h + align16(high_at + nh);
    } else {
        const u64 payload = reinterpret_cast<const u64*>(head)[KVZ_PAYLOAD_LEN_AT / 8];
        claim = payload < (1ull << 48) ? h + (long long)payload : -1;
    }
    return claim >= h && claim <= capacity ? claim : 0;
}

// The 16 codebook bytes of blob t's compact header (or whatever its bytes there are: the guess
// has not checked the header yet) as J.dhi, then J.dlo: a row whose dlo is no longer the staged 0
// has its dhi too (a chunk that reads the row with dlo != 0 uses both; one that read 0 waits for
// it to change, await_book).  The host made sure the blob is at least its layout's fixed bytes
// long, so the bytes lie inside it.
__device__ __forceinline__ void publish_book(const u64* heads, int t, DecodeJob& J) {
    const u8* b = reinterpret_cast<const u8*>(heads[2 * t]) + KVZ_COMPACT_CODEBOOK_AT;
    u64 words[2] = {0, 0};
    for (int c = 0; c < KVZ_COMPACT_CODEBOOK_SIZE; c++) words[c >> 3] |= (u64)b[c] << (8 * (c & 7));
    J.dhi = words[1];
    __threadfence();
    *reinterpret_cast<volatile u64*>(&J.dlo) = words[0];
}

// A decode launched on guessed layouts (layout_cache.guess) starts its scan with one block a blob
// doing this: blob t's header must hang together (as kvz_check_heads says), equal expect's row t
// once the fields that follow the escape count are blanked (payload length, CRC, escape entries),
// and put esc_pos where J already points.  Then J's escape fields are filled in from the header;
// otherwise its escape streams are emptied and its error set to GUESS_MISSED, so the scan reads
// only the fixed streams the host made sure lie inside the blob and kvz_decode skips it, and the
// host decodes that blob the checked way.  J.n_high, staged as GUESS_PENDING, is written last:
// the scan blocks that need the verdict wait for it (await_guess).
// A row staged with dlo = 0 (no codebook has it: its codes 0-7 would share exponent 0) takes the
// blob's own codebook from its compact header (codebook="auto": each blob has its own), which
// expect leaves blank.  Its 16 bytes go into J.dlo, J.dhi first, unchecked (publish_book), so
// kvz_decode's first chunks of that job start on them (decode_early_chunk) while the header is
// checked; then the guess checks that the 16 exponents are distinct and below the format's
// exponent count (staged in J.dhi) and they count for the verdict like the rest of the header: a
// miss throws the speculative decode away, as it does any guessed decode's.
__device__ void guess_head(const u64* heads, int t, int span, const u8* expect, DecodeJob& J, u64* work) {
    __shared__ u32 crc_table[4][256];
    __shared__ __align__(16) u8 head[HEADER_SMEM];
    const u8* b;
    long long len;
    const bool own_book = J.dlo == 0;  // every thread reads the staged row before publish_book changes it
    const u64 bound = J.dhi;
    __syncthreads();
    if (own_book && threadIdx.x == 0) publish_book(heads, t, J);
    const long long staged = stage_head(heads, t, span, head, crc_table, b, len);
    const u32* w = reinterpret_cast<const u32*>(head);
    if (heads[2 * t + 1] & HEAD_LEN_CAPACITY) len = claimed_length(head, len, reinterpret_cast<const u8*>(J.esc_pos) - b);
    const bool prefix = len >= KVZ_PREFIX_SIZE;
    const bool compact = prefix && compact_head(head);
    const long long h = prefix ? w[KVZ_HEADER_LEN_AT / 4] : 0;
    const long long at = prefix ? KVZ_TABLE_AT + KVZ_ENTRY_SIZE * ((long long)w[KVZ_STREAM_COUNT_AT / 4] - KVZ_ESCAPE_STREAMS) : 0;
    bool same = prefix && h <= span && h <= len;  // within expect's row: i < h <= span
    for (long long i = threadIdx.x; same && i < h; i += blockDim.x)  // the varying fields are blanked in expect
        same = (varying_byte(i, compact, at, own_book) ? 0 : i < staged ? head[i] : b[i]) == expect[(long long)t * span + i];
    same = __syncthreads_and(same);
    if (threadIdx.x >= 32) return;
    u64 out[8];
    head_facts(b, len, span, head, staged, crc_table, out);
    if (threadIdx.x != 0) return;
    const u8* payload = b + h;
    if (compact && out[0] == 1) {
        // The escape streams where the layout puts esc_pos (var, as the guess has it) and the
        // header's counts place the others; they must close the payload.
        const long long var = reinterpret_cast<const u8*>(J.esc_pos) - payload;
        const long long ne = (long long)out[4], exp_at = align16(var + KVZ_ESC_POS_BYTES * ne), high_at = align16(exp_at + ne);
        out[1] = (u64)var; out[2] = (u64)exp_at; out[3] = (u64)high_at;
        if (var < 0 || align16(high_at + (long long)out[5]) != len - h) out[0] = 0;
    }
    bool hit = same && out[0] == 1 && reinterpret_cast<const u8*>(J.esc_pos) == payload + out[1];
    if (hit && own_book) {  // same held a compact header: the codebook (in J since publish_book) lies within its 64 bytes
        u64 seen[4] = {0, 0, 0, 0};
        for (int c = 0; c < KVZ_COMPACT_CODEBOOK_SIZE; c++) {
            const long long i = KVZ_COMPACT_CODEBOOK_AT + c;
            const u32 e = i < staged ? head[i] : b[i];
            hit = hit && e < bound && !((seen[e >> 6] >> (e & 63)) & 1);
            seen[e >> 6] |= 1ull << (e & 63);
        }
    }
    if (hit) {
        J.esc_exp = payload + out[2];
        J.exp_high = payload + out[3];
        J.n_esc = (long long)out[4];
    } else {
        J.n_esc = 0;
        work[1 + t] = GUESS_MISSED;
    }
    __threadfence();
    *reinterpret_cast<volatile long long*>(&J.n_high) = hit ? (long long)out[5] : 0;
}

// Wait for guess_head's verdict on J (one thread).
__device__ __forceinline__ void await_guess(const DecodeJob& J) {
    while (*reinterpret_cast<const volatile long long*>(&J.n_high) == GUESS_PENDING) __nanosleep(64);
    __threadfence();
}

// Wait for a blob's own codebook in J (publish_book: dlo no longer 0) or for the guess's
// verdict, whichever comes first (one thread); a forged codebook whose codes 0-7 are all
// exponent 0 waits for the verdict.
__device__ __forceinline__ void await_book(const DecodeJob& J) {
    while (*reinterpret_cast<const volatile u64*>(&J.dlo) == 0 &&
           *reinterpret_cast<const volatile long long*>(&J.n_high) == GUESS_PENDING)
        __nanosleep(32);
    __threadfence();
}
