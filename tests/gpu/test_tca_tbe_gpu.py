"""kvz_tca_tbe_decode (kvzip/gpu/kernels/tca_tbe.cu, through kvzip/weights/tca_tbe_gpu.py) gives
the CPU reference's matrix bit for bit, on synthetic and real weights, host or device blobs, and
refuses exactly the blobs the CPU reference refuses."""
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

from kvzip.errors import FormatError
from kvzip.weights import samples, tca_tbe, tca_tbe_gpu

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "weights"))
from forgery import mutations, reseal  # noqa: E402

MINILM = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "weights" / "minilm-l6_weights_bf16.safetensors"
SHAPES = [(1, 1), (3, 5), (64, 64), (65, 130), (70, 100), (64, 7), (200, 24), (127, 129), (0, 9), (384, 1536),
          (1000, 1000), (30522, 384)]


def gpu(blob) -> np.ndarray:
    return cupy.asnumpy(tca_tbe_gpu.decode(blob))


def verdict(decode, blob):
    try:
        return decode(blob)
    except FormatError:
        return None


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", samples.KINDS)
def test_matches_the_cpu_reference(shape, kind):
    w = samples.synthetic(kind, shape, np.random.default_rng([*shape, samples.KINDS.index(kind)]))
    blob = tca_tbe.encode(w)
    out = tca_tbe_gpu.decode(blob)
    assert out.dtype == cupy.uint16 and out.shape == w.shape
    assert np.array_equal(cupy.asnumpy(out), tca_tbe.decode(blob)) and np.array_equal(cupy.asnumpy(out), w)


def test_device_blobs_aligned_or_not():
    w = samples.synthetic("student_t", (300, 200), np.random.default_rng(1))
    blob = tca_tbe.encode(w)
    assert np.array_equal(gpu(cupy.asarray(np.frombuffer(blob, np.uint8))), w)
    shifted = cupy.zeros(len(blob) + 8, cupy.uint8)
    shifted[8:] = cupy.asarray(np.frombuffer(blob, np.uint8))
    assert np.array_equal(gpu(shifted[8:]), w)  # copied to an aligned buffer first
    with pytest.raises(TypeError):
        tca_tbe_gpu.decode(cupy.zeros(len(blob) // 2, cupy.uint16))


@pytest.mark.skipif(not MINILM.exists(), reason=f"{MINILM} absent")
def test_minilm_weights():
    for name, w in samples.read_bf16_matrices(MINILM).items():
        blob = tca_tbe.encode(w)
        assert np.array_equal(gpu(blob), w), name


@pytest.fixture(scope="module")
def blob():
    return tca_tbe.encode(samples.synthetic("specials", (70, 100), np.random.default_rng(7)))


def test_truncated_and_flipped_blobs_are_refused(blob):
    rng = np.random.default_rng(3)
    for n in (0, 63, 64, 79, len(blob) - 16, len(blob) - 1):
        with pytest.raises(FormatError):
            tca_tbe_gpu.decode(blob[:n])
    for bit in rng.integers(0, 8 * len(blob), 100).tolist():
        b = bytearray(blob)
        b[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(FormatError):
            tca_tbe_gpu.decode(bytes(b))


def test_forged_blobs_get_the_cpu_verdict(blob):
    """Resealed random edits (offsets, bitmaps, runs, padding): the GPU decodes what the CPU
    decodes, to the same matrix, and refuses what it refuses."""
    lay = tca_tbe.read_layout(blob, len(blob))
    refused = 0
    for forged in mutations(blob, lay.streams, 600, np.random.default_rng(4)):
        cpu, dev = verdict(tca_tbe.decode, forged), verdict(gpu, forged)
        assert (cpu is None) == (dev is None)
        if cpu is None:
            refused += 1
        else:
            assert np.array_equal(cpu, dev)
    assert refused > 100


def test_each_kernel_check(blob):
    lay = tca_tbe.read_layout(blob, len(blob))
    s = lay.streams

    def forged(at, value, fmt="<I"):
        b = bytearray(blob)
        np.frombuffer(b, fmt, 1, at)[...] = value
        return reseal(b)

    def u32(at):
        return int(np.frombuffer(blob, "<u4", 1, at)[0])

    glob, med, sm, fb = s["global_offsets"][0], s["median_offsets"][0], s["sign_mantissa"][0], s["fallback"][0]
    cases = {"global offsets": [forged(glob + 8, u32(glob + 8) + 16), forged(glob + 8 * lay.tiles, u32(glob + 8 * lay.tiles) - 16),
                                forged(glob, 16)],
             "median offsets": [forged(med + 8, u32(med + 8) + 1), forged(med + 4, 1)],
             "padding or alignment": [forged(sm + u32(glob + 8) - 1, 7, "<u1"), forged(fb + 2 * u32(glob + 12) - 2, 7, "<u2"),
                                      forged(glob + 8 * (lay.tiles + 1), 1, "<u1")]}
    at = s["bitmap1"][0] + 8 * (64 + 10)  # small tile 10 of global tile 1: columns 104..111, all padding
    cases["filler"] = [forged(at, 1, "<u1")]
    for message, blobs in cases.items():
        for b in blobs:
            with pytest.raises(FormatError, match=message):
                tca_tbe_gpu.decode(b)
            with pytest.raises(FormatError):
                tca_tbe.decode(b)


def test_decode_speed(capsys):
    """Not a gate: prints the kernel's throughput (BF16 bytes out per second) on a large matrix."""
    w = samples.synthetic("student_t", (8192, 8192), np.random.default_rng(5))
    blob = tca_tbe.encode(w)
    dev = cupy.asarray(np.frombuffer(blob, np.uint8))
    assert np.array_equal(cupy.asnumpy(tca_tbe_gpu.decode(dev)), w)
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        tca_tbe_gpu.decode(dev)
    cupy.cuda.Device().synchronize()
    per_call = (time.perf_counter() - t0) / 20
    with capsys.disabled():
        print(f"\nTCA-TBE GPU decode, 8192 x 8192, whole call (checksum, launch, error read-back): "
              f"{w.nbytes / per_call / 1e9:.0f} GB/s, {tca_tbe.bits_per_weight(blob):.3f} bits/weight")
