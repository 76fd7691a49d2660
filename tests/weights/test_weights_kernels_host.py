"""The weights' GPU kernels (kvzip/gpu/kernels/weights.cu: kvz_w_histogram with the codebook in its
last block, kvz_w_encode with esc_off in its last block, kvz_w_escapes; kvz_w_decode, kvz_w_patch;
kvz_w_gemm; the codebook rule alone) run on the host (tests/cuda_host/emu.h) in kvzip/weights/tiled.py's and
kvzip/gpu/weights.py's order: the encoder must write tiled.encode_reference's bytes, the decoder give W back (escapes and ragged edges
included, whole and as band slices), and the fused GEMM, its mma.sync emulated from the PTX ISA's
fragment layout, the product; and choose_codebook_block alone on histograms of every kind.  Needs g++."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from cuda_host import harness

from kvzip.testing import weight_matrix as weight
from kvzip.weights import tiled

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the host harness")


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    return harness.build("weights.cu", "weights_host.cpp", tmp_path_factory.mktemp("weights_host"))


def u16(w):
    return w.contiguous().view(torch.int16).numpy().view(np.uint16)


CASES = [(16, 64, "trained"), (40, 200, "trained"), (33, 72, "bits"), (5, 7, "bits"), (64, 128, "trained")]
# The encoder's paths: no escape (no kvz_w_escapes launch), escapes in some bands only (kvz_w_encode's
# band offsets with empty bands between, a block's start after its band's earlier blocks), escapes
# everywhere, ragged and tiny shapes; grids smaller and larger than the work (idle blocks still
# take their tickets).
ENCODER_CASES = [(m, k, kind, 3) for m, k, kind in CASES] + [
    (48, 192, "clean", 3), (1, 1, "clean", 1), (80, 300, "bands", 2), (80, 300, "bands", 7), (70, 129, "bands", 1),
    (17, 65, "bits", 1), (64, 256, "bits", 5), (1, 2, "bits", 4), (3, 640, "trained", 2),
    (1100, 3, "trained", 3), (4800, 5, "bits", 2)]  # bands over several warps of the offsets' scan, over 2 a thread


@pytest.mark.parametrize("m,k,kind,grid", ENCODER_CASES)
def test_encoder_kernels_write_the_reference_bytes(exe, tmp_path, m, k, kind, grid):
    w = weight(m, k, kind)
    hist, book, code_of, blocks, counts, esc_off, esc_pos, esc_val, tickets = harness.call(
        exe, tmp_path, [0, m, k, grid], [u16(w)])
    ref = tiled.encode_reference(w)
    assert (ref.escapes == 0) == (kind == "clean" or m * k < 16)  # 2 values: 2 exponents at most
    assert kind != "bands" or ref.escape_bands().unique().tolist() == [1, 3]
    exps = (w.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    assert np.frombuffer(hist, np.uint32).tolist() == torch.bincount(exps.reshape(-1), minlength=256).tolist()
    assert list(book) == ref.codebook.tolist()
    assert list(code_of) == tiled._code_of(ref.codebook.to(torch.int32)).tolist()
    assert blocks == ref.blocks.numpy().tobytes()
    counts = np.frombuffer(counts, np.uint32)
    assert counts.sum() == ref.escapes
    assert np.frombuffer(esc_off, np.uint32).tolist() == ref.esc_off.tolist()
    # the escape lists in the reference's order: by band, then position (blocks are band-major)
    assert np.frombuffer(esc_pos, np.uint32).tolist() == ref.esc_pos.tolist()
    assert np.frombuffer(esc_val, np.uint16).tolist() == (ref.esc_val.to(torch.int32) & 0xFFFF).tolist()
    assert np.frombuffer(tickets, np.uint32).tolist() == [grid, grid]


def layout_arrays(tw) -> list:
    """A TiledWeight's five arrays as weights_host.cpp reads them."""
    return [tw.blocks.numpy(), tw.codebook.numpy(), tw.esc_off.numpy().view(np.uint32),
            tw.esc_pos.numpy().view(np.uint32), tw.esc_val.numpy().view(np.uint16)]


def decode(exe, tmp_path, tw):
    m, k = tw.shape
    (out,) = harness.call(exe, tmp_path, [1, m, k, 2], layout_arrays(tw))
    return np.frombuffer(out, np.uint16).reshape(m, k)


@pytest.mark.parametrize("m,k,kind", CASES)
def test_decoder_kernels_give_w_back(exe, tmp_path, m, k, kind):
    w = weight(m, k, kind, seed=1)
    tw = tiled.encode_reference(w)
    assert (decode(exe, tmp_path, tw) == u16(w)).all()


def test_band_slices_through_the_decoder(exe, tmp_path):
    w = weight(70, 136, "bits", seed=2)
    tw = tiled.encode_reference(w)
    for first, end in ((0, 1), (1, 3), (3, 5), (0, 5)):
        assert (decode(exe, tmp_path, tw.band_slice(first, end)) == u16(w[16 * first:16 * end])).all()


@pytest.mark.parametrize("m,k,n,splits,per_split", [(16, 64, 1, 1, 1), (40, 192, 3, 1, 3), (40, 192, 8, 3, 1),
                                                    (33, 128, 12, 2, 1), (64, 256, 32, 2, 2), (20, 640, 5, 4, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_gemm_kernel_is_the_product(exe, tmp_path, m, k, n, splits, per_split, with_bias):
    """kvz_w_gemm (mma.sync emulated by its PTX fragment layout) against an FP64 product: within BF16
    rounding, escapes and bias included, the split tickets zero again afterwards."""
    check_product(exe, tmp_path, 3, m, k, n, splits, per_split, with_bias)


@pytest.mark.parametrize("m,k,n,splits,per_split", [(16, 128, 1, 1, 2), (24, 1088, 9, 3, 6), (40, 192, 20, 3, 1)])
def test_fused_gemm_kernel_with_escapes_everywhere(exe, tmp_path, m, k, n, splits, per_split):
    """kvz_w_gemm where most weights escape (columns scaled by 2^-16 .. 2^15): hundreds a chunk, a
    band's list spanning splits and the warps' chunks."""
    check_product(exe, tmp_path, 3, m, k, n, splits, per_split, True, wide_columns=True)


def check_product(exe, tmp_path, op, m, k, n, splits, per_split, with_bias, wide_columns=False):
    """weights_host's gemm op (3: kvz_w_gemm, 4: kvz_w_gemm_wide) on a trained-like weight with
    escapes: y within BF16 rounding of the FP64 product (FP32 sums of k terms: bounded by the
    terms' magnitudes, element by element), the tickets zero again after."""
    w = weight(m, k, "trained", seed=m + n)
    if wide_columns:  # columns scaled by 2^-16 .. 2^15: most weights escape, all stay finite
        w = (w.float() * 2.0 ** (torch.arange(k) % 32 - 16)).to(torch.bfloat16)
    tw = tiled.encode_reference(w)
    assert tw.escapes or m * k < 5000, "the case must have escapes for the kernel to add"
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(m, generator=g).to(torch.bfloat16) if with_bias else None
    arrays = [*layout_arrays(tw), u16(x), u16(bias) if with_bias else np.zeros(0, np.uint16),
              np.array([n, splits, per_split], np.int64)]
    y, tickets = harness.call(exe, tmp_path, [op, m, k, 1], arrays)
    y = torch.from_numpy(np.frombuffer(y, np.uint16).astype(np.int32)).to(torch.int16).view(torch.bfloat16).reshape(n, m)
    ref = x.double() @ w.double().T + (bias.double() if with_bias else 0)
    terms = x.double().abs() @ w.double().abs().T + (bias.double().abs() if with_bias else 0)
    assert ((y.double() - ref).abs() <= 2 ** -8 * ref.abs() + 1e-5 * terms).all()
    assert not np.frombuffer(tickets, np.uint32).any()


@pytest.mark.parametrize("m,k,n,splits,per_split", [(16, 64, 33, 1, 1), (136, 192, 64, 3, 1), (24, 80, 40, 1, 2),
                                                    (40, 640, 100, 4, 3), (33, 128, 200, 2, 1), (20, 128, 5, 2, 1),
                                                    (48, 192, 20, 1, 3), (40, 192, 1, 2, 2), (24, 128, 12, 1, 2)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_wide_gemm_kernel_is_the_product(exe, tmp_path, m, k, n, splits, per_split, with_bias):
    """kvz_w_gemm_wide (x staged in shared memory; the codebook looked up by byte permutes; escapes
    patched into the A fragments): a row block with bands past M (136 rows: 9 bands), K not a
    multiple of the chunk (80: x zero past it), n blocks of 8 to 128 columns and two n blocks
    (200), splits with a short last one."""
    check_product(exe, tmp_path, 4, m, k, n, splits, per_split, with_bias)


@pytest.mark.parametrize("m,k,n,splits,per_split", [(16, 128, 40, 1, 2), (24, 320, 9, 3, 2), (40, 192, 70, 3, 1)])
def test_wide_gemm_kernel_with_escapes_everywhere(exe, tmp_path, m, k, n, splits, per_split):
    """Columns scaled by 2^-16 .. 2^15, so most weights escape: hundreds a chunk, a chunk's escapes
    span many batches of 32, and a split starts deep in its band's list (the warp's search)."""
    check_product(exe, tmp_path, 4, m, k, n, splits, per_split, True, wide_columns=True)


def histograms() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    out = [np.zeros(256, np.uint32)]                       # an all-zero matrix
    h = np.zeros(256, np.uint32); h[0] = 1000; out.append(h)  # zeros only: no code used
    h = np.zeros(256, np.uint32); h[[3, 200, 255]] = [5, 5, 9]; out.append(h)  # fewer than 15, NaN/inf exponent
    out.append(np.full(256, 7, np.uint32))                  # every count tied: the 15 smallest exponents
    h = np.zeros(256, np.uint32); h[100:130] = 4; h[128] = 5; out.append(h)  # ties at the cut
    h = np.zeros(256, np.uint32); h[1:17] = 2 ** 31 - 1 - np.arange(16, dtype=np.uint32); out.append(h)  # large counts
    for _ in range(40):  # trained-weight-like: a peak of exponents, a tail, random ties
        h = np.zeros(256, np.uint32)
        centre = rng.integers(100, 130)
        h[centre - 12:centre + 6] = rng.integers(0, 4, 18) * rng.integers(1, 10 ** 6)
        h[rng.integers(0, 256, 5)] += rng.integers(0, 3, 5).astype(np.uint32)
        out.append(h)
    return out


def test_codebook_block_gives_the_reference_tables(exe, tmp_path):
    """choose_codebook_block (kvz_w_histogram's last block) alone, on any histogram: choose_codebook's
    book and _code_of's table."""
    hists = histograms()
    records = harness.call(exe, tmp_path, [2, 0, 0, 1], [np.concatenate(hists)])
    assert len(records) == 2 * len(hists)
    for i, h in enumerate(hists):
        book = tiled.choose_codebook(torch.from_numpy(h.astype(np.int64)))
        code_of = tiled._code_of(book)
        assert list(records[2 * i]) == book.tolist(), (i, h.nonzero())
        assert list(records[2 * i + 1]) == code_of.tolist(), i
