// The tiled layout's codebook and code table from the exponent histogram, on the device, by
// kvzip/weights/tiled.py's rule (choose_codebook, _code_of): choose_codebook_block, which the last
// thread block of kvz_w_histogram runs (so the GPU encoder has no launch between the histogram and
// kvz_w_encode).
#pragma once

// One block of 256 threads, thread e holding count = the number of weights with exponent e.
// Exponents 1..255 rank by count, descending, ties to the smaller exponent; the first 15 with a
// nonzero count are the codebook.  book[0] = 0 (zeros, subnormals), book[1..] the chosen exponents
// ascending, unused codes 0; code_of[e] = e's code, 0 for exponent 0 and for every unchosen one
// (an escape).  A 255-step count a thread: a few microseconds.  Every thread of the block calls it.
__device__ __forceinline__ void choose_codebook_block(unsigned count_e, unsigned char* __restrict__ book,
                                                      unsigned char* __restrict__ code_of) {
    __shared__ unsigned count[256];
    __shared__ unsigned char chosen[256];
    const int e = threadIdx.x;
    const unsigned mine = e ? count_e : 0u;  // exponent 0 is code 0 whatever its count: not ranked
    count[e] = mine;
    if (e < 16) book[e] = 0;
    __syncthreads();
    int rank = 0;  // exponents ahead of e
    for (int f = 1; f < 256; ++f) {
        const unsigned other = count[f];
        rank += other > mine || (other == mine && f < e);
    }
    const bool in = e != 0 && mine != 0 && rank < 15;
    chosen[e] = in;
    __syncthreads();  // also orders the zeroed book before the chosen codes' stores
    int code = 0;
    if (in) {
        code = 1;
        for (int f = 1; f < e; ++f) code += chosen[f];
        book[code] = (unsigned char)e;
    }
    code_of[e] = (unsigned char)code;
}
