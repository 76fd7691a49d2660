"""The shortcuts for a call like the thread's last one (kvzip/gpu/executor.py: _EncodeRepeat;
kvzip/gpu/layout_cache.py: decode_again): taken only where the full path would decide the same,
refused for anything else, and giving the full path's bytes and values either way."""
import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

import kvzip
from kvzip.gpu import executor as gpu_executor
from kvzip.data import load_sample
from kvzip.gpu import graphs, programs, layout_cache

rng = np.random.default_rng(99)
SHAPE = (3, 4096 * 5)


def real_bf16(n, rate=0.0):
    """n values of the shipped real KV, permuted, a fraction rate of them made escapes."""
    sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample("prose").values()])
    bits = rng.permutation(np.resize(sample, n))
    hit = rng.random(n) < rate
    bits[hit] = (bits[hit] & 0x807F) | (rng.integers(200, 250, int(hit.sum())) << 7).astype(np.uint16)
    return bits


@pytest.fixture
def taken(monkeypatch):
    """Per call, whether its shortcut gave the result (None: it was not asked: nothing kept)."""
    got = []
    real_encode, real_last, real_decode = gpu_executor.encode_again, layout_cache.last_decode, layout_cache.decode_again

    def encode_again(pipe, x, dtype):
        blob = real_encode(pipe, x, dtype)
        got.append(blob is not None if graphs.recall("encode") is not None else None)
        return blob

    def last_decode():  # nothing to repeat (or the kernels off): decode_again is not asked
        call = real_last()
        if call is None:
            got.append(None if graphs.recall("decode") is None else False)
        return call

    def decode_again(call, found):
        out = real_decode(call, found)
        got.append(out is not None)
        return out

    monkeypatch.setattr(gpu_executor, "encode_again", encode_again)
    monkeypatch.setattr(layout_cache, "last_decode", last_decode)
    monkeypatch.setattr(layout_cache, "decode_again", decode_again)
    graphs.release()
    layout_cache.forget()
    yield got
    graphs.release()


def test_compress_repeats_only_a_call_like_the_last(taken, monkeypatch):
    bits = [real_bf16(int(np.prod(SHAPE)), rate) for rate in (0.0, 0.01, 0.05)]
    x = [cupy.asarray(b).reshape(SHAPE) for b in bits]
    wide = cupy.empty(x[0].size + 8, np.uint16)
    wide[1:1 + x[0].size] = x[0].ravel()
    calls = [  # (input, dtype, host bits, the shortcut taken)
        (x[0], "bf16", bits[0], None),   # the first: the general path, which makes the shape's lane
        (x[1], "bf16", bits[1], None),   # through the lane: that call kept
        (x[2], "bf16", bits[2], True),   # other values and escapes, the same shape: repeated
        (x[2].reshape(-1), "bf16", bits[2], False),  # another shape (its first: the general path)
        (x[0], "bf16", bits[0], True),   # the lane kept is still the first shape's
        (x[1], "fp16", bits[1], False),  # the same array read as another format
        (x[1][:, ::-1], "bf16", bits[1].reshape(SHAPE)[:, ::-1].ravel(), False),  # not contiguous
        (wide[1:1 + x[0].size].reshape(SHAPE), "bf16", bits[0], False),  # not 16-byte aligned
        (x[1], "bf16", bits[1], True),
    ]
    for i, (arr, dtype, host, want) in enumerate(calls):
        blob = kvzip.compress(arr, dtype=dtype)
        assert taken[-1] is want, i
        want_blob = kvzip.compress(host.reshape(arr.shape), dtype=dtype)  # the CPU's
        np.testing.assert_array_equal(blob.get(), want_blob, err_msg=str(i))
    kvzip.compress(x[2], dtype="bf16", checksum=True)  # another pipeline
    assert taken[-1] is False
    graphs.release()  # the kept call goes with the programs
    kvzip.compress(x[2], dtype="bf16")
    assert taken[-1] is None
    monkeypatch.setattr(programs, "ENABLED", False)  # the kernels switched off: the Numba path
    np.testing.assert_array_equal(kvzip.compress(x[0], dtype="bf16").get(),
                                  kvzip.compress(bits[0].reshape(SHAPE), dtype="bf16"))
    assert taken[-1] is False


def test_decompress_repeats_only_a_call_like_the_last(taken):
    n = int(np.prod(SHAPE))
    bits = [real_bf16(n, rate) for rate in (0.0, 0.002, 0.01, 0.03)]
    blobs = [kvzip.compress(cupy.asarray(b).reshape(SHAPE), dtype="bf16") for b in bits]
    assert len({b.size for b in blobs}) == 4  # other escape counts: other lengths, one layout
    other = kvzip.compress(cupy.asarray(real_bf16(n // 3)), dtype="bf16")
    taken.clear()

    def check(blob, want, host):
        out = kvzip.decompress(blob)
        assert taken[-1] is want
        assert out.shape == SHAPE or host.size != n
        np.testing.assert_array_equal(out.reshape(-1).view(cupy.uint16).get(), host)

    check(blobs[0], None, bits[0])   # the general path; the layout remembered
    check(blobs[1], None, bits[1])   # decoded on the guessed layout, and that call kept
    for i in (2, 3, 0, 1):           # every escape count since: repeated
        check(blobs[i], True, bits[i])
    wide = cupy.empty(blobs[2].size + 16, np.uint8)
    wide[1:1 + blobs[2].size] = blobs[2]
    check(wide[1:1 + blobs[2].size], False, bits[2])  # not 16-byte aligned
    out = kvzip.decompress(other)    # another layout: not like it
    assert taken[-1] is False and out.size == n // 3
    check(blobs[3], False, bits[3])  # a new layout was remembered since: the guess table changed
    check(blobs[2], True, bits[2])
    forged = blobs[2].copy()
    forged[44] ^= 1                  # the header's CRC: the GPU's check of the guess misses
    with pytest.raises(kvzip.FormatError):
        kvzip.decompress(forged)
    assert taken[-1] is False
    check(blobs[1], True, bits[1])   # still kept
    layout_cache.forget()           # nothing remembered: the general path
    check(blobs[0], False, bits[0])
    graphs.release()
    check(blobs[0], None, bits[0])


def test_a_dequantizing_decode_repeats_until_its_kernels_are_switched_off(taken, monkeypatch):
    """Blobs of a QuantizeFP8 (per tensor) pipeline decode straight to the caller's dtype; the
    repeat keeps doing so with each blob's own scale, and stops once quantize_kernels is off (the
    full path then dequantizes through the stage, to the same values)."""
    from kvzip import stages as S
    from kvzip.gpu import quantize_kernels

    pipe = kvzip.Pipeline([S.QuantizeFP8("e5m2"), S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(), S.Serialize()])
    n = int(np.prod(SHAPE))
    import ml_dtypes

    host = [real_bf16(n) for _ in range(3)]  # other values each
    top = max(float(np.abs(h.view(ml_dtypes.bfloat16).astype(np.float32)).max()) for h in host)
    host[2][:7] = np.array([4 * top], np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)  # another scale
    xs = [cupy.asarray(h).reshape(SHAPE) for h in host]
    blobs = [pipe.encode(x, dtype="bf16") for x in xs]
    want = [pipe.decode(b.get()) for b in blobs]  # the CPU's values
    # info() decodes as decompress validates: on the host copy, so that no GPU decode runs before
    # the ones counted below
    assert blobs[2].size != blobs[0].size and not kvzip.info(blobs[2].get())["stored_raw"]
    taken.clear()
    got = [pipe.decode(b) for b in blobs + blobs[:1]]
    assert taken[1:] == [None, True, True]  # the first: the general path; the second kept
    for g, w in zip(got, want + want[:1]):
        np.testing.assert_array_equal(g.reshape(-1).view(cupy.uint16).get(), w.reshape(-1).view(np.uint16))
    monkeypatch.setattr(quantize_kernels, "ENABLED", False)
    again = pipe.decode(blobs[1])
    assert taken[-1] is False
    np.testing.assert_array_equal(again.reshape(-1).view(cupy.uint16).get(), want[1].reshape(-1).view(np.uint16))


def test_decompress_repeats_a_layout_that_shares_its_band_while_it_is_the_last_decoded(taken):
    """Blobs of one shape with the auto and with a fixed codebook: two layouts of about the same
    length (one guess band, where guess() goes by recency).  A run of one layout's blobs is
    repeated once its call is kept; a blob of the other is never decoded as the kept one's, and
    every value comes back."""
    n = int(np.prod(SHAPE))
    bits = [real_bf16(n, rate) for rate in (0.0, 0.002, 0.01)]
    auto = [kvzip.compress(cupy.asarray(b).reshape(SHAPE), dtype="bf16") for b in bits]
    fixed = [kvzip.compress(cupy.asarray(b).reshape(SHAPE), None, dtype="bf16") for b in bits]  # the shipped codebook
    taken.clear()

    def check(blob, host):
        out = kvzip.decompress(blob)
        np.testing.assert_array_equal(out.reshape(-1).view(cupy.uint16).get(), host)
        return taken[-1]

    check(auto[0], bits[0])
    check(auto[1], bits[1])
    check(fixed[0], bits[0])
    check(fixed[1], bits[1])
    assert any(len(band) > 1 for band in layout_cache._guess_table()[1])  # the two layouts share one
    for blobs in (auto, fixed, auto):
        got = [check(blobs[i], bits[i]) for i in (0, 1, 2, 0, 1)]
        assert got[2:] == [True] * 3, got  # the run's third call on: repeated
