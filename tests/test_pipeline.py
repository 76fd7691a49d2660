"""Pipeline: construction-time validation, config round trips, defaults, decoding by the
recorded pipeline, the stored-raw fallback, and the lossless property."""
from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import kvzip
from kvzip import stages as S
from kvzip import testing as kt
from kvzip.data import load_sample
from kvzip.formats import FORMATS
from kvzip.trace import last_path
from kvzip.stages.base import REGISTRY, stage_from_config

Q = kt.quantize_fp8_available()
needs_q = pytest.mark.skipif(Q is None, reason="QuantizeFP8 has not landed")

SPLIT = S.ExponentSplit
PACK = S.Top16Pack
ESC = S.EscapeStream
SER = S.Serialize


# --------------------------------------------------------------------------- construction
BAD_CHAINS = {
    "empty": [],
    "only split": [SPLIT()],
    "missing serialize": [SPLIT(), PACK(), ESC()],
    "pack before split": [PACK(), SPLIT(), ESC(), SER()],
    "escape before pack": [SPLIT(), ESC(), PACK(), SER()],
    "pack without escape": [SPLIT(), PACK(), SER()],
    "escape without pack": [SPLIT(), ESC(), SER()],
    "pack without split": [PACK(), ESC(), SER()],
    "serialize not last": [SER(), SPLIT(), PACK(), ESC()],
    "serialize twice": [SPLIT(), PACK(), ESC(), SER(), SER()],
    "serialize in the middle": [SPLIT(), SER(), PACK(), ESC(), SER()],
    "split twice": [SPLIT(), SPLIT(), PACK(), ESC(), SER()],
    "split after escape": [SPLIT(), PACK(), ESC(), SPLIT(), SER()],
}


@pytest.mark.parametrize("name", list(BAD_CHAINS))
def test_bad_chain_raises_at_construction(name):
    with pytest.raises(ValueError) as e:
        kvzip.Pipeline(BAD_CHAINS[name])
    assert str(e.value)  # says what is wrong


@needs_q
@pytest.mark.parametrize("chain", [
    lambda: [SPLIT(), Q("e5m2"), PACK(), ESC(), SER()],
    lambda: [SPLIT(), PACK(), ESC(), Q("e5m2"), SER()],
    lambda: [Q("e5m2"), PACK(), ESC(), SER()],
    lambda: [Q("e5m2")],
], ids=["quantize after split", "quantize after escape", "quantize then pack", "quantize alone"])
def test_bad_chain_with_quantize_raises(chain):
    with pytest.raises(ValueError):
        kvzip.Pipeline(chain())


@pytest.mark.parametrize("entry", [None, "serialize", {"id": "serialize"}, SER, 3, np.zeros(3)])
def test_non_stage_entries_raise_type_error(entry):
    with pytest.raises(TypeError):
        kvzip.Pipeline([SPLIT(), PACK(), ESC(), entry])
    with pytest.raises(TypeError):
        kvzip.Pipeline([entry, SER()])


def test_error_messages_name_the_offending_stage():
    with pytest.raises(ValueError, match="Top16Pack"):
        kvzip.Pipeline([PACK(), SPLIT(), ESC(), SER()])
    with pytest.raises(ValueError, match="Serialize"):
        kvzip.Pipeline([SPLIT(), PACK(), ESC()])


@pytest.mark.parametrize("make", [
    lambda: ESC(7), lambda: ESC(4), lambda: ESC(0), lambda: ESC(-8), lambda: ESC(1 << 17), lambda: ESC(4096.0),
    lambda: ESC(True), lambda: ESC("4096"), lambda: ESC(96),
    lambda: PACK("no-such-codebook"), lambda: PACK({"format": "bf16", "exponents": [1] * 16}),
    lambda: PACK({"format": "bf16", "exponents": list(range(15))}),
    lambda: PACK({"format": "bf16", "exponents": list(range(250, 266))}),
    lambda: PACK({"format": "nope", "exponents": list(range(16))}),
])
def test_bad_stage_parameters_raise_value_error(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("make", [lambda: SER(1), lambda: SER("yes"), lambda: SER(None), lambda: PACK(5),
                                  lambda: PACK([1, 2, 3])])
def test_bad_stage_parameter_types_raise_type_error(make):
    with pytest.raises(TypeError):
        make()


def test_valid_chunks_accepted():
    for chunk in kt.CHUNK_SIZES:
        assert ESC(chunk).chunk == chunk


@needs_q
def test_quantize_parameters_checked():
    for bad in [("bf16",), ("fp32",), ("e5m2", "row"), ("float8_e4m3fnuz",)]:
        with pytest.raises((ValueError, TypeError)):
            Q(*bad)


def test_codebook_for_another_format_fails_at_encode():
    pipe = kvzip.Pipeline([SPLIT(), PACK("e5m2-kv"), ESC(), SER()])
    with pytest.raises(ValueError, match="e5m2"):
        pipe.encode(np.zeros(16, np.uint16), dtype="bf16")


# --------------------------------------------------------------------------- config round trip
@settings(max_examples=examples(150))
@given(p=kt.pipelines())
def test_config_json_roundtrip(p):
    cfg = p.to_config()
    text = json.dumps(cfg)
    assert json.loads(text) == cfg  # plain JSON types only
    for form in (cfg, text, text.encode(), cfg["stages"], json.loads(text)):
        q = kvzip.Pipeline.from_config(form)
        assert q == p
        assert q.to_config() == cfg
        assert [type(s) for s in q.stages] == [type(s) for s in p.stages]
        assert q.lossless == p.lossless
    assert kvzip.Pipeline.from_config(p.to_json()) == p
    for s in p.stages:
        assert stage_from_config(json.loads(json.dumps(s.get_config()))) == s


@settings(max_examples=examples(60))
@given(fmt=kt.formats(), data=st.data())
def test_pipeline_from_config_encodes_identically(fmt, data):
    """A pipeline rebuilt from its JSON config writes the very same bytes."""
    p = data.draw(kt.pipelines(fmt, lossy=False))
    bits = data.draw(kt.kv_like_arrays(fmt, max_size=1000))
    q = kvzip.Pipeline.from_config(json.dumps(p.to_config()))
    np.testing.assert_array_equal(p.encode(bits, dtype=fmt.name), q.encode(bits, dtype=fmt.name))


def test_configs_differ_when_parameters_differ():
    base = kvzip.splitzip_pipeline()
    assert base == kvzip.splitzip_pipeline()
    assert base != kvzip.splitzip_pipeline(chunk=1024)
    assert base != kvzip.splitzip_pipeline(checksum=True)
    assert base != kvzip.splitzip_pipeline(codebook="bf16-kv")
    assert base != "not a pipeline"
    assert kvzip.Pipeline([SER()]) != kvzip.Pipeline([SER(True)])


@pytest.mark.parametrize("config", [
    None, 5, "not json", "[1, 2]", {"stages": None}, {"nope": []}, [{"chunk": 8}], [{"id": "no_such_stage"}],
    [{"id": "escape_stream", "chunk": 8, "extra": 1}], [{"id": "escape_stream", "chunk": 9}],
    [{"id": "serialize", "checksum": "x"}], [{"id": "top16_pack", "codebook": 7}], ["serialize"],
    [{"id": "exponent_split"}, {"id": "serialize", "checksum": False}, {"id": "serialize", "checksum": False}],
])
def test_bad_configs_raise(config):
    with pytest.raises((ValueError, TypeError)):
        kvzip.Pipeline.from_config(config)


def test_registry_holds_every_stage():
    want = {"exponent_split", "top16_pack", "escape_stream", "serialize"} | ({"quantize_fp8"} if Q else set())
    assert want <= set(REGISTRY)
    for sid, cls in REGISTRY.items():
        assert cls.id == sid


# --------------------------------------------------------------------------- defaults / presets
def test_default_pipeline():
    p = kvzip.splitzip_pipeline()
    assert p.to_config() == {"stages": [
        {"id": "exponent_split"}, {"id": "top16_pack", "codebook": None},
        {"id": "escape_stream", "chunk": 4096}, {"id": "serialize", "checksum": False}]}
    assert p.fuse and p.lossless
    assert kvzip.api.DEFAULT_CHUNK == 4096


def test_compress_is_the_default_pipeline():
    for fmt in FORMATS.values():
        bits = kt.kv_like_bits(fmt, 5000, escape_rate=0.002, seed=3)
        for kw in ({}, {"checksum": True}, {"chunk": 64}, {"codebook": f"{fmt.name}-kv"}, {"codebook": None}):
            a = kvzip.compress(bits, dtype=fmt.name, **kw)
            pipe = kvzip.splitzip_pipeline(**{"codebook": "auto", **kw})  # compress's codebook: "auto" unless given
            np.testing.assert_array_equal(a, pipe.encode(bits, dtype=fmt.name))
            assert kvzip.info(a)["pipeline"] == (
                [{"id": "serialize", "checksum": kw.get("checksum", False)}] if kvzip.info(a)["stored_raw"]
                else pipe.to_config()["stages"])


def test_default_codebook_is_the_tensors_own_and_none_the_shipped_one():
    for fmt in FORMATS.values():
        bits = kt.kv_like_bits(fmt, 4096, seed=1)
        auto = kvzip.info(kvzip.compress(bits, dtype=fmt.name))
        blob = kvzip.compress(bits, None, dtype=fmt.name)
        inf = kvzip.info(blob)
        if inf["stored_raw"]:
            assert fmt.name == "e4m3"
            continue
        assert auto["pipeline"][1] == {"id": "top16_pack", "codebook": "auto"} and auto["codebook"] == "auto"
        assert inf["codebook"] == f"{fmt.name}-kv"
        # Explicit and default give the same values (the recorded config differs: None vs the codebook).
        blob2 = kvzip.compress(bits, kvzip.Codebook.default_for(fmt), dtype=fmt.name)
        np.testing.assert_array_equal(kvzip.decompress(blob2).view(fmt.uint_dtype), bits)


# --------------------------------------------------------------------------- decoding follows the blob
@settings(max_examples=examples(50))
@given(fmt=kt.formats(), data=st.data())
def test_decode_follows_the_recorded_pipeline(fmt, data):
    """Any pipeline object decodes any blob: what counts is the pipeline recorded in the blob."""
    enc = data.draw(kt.pipelines(fmt, lossy=False))
    dec = data.draw(kt.pipelines(fmt, lossy=False))
    bits = data.draw(st.one_of(kt.kv_like_arrays(fmt, max_size=2000), kt.escape_heavy_arrays(fmt, max_size=2000)))
    blob = enc.encode(bits, dtype=fmt.name)
    for pipe in (dec, kvzip.splitzip_pipeline(), kvzip.Pipeline([SER()])):
        np.testing.assert_array_equal(pipe.decode(blob).view(fmt.uint_dtype), bits)
    np.testing.assert_array_equal(kvzip.decompress(blob).view(fmt.uint_dtype), bits)
    recorded = kvzip.info(blob)["pipeline"]
    if not kvzip.info(blob)["stored_raw"]:
        assert recorded == enc.to_config()["stages"]


def test_decode_uses_blob_chunk_and_codebook_not_the_decoders():
    bits = kt.kv_like_bits("bf16", 3000, escape_rate=0.01, seed=5)
    cb = kvzip.Codebook(list(range(120, 136)), "bf16")
    blob = kvzip.Pipeline([SPLIT(), PACK(cb), ESC(8), SER()]).encode(bits, dtype="bf16")
    other = kvzip.Pipeline([SPLIT(), PACK("bf16-kv"), ESC(65536), SER(True)])
    np.testing.assert_array_equal(other.decode(blob).view(np.uint16), bits)


def test_split_only_and_stored_pipelines_roundtrip():
    for fmt in FORMATS.values():
        bits = kt.kv_like_bits(fmt, 777, seed=2)
        for stages in ([SER()], [SPLIT(), SER()], [SPLIT(), SER(True)]):
            pipe = kvzip.Pipeline(stages)
            blob = pipe.encode(bits, dtype=fmt.name)
            assert last_path() in ("staged", "stored")
            np.testing.assert_array_equal(kvzip.decompress(blob).view(fmt.uint_dtype), bits)


# --------------------------------------------------------------------------- stored-raw fallback
def stored_cases():
    rng = np.random.default_rng(11)
    yield "e4m3 random", rng.integers(0, 256, 10000, dtype=np.uint8), "e4m3"
    yield "e4m3 kv-like", kt.kv_like_bits("e4m3", 10000, seed=1), "e4m3"
    yield "bf16 random", rng.integers(0, 1 << 16, 10000, dtype=np.uint64).astype(np.uint16), "bf16"
    yield "fp32 random", rng.integers(0, 1 << 32, 10000, dtype=np.uint64).astype(np.uint32), "fp32"
    yield "e5m2 random", rng.integers(0, 256, 10000, dtype=np.uint8), "e5m2"
    for fmt in FORMATS.values():
        yield f"{fmt.name} one value", kt.kv_like_bits(fmt, 1, seed=4), fmt.name
        yield f"{fmt.name} 7 values", kt.kv_like_bits(fmt, 7, seed=4), fmt.name


@pytest.mark.parametrize("case", list(stored_cases()), ids=lambda c: c[0])
def test_incompressible_data_is_stored_raw(case):
    _, bits, fmt = case
    raw = bits.nbytes
    for fuse in (True, False):
        pipe = kvzip.Pipeline(kvzip.splitzip_pipeline().stages, fuse=fuse)
        blob = pipe.encode(bits, dtype=fmt)
        assert last_path() == "stored"
        inf = kvzip.info(blob)
        assert inf["stored_raw"] is True
        assert inf["streams"] == {"data": raw}
        assert inf["pipeline"] == [{"id": "serialize", "checksum": False}]
        assert inf["chunks"] == 0 and inf["escapes"] == 0
        assert len(blob) <= raw + 15 + 512, (len(blob), raw)
        np.testing.assert_array_equal(kvzip.decompress(blob).view(bits.dtype), bits)


def test_compressible_data_is_not_stored():
    bits = np.concatenate([v.view(np.uint16).ravel() for v in load_sample("html").values()])
    pipe = kvzip.splitzip_pipeline()
    blob = pipe.encode(bits, dtype="bf16")
    assert last_path() == "fused"
    inf = kvzip.info(blob)
    assert not inf["stored_raw"] and inf["ratio"] > 1.3


@needs_q
def test_stored_fallback_keeps_the_quantize_stage():
    """After QuantizeFP8 the FP8 values may be stored raw, but the blob still records the
    quantization, so decoding dequantizes."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal(4000).astype(np.float32)
    pipe = kvzip.Pipeline([Q("e4m3"), SPLIT(), PACK(), ESC(), SER()])  # e4m3 never compresses
    blob = pipe.encode(x)
    assert last_path() == "stored"
    inf = kvzip.info(blob)
    assert inf["stored_raw"] and [s["id"] for s in inf["pipeline"]] == ["quantize_fp8", "serialize"]
    ref = kvzip.decompress(kvzip.Pipeline([Q("e4m3"), SER()]).encode(x))
    out = kvzip.decompress(blob)
    assert out.dtype == np.float32 and out.shape == x.shape
    np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))


# --------------------------------------------------------------------------- lossless property
def test_lossless_property():
    assert kvzip.splitzip_pipeline().lossless
    assert kvzip.Pipeline([SER()]).lossless
    assert kvzip.Pipeline([SPLIT(), SER()]).lossless
    for cls in (SPLIT, PACK, ESC, SER):
        assert cls.lossless is True


@needs_q
def test_quantize_makes_a_pipeline_lossy():
    assert Q.lossless is False
    assert not kvzip.Pipeline([Q("e5m2"), SER()]).lossless
    assert not kvzip.Pipeline([Q("e4m3", "channel"), SPLIT(), PACK(), ESC(), SER()]).lossless


@needs_q
def test_quantize_refuses_fp8_input():
    pipe = kvzip.Pipeline([Q("e5m2"), SPLIT(), PACK(), ESC(), SER()])
    with pytest.raises(TypeError):
        pipe.encode(np.zeros(8, np.uint8), dtype="e5m2")


def test_repr_and_stage_equality():
    p = kvzip.splitzip_pipeline(chunk=64)
    assert "EscapeStream(chunk=64)" in repr(p)
    assert ESC(64) == ESC(64) and ESC(64) != ESC(128) and SPLIT() != SER()


def _frame_after(pipe, bits, fmt="bf16"):
    """The frame the fused step would get: the pipeline's stages ahead of it run on the CPU."""
    from kvzip.backends import get_backend
    from kvzip.frame import Frame

    frame = Frame(get_backend("cpu"), {"data": bits},
                  {"dtype": FORMATS[fmt].dtype_name, "shape": [bits.size], "n": bits.size, "format": fmt})
    for step in pipe.body_steps[:-1]:
        frame = step.encode(frame)
    return frame


@pytest.mark.parametrize("front,fmt,lane_key", [
    ([], "bf16", "bf16"),
    ([S.QuantizeFP8("e5m2")], "bf16", "bf16"),   # the lane quantizes: keyed by the caller's format
    ([S.QuantizeFP8("e4m3")], "fp16", "fp16"),
    ([S.QuantizeFP8("e5m2", "channel")], "bf16", None),  # a table per channel: no lane
    ([S.QuantizeFP8("e5m2")], "fp32", None),      # 2^31 magnitudes: no table, no lane
])
def test_lanes_are_kept_only_for_bodies_one_program_can_run(front, fmt, lane_key):
    """What the fused GPU executor's ShapeEncoder (made per caller format and shape) learns
    after its first fast encode."""
    from kvzip.gpu.executor import ShapeEncoder

    bits = np.arange(4096, dtype=np.uint64).astype(FORMATS[fmt].uint_dtype)
    with_sum = kvzip.Pipeline(front + [S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(), S.Serialize(True)])
    encoder = ShapeEncoder(with_sum, FORMATS[fmt], (4096,))
    encoder.learn(_frame_after(with_sum, bits, fmt), plan=None)
    assert encoder.lane is None  # a checksum is hashed on the host: never a lane
    pipe = kvzip.Pipeline(front + [S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(), S.Serialize()])
    encoder = ShapeEncoder(pipe, FORMATS[fmt], (4096,))
    encoder.learn(_frame_after(pipe, bits, fmt), plan=None)
    if lane_key is None:
        assert encoder.lane is None
    else:
        lane = encoder.lane
        assert encoder.fmt.name == lane_key and lane.quantize == (fmt if front else None)
        assert lane.fmt.name == ("bf16" if not front else front[0].format)
