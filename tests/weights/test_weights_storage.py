"""The weights storage level (kvzip/weights/storage.py): every dtype, shape and bit pattern comes
back byte for byte, a blob is never much larger than the tensor, the code is an optimal
length-limited one, and a damaged or forged blob raises FormatError instead of decoding."""
from __future__ import annotations

import heapq
import struct
import zlib
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from conftest import examples
from kvzip import FormatError
from kvzip.weights import storage as S

WEIGHTS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "weights" / "minilm-l6_weights_bf16.safetensors"
SLICE = Path(__file__).resolve().parent / "data" / "minilm-slice-bf16.safetensors"
FLOATS = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32}
# The exponent patterns a float tensor can hold: NaN with payloads, infinities, zeros of both
# signs, subnormals.
SPECIALS = {"BF16": [0x7FC1, 0xFF81, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001, 0x807F],
            "F16": [0x7E01, 0xFC01, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001, 0x83FF],
            "F32": [0x7FC00001, 0xFF800001, 0x7F800000, 0xFF800000, 0, 0x80000000, 1, 0x807FFFFF]}


def tensor_bytes(dtype: str, n: int, kind: str, seed: int) -> np.ndarray:
    """n values of dtype as bytes: uniform random bits, weight-like values, weight-like values with
    specials mixed in, or values of one exponent."""
    rng = np.random.default_rng(seed)
    size = S.ITEMSIZE[dtype]
    if kind == "random" or dtype not in FLOATS:
        return rng.integers(0, 256, n * size, dtype=np.uint8)
    if kind == "one exponent":
        x = rng.uniform(1, 2, n) * rng.choice([-1.0, 1.0], n)
    else:
        x = rng.standard_t(5, n) * 10.0 ** rng.uniform(-3, 0)
    bits = np.ascontiguousarray(x.astype(FLOATS[dtype])).view(f"<u{size}")
    if kind == "specials":
        at = rng.integers(0, max(n, 1), n // 7 + 1) % max(n, 1)
        bits[at[:n]] = rng.choice(np.array(SPECIALS[dtype], dtype=bits.dtype), at[:n].shape)
    return bits.view(np.uint8)


shapes = st.one_of(st.lists(st.integers(0, 9), max_size=4).map(tuple),
                   st.integers(S.CHUNK - 2, 3 * S.CHUNK + 3).map(lambda n: (n,)),
                   st.tuples(st.integers(1, 300), st.integers(1, 301)))


@settings(max_examples=examples(120))
@given(dtype=st.sampled_from(S.DTYPES), shape=shapes, kind=st.sampled_from(["random", "weights", "specials",
                                                                          "one exponent"]),
       seed=st.integers(0, 2**32 - 1))
def test_round_trip_is_byte_exact_and_bounded(dtype, shape, kind, seed):
    data = tensor_bytes(dtype, int(np.prod(shape, dtype=np.int64)), kind, seed)
    blob = S.compress(dtype, shape, data)
    got_dtype, got_shape, back = S.decompress(blob)
    assert (got_dtype, got_shape) == (dtype, shape)
    assert back.dtype == np.uint8 and np.array_equal(back, data)
    raw_blob = data.nbytes + 24 + 8 * len(shape)
    assert blob.nbytes <= raw_blob  # the raw blob at most
    h = S.read_header(blob)
    if h.coding == S.EXPONENT_CODE:
        assert blob.nbytes < raw_blob
    elif dtype in S.CODED and kind != "random":
        assert data.nbytes < 20000  # weight-like values of this size always pay


@pytest.mark.parametrize("dtype", sorted(S.CODED))
@pytest.mark.parametrize("n", [1, S.CHUNK - 1, S.CHUNK, S.CHUNK + 1, 2 * S.CHUNK + 77])
def test_coded_chunk_boundaries(dtype, n):
    data = tensor_bytes(dtype, n, "weights", n)
    blob = S.compress(dtype, (n,), data)
    assert np.array_equal(S.decompress(blob)[2], data)
    h = S.read_header(blob)
    if h.coding == S.EXPONENT_CODE:
        assert h.chunk_ends.shape == (-(-n // S.CHUNK),)


def test_one_exponent_costs_one_bit():
    data = tensor_bytes("BF16", 4 * S.CHUNK, "one exponent", 1)
    h = S.read_header(S.compress("BF16", (4 * S.CHUNK,), data))
    assert h.coding == S.EXPONENT_CODE and sorted(h.lengths[h.lengths > 0]) == [1, 1]
    assert h.stream_len == 4 * S.CHUNK // 8


def test_inputs_that_are_not_a_tensor_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        S.plan("F8_E8M0", (1,), np.zeros(1, np.uint8))
    with pytest.raises(ValueError, match="do not hold"):
        S.plan("BF16", (3,), np.zeros(5, np.uint8))
    with pytest.raises(TypeError, match="uint8"):
        S.plan("BF16", (3,), np.zeros(3, np.uint16))
    with pytest.raises(ValueError, match="shape"):
        S.plan("U8", (-1,), np.zeros(0, np.uint8))


def test_data_changed_after_plan_is_caught():
    data = tensor_bytes("BF16", 3 * S.CHUNK, "weights", 2)
    p = S.plan("BF16", (3 * S.CHUNK,), data)
    data[::2] = 0x7F  # far more code bits than planned
    with pytest.raises(RuntimeError, match="changed"):
        S.encode(p, data)


# ---- the code ---------------------------------------------------------------------------------

def huffman_cost(counts) -> int:
    """Total bits of an unlimited Huffman code (the textbook merge)."""
    heap = [int(c) for c in counts if c]
    heapq.heapify(heap)
    total = 0
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        total += a + b
        heapq.heappush(heap, a + b)
    return total


@settings(max_examples=examples(100))
@given(st.lists(st.integers(0, 10**6), min_size=256, max_size=256), st.integers(8, 16))
def test_code_lengths_are_complete_limited_and_optimal(counts, limit):
    counts = np.array(counts, np.int64)
    lengths = S.code_lengths(counts, limit).astype(np.int64)
    present = counts > 0
    if present.sum() == 0:
        assert not lengths.any()
        return
    assert lengths.max() <= limit and (lengths[present] > 0).all()
    used = lengths > 0
    assert sum(2.0 ** -lengths[used]) == 1.0
    cost = int((counts * lengths).sum())
    best = huffman_cost(counts) if present.sum() > 1 else int(counts.sum())  # a lone symbol: 1 bit
    assert cost >= best
    if S.code_lengths(counts, 64).max() <= limit:  # the limit does not bind: Huffman's cost
        assert cost == best


def test_limit_binds_on_skewed_counts():
    fib = [1, 1]
    while len(fib) < 30:
        fib.append(fib[-1] + fib[-2])
    counts = np.zeros(256, np.int64)
    counts[:30] = fib
    assert S.code_lengths(counts, 64).max() > S.MAX_CODE_LENGTH
    lengths = S.code_lengths(counts).astype(np.int64)
    assert lengths.max() == S.MAX_CODE_LENGTH and sum(2.0 ** -lengths[:30]) == 1.0


def test_canonical_codes_are_prefix_free_and_the_table_full():
    counts = np.bincount(np.random.default_rng(3).zipf(1.6, 5000) % 256, minlength=256)
    lengths = S.code_lengths(counts)
    codes = S.canonical_codes(lengths)
    words = [format(int(codes[s]), f"0{lengths[s]}b")[::-1] for s in range(256) if lengths[s]]  # first bit first
    assert not any(a != b and b.startswith(a) for a in words for b in words)
    table = S.decode_table(lengths)
    assert (table >> 8).min() >= 1  # no empty entry


# ---- hostile blobs ------------------------------------------------------------------------------

def coded_blob(n=3000, dtype="BF16"):
    data = tensor_bytes(dtype, n, "weights", 5)
    blob = S.compress(dtype, (n,), data)
    assert S.read_header(blob).coding == S.EXPONENT_CODE
    return blob, data


def resealed(blob: np.ndarray) -> np.ndarray:
    """blob with its header CRC recomputed as a reader finds the header: a forgery that passes
    the CRC."""
    ndim, coding = int(blob[11]), int(blob[10])
    n = 1
    for d in blob[24:24 + 8 * ndim].view("<u8"):
        n *= int(d)
    h_len = 24 + 8 * ndim + (256 + 8 * -(-n // S.CHUNK) if coding == S.EXPONENT_CODE else 0)
    if h_len > blob.nbytes:
        return blob  # refused before the CRC
    head = bytearray(blob[:h_len])
    head[12:16] = bytes(4)
    out = blob.copy()
    out[12:16] = np.frombuffer(struct.pack("<I", zlib.crc32(head)), np.uint8)
    return out


@pytest.mark.parametrize("dtype", ["BF16", "F32", "I16"])
def test_every_truncation_and_extension_is_refused(dtype):
    blob = S.compress(dtype, (700,), tensor_bytes(dtype, 700, "weights", 0))
    for cut in range(blob.nbytes):
        with pytest.raises(FormatError):
            S.decompress(blob[:cut])
    with pytest.raises(FormatError):
        S.decompress(np.concatenate([blob, np.zeros(8, np.uint8)]))


@pytest.mark.parametrize("dtype, n", [("BF16", 700), ("F16", 1500), ("F32", 700)])  # the least that is coded
def test_every_single_bit_flip_is_caught(dtype, n):
    blob, _ = coded_blob(n, dtype)
    for bit in range(blob.nbytes * 8):
        bad = blob.copy()
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FormatError):
            S.decompress(bad)


def test_flips_in_a_raw_blob_are_caught():
    data = tensor_bytes("I64", 40, "random", 1)
    blob = S.compress("I64", (5, 8), data)
    for bit in range(0, blob.nbytes * 8, 3):
        bad = blob.copy()
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FormatError):
            S.decompress(bad)


def test_forged_fields_are_refused_even_with_a_valid_crc():
    blob, data = coded_blob(3 * S.CHUNK + 10)
    h = S.read_header(blob)
    lengths_at, ends_at = 32, 32 + 256
    shortest = int(np.argmin(np.where(h.lengths > 0, h.lengths, 99)))

    def forged(edit):
        bad = blob.copy()
        edit(bad)
        return resealed(bad)

    cases = {
        "shape": lambda b: b.__setitem__(slice(24, 32), np.frombuffer(struct.pack("<Q", 3 * S.CHUNK + 11), np.uint8)),
        "huge shape": lambda b: b.__setitem__(slice(24, 32), np.frombuffer(struct.pack("<Q", 2**63), np.uint8)),
        "ndim": lambda b: b.__setitem__(11, 2),
        "dtype": lambda b: b.__setitem__(9, S.DTYPES.index("F16")),
        "uncoded dtype": lambda b: b.__setitem__(9, S.DTYPES.index("I16")),
        "coding": lambda b: b.__setitem__(10, 7),
        "raw coding": lambda b: b.__setitem__(10, S.RAW),
        "version": lambda b: b.__setitem__(8, 2),
        "checksum": lambda b: b.__setitem__(16, b[16] ^ 1),
        "long code": lambda b: b.__setitem__(lengths_at + int(np.argmax(h.lengths)), 13),
        "incomplete code": lambda b: b.__setitem__(lengths_at + shortest, h.lengths[shortest] + 1),
        "extra symbol": lambda b: b.__setitem__(lengths_at + int(np.argmin(h.lengths)), 1),
        "end past the stream": lambda b: b.__setitem__(slice(ends_at + 24, ends_at + 32),
                                                       np.frombuffer(struct.pack("<Q", 2**64 - 1), np.uint8)),
        "short chunk": lambda b: b.__setitem__(slice(ends_at, ends_at + 8),
                                               np.frombuffer(struct.pack("<Q", int(h.chunk_ends[0]) - 1), np.uint8)),
        "swapped chunk ends": lambda b: b.__setitem__(slice(ends_at, ends_at + 16), np.concatenate(
            [b[ends_at + 8:ends_at + 16], b[ends_at:ends_at + 8]])),
        "falling chunk ends": lambda b: b.__setitem__(slice(ends_at + 8, ends_at + 16), b[ends_at:ends_at + 8]),
    }
    for what, edit in cases.items():
        with pytest.raises(FormatError):
            S.decompress(forged(edit))
        assert np.array_equal(S.decompress(blob)[2], data), what


def test_not_a_blob():
    for junk in (np.zeros(0, np.uint8), np.zeros(100, np.uint8), np.frombuffer(b"KVZIP\x00\r\n" + bytes(56), np.uint8)):
        with pytest.raises(FormatError):
            S.decompress(junk)
    with pytest.raises(TypeError):
        S.decompress(np.zeros(4, np.uint16))


# ---- real weights -------------------------------------------------------------------------------

def _bf16_tensors(path: Path) -> dict:
    from safetensors.numpy import load_file

    return {k: v for k, v in load_file(str(path)).items()}


def test_real_weight_slice_shipped_with_the_tests():
    raw = stored = 0
    for name, x in _bf16_tensors(SLICE).items():
        data = x.view(np.uint8).reshape(-1)
        blob = S.compress("BF16", x.shape, data)
        assert np.array_equal(S.decompress(blob)[2], data), name
        raw, stored = raw + data.nbytes, stored + blob.nbytes
    assert raw / stored >= 1.47


@pytest.mark.skipif(not WEIGHTS.is_file(), reason="the MiniLM weights of shared/data are not here")
def test_real_minilm_weights_reach_the_ratio():
    raw = stored = 0
    ratios = []
    for name, x in _bf16_tensors(WEIGHTS).items():
        data = x.view(np.uint8).reshape(-1)
        blob = S.compress("BF16", x.shape, data)
        assert np.array_equal(S.decompress(blob)[2], data), name
        raw, stored = raw + data.nbytes, stored + blob.nbytes
        ratios.append(data.nbytes / blob.nbytes)
    assert len(ratios) == 38
    assert raw / stored >= 1.47 and min(ratios) >= 1.46


def test_the_worked_example_of_the_format_doc():
    """docs/weights-format.md 1.10, byte for byte (a coded blob of a tensor a writer would store raw)."""
    values = np.array([0x3F80, 0xBF80, 0x3F00, 0x4000, 0x3FC0, 0xBF40], "<u2").view(np.uint8)
    counts = np.bincount([127, 127, 126, 128, 127, 126], minlength=256)
    p = S.Plan("BF16", (2, 3), S.EXPONENT_CODE, S.code_lengths(counts), np.array([2], np.uint64), 318)
    lengths = bytearray(256)
    lengths[126:129] = b"\x02\x01\x02"
    want = bytes.fromhex("4b565a5754000d0a 01080102 df1d09f0 79595ed5cac5eb98"
                         "0200000000000000 0300000000000000") + bytes(lengths) + \
        bytes.fromhex("0200000000000000 b400000000000000 00 80 00 00 40 c0")
    blob = S.encode(p, values)
    assert blob.tobytes() == want
    assert S.decompress(blob)[2].tobytes() == values.tobytes()
    assert S.read_header(S.compress("BF16", (2, 3), values)).coding == S.RAW


@pytest.mark.parametrize("dtype", sorted(S.CODED))
def test_tensors_and_blobs_at_odd_addresses(dtype):
    """A tensor or a blob inside a .safetensors file may start at any byte."""
    def at_odd_address(a):
        out = np.zeros(a.nbytes + 1, np.uint8)[1:]
        out[:] = a
        assert out.ctypes.data % 2
        return out

    data = tensor_bytes(dtype, 5000, "weights", 9)
    blob = S.compress(dtype, (5000,), at_odd_address(data))
    assert S.read_header(blob).coding == S.EXPONENT_CODE
    assert np.array_equal(S.decompress(at_odd_address(blob))[2], data)


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 1001])
def test_checksum_is_sum64_of_the_zero_padded_bytes(nbytes):
    from kvzip.checksum import sum64

    data = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    padded = np.zeros(-(-nbytes // 8) * 8, np.uint8)
    padded[:nbytes] = data
    assert S.read_header(S.compress("U8", (nbytes,), data)).checksum == sum64(np, padded)
