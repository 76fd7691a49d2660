// kvzip/gpu/kernels/abi_check.cuh: the job structs' layout as the host writes them.
// Generated from kvzip/gpu/abi.py by `python -m kvzip.gpu.headers --write`: do not edit (tests/test_abi.py
// checks that this file is that text).  Included after the struct definitions.
#pragma once

static_assert(sizeof(EncodeJob) == 96, "EncodeJob: 12 words, as kvzip/gpu/abi.py");
static_assert(__builtin_offsetof(EncodeJob, src) == 0 && sizeof(EncodeJob::src) == 8, "EncodeJob::src: column 0");
static_assert(__builtin_offsetof(EncodeJob, n) == 8 && sizeof(EncodeJob::n) == 8, "EncodeJob::n: column 1");
static_assert(__builtin_offsetof(EncodeJob, codes) == 16 && sizeof(EncodeJob::codes) == 8, "EncodeJob::codes: column 2");
static_assert(__builtin_offsetof(EncodeJob, rest) == 24 && sizeof(EncodeJob::rest) == 8, "EncodeJob::rest: column 3");
static_assert(__builtin_offsetof(EncodeJob, esc_count) == 32 && sizeof(EncodeJob::esc_count) == 8, "EncodeJob::esc_count: column 4");
static_assert(__builtin_offsetof(EncodeJob, esc_pos) == 40 && sizeof(EncodeJob::esc_pos) == 8, "EncodeJob::esc_pos: column 5");
static_assert(__builtin_offsetof(EncodeJob, slot_pos) == 48 && sizeof(EncodeJob::slot_pos) == 8, "EncodeJob::slot_pos: column 6");
static_assert(__builtin_offsetof(EncodeJob, slot_exp) == 56 && sizeof(EncodeJob::slot_exp) == 8, "EncodeJob::slot_exp: column 7");
static_assert(__builtin_offsetof(EncodeJob, chunk_base) == 64 && sizeof(EncodeJob::chunk_base) == 8, "EncodeJob::chunk_base: column 8");
static_assert(__builtin_offsetof(EncodeJob, sb_base) == 72 && sizeof(EncodeJob::sb_base) == 8, "EncodeJob::sb_base: column 9");
static_assert(__builtin_offsetof(EncodeJob, q_table) == 80 && sizeof(EncodeJob::q_table) == 8, "EncodeJob::q_table: column 10");
static_assert(__builtin_offsetof(EncodeJob, q_scale) == 88 && sizeof(EncodeJob::q_scale) == 8, "EncodeJob::q_scale: column 11");

static_assert(sizeof(DecodeJob) == 128, "DecodeJob: 16 words, as kvzip/gpu/abi.py");
static_assert(__builtin_offsetof(DecodeJob, codes) == 0 && sizeof(DecodeJob::codes) == 8, "DecodeJob::codes: column 0");
static_assert(__builtin_offsetof(DecodeJob, rest) == 8 && sizeof(DecodeJob::rest) == 8, "DecodeJob::rest: column 1");
static_assert(__builtin_offsetof(DecodeJob, esc_count) == 16 && sizeof(DecodeJob::esc_count) == 8, "DecodeJob::esc_count: column 2");
static_assert(__builtin_offsetof(DecodeJob, esc_pos) == 24 && sizeof(DecodeJob::esc_pos) == 8, "DecodeJob::esc_pos: column 3");
static_assert(__builtin_offsetof(DecodeJob, esc_exp) == 32 && sizeof(DecodeJob::esc_exp) == 8, "DecodeJob::esc_exp: column 4");
static_assert(__builtin_offsetof(DecodeJob, exp_high) == 40 && sizeof(DecodeJob::exp_high) == 8, "DecodeJob::exp_high: column 5");
static_assert(__builtin_offsetof(DecodeJob, n) == 48 && sizeof(DecodeJob::n) == 8, "DecodeJob::n: column 6");
static_assert(__builtin_offsetof(DecodeJob, n_esc) == 56 && sizeof(DecodeJob::n_esc) == 8, "DecodeJob::n_esc: column 7");
static_assert(__builtin_offsetof(DecodeJob, n_high) == 64 && sizeof(DecodeJob::n_high) == 8, "DecodeJob::n_high: column 8");
static_assert(__builtin_offsetof(DecodeJob, dst) == 72 && sizeof(DecodeJob::dst) == 8, "DecodeJob::dst: column 9");
static_assert(__builtin_offsetof(DecodeJob, dlo) == 80 && sizeof(DecodeJob::dlo) == 8, "DecodeJob::dlo: column 10");
static_assert(__builtin_offsetof(DecodeJob, dhi) == 88 && sizeof(DecodeJob::dhi) == 8, "DecodeJob::dhi: column 11");
static_assert(__builtin_offsetof(DecodeJob, chunk_base) == 96 && sizeof(DecodeJob::chunk_base) == 8, "DecodeJob::chunk_base: column 12");
static_assert(__builtin_offsetof(DecodeJob, sb_base) == 104 && sizeof(DecodeJob::sb_base) == 8, "DecodeJob::sb_base: column 13");
static_assert(__builtin_offsetof(DecodeJob, dq_table) == 112 && sizeof(DecodeJob::dq_table) == 8, "DecodeJob::dq_table: column 14");
static_assert(__builtin_offsetof(DecodeJob, dq_scale) == 120 && sizeof(DecodeJob::dq_scale) == 8, "DecodeJob::dq_scale: column 15");

static_assert(sizeof(FinishJob) == 96, "FinishJob: 12 words, as kvzip/gpu/abi.py");
static_assert(__builtin_offsetof(FinishJob, blob) == 0 && sizeof(FinishJob::blob) == 8, "FinishJob::blob: column 0");
static_assert(__builtin_offsetof(FinishJob, tmpl) == 8 && sizeof(FinishJob::tmpl) == 8, "FinishJob::tmpl: column 1");
static_assert(__builtin_offsetof(FinishJob, header_len) == 16 && sizeof(FinishJob::header_len) == 8, "FinishJob::header_len: column 2");
static_assert(__builtin_offsetof(FinishJob, table_at) == 24 && sizeof(FinishJob::table_at) == 8, "FinishJob::table_at: column 3");
static_assert(__builtin_offsetof(FinishJob, var_base) == 32 && sizeof(FinishJob::var_base) == 8, "FinishJob::var_base: column 4");
static_assert(__builtin_offsetof(FinishJob, pad) == 40 && sizeof(FinishJob::pad) == 48, "FinishJob::pad: column 5");
static_assert(__builtin_offsetof(FinishJob, write_header) == 88 && sizeof(FinishJob::write_header) == 8, "FinishJob::write_header: column 11");
