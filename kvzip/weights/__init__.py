"""Lossless BF16 model weights (the ZipServ half of kvzip): weight formats, the fused
decode+GEMM, ZipLinear and the checkpoint command."""
