"""The tiled layout (kvzip/weights/tiled.py) and ZipLinear on the CPU: every bit pattern and shape
round-trips, the blocks hold the documented lane order, a forged layout is refused before use,
and ZipLinear behaves as the Linear it replaces."""
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from conftest import examples

import kvzip.weights as kw
from kvzip import FormatError
from kvzip.weights import tiled

REAL = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "weights" / "minilm-l6_weights_bf16.safetensors"


def bf16(bits):
    return torch.as_tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def same_bits(a, b):
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@settings(max_examples=examples(40))
@given(m=st.integers(1, 70), k=st.integers(1, 200), seed=st.integers(0, 2 ** 31), narrow=st.booleans())
def test_any_matrix_round_trips(m, k, seed, narrow):
    g = torch.Generator().manual_seed(seed)
    if narrow:  # trained-weight-like exponents, a few outliers
        w = (torch.randn(m, k, generator=g) * 0.02 * torch.exp(torch.randn(m, 1, generator=g))).to(torch.bfloat16)
    else:  # every bit pattern: NaNs, infinities, subnormals, -0
        w = bf16(torch.randint(0, 65536, (m, k), generator=g))
    tw = tiled.encode(w).validate()
    assert same_bits(tiled.decode(tw), w)
    assert tw.codebook[0] == 0


def test_block_order_is_the_fragment_order():
    # weight (r, c) of a 16 x 64 block holds code/byte values that name it; decode the lanes by
    # hand from the documented offsets and compare with the matrix
    m, k = 16, 64
    exps = torch.tensor([0] + list(range(100, 115)))  # codes 0-15
    rows, cols = torch.meshgrid(torch.arange(m), torch.arange(k), indexing="ij")
    code = (rows * 64 + cols) % 16
    sm = (rows * 64 + cols) % 256
    bits = ((sm & 0x80) << 8) | (exps[code] << 7) | (sm & 0x7F)
    tw = tiled.encode(bf16(bits))
    assert tw.escapes == 0 and tw.codebook.tolist() == exps.tolist()
    block = tw.blocks[0, 0].tolist()
    for lane in range(32):
        g, q = lane // 4, lane % 4
        for s in range(4):
            for j in range(8):
                t = 8 * s + j
                r, c = g + 8 * ((j >> 1) & 1), 16 * q + 4 * s + 2 * (j >> 2) + (j & 1)
                nibble = (block[16 * lane + t // 2] >> (4 * (t % 2))) & 15
                byte = block[512 + 512 * (s // 2) + 16 * lane + 8 * (s % 2) + j]
                assert nibble == code[r, c] and byte == sm[r, c], (lane, s, j)


def test_escapes_decode_as_zero_in_the_blocks_and_are_listed_in_order():
    w = torch.full((32, 64), 1.0, dtype=torch.bfloat16)
    w[3, 5] = 2.0 ** 100
    w[17, 1] = -(2.0 ** -100)
    w[1, 63] = float("inf")
    tw = tiled.encode(w)
    # 1.0 plus only three other exponents: nothing escapes
    assert tw.escapes == 0
    many = torch.tensor([2.0 ** e for e in range(-60, 60, 2)])  # 60 exponents: 44 and more escape
    w = many.repeat(32 * 64 // many.numel() + 1)[:32 * 64].reshape(32, 64).to(torch.bfloat16)
    tw = tiled.encode(w)
    assert tw.escapes > 0
    assert same_bits(tiled.decode(tw), w)
    off = tw.esc_off.tolist()
    for b in range(2):
        pos = tw.esc_pos[off[b]:off[b + 1]].tolist()
        assert pos == sorted(pos)


@pytest.mark.parametrize("forge", ["codebook0", "offsets", "position", "order", "blocks", "lengths"])
def test_forged_layouts_are_refused(forge):
    many = torch.tensor([2.0 ** e for e in range(-60, 60, 2)])
    w = many.repeat(40).reshape(48, 50)[:, :50].to(torch.bfloat16)
    tw = tiled.encode(w)
    arrays = dict(zip(("blocks", "codebook", "esc_off", "esc_pos", "esc_val"), (a.clone() for a in tw.arrays())))
    if forge == "codebook0":
        arrays["codebook"][0] = 7
    elif forge == "offsets":
        arrays["esc_off"][1] = arrays["esc_off"][-1] + 1
    elif forge == "position":
        arrays["esc_pos"][0] = (50 << 4)  # column 50 of a 50-column matrix
    elif forge == "order":
        arrays["esc_pos"][:2] = arrays["esc_pos"][:2].flip(0)
    elif forge == "blocks":
        arrays["blocks"] = arrays["blocks"][:, :, :-1]
    else:
        arrays["esc_val"] = arrays["esc_val"][:-1]
    with pytest.raises(FormatError):
        tiled.TiledWeight(tw.shape, **arrays).validate()


def test_encode_refuses_what_it_cannot_hold():
    for bad in [torch.zeros(4, 4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(0, 4, dtype=torch.bfloat16)]:
        with pytest.raises(ValueError):
            tiled.encode(bad)


def linear(m, k, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(k, m, bias=bias).to(torch.bfloat16)


def test_zip_linear_is_the_linear_on_the_cpu():
    lin = linear(70, 130)
    zl = kw.ZipLinear.from_linear(lin)
    assert same_bits(zl.decompress_weight(), lin.weight)
    x = torch.randn(2, 3, 130).to(torch.bfloat16)
    assert same_bits(zl(x), lin(x))  # the CPU path decodes W and multiplies as nn.Linear does
    assert zl.in_features == 130 and zl.out_features == 70


def test_zip_linear_refuses_wrong_input():
    zl = kw.ZipLinear.from_linear(linear(8, 16))
    with pytest.raises(TypeError):
        zl(torch.randn(2, 16))
    with pytest.raises(ValueError):
        zl(torch.randn(2, 15).to(torch.bfloat16))
    with pytest.raises(ValueError):
        kw.ZipLinear.from_linear(nn.Linear(16, 8))  # fp32
    with pytest.raises(TypeError):
        kw.ZipLinear.from_linear(nn.Conv1d(1, 1, 1))
    # the custom op itself, called directly: a clear error before any kernel, not a launch on CPU memory
    arrays = (zl.blocks, zl.codebook, zl.esc_off, zl.esc_pos, zl.esc_val, None, zl.tickets, 8, 16)
    for x in (torch.randn(2, 16).to(torch.bfloat16), torch.randn(2, 16), torch.randn(2, 3, 16).to(torch.bfloat16)):
        with pytest.raises(ValueError, match="tiled_linear takes x"):
            kw.tiled_linear(x, *arrays)


def test_state_dict_round_trips_and_is_validated():
    a, b = kw.ZipLinear.from_linear(linear(40, 64, seed=1)), kw.ZipLinear.from_linear(linear(40, 64, seed=2))
    b.load_state_dict(a.state_dict())
    assert same_bits(b.decompress_weight(), a.decompress_weight())
    sd = a.state_dict()
    sd["esc_off"] = sd["esc_off"].clone()
    sd["esc_off"][-1] += 5
    with pytest.raises(FormatError):
        b.load_state_dict(sd)


def test_compress_model_replaces_what_pays_and_keeps_tied_weights():
    torch.manual_seed(0)
    emb = nn.Embedding(100, 64).to(torch.bfloat16)
    head = nn.Linear(64, 100, bias=False).to(torch.bfloat16)
    head.weight = emb.weight  # tied
    model = nn.ModuleDict({"emb": emb, "a": linear(256, 64), "tiny": linear(8, 64), "fp32": nn.Linear(64, 64),
                           "head": head})
    before = {n: m.weight.detach().clone() for n, m in model.items() if isinstance(m, nn.Linear)}
    kw.compress_model(model, progress=False)
    assert isinstance(model["a"], kw.ZipLinear)
    assert isinstance(model["tiny"], nn.Linear)  # 8 rows padded to 16: the layout would be larger
    assert isinstance(model["fp32"], nn.Linear) and isinstance(model["head"], nn.Linear)
    assert same_bits(model["a"].decompress_weight(), before["a"])


@pytest.mark.skipif(not REAL.exists(), reason="the shared real weights are not here")
def test_real_weights_ratio():
    from safetensors.torch import load_file

    raw = stored = 0
    for name, w in load_file(REAL).items():
        tw = tiled.encode(w)
        assert same_bits(tiled.decode(tw), w), name
        raw += w.numel() * 2
        stored += tw.nbytes
    assert raw / stored > 1.331  # docs/weights.md: 1.3314 pooled on MiniLM-L6's 38 matrices


@settings(max_examples=examples(30))
@given(m=st.integers(1, 90), k=st.integers(1, 150), seed=st.integers(0, 2 ** 31), data=st.data())
def test_a_band_slice_decodes_to_its_rows(m, k, seed, data):
    g = torch.Generator().manual_seed(seed)
    w = bf16(torch.randint(0, 65536, (m, k), generator=g))  # every bit pattern: escapes in most bands
    tw = tiled.encode(w)
    bands = -(-m // 16)
    first = data.draw(st.integers(0, bands - 1))
    end = data.draw(st.integers(first + 1, bands))
    part = tw.band_slice(first, end).validate()
    assert same_bits(tiled.decode(part), w[16 * first:16 * end])
    assert part.blocks.data_ptr() == tw.blocks[first].data_ptr()  # a view, not a copy


def test_band_slice_bounds():
    tw = tiled.encode(torch.zeros(40, 64, dtype=torch.bfloat16))
    for first, end in ((0, 0), (2, 4), (-1, 1), (1, 0)):
        with pytest.raises(ValueError, match="band slice"):
            tw.band_slice(first, end)


@pytest.mark.parametrize("resident", [1, 2, 3])
def test_wide_plan_covers_every_chunk_and_sizes_its_partials(monkeypatch, resident):
    """kvzip/gpu/weights.py's wide_plan on every Llama-3 shape and N from 33 to 1024 (the GPU's
    kernel facts stood in for): its splits cover the chunks exactly once (the last split may be
    short, never empty), there is one split where the tiles outnumber the bands (a ticket a
    band), and wide_partial_floats is the kernel's [tile][split][warp][16][8 NT] indexing."""
    from kvzip.gpu import weights as gw

    monkeypatch.setattr(gw, "kernel", lambda name, device: (None, gw._shared(name), resident))
    monkeypatch.setattr(gw, "multiprocessors", lambda device: 132)
    gw.wide_plan.cache_clear()
    try:
        for m, k in [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1024, 4096), (10240, 8192),
                     (8192, 8192), (57344, 8192), (8192, 28672), (16, 64), (136, 80)]:
            bands, chunks = gw.grid((m, k))
            for n in (33, 64, 65, 100, 128, 129, 256, 300, 1024):
                splits, per_split = gw.wide_plan((m, k), n, 0)
                assert (splits - 1) * per_split < chunks <= splits * per_split, (m, k, n, splits, per_split)
                bn = 8 * gw.wide_tiles(n)
                tiles = -(-bands // gw.WARPS) * -(-n // bn)
                assert splits == 1 or tiles <= bands, (m, k, n)
                floats = gw.wide_partial_floats((m, k), n, splits)
                assert floats == (0 if splits == 1 else tiles * splits * gw.WARPS * 16 * bn)
    finally:
        gw.wide_plan.cache_clear()
