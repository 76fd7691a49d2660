// The weights' kernels over the tiled 12-bit split layout (docs/weights-format.md, "The tiled
// layout"): kvz_w_gemm, the fused decode+GEMM y = x W^T + bias for small N on tensor cores
// (mma.sync m16n8k16, BF16 in, FP32 accumulate; weights_gemm.cuh), and kvz_w_gemm_wide, the same
// for wider x, staged in shared memory and shared by a block's bands (weights_wide.cuh); kvz_w_decode and
// kvz_w_patch, W back in row-major BF16; kvz_w_histogram, kvz_w_encode and kvz_w_escapes, the
// GPU encoder, which writes the bytes of kvzip/weights/tiled.py (weights_codec.cuh).
//
// The layout in one paragraph.  W (M x K) is padded with zeros to whole bands of 16 rows and
// chunks of 64 columns; block (band, chunk) is 1536 bytes: 512 bytes of 4-bit codes, then 1024
// sign+mantissa bytes (sign << 7 | mantissa).  Lane l = 4 g + q of a warp owns 32 weights of the
// block, rows g and g + 8 of columns 16 q .. 16 q + 15, in the order of the mma A fragments of
// its four steps (step s: columns 16 q + 4 s .. + 3), so one 16-byte load per stream gives it
// everything it multiplies: codes at byte 16 l, sign+mantissa of steps 0-1 at 512 + 16 l, of
// steps 2-3 at 1024 + 16 l; and its x comes from 32 contiguous bytes of a row of x.  Code 0 means exponent 0 (zero, subnormal); codes 1-15 the
// matrix's codebook.  An escape (an exponent outside the codebook) is stored as code 0 with a
// zero byte, so it decodes to +0 here, and its value sits in a per-band list that kvz_w_gemm adds
// in FP32 after the tensor-core loop (the weight stays exact, only the summation order changes)
// and kvz_w_patch writes over the decoded zero.
#include "weights_tile.cuh"
#include "weights_gemm.cuh"
#include "weights_wide.cuh"
#include "weights_codec.cuh"
#include "weights_book.cuh"
