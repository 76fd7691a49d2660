"""kvz_w_codebook (kvzip/gpu/kernels/weights_book.cuh), the GPU encoder's codebook, run on the host
(tests/cuda_host/emu.h): for any exponent histogram its book and code table must be
kvzip/weights/tiled.py's choose_codebook and _code_of, which define the layout's bytes.  Needs g++."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from cuda_host import harness

from kvzip.weights import tiled

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the host harness")


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


def test_codebook_kernel_gives_the_reference_tables(tmp_path):
    exe = harness.build("weights.cu", "weights_host.cpp", tmp_path)
    hists = histograms()
    records = harness.call(exe, tmp_path, [2, 0, 0, 1], [np.concatenate(hists)])
    assert len(records) == 2 * len(hists)
    for i, h in enumerate(hists):
        book = tiled.choose_codebook(torch.from_numpy(h.astype(np.int64)))
        code_of = tiled._code_of(book)
        assert list(records[2 * i]) == book.tolist(), (i, h.nonzero())
        assert list(records[2 * i + 1]) == code_of.tolist(), i
