"""The compact (version-2) header, docs/format.md section 13: its fields as the spec gives them
(read here with struct, independently of kvzip/container.py), the choice between it and the
version-1 header, that it stands for exactly the version-1 header of the same blob, and the
reader's refusals."""
from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

import kvzip
from kvzip import container, layout
from kvzip import testing as kt
from kvzip.auto_codebook import auto_codebook
from kvzip.errors import FormatError

SPEC = struct.Struct("<8sHHI8sQIIIBBBB16s")  # docs/format.md 13.1, written out
CODES = {"bf16": 1, "fp16": 2, "fp32": 3, "e4m3": 4, "e5m2": 5}


def fields(blob) -> dict:
    names = ("magic", "version", "flags", "header_len", "shape", "checksum", "escapes", "high_bytes", "crc", "dtype",
             "chunk_log2", "ndim", "source", "codebook")
    return dict(zip(names, SPEC.unpack_from(bytes(blob))))


def leb128_reference(sides) -> bytes:
    out = b""
    for v in sides:
        while v >= 0x80:
            out += bytes([v & 0x7F | 0x80])
            v >>= 7
        out += bytes([v])
    return out


def same_bits(out, bits):
    out = np.asarray(out)
    assert out.shape == bits.shape
    np.testing.assert_array_equal(out.view(bits.dtype), bits)


def page(seed=0):
    return kt.kv_like_bits("bf16", 16 * 8 * 128, escape_rate=0.002, seed=seed).reshape(16, 8, 128)


CASES = [
    ("bf16 page", "bf16", page, {}),
    ("bf16 checksum", "bf16", page, {"checksum": True}),
    ("bf16 shipped codebook", "bf16", page, {"codebook": None}),
    ("fp32 5-D chunk 64", "fp32", lambda: kt.kv_like_bits("fp32", 720, seed=2).reshape(2, 3, 4, 5, 6), {"chunk": 64}),
    ("e5m2 plane", "e5m2", lambda: np.concatenate([kt.kv_like_bits("e5m2", 4096, seed=3), np.full(256, 0x7D, np.uint8)]),
     {"chunk": 256}),
    ("e4m3 stored", "e4m3", lambda: np.arange(1000, dtype=np.uint8), {"checksum": True}),
    ("fp16 empty", "fp16", lambda: np.zeros((0, 4), np.uint16), {}),
    ("fp16 0-d", "fp16", lambda: np.array(0x3C00, np.uint16), {}),
    ("bf16 big side", "bf16", lambda: kt.kv_like_bits("bf16", 40_000, seed=4).reshape(1, 40_000), {}),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fields_as_the_spec_says(case):
    _, fmt, make, kw = case
    x = make()
    blob = bytes(kvzip.compress(x, dtype=fmt, **kw))
    f = fields(blob)
    assert f["magic"] == b"KVZIP\x00\r\n" and f["version"] == 2 and f["header_len"] == 64
    assert (len(blob) - 64) % 16 == 0
    assert f["shape"] == leb128_reference(x.shape).ljust(8, b"\0") and f["ndim"] == x.ndim
    assert f["dtype"] == CODES[fmt]
    raw = bytearray(blob[:64])
    raw[40:44] = bytes(4)
    assert zlib.crc32(raw) == f["crc"]
    v1 = kt.version1(blob)
    hdr1 = container.parse_header(v1, len(v1))
    info = kvzip.info(blob)
    sizes = ("compressed_bytes", "ratio")
    assert {k: v for k, v in info.items() if k not in sizes} == {k: v for k, v in kvzip.info(v1).items() if k not in sizes}
    assert info["compressed_bytes"] == len(blob)  # it stands for exactly the version-1 header
    assert v1[hdr1.header_len:] == blob[64:]  # and the payload is the same
    if info["stored_raw"]:
        assert f["flags"] & 2 and (f["chunk_log2"], f["escapes"], f["high_bytes"], f["source"]) == (0, 0, 0, 0)
        assert f["codebook"] == bytes(16)
    else:
        assert 1 << f["chunk_log2"] == kw.get("chunk", 4096)
        assert f["escapes"] == info["escapes"] and f["escapes"] * 2 == info["streams"]["esc_pos"]
        assert f["high_bytes"] == info["streams"]["exp_high"]
        if kw.get("codebook", "auto") == "auto":  # the default: the tensor's own (source 3)
            want = auto_codebook(np.ascontiguousarray(x).reshape(-1), fmt)
            assert list(f["codebook"]) == list(want.exponents) and f["source"] == 3
        else:  # None: the shipped default (source 0)
            assert list(f["codebook"]) == list(kvzip.Codebook.default_for(fmt).exponents) and f["source"] == 0
    assert bool(f["flags"] & 1) == kw.get("checksum", False)
    if not kw.get("checksum"):
        assert f["checksum"] == 0
    same_bits(kvzip.decompress(blob), x)
    same_bits(kvzip.decompress(v1), x)


def test_leb128_round_trip_and_shortest_form():
    for sides in [(), (0,), (1,), (127,), (128,), (16, 8, 128), (2**28 - 1,), (2**32 + 5, 3)]:
        enc = layout.leb128(sides)
        assert enc == leb128_reference(sides)
        assert layout.unleb128(enc, len(sides)) == (sides, len(enc))
    assert layout.unleb128(b"\x80\x00", 1) is None  # 0 in two bytes: not the shortest form
    assert layout.unleb128(b"\x80", 1) is None  # ends inside a number
    assert layout.unleb128(b"\x81\x00", 1) is None


def test_page_is_small():
    """A 32 KB BF16 page (16 tokens x 8 heads x 128) spends 64 bytes on its header."""
    x = page()
    blob = kvzip.compress(x, dtype="bf16")
    assert bytes(blob[8:10]) == b"\x02\x00"
    v1 = kt.version1(blob)
    assert len(v1) - len(blob) > 400  # what the JSON header cost
    assert x.nbytes / len(blob) > 1.31


@pytest.mark.parametrize("source, codebook", [(0, None), (2, "bf16-kv"),
                                              (1, kvzip.Codebook(kvzip.Codebook.default_for("bf16").exponents, "bf16"))])
def test_codebook_sources_record_the_configuration(source, codebook):
    x = page()
    blob = kvzip.compress(x, dtype="bf16", codebook=codebook)
    assert fields(blob)["source"] == source
    want = kvzip.info(kt.version1(blob))
    assert kvzip.info(blob)["pipeline"] == want["pipeline"] and kvzip.info(blob)["codebook"] == want["codebook"]
    # The same configuration as a version-1 writer recorded: build that one and compare.
    pipe = kvzip.Pipeline.from_config(kvzip.info(blob)["pipeline"])
    assert bytes(pipe.encode(x, dtype="bf16")) == bytes(blob)


def test_own_codebook_rides_in_the_header():
    x = page()
    exps = (126, 127, 125, 128, 124, 123, 122, 129, 121, 120, 130, 119, 118, 117, 0, 116)  # last two swapped
    blob = kvzip.compress(x, dtype="bf16", codebook=kvzip.Codebook(exps, "bf16"))
    assert fields(blob)["codebook"] == bytes(exps) and fields(blob)["source"] == 1
    same_bits(kvzip.decompress(blob), x)


@pytest.mark.parametrize("why, make", [
    ("a named codebook", lambda x: kvzip.compress(x, dtype="bf16", codebook=kvzip.Codebook(
        kvzip.Codebook.default_for("bf16").exponents, "bf16", name="mine"))),
    ("nine sides", lambda x: kvzip.compress(x.reshape((1,) * 8 + (-1,)), dtype="bf16")),
    ("a custom pipeline", lambda x: kvzip.Pipeline([kvzip.stages.ExponentSplit(), kvzip.stages.Serialize()]).encode(
        x, dtype="bf16")),
])
def test_other_blobs_keep_version1(why, make):
    blob = make(page())
    assert bytes(blob[8:10]) == b"\x01\x00", why
    kvzip.decompress(blob)


def test_writer_refuses_what_it_cannot_hold():
    blob = bytes(kvzip.compress(page(), dtype="bf16"))
    hdr = container.parse_header(blob, len(blob))
    streams = [(name, dt, nb) for name, dt, _, nb in hdr.streams]
    assert container.compact_header(hdr.meta, streams, hdr.flags) == blob[:64]
    big = dict(hdr.meta, shape=[1 << 16, 1 << 16], n=1 << 32)
    assert container.compact_header(big, streams, hdr.flags) is None  # n >= 2**32
    extra = dict(hdr.meta, note="x")
    assert container.compact_header(extra, streams, hdr.flags) is None  # a key it cannot hold
    assert container.compact_header(hdr.meta, streams[:-1] + [("exp_high", "uint16", 16)], hdr.flags) is None


def _forged(blob, at, fmt, value) -> bytes:
    raw = bytearray(blob)
    struct.pack_into(fmt, raw, at, value)
    return kt.reseal(raw)


@pytest.mark.parametrize("what, at, fmt, value, message", [
    ("header length", 12, "<I", 80, "header length"),
    ("shape not shortest", 16, "<Q", 0x0080, "shape"),
    ("shape trailing bytes", 23, "<B", 7, "shape"),
    ("shape past its field", 16, "<Q", 0x8080808080808080, "shape"),
    ("shape of 2**32 values", 16, "<Q", int.from_bytes(leb128_reference((1 << 16, 1 << 16, 1)), "little"), "2\\*\\*32"),
    ("dtype code", 44, "<B", 9, "dtype code"),
    ("chunk log2 small", 45, "<B", 2, "chunk"),
    ("chunk log2 large", 45, "<B", 17, "chunk"),
    ("codebook source", 47, "<B", 4, "codebook source"),
    ("repeated exponent", 49, "<B", 126, "codebook"),
    ("escape count", 32, "<I", 5, "payload"),
    ("exp_high bytes", 36, "<I", 4096, "payload"),
    ("checksum without flag", 24, "<Q", 1, "checksum"),
    ("unknown flag", 10, "<H", 4, "flags"),
])
def test_reader_refuses_forgeries(what, at, fmt, value, message):
    blob = bytes(kvzip.compress(page(), dtype="bf16"))
    bad = _forged(blob, at, fmt, value)
    with pytest.raises(FormatError, match=message):
        kvzip.decompress(bad)
    with pytest.raises(FormatError):
        kvzip.info(bad)


def test_reader_refuses_stored_raw_with_split_fields_and_bad_lengths():
    blob = bytes(kvzip.compress(np.arange(1000, dtype=np.uint8), dtype="e4m3"))
    assert fields(blob)["flags"] & 2
    for at, fmt, value in [(45, "<B", 12), (32, "<I", 1), (36, "<I", 1), (47, "<B", 1), (50, "<B", 3)]:
        with pytest.raises(FormatError, match="stored-raw"):
            kvzip.decompress(_forged(blob, at, fmt, value))
    with pytest.raises(FormatError, match="CRC|checksum mismatch"):
        raw = bytearray(blob)
        raw[20] ^= 1
        kvzip.decompress(bytes(raw))
    for cut in (16, 63, 64, len(blob) - 16):
        with pytest.raises(FormatError):
            kvzip.decompress(blob[:cut])
    with pytest.raises(FormatError):
        kvzip.decompress(blob + bytes(16))


@pytest.mark.parametrize("mode", ["speed", "ratio"])
def test_counts_set_on_a_header_are_the_header_of_those_counts(mode):
    """with_counts (what the CPU encode and the ratio mode's GPU encode finish a header with):
    a compact header built with no escapes, its counts and checksum then set, is byte for byte
    the header compact_header builds for those counts; a version-1 header is refused."""
    x = kt.kv_like_bits("bf16", 3 * 4096 + 5, escape_rate=0.01, seed=3)
    blob = np.asarray(kvzip.compress(x, dtype="bf16", mode=mode, checksum=True))
    hdr = container.parse_header(container.read_head(kvzip.backends.get_backend("cpu"), blob), blob.shape[0])
    varying = {"esc_pos", "esc_exp", "exp_high", "sec_codes"}
    streams = [(name, dt, nb) for name, dt, _, nb in hdr.streams]
    none = [(name, dt, 0 if name in varying else nb) for name, dt, nb in streams]
    f = fields(blob)
    sizes = {name: nb for name, _, nb in streams}
    head = container.compact_header(hdr.meta, none, hdr.flags)
    set_ = container.with_counts(head, f["escapes"], f["high_bytes"], sizes.get("sec_codes", 0), f["checksum"])
    assert set_ == bytes(blob[:len(set_)]) == container.compact_header(hdr.meta, streams, hdr.flags, f["checksum"])
    assert f["escapes"] > 0
    with pytest.raises(ValueError, match="version"):
        container.with_counts(container.build_header(hdr.meta, streams, hdr.flags), 1, 1)
