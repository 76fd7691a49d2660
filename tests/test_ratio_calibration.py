"""The ratio mode with channel tables calibrated offline (kvzip.calibrate_channels, ChannelCodebook,
``compress(x, mode="ratio", codebook=cb)``, ``kvzip calibrate --mode ratio``): the rule the
tables follow, blobs that hold the calibrated tables and decode with nothing else (a second
decoder from docs/format.md included), any tensor lossless (Hypothesis), the compact header kept,
configs, batches, the CLI, and every bad input refused with a clear error."""
from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import spec_reader
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ratio_mode import second_decoder

import kvzip
from kvzip import channel_codebook as cc
from kvzip import layout
from kvzip import testing as kt
from kvzip.cli import main
from kvzip.data import load_sample
from kvzip.formats import FORMATS

BF16 = FORMATS["bf16"]


def sample_bits() -> list:
    return [np.asarray(v).view(np.uint16) for v in load_sample("prose").values()]


def blob_tables(blob: bytes) -> np.ndarray:
    """The tables stream of a version-3 blob, read by the format's text (spec_reader)."""
    _, shape, fmt, C, (X, NH, NS) = spec_reader.compact_header(blob, 3)
    E, M, _ = spec_reader.BITS[fmt]
    n = int(np.prod(shape))
    G, nchunks, D = -(-n // 8), -(-n // C), spec_reader.channels(shape)
    streams = spec_reader.payload(blob, [3 * G, (M + 1) * G, 2 * nchunks, 2 * X, X, NH, NS, 2 * nchunks, 15 * D])
    return np.frombuffer(streams[-1], np.uint8).reshape(D, 15)


def test_calibrated_tables_follow_the_rule_on_every_value():
    """Each channel's table: its 15 exponents by count over all samples, ties to the lower one,
    counted here independently of kvzip's counting."""
    xs = sample_bits()
    cb = kvzip.calibrate_channels(xs, format="bf16", name="prose", provenance={"model": "SmolLM2-135M"})
    D = xs[0].shape[-1]
    counts = np.zeros((D, 256), np.int64)
    for x in xs:
        flat = x.reshape(-1)
        np.add.at(counts, (np.arange(flat.size) % D, (flat >> 7) & 0xFF), 1)
    for d in range(D):
        seen = [e for e in range(256) if counts[d, e]]
        want = sorted(seen, key=lambda e: (-counts[d, e], e))[:15]
        assert len(want) == 15 and list(cb.tables[d]) == want, d
    prov = cb.provenance
    assert (cb.channels, cb.name, cb.format) == (D, "prose", BF16)
    assert prov["values"] == sum(x.size for x in xs) and prov["tensors"] == len(xs) and prov["channels"] == D
    assert prov["model"] == "SmolLM2-135M"


def test_blobs_hold_the_calibrated_tables_and_decode_alone():
    xs = sample_bits()
    cb = kvzip.calibrate_channels(xs[:4], format="bf16")
    for x in xs[4:8]:
        blob = bytes(np.asarray(kvzip.compress(x, codebook=cb, dtype="bf16", mode="ratio")))
        assert layout.version_of(blob) == layout.RATIO_VERSION  # the 64-byte header, as without calibration
        assert np.array_equal(blob_tables(blob), np.array(cb.tables))
        got, shape = second_decoder(blob)
        assert shape == list(x.shape) and np.array_equal(got, x.reshape(-1))
        assert np.array_equal(np.asarray(kvzip.decompress(blob)).view(np.uint16), x)
        info = kvzip.info(np.frombuffer(blob, np.uint8))
        assert info["pipeline"] == [{"id": "channel_pack", "chunk": 4096}, {"id": "serialize", "checksum": False}]
    own = bytes(np.asarray(kvzip.compress(xs[5], dtype="bf16", mode="ratio")))
    assert not np.array_equal(blob_tables(own), np.array(cb.tables))  # the tensor's own tables differ


@settings(max_examples=examples(40), deadline=None)
@given(st.sampled_from(list(FORMATS)), st.sampled_from([1, 2, 8, 64, 256]), st.integers(0, 3000),
       st.sampled_from([8, 64, 4096]), st.integers(0, 2**32 - 1), st.booleans())
def test_any_tensor_round_trips_with_any_calibration(fmt_name, D, rows, chunk, seed, noise):
    """Tables calibrated on other data (or on random bits) code any tensor of their channels
    losslessly, within raw plus a header; kv-like data with escapes or random bits alike."""
    fmt = FORMATS[fmt_name]
    if (1 << fmt.exp_bits) < cc.TABLE_WIDTH:
        return
    calib = kt.kv_like_bits(fmt, 64 * D, seed=seed).reshape(-1, D)
    cb = kvzip.calibrate_channels(calib, format=fmt_name)
    n = rows * D
    x = (kt._rng_bits(seed, fmt, n) if noise else kt.kv_like_bits(fmt, n, escape_rate=0.01, seed=seed + 1))
    x = x.reshape(rows, D)
    blob = kvzip.compress(x, codebook=cb, dtype=fmt_name, mode="ratio", chunk=chunk)
    assert len(blob) <= layout.align(x.nbytes) + layout.COMPACT_SIZE
    back = np.asarray(kvzip.decompress(blob)).view(fmt.uint_dtype)
    assert back.shape == x.shape and np.array_equal(back, x)


def test_configs_batches_and_caching():
    xs = sample_bits()
    cb = kvzip.calibrate_channels(xs[:2], format="bf16", name="two")
    pipe = kvzip.ratio_pipeline(cb, checksum=True, chunk=1024)
    again = kvzip.Pipeline.from_config(json.loads(pipe.to_json()))
    assert again == pipe and again.stages[0].codebook == cb
    assert pipe.stage_configs[0] == {"id": "channel_pack", "chunk": 1024}  # what blobs record
    blobs = kvzip.compress_many(xs[:3], codebook=cb.to_dict(), dtype="bf16", mode="ratio")
    for blob, x in zip(blobs, xs[:3]):
        assert bytes(blob) == bytes(kvzip.compress(x, codebook=cb, dtype="bf16", mode="ratio"))
    assert bytes(pipe.encode(xs[0], dtype="bf16")) == bytes(kvzip.compress(xs[0], codebook=cb, dtype="bf16",
                                                                           mode="ratio", checksum=True, chunk=1024))
    from kvzip import api

    assert api._preset("ratio", cb, False, None) is api._preset("ratio", cb.to_dict(), False, None)


def test_codebook_object_json_pickle_and_equality(tmp_path):
    cb = kvzip.calibrate_channels(sample_bits()[:2], format="bf16", name="t", provenance={"note": [1, 2]})
    path = tmp_path / "t.json"
    text = cb.to_json(path)
    assert text.count("\n    [") == cb.channels  # a channel's table a line
    for back in (kvzip.ChannelCodebook.from_json(path), kvzip.ChannelCodebook.from_json(text),
                 kvzip.ChannelCodebook.from_dict(json.loads(text)), pickle.loads(pickle.dumps(cb))):
        assert back == cb and hash(back) == hash(cb) and back.name == "t" and back.provenance == cb.provenance
    other = kvzip.ChannelCodebook([list(range(15))] * cb.channels, "bf16")
    assert other != cb and len({cb, other}) == 2
    with pytest.raises(AttributeError):
        cb.name = "x"
    stream = cb.tables_stream()
    stream[0] = 1  # a copy
    assert cb.tables_stream()[0] == cb.tables[0][0]


@pytest.mark.parametrize("tables,fmt,match", [
    ([list(range(15))] * 3, "bf16", "power of two"),
    ([list(range(15))] * 512, "bf16", "power of two"),
    ([], "bf16", "power of two"),
    ([list(range(14))] * 4, "bf16", "needs 15"),
    ([list(range(14)) + [3]] * 4, "bf16", "repeats an exponent"),
    ([list(range(20, 35))] * 4, "e5m2", "outside e5m2"),
    ([list(range(-1, 14))] * 4, "bf16", "outside bf16"),
    ([[1.0] * 15] * 4, "bf16", "must be ints"),
    ([[True] + list(range(1, 15))] * 4, "bf16", "must be ints"),
    (7, "bf16", "sequence of rows"),
    ([list(range(15))] * 4, "bf17", "bf17"),
])
def test_bad_tables_refused(tables, fmt, match):
    with pytest.raises(ValueError, match=match):
        kvzip.ChannelCodebook(tables, fmt)


def test_bad_dicts_and_files_refused(tmp_path):
    cb = kvzip.calibrate_channels(sample_bits()[:1], format="bf16")
    d = cb.to_dict()
    for bad, match in [({**d, "kind": "codebook"}, "'kind'"), ({**d, "extra": 1}, "unknown"),
                       ({k: v for k, v in d.items() if k != "tables"}, "lacks"), ({**d, "format": 16}, "string"),
                       (kvzip.Codebook.default_for("bf16").to_dict(), "Top-16 codebook"), ([], "must be a dict")]:
        with pytest.raises(ValueError, match=match):
            kvzip.ChannelCodebook.from_dict(bad)
    with pytest.raises(ValueError, match="channel codebook"):
        kvzip.Codebook.from_dict(d)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not valid JSON"):
        kvzip.ChannelCodebook.from_json(bad)


def test_tensors_the_codebook_does_not_fit_are_refused():
    xs = sample_bits()
    cb = kvzip.calibrate_channels(xs[:1], format="bf16")
    x = xs[1]
    with pytest.raises(ValueError, match="has 64 channels; a tensor of shape \\(192, 128\\) has 128"):
        kvzip.compress(x.reshape(192, 128), codebook=cb, dtype="bf16", mode="ratio")
    with pytest.raises(ValueError, match="for bf16; the tensor is fp16"):
        kvzip.compress(x.view(np.float16), codebook=cb, mode="ratio")
    with pytest.raises(ValueError, match="Top-16 codebook is for mode='speed'"):
        kvzip.compress(x, codebook="bf16-kv", dtype="bf16", mode="ratio")
    with pytest.raises(ValueError, match="mode='storage' takes no codebook"):
        kvzip.compress(x, codebook=cb, dtype="bf16", mode="storage")
    with pytest.raises(TypeError, match="mode='ratio'"):
        kvzip.compress(x, codebook=cb, dtype="bf16")
    with pytest.raises(ValueError, match="kind"):
        kvzip.compress(x, codebook={**cb.to_dict(), "kind": "?"}, dtype="bf16", mode="ratio")


def test_calibration_input_errors():
    xs = sample_bits()
    with pytest.raises(ValueError, match="same channels"):
        kvzip.calibrate_channels([xs[0], xs[1].reshape(-1, 32)], format="bf16")
    with pytest.raises(ValueError, match="format="):
        kvzip.calibrate_channels(xs[:1])
    with pytest.raises(ValueError, match="one format"):
        import ml_dtypes

        kvzip.calibrate_channels([xs[0].view(ml_dtypes.bfloat16), xs[1].view(np.float16)])
    with pytest.raises(ValueError, match="no values"):
        kvzip.calibrate_channels([np.zeros((0, 64), np.uint16)], format="bf16")


def test_torch_tensors_calibrate():
    torch = pytest.importorskip("torch")
    xs = sample_bits()[:2]
    ts = [torch.from_numpy(x.astype(np.int16)).view(torch.bfloat16) for x in xs]
    assert kvzip.calibrate_channels(ts) == kvzip.calibrate_channels(xs, format="bf16")


def test_cli_calibrates_and_compresses_with_the_tables(tmp_path, capsys):
    st = pytest.importorskip("safetensors.numpy")
    calib, data = tmp_path / "prose.safetensors", tmp_path / "code.safetensors"
    st.save_file(load_sample("prose"), str(calib))
    st.save_file(load_sample("code"), str(data))
    out = tmp_path / "tables.json"
    assert main(["calibrate", "--mode", "ratio", str(calib), "-o", str(out)]) == 0
    assert "tables of 64 channels" in capsys.readouterr().out
    cb = kvzip.ChannelCodebook.from_json(out)
    assert cb == kvzip.calibrate_channels(str(calib))
    packed, back = tmp_path / "code.kvz", tmp_path / "back.safetensors"
    assert main(["compress", "-q", "--mode", "ratio", "--codebook", str(out), str(data), str(packed)]) == 0
    assert main(["decompress", "-q", str(packed), str(back)]) == 0
    assert back.read_bytes() == data.read_bytes()
    # wrong combinations: usage errors (2), a file of the other kind a failure (1)
    assert main(["compress", "-q", "--mode", "ratio", "--codebook", "bf16-kv", str(data), str(tmp_path / "a")]) == 2
    assert main(["compress", "-q", "--mode", "storage", "--codebook", str(out), str(data), str(tmp_path / "b")]) == 2
    assert main(["compress", "-q", "--codebook", str(out), str(data), str(tmp_path / "c")]) == 1
    assert "channel codebook (mode='ratio')" in capsys.readouterr().err
    assert main(["calibrate", "--mode", "ratio", "--always-include", "0", "-o", str(tmp_path / "d.json"),
                 str(calib)]) == 2
    assert "--always-include is for --mode speed" in capsys.readouterr().err
