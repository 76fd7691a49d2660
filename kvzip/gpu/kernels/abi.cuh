// The host ABI of the fused kernels: the job rows Python fills (uint64 arrays, one row a tensor
// or blob; kvzip/gpu/programs.py's ENCODE_COLUMNS, DECODE_COLUMNS, FINISH_COLUMNS) and the
// constants and work-area offsets programs.py mirrors.  Change both sides together.
#pragma once

#include "common.cuh"

// One tensor of a batch.  All fields are 8 bytes wide: the host fills a uint64 array (ntensors, 13).
struct EncodeJob {
    static constexpr bool ENCODE = true;
    const void* src;        // the values' bits
    long long n;            // value count
    u8* codes;              // output streams, in place in the blob
    u8* rest;
    u16* esc_count;
    u16* esc_pos;           // esc_exp and exp_high follow it, where the escape totals put them
    u16* slot_pos;          // kvz_encode's per-chunk escape slots (SLOT entries a chunk) for this tensor
    u8* slot_exp;
    long long chunk_base;   // this tensor's first chunk in the batch-wide chunk numbering
    long long sb_base;      // and its first scan block (SB_CHUNKS chunks each)
    const u8* q_table;      // QT kernels: the quantize table (src is then 16-bit bits)
    float* q_scale;         // QT: where the blob's scales stream goes (kvz_quant_table writes it)
    const u8* lut;          // the codebook's encode LUT: exponent -> code, or ESC_FLAG (2^E bytes; one
                            // shared by the batch, or this tensor's own, which kvz_auto_codebook wrote)
};

// One blob of a decode batch (the mirror of EncodeJob).
struct DecodeJob {  // all 8-byte fields: the host fills a uint64 array (ntensors, 16)
    static constexpr bool ENCODE = false;
    const u8* codes;
    const u8* rest;
    const u16* esc_count;
    const u16* esc_pos;
    const u8* esc_exp;
    const u8* exp_high;
    long long n;
    long long n_esc;        // lengths of esc_pos/esc_exp and exp_high as the container says
    long long n_high;
    void* dst;
    u64 dlo, dhi;           // the codebook: code c -> exponent byte c of dlo:dhi
    long long chunk_base;
    long long sb_base;
    const u16* dq_table;    // kvz_decode<..., DQ = true>: FP8 code -> 16-bit value (QuantizeFP8's decode)
    const float* dq_scale;  // and the blob's scale it is built from (quantize.cu's kvz_dequant_tables)
};

struct FinishJob {  // all 8-byte fields: uint64 array (ntensors, 14)
    u8* blob;               // header at blob[0], payload at blob[header_len]
    const u8* tmpl;         // header template
    long long header_len;
    long long table_at;     // header offset of esc_pos's stream-table entry (esc_exp, exp_high follow); 0 when compact
    long long var_base;     // payload offset of esc_pos (the escape streams close the payload)
    long long pad[6];       // three (start, end) payload ranges of padding known before encoding
    long long write_header; // 0 when the host writes the header itself (payload checksum)
    long long compact;      // 1: a version-2 header (escapes and exp_high bytes in fixed fields, no table)
    const u8* codebook;     // compact: the 16 codebook bytes to put in the header (kvz_auto_codebook's), or 0
};

#include "abi_check.cuh"  // EncodeJob, DecodeJob, FinishJob as kvzip/gpu/abi.py writes them (generated)

#define SB_CHUNKS 256      // chunks per scan block: one thread each

#define GUESS_MISSED 255
#define GUESS_PENDING (-1ll)
// A heads row's length word with this bit set holds the capacity of the buffer the blob starts
// (decompress_into): guess_head takes the blob's length from its header, if that fits.
#define HEAD_LEN_CAPACITY (1ull << 63)

__host__ __device__ constexpr long long offsets_ready_at(int njobs) { return (3ll + njobs + 15) & ~15ll; }
__host__ __device__ constexpr long long decode_status_at(int njobs) { return offsets_ready_at(njobs) + 16; }
