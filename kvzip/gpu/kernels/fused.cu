// kvzip fast GPU path: fused ExponentSplit + Top16Pack + EscapeStream, encode and decode.
//
// Why CUDA C++ and not Numba: Numba-CUDA has no 128-bit loads or stores, which the dense passes
// need to approach DRAM bandwidth (benchmarks/NOTES.md).  The Numba kernels remain the generic
// path and, with the @njit twin, the reference this file is tested against byte for byte
// (tests/gpu).
//
// Work split.  Encode: kvz_encode's warps take chunks from queues (claim_chunk: four atomic
// counters, claimed a chunk ahead); a warp walks its chunk in steps,
// each lane loading a few 8-value groups with vector loads, writing 4 code bytes and R rest bytes a
// group in place in the blob and noting escapes, which ballots put in position order into a
// per-chunk slot; a chunk of too many escapes (plane-coded) it reads again at once, from L2, to
// write its codes as low exponent nibbles and its high bits into its slot.  kvz_scan (a block per
// 256 chunks, chained per tensor by a decoupled look-back) turns the per-chunk counts into
// offsets, moves the escapes and the plane-coded chunks' high bits to their final place (the
// totals, which fix where the escape exponents and the high bits go, are kvz_encode's sums); its
// first blocks, one a tensor, zero the blob's padding and write its header meanwhile.  Decode: kvz_scan computes every chunk's offsets and checks the counts
// (on guessed layouts its first blocks check the headers), kvz_decode walks the chunks like the
// encoder and applies escapes from registers (whole E5M2 chunks a lane per four groups:
// decode_e5m2_quads); launched as the scan's programmatic dependent, it decodes each warp's first
// chunk while the scan still runs.
// No dense pass ever waits on another warp.

#include "auto_codebook.cu"
#include "encode.cu"
#include "heads.cu"
#include "scan.cu"
#include "decode.cu"
