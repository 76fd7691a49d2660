"""benchmarks/weights_sliced.py's candidate wide-x route on the CPU: the product through band
slices (every slice size, bias or none, odd shapes) is F.linear's on the decoded weight."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvzip.weights import tiled

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from weights_sliced import SlicedProduct  # noqa: E402


@pytest.mark.parametrize("m,k", [(100, 64), (33, 96), (16, 8), (257, 40)])
@pytest.mark.parametrize("slice_rows", [16, 32, 48, 4096])
@pytest.mark.parametrize("with_bias", [False, True])
def test_sliced_product_is_the_linear(m, k, slice_rows, with_bias):
    g = torch.Generator().manual_seed(m * k + slice_rows)
    w = (torch.randn(m, k, generator=g) * 0.05).to(torch.bfloat16)
    w[0, 0] = 3e30  # an escape
    x = torch.randn(5, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(m, generator=g).to(torch.bfloat16) if with_bias else None
    product = SlicedProduct(tiled.encode(w), slice_bytes=2 * k * slice_rows)
    assert len(product.parts) == -(-(-(-m // 16)) // max(1, slice_rows // 16))
    y = product(x, bias)
    ref = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert y.shape == (5, m) and y.is_contiguous()
    assert torch.allclose(y.float(), ref, rtol=2 ** -7, atol=1e-3 * float(ref.abs().max()))
    assert torch.equal(y, SlicedProduct(tiled.encode(w), slice_bytes=2 * k * slice_rows)(x, bias))  # deterministic
