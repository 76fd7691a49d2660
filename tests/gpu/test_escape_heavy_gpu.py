"""Escape-heavy data on the fast path: blobs the CPU reference's byte for byte, decoded to the
input for every format, with escapes spread, clustered (chunks of 100 and more), in partial last
chunks, next to plane-coded chunks and in batches; broken escapes in such chunks raise."""
import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

import kvzip
from kvzip import container
from kvzip import testing as kt
from kvzip.backends import get_backend
from kvzip.data import load_sample


def real_bf16(n, roll=0):
    sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample().values()])
    return np.roll(np.resize(sample, n), roll)


def escape_heavy_bf16(n):
    bits = kt.kv_variant(real_bf16(n).reshape(-1, 64), "chan-scaled").reshape(-1)
    bits[-(n // 8)::3] = 201 << 7  # plane-coded chunks at the end
    return bits


@pytest.mark.parametrize("n", [4096 * 300, 4096 * 300 + 77])
def test_bf16_round_trips(n):
    bits = escape_heavy_bf16(n - n % 64)
    bits = np.concatenate([bits, real_bf16(n % 64)]) if n % 64 else bits
    blob = kvzip.compress(cupy.asarray(bits), dtype="bf16")
    assert blob.get().tobytes() == bytes(kvzip.compress(bits, dtype="bf16", backend="cpu"))
    np.testing.assert_array_equal(cupy.asnumpy(kvzip.decompress(blob)).view(np.uint16).reshape(-1), bits)


@pytest.mark.parametrize("fmt", ["fp16", "e5m2", "e4m3", "fp32"])
def test_other_formats_round_trip(fmt):
    bits = kt.kv_like_bits(fmt, 4096 * 64 + 5, escape_rate=0.02, seed=7)
    blob = kvzip.compress(cupy.asarray(bits), dtype=fmt)
    back = cupy.asnumpy(kvzip.decompress(blob)).reshape(-1).view(bits.dtype)
    np.testing.assert_array_equal(back, bits)


def test_batches_round_trip():
    parts = [escape_heavy_bf16(4096 * 40), real_bf16(4096 * 40 + 64, 5), escape_heavy_bf16(4096 * 8)]
    blobs = kvzip.compress_many([cupy.asarray(p) for p in parts], dtype="bf16")
    for got, want in zip(kvzip.decompress_many(blobs), parts):
        np.testing.assert_array_equal(cupy.asnumpy(got).view(np.uint16).reshape(-1), want)


def test_broken_escapes_raise():
    bits = escape_heavy_bf16(4096 * 300)
    host = kvzip.compress(cupy.asarray(bits), dtype="bf16").get()
    hdr = container.parse_header(container.read_head(get_backend("cpu"), host), host.shape[0])
    start = {name: hdr.header_len + off for name, _, off, _ in hdr.streams}
    counts = np.frombuffer(host[start["esc_count"]:start["esc_pos"]], np.uint16).astype(np.int64)
    heavy = int(np.nonzero((counts >= 40) & (counts != 0xFFFF))[0][len(counts) // 4 % 7])
    first = int(np.where(counts == 0xFFFF, 0, counts)[:heavy].sum())
    for at, value in ((first + 20, None), (first + 21, 5000)):  # a repeated position; one past the chunk
        bad = host.copy()
        pos = bad[start["esc_pos"]:start["esc_exp"]].view(np.uint16)
        pos[at] = pos[at - 1] if value is None else value
        with pytest.raises(kvzip.FormatError):
            kvzip.decompress(cupy.asarray(bad))


def test_escape_heavy_blobs_decode_with_the_escape_heavy_instance(monkeypatch):
    """A blob with many escapes (programs.heavy) decodes with kvz_decode's escape-heavy instance,
    one with few with the common one: on the general path, on a guessed layout and repeated
    (decode_again keeps to blobs of its own instance's lengths), alternating, and in a batch;
    every value back."""
    from kvzip.gpu import graphs, layout_cache, programs

    ran = []
    for name in ("run", "run_one"):
        def spy(self, *args, _real=getattr(programs._DecodeProgram, name), **kwargs):
            ran.append(self.heavy)
            return _real(self, *args, **kwargs)
        monkeypatch.setattr(programs._DecodeProgram, name, spy)
    graphs.release()
    layout_cache.forget()
    n = 4096 * 64
    light, heavy = real_bf16(n), escape_heavy_bf16(n)
    blobs = {False: kvzip.compress(cupy.asarray(light), dtype="bf16"),
             True: kvzip.compress(cupy.asarray(heavy), dtype="bf16")}
    bits = {False: light, True: heavy}
    for want in (False, False, False, True, True, True, False, True, False, True):
        ran.clear()
        out = kvzip.decompress(blobs[want])
        np.testing.assert_array_equal(cupy.asnumpy(out).view(np.uint16).reshape(-1), bits[want])
        assert ran and ran[-1] is want, (want, ran)
    for got, want in zip(kvzip.decompress_many([blobs[False], blobs[True], blobs[False]]), (light, heavy, light)):
        np.testing.assert_array_equal(cupy.asnumpy(got).view(np.uint16).reshape(-1), want)
    graphs.release()
