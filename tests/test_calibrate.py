"""calibrate / exponent_histogram / choose_exponents, and the shipped KV sample they are used on."""
import importlib
import sys

import ml_dtypes
import numpy as np
import pytest

from kvzip.calibrate import calibrate, choose_exponents, exponent_histogram
from kvzip.codebook import Codebook
from kvzip.data import SAMPLE_KINDS, load_sample, sample_metadata
from kvzip.formats import FORMATS

# `kvzip.calibrate` the attribute is the function kvzip exports; the module is in sys.modules.
calmod = importlib.import_module("kvzip.calibrate")

NP_DTYPE = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32,
            "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}


def values_with_exponents(fmt, counts, seed=0):
    """Float values of ``fmt`` whose exponents occur exactly ``counts[e]`` times, shuffled,
    with random signs and mantissas."""
    f = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    exps = np.repeat(np.array(list(counts), dtype=np.uint64), list(counts.values()))
    n = exps.size
    sign = rng.integers(0, 2, n, dtype=np.uint64)
    mant = rng.integers(0, 1 << f.mant_bits, n, dtype=np.uint64)
    bits = (sign << (f.width - 1)) | (exps << f.mant_bits) | mant
    return rng.permutation(bits.astype(f.uint_dtype)).view(NP_DTYPE[fmt])


# Exponents with distinct counts, in no particular order; 20 of them.
KNOWN = {e: 1000 - 37 * i for i, e in enumerate([127, 126, 128, 125, 3, 129, 124, 200, 123, 130,
                                                  122, 131, 121, 60, 120, 132, 119, 133, 118, 0])}
KNOWN_TOP = sorted(KNOWN, key=lambda e: -KNOWN[e])


# ---- exponent_histogram ----------------------------------------------------------------------

@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_histogram_matches_brute_force(fmt, monkeypatch):
    monkeypatch.setattr(calmod, "_CHUNK", 1000)  # cross chunk boundaries on a small input
    f = FORMATS[fmt]
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 1 << f.width, 12_345, dtype=np.uint64).astype(f.uint_dtype)
    want = np.bincount((bits.astype(np.int64) >> f.mant_bits) & ((1 << f.exp_bits) - 1),
                       minlength=1 << f.exp_bits)
    for a in (bits, bits.view(NP_DTYPE[fmt]), bits.view(bits.dtype.str.replace("u", "i"))):
        h = exponent_histogram(a, fmt)
        assert h.dtype == np.int64 and h.tolist() == want.tolist()
    # Non-contiguous and multi-dimensional input.
    grid = bits[:12_000].reshape(120, 100)[:, ::3]
    want_sub = np.bincount((grid.astype(np.int64).ravel() >> f.mant_bits) & ((1 << f.exp_bits) - 1),
                           minlength=1 << f.exp_bits)
    assert exponent_histogram(grid, fmt).tolist() == want_sub.tolist()


def test_histogram_rejects_wrong_dtype():
    with pytest.raises(ValueError, match="bf16"):
        exponent_histogram(np.zeros(4, np.float32), "bf16")
    with pytest.raises(ValueError, match="16-bit"):
        exponent_histogram(np.zeros(4, np.uint8), "bf16")


# ---- the choice ---------------------------------------------------------------------------------

def test_exact_top16_and_order():
    cb = calibrate(values_with_exponents("bf16", KNOWN), always_include=())
    assert cb.exponents == tuple(KNOWN_TOP[:16])
    total = sum(KNOWN.values())
    assert cb.coverage == pytest.approx(sum(KNOWN[e] for e in KNOWN_TOP[:16]) / total)


def test_ties_go_to_the_lower_exponent():
    counts = {e: 10 for e in range(140, 100, -1)}  # 40 exponents, all tied
    assert calibrate(values_with_exponents("bf16", counts), always_include=()).exponents == tuple(range(101, 117))


def test_always_include_zero_by_default():
    cb = calibrate(values_with_exponents("bf16", KNOWN))
    # Exponent 0 is 20th by count: it displaces the 16th and, being least frequent, gets code 15.
    assert cb.exponents == tuple(KNOWN_TOP[:15]) + (0,)
    # Exponent 0 among the 16 most frequent already: nothing changes.
    counts = {**KNOWN, 0: 999}
    assert calibrate(values_with_exponents("bf16", counts)).exponents == \
        calibrate(values_with_exponents("bf16", counts), always_include=()).exponents
    # Exponent 0 never seen: still included.
    no_zero = {e: c for e, c in KNOWN.items() if e != 0}
    assert calibrate(values_with_exponents("bf16", no_zero)).exponents[-1] == 0


def test_always_include_several():
    cb = calibrate(values_with_exponents("bf16", KNOWN), always_include=(255, 0, 133))
    # The three lowest-ranked chosen ones make room; the required ones sit by their own rank.
    assert set(cb.exponents) == set(KNOWN_TOP[:13]) | {255, 0, 133}
    assert cb.exponents[:13] == tuple(KNOWN_TOP[:13])
    assert cb.exponents[13:] == (133, 0, 255)  # 133 seen more than 0; 255 never seen
    assert cb.provenance["always_include"] == [255, 0, 133]


@pytest.mark.parametrize("bad", [(256,), (-1,), (1.0,), (True,), tuple(range(17))])
def test_always_include_invalid(bad):
    with pytest.raises(ValueError, match="always_include"):
        calibrate(values_with_exponents("bf16", KNOWN), always_include=bad)


def test_fill_when_fewer_than_16_exponents_occur():
    counts = {120: 50, 121: 30, 130: 5}
    # Unseen exponents follow, nearest to the most frequent (120) first, ties lower.
    fill = [119, 118, 122, 117, 123, 116, 124, 115, 125, 114, 126, 113, 127]
    cb = calibrate(values_with_exponents("bf16", counts), always_include=())
    assert cb.exponents == (120, 121, 130, *fill)
    assert cb.coverage == 1.0
    assert calibrate(values_with_exponents("bf16", counts)).exponents == (120, 121, 130, *fill[:-1], 0)


def test_e4m3_fill_is_a_permutation():
    cb = calibrate(values_with_exponents("e4m3", {7: 100, 8: 50, 6: 10}))
    assert sorted(cb.exponents) == list(range(16))  # E4M3 has exactly 16 exponents
    assert cb.exponents == (7, 8, 6, 5, 9, 4, 10, 3, 11, 2, 12, 1, 13, 0, 14, 15)
    assert cb.format.name == "e4m3" and cb.coverage == 1.0


def test_choose_exponents_validates_histogram():
    with pytest.raises(ValueError, match="histogram"):
        choose_exponents(np.ones(10))
    assert choose_exponents(np.arange(16)[::-1], always_include=()) == tuple(range(16))


# ---- inputs -------------------------------------------------------------------------------------

def test_raw_bits_need_format():
    bits = values_with_exponents("bf16", KNOWN).view(np.uint16)
    with pytest.raises(ValueError, match="format="):
        calibrate(bits)
    assert calibrate(bits, format="bf16") == calibrate(bits.view(ml_dtypes.bfloat16))
    assert calibrate(bits.view(np.int16), format="bfloat16") == calibrate(bits, format="bf16")
    with pytest.raises(ValueError, match="do not fit e5m2"):
        calibrate(bits, format="e5m2")


def test_one_format_only():
    a = values_with_exponents("bf16", KNOWN)
    with pytest.raises(ValueError, match="one format"):
        calibrate([a, np.ones(4, np.float16)])
    with pytest.raises(ValueError, match="format=fp16"):
        calibrate(a, format="fp16")
    with pytest.raises(ValueError, match="float64"):
        calibrate(np.ones(4))


def test_empty_and_wrong_types():
    with pytest.raises(ValueError, match="no values"):
        calibrate([])
    with pytest.raises(ValueError, match="no values"):
        calibrate(np.zeros(0, ml_dtypes.bfloat16))
    with pytest.raises(TypeError):
        calibrate(3.5)
    with pytest.raises(ValueError, match=".safetensors"):
        calibrate("weights.npy")


def test_iterables_mappings_generators_accumulate():
    a = values_with_exponents("bf16", KNOWN, seed=1)
    halves = [a[: a.size // 2], a[a.size // 2:]]
    whole = calibrate(a)
    for samples in (halves, tuple(halves), (h for h in halves), {"x": halves[0], "y": [halves[1]]}):
        cb = calibrate(samples)
        assert cb == whole and cb.coverage == whole.coverage
        assert cb.provenance["values"] == a.size and cb.provenance["tensors"] == 2


@pytest.mark.parametrize("fmt, tdtype", [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"),
                                         ("e5m2", "float8_e5m2"), ("e4m3", "float8_e4m3fn")])
def test_torch_tensors(fmt, tdtype):
    torch = pytest.importorskip("torch")
    a = values_with_exponents(fmt, {e: c for e, c in KNOWN.items() if e < 1 << FORMATS[fmt].exp_bits})
    # The same bits as a torch tensor (torch.from_numpy refuses ml_dtypes, so cross as ints).
    as_int = {1: np.uint8, 2: np.int16, 4: np.int32}[a.dtype.itemsize]
    t = torch.from_numpy(a.view(as_int).copy()).view(getattr(torch, tdtype))
    assert calibrate(t) == calibrate(a)
    # Non-contiguous 2-D torch input counts the same multiset of values.
    t2 = t[: (t.numel() // 4) * 4].reshape(-1, 4).T
    assert not t2.is_contiguous()
    assert calibrate(t2).provenance["exponent_histogram"] == \
        calibrate(a[: t2.numel()]).provenance["exponent_histogram"]


def test_torch_bf16_real_values():
    torch = pytest.importorskip("torch")
    t = torch.randn(3, 100, 64).to(torch.bfloat16)
    t[0, :5] = 0
    cb = calibrate([t, t * 1000])
    as_numpy = [u.float().numpy().astype(ml_dtypes.bfloat16) for u in (t, t * 1000)]
    assert cb == calibrate(as_numpy) and cb.format.name == "bf16" and 0 in cb.exponents


# ---- .safetensors -------------------------------------------------------------------------------

def test_safetensors_file(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    a = values_with_exponents("bf16", KNOWN, seed=2).reshape(-1, 2)
    b = values_with_exponents("bf16", {126: 500, 127: 300}, seed=3)
    path = tmp_path / "kv.safetensors"
    st.save_file({"layer00.k": a, "layer00.v": b}, str(path))
    cb = calibrate(path, name="mine")
    assert cb == calibrate([a, b]) and cb.name == "mine"
    assert cb.provenance["sources"] == ["kv.safetensors"]
    assert cb.provenance["tensors"] == 2 and cb.provenance["values"] == a.size + b.size
    assert calibrate(str(path)) == cb
    assert calibrate([path, path]).provenance["values"] == 2 * (a.size + b.size)


def test_safetensors_fp8_and_mixed_files(tmp_path):
    torch = pytest.importorskip("torch")
    save_file = pytest.importorskip("safetensors.torch").save_file

    q = torch.linspace(-3, 3, 999).to(torch.float8_e5m2)
    save_file({"q": q, "r": q[:10].clone()}, str(tmp_path / "fp8.safetensors"))
    cb = calibrate(tmp_path / "fp8.safetensors")
    assert cb == calibrate([q, q[:10]]) and cb.format.name == "e5m2"

    save_file({"a": torch.ones(4, dtype=torch.bfloat16), "b": torch.ones(4)}, str(tmp_path / "mixed.safetensors"))
    with pytest.raises(ValueError, match="one format"):
        calibrate(tmp_path / "mixed.safetensors")


def test_safetensors_missing_gives_clear_import_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "safetensors", None)  # makes `import safetensors` fail
    with pytest.raises(ImportError, match="pip install safetensors"):
        calibrate(tmp_path / "kv.safetensors")


# ---- provenance and real data --------------------------------------------------------------------

def test_provenance(monkeypatch):
    import kvzip

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "86400")
    cb = calibrate(values_with_exponents("bf16", KNOWN), name="n", provenance={"model": "toy", "values": -1})
    p = cb.provenance
    assert p["date"] == "1970-01-02"
    assert p["kvzip_version"] == kvzip.__version__
    assert p["model"] == "toy" and p["values"] == -1  # caller's entries win
    assert p["sources"] == ["in-memory tensors"]
    assert p["exponent_histogram"] == {str(e): c for e, c in sorted(KNOWN.items())}
    assert Codebook.from_json(cb.to_json()).to_dict() == cb.to_dict()


def test_real_kv_coverage():
    prose = load_sample("prose")
    cb = calibrate(prose)
    hist = sum(exponent_histogram(x, "bf16") for x in prose.values())
    assert cb.coverage == pytest.approx(cb.coverage_of(hist))
    assert cb.coverage > 0.998  # BF16 KV: the Top-16 covers > 99.8 % (DESIGN.md)
    code_hist = sum(exponent_histogram(x, "bf16") for x in load_sample("code").values())
    assert cb.coverage_of(code_hist) > 0.998  # and carries over to another kind of text
    assert Codebook.default_for("bf16").coverage_of(code_hist) > 0.998


def test_calibrate_is_fast_enough_for_big_inputs():
    # 16M values: a few hundred ms with the chunked bincount; generous bound against slow CI.
    import time

    bits = np.random.default_rng(0).integers(0, 1 << 16, 1 << 24, dtype=np.uint16)
    t0 = time.perf_counter()
    calibrate(bits, format="bf16")
    assert time.perf_counter() - t0 < 3.0


# ---- the shipped sample --------------------------------------------------------------------------

def test_load_sample():
    all_ = load_sample()
    meta = sample_metadata()
    assert "SmolLM2" in meta["model"]
    for kind in SAMPLE_KINDS:
        part = load_sample(kind)
        assert part and all(k.startswith(kind + "/") for k in part)
        assert set(part) <= set(all_)
        start, stop = meta["tokens"][kind]
        for k, x in part.items():
            assert x.dtype == ml_dtypes.bfloat16 and x.shape == (3, stop - start, 64)
            assert np.array_equal(x.view(np.uint16), all_[k].view(np.uint16))
    assert len(all_) == sum(len(load_sample(k)) for k in SAMPLE_KINDS)
    assert {"prose/layer00.k", "prose/layer00.v", "html/layer29.v"} <= set(all_)
    with pytest.raises(ValueError, match="prose"):
        load_sample("poetry")
