"""codebook="auto" on the GPU: kvz_auto_codebook chooses each tensor's codebook on the device by
kvzip/auto_codebook.py's rule, and the blobs are the CPU reference's byte for byte (one tensor,
a batch of different tensors in one launch, every format, the sampled sizes, tails, a checksum),
on the fast path and on the Numba kernels."""
import struct
import zlib

import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

import kvzip
from kvzip import testing as kt
from kvzip.auto_codebook import auto_codebook
from kvzip.data import load_sample
from kvzip.formats import FORMATS
from kvzip.gpu import programs
from kvzip.trace import last_path


def real_bf16(n, roll=0):
    sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample().values()])
    return np.roll(np.resize(sample, n), roll)


def cpu_blob(bits, fmt, **kw):
    return bytes(kvzip.compress(bits, dtype=fmt, codebook="auto", backend="cpu", **kw))


def of_format(fmt, n, seed=0):
    """Bits of fmt from real BF16 KV: per-channel scaled (more exponents in play) when n is a
    multiple of 64, converted to fmt (FP8 scaled into its range first)."""
    bits = real_bf16(n, seed)
    if n % 64 == 0 and n:
        bits = kt.kv_variant(bits.reshape(-1, 64), "chan-scaled").reshape(-1)
    if fmt == "bf16":
        return bits
    import ml_dtypes

    x = (bits.astype(np.uint32) << 16).view(np.float32)
    if FORMATS[fmt].itemsize == 1 and n:
        x = x / (np.abs(x).max() / (448.0 if fmt == "e4m3" else 57344.0))
    dtype = {"fp16": np.float16, "fp32": np.float32, "e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[fmt]
    return np.ascontiguousarray(x.astype(dtype)).view(FORMATS[fmt].uint_dtype)


@pytest.fixture(params=["fast", "numba"])
def gpu_path(request, monkeypatch):
    monkeypatch.setattr(programs, "ENABLED", request.param == "fast")
    return request.param


SIZES = [0, 1, 255, 3 * 4096 + 5, (1 << 20) + 64 * 17, (1 << 24) + 64 * 1000]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_one_tensor_is_the_cpu_reference(fmt, n, gpu_path):
    if gpu_path == "numba" and n > 1 << 20:
        pytest.skip("the Numba kernels' sampled sizes: the smaller ones suffice")
    bits = of_format(fmt, n, n % 7)
    want = cpu_blob(bits, fmt)
    x = cupy.asarray(bits)
    kvzip.compress(x, dtype=fmt)
    path = last_path()
    got = kvzip.compress(x, dtype=fmt, codebook="auto")
    assert bytes(got.get()) == want
    assert last_path() == path  # the path a fixed codebook takes
    info = kvzip.info(want)
    assert info["codebook"] == (None if info["stored_raw"] else "auto")  # chosen for the tensor: no name
    if not info["stored_raw"]:
        assert list(want[48:64]) == list(auto_codebook(bits, fmt).exponents)
    back = kvzip.decompress(got)
    np.testing.assert_array_equal(back.get().reshape(-1).view(FORMATS[fmt].uint_dtype), bits)


@pytest.mark.parametrize("fmt", ["bf16", "e5m2", "fp16"])
def test_a_batch_of_different_tensors_in_one_launch(fmt, gpu_path):
    """Tensors scaled differently get codebooks of their own in one program run; each blob is the
    CPU's; the same batch again (the program's second call) too."""
    f = FORMATS[fmt]
    base = of_format(fmt, 64 * 4096)
    xs = []
    for i in range(6):
        x = base.copy()
        if fmt == "bf16":
            x = kt.scale_pow2(x, i - 3)
        xs.append(np.roll(x, 977 * i)[: 64 * (1000 + 512 * i)])
    want = [cpu_blob(x, fmt) for x in xs]
    for _ in range(2):
        got = kvzip.compress_many([cupy.asarray(x) for x in xs], dtype=fmt, codebook="auto")
        assert [bytes(b.get()) for b in got] == want
    books = {bytes(w[48:64]) for w in want if w[8] == 2}
    if fmt == "bf16":
        assert len(books) > 1  # the batch really had several codebooks
    for _ in range(2):  # the second time on remembered layouts: each blob's own codebook in its job row
        for b, x in zip(kvzip.decompress_many(got), xs):
            np.testing.assert_array_equal(b.get().reshape(-1).view(f.uint_dtype), x)
    if gpu_path == "fast":
        assert last_path() == "fast"
    for b, x in zip(got, xs):  # one at a time: guesses that miss on another codebook, then the match
        np.testing.assert_array_equal(kvzip.decompress(b).get().reshape(-1).view(f.uint_dtype), x)


def test_checksum_and_repeat_calls():
    x = real_bf16(1 << 21, 5)
    for rep in range(3):
        y = kt.scale_pow2(x, rep - 1)
        for checksum in (False, True):
            got = kvzip.compress(cupy.asarray(y), dtype="bf16", codebook="auto", checksum=checksum)
            assert bytes(got.get()) == cpu_blob(y, "bf16", checksum=checksum)


def test_auto_beats_the_shipped_codebook_where_it_should():
    """A layer scaled by 2^3 falls off the shipped codebook (stored raw); auto keeps the ratio."""
    x = kt.scale_pow2(real_bf16(1 << 20, 3), 3)
    fixed = kvzip.compress(cupy.asarray(x), None, dtype="bf16")
    auto = kvzip.compress(cupy.asarray(x), dtype="bf16")  # the default
    assert x.nbytes / auto.shape[0] > 1.32 and fixed.shape[0] > auto.shape[0] * 1.15


def _resealed(blob: bytes, change) -> np.ndarray:
    """An auto blob with change applied to its compact header and the header CRC made right."""
    b = bytearray(blob)
    change(b)
    b[40:44] = bytes(4)
    struct.pack_into("<I", b, 40, zlib.crc32(bytes(b[:64])))
    return np.frombuffer(bytes(b), np.uint8)


@pytest.mark.parametrize("fmt", ["bf16", "e5m2"])
def test_auto_blobs_decode_into_with_the_codebook_each_header_carries(fmt):
    """decompress_into(codebook="auto") decodes each blob by its own header's codebook, on the
    GPU's guess (status 0 for tensors of different codebooks, one after another on one
    program); a header whose codebook repeats an exponent, or names one the format does not
    have, its CRC made right, gives 255 there and FormatError through decompress."""
    f = FORMATS[fmt]
    base = of_format(fmt, 64 * 4096)
    xs = [kt.scale_pow2(base, i - 2) if fmt == "bf16" else np.roll(base, 4099 * i) for i in range(4)]
    out, status = cupy.zeros(base.shape, f.uint_dtype), cupy.zeros(1, np.int64)
    blobs = [kvzip.compress(cupy.asarray(x), dtype=fmt, codebook="auto") for x in xs]
    if fmt == "bf16":
        assert len({bytes(b[48:64].get()) for b in blobs}) > 1
    for _ in range(2):
        for b, x in zip(blobs, xs):
            status[...] = -1
            kvzip.decompress_into(b, out, status, dtype=fmt, codebook="auto")
            assert int(status.get()[0]) == 0
            np.testing.assert_array_equal(out.get(), x)
    first = bytes(blobs[0].get())
    forged = [_resealed(first, lambda b: b.__setitem__(49, b[48]))]  # code 1 = code 0's exponent
    if fmt == "e5m2":
        forged.append(_resealed(first, lambda b: b.__setitem__(50, 40)))  # no 5-bit exponent
    # codes 0-7 all exponent 0, what the guessed row holds until the header's codebook is put
    # there: kvz_decode's first chunks wait for the guess's verdict instead
    forged.append(_resealed(first, lambda b: b.__setitem__(slice(48, 56), bytes(8))))
    for bad in forged:
        status[...] = -1
        kvzip.decompress_into(cupy.asarray(bad), out, status, dtype=fmt, codebook="auto")
        assert int(status.get()[0]) == programs.GUESS_MISSED
        with pytest.raises(kvzip.FormatError, match="codebook"):
            kvzip.decompress(cupy.asarray(bad))
        with pytest.raises(kvzip.FormatError, match="codebook"):
            kvzip.decompress_into(cupy.asarray(bad), out, dtype=fmt, codebook="auto")

