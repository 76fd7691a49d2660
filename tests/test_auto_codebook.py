"""kvzip.auto_codebook: the sample it reads (against an independent reading of its docstring) and
the codebooks it chooses (against the tensor's own full-histogram Top-16, on the shipped KV
sample and its variants, every format, and a layout built to alias a fixed sampling)."""
import numpy as np
import pytest

import kvzip
from kvzip import auto_codebook as auto
from kvzip import testing as kt
from kvzip.calibrate import choose_exponents, exponent_histogram
from kvzip.codebook import Codebook
from kvzip.data import load_sample
from kvzip.formats import FORMATS

GAP = 0.002  # the auto codebook's ratio is within 0.2 % of the own codebook's


# ---- the sample: an independent reading of the module docstring ------------------------------

def doc_starts(n):
    """run starts as the docstring states them, in plain Python ints."""
    k = min(8, max(0, n.bit_length() - 20))
    S = 256 << k
    M = (S - 256) // 16 + 1
    return [i * S + 16 * ((((i * 0x9E3779B9) % 2**32) * M) >> 32) for i in range(-(-n // S))]


def doc_indices(n):
    return sorted({j for s in doc_starts(n) for j in range(s, min(s + 256, n))})


@pytest.mark.parametrize("n", [0, 1, 2, 15, 16, 255, 256, 257, 511, 512, 513, 1000, (1 << 20) - 1])
def test_small_tensors_are_read_whole(n):
    plan = auto.sample_plan(n)
    assert (plan.run_length, plan.block, plan.offsets) == (256, 256, 1)
    assert plan.blocks == -(-n // 256)
    assert auto.run_starts(n).tolist() == [256 * i for i in range(plan.blocks)]
    np.testing.assert_array_equal(auto.sample_indices(n), np.arange(n))


@pytest.mark.parametrize("n", [1 << 20, (1 << 20) + 1, (1 << 20) + 255, (1 << 20) + 256, (1 << 20) + 257,
                               (1 << 21) - 1, (1 << 21) + 300, 3 << 21, (1 << 23) + 4097, (1 << 24) - 1, 1 << 24,
                               (1 << 24) + 8191, (1 << 24) + 8193, (1 << 27) + 65537])
def test_sample_matches_the_docstring(n):
    assert auto.run_starts(n).tolist() == doc_starts(n)
    np.testing.assert_array_equal(auto.sample_indices(n), doc_indices(n))


@pytest.mark.parametrize("n, block, fraction", [
    ((1 << 20) - 1, 256, 1), (1 << 20, 512, 1 / 2), ((1 << 21) - 1, 512, 1 / 2), (1 << 21, 1024, 1 / 4),
    (1 << 22, 2048, 1 / 8), (1 << 23, 4096, 1 / 16), ((1 << 24) - 1, 4096, 1 / 16), (1 << 24, 8192, 1 / 32),
    (1 << 26, 32768, 1 / 128), ((1 << 27) - 1, 32768, 1 / 128), (1 << 27, 65536, 1 / 256),
    (1 << 29, 65536, 1 / 256)])
def test_the_ladder(n, block, fraction):
    plan = auto.sample_plan(n)
    assert plan.block == block
    read = auto.sample_indices(n).size
    assert abs(read / n - fraction) <= 256 / n  # up to one cut run off
    assert read <= 1 << 20 if n < 1 << 28 else read <= 256 * -(-n // 65536)
    if fraction < 1:
        assert plan.blocks >= 2048 and read >= 1 << 19


@pytest.mark.parametrize("n", [(1 << 20) + 1, (1 << 24) + 8193, (1 << 34) + 12345])
def test_runs_are_aligned_inside_their_blocks(n):
    """Huge n through the index function only: every run starts at a multiple of 16 and ends
    inside its block; the offsets reach every one of their M places (no fixed phase)."""
    plan = auto.sample_plan(n)
    starts = auto.run_starts(n)
    assert starts.size == plan.blocks == -(-n // plan.block)
    offset = starts - np.arange(plan.blocks, dtype=np.int64) * plan.block
    assert (offset % 16 == 0).all() and offset.min() >= 0 and (offset + 256 <= plan.block).all()
    if plan.blocks >= 8 * plan.offsets:
        assert np.unique(offset).size == plan.offsets
        counts = np.bincount(offset // 16, minlength=plan.offsets)
        assert counts.max() - counts.min() <= 0.02 * plan.blocks / plan.offsets + 4  # low discrepancy
    if n == (1 << 34) + 12345:
        assert plan.block == 65536 and starts[-1] == (plan.blocks - 1) * 65536 + offset[-1]


def test_sample_plan_rejects_bad_sizes():
    for bad in (-1, 2.0, True, "5"):
        with pytest.raises(ValueError, match="non-negative int"):
            auto.sample_plan(bad)


# ---- the histogram ---------------------------------------------------------------------------

def find_cut_tail(lo):
    """An n >= lo whose last run is cut at n (starts before n, would end after it)."""
    n = lo
    while True:
        last = auto.run_starts(n)[-1]
        if last < n < last + 256:
            return n
        n += 97


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_sample_histogram_counts_exactly_the_sampled_values(fmt):
    f = FORMATS[fmt]
    for n in (0, 300, (1 << 20) + 5, find_cut_tail(1 << 21)):
        bits = kt._rng_bits(n, f, n)
        expect = exponent_histogram(bits[auto.sample_indices(n)], f)
        np.testing.assert_array_equal(auto.sample_histogram(bits, f), expect, err_msg=f"{fmt} n={n}")


# ---- the codebook ----------------------------------------------------------------------------

def own(bits, fmt="bf16"):
    return Codebook(choose_exponents(exponent_histogram(bits, fmt)), fmt)


def ratio(bits, cb, fmt="bf16"):
    blob = kvzip.compress(bits, codebook=cb, dtype=fmt)
    np.testing.assert_array_equal(np.asarray(kvzip.decompress(blob)).view(bits.dtype).reshape(-1), bits.reshape(-1))
    return kvzip.info(blob)["ratio"]


@pytest.fixture(scope="module")
def sample_layers():
    """The shipped sample's layer tensors as uint16 bits [3, tokens, 64], in key order."""
    return [(k, v.view(np.uint16)) for k, v in sorted(load_sample().items())]


def variant_concat(layers, name):
    return np.concatenate([kt.kv_variant(b, name, i % 30, seed=i).reshape(-1) for i, (_, b) in enumerate(layers)])


def test_layer_tensors_get_their_own_codebook(sample_layers):
    """Layer tensors (under 2^20 values) are read whole: the auto codebook is the own one."""
    for i, (key, b) in enumerate(sample_layers[::7]):
        for name in kt.KV_VARIANTS:
            v = kt.kv_variant(b, name, i, seed=i).reshape(-1)
            assert auto.auto_codebook(v, "bf16") == own(v), (key, name)


@pytest.mark.parametrize("name", kt.KV_VARIANTS)
def test_sampled_codebook_ratio_within_gap_of_own(sample_layers, name):
    """The sample's codebook compresses as well as the whole tensor's (within 0.2 %), on the
    shipped sample's layers concatenated (2.9M values: 1/4 read) and tiled to 2^24 + 4097
    (1/32 read), as stored and token-major."""
    flat = variant_concat(sample_layers, name)
    tokmaj = np.concatenate([kt.kv_variant(b, name, i % 30, seed=i).transpose(1, 0, 2).reshape(-1)
                             for i, (_, b) in enumerate(sample_layers)])
    for label, x in (("concat", flat), ("tiled", np.resize(flat, (1 << 24) + 4097)), ("token-major", tokmaj)):
        assert auto.sample_plan(x.size).block > 256, label  # the sampled regime
        cb = auto.auto_codebook(x, "bf16")
        assert 0 in cb.exponents
        r_auto, r_own = ratio(x, cb), ratio(x, own(x))
        assert r_auto >= (1 - GAP) * r_own, f"{name} {label}: auto {r_auto:.5f} vs own {r_own:.5f}"


def token_scaled(layers):
    """Token t times 2**(t % 8 - 4): a structure of period 512 values, which divides every block."""
    out = []
    for _, b in layers:
        t = np.arange(b.shape[1])[:, None]
        out.append(kt.scale_pow2(b, np.broadcast_to(t % 8 - 4, b.shape)).reshape(-1))
    return np.resize(np.concatenate(out), (1 << 24) + 4097)


def test_the_varying_offset_defeats_a_block_period(sample_layers, monkeypatch):
    """Runs at a fixed place in their block see tokens 0-3 of every 8 and choose a codebook much
    worse than the tensor's own; the rule's varying offsets see every token.  (WEYL = 0 makes
    every offset 0: the negative control shows the check can fail.)"""
    x = token_scaled(sample_layers)
    r_own = ratio(x, own(x))
    assert ratio(x, auto.auto_codebook(x, "bf16")) >= (1 - GAP) * r_own
    monkeypatch.setattr(auto, "WEYL", 0)
    assert (auto.run_starts(x.size) % auto.sample_plan(x.size).block == 0).all()
    assert ratio(x, auto.auto_codebook(x, "bf16")) < 0.95 * r_own


def test_a_strided_single_value_sample_would_fail_the_same_check(sample_layers):
    """The check above is strict enough to catch the head-dim aliasing of NOTES a1: a Top-16
    from every 64th value (one channel per head) of per-channel-scaled KV falls well short."""
    x = np.resize(variant_concat(sample_layers, "chan-scaled"), (1 << 24) + 4097)
    strided = Codebook(choose_exponents(exponent_histogram(x[::64], "bf16")), "bf16")
    assert ratio(x, strided) < (1 - GAP) * ratio(x, own(x))


def test_deterministic_and_shape_blind(sample_layers):
    x = np.resize(variant_concat(sample_layers, "zeros-5%"), (1 << 22) + 33)
    a = auto.auto_codebook(x, "bf16")
    b = auto.auto_codebook(x.copy().reshape(-1, 1), "bf16")
    c = auto.auto_codebook(x.view(np.int16), "bf16")
    assert a == b == c and a.exponents == b.exponents and a.name is None
    assert a.coverage == b.coverage and 0.99 < a.coverage <= 1


def test_exponent_zero_always_included_and_codes_by_rank():
    """20 exponents, none of them 0, with distinct counts: the 15 most frequent by rank, then 0."""
    rng = np.random.default_rng(3)
    exps = np.arange(100, 120)
    counts = (2000 - 90 * np.arange(20)) * 100
    e = rng.permutation(np.repeat(exps, counts)).astype(np.uint16)
    bits = (e << 7) | rng.integers(0, 1 << 7, e.size, dtype=np.uint16)
    assert bits.size > 1 << 21  # sampled
    cb = auto.auto_codebook(bits, "bf16")
    assert cb.exponents == tuple(range(100, 115)) + (0,)


def test_ties_go_to_the_lower_exponent_and_unseen_to_the_mode():
    """Four exponents seen 10 times each (mode 125); then the unseen by distance to 125, ties
    lower (124 126 | 123 | 122 128 | 121 129 | 120 | 119 | 118 132 | 117 133); 0 displaces the 16th."""
    bits = np.repeat(np.array([130, 125, 127, 131], np.uint16) << 7, 10)
    assert auto.auto_codebook(bits, "bf16").exponents == (
        125, 127, 130, 131, 124, 126, 123, 122, 128, 121, 129, 120, 119, 118, 132, 0)


def test_empty_and_tiny_tensors():
    assert auto.auto_codebook(np.zeros(0, np.uint16), "bf16").exponents == tuple(range(16))
    assert auto.auto_codebook(np.array([0x3F80], np.uint16), "bf16").exponents[:3] == (127, 126, 128)
    assert auto.auto_codebook(np.zeros(0, np.uint16), "bf16").coverage == 1.0


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_format(fmt):
    f = FORMATS[fmt]
    for n in (1000, (1 << 24) + 77):
        bits = kt.kv_like_bits(f, n, escape_rate=0.002, seed=n)
        cb = auto.auto_codebook(bits, f)
        assert cb.format is f and 0 in cb.exponents
        if fmt == "e4m3":  # 16 exponents: all of them, in the sample's rank order
            assert sorted(cb.exponents) == list(range(16))
            hist = auto.sample_histogram(bits, f)
            assert cb.exponents == choose_exponents(hist)
            assert list(hist[list(cb.exponents)]) == sorted(hist, reverse=True)
        if n > 1 << 20:
            assert ratio(bits, cb, fmt) >= (1 - GAP) * ratio(bits, own(bits, fmt), fmt), fmt


def test_rejects_floats_and_wrong_widths():
    with pytest.raises(ValueError, match="16-bit integer bits of bf16"):
        auto.auto_codebook(np.zeros(4, np.float16), "bf16")
    with pytest.raises(ValueError, match="8-bit integer bits of e4m3"):
        auto.auto_codebook(np.zeros(4, np.uint16), "e4m3")
