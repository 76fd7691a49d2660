"""The container (kvzip/container.py, docs/format.md): header fields, alignment, stream order,
stream layouts, info(), the checksum flag, sum64 and layout()."""
from __future__ import annotations

import json
import math
import struct
import zlib

import numpy as np
import pytest
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import kvzip
from kvzip import container
from kvzip import stages as S
from kvzip import testing as kt
from kvzip.checksum import sum64
from kvzip.formats import FORMATS

FMTS = list(FORMATS.values())


def parse(blob):
    b = bytes(np.asarray(blob))
    return b, container.parse_header(b, len(b))


def fields(b):
    names = ("magic", "version", "flags", "header_len", "payload_len", "checksum", "meta_len", "nstreams", "crc")
    return dict(zip(names, container.PREFIX.unpack_from(b)))


# --------------------------------------------------------------------------- an independent sum64
M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def _mix(z):
    z = (z + GOLDEN) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def sum64_reference(payload: bytes) -> int:
    """sum64 written from checksum.py's docstring, in plain Python integers."""
    words = struct.unpack(f"<{len(payload) // 8}Q", payload)
    total = sum(_mix((w + i * GOLDEN) & M64) for i, w in enumerate(words)) & M64
    return _mix(total ^ len(payload))


# --------------------------------------------------------------------------- header fields
# (name, format, make input, compress kwargs, stored raw?)
BLOB_CASES = [
    ("bf16 kv", "bf16", lambda: kt.kv_like_bits("bf16", 5000, escape_rate=0.003, seed=1), {}, False),
    ("bf16 kv checksum", "bf16", lambda: kt.kv_like_bits("bf16", 5000, escape_rate=0.003, seed=1), {"checksum": True},
     False),
    ("fp32 5-D", "fp32", lambda: kt.kv_like_bits("fp32", 2 * 3 * 4 * 5 * 6, seed=2).reshape(2, 3, 4, 5, 6),
     {"chunk": 64}, False),
    ("e5m2 plane", "e5m2", lambda: np.concatenate([kt.kv_like_bits("e5m2", 4096, seed=3),
                                                   np.full(256, 0x7D, np.uint8)]), {"chunk": 256}, False),
    ("e4m3 stored", "e4m3", lambda: np.arange(1000, dtype=np.uint8), {"checksum": True}, True),
    ("fp16 empty", "fp16", lambda: np.zeros((0, 4), np.uint16), {}, False),
    ("fp16 0-d", "fp16", lambda: np.array(0x3C00, np.uint16), {}, True),
]


@pytest.mark.parametrize("case", BLOB_CASES, ids=[c[0] for c in BLOB_CASES])
def test_version1_header_fields(case):
    """The version-1 header (docs/format.md sections 2-3) of each case: the one kvzip wrote
    before the compact header, and still writes for blobs the compact one cannot hold."""
    _, fmt, make, kw, stored = case
    x = make()
    b, hdr = parse(kt.version1(kvzip.compress(x, dtype=fmt, **kw)))
    f = fields(b)
    assert f["magic"] == b"KVZIP\x00\r\n" == container.MAGIC
    assert f["version"] == 1 == container.VERSION
    assert f["header_len"] % 16 == 0 and f["header_len"] >= 48
    assert f["payload_len"] % 16 == 0
    assert len(b) == f["header_len"] + f["payload_len"]
    assert b[44:48] == b"\x00" * 4  # reserved
    want_flags = (container.FLAG_CHECKSUM if kw.get("checksum") else 0) | (container.FLAG_STORED if stored else 0)
    assert f["flags"] == want_flags
    if stored:
        assert [s[0] for s in hdr.streams] == ["data"]
        assert hdr.meta["pipeline"] == [{"id": "serialize", "checksum": kw.get("checksum", False)}]
    # CRC-32 of the header with its own field zeroed.
    raw = bytearray(b[:f["header_len"]])
    raw[40:44] = b"\x00" * 4
    assert zlib.crc32(raw) == f["crc"]
    # Metadata: canonical JSON right after the table, zero padding to H.
    text_at = 48 + 16 * f["nstreams"]
    text = b[text_at:text_at + f["meta_len"]]
    doc = json.loads(text)
    assert text == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    assert b[text_at + f["meta_len"]:f["header_len"]] == bytes(f["header_len"] - text_at - f["meta_len"])
    assert f["header_len"] - (text_at + f["meta_len"]) < 16
    assert doc["meta"]["shape"] == list(x.shape) and doc["meta"]["n"] == x.size
    assert doc["meta"]["dtype"] == FORMATS[fmt].dtype_name
    assert len(doc["streams"]) == f["nstreams"]
    # Checksum field.
    payload = b[f["header_len"]:]
    if kw.get("checksum"):
        assert f["checksum"] == sum64_reference(payload) == sum64(np, np.frombuffer(payload, np.uint8))
    else:
        assert f["checksum"] == 0


@pytest.mark.parametrize("case", BLOB_CASES, ids=[c[0] for c in BLOB_CASES])
def test_streams_aligned_ordered_and_zero_padded(case):
    _, fmt, make, kw, _ = case
    b, hdr = parse(kvzip.compress(make(), dtype=fmt, **kw))
    names = [s[0] for s in hdr.streams]
    assert names == container.canonical_order(names)
    end = 0
    for name, dt, off, nb in hdr.streams:
        assert off % 16 == 0 and (hdr.header_len + off) % 16 == 0, name
        assert off == -(-end // 16) * 16  # packed: each stream at the first aligned offset
        assert nb % np.dtype(dt).itemsize == 0
        assert b[hdr.header_len + end: hdr.header_len + off] == bytes(off - end)  # zero padding
        end = off + nb
    assert hdr.payload_len == -(-end // 16) * 16
    assert b[hdr.header_len + end:] == bytes(hdr.payload_len - end)
    offsets, plen = container.layout([s[3] for s in hdr.streams])
    assert offsets == [s[2] for s in hdr.streams] and plen == hdr.payload_len


def test_canonical_order():
    assert container.canonical_order(["exp_high", "zz", "codes", "a", "rest", "data"]) == [
        "data", "codes", "rest", "exp_high", "a", "zz"]
    assert container.canonical_order(list(reversed(container.STREAM_ORDER))) == list(container.STREAM_ORDER)
    assert container.canonical_order([]) == []


def test_splitzip_stream_set_and_order():
    b, hdr = parse(kvzip.compress(kt.kv_like_bits("bf16", 4096, escape_rate=0.01), dtype="bf16"))
    assert [(s[0], s[1]) for s in hdr.streams] == [
        ("codes", "uint8"), ("rest", "uint8"), ("esc_count", "uint16"), ("esc_pos", "uint16"),
        ("esc_exp", "uint8"), ("exp_high", "uint8")]


def _nibbles(codes):
    codes = list(codes) + [0] * (-len(codes) % 8)  # padded to whole groups of 8
    return [codes[2 * i] | (codes[2 * i + 1] << 4) for i in range(len(codes) // 2)]


def test_stream_layouts_by_hand():
    """A bf16 blob whose streams are computed by hand from docs/format.md: codes are 4-bit,
    LSB first; rest is sign<<7 | mantissa; escapes list (position in chunk, exponent)."""
    cb = kvzip.Codebook(list(range(100, 116)), "bf16")
    exps = list(range(100, 116)) + [7, 100, 200, 101] + [100 + (i * 7) % 16 for i in range(181)]  # 201 values
    rest = [(i * 37) & 0xFF for i in range(len(exps))]
    bits = np.array([((r >> 7) << 15) | (e << 7) | (r & 0x7F) for e, r in zip(exps, rest)], np.uint16)
    blob = kvzip.Pipeline([S.ExponentSplit(), S.Top16Pack(cb), S.EscapeStream(16), S.Serialize()]).encode(
        bits, dtype="bf16")
    b, hdr = parse(blob)
    assert not kvzip.info(blob)["stored_raw"]
    v = container.stream_views(kvzip.backends.get_backend("cpu"), np.frombuffer(b, np.uint8), hdr)
    assert v["codes"].tolist() == _nibbles([cb.exponents.index(e) if e in cb.exponents else 0 for e in exps])
    assert v["rest"].tolist() == rest + [0] * (-len(rest) % 8)
    # chunks of 16 (2 groups: room for (E-4) * 2 // 3 = 2 listed escapes): both in chunk 1
    assert v["esc_count"].tolist() == [0, 2] + [0] * 11
    assert v["esc_pos"].tolist() == [0, 2] and v["esc_exp"].tolist() == [7, 200]
    assert v["exp_high"].size == 0
    np.testing.assert_array_equal(kvzip.decompress(blob).view(np.uint16), bits)


def test_plane_coded_chunk_layout_by_hand():
    """A chunk with more escapes than its list may hold: esc_count 0xFFFF, codes = low exponent
    nibbles, exp_high = the other E-4 bits, bit-packed LSB first."""
    cb = kvzip.Codebook(list(range(16)), "e5m2")
    good = np.array([((i * 5) % 16) << 2 | (i & 3) for i in range(4096)], np.uint8)
    exps = [16 + (i * 3) % 16 if i % 3 else i % 16 for i in range(64)]  # 43 of 64 escape; E-4 = 1 high bit
    bad = np.array([(e << 2) | (i & 3) for i, e in enumerate(exps)], np.uint8)
    x = np.concatenate([good, bad])
    blob = kvzip.Pipeline([S.ExponentSplit(), S.Top16Pack(cb), S.EscapeStream(64), S.Serialize()]).encode(
        x, dtype="e5m2")
    b, hdr = parse(blob)
    inf = kvzip.info(blob)
    assert inf["raw_chunks"] == 1 and not inf["stored_raw"], inf
    v = container.stream_views(kvzip.backends.get_backend("cpu"), np.frombuffer(b, np.uint8), hdr)
    assert v["esc_count"].tolist() == [0] * 64 + [0xFFFF]
    assert v["codes"][2048:].tolist() == _nibbles([e & 15 for e in exps])
    high = [(e >> 4) & 1 for e in exps]
    assert v["exp_high"].tolist() == [sum(high[8 * k + j] << j for j in range(8)) for k in range(8)]
    assert v["esc_pos"].size == 0 and v["esc_exp"].size == 0
    np.testing.assert_array_equal(kvzip.decompress(blob).view(np.uint8), x)


# --------------------------------------------------------------------------- info()
@pytest.mark.parametrize("fmt", FMTS, ids=[f.name for f in FMTS])
@pytest.mark.parametrize("chunk", [8, 512, 4096])
def test_info_contents(fmt, chunk):
    cb = kvzip.Codebook.default_for(fmt)
    bits = kt.kv_like_bits(fmt, 6000, escape_rate=0.004, seed=9).reshape(2, 3000)
    blob = kvzip.compress(bits, codebook=None, dtype=fmt.name, chunk=chunk, checksum=True)  # cb's escapes
    inf = kvzip.info(blob)
    b, hdr = parse(blob)
    exps = (bits.ravel().astype(np.uint64) >> fmt.mant_bits) & ((1 << fmt.exp_bits) - 1)
    escaping = ~np.isin(exps, cb.exponents)
    assert inf["dtype"] == fmt.dtype_name and inf["shape"] == (2, 3000)
    assert inf["raw_bytes"] == bits.nbytes and inf["compressed_bytes"] == len(blob)
    assert inf["ratio"] == pytest.approx(bits.nbytes / len(blob))
    assert inf["checksum"] is True
    assert inf["streams"] == {s[0]: s[3] for s in hdr.streams}
    if inf["stored_raw"]:
        assert inf["chunks"] == inf["escapes"] == inf["raw_chunks"] == 0 and inf["codebook"] is None
        assert fmt.name == "e4m3" or chunk == 8
        return
    nchunks = math.ceil(6000 / chunk)
    per_chunk = np.bincount(np.flatnonzero(escaping) // chunk, minlength=nchunks)
    cap = (fmt.high_exp_bits * np.diff(np.minimum(np.arange(nchunks + 1) * chunk, 6000)) // 8 + (
        np.diff(np.minimum(np.arange(nchunks + 1) * chunk, 6000)) % 8 > 0)) // 3
    plane = per_chunk > cap
    assert inf["chunks"] == nchunks
    assert inf["raw_chunks"] == int(plane.sum())
    assert inf["escapes"] == int(per_chunk[~plane].sum())
    assert inf["escape_rate"] == pytest.approx(inf["escapes"] / 6000)
    assert inf["codebook"] == f"{fmt.name}-kv"
    assert inf["pipeline"] == kvzip.splitzip_pipeline(checksum=True, chunk=chunk).to_config()["stages"]
    assert inf["streams"]["esc_pos"] == 2 * inf["escapes"] and inf["streams"]["esc_exp"] == inf["escapes"]


def test_info_on_each_framework_and_buffer():
    torch = pytest.importorskip("torch")

    bits = kt.kv_like_bits("bf16", 1000, seed=4)
    blob = kvzip.compress(bits, dtype="bf16")
    want = kvzip.info(blob)
    for b in (blob.tobytes(), bytearray(blob.tobytes()), memoryview(blob.tobytes()), torch.from_numpy(blob.copy())):
        assert kvzip.info(b) == want
    with pytest.raises(kvzip.FormatError):
        kvzip.info(blob.tobytes()[:-1])


# --------------------------------------------------------------------------- checksum
def test_checksum_flag_and_value():
    bits = kt.kv_like_bits("fp16", 3000, escape_rate=0.01, seed=6)
    plain = kvzip.compress(bits, dtype="fp16")
    summed = kvzip.compress(bits, dtype="fp16", checksum=True)
    bp, hp = parse(plain)
    bs, hs = parse(summed)
    assert hp.flags & container.FLAG_CHECKSUM == 0 and hp.checksum == 0
    assert hs.flags & container.FLAG_CHECKSUM and hs.checksum == sum64_reference(bs[hs.header_len:])
    assert bp[hp.header_len:] == bs[hs.header_len:]  # the same payload; only the header differs
    assert kvzip.info(summed)["checksum"] and not kvzip.info(plain)["checksum"]


def test_checksum_without_flag_is_rejected():
    bits = kt.kv_like_bits("bf16", 100, seed=6)
    b, hdr = parse(kvzip.compress(bits, dtype="bf16"))
    st_ = [(n, d, nb) for n, d, _, nb in hdr.streams]
    forged = container.build_header(hdr.meta, st_, 0, checksum=12345) + b[hdr.header_len:]
    with pytest.raises(kvzip.FormatError, match="checksum"):
        kvzip.decompress(forged)
    # and a correct blob with the flag but a wrong sum
    forged = container.build_header(hdr.meta, st_, container.FLAG_CHECKSUM, checksum=12345) + b[hdr.header_len:]
    with pytest.raises(kvzip.FormatError, match="checksum"):
        kvzip.decompress(forged)


# --------------------------------------------------------------------------- sum64
@settings(max_examples=examples(100))
@given(words=st.lists(st.integers(0, M64), min_size=0, max_size=200))
def test_sum64_matches_reference(words):
    payload = struct.pack(f"<{len(words)}Q", *words)
    assert sum64(np, np.frombuffer(payload, np.uint8)) == sum64_reference(payload)


@settings(max_examples=examples(200))
@given(words=st.lists(st.integers(0, M64), min_size=1, max_size=300), data=st.data())
def test_sum64_detects_every_single_word_change(words, data):
    i = data.draw(st.integers(0, len(words) - 1))
    new = data.draw(st.integers(0, M64).filter(lambda w: w != words[i]))
    a = np.array(words, np.uint64)
    b = a.copy()
    b[i] = new
    assert sum64(np, a.view(np.uint8)) != sum64(np, b.view(np.uint8))


@settings(max_examples=examples(100))
@given(words=st.lists(st.integers(0, M64), min_size=1, max_size=200), data=st.data())
def test_sum64_detects_every_single_bit_flip(words, data):
    a = np.array(words, np.uint64).view(np.uint8)
    bit = data.draw(st.integers(0, a.size * 8 - 1))
    b = a.copy()
    b[bit // 8] ^= 1 << (bit % 8)
    assert sum64(np, a) != sum64(np, b)


def test_sum64_is_position_and_length_sensitive():
    a = np.array([1, 2, 3, 4], np.uint64)
    assert sum64(np, a.view(np.uint8)) != sum64(np, a[[1, 0, 2, 3]].view(np.uint8))  # swapped words
    z = np.zeros(4, np.uint64)
    assert len({sum64(np, z[:k].view(np.uint8)) for k in range(5)}) == 5  # zero words are not invisible
    with pytest.raises(ValueError):
        sum64(np, np.zeros(12, np.uint8))


def test_sum64_known_value():
    # Pinned: the checksum is part of the format.  Also equal to the reference above.
    payload = bytes(range(64))
    assert sum64(np, np.frombuffer(payload, np.uint8)) == sum64_reference(payload)
    assert sum64_reference(b"") == _mix(0)


# --------------------------------------------------------------------------- layout / header round trip
@settings(max_examples=examples(100))
@given(sizes=st.lists(st.integers(0, 10000), max_size=12))
def test_layout(sizes):
    offsets, plen = container.layout(sizes)
    assert len(offsets) == len(sizes)
    end = 0
    for off, nb in zip(offsets, sizes):
        assert off % 16 == 0 and end <= off < end + 16
        end = off + nb
    assert plen % 16 == 0 and end <= plen < end + 16
    assert container.layout([]) == ([], 0)


@settings(max_examples=examples(100))
@given(
    meta=st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-2**40, 2**40), st.text(max_size=20),
                                                       st.lists(st.integers(0, 9), max_size=5), st.none()),
                         max_size=6),
    streams=st.lists(st.tuples(st.sampled_from(sorted(container.STREAM_DTYPES)), st.integers(0, 500)), max_size=8),
    flags=st.sampled_from([0, 1, 2, 3]),
)
def test_build_parse_header_roundtrip(meta, streams, flags):
    described = [(f"s{i}", dt, nb * np.dtype(container.STREAM_DTYPES[dt]).itemsize) for i, (dt, nb) in enumerate(streams)]
    checksum = 0xDEADBEEF if flags & 1 else 0
    head = container.build_header(meta, described, flags, checksum)
    offsets, plen = container.layout([d[2] for d in described])
    hdr = container.parse_header(head + bytes(plen), len(head) + plen)
    assert hdr.meta == meta and hdr.flags == flags and hdr.checksum == checksum
    assert hdr.header_len == len(head) and hdr.payload_len == plen
    assert hdr.streams == [(n, d, o, nb) for (n, d, nb), o in zip(described, offsets)]


def test_header_size_limit():
    with pytest.raises(ValueError):
        container.build_header({"x": "a" * container.MAX_HEADER}, [], 0)


def test_long_header_is_read_in_full():
    """Headers longer than the first 4096 bytes read_head fetches (a long codebook name, say)."""
    cb = kvzip.Codebook(kvzip.Codebook.default_for("bf16").exponents, "bf16", name="n" * 6000)
    bits = kt.kv_like_bits("bf16", 2000, seed=1)
    blob = kvzip.compress(bits, cb, dtype="bf16", checksum=True)
    b, hdr = parse(blob)
    assert hdr.header_len > 4096
    np.testing.assert_array_equal(kvzip.decompress(blob).view(np.uint16), bits)
    assert kvzip.info(blob)["codebook"] == "n" * 6000
