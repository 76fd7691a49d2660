"""The tiled layout: a BF16 weight matrix as kvzip's 12-bit split (a 4-bit exponent code and the
raw sign+mantissa byte per weight), re-tiled into the order in which tensor cores consume it.

This module is the layout's reference: ``encode_reference`` and ``decode`` are integer torch
operations, so the same code runs on the CPU and on a GPU and writes the same bytes, and the
CUDA kernels (kvzip/gpu/kernels/weights.cu) are tested against it; the block geometry (BAND,
CHUNK, BLOCK_BYTES) comes from kvzip/gpu/weights.py, which the kernels are built with.
docs/weights-format.md §1 specifies the bytes; in short:

* W (M x K) is padded with zeros to ``bands`` of 16 rows and ``chunks`` of 64 columns.
* Block (band, chunk), 1536 bytes, holds the 1024 weights of rows 16 band.. and columns
  64 chunk..: lane l (g = l // 4, q = l % 4) of a warp owns rows g and g + 8 of columns
  16 q .. 16 q + 15, as the mma.m16n8k16 A fragments of four steps s: weight j of step s
  (t = 8 s + j) is row g + 8 ((j >> 1) & 1), column 16 q + 4 s + 2 (j >> 2) + (j & 1).  (The
  mma's k order within a step is a permutation of the block's columns, which a sum over k
  does not see; this one gives each lane x from 32 contiguous bytes of a row.)  Bytes 16 l..
  hold its 32 codes (two a byte, the lower t in the low nibble); bytes 512 + 512 h + 16 l..
  its sign+mantissa bytes (sign << 7 | mantissa) of steps 2 h and 2 h + 1.
* Code 0 is exponent 0 (zeros, subnormals); codes 1-15 the 15 most frequent other exponents
  (ascending; unused codes repeat 0).  Any other weight is an escape: code 0 and byte 0 in its
  block (it decodes to +0) and its BF16 value in the escape list, per band, ordered by
  position p = 16 column + row-in-band.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import arrays
from ..errors import FormatError
from ..gpu.weights import BAND, BLOCK_BYTES, CHUNK, grid  # the geometry the kernels are built for

CODES = 16


def _bits(w: torch.Tensor) -> torch.Tensor:
    """BF16 tensor -> its 16-bit patterns as int32 (0..65535)."""
    return w.view(torch.int16).to(torch.int32) & 0xFFFF


def choose_codebook(histogram: torch.Tensor) -> torch.Tensor:
    """The 16 exponents codes 0-15 stand for (int32), from the 256-bin exponent histogram: 0,
    then the 15 most frequent nonzero exponents, ties to the smaller exponent, in ascending
    order; unused codes 0.  Integer operations only, on the histogram's device, no host sync."""
    hist = histogram[1:].to(torch.int64)
    key = hist * 256 + (255 - torch.arange(1, 256, device=hist.device))  # counts first, then smaller exponent
    top = torch.topk(key, 15).indices
    chosen = torch.sort(torch.where(hist[top] > 0, top + 1, 256)).values  # 256: unused, sorted last
    book = torch.zeros(CODES, dtype=torch.int32, device=hist.device)
    book[1:] = torch.where(chosen == 256, 0, chosen).to(torch.int32)
    return book


def _code_of(book: torch.Tensor) -> torch.Tensor:
    """The code of each of the 256 exponents (int32): its place in the codebook, 0 for exponent 0
    and for the escapes."""
    code_of = torch.zeros(256, dtype=torch.int32, device=book.device)
    code_of[book[1:]] = torch.arange(1, CODES, dtype=torch.int32, device=book.device)
    code_of[0] = 0  # unused codes repeat exponent 0: code 0 keeps it
    return code_of


# The permutation between a band x chunk grid of 16 x 64 weights and the blocks' lane order:
# axes (band, h_r, g, chunk, q, s, h_c, e) with row = 8 h_r + g, column = 16 q + 4 s + 2 h_c + e,
# to (band, chunk, g, q, s, h_c, h_r, e), whose last six axes are (lane, t) with
# j = 4 h_c + 2 h_r + e.
_GRID_AXES = (2, 8, 4, 4, 2, 2)  # h_r, g | q, s, h_c, e
_TO_BLOCKS = (0, 3, 2, 4, 5, 6, 1, 7)
_FROM_BLOCKS = tuple(_TO_BLOCKS.index(i) for i in range(8))


def _to_blocks(a: torch.Tensor, bands: int, chunks: int) -> torch.Tensor:
    """(16 bands, 64 chunks) -> (bands, chunks, 32 lanes, 32 weights), in lane order."""
    h_r, g, q, s, h_c, e = _GRID_AXES
    grid_view = a.reshape(bands, h_r, g, chunks, q, s, h_c, e)
    return grid_view.permute(*_TO_BLOCKS).reshape(bands, chunks, 32, 32)


def _from_blocks(a: torch.Tensor, bands: int, chunks: int) -> torch.Tensor:
    h_r, g, q, s, h_c, e = _GRID_AXES
    lane_view = a.reshape(bands, chunks, g, q, s, h_c, h_r, e)
    return lane_view.permute(*_FROM_BLOCKS).reshape(bands * BAND, chunks * CHUNK)


@dataclass(frozen=True)
class TiledWeight:
    """A weight matrix in the tiled layout; every array on one device.

    blocks    uint8 (bands, chunks, 1536)
    codebook  uint8 (16,): the exponent of each code (codebook[0] == 0)
    esc_off   int32 (bands + 1,): band b's escapes are esc_pos/esc_val[esc_off[b]:esc_off[b + 1]]
    esc_pos   int32 (escapes,): 16 column + row in band, increasing within a band
    esc_val   int16 (escapes,): the escaped weights' BF16 bits
    """

    shape: tuple
    blocks: torch.Tensor
    codebook: torch.Tensor
    esc_off: torch.Tensor
    esc_pos: torch.Tensor
    esc_val: torch.Tensor

    @property
    def escapes(self) -> int:
        return self.esc_pos.numel()

    @property
    def nbytes(self) -> int:
        """Bytes the layout holds: blocks, codebook and escape lists."""
        return sum(a.numel() * a.element_size() for a in self.arrays())

    @property
    def ratio(self) -> float:
        m, k = self.shape
        return 2 * m * k / self.nbytes

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def to(self, device) -> "TiledWeight":
        return TiledWeight(self.shape, *(a.to(device) for a in self.arrays()))

    def arrays(self) -> tuple:
        return self.blocks, self.codebook, self.esc_off, self.esc_pos, self.esc_val

    def band_slice(self, first: int, end: int) -> "TiledWeight":
        """Rows 16 first .. 16 end (clipped to M) as a TiledWeight of their own: its blocks and
        escape lists are views of these, its esc_off rebased to start at 0 (a new tensor of
        end - first + 1 entries), so every decoder takes it as a whole matrix."""
        bands, _ = grid(self.shape)
        if not (type(first) is int and type(end) is int and 0 <= first < end <= bands):
            raise ValueError(f"a band slice of a weight of {bands} bands needs 0 <= first < end <= {bands}, "
                             f"got {first}, {end}")
        lo, hi = int(self.esc_off[first]), int(self.esc_off[end])
        rows = min(BAND * end, self.shape[0]) - BAND * first
        return TiledWeight((rows, self.shape[1]), self.blocks[first:end], self.codebook,
                           (self.esc_off[first:end + 1] - lo).contiguous(), self.esc_pos[lo:hi], self.esc_val[lo:hi])

    def escape_bands(self) -> torch.Tensor:
        """The band of each escape (int64), from esc_off."""
        off = self.esc_off.to(torch.int64)
        return torch.repeat_interleave(torch.arange(off.numel() - 1, device=off.device), off[1:] - off[:-1])

    def validate(self) -> "TiledWeight":
        """Check every size, offset and position against the shape (FormatError): what a kernel
        indexes with these arrays then stays inside W.  A pure function of the arrays."""
        m, k = self.shape
        if not (isinstance(m, int) and isinstance(k, int) and m > 0 and k > 0):
            raise FormatError(f"a tiled weight needs a positive 2-D shape, got {self.shape}")
        bands, chunks = grid(self.shape)
        want = {"blocks": ((bands, chunks, BLOCK_BYTES), torch.uint8), "codebook": ((CODES,), torch.uint8),
                "esc_off": ((bands + 1,), torch.int32)}
        for name, (shape, dtype) in want.items():
            a = getattr(self, name)
            if tuple(a.shape) != shape or a.dtype != dtype:
                raise FormatError(f"{name} must be {dtype} of shape {shape}, got {a.dtype} {tuple(a.shape)}")
        n = self.esc_pos.numel()
        if self.esc_pos.dtype != torch.int32 or self.esc_val.dtype != torch.int16 or self.esc_val.numel() != n \
                or self.esc_pos.dim() != 1 or self.esc_val.dim() != 1:
            raise FormatError("esc_pos (int32) and esc_val (int16) must be 1-D lists of one length")
        if int(self.codebook[0]) != 0:
            raise FormatError("code 0 must stand for exponent 0")
        off = self.esc_off.to(torch.int64)
        if int(off[0]) != 0 or int(off[-1]) != n or bool((off[1:] < off[:-1]).any()):
            raise FormatError("esc_off must rise from 0 to the number of escapes")
        if n:
            pos = self.esc_pos.to(torch.int64)
            band = self.escape_bands()
            row, col = band * BAND + (pos & 15), pos >> 4
            if bool((pos < 0).any() | (row >= m).any() | (col >= k).any()):
                raise FormatError("an escape lies outside the matrix")
            key = band * (16 * chunks * CHUNK) + pos
            if bool((key[1:] <= key[:-1]).any()):
                raise FormatError("escape positions must increase within a band")
        return self


def encode(w: torch.Tensor) -> TiledWeight:
    """A 2-D BF16 tensor in the tiled layout, on its device (by the CUDA kernels on a GPU,
    which write the reference's bytes)."""
    if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.dim() != 2 or w.numel() == 0:
        raise ValueError(f"the tiled layout takes a non-empty 2-D bfloat16 tensor, got "
                         f"{getattr(w, 'dtype', type(w).__name__)} of shape {tuple(getattr(w, 'shape', ()))}")
    if w.device.type == "cuda":
        return _encode_cuda(w)
    return encode_reference(w)


def encode_reference(w: torch.Tensor) -> TiledWeight:
    """encode() by integer torch operations, on any device: the definition of the bytes."""
    m, k = w.shape
    bands, chunks = grid(w.shape)
    bits = torch.zeros(bands * BAND, chunks * CHUNK, dtype=torch.int32, device=w.device)
    bits[:m, :k] = _bits(w.contiguous())
    exps = (bits >> 7) & 0xFF
    book = choose_codebook(torch.bincount(exps.reshape(-1), minlength=256))
    codes = _code_of(book)[exps]
    escape = (codes == 0) & (exps != 0)
    sm = ((bits >> 8) & 0x80) | (bits & 0x7F)
    sm = torch.where(escape, 0, sm)

    lanes_codes = _to_blocks(codes, bands, chunks)
    code_bytes = (lanes_codes[..., 0::2] | (lanes_codes[..., 1::2] << 4)).reshape(bands, chunks, 512)
    sm_bytes = _to_blocks(sm, bands, chunks).reshape(bands, chunks, 32, 2, 16).transpose(2, 3)
    blocks = torch.cat([code_bytes, sm_bytes.reshape(bands, chunks, 1024)], dim=2).to(torch.uint8)

    row, col = torch.nonzero(escape, as_tuple=True)
    band = row // BAND
    pos = col * BAND + row % BAND
    order = torch.argsort(band * (BAND * chunks * CHUNK) + pos)
    counts = torch.bincount(band, minlength=bands)
    esc_off = torch.zeros(bands + 1, dtype=torch.int32, device=w.device)
    esc_off[1:] = torch.cumsum(counts, 0).to(torch.int32)
    esc_val = bits[row[order], col[order]].to(torch.int16)  # wraps 0x8000.. to negative int16: the same bits
    return TiledWeight((int(m), int(k)), blocks.contiguous(), book.to(torch.uint8), esc_off,
                       pos[order].to(torch.int32).contiguous(), esc_val.contiguous())


def _encode_cuda(w: torch.Tensor) -> TiledWeight:
    """Three launches and one host sync: kvz_w_histogram (whose last thread block chooses the
    codebook), kvz_w_encode (whose last block writes esc_off), the escape count read back to size
    the lists, and kvz_w_escapes where there are escapes."""
    from ..gpu import weights as gpu

    w = w.contiguous()
    if w.data_ptr() % 16:
        w = w.clone()
    stream = cuda_stream(w.device.index)
    bands, chunks = grid(w.shape)
    ws = gpu.workspace(w.shape, w.device.index)
    work = torch.zeros(ws.words, dtype=torch.int32, device=w.device)  # counters and tickets start at zero
    book = torch.empty(CODES, dtype=torch.uint8, device=w.device)
    blocks = torch.empty(bands, chunks, BLOCK_BYTES, dtype=torch.uint8, device=w.device)
    esc_off = torch.empty(bands + 1, dtype=torch.int32, device=w.device)
    gpu.histogram(w, work, book, ws, stream)
    gpu.encode_blocks(w, work, blocks, esc_off, ws, stream)
    total = int(esc_off[bands])  # the one host sync: the escape lists' length
    if total < 0:
        raise ValueError(f"{w.shape[0]} x {w.shape[1]} has 2^31 escapes or more: more than esc_off (int32) can count")
    esc_pos = torch.empty(total, dtype=torch.int32, device=w.device)
    esc_val = torch.empty(total, dtype=torch.int16, device=w.device)
    if total:
        gpu.encode_escapes(w, work, esc_off, esc_pos, esc_val, ws, stream)
    return TiledWeight((int(w.shape[0]), int(w.shape[1])), blocks, book, esc_off, esc_pos, esc_val)


def cuda_stream(device_index: int):
    """CuPy's object for the caller's current torch stream on a GPU (the kernels' stream)."""
    return arrays._cupy_stream(arrays._torch_stream_ptr(device_index), device_index)


def decode(tw: TiledWeight) -> torch.Tensor:
    """The BF16 matrix back, bit for bit (the reference decoder; ZipLinear.decompress_weight
    runs the CUDA kernels on a GPU)."""
    m, k = tw.shape
    bands, chunks = grid(tw.shape)
    blocks = tw.blocks.to(torch.int32)
    code_bytes = blocks[..., :512].reshape(bands, chunks, 32, 16)
    codes = torch.stack([code_bytes & 15, code_bytes >> 4], dim=-1).reshape(bands, chunks, 32, 32)
    sm = blocks[..., 512:].reshape(bands, chunks, 2, 32, 16).transpose(2, 3).reshape(bands, chunks, 32, 32)
    exps = tw.codebook.to(torch.int32)[codes]
    bits = ((sm & 0x80) << 8) | (exps << 7) | (sm & 0x7F)
    full = _from_blocks(bits, bands, chunks)
    if tw.escapes:
        band, pos = tw.escape_bands(), tw.esc_pos.to(torch.int64)
        full[band * BAND + (pos & 15), pos >> 4] = tw.esc_val.to(torch.int32) & 0xFFFF
    out = full[:m, :k].to(torch.int16)  # 32768.. wrap to the same 16 bits
    return out.contiguous().view(torch.bfloat16)
