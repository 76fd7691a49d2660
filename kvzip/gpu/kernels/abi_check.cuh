// kvzip/gpu/kernels/abi_check.cuh: the job structs' layout as the host writes them.
// Generated from kvzip/gpu/abi.py by `python -m kvzip.gpu.headers --write`: do not edit (tests/test_abi.py
// checks that this file is that text).  Included after the struct definitions.
// Every field is whole 8-byte words and there is no padding, so with each field's size and the
// struct's size asserted here, the fields' order fixes every offset; tests/test_abi.py checks that
// order in abi.cuh against kvzip/gpu/abi.py.  (NVRTC of CUDA 13.0 has no __builtin_offsetof.)
#pragma once

static_assert(sizeof(EncodeJob) == 104, "EncodeJob: 13 words, as kvzip/gpu/abi.py");
static_assert(sizeof(EncodeJob::src) == 8, "EncodeJob::src: column 0, 1 word");
static_assert(sizeof(EncodeJob::n) == 8, "EncodeJob::n: column 1, 1 word");
static_assert(sizeof(EncodeJob::codes) == 8, "EncodeJob::codes: column 2, 1 word");
static_assert(sizeof(EncodeJob::rest) == 8, "EncodeJob::rest: column 3, 1 word");
static_assert(sizeof(EncodeJob::esc_count) == 8, "EncodeJob::esc_count: column 4, 1 word");
static_assert(sizeof(EncodeJob::esc_pos) == 8, "EncodeJob::esc_pos: column 5, 1 word");
static_assert(sizeof(EncodeJob::slot_pos) == 8, "EncodeJob::slot_pos: column 6, 1 word");
static_assert(sizeof(EncodeJob::slot_exp) == 8, "EncodeJob::slot_exp: column 7, 1 word");
static_assert(sizeof(EncodeJob::chunk_base) == 8, "EncodeJob::chunk_base: column 8, 1 word");
static_assert(sizeof(EncodeJob::sb_base) == 8, "EncodeJob::sb_base: column 9, 1 word");
static_assert(sizeof(EncodeJob::q_table) == 8, "EncodeJob::q_table: column 10, 1 word");
static_assert(sizeof(EncodeJob::q_scale) == 8, "EncodeJob::q_scale: column 11, 1 word");
static_assert(sizeof(EncodeJob::lut) == 8, "EncodeJob::lut: column 12, 1 word");

static_assert(sizeof(DecodeJob) == 128, "DecodeJob: 16 words, as kvzip/gpu/abi.py");
static_assert(sizeof(DecodeJob::codes) == 8, "DecodeJob::codes: column 0, 1 word");
static_assert(sizeof(DecodeJob::rest) == 8, "DecodeJob::rest: column 1, 1 word");
static_assert(sizeof(DecodeJob::esc_count) == 8, "DecodeJob::esc_count: column 2, 1 word");
static_assert(sizeof(DecodeJob::esc_pos) == 8, "DecodeJob::esc_pos: column 3, 1 word");
static_assert(sizeof(DecodeJob::esc_exp) == 8, "DecodeJob::esc_exp: column 4, 1 word");
static_assert(sizeof(DecodeJob::exp_high) == 8, "DecodeJob::exp_high: column 5, 1 word");
static_assert(sizeof(DecodeJob::n) == 8, "DecodeJob::n: column 6, 1 word");
static_assert(sizeof(DecodeJob::n_esc) == 8, "DecodeJob::n_esc: column 7, 1 word");
static_assert(sizeof(DecodeJob::n_high) == 8, "DecodeJob::n_high: column 8, 1 word");
static_assert(sizeof(DecodeJob::dst) == 8, "DecodeJob::dst: column 9, 1 word");
static_assert(sizeof(DecodeJob::dlo) == 8, "DecodeJob::dlo: column 10, 1 word");
static_assert(sizeof(DecodeJob::dhi) == 8, "DecodeJob::dhi: column 11, 1 word");
static_assert(sizeof(DecodeJob::chunk_base) == 8, "DecodeJob::chunk_base: column 12, 1 word");
static_assert(sizeof(DecodeJob::sb_base) == 8, "DecodeJob::sb_base: column 13, 1 word");
static_assert(sizeof(DecodeJob::dq_table) == 8, "DecodeJob::dq_table: column 14, 1 word");
static_assert(sizeof(DecodeJob::dq_scale) == 8, "DecodeJob::dq_scale: column 15, 1 word");

static_assert(sizeof(FinishJob) == 112, "FinishJob: 14 words, as kvzip/gpu/abi.py");
static_assert(sizeof(FinishJob::blob) == 8, "FinishJob::blob: column 0, 1 word");
static_assert(sizeof(FinishJob::tmpl) == 8, "FinishJob::tmpl: column 1, 1 word");
static_assert(sizeof(FinishJob::header_len) == 8, "FinishJob::header_len: column 2, 1 word");
static_assert(sizeof(FinishJob::table_at) == 8, "FinishJob::table_at: column 3, 1 word");
static_assert(sizeof(FinishJob::var_base) == 8, "FinishJob::var_base: column 4, 1 word");
static_assert(sizeof(FinishJob::pad) == 48, "FinishJob::pad: column 5, 6 words");
static_assert(sizeof(FinishJob::write_header) == 8, "FinishJob::write_header: column 11, 1 word");
static_assert(sizeof(FinishJob::compact) == 8, "FinishJob::compact: column 12, 1 word");
static_assert(sizeof(FinishJob::codebook) == 8, "FinishJob::codebook: column 13, 1 word");
