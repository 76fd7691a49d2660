"""The storage mode (ChannelRans, docs/format.md section 16): lossless on every bit pattern, shape,
format and chunk size (Hypothesis), bounded in size, the same bytes for any thread count,
decodable by a second decoder written from the format text alone, real KV and its adversarial
variants, the mode's plumbing, and forged blobs refused with FormatError."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import spec_reader
from conftest import examples
from hypothesis import given, settings
from hypothesis import strategies as st

import kvzip
from kvzip import cpu_parallel, layout
from kvzip import stages as S
from kvzip import testing as kt
from kvzip.backends import get_backend
from kvzip.formats import FORMATS
from kvzip.frame import Frame

FMTS = list(FORMATS.values())
KV_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "kv"


def storage_blob(bits, fmt, **kw) -> bytes:
    return bytes(np.asarray(kvzip.compress(bits, dtype=fmt.name, mode="storage", **kw)))


def assert_round_trip(bits, fmt, **kw) -> bytes:
    blob = storage_blob(bits, fmt, **kw)
    back = np.asarray(kvzip.decompress(np.frombuffer(blob, np.uint8))).view(fmt.uint_dtype)
    assert back.shape == bits.shape and np.array_equal(back.reshape(-1), bits.reshape(-1))
    # Never more than the raw values, a header and padding (the stored-raw fallback is version 2).
    assert len(blob) <= layout.align(bits.size * fmt.itemsize) + layout.COMPACT_SIZE
    return blob


# ----------------------------------------------------------------------------- a second decoder
def header_v1(blob: bytes):
    """(format name, shape, chunk, {stream: array}) of a version-1 channel_rans blob (sections 2, 3)."""
    magic, version, _, H, _, _, J, nstreams, _ = struct.unpack_from("<8sHHIQQIII4x", blob)
    assert magic == b"KVZIP\x00\r\n" and version == 1
    doc = json.loads(blob[48 + 16 * nstreams:48 + 16 * nstreams + J])
    meta = doc["meta"]
    assert [c["id"] for c in meta["pipeline"]] == ["channel_rans", "serialize"]
    dt = {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}
    streams = {}
    for k, (name, dtype) in enumerate(doc["streams"]):
        off, nb = struct.unpack_from("<QQ", blob, 48 + 16 * k)
        streams[name] = np.frombuffer(blob[H + off:H + off + nb], dt[dtype])
    return meta["format"], meta["shape"], meta["pipeline"][0]["chunk"], streams


def header_v4(blob: bytes):
    """header_v1's answer for a version-4 blob (section 16.5: the 64-byte header, the streams
    laid out by the rule of 2.4)."""
    flags, shape, fmt, C, (X, W, T) = spec_reader.compact_header(blob, 4)
    assert not flags & 2
    R = spec_reader.BITS[fmt][1] + 1
    n = int(np.prod(shape))
    G, nchunks = -(-n // 8), -(-n // C)
    layout_ = [("rest", np.uint8, R * G), ("esc_count", np.uint32, 4 * nchunks), ("esc_exp", np.uint8, X),
               ("states", np.uint32, 128 * nchunks), ("tables", np.uint8, T), ("word_count", np.uint32, 4 * nchunks),
               ("words", np.uint16, 2 * W)]
    parts = spec_reader.payload(blob, [nb for _, _, nb in layout_])
    streams = {name: np.frombuffer(b, dt) for (name, dt, _), b in zip(layout_, parts)}
    return fmt, shape, C, streams


def second_decoder(blob: bytes) -> tuple[np.ndarray, list]:
    """(the values' bits, the shape) of a channel_rans blob, version 4 or 1, read from
    docs/format.md sections 2, 3, 5, 6 and 16 alone (struct, json and NumPy, no kvzip code),
    values one by one."""
    fmt, shape, C, streams = (header_v4 if blob[8] == 4 else header_v1)(blob)
    E, M, width = spec_reader.BITS[fmt]
    n, R = int(np.prod(shape)), M + 1
    D = spec_reader.channels(shape)
    # 16.2 tables
    tb = streams["tables"].tobytes()
    shift = tb[0]
    NG = D >> shift
    ranges = [(tb[1 + 2 * g], tb[2 + 2 * g]) for g in range(NG)]
    bits = np.unpackbits(np.frombuffer(tb[1 + 2 * NG:], np.uint8), bitorder="little")
    ESC = 1 << E
    tables, at = [], 0
    for lo, hi in ranges:
        F = {}
        for sym in [ESC] + list(range(lo, hi + 1)):
            F[sym] = int(sum(int(bits[at + b]) << b for b in range(12)))
            at += 12
        assert sum(F.values()) == 4096
        slots, cum, c = [], {}, 0
        for sym in [ESC] + list(range(lo, hi + 1)):
            cum[sym] = c
            c += F[sym]
            slots += [sym] * F[sym]
        tables.append((F, cum, slots))
    # 5, 6: rest packed b = R bits LSB first
    rest_bits = np.unpackbits(streams["rest"], bitorder="little")
    out = np.zeros(n, np.uint64)
    words, esc = streams["words"].tolist(), streams["esc_exp"].tolist()
    wp = ep = 0
    for c in range(-(-n // C)):
        length = min(C, n - c * C)
        x = [int(v) for v in streams["states"][32 * c:32 * c + 32]]
        for j in range(length):
            i, lane = c * C + j, j % 32
            F, cum, slots = tables[(i & (D - 1)) >> shift]
            slot = x[lane] & 4095
            s = slots[slot]
            x[lane] = F[s] * (x[lane] >> 12) + slot - cum[s]
            if x[lane] < 1 << 16:
                x[lane] = (x[lane] << 16) | words[wp]
                wp += 1
            if s == ESC:
                s = esc[ep]
                ep += 1
            r = int(sum(int(rest_bits[R * i + b]) << b for b in range(R)))
            out[i] = ((r >> M) << (E + M)) | (s << M) | (r & ((1 << M) - 1))
        assert x == [1 << 16] * 32
    assert wp == len(words) and ep == len(esc)
    return out.astype({8: np.uint8, 16: np.uint16, 32: np.uint32}[width]), shape


@pytest.mark.parametrize("fmt", FMTS, ids=lambda f: f.name)
def test_second_decoder_reads_what_the_writer_wrote(fmt):
    rng = np.random.default_rng(3)
    bits = kt.kv_like_bits(fmt, 3 * 128 * 16, escape_rate=0.01, seed=5).reshape(3, 128, 16)
    bits.reshape(-1)[::97] = rng.integers(0, 1 << (8 * fmt.itemsize), bits.size // 97 + 1, dtype=np.uint64
                                          ).astype(fmt.uint_dtype)[: bits.reshape(-1)[::97].size]
    blob = storage_blob(bits, fmt, chunk=2048)
    assert blob[8] == 4  # not stored raw: a version-4 channel_rans blob
    for form in (blob, kt.version1(blob)):  # the compact header and the version-1 one it stands for
        values, shape = second_decoder(form)
        assert shape == list(bits.shape) and np.array_equal(values, bits.reshape(-1))


# ----------------------------------------------------------------------------- round trips
shapes = st.one_of(
    st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple),
    st.tuples(st.integers(1, 40), st.sampled_from([1, 2, 8, 32, 64, 96, 128, 256, 384, 512])),
    st.tuples(st.integers(1, 3), st.integers(1, 50), st.sampled_from([7, 16, 63, 64]))).filter(
    lambda s: int(np.prod(s)) <= 40000)


@settings(max_examples=examples(60))
@given(fmt=st.sampled_from(FMTS), shape=shapes, chunk=st.sampled_from([32, 64, 256, 4096, 65536]),
       kind=st.sampled_from(["kv", "random", "constant", "kv-escapes"]), seed=st.integers(0, 2**16),
       checksum=st.booleans())
def test_round_trip(fmt, shape, chunk, kind, seed, checksum):
    n = int(np.prod(shape))
    rng = np.random.default_rng(seed)
    if kind == "random":
        bits = rng.integers(0, 1 << (8 * fmt.itemsize), n, dtype=np.uint64).astype(fmt.uint_dtype)
    elif kind == "constant":
        bits = np.full(n, rng.integers(0, 1 << (8 * fmt.itemsize)), fmt.uint_dtype)
    else:
        bits = kt.kv_like_bits(fmt, n, escape_rate=0.05 if kind == "kv-escapes" else 0.001, seed=seed)
    assert_round_trip(bits.reshape(shape), fmt, chunk=chunk, checksum=checksum)


def test_same_bytes_for_any_thread_count():
    fmt = FORMATS["bf16"]
    bits = kt.kv_like_bits(fmt, 1 << 19, escape_rate=0.003, seed=1).reshape(128, 64, 64)
    with cpu_parallel.threads(1):
        want = storage_blob(bits, fmt, chunk=4096)
    for k in (2, 3):
        with cpu_parallel.threads(k):
            assert storage_blob(bits, fmt, chunk=4096) == want
            back = np.asarray(kvzip.decompress(np.frombuffer(want, np.uint8))).view(np.uint16)
            assert np.array_equal(back, bits)


def test_incompressible_is_stored_raw_and_bounded():
    fmt = FORMATS["e4m3"]
    bits = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8)
    blob = assert_round_trip(bits, fmt)
    assert kvzip.info(np.frombuffer(blob, np.uint8))["stored_raw"]


def test_mode_plumbing():
    x = kt.kv_like_bits(FORMATS["bf16"], 4096, seed=2).reshape(2, 32, 64)
    assert kvzip.storage_pipeline().stage_configs[0] == {"id": "channel_rans", "chunk": 65536}
    blobs = kvzip.compress_many([x, x[:1]], dtype="bf16", mode="storage")
    assert kvzip.info(blobs[0])["pipeline"][0]["id"] == "channel_rans"
    for b, want in zip(blobs, (x, x[:1])):
        assert np.array_equal(np.asarray(kvzip.decompress(b)).view(np.uint16), want)
    with pytest.raises(ValueError):
        kvzip.compress(x, dtype="bf16", mode="storage", codebook="bf16-kv")
    with pytest.raises(ValueError):
        kvzip.compress(x, dtype="bf16", mode="storage", chunk=16)


# ----------------------------------------------------------------------------- real KV
def real_files():
    files = sorted(KV_DIR.glob("*_512.safetensors")) + sorted(KV_DIR.glob("minilm*_1024.safetensors"))
    if not files:
        pytest.skip(f"no real KV under {KV_DIR}")
    from safetensors.numpy import load_file

    return {f.stem: {k: v.view(np.uint16) for k, v in load_file(str(f)).items()} for f in files}


def test_real_kv_and_its_variants_round_trip_at_the_storage_ratio():
    fmt = FORMATS["bf16"]
    for stem, tensors in real_files().items():
        for key in sorted(tensors)[::7]:
            bits = tensors[key]
            blob = assert_round_trip(bits, fmt)
            assert bits.nbytes / len(blob) >= 1.46, (stem, key)
            for k, variant in enumerate(kt.KV_VARIANTS[1:]):
                assert_round_trip(kt.kv_variant(bits, variant, layer=int(key[5:7]), seed=k), fmt)


# ----------------------------------------------------------------------------- forged blobs
def streams_of(bits, fmt, chunk):
    meta = {"dtype": fmt.dtype_name, "shape": list(bits.shape), "n": bits.size, "format": fmt.name,
            "pipeline": [{"id": "channel_rans", "chunk": chunk}, {"id": "serialize", "checksum": False}]}
    frame = S.ChannelRans(chunk).encode(Frame(get_backend("cpu"), {"data": bits.reshape(-1)}, dict(meta)))
    return {k: np.array(v) for k, v in frame.streams.items()}, meta


def blob_of(streams, meta) -> np.ndarray:
    return S.Serialize().encode(Frame(get_backend("cpu"), streams, dict(meta))).streams["blob"]


FMT = FORMATS["bf16"]
BITS = kt.kv_like_bits(FMT, 3 * 64 * 32, escape_rate=0.01, seed=9).reshape(3, 64, 32)
GOOD, META = streams_of(BITS, FMT, 1024)


def forged(name, fn):
    s = {k: v.copy() for k, v in GOOD.items()}
    s[name] = fn(s[name])
    return s


def _bump(a, k, d):
    a[k] = int(a[k]) + d
    return a


def _set(a, k, v):
    a[k] = v
    return a


FORGERIES = {
    "word_count+1": ("word_count", lambda a: _bump(a, 0, 1)),
    "word_count-1": ("word_count", lambda a: _bump(a, 1, -1)),
    "word_count>len": ("word_count", lambda a: _set(a, 0, 5000)),
    "esc_count+1": ("esc_count", lambda a: _bump(a, 0, 1)),
    "esc_count-1": ("esc_count", lambda a: _set(a, 2, max(int(a[2]), 1) - 1) if a[2] else _bump(a, 2, 1)),
    "esc_count huge": ("esc_count", lambda a: _set(a, 0, 2**32 - 1)),
    "state low": ("states", lambda a: _set(a, 5, 17)),
    "state flipped": ("states", lambda a: _set(a, 5, int(a[5]) ^ 0x400)),
    "states short": ("states", lambda a: a[:-1]),
    "rest short": ("rest", lambda a: a[:-1]),
    "words short": ("words", lambda a: a[:-1]),
    "words long": ("words", lambda a: np.append(a, np.uint16(7))),
    "words dtype": ("words", lambda a: a.view(np.uint8)),
    "esc_exp long": ("esc_exp", lambda a: np.append(a, np.uint8(1))),
    "esc_exp in table": ("esc_exp", lambda a: _set(a, 0, 127)),
    "word_count short": ("word_count", lambda a: a[:-1]),
    "tables empty": ("tables", lambda a: a[:0]),
    "tables shift": ("tables", lambda a: _set(a, 0, 6)),
    "tables lo>hi": ("tables", lambda a: _set(a, 1, 255)),
    "tables short": ("tables", lambda a: a[:-1]),
    "tables long": ("tables", lambda a: np.append(a, np.uint8(0))),
    "tables freq": ("tables", lambda a: _set(a, 1 + 2 * (32 >> int(a[0])) + 1, int(a[1 + 2 * (32 >> int(a[0])) + 1]) ^ 1)),
}


def test_good_streams_decode():
    back = np.asarray(kvzip.decompress(blob_of(GOOD, META))).view(np.uint16)
    assert np.array_equal(back, BITS) and GOOD["esc_exp"].size > 0


@pytest.mark.parametrize("case", sorted(FORGERIES))
def test_forged_field_raises_format_error(case):
    name, fn = FORGERIES[case]
    with pytest.raises(kvzip.FormatError):
        kvzip.decompress(blob_of(forged(name, fn), META))


def test_forged_n_is_refused_before_allocating():
    meta = dict(META, shape=[1 << 20, 1 << 20, 32], n=1 << 45)
    with pytest.raises(kvzip.FormatError):
        kvzip.decompress(blob_of(GOOD, meta))


@settings(max_examples=examples(100))
@given(at=st.integers(0, 10**9), xor=st.integers(1, 255))
def test_flipped_byte_never_crashes(at, xor):
    blob = np.array(blob_of(GOOD, META))
    blob[at % blob.size] ^= xor
    try:
        kvzip.decompress(blob)
    except kvzip.FormatError:
        pass


# ----------------------------------------------------------------------------- the version-4 header
HEADER_FORGERIES = {  # (offset, struct code, value) of a field of 16.5
    "version 3": (8, "<H", 3),
    "stored-raw flag": (10, "<H", 2),
    "escapes +1": (32, "<I", None),
    "words +1": (36, "<I", None),
    "tables bytes +1": (48, "<I", None),
    "chunk log2 4": (45, "<B", 4),
    "chunk log2 21": (45, "<B", 21),
    "dtype 9": (44, "<B", 9),
    "reserved byte 47": (47, "<B", 1),
    "reserved tail": (60, "<I", 1),
    "ndim 0": (46, "<B", 0),
}


def test_storage_blobs_carry_the_version4_header():
    blob = np.asarray(kvzip.compress(BITS, dtype="bf16", mode="storage", chunk=1024))
    assert blob[8] == 4 and np.array_equal(np.asarray(kvzip.decompress(blob)).view(np.uint16), BITS)
    assert len(kt.version1(blob)) > len(blob)  # the JSON header it stands for
    quantized = kvzip.Pipeline([kt.quantize_fp8_available()("e5m2"), S.ChannelRans(1024), S.Serialize()]) \
        if kt.quantize_fp8_available() else None
    if quantized is not None:  # no compact header holds QuantizeFP8: version 1
        assert np.asarray(quantized.encode(BITS, dtype="bf16"))[8] == 1


@pytest.mark.parametrize("case", sorted(HEADER_FORGERIES))
def test_forged_header_field_raises_format_error(case):
    at, code, value = HEADER_FORGERIES[case]
    raw = bytearray(np.asarray(kvzip.compress(BITS, dtype="bf16", mode="storage", chunk=1024)).tobytes())
    old = struct.unpack_from(code, raw, at)[0]
    struct.pack_into(code, raw, at, old + 1 if value is None else value)
    with pytest.raises(kvzip.FormatError):
        kvzip.decompress(np.frombuffer(kt.reseal(bytes(raw)), np.uint8))


# ----------------------------------------------------------------------------- the writer's rule
def test_log2_table_is_exact_and_far_from_ties():
    """LOG2_FRAC[i] = round(2**16 log2(1 + i / 2**11)) computed in float64 is the exact rounding
    (50 decimal digits), and every entry is at least 2.5e-4 from a tie, so any accurate log2
    gives this table (docs/format.md 16.2)."""
    import decimal

    from kvzip.stages import channel_rans as cr

    ctx = decimal.Context(prec=50)
    ln2 = ctx.ln(decimal.Decimal(2))
    margin = 1.0
    for i, got in enumerate(cr.LOG2_FRAC):
        y = ctx.divide(ctx.ln(ctx.divide(decimal.Decimal(2048 + i), 2048)), ln2) * 65536
        assert int(got) == int(y.to_integral_value(rounding=decimal.ROUND_HALF_EVEN)), i
        margin = min(margin, abs(float(y - int(y)) - 0.5))
    assert margin > 2.5e-4 and cr.LOG2_FRAC[0] == 0 and cr.LOG2_FRAC[-1] == 65513


def test_rans_rule_cuh_is_generated():
    """kvzip/gpu/kernels/rans_rule.cuh is stages/channel_rans.py's cuh() text (regenerate it with
    `python -m kvzip.gpu.headers --write` after changing the writer's rule's constants)."""
    import re

    from kvzip.stages import channel_rans as cr

    text = cr.cuh()
    assert cr.cuh_path().read_text() == text
    table = re.search(r"rans_log2_frac\[(\d+)\] = \{([^}]*)\}", text)
    assert [int(v) for v in table.group(2).replace(",", " ").split()] == cr.LOG2_FRAC.tolist()
    defines = dict(re.findall(r"#define (RANS_\w+) (\d+)", text))
    assert int(defines["RANS_MIN_COUNT"]) == cr.MIN_COUNT and int(defines["RANS_FREQ_BITS"]) == cr.FREQ_BITS
    assert int(defines["RANS_LOG2_ONE_BITS"]) == cr.LOG2_ONE_BITS
    assert int(defines["RANS_LOG2_INDEX_BITS"]) == cr.LOG2_INDEX_BITS


def _log2_by_definition(x: int) -> int:
    m = x.bit_length() - 1
    i = (x >> (m - 11) if m >= 11 else x << (11 - m)) & 2047
    from kvzip.stages import channel_rans as cr

    return (m << 16) | int(cr.LOG2_FRAC[i])


def test_fixed_point_log2_is_the_definition():
    from kvzip.stages import channel_rans as cr

    xs = {1, 2, 3, 2047, 2048, 2049, 4095, 4096, 2**62 - 1}
    xs |= {(1 << k) + d for k in range(1, 62) for d in (-1, 0, 1)}
    xs |= set(np.random.default_rng(0).integers(1, 2**62, 2000).tolist())
    xs = sorted(xs)
    got = cr.log2_fixed(np.array(xs, np.int64))
    assert got.tolist() == [_log2_by_definition(x) for x in xs]
    assert (np.diff(got) >= 0).all()  # non-decreasing: every estimate term is >= 0


def _estimate_by_definition(hist: np.ndarray, shift: int, E: int) -> int:
    """16.2's estimate in Python integers, a group at a time."""
    from kvzip.stages import channel_rans as cr

    total = 0
    D = hist.shape[0]
    for g in range(D >> shift):
        row = [int(v) for v in hist[g << shift:(g + 1) << shift].sum(axis=0)]
        if sum(row) == 0:
            row[0] = 1
        mode = row.index(max(row))
        kept = [e for e, c in enumerate(row) if c >= cr.MIN_COUNT]
        lo, hi = min([mode] + kept), max([mode] + kept)
        N = sum(row)
        counts = [N - sum(row[lo:hi + 1])] + row[lo:hi + 1]
        total += (16 + 12 * len(counts) + E * counts[0]) << 16
        total += sum(c * (_log2_by_definition(N) - _log2_by_definition(c)) for c in counts if c > 0)
    return total


@pytest.mark.parametrize("E,D,scale", [(8, 64, 50), (5, 16, 3), (4, 8, 1), (8, 256, 2**31), (4, 256, 2**32 - 1),
                                       (8, 1, 2**32 - 1), (5, 4, 2**36)])
def test_estimate_is_the_integer_definition(E, D, scale):
    """_estimate_bits (vectorised int64) equals the rule in Python integers for every grouping,
    counts up to 256 channels of uint32 (group sums near 2**40) and beyond (a CPU histogram of a
    tensor under 2**42 values), and choose_shift takes
    the smallest, the finest on ties."""
    from kvzip.stages import channel_rans as cr

    rng = np.random.default_rng(D + E)
    for trial in range(3):
        hist = (rng.random((D, 1 << E)) ** 4 * scale).astype(np.int64) * (rng.random((D, 1 << E)) < 0.4)
        hist[rng.integers(0, D)] = 0  # a channel without values
        costs = [_estimate_by_definition(hist, s, E) for s in range(D.bit_length())]
        assert [cr._estimate_bits(hist, s, E) for s in range(D.bit_length())] == costs
        assert cr.choose_shift(hist, E) == costs.index(min(costs))


def test_ties_go_to_the_finer_grouping():
    """Two channels of 8 values, at exponents x and x + 2: one table a channel costs 2 x 40 bits,
    one shared table 64 bits of table and 16 of exponents -- equal, so shift 0."""
    from kvzip.stages import channel_rans as cr

    for E in (4, 5, 8):
        hist = np.zeros((2, 1 << E), np.int64)
        hist[0, 3], hist[1, 5] = 8, 8
        assert cr._estimate_bits(hist, 0, E) == cr._estimate_bits(hist, 1, E) == 80 << 16
        assert cr.choose_shift(hist, E) == 0
