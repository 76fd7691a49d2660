// QuantizeFP8 with one scale per tensor, as a table lookup: two 16-bit values (bf16 or fp16 bits)
// in a 32-bit word -> their two FP8 codes in the low 16 bits.  The magnitude goes through table
// (2^15 entries: the code of each magnitude, sign bit clear; quantize.cu's kvz_quant_table
// builds it) and the sign is copied.  Included by quantize.cu (kvz_quantize) and, through
// group_io.cuh, by the fused kernels (the quantizing encode).
#pragma once
__device__ __forceinline__ unsigned int quantize_pair(unsigned int w, const unsigned char* table) {
    const unsigned int lo = table[w & 0x7FFFu] | ((w >> 8) & 0x80u);
    const unsigned int hi = table[(w >> 16) & 0x7FFFu] | ((w >> 24) & 0x80u);
    return lo | (hi << 8);
}

