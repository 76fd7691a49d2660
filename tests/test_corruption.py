"""Hostile blobs: truncations, bit flips and forged headers with a valid CRC.

Every malformed blob must raise kvzip.FormatError (a ValueError): never another exception, a
crash, a hang, an out-of-bounds access or a huge allocation driven by the header.  Each case is
decoded three ways: kvzip.decompress (fused CPU kernel), a fuse=False pipeline (the stages one by
one) and kvzip.decompress_many.  Without a checksum a payload bit flip may also decode, to an
array of the shape and dtype the header states.

The structured fuzz also runs once in a subprocess with NUMBA_BOUNDSCHECK=1, where any index
the validation misses becomes an IndexError instead of a silent out-of-bounds read or write.

Tests marked ``known_bug`` document bugs in code this suite does not own; they are strict
xfails, so they start failing (XPASS) the moment the bug is fixed: then drop the mark.
"""
from __future__ import annotations

import faulthandler
import json
import os
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import kvzip
from kvzip import FormatError, container
from kvzip import stages as S
from kvzip import testing as kt
from kvzip.backends import get_backend
from kvzip.frame import Frame
from kvzip.formats import FORMATS


def known_bug(reason, raises=None):
    return pytest.mark.xfail(strict=True, reason=f"BUG (not in this suite's files): {reason}", raises=raises)


@pytest.fixture(autouse=True)
def no_hang():
    """A decode that hangs (even inside a Numba kernel) kills the run with tracebacks after 300 s."""
    faulthandler.dump_traceback_later(300, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


# --------------------------------------------------------------------------- blob surgery
unpack = kt.blob_parts  # (meta, flags, [(name, dtype, payload bytes)]) of a valid blob
rebuild = kt.build_blob  # a forged blob with a valid CRC (and payload checksum)
reseal = kt.reseal  # the header CRC recomputed after editing header bytes in place


def raw_header(text: bytes, table=(), flags=0, payload=b"", version=1, checksum=0, header_len=None,
               meta_len=None, nstreams=None) -> bytes:
    """A header built field by field (for metadata build_header would refuse to write)."""
    tbl = b"".join(struct.pack("<QQ", o, nb) for o, nb in table)
    H = header_len if header_len is not None else -(-(48 + len(tbl) + len(text)) // 16) * 16
    body = tbl + text
    raw = bytearray(container.PREFIX.pack(container.MAGIC, version, flags, H, len(payload), checksum,
                                          len(text) if meta_len is None else meta_len,
                                          len(table) if nstreams is None else nstreams, 0) + body)
    raw += bytes(max(0, H - len(raw)))
    return reseal(bytes(raw) + payload)


def with_stream(streams, name, data=None, dtype=None, drop=False):
    out = []
    for n, d, b in streams:
        if n == name:
            if drop:
                continue
            out.append((n, dtype or d, b if data is None else data))
        else:
            out.append((n, d, b))
    return out


def stream_array(streams, name):
    for n, d, b in streams:
        if n == name:
            return np.frombuffer(b, container.STREAM_DTYPES[d]).copy()
    raise KeyError(name)


# --------------------------------------------------------------------------- decoders
STAGED = kvzip.Pipeline([S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(), S.Serialize()], fuse=False)
DECODERS = {
    "decompress": kvzip.decompress,
    "staged": STAGED.decode,
    "decompress_many": lambda b: kvzip.decompress_many([b])[0],
}


def assert_rejected(blob, match=None):
    for name, dec in DECODERS.items():
        with pytest.raises(FormatError, match=match) as e:
            dec(blob)
        assert isinstance(e.value, ValueError), name


def assert_rejected_or_sane(blob):
    """Decode raises FormatError or returns an array of the shape and dtype the header states."""
    meta = container.parse_header(bytes(blob), len(blob)).meta
    for name, dec in DECODERS.items():
        try:
            out = dec(blob)
        except FormatError:
            continue
        assert isinstance(out, np.ndarray), name
        assert list(out.shape) == meta["shape"] and out.dtype.name == meta["dtype"], (name, out.shape, out.dtype)


# --------------------------------------------------------------------------- base blobs
def _base_cases():
    cb16 = kvzip.Codebook.default_for("bf16")
    plane = kt.kv_like_bits("bf16", 3000, seed=2)
    plane[512:768] = np.random.default_rng(2).integers(0, 1 << 16, 256, dtype=np.uint64).astype(np.uint16)
    e5 = kt.kv_like_bits("e5m2", 4000, escape_rate=0.002, seed=3)
    e5[1024:1280] = np.random.default_rng(3).integers(0, 256, 256, dtype=np.uint64).astype(np.uint8)
    cases = {
        "bf16 listed escapes": (kt.kv_like_bits("bf16", 3000, escape_rate=0.01, seed=1).reshape(3, 1000), "bf16",
                                dict(chunk=256)),
        "bf16 plane-coded": (plane, "bf16", dict(chunk=256, codebook=cb16)),
        "fp32 escapes": (kt.kv_like_bits("fp32", 2000, escape_rate=0.01, seed=4).reshape(2, 10, 100), "fp32",
                         dict(chunk=64)),
        "fp16 escape-free": (kt.kv_like_bits("fp16", 2500, seed=5), "fp16", dict(chunk=512)),
        "e5m2 plane and listed": (e5, "e5m2", dict(chunk=256)),
        "e4m3 stored": (np.arange(1500, dtype=np.uint8), "e4m3", {}),
        "fp16 0-d": (np.array(0x3C00, np.uint16), "fp16", {}),
    }
    out = {}
    for name, (bits, fmt, kw) in cases.items():
        for checksum in (False, True):
            blob = bytes(kvzip.compress(bits, dtype=fmt, checksum=checksum, **kw))
            out[name + (" +checksum" if checksum else "")] = (blob, bits, fmt)
    # Pipeline.encode stores [ExponentSplit, Serialize] raw (exponent + rest bytes outgrow the
    # values), so a split-only blob is written with the stages themselves: a valid blob that
    # the decoder must handle by following its recorded pipeline.
    split_bits = kt.kv_like_bits("fp16", 999, seed=6)
    split = [S.ExponentSplit(), S.Serialize()]
    frame = Frame(get_backend("cpu"), {"data": split_bits},
                  {"dtype": "float16", "shape": [999], "n": 999, "format": "fp16",
                   "pipeline": [s.get_config() for s in split]})
    blob = split[1].encode(split[0].encode(frame)).streams["blob"]
    out["fp16 split-only"] = (bytes(blob), split_bits, "fp16")
    Q = kt.quantize_fp8_available()
    if Q is not None:
        x = kt.kv_like_bits("bf16", 2048, seed=7).reshape(32, 64)
        pipe = kvzip.Pipeline([Q("e5m2", "channel"), S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(256), S.Serialize()])
        out["quantize e5m2"] = (bytes(pipe.encode(x, dtype="bf16")), None, "bf16")
    return out


BASE = _base_cases()
BASE_NAMES = list(BASE)


def test_base_blobs_are_what_they_claim():
    """The fixtures cover listed escapes, plane-coded chunks, stored raw, checksums."""
    inf = {k: kvzip.info(v[0]) for k, v in BASE.items()}
    assert inf["bf16 listed escapes"]["escapes"] > 0 and inf["bf16 listed escapes"]["raw_chunks"] == 0
    assert inf["bf16 plane-coded"]["raw_chunks"] > 0 and not inf["bf16 plane-coded"]["stored_raw"]
    assert inf["e5m2 plane and listed"]["raw_chunks"] > 0 and inf["e5m2 plane and listed"]["escapes"] > 0
    assert inf["fp32 escapes"]["escapes"] > 0 and inf["fp16 escape-free"]["escapes"] == 0
    assert inf["e4m3 stored"]["stored_raw"] and inf["e4m3 stored +checksum"]["checksum"]
    for name, (blob, bits, fmt) in BASE.items():
        if bits is not None:
            out = kvzip.decompress(blob)
            np.testing.assert_array_equal(out.view(FORMATS[fmt].uint_dtype), bits, err_msg=name)


# --------------------------------------------------------------------------- truncation / extension
@pytest.mark.parametrize("name", BASE_NAMES)
def test_truncation_classes(name):
    blob = BASE[name][0]
    H = container.parse_header(blob, len(blob)).header_len
    cuts = sorted({0, 1, 7, 8, 16, 47, 48, 49, H // 2, H - 1, H, H + 1, (H + len(blob)) // 2, len(blob) - 16,
                   len(blob) - 8, len(blob) - 1})
    for cut in cuts:
        if 0 <= cut < len(blob):
            assert_rejected(blob[:cut])
    for extra in (b"\x00", bytes(16), b"KVZIP\x00\r\n" + bytes(8)):
        assert_rejected(blob + extra)


@pytest.mark.parametrize("name", ["bf16 listed escapes", "e5m2 plane and listed +checksum", "fp16 0-d"])
def test_every_truncation_point(name):
    blob = BASE[name][0]
    for cut in range(len(blob)):
        with pytest.raises(FormatError):
            kvzip.decompress(blob[:cut])


def test_not_a_blob():
    for junk in (b"", b"KVZIP", b"\x00" * 64, b"PK\x03\x04" + bytes(100), np.arange(256, dtype=np.uint8).tobytes()):
        assert_rejected(junk)


# --------------------------------------------------------------------------- header bit flips
@pytest.mark.parametrize("name", ["bf16 listed escapes", "e4m3 stored +checksum", "quantize e5m2"])
def test_every_header_bit_flip_is_caught(name):
    if name not in BASE:
        pytest.skip("QuantizeFP8 has not landed")
    blob = BASE[name][0]
    H = container.parse_header(blob, len(blob)).header_len
    raw = bytearray(blob)
    for bit in range(H * 8):
        raw[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FormatError):
            kvzip.decompress(bytes(raw))
        raw[bit // 8] ^= 1 << (bit % 8)


@settings(max_examples=examples(150))
@given(name=st.sampled_from(BASE_NAMES), data=st.data())
def test_random_header_corruption_is_caught(name, data):
    blob = bytearray(BASE[name][0])
    H = container.parse_header(bytes(blob), len(blob)).header_len
    for _ in range(data.draw(st.integers(1, 6))):
        i = data.draw(st.integers(0, H - 1))
        blob[i] = data.draw(st.integers(0, 255).filter(lambda v: v != blob[i]))
    assert_rejected(bytes(blob))


# --------------------------------------------------------------------------- payload bit flips
CHECKSUMMED = [n for n in BASE_NAMES if n.endswith("+checksum")]
UNCHECKED = [n for n in BASE_NAMES if not n.endswith("+checksum")]


@settings(max_examples=examples(200))
@given(name=st.sampled_from(CHECKSUMMED), data=st.data())
def test_payload_bit_flips_with_checksum_always_caught(name, data):
    blob = bytearray(BASE[name][0])
    H = container.parse_header(bytes(blob), len(blob)).header_len
    bits = data.draw(st.lists(st.integers(0, (len(blob) - H) * 8 - 1), min_size=1, max_size=8, unique=True))
    for b in bits:
        blob[H + b // 8] ^= 1 << (b % 8)
    assert_rejected(bytes(blob), match="checksum")


@pytest.mark.parametrize("name", ["fp16 0-d +checksum", "bf16 listed escapes +checksum"])
def test_every_payload_bit_flip_with_checksum(name):
    blob = bytearray(BASE[name][0])
    H = container.parse_header(bytes(blob), len(blob)).header_len
    stop = min(len(blob), H + 512)
    for bit in range(H * 8, stop * 8):
        blob[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FormatError, match="checksum"):
            kvzip.decompress(bytes(blob))
        blob[bit // 8] ^= 1 << (bit % 8)


@pytest.mark.parametrize("name", ["bf16 listed escapes +checksum", "fp32 escapes +checksum",
                                  "e5m2 plane and listed +checksum", "quantize e5m2"])
def test_checksum_error_wins_over_the_decodes_and_the_headers(name):
    """On the CPU the fused decode verifies the checksum from the words it decodes
    (container.PayloadCheck), later than a pass before the decode would: a blob the decode or the
    header checks reject still reports the checksum mismatch when its checksum is wrong, and the
    other error when it is right."""
    if name not in BASE:
        pytest.skip("QuantizeFP8 not available")
    meta, flags, streams = unpack(BASE[name][0])
    if not flags & container.FLAG_CHECKSUM:  # the quantizing pipeline's blob: give it a checksum
        flags |= container.FLAG_CHECKSUM
    counts = stream_array(streams, "esc_count")
    pos = stream_array(streams, "esc_pos")
    codes = stream_array(streams, "codes")
    first = int(np.flatnonzero(counts != 0xFFFF)[0])
    bad_count, bad_pos, other_codes = counts.copy(), pos.copy(), codes.copy()
    bad_count[first] += 1
    if bad_pos.size:
        bad_pos[0] = 0xFFFF
    other_codes[-1] ^= 0x11
    shape = dict(meta, shape=[meta["n"] + 1])
    cases = [(meta, with_stream(streams, "esc_count", bad_count.tobytes())),
             (meta, with_stream(streams, "esc_pos", bad_pos.tobytes())),
             (meta, with_stream(streams, "codes", other_codes.tobytes())),  # decodes, to other values
             (shape, streams)]
    for m, s in cases:
        right = rebuild(m, s, flags)
        wrong = rebuild(m, s, flags, checksum=container.parse_header(right, len(right)).checksum ^ (1 << 63))
        assert_rejected(wrong, match="payload checksum mismatch")
        for dec in DECODERS.values():
            try:
                dec(right)
            except FormatError as e:
                assert "checksum" not in str(e)


def test_fused_cpu_decode_sums_the_payload_itself(monkeypatch):
    """kvzip.decompress on the CPU verifies a checksum from the fused decode's own sums: no pass of
    sum64 over the payload; other pipelines (here the stages one by one) still take that pass."""
    from kvzip import checksum

    passes = []
    real = checksum._cpu_total
    monkeypatch.setattr(checksum, "_cpu_total", lambda words: passes.append(words.shape[0]) or real(words))
    for name in ("bf16 listed escapes +checksum", "e5m2 plane and listed +checksum", "fp32 escapes +checksum"):
        blob, bits, fmt = BASE[name]
        assert np.asarray(kvzip.decompress(blob)).view(bits.dtype).tobytes() == np.asarray(bits).tobytes()
        assert passes == [], name
        STAGED.decode(blob)
        assert len(passes) == 1
        passes.clear()


@settings(max_examples=examples(300))
@given(name=st.sampled_from(UNCHECKED), data=st.data())
def test_payload_corruption_without_checksum_never_crashes(name, data):
    blob = bytearray(BASE[name][0])
    H = container.parse_header(bytes(blob), len(blob)).header_len
    if len(blob) == H:
        return
    for _ in range(data.draw(st.integers(1, 16))):
        i = data.draw(st.integers(H, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    assert_rejected_or_sane(bytes(blob))


# --------------------------------------------------------------------------- forged prefix fields
def _fmt_blob():
    """A blob with a version-1 header: what the prefix, table and metadata forgeries below edit
    (the compact header's fields are tests/test_compact_header.py's)."""
    return kt.version1(BASE["bf16 listed escapes"][0])


@pytest.mark.parametrize("field,value", [
    ("version", 0), ("version", 2), ("version", 0xFFFF),
    ("flags", 4), ("flags", 0x8000), ("flags", 0xFFFF),
    ("header_len", 0), ("header_len", 40), ("header_len", 56), ("header_len", 1 << 21), ("header_len", 0xFFFFFFFF),
    ("payload_len", 0), ("payload_len", 8), ("payload_len", 1 << 63), ("payload_len", (1 << 64) - 16),
    ("meta_len", 0), ("meta_len", 0xFFFFFFFF), ("nstreams", 0), ("nstreams", 65), ("nstreams", 0xFFFFFFFF),
])
def test_forged_prefix_field(field, value):
    blob = bytearray(_fmt_blob())
    fmt_fields = ["magic", "version", "flags", "header_len", "payload_len", "checksum", "meta_len", "nstreams", "crc"]
    vals = list(container.PREFIX.unpack_from(blob))
    vals[fmt_fields.index(field)] = value
    container.PREFIX.pack_into(blob, 0, *vals)
    assert_rejected(reseal(bytes(blob)))


def test_bad_magic():
    blob = bytearray(_fmt_blob())
    blob[0:8] = b"KVZIP\x00\n\r"
    assert_rejected(reseal(bytes(blob)), match="magic")


def test_nonzero_reserved_field_or_bad_crc():
    blob = bytearray(_fmt_blob())
    blob[40] ^= 1
    assert_rejected(bytes(blob), match="checksum")


def test_header_length_mismatch_with_blob():
    blob = _fmt_blob()
    meta, flags, streams = unpack(blob)
    good = rebuild(meta, streams, flags)
    assert_rejected(good + bytes(16))
    assert_rejected(good[:-16])


# --------------------------------------------------------------------------- forged stream table
def _table_entry(blob, k):
    return struct.unpack_from("<QQ", blob, 48 + 16 * k)


def _set_table(blob, k, off, nb):
    raw = bytearray(blob)
    struct.pack_into("<QQ", raw, 48 + 16 * k, off, nb)
    return reseal(bytes(raw))


@pytest.mark.parametrize("name", ["bf16 listed escapes", "e4m3 stored", "fp16 split-only"])
def test_forged_stream_table(name):
    blob = kt.version1(BASE[name][0])
    hdr = container.parse_header(blob, len(blob))
    P = hdr.payload_len
    for k, (sname, dt, off, nb) in enumerate(hdr.streams):
        item = np.dtype(container.STREAM_DTYPES[dt]).itemsize
        bad = [
            (off + 1, nb), (off + 8, nb),                 # misaligned
            (P, nb + 16), (P + 16, nb), (off, P + 1),     # past the payload
            (off, nb + P), (1 << 63, nb), (off, 1 << 63), ((1 << 64) - 16, 32),  # overflow bait
        ]
        if item > 1:
            bad.append((off, nb + 1))                    # not a whole number of items
        if nb >= item:
            bad.append((off, nb - item))                 # one item short
        if k > 0:
            prev_off = hdr.streams[k - 1][2]
            bad.append((prev_off, nb))                   # overlaps / goes backwards
        for o, n in bad:
            assert_rejected(_set_table(blob, k, o, n))


# --------------------------------------------------------------------------- forged metadata JSON
def _text_of(blob):
    f = container.PREFIX.unpack_from(blob)
    n = f[7]
    return blob[48 + 16 * n: 48 + 16 * n + f[6]]


_with_text = kt.with_metadata_text  # the metadata JSON replaced verbatim, resealed


@pytest.mark.parametrize("text", [
    b"", b"{", b"null", b"[]", b"42", b'"meta"', b"\xff\xfe{}", b'{"meta": {}}', b'{"streams": []}',
    b'{"meta": [], "streams": []}', b'{"meta": {}, "streams": {}}', b'{"meta": {}, "streams": [1, 2, 3, 4, 5, 6]}',
    b'{"meta": {}, "streams": [["codes", "uint8"]]}',
    b"\x00" * 64,
])
def test_bad_metadata_json(text):
    assert_rejected(_with_text(_fmt_blob(), text))


def test_metadata_stream_entries_checked():
    blob = _fmt_blob()
    doc = json.loads(_text_of(blob))
    for bad_entry in (["codes"], ["codes", "uint8", 1], [1, "uint8"], ["codes", "float64"], ["codes", "int8"],
                      ["codes", None], "codes", None):
        d = json.loads(json.dumps(doc))
        d["streams"][0] = bad_entry
        assert_rejected(_with_text(blob, json.dumps(d).encode()))
    d = json.loads(json.dumps(doc))
    d["streams"][1][0] = d["streams"][0][0]  # duplicate names
    assert_rejected(_with_text(blob, json.dumps(d).encode()))


def test_deeply_nested_metadata_json():
    deep = b'{"meta": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b'}, "streams": []}'
    with pytest.raises(FormatError):
        kvzip.decompress(raw_header(deep))


# --------------------------------------------------------------------------- forged meta values
_DROP = object()


def forge_meta(name, **changes):
    blob, _, _ = BASE[name]
    meta, flags, streams = unpack(blob)
    meta = json.loads(json.dumps(meta))
    for k, v in changes.items():
        if v is _DROP:
            meta.pop(k, None)
        else:
            meta[k] = v
    return rebuild(meta, streams, flags)


ALL_KINDS = ["bf16 listed escapes", "bf16 plane-coded +checksum", "e4m3 stored", "fp16 split-only", "fp16 0-d"]


@pytest.mark.parametrize("name", ALL_KINDS)
@pytest.mark.parametrize("changes", [
    {"n": _DROP}, {"n": -1}, {"n": "3000"}, {"n": 3000.0}, {"n": True}, {"n": None}, {"n": [3000]},
    {"n": 2**62 + 1}, {"n": 2**64}, {"n": 10**30},
    {"shape": _DROP}, {"shape": None}, {"shape": "3000"}, {"shape": [-3000]}, {"shape": [3000.0]}, {"shape": [True]},
    {"shape": {"0": 3}}, {"shape": [1, -1]}, {"shape": [2**62, 0]},
    {"dtype": _DROP}, {"dtype": "float64"}, {"dtype": 5}, {"dtype": None}, {"dtype": "int16"},
    {"format": _DROP}, {"format": "float64"}, {"format": 3}, {"format": None},
    {"pipeline": _DROP}, {"pipeline": None}, {"pipeline": []}, {"pipeline": "serialize"}, {"pipeline": [[]]},
    {"pipeline": [{"id": "serialize", "checksum": False}, {"id": "serialize", "checksum": False}]},
    {"pipeline": [{"id": "exponent_split"}]}, {"pipeline": [{"id": "no_such_stage"}]},
    {"pipeline": [{"id": ["serialize"]}]}, {"pipeline": [{"id": {"a": 1}}]},
    {"pipeline": [{"id": "serialize", "checksum": "yes"}]},
])
def test_forged_meta_values(name, changes):
    assert_rejected(forge_meta(name, **changes))


@pytest.mark.parametrize("name", ALL_KINDS)
def test_n_and_shape_consistent_but_wrong(name):
    blob, _, _ = BASE[name]
    meta = unpack(blob)[0]
    n = meta["n"]
    split = "esc_count" in {s[0] for s in unpack(blob)[2]} or name == "fp16 split-only"
    for n2 in (0, max(0, n - 1), n + 1, n + 8, 2 * n + 64):
        if n2 == n:
            continue
        forged = forge_meta(name, n=n2, shape=[n2])
        if split and name != "fp16 split-only" and (n2 + 7) // 8 == (n + 7) // 8:
            # Same number of 8-value groups: the streams fit n2 as well (the dropped value was in
            # the padding of the last group); a consistent blob of other values, not an error.
            assert_rejected_or_sane(forged)
        else:
            assert_rejected(forged)
    # Same n, other shapes: harmless, decodes to that shape.
    out = kvzip.decompress(forge_meta(name, shape=[1, n, 1]))
    assert out.shape == (1, n, 1)


@pytest.mark.parametrize("name", ["bf16 listed escapes", "e4m3 stored", "fp16 split-only"])
@pytest.mark.parametrize("dtype,fmt", [("float16", "fp16"), ("bfloat16", "fp16"), ("float32", "fp32"),
                                       ("float8_e5m2", "e5m2"), ("float8_e4m3fn", "e4m3"), ("bfloat16", "bf16"),
                                       ("float16", "e5m2")])
def test_forged_dtype_and_format(name, dtype, fmt):
    blob, _, own = BASE[name]
    meta = unpack(blob)[0]
    if (dtype, fmt) == (meta["dtype"], meta["format"]):
        return
    b = forge_meta(name, dtype=dtype, format=fmt)
    same_width = FORMATS[fmt].itemsize == FORMATS[own].itemsize and FORMATS[fmt].dtype_name == dtype
    if same_width and kvzip.info(blob)["stored_raw"]:
        # Stored raw values reinterpreted as another format of the same width: decodes, garbage in,
        # garbage out, but never a crash.
        assert_rejected_or_sane(b)
    else:
        assert_rejected(b)


def test_shape_with_too_many_dimensions():
    blob, _, _ = BASE["bf16 listed escapes"]
    b = forge_meta("bf16 listed escapes", shape=[3000] + [1] * 70)
    assert_rejected(b)


# --------------------------------------------------------------------------- huge forged n
def _huge(name, n, shape=None):
    return forge_meta(name, n=n, shape=[n] if shape is None else shape)


@pytest.mark.parametrize("name", ["fp16 split-only", "e4m3 stored"])
def test_huge_n_rejected_quickly_stages_without_chunks(name):
    for n in (2**40, 2**60, 2**62):
        t = time.perf_counter()
        assert_rejected(_huge(name, n))
        assert time.perf_counter() - t < 2.0


@pytest.mark.parametrize("name", ["bf16 listed escapes", "e5m2 plane and listed +checksum"])
def test_huge_n_rejected_quickly(name):
    for n in (2**60, 2**62):
        t = time.perf_counter()
        assert_rejected(_huge(name, n))
        assert time.perf_counter() - t < 2.0


def test_forged_n_never_drives_a_large_allocation():
    blob, _, _ = BASE["bf16 listed escapes"]
    meta, flags, streams = unpack(blob)
    meta = json.loads(json.dumps(meta))
    for st_ in meta["pipeline"]:
        if st_["id"] == "escape_stream":
            st_["chunk"] = 8
    meta["n"], meta["shape"] = 2**28, [2**28]
    forged = rebuild(meta, streams, flags)
    for name, dec in DECODERS.items():
        tracemalloc.start()
        try:
            with pytest.raises(FormatError):
                dec(forged)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 16 << 20, f"{name}: decoding a forged header allocated {peak / 2**20:.0f} MiB"


# --------------------------------------------------------------------------- forged codebook
CB_CASES = {
    "duplicates": lambda cb: dict(cb, exponents=[cb["exponents"][0]] * 16),
    "one duplicate": lambda cb: dict(cb, exponents=cb["exponents"][:15] + [cb["exponents"][0]]),
    "out of range": lambda cb: dict(cb, exponents=cb["exponents"][:15] + [1 << 8]),
    "negative": lambda cb: dict(cb, exponents=cb["exponents"][:15] + [-1]),
    "15 entries": lambda cb: dict(cb, exponents=cb["exponents"][:15]),
    "17 entries": lambda cb: dict(cb, exponents=cb["exponents"] + [1]),
    "float entry": lambda cb: dict(cb, exponents=cb["exponents"][:15] + [1.5]),
    "bool entry": lambda cb: dict(cb, exponents=cb["exponents"][:15] + [True]),
    "string entry": lambda cb: dict(cb, exponents=cb["exponents"][:15] + ["7"]),
    "wrong format": lambda cb: dict(cb, format="fp16", exponents=list(range(16))),
    "unknown format": lambda cb: dict(cb, format="fp64"),
    "no format": lambda cb: {k: v for k, v in cb.items() if k != "format"},
    "no exponents": lambda cb: {k: v for k, v in cb.items() if k != "exponents"},
    "unknown key": lambda cb: dict(cb, extra=1),
    "name not str": lambda cb: dict(cb, name=5),
    "exponents not list": lambda cb: dict(cb, exponents="0123456789abcdef"),
    "not a dict": lambda cb: [1, 2, 3],
    "null": lambda cb: None,
}


@pytest.mark.parametrize("name", ["bf16 listed escapes", "bf16 plane-coded +checksum", "e5m2 plane and listed"])
@pytest.mark.parametrize("case", list(CB_CASES))
def test_forged_codebook(name, case):
    blob = BASE[name][0]
    meta, flags, streams = unpack(blob)
    cb = CB_CASES[case](json.loads(json.dumps(meta["codebook"])))
    if case == "out of range" and meta["format"] == "e5m2":
        cb["exponents"][-1] = 32
    if case == "wrong format" and meta["format"] == "fp16":
        cb["format"] = "bf16"
    meta["codebook"] = cb
    assert_rejected(rebuild(meta, streams, flags))
    meta.pop("codebook")
    assert_rejected(rebuild(meta, streams, flags))


def test_forged_codebook_in_pipeline_config():
    """The codebook recorded in the pipeline config is checked too (it is parsed to rebuild the stage)."""
    blob = BASE["bf16 listed escapes"][0]
    meta, flags, streams = unpack(blob)
    for bad in ({"format": "bf16", "exponents": [1] * 16}, "no-such-codebook", 5, {"format": "bf16"}):
        m = json.loads(json.dumps(meta))
        m["pipeline"][1]["codebook"] = bad
        assert_rejected(rebuild(m, streams, flags))


# --------------------------------------------------------------------------- forged chunk
@pytest.mark.parametrize("chunk", [0, 7, 9, 4, 6, 2**17, 2**16 + 8, -256, 256.0, "256", None, True, [256]])
def test_forged_chunk(chunk):
    blob = BASE["bf16 listed escapes"][0]
    meta, flags, streams = unpack(blob)
    meta["pipeline"][2]["chunk"] = chunk
    assert_rejected(rebuild(meta, streams, flags))


def test_other_valid_chunk_with_same_streams_is_rejected():
    """A valid chunk size other than the encoder's changes the chunk count: esc_count no longer fits."""
    blob = BASE["bf16 listed escapes"][0]
    meta, flags, streams = unpack(blob)
    for chunk in (8, 128, 512, 4096, 65536):
        meta["pipeline"][2]["chunk"] = chunk
        assert_rejected(rebuild(meta, streams, flags))


# --------------------------------------------------------------------------- forged escape streams
def _escape_blob(name="bf16 listed escapes"):
    blob, bits, fmt = BASE[name]
    meta, flags, streams = unpack(blob)
    return meta, flags, streams, FORMATS[meta["format"]]


def _chunk_of(meta):
    return next(s["chunk"] for s in meta["pipeline"] if s["id"] == "escape_stream")


def _cap(fmt, chunk, n, c):
    values = min(chunk, n - c * chunk)
    return fmt.high_exp_bits * (-(-values // 8)) // 3


@pytest.mark.parametrize("name", ["bf16 listed escapes", "fp32 escapes", "e5m2 plane and listed"])
def test_escape_count_over_capacity(name):
    meta, flags, streams, fmt = _escape_blob(name)
    counts = stream_array(streams, "esc_count")
    pos, exp = stream_array(streams, "esc_pos"), stream_array(streams, "esc_exp")
    C = _chunk_of(meta)
    c = int(np.flatnonzero(counts != 0xFFFF)[0])
    cap = _cap(fmt, C, meta["n"], c)
    before = int(counts[:c][counts[:c] != 0xFFFF].sum())
    extra = cap + 1 - int(counts[c])
    counts[c] = cap + 1
    # keep the totals consistent: add entries for chunk c (increasing positions, valid exponents)
    have = pos[before:before + cap + 1 - extra]
    new_pos = np.setdiff1d(np.arange(min(C, meta["n"] - c * C)), have)[:extra]
    chunk_pos = np.sort(np.concatenate([have, new_pos])).astype(np.uint16)
    pos2 = np.concatenate([pos[:before], chunk_pos, pos[before + int(len(have)):]]).astype(np.uint16)
    exp2 = np.concatenate([exp[:before], np.full(len(chunk_pos), 3, np.uint8), exp[before + int(len(have)):]])
    s = with_stream(streams, "esc_count", counts.tobytes())
    s = with_stream(s, "esc_pos", pos2.tobytes())
    s = with_stream(s, "esc_exp", exp2.astype(np.uint8).tobytes())
    assert_rejected(rebuild(meta, s, flags))


@pytest.mark.parametrize("name", ["bf16 listed escapes", "fp32 escapes", "e5m2 plane and listed"])
def test_escape_totals_disagree_with_streams(name):
    meta, flags, streams, fmt = _escape_blob(name)
    counts = stream_array(streams, "esc_count")
    pos, exp = stream_array(streams, "esc_pos"), stream_array(streams, "esc_exp")
    assert pos.size > 0
    c = int(np.flatnonzero((counts != 0xFFFF) & (counts > 0))[0])
    for delta in (-1, +1):
        cc = counts.copy()
        cc[c] = int(cc[c]) + delta
        assert_rejected(rebuild(meta, with_stream(streams, "esc_count", cc.tobytes()), flags))
    # streams one entry short / long, counts unchanged
    for p, e in ((pos[:-1], exp[:-1]), (np.append(pos, pos[-1]), np.append(exp, exp[-1])), (pos, exp[:-1]),
                 (pos[:-1], exp)):
        s = with_stream(with_stream(streams, "esc_pos", p.astype(np.uint16).tobytes()), "esc_exp",
                        e.astype(np.uint8).tobytes())
        assert_rejected(rebuild(meta, s, flags))


@pytest.mark.parametrize("name", ["bf16 listed escapes", "fp32 escapes", "e5m2 plane and listed"])
def test_escape_position_outside_chunk(name):
    meta, flags, streams, fmt = _escape_blob(name)
    counts = stream_array(streams, "esc_count")
    pos = stream_array(streams, "esc_pos")
    C, n = _chunk_of(meta), meta["n"]
    listed = np.where(counts == 0xFFFF, 0, counts)
    owner = np.repeat(np.arange(counts.size), listed)
    # the last escape of its chunk moved to the chunk length, and to 0xFFFF
    k = int(np.flatnonzero(np.append(owner[1:] != owner[:-1], True))[0])
    length = min(C, n - owner[k] * C)
    for bad in (length, 0xFFFF, C):
        p = pos.copy()
        p[k] = min(bad, 0xFFFF)
        assert_rejected(rebuild(meta, with_stream(streams, "esc_pos", p.tobytes()), flags))
    # an escape in the last, partial chunk of a tensor whose length is not a multiple of the chunk
    bits = kt.kv_like_bits(fmt, 1000, seed=1)
    e_out = np.setdiff1d(np.arange(1 << fmt.exp_bits), kvzip.Codebook.default_for(fmt).exponents)[0]
    bits[995] = (int(bits[995]) & ~(((1 << fmt.exp_bits) - 1) << fmt.mant_bits)) | (int(e_out) << fmt.mant_bits)
    blob = bytes(kvzip.compress(bits, None, dtype=fmt.name, chunk=256))  # the shipped codebook: e_out escapes
    m, f, s = unpack(blob)
    assert stream_array(s, "esc_pos").tolist() == [995 - 768]
    for bad in (1000 - 768, 255):  # inside a full chunk's range, outside this chunk's 232 values
        assert_rejected(rebuild(m, with_stream(s, "esc_pos", np.array([bad], np.uint16).tobytes()), f))


@pytest.mark.parametrize("name", ["bf16 listed escapes", "fp32 escapes"])
def test_escape_positions_not_increasing(name):
    meta, flags, streams, fmt = _escape_blob(name)
    counts = stream_array(streams, "esc_count")
    pos = stream_array(streams, "esc_pos")
    listed = np.where(counts == 0xFFFF, 0, counts)
    starts = np.cumsum(listed) - listed
    c = int(np.flatnonzero(listed >= 2)[0])
    k = int(starts[c])
    for swap in ("duplicate", "reverse"):
        p = pos.copy()
        if swap == "duplicate":
            p[k + 1] = p[k]
        else:
            p[k], p[k + 1] = p[k + 1], p[k]
        assert_rejected(rebuild(meta, with_stream(streams, "esc_pos", p.tobytes()), flags))


@pytest.mark.parametrize("name", ["fp16 escape-free", "e5m2 plane and listed"])
def test_escaped_exponent_out_of_range(name):
    """fp16 / e5m2 have 5-bit exponents: a uint8 escape exponent >= 32 is impossible."""
    blob, bits, fmt = BASE[name]
    fmt = FORMATS[fmt]
    if name == "fp16 escape-free":
        bits = bits.copy()
        bits[10] = (int(bits[10]) & 0x83FF) | (1 << 10)  # exponent 1: not in the fp16 codebook
        blob = bytes(kvzip.compress(bits, dtype="fp16", chunk=512))
    meta, flags, streams = unpack(blob)
    exp = stream_array(streams, "esc_exp")
    assert exp.size > 0
    for bad in (32, 200, 255):
        e = exp.copy()
        e[0] = bad
        assert_rejected(rebuild(meta, with_stream(streams, "esc_exp", e.tobytes()), flags))


@pytest.mark.parametrize("name", ["bf16 plane-coded", "e5m2 plane and listed"])
def test_plane_chunks_with_short_or_long_exp_high(name):
    meta, flags, streams, fmt = _escape_blob(name)
    high = stream_array(streams, "exp_high")
    assert high.size > 0
    for h in (high[:-1], high[:0], np.append(high, 0).astype(np.uint8)):
        assert_rejected(rebuild(meta, with_stream(streams, "exp_high", h.tobytes()), flags))
    # a listed chunk re-marked as plane-coded, exp_high unchanged (now too short)
    counts = stream_array(streams, "esc_count")
    c = int(np.flatnonzero(counts == 0)[0])
    counts[c] = 0xFFFF
    assert_rejected(rebuild(meta, with_stream(streams, "esc_count", counts.tobytes()), flags))
    # every chunk plane-coded, no exp_high at all
    counts[:] = 0xFFFF
    s = with_stream(with_stream(streams, "esc_count", counts.tobytes()), "exp_high", b"")
    assert_rejected(rebuild(meta, s, flags))


def test_plane_marker_on_e4m3_like_zero_capacity():
    """e4m3 has no high exponent bits: any listed escape is over capacity."""
    bits = kt.kv_like_bits("e4m3", 4096, seed=1)
    cb = kvzip.Codebook(list(range(16)), "e4m3")
    pipe = kvzip.Pipeline([S.ExponentSplit(), S.Top16Pack(cb), S.EscapeStream(256), S.Serialize()])
    frame_blob = bytes(kvzip.Pipeline([S.ExponentSplit(), S.Serialize()]).encode(bits, dtype="e4m3"))
    assert kvzip.info(frame_blob)["streams"]  # split-only blob exists; now forge a SplitZip one by hand
    n = bits.size
    meta = {"codebook": {"name": None, "format": "e4m3", "exponents": list(range(16))}, "dtype": "float8_e4m3fn",
            "format": "e4m3", "n": n, "shape": [n], "pipeline": pipe.to_config()["stages"]}
    codes = ((bits >> 3) & 15).astype(np.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).astype(np.uint8)
    rest = (((bits >> 7) << 3) | (bits & 7)).astype(np.uint8)
    rest_packed = (rest[0::2] | (rest[1::2] << 4)).astype(np.uint8)
    counts = np.zeros(16, np.uint16)
    good = [("codes", "uint8", packed.tobytes()), ("rest", "uint8", rest_packed.tobytes()),
            ("esc_count", "uint16", counts.tobytes()), ("esc_pos", "uint16", b""), ("esc_exp", "uint8", b""),
            ("exp_high", "uint8", b"")]
    np.testing.assert_array_equal(kvzip.decompress(rebuild(meta, good, 0)).view(np.uint8), bits)
    counts[3] = 1
    bad = with_stream(with_stream(with_stream(good, "esc_count", counts.tobytes()), "esc_pos",
                                  np.array([5], np.uint16).tobytes()), "esc_exp", b"\x02")
    assert_rejected(rebuild(meta, bad, 0))


# --------------------------------------------------------------------------- forged streams
@pytest.mark.parametrize("name", ["bf16 listed escapes", "bf16 plane-coded +checksum", "fp16 split-only", "e4m3 stored",
                                  "quantize e5m2"])
def test_stream_missing_extra_retyped_resized(name):
    if name not in BASE:
        pytest.skip("QuantizeFP8 has not landed")
    meta, flags, streams = unpack(BASE[name][0])
    for sname, dt, b in streams:
        assert_rejected(rebuild(meta, with_stream(streams, sname, drop=True), flags))
        item = np.dtype(container.STREAM_DTYPES[dt]).itemsize
        if len(b) >= item:
            assert_rejected(rebuild(meta, with_stream(streams, sname, b[:-item]), flags))
        assert_rejected(rebuild(meta, with_stream(streams, sname, b + bytes(item)), flags))
        for other in ("uint8", "uint16", "uint32", "float32"):
            osize = np.dtype(container.STREAM_DTYPES[other]).itemsize
            if other != dt and len(b) % osize == 0 and (len(b) or other != "uint8"):
                assert_rejected(rebuild(meta, with_stream(streams, sname, dtype=other), flags))
    assert_rejected(rebuild(meta, streams + [("zzz", "uint8", b"\x01")], flags))
    assert_rejected(rebuild(meta, streams + [("blob", "uint8", b"\x01")], flags))
    assert_rejected(rebuild(meta, [], flags))


@pytest.mark.parametrize("extra", ["data", "exponent"])
def test_stray_intermediate_stream_is_rejected(extra):
    meta, flags, streams = unpack(BASE["bf16 listed escapes"][0])
    assert_rejected(rebuild(meta, streams + [(extra, "uint8", b"\x01")], flags))


def test_split_only_streams_out_of_range():
    meta, flags, streams = unpack(BASE["fp16 split-only"][0])
    e = stream_array(streams, "exponent")
    e[0] = 32
    assert_rejected(rebuild(meta, with_stream(streams, "exponent", e.tobytes()), flags))
    r = stream_array(streams, "rest")
    r[-1] = 1 << 11
    assert_rejected(rebuild(meta, with_stream(streams, "rest", r.tobytes()), flags))


def test_forged_quantize_metadata():
    if "quantize e5m2" not in BASE:
        pytest.skip("QuantizeFP8 has not landed")
    meta, flags, streams = unpack(BASE["quantize e5m2"][0])
    for key, val in (("quantize_fp8", None), ("quantize_fp8", {"source_format": "e5m2"}),
                     ("quantize_fp8", {"source_format": 3}), ("quantize_fp8", []), ("format", "bf16"),
                     ("dtype", "float8_e5m2")):
        m = json.loads(json.dumps(meta))
        m[key] = val
        assert_rejected(rebuild(m, streams, flags))
    m = json.loads(json.dumps(meta))
    m["pipeline"][0]["format"] = "e4m3"
    assert_rejected(rebuild(m, streams, flags))
    m = json.loads(json.dumps(meta))
    m["pipeline"][0]["granularity"] = "tensor"  # 64 channel scales, one expected
    assert_rejected(rebuild(m, streams, flags))


# --------------------------------------------------------------------------- info() on hostile blobs
@pytest.mark.parametrize("name", ["bf16 listed escapes", "e4m3 stored"])
def test_info_rejects_structural_damage(name):
    blob = BASE[name][0]
    for bad in (blob[:-1], blob[:47], b"", reseal(blob[:8] + b"\x03\x00" + blob[10:])):
        with pytest.raises(FormatError):
            kvzip.info(bad)


@pytest.mark.parametrize("changes", [{"dtype": "float64"}, {"n": _DROP}, {"n": "x"}, {"dtype": _DROP}])
def test_info_on_forged_metadata_raises_format_error(changes):
    b = forge_meta("bf16 listed escapes", **changes)
    with pytest.raises(FormatError):
        kvzip.info(b)


# --------------------------------------------------------------------------- structured fuzz
def mutate(rng, blob: bytes) -> bytes:
    """One random structural forgery of a valid blob, resealed (valid CRC and payload checksum)."""
    meta, flags, streams = unpack(blob)
    meta = json.loads(json.dumps(meta))
    streams = list(streams)
    kind = rng.integers(0, 12)
    if kind <= 2 and streams:  # overwrite content of a stream
        k = rng.integers(len(streams))
        n, d, b = streams[k]
        b = bytearray(b)
        if b:
            for _ in range(rng.integers(1, 9)):
                b[rng.integers(len(b))] = rng.integers(256)
        streams[k] = (n, d, bytes(b))
    elif kind == 3 and streams:  # resize a stream
        k = rng.integers(len(streams))
        n, d, b = streams[k]
        item = np.dtype(container.STREAM_DTYPES[d]).itemsize
        delta = int(rng.integers(-4, 5)) * item
        b = b[:max(0, len(b) + delta)] if delta < 0 else b + rng.integers(0, 256, delta, dtype=np.uint8).tobytes()
        streams[k] = (n, d, b)
    elif kind == 4 and "esc_count" in {s[0] for s in streams}:  # counts and positions
        c = stream_array(streams, "esc_count")
        if c.size:
            c[rng.integers(c.size)] = rng.choice([0, 1, 2, 7, 0xFFFF, 0xFFFE, int(rng.integers(0, 1 << 16))])
        p = stream_array(streams, "esc_pos")
        if p.size:
            p[rng.integers(p.size)] = rng.integers(0, 1 << 16)
        streams = with_stream(with_stream(streams, "esc_count", c.tobytes()), "esc_pos", p.tobytes())
    elif kind == 5:  # n / shape
        n2 = int(rng.integers(0, 2 * meta["n"] + 64))
        meta["n"], meta["shape"] = n2, [n2]
    elif kind == 6:  # pipeline parameters
        for s in meta.get("pipeline", []):
            if s["id"] == "escape_stream":
                s["chunk"] = int(rng.choice([8, 16, 64, 256, 1024, 65536]))
            if s["id"] == "quantize_fp8" and rng.integers(2):
                s["granularity"] = str(rng.choice(["tensor", "channel"]))
    elif kind == 7 and isinstance(meta.get("codebook"), dict):  # codebook: a valid but different one
        fmt = FORMATS[meta["codebook"]["format"]]
        meta["codebook"]["exponents"] = [int(v) for v in rng.permutation(1 << fmt.exp_bits)[:16]]
    elif kind == 8:  # another valid pipeline recorded for the same streams
        meta["pipeline"] = [s.get_config() for s in PIPELINE_SWAPS[rng.integers(len(PIPELINE_SWAPS))]]
    elif kind == 9 and streams:  # a stream retyped (lengths kept where the width allows)
        k = rng.integers(len(streams))
        n, d, b = streams[k]
        d2 = str(rng.choice(sorted(container.STREAM_DTYPES)))
        size = np.dtype(container.STREAM_DTYPES[d2]).itemsize
        streams[k] = (n, d2, b[:len(b) // size * size])
    elif kind == 10 and len(streams) > 1:  # streams in another order (offsets still increasing)
        streams = [streams[i] for i in rng.permutation(len(streams))]
    else:  # format / dtype swap
        f = FORMATS[str(rng.choice(list(FORMATS)))]
        if rng.integers(2):
            meta["format"] = f.name
        else:
            meta["dtype"] = f.dtype_name
    return rebuild(meta, streams, flags)


PIPELINE_SWAPS = [
    [S.Serialize()], [S.ExponentSplit(), S.Serialize()],
    [S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(8), S.Serialize()],
    [S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(256), S.Serialize(True)],
] + ([] if kt.quantize_fp8_available() is None else [
    [kt.quantize_fp8_available()("e5m2"), S.Serialize()],
    [kt.quantize_fp8_available()("e4m3", "channel"), S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(), S.Serialize()],
])


def _fuzz(seed: int, rounds: int, decoders=None):
    """Run ``rounds`` random forgeries; return a list of (case, description) failures."""
    rng = np.random.default_rng(seed)
    decoders = decoders or DECODERS
    failures = []
    for r in range(rounds):
        name = BASE_NAMES[rng.integers(len(BASE_NAMES))]
        forged = mutate(rng, BASE[name][0])
        for _ in range(rng.integers(0, 2)):
            forged = mutate(rng, forged)
        meta = container.parse_header(forged, len(forged)).meta
        for dname, dec in decoders.items():
            try:
                out = dec(forged)
            except FormatError:
                continue
            except Exception as e:  # noqa: BLE001 - anything else is the failure we look for
                failures.append((r, name, dname, f"{type(e).__name__}: {e}"))
                continue
            if not (isinstance(out, np.ndarray) and list(out.shape) == meta["shape"] and out.dtype.name == meta["dtype"]):
                failures.append((r, name, dname, f"returned {type(out).__name__} {getattr(out, 'shape', '')}"))
    return failures


@settings(max_examples=examples(60))
@given(seed=st.integers(0, 2**32 - 1))
def test_structured_fuzz(seed):
    failures = _fuzz(seed, 40)
    assert not failures, failures[:5]


def test_structured_fuzz_with_numba_boundscheck():
    """The same fuzz in a fresh process whose Numba kernels check every index: a validation gap
    shows up as IndexError rather than as a silent out-of-bounds access."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import test_corruption as t; "
            "f = t._fuzz(12345, int(sys.argv[1])); print('FAILURES', len(f)); [print(x) for x in f[:20]]; "
            "sys.exit(1 if f else 0)")
    env = dict(os.environ, NUMBA_BOUNDSCHECK="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    rounds = str(examples(3000))
    p = subprocess.run([sys.executable, "-c", code, rounds], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "FAILURES 0" in p.stdout
