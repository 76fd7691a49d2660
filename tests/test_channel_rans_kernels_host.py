"""kvzip/gpu/kernels/channel_rans.cu (the storage mode's CUDA kernels) run on the host, without a
GPU: tests/cuda_host/emu.h makes every GPU thread a host thread and every warp intrinsic a
rendezvous of its warp, and tests/cuda_host/channel_rans_host.cpp launches the kernels in
kvzip/gpu/channel_rans.py's order.  Their histogram must be the CPU reference's counts, their
streams its bytes (the tables too: made from the kernels' histogram by kvz_rans_tables), their
decode the values, and a forged stream's error the reference's.  kvz_rans_tables
(kernels/rans_tables.cuh) must give the writer's rule of stages/channel_rans.py (choose_shift,
tables_bytes(group_tables)) and kvzip/gpu/channel_rans.py's device_tables of it, shift, stream
and table words, on real KV, random, tied, empty, single-exponent, every-exponent and
huge-count histograms of every exponent width and channel counts 1 to 256.  Needs g++ (C++20)."""
from __future__ import annotations

import re
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from cuda_host import harness

from kvzip import channel_codebook
from kvzip import stages as S
from kvzip import testing as kt
from kvzip.backends import get_backend
from kvzip.data import load_sample
from kvzip.formats import FORMATS
from kvzip.frame import Frame
from kvzip.gpu import channel_rans as gpu
from kvzip.gpu import loader
from kvzip.stages import channel_rans as cr
from kvzip.stages import channel_rans_cpu

STREAMS = ("rest", "states", "word_count", "esc_count", "words", "esc_exp")  # the harness's encode output
DTYPES = {"rest": np.uint8, "states": np.uint32, "word_count": np.uint32, "esc_count": np.uint32,
          "words": np.uint16, "esc_exp": np.uint8}

KV_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "kv"  # the real KV captures, where present
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ to build the host harness")


@pytest.fixture(scope="module")
def exe(tmp_path_factory):
    return harness.build(loader.CHANNEL_RANS, "channel_rans_host.cpp", tmp_path_factory.mktemp("channel_rans_host"))


def call(exe, tmp_path, op, fmt, n, channels, chunk, arrays, grid=3, shift=0, groups=0, a=0, b=0) -> list[bytes]:
    params = [op, fmt.exp_bits, fmt.mant_bits, n, channels, chunk, grid, shift, groups, a, b]
    return harness.call(exe, tmp_path, params, arrays)


def values(fmt, n, kind, channels=1, seed=0) -> np.ndarray:
    """n values' bits: "kv" KV-like with 1 % escapes, "random" every bit pattern, "zeros" 60 %
    exact zeros, "wide" 30 % of the exponents anywhere, "channels" a channel-dependent exponent
    offset (tables a group of channels), "holes" even exponents only (and the escapes'), "real"
    the shipped real KV (BF16)."""
    rng = np.random.default_rng(seed)
    E, M = fmt.exp_bits, fmt.mant_bits
    if kind == "random":
        return rng.integers(0, 1 << (8 * fmt.itemsize), n, dtype=np.uint64).astype(fmt.uint_dtype)
    if kind == "real":
        sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample("code").values()])
        return sample[:n].copy()
    bits = kt.kv_like_bits(fmt, n, escape_rate=0.01, seed=seed).reshape(-1).astype(np.uint64)
    if kind == "zeros":
        bits[rng.random(n) < 0.6] = 0
    e = (bits >> np.uint64(M)) & np.uint64((1 << E) - 1)
    if kind == "wide":
        e = np.where(rng.random(n) < 0.3, rng.integers(0, 1 << E, n).astype(np.uint64), e)
    if kind == "holes":  # even exponents only: frequency-0 exponents inside the tables' ranges
        e = e & ~np.uint64(1)
    if kind == "channels":
        e = (e + np.uint64(3) * ((np.arange(n, dtype=np.uint64) & np.uint64(channels - 1)) % np.uint64(5))) \
            & np.uint64((1 << E) - 1)
    mask = np.uint64(((1 << E) - 1) << M)
    return ((bits & ~mask) | (e << np.uint64(M))).astype(fmt.uint_dtype)


def reference(bits, fmt, channels, chunk) -> dict:
    """The CPU reference's streams: the stage on the CPU backend, a tensor [n / channels, channels]."""
    n = bits.shape[0]
    meta = {"dtype": fmt.dtype_name, "shape": [n // channels, channels], "n": n, "format": fmt.name}
    frame = cr.ChannelRans(chunk).encode(Frame(get_backend("cpu"), {"data": bits}, meta))
    return {k: np.asarray(v) for k, v in frame.streams.items()}


def tables_of(s, fmt, channels):
    """(shift, words, groups, search_top) of a tables stream: parse_tables, then device_tables."""
    shift, freq, cum, _ = cr.parse_tables(s["tables"], channels, fmt.exp_bits)
    return (shift, *gpu.device_tables(s["tables"], freq, cum, fmt.exp_bits))


def device_rule(exe, tmp_path, hist, fmt) -> tuple:
    """(shift, tables stream, table words, groups, search_top) of kvz_rans_tables on a histogram
    (uint32[channels, 2**E])."""
    D = hist.shape[0]
    stream, words, info = call(exe, tmp_path, 3, fmt, 0, D, 32, [np.ascontiguousarray(hist, np.uint32).reshape(-1)])
    shift, nbytes, nwords, ng, top = (int(x) for x in np.frombuffer(info, np.uint32))
    assert len(stream) == nbytes and len(words) == 4 * nwords
    return shift, np.frombuffer(stream, np.uint8), np.frombuffer(words, np.uint32), ng, top


def reference_rule(hist, fmt) -> tuple:
    """The same of the Python reference: choose_shift, tables_bytes(group_tables), device_tables."""
    E, h = fmt.exp_bits, hist.astype(np.int64)
    shift = cr.choose_shift(h, E)
    stream = cr.tables_bytes(shift, cr.group_tables(h, shift))
    _, freq, cum, _ = cr.parse_tables(stream, h.shape[0], E)
    return (shift, stream, *gpu.device_tables(stream, freq, cum, E))


def device_encode(exe, tmp_path, bits, fmt, channels, chunk) -> dict:
    """The streams of the kernels' chain, as kvzip/gpu/channel_rans.py's encode launches it:
    kvz_rans_histogram, kvz_rans_tables, kvz_rans_encode, kvz_rans_offsets, kvz_rans_compact."""
    n = bits.shape[0]
    S, per_block, blocks = gpu.histogram_plan(n, channels, fmt.exp_bits, 3)
    (hist,) = call(exe, tmp_path, 0, fmt, n, channels, 32, [bits], grid=blocks, a=S, b=per_block)
    shift, tables, words, ng, _ = device_rule(exe, tmp_path, np.frombuffer(hist, np.uint32).reshape(channels, -1), fmt)
    out = call(exe, tmp_path, 1, fmt, n, channels, chunk, [bits, words], shift=shift, groups=ng)
    return {**dict(zip(STREAMS, out)), "tables": tables.tobytes()}


def device_decode(exe, tmp_path, s, n, fmt, channels, chunk):
    shift, words, ng, top = tables_of(s, fmt, channels)
    dst, err = call(exe, tmp_path, 2, fmt, n, channels, chunk,
                    [np.asarray(s[k]) for k in ("rest", "states", "words", "word_count", "esc_exp", "esc_count")]
                    + [words], shift=shift, groups=ng, a=top)
    (word,) = struct.unpack("<Q", err)
    return np.frombuffer(dst, fmt.uint_dtype), 0 if word == 2**64 - 1 else word % 8


def cpu_error(s, n, fmt, channels, chunk) -> int:
    shift, freq, cum, sym_of = cr.parse_tables(s["tables"], channels, fmt.exp_bits)
    dst = np.empty(n, fmt.uint_dtype)
    return channel_rans_cpu.decode(s["rest"], s["states"], s["words"], s["word_count"], s["esc_exp"], s["esc_count"],
                                   freq, cum, sym_of, channels, shift, n, fmt, chunk, dst)


# ----------------------------------------------------------------------------- histogram
HIST_CASES = [  # (format, n, channels, grid): slices of 32 channels (E = 8), one slice (E <= 5), a
    # last partial row (n not a multiple of channels: the kernel's rule, though tensors never have one)
    ("bf16", 0, 64, 4), ("bf16", 5000, 1, 4), ("bf16", 64 * 70 + 13, 64, 4), ("bf16", 256 * 40, 256, 16),
    ("fp32", 3000, 16, 2), ("fp16", 256 * 30 + 100, 256, 3), ("e5m2", 7777, 8, 5), ("e4m3", 128 * 50, 128, 2),
]


@pytest.mark.parametrize("name,n,channels,grid", HIST_CASES)
def test_histogram_counts_every_value_by_channel(exe, tmp_path, name, n, channels, grid):
    fmt = FORMATS[name]
    bits = values(fmt, n, "wide", seed=n)
    S, per_block, blocks = gpu.histogram_plan(n, channels, fmt.exp_bits, grid)
    (hist,) = call(exe, tmp_path, 0, fmt, n, channels, 32, [bits], grid=blocks, a=S, b=per_block)
    want = channel_rans_cpu.histogram(bits, fmt, channels)
    assert np.array_equal(np.frombuffer(hist, np.uint32).reshape(want.shape), want)


# ----------------------------------------------------------------------------- the writer's rule
BY_E = {8: FORMATS["bf16"], 5: FORMATS["e5m2"], 4: FORMATS["e4m3"]}


def quantized(bits16, name):
    """BF16 bits quantized to an FP8 format by the QuantizeFP8 stage (one scale a tensor)."""
    if name == "bf16":
        return bits16
    n = bits16.size
    frame = S.QuantizeFP8(name, "tensor").encode(Frame(get_backend("cpu"), {"data": bits16.reshape(-1)},
                                                       {"dtype": "bfloat16", "shape": [n], "n": n, "format": "bf16"}))
    return np.asarray(frame.streams["data"])


def real_histograms():
    """(label, E, hist) of real KV layer tensors, each alone ([heads, tokens, 64]: 64 channels),
    BF16 and quantized to E5M2 / E4M3: the shipped sample, and the captures of KV_DIR when there."""
    tensors = [(f"sample {k}", v.view(np.uint16)) for k, v in sorted(load_sample().items())[::90]]
    if KV_DIR.exists():
        import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy for safetensors)
        from safetensors.numpy import load_file

        for path in sorted(KV_DIR.glob("*.safetensors")):
            layers = load_file(str(path))
            tensors += [(f"{path.stem} {k}", layers[k].view(np.uint16)) for k in sorted(layers)[5:6]]
    for label, t in tensors:
        for name in ("bf16", "e5m2", "e4m3"):
            fmt = FORMATS[name]
            yield f"{label} {name}", fmt.exp_bits, channel_rans_cpu.histogram(quantized(t, name).reshape(-1), fmt,
                                                                               t.shape[-1])


def escape_tie(E):
    """A table whose escape's count equals the largest exponent count (the normalisation's tie at
    the largest frequency: the escape's, index 0, takes the difference)."""
    hist = np.zeros((1, 1 << E), np.int64)
    hist[0, (1 << E) - 2] = 50
    hist[0, (1 << E) - 3] = 20
    hist[0, :25 if E > 4 else 12] = 2  # below MIN_COUNT and outside [lo, hi]: the escapes
    return hist


def crowded(E):
    """Symbols of count 1 between equal larger counts: F = max(1, ...) overshoots 4096, so the
    normalisation takes from the largest (equal: the lowest exponent first), in several rounds
    where E = 8 (52 counts of 1000 and 204 of 1: 4260 slots, three rounds)."""
    hist = np.ones((1, 1 << E), np.int64)
    hist[0, ::5] = 1000
    return hist


def synthetic_histograms():
    """(label, E, hist): random ones of every width and channel count, ties between groupings,
    empty channels and tensors, one exponent, every exponent, counts near 2**31 and 2**32."""
    rng = np.random.default_rng(7)
    for E, D in ((8, 1), (8, 2), (5, 4), (4, 8), (8, 32), (5, 64), (4, 128), (8, 256)):
        hist = (rng.random((D, 1 << E)) ** 3 * rng.choice([20, 3000, 10**6], (D, 1))).astype(np.int64)
        yield f"random E={E} D={D}", E, hist * (rng.random((D, 1 << E)) < 0.5)
    for E in (4, 5, 8):
        hist = np.zeros((2, 1 << E), np.int64)
        hist[0, 3], hist[1, 5] = 8, 8  # shifts 0 and 1 tie (2 x 40 bits, 64 + 16): the finer
        yield f"tie E={E}", E, hist
        yield f"empty E={E}", E, np.zeros((8, 1 << E), np.int64)
        hist = (rng.random((16, 1 << E)) < 0.2) * rng.integers(0, 9, (16, 1 << E))
        hist[::3] = 0
        yield f"some empty channels E={E}", E, hist
        D = 256 if E == 8 else 32  # one table for all 256 channels: shift 8
        hist = np.zeros((D, 1 << E), np.int64)
        hist[:, (1 << E) - 1] = rng.integers(1, 1000, D)
        yield f"one exponent E={E} D={D}", E, hist
        yield f"escape tie E={E}", E, escape_tie(E)
        hist = np.zeros((2, 1 << E), np.int64)
        hist[:, 1], hist[:, (1 << E) - 2], hist[1, 5] = 1, 1, 1  # every count below MIN_COUNT: [lo, hi] =
        yield f"mode tie E={E}", E, hist                         # the mode, the lowest of the largest
        yield f"crowded E={E}", E, crowded(E)
        yield f"every exponent E={E}", E, rng.integers(4, 100, (64, 1 << E))
        hist = np.full((2, 1 << E), 2**32 - 1, np.int64)
        hist[1, 0] = 2**31
        yield f"near 2**32 E={E}", E, hist
    # the largest tables: 256 channels of every exponent, a distinct exponent of ~2**31 values each
    hist = rng.integers(4, 64, (256, 256))
    hist[np.arange(256), np.arange(256)] = 2**31 - rng.integers(1, 2**20, 256)
    yield "widest 256 x 257", 8, hist
    found = 0
    for _ in range(3000):  # random small histograms whose groupings tie at the smallest estimate
        D, E = int(rng.choice([2, 4])), 4
        hist = np.zeros((D, 16), np.int64)
        for d in range(D):
            k = rng.integers(1, 4)
            hist[d, rng.integers(0, 16, k)] = rng.integers(0, 12, k)
        costs = [cr._estimate_bits(hist, s, E) for s in range(D.bit_length())]
        if costs.count(min(costs)) > 1:
            found += 1
            yield f"random tie {found}", E, hist
            if found == 3:
                break


RULE_CASES = list(synthetic_histograms())


@pytest.mark.parametrize("label,E,hist", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_device_tables_are_the_writers_rule(exe, tmp_path, label, E, hist):
    got, want = device_rule(exe, tmp_path, hist, BY_E[E]), reference_rule(hist, BY_E[E])
    assert got[0] == want[0], "shift"
    assert np.array_equal(got[1], want[1]), "tables stream"
    assert np.array_equal(got[2], want[2]), "table words"
    assert got[3:] == want[3:], "groups, search_top"


def test_device_tables_on_real_kv(exe, tmp_path):
    for label, E, hist in real_histograms():
        got, want = device_rule(exe, tmp_path, hist, BY_E[E]), reference_rule(hist, BY_E[E])
        assert got[0] == want[0] and np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2]), label
        assert got[3:] == want[3:], label


def normalisation_rounds(counts) -> int:
    """_freqs's rounds of its difference loop on one table's counts (escape first)."""
    c = counts.copy()
    c[0] += np.count_nonzero(c) < 2
    f = np.where(c > 0, np.maximum(1, c * cr.TOTAL // c.sum()), 0)
    d, rounds = cr.TOTAL - int(f.sum()), 0
    while d:
        j = int(np.argmax(f))
        step = d if d > 0 else max(d, 1 - int(f[j]))
        f[j] += step
        d -= step
        rounds += 1
    return rounds


def test_rule_cases_reach_what_they_claim():
    """The cases hold ties between groupings, several normalisation rounds, escape frequencies
    tied with the largest, shifts 0, 1 and 8, the widest tables and group counts beyond uint32."""
    shifts, ties, rounds, escape_ties, widest = set(), 0, 0, 0, 0
    for _, E, hist in RULE_CASES:
        h = hist.astype(np.int64)
        costs = [cr._estimate_bits(h, s, E) for s in range(h.shape[0].bit_length())]
        ties += costs.count(min(costs)) > 1
        shift = cr.choose_shift(h, E)
        shifts.add(shift)
        merged = cr._merged(h, shift)
        for (lo, hi, f), row in zip(cr.group_tables(h, shift), merged):
            counts = np.concatenate(([row.sum() - row[lo:hi + 1].sum()], row[lo:hi + 1]))
            rounds = max(rounds, normalisation_rounds(counts))
            first = np.where(counts > 0, np.maximum(1, counts * cr.TOTAL // counts.sum()), 0)
            escape_ties += counts[0] > 0 and first[0] == first.max() and f[0] != first[0]
            widest = max(widest, hi - lo + 2)
    assert ties >= 4 and rounds >= 2 and escape_ties >= 1 and widest == 257 and {0, 1, 8} <= shifts
    assert max(int(h.astype(np.int64).sum(axis=0).max()) for _, _, h in RULE_CASES) > 2**32


# ----------------------------------------------------------------------------- encode and decode
CASES = [  # (format, n, channels, chunk, how the values are made)
    ("bf16", 0, 1, 65536, "kv"), ("bf16", 1, 1, 32, "kv"), ("bf16", 31, 1, 32, "kv"), ("bf16", 33, 1, 32, "zeros"),
    ("bf16", 5 * 1024 + 8 * 3, 8, 1024, "kv"), ("bf16", 64 * 150, 64, 4096, "channels"),
    ("bf16", 64 * 48 * 3, 64, 2048, "real"), ("bf16", 128 * 20, 128, 256, "wide"), ("bf16", 256 * 12, 256, 64, "random"),
    ("bf16", 3 * 1000 + 5, 1, 32, "zeros"), ("bf16", 2 * 9000, 2, 65536, "kv"),
    ("fp16", 32 * 200 + 3 * 32, 32, 1024, "channels"), ("fp16", 4000, 4, 128, "random"),
    ("fp32", 16 * 190, 16, 512, "wide"), ("fp32", 999, 1, 64, "kv"),
    ("e4m3", 64 * 90, 64, 1024, "channels"), ("e4m3", 4096, 4, 4096, "random"),
    ("e5m2", 128 * 60 + 128, 128, 2048, "kv"), ("e5m2", 64 * 40, 64, 32, "wide"), ("e5m2", 100, 2, 32, "random"),
]


@pytest.mark.parametrize("name,n,channels,chunk,kind", CASES)
def test_kernels_give_the_reference_streams_and_decode_them(exe, tmp_path, name, n, channels, chunk, kind):
    fmt = FORMATS[name]
    bits = values(fmt, n, kind, channels, seed=n)
    want = reference(bits, fmt, channels, chunk)
    got = device_encode(exe, tmp_path, bits, fmt, channels, chunk)
    for k in STREAMS + ("tables",):
        assert got[k] == want[k].tobytes(), k
    back, code = device_decode(exe, tmp_path, want, n, fmt, channels, chunk)
    assert code == 0 and np.array_equal(back, bits)


def test_cases_cover_escapes_groups_and_wide_tables():
    seen = set()
    for name, n, channels, chunk, kind in CASES:
        fmt = FORMATS[name]
        s = reference(values(fmt, n, kind, channels, seed=n), fmt, channels, chunk)
        _, _, ng, top = tables_of(s, fmt, channels)
        seen |= {"escapes"} if s["esc_exp"].size else set()
        seen |= {"groups"} if ng > 1 else set()
        seen |= {"wide"} if top >= 128 else set()
        seen |= {"partial chunk"} if n % chunk else set()
        seen |= {"full words"} if (s["word_count"] > (s["word_count"].sum() / max(1, s["word_count"].size))).any() \
            else set()
    assert {"escapes", "groups", "wide", "partial chunk"} <= seen


def test_device_tables_find_every_slots_symbol():
    """A binary search over device_tables' entries of each group finds parse_tables's symbol of
    every slot (the decoder's lookup), for narrow, wide and zero-frequency tables."""
    for name, kind, channels in (("bf16", "channels", 64), ("bf16", "random", 1), ("e5m2", "wide", 8),
                                 ("fp16", "zeros", 4)):
        fmt = FORMATS[name]
        s = reference(values(fmt, 64 * 300, kind, channels, seed=1), fmt, channels, 4096)
        shift, freq, cum, sym_of = cr.parse_tables(s["tables"], channels, fmt.exp_bits)
        words, ng, top = gpu.device_tables(s["tables"], freq, cum, fmt.exp_bits)
        desc, entries = words[:2 * ng], words[2 * ng:].view(np.uint16)
        slots = np.arange(4096)
        for g in range(ng):
            off, lo, width = int(desc[2 * g]), int(desc[2 * g + 1] & 0xFF), int(desc[2 * g + 1] >> 8 & 0x1FF)
            assert int(desc[2 * g + 1] >> 20) == freq[g, 1 << fmt.exp_bits]
            group = entries[off:off + width + 2].astype(np.int64)
            k = np.searchsorted(group, slots, side="right") - 1
            assert width + 1 <= 2 * top
            want = sym_of[g].astype(np.int64)
            assert np.array_equal(np.where(k == 0, 1 << fmt.exp_bits, lo + k - 1), want)


# ----------------------------------------------------------------------------- forged streams
def forgeries(s, rng):
    """(what, streams) pairs: each count stream's fields, the states, the words and escapes."""
    def with_(**kw):
        return {**s, **kw}

    nchunks = s["word_count"].size
    for c in sorted({0, 1, nchunks - 1} & set(range(nchunks))):
        for field, delta in (("word_count", 1), ("word_count", -1), ("esc_count", 1), ("esc_count", -1),
                             ("word_count", 70000), ("esc_count", 3)):
            a = s[field].copy()
            a[c] = (int(a[c]) + delta) % 2**32
            yield f"{field}[{c}]{delta:+}", with_(**{field: a})
        wc, ec = s["word_count"].copy(), s["esc_count"].copy()
        wc[c] += 1
        ec[c] += 1
        yield f"both counts[{c}]+1", with_(word_count=wc, esc_count=ec, words=np.append(s["words"], np.uint16(0)),
                                            esc_exp=np.append(s["esc_exp"], np.uint8(0)))
        wc[c] = ec[c] = 2**31
        yield f"both counts[{c}] huge", with_(word_count=wc, esc_count=ec)
        for lane, v in ((0, 0xFFFF), (31, 0x10001), (5, 2**32 - 1), (7, int(s["states"][32 * c + 7]) ^ 1)):
            a = s["states"].copy()
            a[32 * c + lane] = v
            yield f"states[{c},{lane}]={v}", with_(states=a)
    for name in ("words", "esc_exp"):
        yield f"{name}+1", with_(**{name: np.concatenate([s[name], np.zeros(1, s[name].dtype)])})
        if s[name].size:
            yield f"{name}-1", with_(**{name: s[name][:-1]})
    if s["word_count"].size and s["word_count"][0]:  # chunk 0's last word: its last states change
        for bit in (1, 0x8000):
            a = s["words"].copy()
            a[int(s["word_count"][0]) - 1] ^= bit
            yield f"words[last of chunk 0]^{bit}", with_(words=a)
    for k in rng.integers(0, max(s["words"].size, 1), 4) if s["words"].size else []:
        a = s["words"].copy()
        a[k] ^= 0x1234
        yield f"words[{k}]", with_(words=a)
    lo, hi = int(s["tables"][1]), int(s["tables"][2])  # group 0's range: its ends and first holes
    edges = {lo - 1, lo, lo + 1, lo + 2, lo + 3, hi - 1, hi, hi + 1} & set(range(256))
    for k in sorted({0, s["esc_exp"].size - 1}) if s["esc_exp"].size else []:
        for v in sorted({255, int(s["esc_exp"][k]) ^ 1, 127} | edges):
            a = s["esc_exp"].copy()
            a[k] = v
            yield f"esc_exp[{k}]={v}", with_(esc_exp=a)


FORGED = [("bf16", 64 * 150, 64, 4096, "channels"), ("e5m2", 64 * 40, 64, 1024, "kv"), ("e4m3", 4 * 1024 + 96, 4, 1024, "kv"),
          ("bf16", 3 * 2048 + 640, 1, 2048, "holes")]


@pytest.mark.parametrize("name,n,channels,chunk,kind", FORGED)
def test_forged_streams_give_the_reference_error(exe, tmp_path, name, n, channels, chunk, kind):
    fmt = FORMATS[name]
    s = reference(values(fmt, n, kind, channels, seed=n), fmt, channels, chunk)
    for what, forged in forgeries(s, np.random.default_rng(1)):
        want = cpu_error(forged, n, fmt, channels, chunk)
        _, code = device_decode(exe, tmp_path, forged, n, fmt, channels, chunk)
        assert code == want, what


def test_forgeries_reach_every_error():
    codes = set()
    for name, n, channels, chunk, kind in FORGED:
        fmt = FORMATS[name]
        s = reference(values(fmt, n, kind, channels, seed=n), fmt, channels, chunk)
        codes |= {cpu_error(f, n, fmt, channels, chunk) for _, f in forgeries(s, np.random.default_rng(1))}
    assert codes == {0, 1, 2, 3, 4, 5}


def test_harness_constants_are_the_stages():
    text = loader.sources()[loader.CHANNEL_RANS] + loader.sources()["rans_tables.cuh"]
    defined = {k: int(v, 0) for k, v in re.findall(r"#define (RANS_\w+) (0x[0-9A-Fa-f]+|\d+)u?", text)}
    assert defined["RANS_TABLES_THREADS"] == gpu.TABLES_THREADS and defined["RANS_INFO_WORDS"] == gpu.INFO_WORDS
    assert defined["RANS_MAX_GROUPS"] == 256 == channel_codebook.MAX_CHANNELS and gpu.FREQ_BITS == cr.FREQ_BITS
    assert defined["RANS_PROB_BITS"] == channel_rans_cpu.PROB_BITS and defined["RANS_TOTAL"] == cr.TOTAL
    assert defined["RANS_LOW"] == channel_rans_cpu.STATE_LOW and defined["RANS_WARPS"] == gpu.WARPS
    assert defined["RANS_BOUND_SHIFT"] == 32 - channel_rans_cpu.PROB_BITS
    assert defined["RANS_SCAN_THREADS"] == gpu.SCAN_THREADS and defined["RANS_HIST_THREADS"] == gpu.HIST_THREADS
    assert defined["RANS_HIST_COUNTERS"] == gpu.HIST_COUNTERS and gpu.TOTAL == cr.TOTAL
    assert gpu.LANES == channel_rans_cpu.LANES
