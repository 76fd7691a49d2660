"""kvzip/gpu/kernels/channel.cu (the ratio mode's CUDA kernels) run on the host, without a GPU:
tests/cuda_host/emu.h makes every GPU thread a host thread and every warp intrinsic a
rendezvous of its warp, and tests/cuda_host/channel_host.cpp launches the kernels in
kvzip/gpu/channel_pack.py's order.  Their streams must be the CPU reference's bytes, their
decode the values, and a forged blob's error the reference's.  Needs g++ (C++20)."""
from __future__ import annotations

import re
import shutil
import struct

import numpy as np
import pytest
from cuda_host import harness

import kvzip
from kvzip import channel_codebook as cc
from kvzip import container, layout
from kvzip import testing as kt
from kvzip.bitlogic import PLANE
from kvzip.errors import FormatError
from kvzip.formats import FORMATS
from kvzip.gpu import loader
from kvzip.stages import channel_pack_cpu

STREAMS = ("tables", "codes", "rest", "esc_count", "sec_count", "sec_codes", "esc_pos", "esc_exp", "exp_high")
DTYPES = {"esc_count": np.uint16, "sec_count": np.uint16, "esc_pos": np.uint16}

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the host harness")


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    return harness.build(loader.CHANNEL, "channel_host.cpp", tmp_path_factory.mktemp("channel_host"))


def call(exe, tmp_path, op, fmt, n, channels, chunk, arrays, grid=3) -> list[bytes]:
    return harness.call(exe, tmp_path, [op, fmt.exp_bits, fmt.mant_bits, n, channels, chunk, grid], arrays)


def reference(bits, fmt, channels, chunk) -> dict:
    """The CPU reference's streams (ChannelPack.encode's steps)."""
    n = bits.shape[0]
    tables = cc.rank_tables(channel_pack_cpu.histogram(bits, fmt, channels)).reshape(-1)
    G, nchunks = -(-n // 8), -(-n // chunk)
    codes, rest = np.empty(3 * G, np.uint8), np.empty(fmt.rest_bits * G, np.uint8)
    esc_count, sec_count = np.empty(nchunks, np.uint16), np.empty(nchunks, np.uint16)
    variable = channel_pack_cpu.encode(bits, n, fmt, channels, cc.encode_lut(tables, fmt), chunk, codes, rest,
                                       esc_count, sec_count)
    return dict(zip(STREAMS, (tables, codes, rest, esc_count, sec_count, *variable)))


def spec_payload(s) -> bytes:
    """A blob's payload of these streams by format.md 2.4 (canonical order, each at the next
    16-byte boundary, zero padding)."""
    out = bytearray()
    for name, _ in layout.RATIO_STREAMS:
        out += np.asarray(s[name]).tobytes()
        out += bytes(-len(out) % layout.ALIGN)
    return bytes(out)


def device_decode(exe, tmp_path, s, n, fmt, channels, chunk, tables_code=False):
    """(the values, the counts' error code or 0); with tables_code, also the tables' (0: sound)."""
    dst, err = call(exe, tmp_path, 1, fmt, n, channels, chunk, [np.asarray(s[k]) for k in STREAMS])
    words = [0 if w == 2**64 - 1 else w for w in struct.unpack("<2Q", err)]
    out = np.frombuffer(dst, fmt.uint_dtype), words[0] % 8
    return (*out, words[1]) if tables_code else out


CASES = [  # (format, n, channels, chunk, how the values are made)
    ("bf16", 0, 1, 4096, "kv"), ("bf16", 1, 1, 4096, "kv"), ("bf16", 7, 1, 8, "kv"),
    ("bf16", 5 * 4096 + 123, 64, 4096, "kv"), ("bf16", 4096 - 1, 128, 4096, "kv"), ("bf16", 4097, 256, 4096, "wide"),
    ("bf16", 3 * 1024 + 5, 1, 1024, "random"), ("bf16", 2000, 8, 64, "zeros"), ("bf16", 1 << 12, 2, 8, "kv"),
    ("fp16", 3 * 2048 + 17, 64, 2048, "kv"), ("fp16", 2048 * 2, 32, 2048, "random"),
    ("fp32", 2 * 1024 + 3, 16, 1024, "kv"), ("fp32", 999, 1, 256, "wide"),
    ("e4m3", 4 * 512 + 9, 64, 512, "kv"), ("e4m3", 4096, 4, 4096, "random"), ("e4m3", 333, 1, 16, "kv"),
    ("bf16", (1 << 20) + 4099, 128, 4096, "kv"),  # a sampled histogram (auto_codebook's runs)
    ("e5m2", 3 * 4096 + 77, 128, 4096, "kv"), ("e5m2", 4096 + 64, 64, 32768, "wide"), ("e5m2", 100, 2, 8, "random"),
    ("bf16", 3 * 2048 * 16 + 77, 64, 16, "wide"),  # chunks in four tiles of the offsets scan (CH_TILE)
]


def values(fmt, n, kind, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 1 << (8 * fmt.itemsize), n, dtype=np.uint64).astype(fmt.uint_dtype)
    bits = kt.kv_like_bits(fmt, n, escape_rate=0.01, seed=seed).reshape(-1).copy()
    if kind == "zeros":
        bits[rng.random(n) < 0.6] = 0
    if kind == "wide":  # exponents all over the range: escapes, and plane-coded chunks
        E, M = fmt.exp_bits, fmt.mant_bits
        e = rng.integers(0, 1 << E, n).astype(np.uint64)
        wide = rng.random(n) < 0.3
        mask = np.uint64(((1 << E) - 1) << M)
        bits = np.where(wide, (bits.astype(np.uint64) & ~mask) | (e << np.uint64(M)), bits).astype(fmt.uint_dtype)
    return bits


@pytest.mark.parametrize("name,n,channels,chunk,kind", CASES)
def test_kernels_give_the_reference_streams_and_decode_them(exe, tmp_path, name, n, channels, chunk, kind):
    fmt = FORMATS[name]
    bits = values(fmt, n, kind, seed=n)
    want = reference(bits, fmt, channels, chunk)
    payload, *streams = call(exe, tmp_path, 0, fmt, n, channels, chunk, [bits])
    got = dict(zip(STREAMS, streams))
    for k in STREAMS:
        assert got[k] == want[k].tobytes(), k
    assert payload == spec_payload(want)  # every padding byte written, and written 0
    back, code = device_decode(exe, tmp_path, want, n, fmt, channels, chunk)
    assert code == 0 and np.array_equal(back, bits)


@pytest.mark.parametrize("name,n,channels,chunk,kind", [("bf16", 5 * 4096 + 64, 64, 4096, "kv"),
                                                       ("e5m2", 3 * 4096, 128, 32768, "kv"),
                                                       ("fp16", 3 * 2048, 64, 2048, "kv"), ("bf16", 1 << 12, 2, 8, "kv")])
def test_scan_writes_the_blobs_header(exe, tmp_path, name, n, channels, chunk, kind):
    """Given the tensor's version-3 header with any counts (a template), the scan's last tile
    writes the blob's header in front of the payload: the CPU blob's, counts set and CRC sealed."""
    fmt = FORMATS[name]
    bits = values(fmt, n, kind, seed=n)
    blob = bytes(kvzip.compress(bits.reshape(-1, channels), dtype=name, mode="ratio", chunk=chunk, backend="cpu",
                                checksum=False))
    assert layout.version_of(blob) == layout.RATIO_VERSION
    H = layout.COMPACT_SIZE
    template = container.with_counts(blob[:H], 12345, 678, 9)  # other counts, other CRC
    out = call(exe, tmp_path, 5, fmt, n, channels, chunk, [bits, np.frombuffer(template, np.uint8)])
    assert out[0] == blob[H:]  # the payload, as before
    assert out[-1] == blob[:H]


def test_cases_cover_plane_coding_escapes_and_second_level():
    seen = set()
    for name, n, channels, chunk, kind in CASES:
        s = reference(values(FORMATS[name], n, kind, seed=n), FORMATS[name], channels, chunk)
        seen |= {"plane"} if (s["esc_count"] == 0xFFFF).any() else set()
        seen |= {"escapes"} if s["esc_pos"].size else set()
        seen |= {"second"} if s["sec_codes"].size else set()
    assert seen == {"plane", "escapes", "second"}


def cpu_error(s, n, fmt, channels, chunk) -> int:
    dst = np.empty(n, fmt.uint_dtype)
    return channel_pack_cpu.decode(s["codes"], s["rest"], s["tables"], channels, s["esc_count"], s["sec_count"],
                                   s["sec_codes"], s["esc_pos"], s["esc_exp"], s["exp_high"], n, fmt, chunk, dst)


def forgeries(s, rng):
    """(what, streams) pairs: each count stream's field, the variable streams' lengths and contents."""
    def with_(**kw):
        return {**s, **kw}

    listed = np.flatnonzero(s["esc_count"] != 0xFFFF)
    for c in listed[:2].tolist() + listed[-1:].tolist():
        for field, delta in (("esc_count", 1), ("esc_count", -1), ("sec_count", 1), ("sec_count", -1),
                             ("sec_count", 9), ("esc_count", 500)):
            a = s[field].copy()
            a[c] = (int(a[c]) + delta) % 0x10000
            yield f"{field}[{c}]{delta:+}", with_(**{field: a})
        a = s["esc_count"].copy()
        a[c] = 0xFFFF
        yield f"esc_count[{c}]=plane", with_(esc_count=a)
    if s["esc_pos"].size:
        for k in (0, s["esc_pos"].size - 1):
            for v in (0, 65535, int(s["esc_pos"][k]) + 1):
                a = s["esc_pos"].copy()
                a[k] = v
                yield f"esc_pos[{k}]={v}", with_(esc_pos=a)
            a = s["esc_exp"].copy()
            a[k] = 255
            yield f"esc_exp[{k}]=255", with_(esc_exp=a)
    for name in ("sec_codes", "esc_pos", "esc_exp", "exp_high"):
        yield f"{name}+1", with_(**{name: np.concatenate([s[name], np.zeros(1, s[name].dtype)])})
        if s[name].size:
            yield f"{name}-1", with_(**{name: s[name][:-1]})
    codes = s["codes"].copy()
    for at in rng.integers(0, max(codes.size, 1), 4) if codes.size else []:
        codes[at] ^= 0xFF
    yield "codes", with_(codes=codes)


@pytest.mark.parametrize("name,n,channels,chunk,kind", [("bf16", 5 * 4096 + 123, 64, 4096, "kv"),
                                                       ("e5m2", 4096 + 64, 64, 32768, "wide"),
                                                       ("e4m3", 4 * 512 + 9, 64, 512, "kv"),
                                                       ("bf16", 2 * 2048 * 16 + 40, 64, 16, "kv")])  # three tiles
def test_forged_streams_give_the_reference_error(exe, tmp_path, name, n, channels, chunk, kind):
    fmt = FORMATS[name]
    bits = values(fmt, n, kind, seed=n)
    s = reference(bits, fmt, channels, chunk)
    tried = 0
    for what, forged in forgeries(s, np.random.default_rng(1)):
        if forged["esc_pos"].size != forged["esc_exp"].size:
            continue  # ChannelPack.check refuses these before any kernel runs
        want = cpu_error(forged, n, fmt, channels, chunk)
        back, code = device_decode(exe, tmp_path, forged, n, fmt, channels, chunk)
        assert code == want, what
        tried += bool(want)
    assert tried >= 10


@pytest.mark.parametrize("name", ["bf16", "e5m2", "e4m3"])
def test_forged_tables_give_the_reference_error(exe, tmp_path, name):
    """The scan checks the tables on the device (no copy to the host): an entry outside the
    format and a repeat give check_tables's finding, the first where a blob has both."""
    fmt, n, channels, chunk = FORMATS[name], 3 * 4096 + 5, 64, 4096
    s = reference(values(fmt, n, "kv", seed=5), fmt, channels, chunk)
    assert device_decode(exe, tmp_path, s, n, fmt, channels, chunk, tables_code=True)[2] == 0
    E = fmt.exp_bits
    forged = {}
    t = s["tables"].copy()
    t[17 * cc.TABLE_WIDTH + 4] = t[17 * cc.TABLE_WIDTH + 11]
    forged["repeat"] = t
    t = s["tables"].copy()
    t[5 * cc.TABLE_WIDTH + 14] = t[5 * cc.TABLE_WIDTH + 13]  # the last two entries of a channel
    forged["adjacent repeat"] = t
    if E < 8:
        t = s["tables"].copy()
        t[63 * cc.TABLE_WIDTH + 14] = 1 << E
        forged["out of range"] = t
        t = forged["repeat"].copy()
        t[40 * cc.TABLE_WIDTH] = 255
        forged["both"] = t
    for what, t in forged.items():
        with pytest.raises(FormatError) as e:
            cc.check_tables(t, fmt)
        want = cc.TABLE_OUT_OF_RANGE if "2**" in str(e.value) else cc.TABLE_REPEAT
        assert cc.table_error_text(want, fmt) == str(e.value)
        assert device_decode(exe, tmp_path, {**s, "tables": t}, n, fmt, channels, chunk, tables_code=True)[2] == want, what


def scan(exe, tmp_path, esc_count, sec_count, n, chunk, lengths=None):
    """(offsets int64[3, nchunks], error word, totals) of the device scan (op 3) of these counts."""
    checked = [1, *lengths] if lengths is not None else [0, 0, 0, 0]
    offsets, result = call(exe, tmp_path, 3, FORMATS["bf16"], n, 1, chunk,
                           [esc_count, sec_count, np.array(checked, np.int64)])
    result = np.frombuffer(result, np.uint64)
    return np.frombuffer(offsets, np.int64).reshape(3, -1), int(result[0]), [int(x) for x in result[1:]]


def test_offsets_scan_over_many_tiles(exe, tmp_path):
    """The scan alone, over 301 tiles (each tile's start from the look-back over the ones before
    it): the CPU reference's offsets and totals, its lowest count error, and the totals' errors
    past the last chunk."""
    HB, chunk = FORMATS["bf16"].exp_bits - cc.CODE_BITS, 8
    nchunks = 300 * 2048 + 77
    n = nchunks * chunk
    rng = np.random.default_rng(4)
    sec = rng.integers(0, 9, nchunks)  # at most 8 second-level codes and one escape fit a chunk of 8
    esc = (rng.random(nchunks) < 0.3) * ((HB * 1 - (3 * sec + 7) // 8) >= 3)
    plane = rng.random(nchunks) < 0.01
    esc_count = np.where(plane, PLANE, esc).astype(np.uint16)
    sec_count = np.where(plane, 0, sec).astype(np.uint16)
    ng = np.minimum(chunk // 8, (n + 7) // 8 - np.arange(nchunks) * (chunk // 8))
    sizes = np.stack([np.where(plane, 0, (3 * sec + 7) // 8), np.where(plane, 0, esc), np.where(plane, HB * ng, 0)])
    want = np.concatenate([np.zeros((3, 1), np.int64), np.cumsum(sizes, axis=1)[:, :-1]], axis=1)
    totals = [int(t) for t in sizes.sum(axis=1)]
    offsets, err, got = scan(exe, tmp_path, esc_count, sec_count, n, chunk)
    np.testing.assert_array_equal(offsets, want)
    assert got == totals and err == 2**64 - 1

    def reference_error(e, s, lengths):
        out = [np.empty(nchunks, np.int64) for _ in range(3)]
        return channel_pack_cpu._decode_offsets(e, s, n, chunk, HB, *lengths, *out)[1]

    for lengths in (totals, [totals[0] + 1, *totals[1:]], [totals[0], totals[1] - 1, totals[2]],
                    [*totals[:2], totals[2] + 5]):
        _, err, _ = scan(exe, tmp_path, esc_count, sec_count, n, chunk, lengths)
        assert err == (2**64 - 1 if reference_error(esc_count, sec_count, lengths) < 0
                       else reference_error(esc_count, sec_count, lengths)), lengths
    bad = sec_count.copy()
    bad[[200 * 2048 + 5, 280 * 2048 + 1]] = 9  # two chunks' counts past their 8 values: the lower wins
    _, err, _ = scan(exe, tmp_path, esc_count, bad, n, chunk, totals)
    assert err == reference_error(esc_count, bad, totals) == 8 * (200 * 2048 + 5) + 1


@pytest.mark.parametrize("fill", [0, 2**64 - 1])
def test_look_back_waits_for_every_word_it_needs(exe, tmp_path, fill):
    """The scan's look-back (channel_offsets.cuh's tile_look_back) over words that start zeroed
    or as 0xFF bytes and are published while it waits, out of order: aggregates (flag 1) of
    every tile before it, inclusive prefixes (flag 2) of a few, the window of 32 stepped back
    twice.  The prefix is the tiles' sum whichever inclusive word it stops at, and it publishes
    its own."""
    c, mine = 70, 12345
    rng = np.random.default_rng(7)
    own = rng.integers(0, 1 << 40, c)
    inclusive = np.cumsum(own)
    order = []
    for t in rng.permutation(c):
        order += [t, (1 << 62) | int(own[t])]
    for t in (0, 5, 11):  # late inclusive words, far behind tile c: the look-back stops at none of them early
        order += [t, (2 << 62) | int(inclusive[t])]
    got, status = call(exe, tmp_path, 4, FORMATS["bf16"], 0, 1, 8,
                       [np.array([fill], np.uint64), np.array(order, np.uint64), np.array([c, mine], np.int64)])
    (prefix,) = struct.unpack("<Q", got)
    assert prefix == int(inclusive[-1])
    assert np.frombuffer(status, np.uint64)[c] == (2 << 62) | (int(inclusive[-1]) + mine)


def test_harness_constants_are_the_codebooks():
    text = loader.sources()[loader.CHANNEL] + loader.sources()["channel_offsets.cuh"]
    defined = {k: int(v, 0) for k, v in re.findall(r"#define (CH_\w+) (0x[0-9A-Fa-f]+|\d+)", text)}
    assert defined["CH_WIDTH"] == cc.TABLE_WIDTH and defined["CH_PRIMARY"] == cc.PRIMARY
    assert defined["CH_MAX_CHANNELS"] == cc.MAX_CHANNELS
    from kvzip.gpu import channel_pack

    assert defined["CH_TILE_THREADS"] == channel_pack.TILE_THREADS and channel_pack.TILE == 8 * channel_pack.TILE_THREADS


AUTO_CASES = [  # (format, n, how the values are made): the speed mode's kvz_auto_codebook, whose
    # sample plan and ranking channel.cu shares (auto_codebook.cu's SamplePlan, rank_exponents)
    ("bf16", 0, "kv"), ("bf16", 1, "kv"), ("bf16", 4099, "kv"), ("bf16", 5000, "wide"), ("bf16", 3000, "zeros"),
    ("bf16", (1 << 20) + 4099, "kv"), ("bf16", 3 << 20, "wide"), ("fp16", 70000, "kv"), ("fp32", 2049, "random"),
    ("e4m3", 4096, "random"), ("e4m3", 100, "kv"), ("e5m2", 65536 + 7, "kv"), ("e5m2", 999, "wide"),
]


@pytest.mark.parametrize("name,n,kind", AUTO_CASES)
def test_auto_codebook_kernel_gives_the_reference_codebook(exe, tmp_path, name, n, kind):
    """kvz_auto_codebook (codebook="auto" on a GPU) chooses kvzip.auto_codebook's codebook: its
    book is the codebook's exponents in code order, its LUT each exponent's code or ESC_FLAG."""
    from kvzip.auto_codebook import auto_codebook

    fmt = FORMATS[name]
    bits = values(fmt, n, kind, seed=n)
    lut, book = call(exe, tmp_path, 2, fmt, n, 1, 4096, [bits])
    want = auto_codebook(bits, fmt).exponents
    assert list(book) == list(want)
    expect = [want.index(e) if e in want else 0x80 for e in range(1 << fmt.exp_bits)]
    assert list(lut[: 1 << fmt.exp_bits]) == expect
