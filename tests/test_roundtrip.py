"""Property tests: bit-exact round trips, fused == staged bytes, bounded size, determinism.

Every array here is drawn by the strategies in kvzip.testing (shipped for users too).  Inputs
cover all five formats, arbitrary bit patterns (NaN payloads, +-0, +-Inf, subnormals, every
exponent), 0-d to 5-D shapes with empty and odd sizes, non-contiguous NumPy and torch views,
random codebooks, every chunk size, escape-free, escape-heavy (plane-coded) and stored-raw data.
"""
from __future__ import annotations

import numpy as np
import pytest
try:
    import torch
except ImportError:  # torch is optional: only the torch tests need it
    torch = None
from conftest import examples
from hypothesis import event, given, settings
from hypothesis import strategies as st

import kvzip
from kvzip import container
from kvzip import stages as S
from kvzip import testing as kt
from kvzip.data import load_sample
from kvzip.formats import FORMATS
from kvzip.trace import last_path

FMTS = list(FORMATS.values())
FMT_IDS = [f.name for f in FMTS]

# The default pipeline's header for a 5-D tensor is about 640 bytes (measured in
# test_header_overhead_is_small); every blob must stay within raw + this.
OVERHEAD = 1024


def split_pipeline(codebook=None, chunk=4096, checksum=False, fuse=True):
    return kvzip.Pipeline([S.ExponentSplit(), S.Top16Pack(codebook), S.EscapeStream(chunk), S.Serialize(checksum)],
                          fuse=fuse)


def header_of(blob):
    b = blob.numpy().tobytes() if torch is not None and isinstance(blob, torch.Tensor) else np.asarray(blob).tobytes()
    return container.parse_header(b, len(b))


def check_size(blob, raw_nbytes):
    """The documented bound: never more than raw + a small constant.  Tighter, as the container
    makes it: the payload is never larger than the raw values padded to 16 bytes."""
    hdr = header_of(blob)
    nbytes = len(blob)
    assert nbytes <= raw_nbytes + OVERHEAD, f"blob {nbytes} B for {raw_nbytes} B raw (header {hdr.header_len} B)"
    assert hdr.payload_len <= raw_nbytes + 15, f"payload {hdr.payload_len} B > raw {raw_nbytes} B + padding"


def roundtrip_bits(bits, fmt, shape, **kw):
    """compress raw bits (dtype=fmt) and check the round trip; returns the blob."""
    x = bits.reshape(shape)
    blob = kvzip.compress(x, dtype=fmt.name, **kw)
    out = kvzip.decompress(blob)
    assert out.shape == shape and out.dtype.name == fmt.dtype_name
    np.testing.assert_array_equal(np.ascontiguousarray(out).view(fmt.uint_dtype), x)
    check_size(blob, bits.nbytes)
    return blob


@st.composite
def shaped_bits(draw, make=kt.bit_arrays, fmt=None, max_size=2048):
    fmt = fmt or draw(kt.formats())
    shape = draw(kt.shapes(max_dims=5, max_size=max_size))
    n = int(np.prod(shape, dtype=np.int64))
    bits = draw(make(fmt, min_size=n, max_size=n))
    return fmt, shape, bits


# --------------------------------------------------------------------------- round trips
@settings(max_examples=examples(200))
@given(case=shaped_bits(), chunk=kt.chunk_sizes(), checksum=st.booleans())
def test_roundtrip_arbitrary_bits(case, chunk, checksum):
    fmt, shape, bits = case
    blob = roundtrip_bits(bits, fmt, shape, chunk=chunk, checksum=checksum)
    # Deterministic: the same input gives the same bytes again.
    np.testing.assert_array_equal(blob, kvzip.compress(bits.reshape(shape), dtype=fmt.name, chunk=chunk,
                                                       checksum=checksum))


@pytest.mark.parametrize("fmt", FMTS, ids=FMT_IDS)
@settings(max_examples=examples(25))
@given(data=st.data(), chunk=kt.chunk_sizes())
def test_roundtrip_specials_as_float_arrays(fmt, data, chunk):
    """ml_dtypes / NumPy float arrays (not raw bits) full of NaN payloads, zeros, Inf, subnormals."""
    bits = data.draw(kt.special_heavy_arrays(fmt, max_size=1500))
    x = kt.as_float(bits, fmt)
    blob = kt.assert_roundtrip(x, chunk=chunk)
    check_size(blob, bits.nbytes)


@pytest.mark.parametrize("fmt", FMTS, ids=FMT_IDS)
@settings(max_examples=examples(25))
@given(data=st.data(), chunk=st.sampled_from(kt.CHUNK_SIZES[5:]))
def test_roundtrip_kv_like_default_codebook(fmt, data, chunk):
    """The regime the codec is built for: compresses (not stored raw) and round-trips.  (Chunks
    of 256+ values: with chunk 8, esc_count alone costs 2 bits a value, so 16-bit fp16 and
    8-bit e5m2 data, 15 and 7 bits a value after the split, are rightly stored raw.)"""
    n = data.draw(st.integers(1024, 4096))
    bits = data.draw(kt.kv_like_arrays(fmt, min_size=n, max_size=n))
    blob = roundtrip_bits(bits, fmt, bits.shape, chunk=chunk)
    inf = kvzip.info(blob)
    if fmt.name != "e4m3":  # e4m3: 4-bit codes + 4-bit rest = 8 bits; never smaller, so stored
        assert not inf["stored_raw"], inf
        assert inf["raw_chunks"] == 0, inf  # nearly escape-free data needs no plane coding
        assert len(blob) < bits.nbytes + 700


@pytest.mark.parametrize("fmt", FMTS, ids=FMT_IDS)
@settings(max_examples=examples(30))
@given(data=st.data(), chunk=kt.chunk_sizes())
def test_roundtrip_random_codebooks_escape_heavy(fmt, data, chunk):
    cb = data.draw(kt.codebooks(fmt))
    make = data.draw(st.sampled_from([kt.escape_heavy_arrays, kt.kv_like_arrays, kt.bit_arrays]))
    if make is kt.bit_arrays:
        bits = data.draw(make(fmt, min_size=0, max_size=3000))
    else:
        bits = data.draw(make(fmt, codebook=cb, min_size=1, max_size=3000))
    for fuse in (True, False):
        pipe = split_pipeline(cb, chunk, fuse=fuse)
        blob = pipe.encode(bits, dtype=fmt.name)
        out = kvzip.decompress(blob)
        np.testing.assert_array_equal(out.view(fmt.uint_dtype), bits)
        check_size(blob, bits.nbytes)
        # The codebook travels in the blob: a receiver needs nothing else.
        hdr = header_of(blob)
        if not kvzip.info(blob)["stored_raw"]:
            assert hdr.meta["codebook"]["exponents"] == list(cb.exponents)


def test_plane_coded_chunks_roundtrip_every_format():
    """Deterministic: a chunk of pure escapes among KV-like chunks is plane-coded, the blob is not
    stored raw, and it decodes exactly (fused and staged)."""
    rng = np.random.default_rng(7)
    for fmt in FMTS:
        if fmt.name == "e4m3":
            continue  # no exponent of e4m3 can escape
        cb = kvzip.Codebook.default_for(fmt)
        bits = kt.kv_like_bits(fmt, 4096, cb, seed=fmt.width)
        outside = np.setdiff1d(np.arange(1 << fmt.exp_bits), cb.exponents)
        e = rng.choice(outside, 256)
        bits[256:512] = (bits[256:512] & ~np.array(((1 << fmt.exp_bits) - 1) << fmt.mant_bits).astype(
            fmt.uint_dtype)) | (e.astype(np.uint64) << fmt.mant_bits).astype(fmt.uint_dtype)
        for fuse in (True, False):
            pipe = split_pipeline(cb, 256, fuse=fuse)
            blob = pipe.encode(bits, dtype=fmt.name)
            inf = kvzip.info(blob)
            assert inf["raw_chunks"] == 1 and not inf["stored_raw"], (fmt.name, inf)
            assert inf["streams"]["exp_high"] == fmt.high_exp_bits * 256 // 8
            np.testing.assert_array_equal(kvzip.decompress(blob).view(fmt.uint_dtype), bits)


# --------------------------------------------------------------------------- fused vs staged
@settings(max_examples=examples(120))
@given(data=st.data())
def test_fused_and_staged_write_identical_bytes(data):
    fmt = data.draw(kt.formats())
    cb = data.draw(st.one_of(st.none(), kt.codebooks(fmt)))
    chunk = data.draw(st.sampled_from(kt.CHUNK_SIZES))
    checksum = data.draw(st.booleans())
    gen = data.draw(st.sampled_from(["kv", "kv", "escapes", "escapes", "bits"]))
    if gen == "kv":
        bits = data.draw(kt.kv_like_arrays(fmt, cb, min_size=1, max_size=3000))
    elif gen == "escapes":
        bits = data.draw(kt.escape_heavy_arrays(fmt, cb, min_size=256, max_size=4000))
    else:
        bits = data.draw(kt.bit_arrays(fmt, max_size=3000))
    fused, staged = split_pipeline(cb, chunk, checksum, fuse=True), split_pipeline(cb, chunk, checksum, fuse=False)
    a = fused.encode(bits, dtype=fmt.name)
    fused_path = last_path()
    b = staged.encode(bits, dtype=fmt.name)
    staged_path = last_path()
    np.testing.assert_array_equal(a, b)
    inf = kvzip.info(a)
    event(f"{gen}: {'stored' if inf['stored_raw'] else 'plane-coded' if inf['raw_chunks'] else 'listed' if inf['escapes'] else 'no escapes'}")
    if inf["stored_raw"]:
        assert fused_path == staged_path == "stored"
    else:
        assert fused_path == "fused", "the fused kernel did not run"
        assert staged_path == "staged"
    # Either decoder reads either blob, and says which path it took.
    for pipe, path in ((fused, "fused"), (staged, "staged")):
        out = pipe.decode(a)
        took = last_path()
        np.testing.assert_array_equal(out.view(fmt.uint_dtype), bits)
        if not inf["stored_raw"]:
            assert took == path


def test_fused_path_really_runs_on_kv_data(monkeypatch):
    """Not only does last_path say so: the fused CPU kernels are what encode and decode (counted
    through wrappers), the per-stage encoders are not called on that path, and fuse=False runs
    the stages and never the fused kernels."""
    from kvzip.stages import fused as F

    calls = {"enc": 0, "dec": 0, "stage": 0}

    def counting(key, fn):
        def wrapper(*a, **k):
            calls[key] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(F, "_encode_cpu", counting("enc", F._encode_cpu))
    monkeypatch.setattr(F, "_decode_cpu", counting("dec", F._decode_cpu))
    monkeypatch.setattr(S.EscapeStream, "encode", counting("stage", S.EscapeStream.encode))
    monkeypatch.setattr(S.EscapeStream, "decode", counting("stage", S.EscapeStream.decode))
    bits = np.concatenate([v.view(np.uint16).ravel() for v in load_sample("code").values()])[:50000]

    pipe = split_pipeline()
    a = pipe.encode(bits, dtype="bf16")
    assert last_path() == "fused" and calls == {"enc": 1, "dec": 0, "stage": 0}
    np.testing.assert_array_equal(pipe.decode(a).view(np.uint16), bits)
    assert last_path() == "fused" and calls == {"enc": 1, "dec": 1, "stage": 0}

    staged = split_pipeline(fuse=False)
    b = staged.encode(bits, dtype="bf16")
    assert last_path() == "staged" and calls == {"enc": 1, "dec": 1, "stage": 1}
    np.testing.assert_array_equal(staged.decode(b).view(np.uint16), bits)
    assert last_path() == "staged" and calls == {"enc": 1, "dec": 1, "stage": 2}
    np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------- frameworks and views
@settings(max_examples=examples(80))
@given(data=st.data())
def test_noncontiguous_numpy_views(data):
    fmt, shape, bits = data.draw(shaped_bits(max_size=3000))
    base = kt.as_float(bits, fmt).reshape(shape)
    view, what = data.draw(kt.views(base))
    chunk = data.draw(kt.chunk_sizes())
    blob = kt.assert_roundtrip(view, chunk=chunk)
    # A view compresses to exactly the bytes of its contiguous copy.
    np.testing.assert_array_equal(blob, kvzip.compress(view.copy(order="C"), chunk=chunk), err_msg=what)
    check_size(blob, view.size * fmt.itemsize)


@pytest.mark.skipif(torch is None, reason="needs torch")
@settings(max_examples=examples(80))
@given(data=st.data())
def test_torch_tensors_and_views(data):
    fmt, shape, bits = data.draw(shaped_bits(make=data.draw(st.sampled_from([kt.bit_arrays, kt.kv_like_arrays])),
                                             max_size=3000))
    t = kt.as_torch(bits, fmt).reshape(shape)
    view, what = data.draw(kt.views(t))
    chunk = data.draw(kt.chunk_sizes())
    blob = kvzip.compress(view, chunk=chunk)
    assert isinstance(blob, torch.Tensor) and blob.dtype == torch.uint8 and blob.ndim == 1
    out = kvzip.decompress(blob)
    kt.assert_bits_equal(out, view, what)
    # Same bytes as the NumPy path on the same values.
    ref, _, _ = kt.bits_of(view)
    np.testing.assert_array_equal(blob.numpy(), kvzip.compress(ref.reshape(tuple(view.shape)), dtype=fmt.name,
                                                               chunk=chunk))


def test_zero_d_and_empty_every_format():
    for fmt in FMTS:
        for shape in [(), (0,), (3, 0, 2), (0, 0, 0, 0, 0), (1,), (1, 1, 1, 1, 1), (7,), (3, 5)]:
            n = int(np.prod(shape, dtype=np.int64))
            bits = (np.arange(n, dtype=np.uint64) * 2654435761 % (1 << fmt.width)).astype(fmt.uint_dtype)
            for chunk in (8, 4096):
                blob = roundtrip_bits(bits, fmt, shape, chunk=chunk)
                assert kvzip.info(blob)["shape"] == shape
            if torch is not None:
                t = kt.as_torch(bits, fmt).reshape(shape)
                kt.assert_bits_equal(kvzip.decompress(kvzip.compress(t)), t, f"{fmt.name} {shape}")


def test_blob_inputs_of_any_buffer_kind_decode():
    bits = kt.kv_like_bits("bf16", 999, escape_rate=0.01)
    blob = kvzip.compress(bits, dtype="bf16", checksum=True)
    raw = blob.tobytes()
    unaligned = memoryview(b"\x00" + raw)[1:]  # uint16 streams start on an odd address
    inputs = [raw, bytearray(raw), memoryview(raw), unaligned, np.frombuffer(raw, np.uint8)]
    if torch is not None:
        inputs.append(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    for b in inputs:
        out = kvzip.decompress(b)
        if torch is not None and isinstance(out, torch.Tensor):
            out = out.view(torch.int16)
        np.testing.assert_array_equal(np.asarray(out).view(np.uint16), bits, err_msg=type(b).__name__)


@settings(max_examples=examples(30))
@given(data=st.data())
def test_compress_many_matches_compress(data):
    """The batched API writes, one by one, the bytes compress() writes, and reads them back."""
    fmt = data.draw(kt.formats())
    xs = data.draw(st.lists(st.one_of(kt.kv_like_arrays(fmt, max_size=1500), kt.bit_arrays(fmt, max_size=500),
                                      kt.escape_heavy_arrays(fmt, max_size=1500)), max_size=5))
    chunk = data.draw(kt.chunk_sizes())
    checksum = data.draw(st.booleans())
    blobs = kvzip.compress_many(xs, dtype=fmt.name, chunk=chunk, checksum=checksum)
    assert len(blobs) == len(xs)
    for x, b in zip(xs, blobs):
        np.testing.assert_array_equal(b, kvzip.compress(x, dtype=fmt.name, chunk=chunk, checksum=checksum))
    for x, out in zip(xs, kvzip.decompress_many(blobs)):
        np.testing.assert_array_equal(out.view(fmt.uint_dtype), x)


# --------------------------------------------------------------------------- size bound
def test_header_overhead_is_small():
    """Measure the real overhead of the default pipeline (printed): header plus padding."""
    worst = 0
    for fmt in FMTS:
        for shape in [(), (5,), (2, 3, 4, 5, 6), (4097, 3), (1, 1, 1, 1, 999)]:
            n = int(np.prod(shape, dtype=np.int64))
            bits = kt.kv_like_bits(fmt, n).reshape(shape)
            for checksum in (False, True):
                blob = kvzip.compress(bits, dtype=fmt.name, checksum=checksum, chunk=8)
                hdr = header_of(blob)
                worst = max(worst, hdr.header_len)
                assert len(blob) - hdr.payload_len == hdr.header_len
    print(f"\nlargest default-pipeline header: {worst} bytes")
    assert worst <= OVERHEAD - 16, worst


@settings(max_examples=examples(40))
@given(data=st.data())
def test_size_bound_any_pipeline(data):
    """Whatever the pipeline (random codebooks, chunk sizes, checksum) and the data."""
    fmt = data.draw(kt.formats())
    pipe = data.draw(kt.pipelines(fmt, lossy=False))
    bits = data.draw(st.one_of(kt.bit_arrays(fmt, max_size=3000), kt.escape_heavy_arrays(fmt, max_size=3000)))
    blob = pipe.encode(bits, dtype=fmt.name)
    hdr = header_of(blob)
    assert hdr.payload_len <= bits.nbytes + 15
    assert len(blob) <= bits.nbytes + hdr.header_len + 15
    np.testing.assert_array_equal(kvzip.decompress(blob).view(fmt.uint_dtype), bits)


# --------------------------------------------------------------------------- lossy front stage
@settings(max_examples=examples(25))
@given(data=st.data())
def test_lossless_stages_behind_quantize_are_transparent(data):
    """With QuantizeFP8 in front, the lossless stages change nothing: the full pipeline decodes to
    exactly what [QuantizeFP8, Serialize] decodes to, and fused == staged bytes."""
    Q = kt.quantize_fp8_available()
    if Q is None:
        pytest.skip("QuantizeFP8 has not landed")
    fmt = data.draw(st.sampled_from([FORMATS["bf16"], FORMATS["fp16"], FORMATS["fp32"]]))
    shape = data.draw(kt.shapes(max_dims=3, max_size=2000))
    n = int(np.prod(shape, dtype=np.int64))
    bits = data.draw(st.one_of(kt.kv_like_arrays(fmt, min_size=n, max_size=n), kt.bit_arrays(fmt, n, n)))
    q = Q(data.draw(st.sampled_from(["e5m2", "e4m3"])), data.draw(st.sampled_from(["tensor", "channel"])))
    chunk = data.draw(kt.chunk_sizes())
    x = bits.reshape(shape)
    ref = kvzip.Pipeline([q, S.Serialize()]).encode(x, dtype=fmt.name)
    blobs = []
    for fuse in (True, False):
        pipe = kvzip.Pipeline([q, S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(chunk), S.Serialize()], fuse=fuse)
        assert not pipe.lossless
        blobs.append(pipe.encode(x, dtype=fmt.name))
    np.testing.assert_array_equal(blobs[0], blobs[1])
    want = kvzip.decompress(ref)
    got = kvzip.decompress(blobs[0])
    assert got.shape == shape and got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(fmt.uint_dtype), want.view(fmt.uint_dtype))
