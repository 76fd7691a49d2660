// kvzip/gpu/kernels/layout.cuh: the container layout for the kernels.
// Generated from kvzip/layout.py by `python -m kvzip.gpu.headers --write`: do not edit (tests/test_layout.py
// checks that this file is that text).
#pragma once

// Prefix fields: byte offset (_AT) and size in bytes (_SIZE).
#define KVZ_MAGIC_AT 0
#define KVZ_MAGIC_SIZE 8
static_assert(KVZ_MAGIC_AT % KVZ_MAGIC_SIZE == 0, "magic is aligned to its size");
#define KVZ_VERSION_AT 8
#define KVZ_VERSION_SIZE 2
static_assert(KVZ_VERSION_AT % KVZ_VERSION_SIZE == 0, "version is aligned to its size");
#define KVZ_FLAGS_AT 10
#define KVZ_FLAGS_SIZE 2
static_assert(KVZ_FLAGS_AT % KVZ_FLAGS_SIZE == 0, "flags is aligned to its size");
#define KVZ_HEADER_LEN_AT 12
#define KVZ_HEADER_LEN_SIZE 4
static_assert(KVZ_HEADER_LEN_AT % KVZ_HEADER_LEN_SIZE == 0, "header_len is aligned to its size");
#define KVZ_PAYLOAD_LEN_AT 16
#define KVZ_PAYLOAD_LEN_SIZE 8
static_assert(KVZ_PAYLOAD_LEN_AT % KVZ_PAYLOAD_LEN_SIZE == 0, "payload_len is aligned to its size");
#define KVZ_CHECKSUM_AT 24
#define KVZ_CHECKSUM_SIZE 8
static_assert(KVZ_CHECKSUM_AT % KVZ_CHECKSUM_SIZE == 0, "checksum is aligned to its size");
#define KVZ_META_LEN_AT 32
#define KVZ_META_LEN_SIZE 4
static_assert(KVZ_META_LEN_AT % KVZ_META_LEN_SIZE == 0, "meta_len is aligned to its size");
#define KVZ_STREAM_COUNT_AT 36
#define KVZ_STREAM_COUNT_SIZE 4
static_assert(KVZ_STREAM_COUNT_AT % KVZ_STREAM_COUNT_SIZE == 0, "stream_count is aligned to its size");
#define KVZ_HEADER_CRC_AT 40
#define KVZ_HEADER_CRC_SIZE 4
static_assert(KVZ_HEADER_CRC_AT % KVZ_HEADER_CRC_SIZE == 0, "header_crc is aligned to its size");
#define KVZ_RESERVED_AT 44
#define KVZ_RESERVED_SIZE 4
static_assert(KVZ_RESERVED_AT % KVZ_RESERVED_SIZE == 0, "reserved is aligned to its size");
#define KVZ_PREFIX_SIZE 48

// Header length, payload length and stream offsets are multiples of KVZ_ALIGN.
#define KVZ_ALIGN 16
// The stream table: an entry (offset from the payload's start, length; uint64 each) a stream.
#define KVZ_TABLE_AT 48
#define KVZ_ENTRY_SIZE 16
// The escape streams close the payload and the table, in this order.
#define KVZ_ESC_POS_INDEX 0
#define KVZ_ESC_EXP_INDEX 1
#define KVZ_EXP_HIGH_INDEX 2
#define KVZ_ESCAPE_STREAMS 3
#define KVZ_ESCAPE_ENTRIES_SIZE 48  // their table entries, back to back
#define KVZ_ESC_POS_BYTES 2
// esc_count of a plane-coded chunk.
#define PLANE 0xFFFFu

// Version 2, the compact header: its fields' offsets (_AT) and sizes; it is KVZ_COMPACT_SIZE bytes.
#define KVZ_COMPACT_VERSION 2
#define KVZ_COMPACT_SIZE 64
#define KVZ_COMPACT_SHAPE_AT 16
#define KVZ_COMPACT_SHAPE_SIZE 8
#define KVZ_COMPACT_ESCAPES_AT 32
#define KVZ_COMPACT_ESCAPES_SIZE 4
#define KVZ_COMPACT_HIGH_BYTES_AT 36
#define KVZ_COMPACT_HIGH_BYTES_SIZE 4
#define KVZ_COMPACT_DTYPE_AT 44
#define KVZ_COMPACT_DTYPE_SIZE 1
#define KVZ_COMPACT_CHUNK_LOG2_AT 45
#define KVZ_COMPACT_CHUNK_LOG2_SIZE 1
#define KVZ_COMPACT_NDIM_AT 46
#define KVZ_COMPACT_NDIM_SIZE 1
#define KVZ_COMPACT_CODEBOOK_SOURCE_AT 47
#define KVZ_COMPACT_CODEBOOK_SOURCE_SIZE 1
#define KVZ_COMPACT_CODEBOOK_AT 48
#define KVZ_COMPACT_CODEBOOK_SIZE 16

// Version 3, the ratio mode's header: version 2's fields up to ndim, then these; the same size.
#define KVZ_RATIO_RESERVED_AT 47
#define KVZ_RATIO_RESERVED_SIZE 1
#define KVZ_RATIO_SECOND_BYTES_AT 48
#define KVZ_RATIO_SECOND_BYTES_SIZE 4
#define KVZ_RATIO_TAIL_AT 52
#define KVZ_RATIO_TAIL_SIZE 12
