"""The ratio mode (ChannelPack, container version 3) on a real GPU, before it has CUDA kernels of
its own: CuPy tensors compress through the host and back to the CPU reference's bytes, and the
fast path's decoders (a guessed layout, the header checks of a batch) hand version-3 blobs to
the checked path instead of mistaking them for a remembered layout, alone and mixed with
version-2 blobs in one decompress_many."""
import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

import kvzip
from kvzip import testing as kt
from kvzip.data import load_sample


def layers(count=4):
    return [np.asarray(v).view(np.uint16) for v in list(load_sample("code").values())[:count]]


@pytest.mark.parametrize("fmt", ["bf16", "e5m2"])
def test_cupy_tensors_give_the_cpu_blob(fmt):
    bits = layers(1)[0] if fmt == "bf16" else kt.kv_like_bits(fmt, 3 * 512 * 64, seed=3).reshape(3, 512, 64)
    blob = kvzip.compress(cupy.asarray(bits), dtype=fmt, mode="ratio")
    assert type(blob) is cupy.ndarray
    assert blob.get().tobytes() == bytes(kvzip.compress(bits, dtype=fmt, mode="ratio", backend="cpu"))
    back = kvzip.decompress(blob)
    np.testing.assert_array_equal(cupy.asnumpy(back).reshape(-1).view(bits.dtype), bits.reshape(-1))


def test_version_3_blobs_beside_remembered_layouts():
    host = layers()
    speed = kvzip.compress_many([cupy.asarray(x) for x in host], dtype="bf16")
    for _ in range(2):  # the speed blobs' layouts remembered and guessed
        kvzip.decompress_many(speed)
    ratio = kvzip.compress_many([cupy.asarray(x) for x in host], dtype="bf16", mode="ratio")
    for blob, x in zip(ratio, host):  # one at a time, after the speed layouts
        np.testing.assert_array_equal(cupy.asnumpy(kvzip.decompress(blob)).view(np.uint16), x)
    mixed = [b for pair in zip(speed, ratio) for b in pair]
    for got, x in zip(kvzip.decompress_many(mixed), [x for x in host for _ in range(2)]):
        np.testing.assert_array_equal(cupy.asnumpy(got).view(np.uint16), x)
    packed = kvzip.pack(mixed)
    assert len(kvzip.decompress_many(packed)) == len(mixed)
