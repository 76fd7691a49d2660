"""benchmarks/dfloat11_baseline.py's vectorised encoder writes the bytes of the dfloat11 package's own
encoder (the baseline's decoder is the package's kernel, so its input must be the package's
format exactly).  Skipped where dfloat11 (and its dahuffman) are not installed."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import dfloat11_baseline as df11  # noqa: E402

pytestmark = pytest.mark.skipif(df11.package_dir() is None or importlib.util.find_spec("dahuffman") is None,
                                reason="the dfloat11 package (and dahuffman) not installed")


def trained_like(n, seed, spread=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02 * torch.exp(spread * torch.randn(n, generator=g))).to(torch.bfloat16)


@pytest.mark.parametrize("n,seed,spread", [(100, 0, 1.0), (257, 1, 1.0), (5000, 2, 3.0), (30001, 3, 1.0), (64, 4, 0.1)])
@pytest.mark.parametrize("threads,bytes_per_thread", [(512, 8), (4, 4), (8, 4), (2, 8)])
def test_encoder_writes_the_packages_bytes(n, seed, spread, threads, bytes_per_thread):
    w = trained_like(n, seed, spread)
    ours = df11.encode(w, threads, bytes_per_thread)
    theirs = df11.reference_encode(w, threads, bytes_per_thread)
    for name in ("encoded", "sign_mantissa", "output_positions", "gaps"):
        assert torch.equal(ours[name], theirs[name]), name


def test_both_end_cases_of_the_stream():
    """A stream of whole bytes (no end-of-file code) and one that needs it: found among seeds."""
    seen = set()
    for seed in range(40):
        w = trained_like(300, seed)
        state = df11.encode(w, 4, 4)
        exponents = (w.view(torch.int16).to(torch.int32) >> 7) & 0xFF
        codec, _ = df11.code_table(df11.exponent_counts(exponents))
        total = sum(codec._table[int(e)][0] for e in exponents)  # the stream's bits before any end-of-file code
        seen.add(total % 8 == 0)
        assert torch.equal(state["encoded"], df11.reference_encode(w, 4, 4)["encoded"])
        if len(seen) == 2:
            return
    pytest.fail(f"only streams with whole bytes == {seen} in 40 seeds")


def test_shared_memory_and_sizes():
    w = trained_like(20000, 5)
    s = df11.encode(w)
    pos = s["output_positions"].view(torch.int32).to(torch.int64)
    assert s["shared_mem"] == 512 * 4 + 4 + 2 * int((pos[1:] - pos[:-1]).max())
    assert df11.nbytes(s) < 2 * w.numel()  # DFloat11 is smaller than BF16 on trained-like weights
    with pytest.raises(ValueError, match="bytes_per_thread"):
        df11.encode(w, 512, 2)
    with pytest.raises(ValueError, match="bfloat16"):
        df11.encode(w.float())
