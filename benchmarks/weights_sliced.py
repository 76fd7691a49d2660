"""A candidate route for wide x (N above ZipLinear's fused kernel), measured by bench_weights.py
before ZipLinear takes it (benchmarks/NOTES.md w6): W decoded a band slice at a time into a small
scratch buffer, each slice's cuBLAS GEMM on the caller's stream while the next slice decodes on a
side stream.

Why it might pay where decode + cuBLAS does not (0.31-0.53x of cuBLAS at N = 64-256 on the H200):
that route writes all of W to memory and reads it back, more traffic than cuBLAS's own read of W.
Slices of a few MiB are written and read again while they are still in L2 (50 MB on the H200), so
HBM sees the compressed W once; and the decoder (memory and ALU) overlaps the GEMMs (tensor cores)
of the slice before.  y^T is built a slice of rows at a time (each slice's rows of y^T are
contiguous), with the bias in each GEMM, then transposed once.

Exact as a product: each output element is one row of W against one column of x, as in F.linear;
only cuBLAS's choice of kernel for the slice's shape may order the sum differently.
"""
from __future__ import annotations

import torch

from kvzip.gpu import weights as gpu
from kvzip.weights import tiled
from kvzip.weights.tiled import TiledWeight

SLICE_BYTES = 16 << 20  # BF16 bytes of W a slice decodes to (a multiple of 16 rows)


class SlicedProduct:
    """y = x W^T + bias through band slices of a tiled weight (see the module docstring)."""

    def __init__(self, tw: TiledWeight, slice_bytes: int = SLICE_BYTES):
        m, k = tw.shape
        bands, _ = tiled.grid(tw.shape)
        per = max(1, slice_bytes // (2 * k * tiled.BAND))
        self.shape = tw.shape
        self.parts = [(b * tiled.BAND, tw.band_slice(b, min(b + per, bands))) for b in range(0, bands, per)]
        self.rows = max(p.shape[0] for _, p in self.parts)
        # the decoding stream, made here: a CUDA graph may capture the first call
        self._side = torch.cuda.Stream(device=tw.device) if tw.device.type == "cuda" else None

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x: (N, K) BF16 on the weight's device; returns (N, M), contiguous."""
        m, k = self.shape
        dev = x.device
        y_t = torch.empty(m, x.shape[0], dtype=torch.bfloat16, device=dev)
        scratch = [torch.empty(self.rows, k, dtype=torch.bfloat16, device=dev) for _ in range(2)]
        x_t = x.t()
        if dev.type != "cuda":
            for i, (row, part) in enumerate(self.parts):
                buf = scratch[i % 2][:part.shape[0]]
                buf.copy_(tiled.decode(part))
                self._gemm(buf, x_t, bias, row, y_t)
            return y_t.t().contiguous()
        main, side = torch.cuda.current_stream(dev), self._side
        side.wait_stream(main)  # x and the buffers are ready; also forks a graph capture onto side
        freed = [None, None]    # the GEMM that last read each buffer
        for i, (row, part) in enumerate(self.parts):
            buf = scratch[i % 2][:part.shape[0]]
            with torch.cuda.stream(side):
                if freed[i % 2] is not None:
                    side.wait_event(freed[i % 2])
                gpu.decode(part, buf, tiled.cuda_stream(dev.index))
                decoded = torch.cuda.Event()
                decoded.record(side)
            main.wait_event(decoded)  # every side-stream step joins main before the call returns
            self._gemm(buf, x_t, bias, row, y_t)
            freed[i % 2] = torch.cuda.Event()
            freed[i % 2].record(main)
        return y_t.t().contiguous()

    @staticmethod
    def _gemm(w_rows, x_t, bias, row, y_t) -> None:
        out = y_t[row:row + w_rows.shape[0]]
        if bias is None:
            torch.mm(w_rows, x_t, out=out)
        else:
            torch.addmm(bias[row:row + w_rows.shape[0], None], w_rows, x_t, out=out)
