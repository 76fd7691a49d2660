// Per-format encoders and decoders of whole groups: BF16, E5M2 and FP16 fast paths
// (SIMD-within-a-register), and the generic loops every format falls back to.
#pragma once

#include "common.cuh"
#include "group_io.cuh"

// ------------------------------------------------------------------ encode
// The device LUT maps an exponent to its code (0..15) or to ESC_FLAG for "not in the codebook", so a
// code is (c & 0xF) and the escape bit (c >> 7): no compare or select per value.
#define ESC_FLAG 0x80u

// Four LUT results (bytes: a code 0-15, or ESC_FLAG) -> their codes as a 16-bit nibble word in the
// low half and the escape bits at 7, 15, 23, 31 of the packed bytes (returned in *flags).
__device__ __forceinline__ u32 pack4(u32 c0, u32 c1, u32 c2, u32 c3, u32* flags) {
    const u32 b = __byte_perm(__byte_perm(c0, c1, 0x0040), __byte_perm(c2, c3, 0x0040), 0x5410);  // c0..c3 as bytes
    *flags = b & 0x80808080u;
    const u32 t = b & 0x0F0F0F0Fu;
    return t | (t >> 4);  // bytes 0 and 2 hold codes 0|1 and 2|3
}

// pack4's escape flags of values 0-3 (fa) and 4-7 (fb) -> bit j for value j.  The product gathers
// bits 0, 8, 16, 24 of f >> 7 into bits 24-27 with nothing above them or in bits 20-23 (its
// partial products land on distinct bits, so nothing carries): six instructions, no branch.
__device__ __forceinline__ u32 escape_mask(u32 fa, u32 fb) {
    return (((fa >> 7) * 0x01020408u) >> 24) | (((fb >> 7) * 0x01020408u) >> 20);
}

// The exponent bytes of four BF16 values from their two words: two shifts and a byte permute (a
// value's exponent is bits 7-14 of its half, so bits 8-15 / 24-31 of the word shifted left once).
__device__ __forceinline__ u32 bf16_exponents4(u32 w0, u32 w1) { return __byte_perm(w0 << 1, w1 << 1, 0x7531); }

// BF16, a whole group, SIMD-within-a-register.  The exponents of all 8 values are gathered into two
// words (bf16_exponents4); the 8 LUT results are packed into the codes word with byte permutes;
// the escape mask is only worked out when a LUT result is an escape.
// The v3 encoder was issue-bound at ~100 instructions a group; this is ~55.
__device__ __forceinline__ u32 encode_bf16_full(const Raw<u16>& raw, long long g, const u8* slut,
                                                u8* __restrict__ codes, u8* __restrict__ rest) {
    const u32 ea = bf16_exponents4(raw.w[0], raw.w[1]);  // exponents of values 0-3
    const u32 eb = bf16_exponents4(raw.w[2], raw.w[3]);  // and 4-7
    u32 fa, fb;
    const u32 ta = pack4(slut[ea & 0xFF], slut[(ea >> 8) & 0xFF], slut[(ea >> 16) & 0xFF], slut[ea >> 24], &fa);
    const u32 tb = pack4(slut[eb & 0xFF], slut[(eb >> 8) & 0xFF], slut[(eb >> 16) & 0xFF], slut[eb >> 24], &fb);
    reinterpret_cast<u32*>(codes)[g] = __byte_perm(ta, tb, 0x6420);
    // Rest byte = sign << 7 | mantissa: the value's low byte with its top bit taken from the high
    // byte's (the sign).  Per four values: their low bytes, their high bytes (one permute each)
    // and one bit-select, instead of a shift and two masks per pair of values.
    const u32 lo0 = __byte_perm(raw.w[0], raw.w[1], 0x6420), lo1 = __byte_perm(raw.w[2], raw.w[3], 0x6420);
    const u32 hi0 = __byte_perm(raw.w[0], raw.w[1], 0x7531), hi1 = __byte_perm(raw.w[2], raw.w[3], 0x7531);
    *reinterpret_cast<uint2*>(rest + g * 8) = make_uint2((lo0 & 0x7F7F7F7Fu) | (hi0 & 0x80808080u),
                                                         (lo1 & 0x7F7F7F7Fu) | (hi1 & 0x80808080u));
    return escape_mask(fa, fb);
}

// The rest fields (sign << 2 | mantissa) of four E5M2 values (the bytes of w), packed 3 bits a
// value at bits 20-31, by two products: every partial product lands on bits of its own or outside
// 20-31, so nothing carries into them (tests/test_kernel_identities.py: all 4096 field values,
// each with random other bits).  Two logic ops and two multiplies (FMA pipe) instead of nine logic ops: the
// E5M2 encoder was ALU-bound (benchmarks/NOTES.md, v17).
__device__ __forceinline__ u32 e5m2_rest12(u32 w) {
    return (w & 0x80038003u) * 0x00100401u + (w & 0x03800380u) * 0x00008020u;
}

// E5M2 position tables: eight 32-word tables in kvz_encode's shared memory, table j (byte offset
// 128 j) holding for exponent e value j's code already in its nibble of the group's codes
// half-word (bits 4 (j & 3) up) and its escape flag at bit 16 + j.  A group's codes and escape
// mask are then the OR of its eight lookups, where packing LUT bytes into nibbles (pack4) and
// gathering the flags (escape_mask) took ~14 more integer instructions a group.  Lanes looking
// up one table with different exponents hit different banks (entry e is word e of its table),
// with equal ones the same word: no conflicts (benchmarks/NOTES.md, kernel source split: position tables).
// Partial groups (a tensor's tail) take encode_raw's
// generic loop and the byte LUT.
#define POSITION_TABLE_WORDS (8 * 32)

// A warp's shared copy of a LUT (2^E bytes) and, for E5M2, the position tables built from it, by
// the warp's lanes; the warp's lanes synchronise before (the old copy may still be read) and after.
template <int E, bool E5M2>
__device__ __forceinline__ void load_warp_lut(const u8* __restrict__ lut, u8* slut, u32* tabs, int lane) {
    __syncwarp();
    for (int i = lane; i < (1 << E); i += 32) slut[i] = lut[i];
    if constexpr (E5M2) {
        for (int i = lane; i < POSITION_TABLE_WORDS; i += 32) {
            const int j = i >> 5;
            const u32 c = lut[i & 31];
            tabs[i] = ((c & 0xFu) << (4 * (j & 3))) | ((c >> 7) << (16 + j));
        }
    }
    __syncwarp();
}
__device__ __forceinline__ u32 table_word(const u8* tabs, u32 byte_offset) {
    return *reinterpret_cast<const u32*>(tabs + byte_offset);
}
// E5M2, a whole group, through the position tables: codes to codes[g], the rest fields (3 bits a
// value, 24 a group) to *rest24 (for store_rest24_warp); returns the escape mask.
__device__ __forceinline__ u32 encode_e5m2_full(const Raw<u8>& raw, long long g, const u8* tabs,
                                                u8* __restrict__ codes, u32* rest24) {
    u32 r[2];
#pragma unroll
    for (int k = 0; k < 2; k++) {
        const u32 e4 = raw.w[k] & 0x7C7C7C7Cu;  // each value's exponent times 4: its entry's offset
        const u8* t = tabs + 512 * k;
        r[k] = table_word(t, e4 & 0xFF) | table_word(t + 128, __byte_perm(e4, 0, 0x4441)) |
               table_word(t + 256, __byte_perm(e4, 0, 0x4442)) | table_word(t + 384, e4 >> 24);
    }
    reinterpret_cast<u32*>(codes)[g] = __byte_perm(r[0], r[1], 0x5410);
    *rest24 = (e5m2_rest12(raw.w[0]) >> 20) | ((e5m2_rest12(raw.w[1]) >> 8) & 0xFFF000u);
    return (r[0] | r[1]) >> 16;
}

// FP16, a whole group: codes to codes[g]; the rest fields (sign << 10 | mantissa, 11 bits a
// value) packed LSB first into *lo (bits 0-63) and *hi (64-87), for store_rest11_warp.
__device__ __forceinline__ u32 encode_fp16_full(const Raw<u16>& raw, long long g, const u8* slut,
                                                u8* __restrict__ codes, u64* lo, u32* hi) {
    u32 word = 0, mask = 0, r[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const u32 v = (raw.w[j >> 1] >> (16 * (j & 1))) & 0xFFFFu;
        const u32 c = slut[(v >> 10) & 0x1Fu];
        r[j] = ((v >> 15) << 10) | (v & 0x3FFu);
        mask |= (c >> 7) << j;
        word |= (c & 0xFu) << (4 * j);
    }
    reinterpret_cast<u32*>(codes)[g] = word;
    u64 h;
    pack_rest<11>(r, lo, &h);
    *hi = (u32)h;
    return mask;
}

// FULL: the caller knows the group holds 8 values (whole steps of kvz_encode).
template <int E, int M, typename T, bool FULL = false>
__device__ __forceinline__ u32 encode_raw(const Raw<T>& raw, long long n, long long g, const u8* slut,
                                          u8* __restrict__ codes, u8* __restrict__ rest) {
    constexpr int R = M + 1;
    if constexpr (E == 8 && M == 7 && sizeof(T) == 2) {
        if (FULL || g * 8 + 8 <= n) return encode_bf16_full(raw, g, slut, codes, rest);
    }
    u32 word = 0, mask = 0, r[8];
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const u32 v = raw_value(raw, j);
        const u32 e = (v >> M) & ((1u << E) - 1u);
        r[j] = ((v >> (E + M)) << M) | (v & ((1u << M) - 1u));
        const bool valid = g * 8 + j < n;
        const u32 c = valid ? (u32)slut[e] : 0u;  // padding values: code 0, never an escape
        mask |= (c >> 7) << j;
        word |= (c & 0xF) << (4 * j);
    }
    reinterpret_cast<u32*>(codes)[g] = word;
    store_rest<R>(rest, g, r);
    return mask;
}

// The biased exponents of a group's 8 values as the bytes of a word (value j: byte j), so an escape
// loop can take value j's with a shift whatever j is (indexing Raw's words by a j known only at
// run time puts them in local memory).
template <int E, int M, typename T>
__device__ __forceinline__ u64 exponent_bytes(const Raw<T>& v) {
    constexpr u32 EMASK = (1u << E) - 1u;
    if constexpr (sizeof(T) == 1 && E + M <= 8) {  // FP8: one shift and mask for all 8 (sign bits masked off)
        const u64 x = (u64)v.w[0] | ((u64)v.w[1] << 32);
        return (x >> M) & (0x0101010101010101ull * EMASK);
    } else if constexpr (sizeof(T) == 2 && E == 8 && M == 7) {  // BF16: as encode_bf16_full gathers them
        return (u64)bf16_exponents4(v.w[0], v.w[1]) | ((u64)bf16_exponents4(v.w[2], v.w[3]) << 32);
    } else {
        u64 e = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) e |= (u64)((raw_value(v, j) >> M) & EMASK) << (8 * j);
        return e;
    }
}

// Eight nibbles (the low half of each byte of x, the rest zero) packed into a word, byte j's at
// bits 4j: byte 2k of x | x >> 4 holds the pair of bytes 2k and 2k + 1, one permute gathers them.
__device__ __forceinline__ u32 pack_nibbles8(u64 x) {
    const u64 t = x | (x >> 4);
    return __byte_perm((u32)t, (u32)(t >> 32), 0x6420);
}

// One group of a plane-coded chunk (its values v, load_redo's: zeros past the tensor's end, whose
// exponent 0 gives code 0 and no high bits): low exponent nibbles as its codes, high bits (value
// j's at bit HB j) to the HB bytes at high_out, one word when HB is 4 (high_out 4-byte aligned).
template <int E, int M, typename T>
__device__ __forceinline__ void encode_plane(const Raw<T>& v, long long g, u8* __restrict__ codes,
                                             u8* __restrict__ high_out) {
    constexpr int HB = E - 4;
    const u64 e = exponent_bytes<E, M>(v);
    reinterpret_cast<u32*>(codes)[g] = pack_nibbles8(e & 0x0F0F0F0F0F0F0F0Full);
    if constexpr (HB == 4) {
        *reinterpret_cast<u32*>(high_out) = pack_nibbles8((e >> 4) & 0x0F0F0F0F0F0F0F0Full);
    } else {
        u32 high = 0;
#pragma unroll
        for (int j = 0; j < 8; j++) high |= (u32)((e >> (8 * j + 4)) & ((1u << HB) - 1u)) << (HB * j);
#pragma unroll
        for (int k = 0; k < HB; k++) high_out[k] = (u8)(high >> (8 * k));
    }
}

// ------------------------------------------------------------------ decode
template <int E, int M>
__device__ __forceinline__ void decode_raw(u32 word, const RestRaw<M + 1>& rr, u64 dlo, u64 dhi, bool plane,
                                          const u8* __restrict__ high_in, u32 v[8]) {
    constexpr int HB = E - 4;
    u32 r[8];
    unpack_rest<M + 1>(rr, r);
    u64 high = 0;
    if (plane) {
#pragma unroll
        for (int k = 0; k < HB; k++) high |= (u64)high_in[k] << (8 * k);
    }
#pragma unroll
    for (int j = 0; j < 8; j++) {
        const u32 c = (word >> (4 * j)) & 0xF;
        u32 e;
        if (plane) e = c | ((u32)((high >> (HB * j)) & ((1u << HB) - 1u)) << 4);
        else e = (u32)((c < 8 ? dlo >> (8 * c) : dhi >> (8 * (c - 8))) & 0xFF);
        v[j] = ((r[j] >> M) << (E + M)) | (e << M) | (r[j] & ((1u << M) - 1u));
    }
}

// Four codes (16 bits) -> their four exponent bytes: byte-permute lookups in the low and high
// halves of the 16-entry codebook (d0..d3), then a third permute picks byte k of hi (selector
// k + 4) where code k has bit 3 set, else byte k of lo: five instructions where a mask built from
// the bits took eleven (the E5M2 decoder was ALU-bound: benchmarks/NOTES.md, v17).
__device__ __forceinline__ u32 lookup4(u32 n4, u32 d0, u32 d1, u32 d2, u32 d3) {
    const u32 sel = n4 & 0x7777u;  // prmt selector bit 3 would mean sign replication: keep 0-7
    const u32 lo = __byte_perm(d0, d1, sel), hi = __byte_perm(d2, d3, sel);
    return __byte_perm(lo, hi, 0x3210u | ((n4 >> 1) & 0x4444u));
}

// A BF16 group's stored values from its exponents (ea, eb: values 0-3 and 4-7, a byte each) and
// its rest bytes, SIMD-within-a-register: out[k] holds values 2k and 2k+1 as stored.
__device__ __forceinline__ void assemble_bf16_words(u32 ea, u32 eb, const RestRaw<8>& rr, u32 out[4]) {
    const u32 rlo = (u32)rr.q[0], rhi = (u32)(rr.q[0] >> 32);
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const u32 sel = (k & 1) ? 0x4342u : 0x4140u;  // bytes 2k, 2k+1 of the group into 16-bit lanes
        const u32 r = __byte_perm(k < 2 ? rlo : rhi, 0, sel);
        const u32 e = __byte_perm(k < 2 ? ea : eb, 0, sel);
        out[k] = ((r & 0x00800080u) << 8) | (r & 0x007F007Fu) | (e << 7);
    }
}

// BF16, a whole group, non-plane: the codes' exponents looked up, then assembled.  The generic
// decode (unpack to 8 values, repack) spent ~130 instructions a group and was compute-bound;
// this one ~45.
__device__ __forceinline__ void decode_bf16_words(u32 word, const RestRaw<8>& rr, u32 d0, u32 d1, u32 d2, u32 d3,
                                                  u32 out[4]) {
    assemble_bf16_words(lookup4(word & 0xFFFFu, d0, d1, d2, d3), lookup4(word >> 16, d0, d1, d2, d3), rr, out);
}

// BF16, a whole group of a plane-coded chunk: value j's exponent is code nibble j of word below
// high nibble j of high (the group's 4 exp_high bytes, little-endian, as decode_raw reads them).
// The even values' exponent bytes and the odd ones' are built in place, then interleaved.
__device__ __forceinline__ void decode_bf16_plane_words(u32 word, u32 high, const RestRaw<8>& rr, u32 out[4]) {
    const u32 even = (word & 0x0F0F0F0Fu) | ((high & 0x0F0F0F0Fu) << 4);  // e0, e2, e4, e6
    const u32 odd = ((word >> 4) & 0x0F0F0F0Fu) | (high & 0xF0F0F0F0u);  // e1, e3, e5, e7
    assemble_bf16_words(__byte_perm(even, odd, 0x5140u), __byte_perm(even, odd, 0x7362u), rr, out);
}

// The rest fields of four E5M2 values (3 bits each at bits 0-11 of x; higher bits ignored) spread
// to their places in the stored bytes: mantissas to bits 8k..8k+1 by two products (the even and
// the odd values' fields; their partial products land on bits of their own, so they add without
// carries), signs to bit 8k + 7 by one (tests/test_kernel_identities.py: all 4096 fields).  It
// replaced ten shifts and masks (benchmarks/NOTES.md, v17).
__device__ __forceinline__ u32 e5m2_spread_rest(u32 x) {
    const u32 mm = (x & 0x0C3u) * 0x401u + (x & 0x618u) * 0x8020u;
    const u32 s = (x & 0x924u) * 0x108420u;
    return (mm & 0x03030303u) | (s & 0x80808080u);
}

// E5M2, a whole group, non-plane, SIMD-within-a-register: out[h] holds values 4h..4h+3 as stored
// (byte = sign << 7 | exponent << 2 | mantissa; rest = sign << 2 | mantissa, 3 bits a value).
// The generic path spent ~130 instructions a group.
// d0..d3: the codebook's exponents shifted left by 2, in place in the stored byte (E5M2 exponents
// are below 64, so a shift of the table keeps its bytes apart).
__device__ __forceinline__ void decode_e5m2_words(u32 word, u32 rest24, u32 d0, u32 d1, u32 d2, u32 d3, u32 out[2]) {
    out[0] = e5m2_spread_rest(rest24) | lookup4(word & 0xFFFFu, d0, d1, d2, d3);
    out[1] = e5m2_spread_rest(rest24 >> 12) | lookup4(word >> 16, d0, d1, d2, d3);
}
