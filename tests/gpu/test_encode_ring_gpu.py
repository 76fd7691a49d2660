"""kvz_encode's ring of bulk copies (FP8 formats, encode_ring in fused_fast.cu): the blobs are the
CPU backend's and the ring-less encoder's, byte for byte, whatever mix of whole chunks (copied to
shared memory) and last chunks (read from global memory) a call holds."""
import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

import kvzip
from kvzip import stages as S
from kvzip.formats import FORMATS
from kvzip.stages import call_graphs, fused_fast

rng = np.random.default_rng(2026)


def fp8_bits(fmt, n, escape_rate=1e-3):
    """FP8 bits of KV-like values (exponents around one value) with escapes sprinkled at a rate."""
    f = FORMATS[fmt]
    e = np.clip(np.rint(rng.normal(24 if fmt == "e5m2" else 10, 1.5, n)), 0, 2**f.exp_bits - 1).astype(np.uint32)
    wild = rng.random(n) < escape_rate
    e[wild] = rng.integers(0, 2**f.exp_bits, int(wild.sum()))
    sign_mant = rng.integers(0, 2 ** (f.mant_bits + 1), n).astype(np.uint32)
    sign, mant = sign_mant >> f.mant_bits, sign_mant & ((1 << f.mant_bits) - 1)
    return ((sign << (f.width - 1)) | (e << f.mant_bits) | mant).astype(f.uint_dtype)


def pipeline(chunk):
    return kvzip.Pipeline([S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(chunk), S.Serialize(False)])


@pytest.fixture
def ring(monkeypatch):
    """Encode with the ring (RING_SLOTS as shipped) and without (0); cached programs dropped so
    each setting builds its own."""
    def encode(pipe, xs, dtype, slots):
        monkeypatch.setattr(fused_fast, "RING_SLOTS", slots)
        call_graphs.release()
        out = pipe.encode_many(xs, dtype=dtype) if isinstance(xs, list) else [pipe.encode(xs, dtype=dtype)]
        call_graphs.release()
        return [b.get() for b in out]
    return encode


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
@pytest.mark.parametrize("chunk", [2048, 4096, 8192])
@pytest.mark.parametrize("n", [2048, 4096 * 7 + 8, 1 << 20, (1 << 20) + 3000])
def test_ring_matches_cpu_and_the_ringless_encoder(ring, fmt, chunk, n):
    bits = fp8_bits(fmt, n)
    pipe = pipeline(chunk)
    cpu = kvzip.compress(bits, dtype=fmt, chunk=chunk)
    with_ring = ring(pipe, cupy.asarray(bits), fmt, fused_fast.RING_SLOTS)[0]
    without = ring(pipe, cupy.asarray(bits), fmt, 0)[0]
    np.testing.assert_array_equal(with_ring, cpu)
    np.testing.assert_array_equal(without, cpu)


@pytest.mark.parametrize("slots", [2, 3, 4])
def test_every_ring_size_and_escape_density(ring, slots):
    """Rings of 2-4 slots, on escape densities from none to plane-coded chunks."""
    pipe = pipeline(4096)
    for rate in (0.0, 1e-3, 0.02, 0.5):
        bits = fp8_bits("e5m2", 3 << 20, rate)
        np.testing.assert_array_equal(ring(pipe, cupy.asarray(bits), "e5m2", slots)[0],
                                      kvzip.compress(bits, dtype="e5m2"))


def test_batches_of_whole_and_ragged_tensors(ring):
    """A batch whose tensors end mid-chunk and on chunk ends: the ring holds chunks of several
    tensors at once and reads each last chunk from global memory."""
    sizes = [4096 * 3, 5000, 1 << 18, 0, 4096 * 64 + 1, 77, 1 << 20]
    xs = [fp8_bits("e5m2", n) for n in sizes]
    pipe = pipeline(4096)
    got = ring(pipe, [cupy.asarray(x) for x in xs], "e5m2", fused_fast.RING_SLOTS)
    for g, x in zip(got, xs):
        np.testing.assert_array_equal(g, kvzip.compress(x, dtype="e5m2"))


def test_the_default_e5m2_pipeline_uses_the_ring():
    """On this GPU the shipped setting gives the E5M2 encoder its ring (the bench's path)."""
    dev = cupy.cuda.Device().id
    assert fused_fast.ring_bytes(FORMATS["e5m2"], 4096, dev) == fused_fast.WARPS * fused_fast.RING_SLOTS * 4096
    assert fused_fast.ring_bytes(FORMATS["bf16"], 4096, dev) == 0
    assert fused_fast.ring_bytes(FORMATS["e5m2"], 4096, dev, quantize="tensor") == 0
    assert fused_fast.ring_bytes(FORMATS["e5m2"], 1024, dev) == 0  # chunks of less than a whole step
    call_graphs.release()
    kvzip.compress(cupy.asarray(fp8_bits("e5m2", 1 << 20)), dtype="e5m2")
    ops = call_graphs.entries()[-1].shape.ops
    shared = [op[5] for op in ops if op[0] == "dependent" and "kvz_encode" in str(op[1].name)]
    assert shared == [fused_fast.WARPS * fused_fast.RING_SLOTS * 4096]
