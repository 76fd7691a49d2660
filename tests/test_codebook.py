"""Codebook: validation, lookup tables, JSON, shipped codebooks, resolve_codebook."""
import copy
import json
import pickle

import numpy as np
import pytest

from kvzip.codebook import ESCAPE, Codebook, resolve_codebook
from kvzip.formats import FORMATS, get_format

BF16_EXPS = list(range(120, 136))


def some_exponents(fmt):
    """16 distinct valid exponents for fmt, not in sorted order."""
    n = 1 << FORMATS[fmt].exp_bits
    return [(7 * i + 3) % n for i in range(16)] if n > 16 else list(range(15, -1, -1))


# ---- validation --------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_valid_codebook_every_format(fmt):
    exps = some_exponents(fmt)
    cb = Codebook(exps, fmt, name="x", coverage=0.5, provenance={"model": "m"})
    assert cb.format is FORMATS[fmt]
    assert cb.exponents == tuple(exps)
    assert (cb.name, cb.coverage, cb.provenance) == ("x", 0.5, {"model": "m"})


@pytest.mark.parametrize("exps, match", [
    (BF16_EXPS[:15], "exactly 16"),
    (BF16_EXPS + [1], "exactly 16"),
    ([], "exactly 16"),
    (BF16_EXPS[:15] + [120], r"distinct; repeated: \[120\]"),
    (BF16_EXPS[:15] + [256], "out of range"),
    (BF16_EXPS[:15] + [-1], "out of range"),
    (BF16_EXPS[:15] + [3.0], "must be ints"),
    (BF16_EXPS[:15] + ["3"], "must be ints"),
    (BF16_EXPS[:15] + [True], "must be ints"),
    (None, "sequence"),
])
def test_invalid_exponents(exps, match):
    with pytest.raises(ValueError, match=match):
        Codebook(exps, "bf16")


def test_range_depends_on_format():
    # 31 is a valid e5m2/fp16 exponent, 32 is not; bf16 accepts both.
    exps = list(range(16, 31)) + [31]
    Codebook(exps, "e5m2")
    with pytest.raises(ValueError, match=r"e5m2.*\[0, 31\]"):
        Codebook(exps[:15] + [32], "e5m2")
    with pytest.raises(ValueError, match="out of range"):
        Codebook(list(range(1, 17)), "e4m3")


def test_numpy_ints_accepted():
    cb = Codebook(np.arange(120, 136, dtype=np.int64), "bf16")
    assert all(type(e) is int for e in cb.exponents)


@pytest.mark.parametrize("kwargs, match", [
    ({"format": "int8"}, "unsupported float format"),
    ({"format": "bf16", "coverage": 1.5}, "coverage"),
    ({"format": "bf16", "coverage": -0.1}, "coverage"),
    ({"format": "bf16", "coverage": "high"}, "coverage"),
    ({"format": "bf16", "name": 3}, "name"),
    ({"format": "bf16", "provenance": [1]}, "provenance must be a dict"),
    ({"format": "bf16", "provenance": {"x": object()}}, "JSON-able"),
])
def test_invalid_metadata(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Codebook(BF16_EXPS, **kwargs)


def test_format_spellings():
    for spelling in ("bf16", "bfloat16", get_format("bf16")):
        assert Codebook(BF16_EXPS, spelling).format.name == "bf16"


def test_immutable_and_provenance_is_a_copy():
    cb = Codebook(BF16_EXPS, "bf16", provenance={"sources": ["a"]})
    with pytest.raises(AttributeError):
        cb.exponents = tuple(range(16))
    cb.provenance["sources"].append("b")
    assert cb.provenance == {"sources": ["a"]}


# ---- lookup tables ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_luts(fmt):
    exps = some_exponents(fmt)
    cb = Codebook(exps, fmt)
    enc, dec = cb.encode_lut(), cb.decode_lut()
    n = 1 << FORMATS[fmt].exp_bits
    assert enc.dtype == np.uint8 and enc.shape == (n,)
    assert dec.dtype == np.uint8 and dec.shape == (16,)
    assert dec.tolist() == exps
    assert enc[dec].tolist() == list(range(16))  # code -> exponent -> same code
    others = np.setdiff1d(np.arange(n), exps)
    assert (enc[others] == ESCAPE).all() and ESCAPE == 255
    assert int((enc == ESCAPE).sum()) == n - 16


def test_coverage_of():
    cb = Codebook(BF16_EXPS, "bf16")
    hist = np.zeros(256, np.int64)
    hist[120] = 90
    hist[10] = 10
    assert cb.coverage_of(hist) == pytest.approx(0.9)
    assert cb.coverage_of(np.zeros(256)) == 1.0
    with pytest.raises(ValueError, match="256"):
        cb.coverage_of(np.zeros(32))


# ---- JSON -----------------------------------------------------------------------------------------

def test_dict_and_json_round_trip(tmp_path):
    cb = Codebook(some_exponents("bf16"), "bf16", name="mine", coverage=0.99,
                  provenance={"sources": ["a.safetensors"], "values": 12})
    d = cb.to_dict()
    assert set(d) == {"name", "format", "exponents", "coverage", "provenance"}
    json.dumps(d)
    back = Codebook.from_dict(d)
    assert back == cb and back.to_dict() == d

    text = cb.to_json()
    assert Codebook.from_json(text).to_dict() == d
    path = tmp_path / "cb.json"
    assert cb.to_json(path) == path.read_text()
    assert Codebook.from_json(path).to_dict() == d
    assert Codebook.from_json(str(path)).to_dict() == d
    assert Codebook.from_json(text.encode()).to_dict() == d


def test_compact_dict_leaves_provenance_out():
    cb = Codebook(BF16_EXPS, "bf16", name="n", provenance={"big": list(range(100))})
    d = cb.to_dict(provenance=False)
    assert "provenance" not in d
    assert Codebook.from_dict(d) == cb


def _good_dict():
    return {"name": "n", "format": "bf16", "exponents": list(BF16_EXPS), "coverage": 0.9, "provenance": {}}


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.pop("format"), "lacks"),
    (lambda d: d.pop("exponents"), "lacks"),
    (lambda d: d.update(extra=1), "unknown codebook key"),
    (lambda d: d.update(format=16), "'format' must be a string"),
    (lambda d: d.update(format="int4"), "unsupported"),
    (lambda d: d.update(exponents="0123456789abcdef"), "must be a list"),
    (lambda d: d.update(exponents={"a": 1}), "must be a list"),
    (lambda d: d.update(exponents=BF16_EXPS[:15]), "exactly 16"),
    (lambda d: d.update(exponents=BF16_EXPS[:15] + [120]), "distinct"),
    (lambda d: d.update(exponents=BF16_EXPS[:15] + [300]), "out of range"),
    (lambda d: d.update(exponents=BF16_EXPS[:15] + [135.0]), "must be ints"),
    (lambda d: d.update(coverage=float("nan")), "coverage"),
    (lambda d: d.update(coverage=2), "coverage"),
    (lambda d: d.update(name=["n"]), "name"),
    (lambda d: d.update(provenance="x"), "provenance"),
])
def test_from_dict_validates(mutate, match):
    d = _good_dict()
    Codebook.from_dict(copy.deepcopy(d))
    mutate(d)
    with pytest.raises(ValueError, match=match):
        Codebook.from_dict(d)


def test_rejects_non_dicts_and_bad_json():
    with pytest.raises(ValueError, match="must be a dict"):
        Codebook.from_dict([])
    with pytest.raises(ValueError, match="not valid JSON"):
        Codebook.from_json('{"format": "bf16"')


# ---- shipped codebooks ----------------------------------------------------------------------------

def test_available_lists_every_default():
    names = Codebook.available()
    assert names == sorted(names)
    assert {f"{f}-kv" for f in FORMATS} <= set(names)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_shipped_defaults(fmt):
    cb = Codebook.default_for(fmt)
    assert cb.name == f"{fmt}-kv"
    assert cb.format is FORMATS[fmt]
    assert Codebook.load(f"{fmt}-kv") is cb  # cached
    assert Codebook.default_for(FORMATS[fmt].dtype_name) is cb
    assert 0 in cb.exponents  # calibrated with the default always_include=(0,)
    assert 0.99 < cb.coverage <= 1.0
    prov = cb.provenance
    assert prov["sources"] == ["smollm2-135m_prose_2048.safetensors"]
    assert prov["values"] > 10**7
    assert set(prov["held_out_coverage"]) == {"code", "html"}
    # The recorded histogram reproduces the recorded coverage.
    hist = np.zeros(1 << FORMATS[fmt].exp_bits, np.int64)
    for e, c in prov["exponent_histogram"].items():
        hist[int(e)] = c
    assert cb.coverage_of(hist) == pytest.approx(cb.coverage)
    # Codes are ordered most frequent first.
    counts = [hist[e] for e in cb.exponents]
    assert counts == sorted(counts, reverse=True)


def test_load_unknown_lists_names():
    with pytest.raises(ValueError, match="bf16-kv"):
        Codebook.load("no-such-codebook")
    with pytest.raises(ValueError, match="no shipped codebook"):
        Codebook.load("../pyproject")


# ---- identity ---------------------------------------------------------------------------------------

def test_eq_hash_repr_pickle():
    a = Codebook(BF16_EXPS, "bf16", name="a", coverage=0.5)
    b = Codebook(BF16_EXPS, "bfloat16", name="b")
    assert a == b and hash(a) == hash(b)  # identity is (format, exponents)
    assert a != Codebook(BF16_EXPS[::-1], "bf16")  # order is the code assignment
    assert a != Codebook(BF16_EXPS, "fp32")
    assert len({a, b}) == 1
    r = repr(a)
    assert "bf16" in r and "'a'" in r and len(r) < 150
    assert pickle.loads(pickle.dumps(a)).to_dict() == a.to_dict()
    assert copy.deepcopy(a).to_dict() == a.to_dict()


# ---- resolve_codebook -------------------------------------------------------------------------------

def test_resolve_codebook():
    default = Codebook.default_for("bf16")
    assert resolve_codebook(None, "bf16") is default
    assert resolve_codebook("bf16-kv", "bfloat16") is default
    assert resolve_codebook(default.to_dict(), "bf16") == default
    mine = Codebook(BF16_EXPS, "bf16")
    assert resolve_codebook(mine, "bf16") is mine
    assert resolve_codebook(None, "e5m2").format.name == "e5m2"


def test_resolve_codebook_rejects():
    with pytest.raises(ValueError, match="'fp16-kv' is for fp16, but the data is bf16"):
        resolve_codebook("fp16-kv", "bf16")
    with pytest.raises(ValueError, match="is for bf16"):
        resolve_codebook(Codebook(BF16_EXPS, "bf16"), "fp32")
    with pytest.raises(ValueError, match="available"):
        resolve_codebook("nope", "bf16")
    with pytest.raises(TypeError):
        resolve_codebook(42, "bf16")
