"""TCA-TBE (kvzip/weights/tca_tbe.py, docs/weights-format.md): every matrix round-trips bit for
bit, the writer's choices are the spec's, MiniLM's real weights cost what ZipServ's layout costs
(~11.35 bits a weight), and no hostile blob gets past the reader as anything but FormatError."""
from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import examples
from forgery import reseal
from kvzip.errors import FormatError
from kvzip.weights import samples, tca_tbe

MINILM = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "weights" / "minilm-l6_weights_bf16.safetensors"
ZIPSERV_MINILM_BITS = 11.35  # the data's README: ZipServ's layout, measured with NumPy


def shapes(max_side=150):
    return st.tuples(st.integers(0, max_side), st.integers(0, max_side))


def window_counts(w: np.ndarray) -> np.ndarray:
    h = np.bincount(((w >> 7) & 0xFF).ravel(), minlength=256)
    return np.array([h[s:s + 7].sum() for s in range(250)])


# ----------------------------------------------------------------------------- round trips
@settings(max_examples=examples(60))
@given(shape=shapes(), kind=st.sampled_from(samples.KINDS), seed=st.integers(0, 2**32 - 1))
def test_round_trip(shape, kind, seed):
    w = samples.synthetic(kind, shape, np.random.default_rng(seed))
    blob = tca_tbe.encode(w)
    back = tca_tbe.decode(blob)
    assert back.dtype == np.uint16 and back.shape == w.shape and np.array_equal(back, w)
    assert tca_tbe.encode(back) == blob  # one encoding per matrix
    info = tca_tbe.info(blob)
    assert info["bytes"] == len(blob) and info["in_window"] + info["fallback"] == w.size
    if w.size:
        counts = window_counts(w)
        assert info["in_window"] == counts.max() and info["base"] == int(np.argmax(counts)) - 1  # best, lowest on ties
        assert tca_tbe.bits_per_weight(blob) == info["bits_per_weight"] == 8 * len(blob) / w.size


@settings(max_examples=examples(30))
@given(shape=shapes(80), pattern=st.integers(0, 0xFFFF))
def test_constant_matrices_cover_every_window_end(shape, pattern):
    """Any one bit pattern, zeros (window 0..6, base -1) and NaNs (window 249..255) included."""
    w = np.full(shape, pattern, np.uint16)
    blob = tca_tbe.encode(w)
    assert np.array_equal(tca_tbe.decode(blob), w)
    assert tca_tbe.info(blob)["fallback"] == 0
    assert -1 <= tca_tbe.info(blob)["base"] <= 248


def test_layout_of_a_small_matrix_by_hand():
    """A 64x64 matrix: element (r, c) lands in small tile 16*(r//16) + 2*(c//8) + (r//8)%2 at bit
    8*(r%8) + c%8 of the bitmaps; the streams hold sign-mantissa bytes and fallbacks in that order."""
    w = np.full((64, 64), 0x3F80, np.uint16)        # 1.0: exponent 127, so window 121..127, base 120
    w[9, 3] = 0xBFC0                                 # -1.5: exponent 127, code 7
    w[17, 12] = 0x4600                               # 8192.0: exponent 140, outside: a fallback
    blob = tca_tbe.encode(w)
    lay = tca_tbe.read_layout(blob, len(blob))
    assert lay.base == 120 and lay.filler == 121 << 7

    def stream(name, dtype):
        o, n = lay.streams[name]
        return np.frombuffer(blob, dtype, n // np.dtype(dtype).itemsize, o)

    tile_a, bit_a = 16 * 0 + 2 * 0 + 1, 8 * 1 + 3    # (9, 3)
    tile_b, bit_b = 16 * 1 + 2 * 1 + 0, 8 * 1 + 4    # (17, 12)
    for b in range(3):
        plane = stream(f"bitmap{b}", "<u8")
        assert plane[0] == plane[tile_a] == (1 << 64) - 1 and plane[tile_b] == ((1 << 64) - 1) ^ (1 << bit_b)
    sm, fb = stream("sign_mantissa", np.uint8), stream("fallback", "<u2")
    assert len(sm) == 4096 and fb.tolist() == [0x4600] + [0] * 7
    assert sm[tile_a * 64 + bit_a] == 0xC0 and sm[4095] == 0   # -1.5: sign 1, mantissa 0x40; the run's padding
    assert stream("global_offsets", "<u4").tolist() == [0, 0, 4096, 8]
    assert stream("median_offsets", "<u4").tolist() == [0, 0, 1024, 0, 2047, 1, 3071, 1]


# ----------------------------------------------------------------------------- real weights
@pytest.mark.skipif(not MINILM.exists(), reason=f"{MINILM} absent")
def test_minilm_weights_cost_what_zipserv_costs():
    matrices = samples.read_bf16_matrices(MINILM)
    assert len(matrices) == 38
    total_bits = total_weights = covered = 0
    per_matrix = {}
    for name, w in matrices.items():
        blob = tca_tbe.encode(w)
        assert np.array_equal(tca_tbe.decode(blob), w), name
        info = tca_tbe.info(blob)
        per_matrix[name] = info["bits_per_weight"]
        total_bits += 8 * len(blob)
        total_weights += w.size
        covered += info["in_window"]
    pooled = total_bits / total_weights
    print(f"\nMiniLM TCA-TBE: pooled {pooled:.4f} bits/weight, coverage {covered / total_weights:.4f}, "
          f"per matrix {min(per_matrix.values()):.3f}-{max(per_matrix.values()):.3f}")
    assert abs(pooled - ZIPSERV_MINILM_BITS) < 0.1
    assert 0.965 < covered / total_weights < 0.975


# ----------------------------------------------------------------------------- hostile blobs
@pytest.fixture(scope="module")
def blob():
    """70 x 100: padded on both axes, 4 global tiles (an even count: 8 alignment bytes follow
    the global offsets), some fallbacks."""
    return tca_tbe.encode(samples.synthetic("specials", (70, 100), np.random.default_rng(7)))


def rejects(blob, match=None):
    with pytest.raises(FormatError, match=match):
        tca_tbe.decode(blob)
    with pytest.raises(FormatError, match=match):
        tca_tbe.info(blob)


def test_truncated_or_extended(blob):
    rng = np.random.default_rng(1)
    for n in sorted({*range(0, 80), *rng.integers(80, len(blob), 100).tolist(), len(blob) - 1, len(blob) - 16}):
        rejects(blob[:n])
    rejects(blob + bytes(16))
    with pytest.raises(FormatError):
        tca_tbe.bits_per_weight(blob[:-16])


def test_flipped_bits_are_caught_by_the_checksums(blob):
    rng = np.random.default_rng(2)
    for bit in rng.integers(0, 8 * len(blob), 300).tolist():
        b = bytearray(blob)
        b[bit // 8] ^= 1 << (bit % 8)
        rejects(bytes(b), "CRC|checksum|magic|version")


def _field(blob, fmt, at, value):
    b = bytearray(blob)
    struct.pack_into(fmt, b, at, value)
    return reseal(b)


def _stream(blob, name):
    return tca_tbe.read_layout(blob, len(blob)).streams[name]


def test_forged_header_fields(blob):
    assert np.array_equal(tca_tbe.decode(reseal(bytearray(blob))), tca_tbe.decode(blob))  # reseal itself is right
    rejects(_field(blob, "<8s", 0, b"KVZTBE\x00\r"), "magic")
    rejects(_field(blob, "<H", 8, 2), "version")
    for base in (-2, 249, 0x7FFF, -0x8000):
        rejects(_field(blob, "<h", 10, base), "base")
    other = tca_tbe.decode(_field(blob, "<h", 10, 3))  # another base: well formed, other weights (the filler moves too)
    assert other.shape == (70, 100) and not np.array_equal(other, tca_tbe.decode(blob))
    for at, value in ((12, 71), (12, 64), (16, 101), (16, 1 << 31), (12, (1 << 32) - 1)):
        rejects(_field(blob, "<I", at, value))
    rejects(_field(blob, "<B", 20, 0), "padding")
    rejects(_field(blob, "<B", 21, 60), "padding")
    for at in (22, 23, 52, 63):
        rejects(_field(blob, "<B", at, 1), "reserved")
    for at, delta in ((24, 16), (24, -16), (32, 16), (32, -16), (24, 1), (32, 2)):
        rejects(_field(blob, "<Q", at, struct.unpack_from("<Q", blob, at)[0] + delta))


def test_huge_shape_is_refused_before_anything_is_allocated(blob):
    for rows, cols in ((1 << 20, 1 << 20), ((1 << 32) - 1, (1 << 32) - 1), (1 << 25, 64)):
        b = bytearray(blob)
        struct.pack_into("<IIBB", b, 12, rows, cols, -rows % 64, -cols % 64)
        rejects(reseal(b), "limit|describes")


def test_forged_offsets(blob):
    lay = tca_tbe.read_layout(blob, len(blob))
    o, _ = _stream(blob, "global_offsets")
    for pair in range(1, lay.tiles + 1):
        for which, delta in ((0, 16), (1, 8), (0, -16), (0, 1)):
            at = o + 8 * pair + 4 * which
            rejects(_field(blob, "<I", at, struct.unpack_from("<I", blob, at)[0] + delta), "global offsets|stream lengths")
    rejects(_field(blob, "<I", o, 16), "global offsets")
    o, n = _stream(blob, "median_offsets")
    for at in range(o, o + n, 4):
        rejects(_field(blob, "<I", at, struct.unpack_from("<I", blob, at)[0] + 1), "median offsets")


def _bitmap_bit(blob, plane, tile, bit):
    return _stream(blob, f"bitmap{plane}")[0] + 8 * tile + bit // 8, 1 << (bit % 8)


def test_forged_bitmaps(blob):
    """A flipped code bit is caught (by the offsets or the runs' zero padding, which a changed
    count moves, or by a padding weight's filler) or gives another well-formed blob: a code
    changed within the window, or a zero value moved between a run's end and its padding."""
    lay = tca_tbe.read_layout(blob, len(blob))
    original, caught = tca_tbe.decode(blob), 0
    for tile in range(0, lay.tiles * 64, 7):
        for plane, bit in ((2, 0), (0, 27), (1, 63)):
            at, mask = _bitmap_bit(blob, plane, tile, bit)
            b = bytearray(blob)
            b[at] ^= mask
            try:
                assert not np.array_equal(tca_tbe.decode(reseal(b)), original)
            except FormatError as e:
                assert any(k in str(e) for k in ("offsets", "padding", "filler")), e
                caught += 1
    assert caught > 0.2 * 3 * len(range(0, lay.tiles * 64, 7))


def test_forged_padding(blob):
    lay = tca_tbe.read_layout(blob, len(blob))
    glob = np.frombuffer(blob, "<u4", 2 * (lay.tiles + 1), _stream(blob, "global_offsets")[0]).reshape(-1, 2)
    o_sm, n_sm = _stream(blob, "sign_mantissa")
    o_fb, n_fb = _stream(blob, "fallback")
    sm, fb = np.frombuffer(blob, np.uint8, n_sm, o_sm), np.frombuffer(blob, "<u2", n_fb // 2, o_fb)
    assert sm[glob[1, 0] - 1] == 0 and fb[glob[1, 1] - 1] == 0  # this blob's first runs end in padding
    rejects(_field(blob, "<B", o_sm + int(glob[1, 0]) - 1, 5), "padding")
    rejects(_field(blob, "<H", o_fb + 2 * (int(glob[1, 1]) - 1), 5), "padding")
    o, n = _stream(blob, "global_offsets")
    rejects(_field(blob, "<B", o + n, 1), "alignment")
    # padding weights with code 3 instead of the filler's 1: column 104 (global tile 1, small
    # tile 2*5 = 10, element 0) and row 70 (global tile 2, small tile 0, element 8*6)
    for tile, bit in ((64 + 10, 0), (128, 48)):
        at, mask = _bitmap_bit(blob, 1, tile, bit)
        assert not blob[at] & mask
        b = bytearray(blob)
        b[at] ^= mask
        rejects(reseal(b), "filler")


@settings(max_examples=examples(200))
@given(data=st.data())
def test_any_resealed_mutation_decodes_or_raises_format_error(blob, data):
    """Random bytes anywhere, checksums made right again: the reader decodes or raises
    FormatError, never anything else (no IndexError, no MemoryError, no wrong shape)."""
    b = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(b) - 1))
        b[at] = data.draw(st.integers(0, 255))
    try:
        out = tca_tbe.decode(reseal(b))
    except FormatError:
        return
    assert out.dtype == np.uint16 and out.ndim == 2


def test_encode_refuses_what_it_cannot_hold():
    for bad in (np.zeros((4, 4), np.float16), np.zeros(16, np.uint16), np.zeros((2, 2, 2), np.uint16)):
        with pytest.raises(ValueError):
            tca_tbe.encode(bad)
    with pytest.raises(ValueError):
        tca_tbe.bits_per_weight(tca_tbe.encode(np.zeros((0, 3), np.uint16)))


def test_gpu_launcher_imports_without_cupy():
    """kvzip/weights/tca_tbe_gpu.py imports CuPy only when it decodes; its kernel source ships."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['cupy'] = None; from kvzip.weights import tca_tbe_gpu; "
            "assert tca_tbe_gpu.KERNEL in tca_tbe_gpu.source()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
