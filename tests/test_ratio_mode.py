"""The ratio mode (ChannelPack, docs/format.md section 15): lossless on every bit pattern, shape,
format and chunk size (Hypothesis), bounded in size, the same bytes for any thread count,
decodable by a second decoder written from the format text alone, the mode's plumbing
(compress(mode=...), configs, compress_many, info), and bad blobs refused with FormatError."""
from __future__ import annotations

import struct

import ml_dtypes
import numpy as np
import pytest
import spec_reader
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import kvzip
from kvzip import channel_codebook as cc
from kvzip import cpu_parallel, layout
from kvzip import stages as S
from kvzip import testing as kt
from kvzip.formats import FORMATS
from kvzip.stages import FusedSplitPackEscape, channel_pack_cpu

FMTS = list(FORMATS.values())


def kv_bits(fmt, shape, seed=0, escape_rate=0.002):
    return kt.kv_like_bits(fmt, int(np.prod(shape)), escape_rate=escape_rate, seed=seed).reshape(shape)


def ratio_blob(bits, fmt, **kw) -> bytes:
    return bytes(np.asarray(kvzip.compress(bits, dtype=fmt.name, mode="ratio", **kw)))


def decoded_bits(blob, fmt) -> np.ndarray:
    return np.asarray(kvzip.decompress(np.frombuffer(blob, np.uint8))).view(fmt.uint_dtype)


def assert_round_trip(bits, fmt, **kw) -> bytes:
    blob = ratio_blob(bits, fmt, **kw)
    back = decoded_bits(blob, fmt)
    assert back.shape == bits.shape and np.array_equal(back.reshape(-1), bits.reshape(-1))
    raw = bits.size * fmt.itemsize
    assert len(blob) <= layout.align(raw) + layout.COMPACT_SIZE  # never more than raw + a header
    return blob


# ----------------------------------------------------------------------------- a second decoder
def unpack(buf: bytes, b: int, count: int) -> np.ndarray:
    """count values of b bits, LSB first (format.md section 6 and 15.4)."""
    bits = np.unpackbits(np.frombuffer(buf, np.uint8), bitorder="little")[:count * b].reshape(count, b)
    return (bits.astype(np.int64) << np.arange(b)).sum(1)


def second_decoder(blob: bytes) -> tuple[np.ndarray, list]:
    """(the values' bits, the shape) of a version-3 ratio blob, read from docs/format.md section 15
    alone (struct and NumPy, no kvzip code), unchecked beyond what it needs."""
    _, shape, fmt, C, (X, NH, NS) = spec_reader.compact_header(blob, 3)
    E, M, width = spec_reader.BITS[fmt]
    n, R = int(np.prod(shape)), M + 1
    G, nchunks = -(-n // 8), -(-n // C)
    D = spec_reader.channels(shape)
    streams = spec_reader.payload(blob, [3 * G, R * G, 2 * nchunks, 2 * X, X, NH, NS, 2 * nchunks, 15 * D])
    codes_b, rest_b, escc_b, pos_b, exp_b, high_b, sec_b, secc_b, tab_b = streams
    codes, rest = unpack(codes_b, 3, n), unpack(rest_b, R, n)
    esc_count, sec_count = np.frombuffer(escc_b, "<u2"), np.frombuffer(secc_b, "<u2")
    esc_pos, esc_exp = np.frombuffer(pos_b, "<u2"), np.frombuffer(exp_b, np.uint8)
    tables = np.frombuffer(tab_b, np.uint8).reshape(D, 15).astype(np.int64)
    e = np.empty(n, np.int64)
    so = eo = ho = 0
    for c in range(nchunks):
        lo, hi = c * C, min(c * C + C, n)
        ch = np.arange(lo, hi) & (D - 1)
        code = codes[lo:hi]
        if esc_count[c] == 0xFFFF:
            nb = (E - 3) * -(-(hi - lo) // 8)
            e[lo:hi] = code | (unpack(high_b[ho:ho + nb], E - 3, hi - lo) << 3)
            ho += nb
            continue
        s, k = int(sec_count[c]), int(esc_count[c])
        out = tables[ch, np.minimum(code, 6)]
        hit = code == 7
        assert hit.sum() == s
        run = -(-3 * s // 8)
        out[hit] = tables[ch[hit], 7 + unpack(sec_b[so:so + run], 3, s)]
        so += run
        out[esc_pos[eo:eo + k].astype(np.int64)] = esc_exp[eo:eo + k]
        eo += k
        e[lo:hi] = out
    assert (so, eo, ho) == (NS, X, NH)
    sign, mant = rest >> M, rest & ((1 << M) - 1)
    bits = (sign << (E + M)) | (e << M) | mant
    return bits.astype({8: np.uint8, 16: np.uint16, 32: np.uint32}[width]), shape


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
@pytest.mark.parametrize("shape,chunk", [((3, 100, 64), 4096), ((5, 7, 32), 64), ((1000,), 256), ((4, 96), 8),
                                         ((2, 3, 256), 512)])
def test_second_decoder_reads_what_the_format_says(fmt, shape, chunk):
    bits = kv_bits(fmt, shape, seed=1, escape_rate=0.01)
    k = min(600, bits.size // 2)
    bits.reshape(-1)[:k] = kt._rng_bits(5, fmt, k)  # random bits: the first chunks plane-coded
    blob = assert_round_trip(bits, fmt, chunk=chunk)
    if layout.version_of(blob) == layout.RATIO_VERSION:
        got, got_shape = second_decoder(blob)
        assert got_shape == list(shape) and np.array_equal(got, bits.reshape(-1))
    else:  # stored raw: only tiny chunks of random bits get there
        assert kvzip.info(blob)["stored_raw"]


def test_examples_cover_plane_coding_escapes_and_second_level():
    fmt = FORMATS["bf16"]
    bits = kv_bits(fmt, (3, 100, 64), seed=1, escape_rate=0.01)
    bits.reshape(-1)[:5000] = kt._rng_bits(5, fmt, 5000)
    info = kvzip.info(np.frombuffer(ratio_blob(bits, fmt, chunk=512), np.uint8))
    assert info["raw_chunks"] and info["escapes"] and info["streams"]["sec_codes"] and not info["stored_raw"]


# ----------------------------------------------------------------------------- every bit pattern
def shaped(draw, bits):
    """bits reshaped to a drawn shape whose last side is often a power of two (channels)."""
    n = bits.size
    d = draw(st.sampled_from([1, 2, 8, 32, 64, 128, 256, 3, 96]))
    if n and n % d == 0 and draw(st.booleans()):
        return bits.reshape(-1, d)
    return bits


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
@settings(max_examples=examples(40))
@given(data=st.data())
def test_any_bits_round_trip(fmt, data):
    source = data.draw(st.sampled_from([kt.bit_arrays, kt.special_heavy_arrays, kt.kv_like_arrays]))
    bits = data.draw(source(fmt, max_size=3000) if source is not kt.kv_like_arrays else source(fmt, max_size=6000))
    bits = shaped(data.draw, bits)
    chunk = data.draw(st.sampled_from([8, 16, 64, 512, 4096, 32768]))
    assert_round_trip(bits, fmt, chunk=chunk, checksum=data.draw(st.booleans()))


@pytest.mark.parametrize("fmt", [FORMATS["bf16"], FORMATS["e4m3"], FORMATS["e5m2"]], ids=lambda f: f.name)
@settings(max_examples=examples(20))
@given(seed=st.integers(0, 2**32 - 1), rate=st.sampled_from([0.0, 0.01, 0.05, 0.3]), d=st.sampled_from([1, 32, 64]))
def test_kv_like_channels_round_trip(fmt, seed, rate, d):
    """KV-like exponents with per-channel offsets: the second level and escapes carry the data."""
    bits = kt.kv_like_bits(fmt, 64 * 97, escape_rate=rate, seed=seed)
    e_shift = (np.arange(bits.size) % d) % 3  # channels that peak at different exponents
    exp = ((bits.astype(np.int64) >> fmt.mant_bits) & ((1 << fmt.exp_bits) - 1))
    exp = np.clip(exp + e_shift, 0, (1 << fmt.exp_bits) - 1)
    bits = ((bits.astype(np.int64) & ~(((1 << fmt.exp_bits) - 1) << fmt.mant_bits)) | (exp << fmt.mant_bits))
    assert_round_trip(bits.astype(fmt.uint_dtype).reshape(-1, d), fmt)


def test_edge_shapes_round_trip():
    fmt = FORMATS["bf16"]
    for shape in [(), (0,), (0, 64), (1,), (7,), (8,), (9, 64), (1, 256), (2, 512), (3, 5, 0)]:
        bits = kv_bits(fmt, shape, seed=2) if int(np.prod(shape)) else np.zeros(shape, np.uint16)
        assert_round_trip(bits, fmt)


def test_bytes_do_not_depend_on_threads():
    fmt = FORMATS["bf16"]
    bits = kv_bits(fmt, (8, 512, 64), seed=3, escape_rate=0.01)
    bits.reshape(-1)[4096 * 3:4096 * 4] = kt._rng_bits(9, fmt, 4096)
    blobs = set()
    for t in (1, 2, 3):
        with cpu_parallel.threads(t):
            blob = ratio_blob(bits, fmt)
            assert np.array_equal(decoded_bits(blob, fmt), bits)
            blobs.add(blob)
    assert len(blobs) == 1


# ----------------------------------------------------------------------------- tables, channels
def test_channels_rule():
    assert [cc.channels_of(s) for s in [(), (0,), (3, 64), (4, 96), (2, 256), (2, 512), (5, 1), (8, 32)]] == \
        [1, 1, 64, 1, 256, 1, 1, 32]


def test_compiled_histogram_is_the_reference():
    rng = np.random.default_rng(0)
    for fmt in FMTS:
        for n in (0, 1, 255, 70000, (1 << 20) + 77):
            b = rng.integers(0, 1 << fmt.width, n, dtype=np.uint64).astype(fmt.uint_dtype)
            for d in (1, 64, 256):
                assert np.array_equal(cc.channel_histogram(b, fmt, d), channel_pack_cpu.histogram(b, fmt, d))


def test_tables_follow_the_rule():
    fmt = FORMATS["bf16"]
    hist = np.zeros((2, 256), np.int64)
    hist[0, [120, 121, 122]] = [5, 9, 5]  # ties go to the lower exponent; unseen ones by distance to the mode
    hist[1, 3] = 1
    t = cc.rank_tables(hist)
    assert t[0].tolist() == [121, 120, 122, 119, 123, 118, 124, 117, 125, 116, 126, 115, 127, 114, 128]
    assert t[1].tolist()[:3] == [3, 2, 4]
    bits = kv_bits(fmt, (2, 64, 64), seed=4)
    meta, _, streams = kt.blob_parts(ratio_blob(bits, fmt))
    stored = np.frombuffer(dict((k, b) for k, _, b in streams)["tables"], np.uint8)
    assert np.array_equal(stored, cc.tables_of(bits.reshape(-1), fmt, 64))


# ----------------------------------------------------------------------------- the mode's plumbing
def test_mode_selects_the_pipeline_and_speed_is_unchanged():
    fmt = FORMATS["bf16"]
    bits = kv_bits(fmt, (3, 64, 64), seed=5)
    speed = bytes(np.asarray(kvzip.compress(bits, dtype="bf16")))
    assert bytes(np.asarray(kvzip.compress(bits, dtype="bf16", mode="speed"))) == speed
    blob = ratio_blob(bits, fmt)
    assert len(blob) < len(speed)
    info = kvzip.info(np.frombuffer(blob, np.uint8))
    assert info["pipeline"] == kvzip.ratio_pipeline().to_config()["stages"] == \
        [{"id": "channel_pack", "chunk": 4096}, {"id": "serialize", "checksum": False}]
    assert info["codebook"] is None and layout.version_of(blob) == layout.RATIO_VERSION
    pipe = kvzip.Pipeline.from_config(kvzip.ratio_pipeline(checksum=True, chunk=1024).to_json())
    assert bytes(np.asarray(pipe.encode(bits, dtype="bf16"))) == ratio_blob(bits, fmt, checksum=True, chunk=1024)
    with pytest.raises(ValueError, match="mode"):
        kvzip.compress(bits, dtype="bf16", mode="fast")
    with pytest.raises(ValueError, match="codebook"):
        kvzip.compress(bits, dtype="bf16", mode="ratio", codebook="bf16-kv")
    with pytest.raises(ValueError, match="chunk"):
        kvzip.compress(bits, dtype="bf16", mode="ratio", chunk=65536)
    with pytest.raises(ValueError, match="chunk"):
        S.ChannelPack(chunk=True)


def test_compress_many_and_packed():
    fmt = FORMATS["e5m2"]
    xs = [kv_bits(fmt, (2, 64, 32), seed=s) for s in range(3)]
    blobs = kvzip.compress_many(xs, dtype="e5m2", mode="ratio")
    assert [bytes(np.asarray(b)) for b in blobs] == [ratio_blob(x, fmt) for x in xs]
    packed = kvzip.compress_many(xs, dtype="e5m2", mode="ratio", packed=True)
    for x, y in zip(xs, kvzip.decompress_many(packed)):
        assert np.array_equal(np.asarray(y).view(np.uint8), x)


def test_torch_and_float_dtypes():
    torch = pytest.importorskip("torch")
    x = torch.randn(4, 33, 64).to(torch.bfloat16)
    kt.assert_roundtrip(x, mode="ratio")
    y = (np.random.default_rng(0).standard_normal((16, 128)) * 0.1).astype(ml_dtypes.float8_e4m3fn)
    kt.assert_roundtrip(y, mode="ratio")


def test_quantize_fp8_in_front_takes_the_version1_header():
    Q = kt.quantize_fp8_available()
    if Q is None:
        pytest.skip("QuantizeFP8 unavailable")
    x = (np.random.default_rng(1).standard_normal((4, 256, 64)) * 0.05).astype(ml_dtypes.bfloat16)
    pipe = kvzip.Pipeline([Q("e4m3", "channel"), S.ChannelPack(), S.Serialize()])
    blob = pipe.encode(x)
    assert layout.version_of(bytes(blob[:16])) == layout.VERSION
    want = kvzip.Pipeline([Q("e4m3", "channel"), S.Serialize()]).encode(x)
    assert np.array_equal(np.asarray(kvzip.decompress(blob)).view(np.uint16),
                          np.asarray(kvzip.decompress(want)).view(np.uint16))


def test_random_bits_are_stored_raw_as_the_speed_mode_stores_them():
    fmt = FORMATS["bf16"]
    bits = kt._rng_bits(7, fmt, 5000)
    blob = ratio_blob(bits, fmt)
    assert kvzip.info(np.frombuffer(blob, np.uint8))["stored_raw"]
    assert blob == bytes(np.asarray(kvzip.compress(bits, dtype="bf16")))


def test_gpu_executor_does_not_take_the_ratio_pipeline():
    """The fused GPU executor takes only pipelines whose last body step is the speed mode's fused
    step (kvzip/gpu/executor.py: takes); the ratio pipeline runs staged, on the host."""
    steps = kvzip.ratio_pipeline().body_steps
    assert not isinstance(steps[-1], FusedSplitPackEscape)


def test_version1_header_of_a_ratio_blob_decodes_the_same():
    fmt = FORMATS["fp16"]
    bits = kv_bits(fmt, (2, 100, 32), seed=8, escape_rate=0.02)
    blob = ratio_blob(bits, fmt, chunk=256)
    v1 = kt.version1(blob)
    assert layout.version_of(v1) == layout.VERSION and len(v1) > len(blob)
    assert np.array_equal(decoded_bits(v1, fmt), bits)


# ----------------------------------------------------------------------------- bad blobs
BASE_FMT = FORMATS["bf16"]


def base_bits():
    bits = kv_bits(BASE_FMT, (4, 32, 64), seed=9, escape_rate=0.02)
    bits.reshape(-1)[1024:1536] = kt._rng_bits(10, BASE_FMT, 512)  # chunk 2 plane-coded at chunk 512
    return bits


BASE = ratio_blob(base_bits(), BASE_FMT, chunk=512)


def edited(stream: str, fn) -> bytes:
    meta, flags, streams = kt.blob_parts(BASE)
    out = [(k, dt, fn(bytearray(b)) if k == stream else b) for k, dt, b in streams]
    return kt.build_blob(meta, [(k, dt, bytes(b)) for k, dt, b in out], flags)


def rejects(blob, match=None):
    with pytest.raises(kvzip.FormatError, match=match):
        kvzip.decompress(np.frombuffer(blob, np.uint8))


def u16(b, k, v):
    struct.pack_into("<H", b, 2 * k, v)
    return b


def test_base_blob_has_what_the_forgeries_need():
    info = kvzip.info(np.frombuffer(BASE, np.uint8))
    counts = np.frombuffer(dict((k, b) for k, _, b in kt.blob_parts(BASE)[2])["esc_count"], "<u2")
    assert info["raw_chunks"] == 1 and counts[2] == 0xFFFF and info["escapes"] > 0
    assert np.array_equal(decoded_bits(kt.build_blob(*_parts()), BASE_FMT), base_bits())


def _parts():
    meta, flags, streams = kt.blob_parts(BASE)
    return meta, [(k, dt, b) for k, dt, b in streams], flags


def test_truncated_and_extended_blobs_are_refused():
    for cut in (0, 8, 47, 63, 64, 80, len(BASE) // 2, len(BASE) - 16, len(BASE) - 1):
        rejects(BASE[:cut])
    rejects(BASE + bytes(16))


def test_forged_streams_are_refused():
    rejects(edited("tables", lambda b: b.__setitem__(1, b[0]) or b), "repeats")
    rejects(edited("tables", lambda b: b[:-15]))
    rejects(edited("codes", lambda b: b[:-3]))
    rejects(edited("esc_count", lambda b: u16(b, 0, struct.unpack_from("<H", b, 0)[0] + 1)))
    rejects(edited("esc_count", lambda b: u16(b, 0, 400)), "listed chunk")
    rejects(edited("esc_count", lambda b: u16(b, 1, 0xFFFF)))
    rejects(edited("sec_count", lambda b: u16(b, 0, struct.unpack_from("<H", b, 0)[0] + 1)), "second-level")
    rejects(edited("sec_count", lambda b: u16(b, 2, 1)), "second-level")  # a plane-coded chunk's
    rejects(edited("sec_codes", lambda b: b + bytes(1)), "second-level")
    rejects(edited("esc_pos", lambda b: u16(b, 0, 600)), "escape position")
    rejects(edited("esc_exp", lambda b: b[:-1]))
    rejects(edited("exp_high", lambda b: b[:-1]))
    rejects(edited("exp_high", lambda b: b + bytes(5)), "exp_high")


def test_forged_codes_are_refused_or_decode_to_other_values():
    """A code changed from 7 leaves the chunk's second-level count unmet: refused; a change
    between primary codes decodes to another value of the table, never out of bounds."""
    meta, streams, flags = _parts()
    codes = bytearray(dict((k, b) for k, _, b in streams)["codes"])
    values = unpack(bytes(codes), 3, 4 * 32 * 64)

    def with_code(i, code):
        forged = bytearray(codes)
        word = int.from_bytes(forged[3 * (i // 8):3 * (i // 8) + 3], "little")
        word = (word & ~(7 << 3 * (i % 8))) | (code << 3 * (i % 8))
        forged[3 * (i // 8):3 * (i // 8) + 3] = word.to_bytes(3, "little")
        return kt.build_blob(meta, [(k, dt, bytes(forged) if k == "codes" else b) for k, dt, b in streams], flags)

    rejects(with_code(int(np.flatnonzero(values == 7)[0]), 0), "second-level")
    i = int(np.flatnonzero(values == 1)[0])
    out = decoded_bits(with_code(i, 2), BASE_FMT).reshape(-1)
    want = base_bits().reshape(-1)
    assert np.flatnonzero(out != want).tolist() == [i]


def test_forged_version3_header_fields_are_refused():
    def forged(at, fmt, value):
        raw = bytearray(BASE)
        struct.pack_into(fmt, raw, at, value)
        return kt.reseal(raw)

    rejects(forged(45, "<B", 16), "chunk")     # chunk log2 beyond 15
    rejects(forged(45, "<B", 2), "chunk")
    rejects(forged(47, "<B", 1), "reserved")
    rejects(forged(60, "<B", 1), "reserved")
    rejects(forged(10, "<H", 2), "stored-raw")
    rejects(forged(48, "<I", 5))               # sec_codes bytes: the payload does not add up
    rejects(forged(32, "<I", 1 << 31))
    rejects(forged(44, "<B", 9), "dtype")
    rejects(forged(8, "<H", 5), "version")     # a version this kvzip does not implement
    rejects(forged(8, "<H", 4))                # read as the storage header: the streams do not add up
    raw = bytearray(BASE)
    raw[50] ^= 1  # no reseal: the CRC catches it
    rejects(bytes(raw), "checksum")


def test_checksum_catches_payload_damage():
    blob = bytearray(ratio_blob(base_bits(), BASE_FMT, chunk=512, checksum=True))
    blob[-20] ^= 0x10
    rejects(bytes(blob), "checksum")


@settings(max_examples=examples(300))
@given(blob=kt.hostile_blobs([BASE, ratio_blob(kv_bits(FORMATS["e4m3"], (2, 40, 32), seed=11), FORMATS["e4m3"],
                                               chunk=64)]))
def test_hostile_blobs_are_refused_or_decoded(blob):
    """Forgeries of real ratio blobs: FormatError, or a decode that info() accepts alike."""
    try:
        out = kvzip.decompress(np.frombuffer(blob, np.uint8))
    except kvzip.FormatError:
        with pytest.raises(kvzip.FormatError):
            kvzip.info(np.frombuffer(blob, np.uint8))
        return
    assert kvzip.info(np.frombuffer(blob, np.uint8))["shape"] == np.asarray(out).shape
