"""What the GPU tests of the modes coded from the tensor itself share (test_ratio_gpu.py,
test_storage_gpu.py): the real KV layers, a mode's CPU blob, the check that a CuPy tensor gives
that blob and that the GPU decodes both, that the stage calls none of its CPU kernels, the
2^24-value and unaligned-view cases, and a forged blob's outcome on either side."""
import numpy as np

import cupy

import kvzip
from kvzip import testing as kt
from kvzip.data import load_sample
from kvzip.trace import last_path


def layers(count=4):
    return [np.asarray(v).view(np.uint16) for v in list(load_sample("code").values())[:count]]


def cpu_blob(bits, fmt, mode, **kw) -> bytes:
    return bytes(kvzip.compress(bits, dtype=fmt, mode=mode, backend="cpu", **kw))


def assert_device_matches(bits, fmt, mode, **kw):
    """GPU blob == CPU blob; the GPU decodes both to the values."""
    blob = kvzip.compress(cupy.asarray(bits), dtype=fmt, mode=mode, **kw)
    assert type(blob) is cupy.ndarray
    want = cpu_blob(bits, fmt, mode, **kw)
    assert blob.get().tobytes() == want
    for b in (blob, cupy.asarray(np.frombuffer(want, np.uint8))):
        back = kvzip.decompress(b)
        assert type(back) is cupy.ndarray
        np.testing.assert_array_equal(cupy.asnumpy(back).reshape(-1).view(bits.dtype), bits.reshape(-1))
    return want


def assert_no_cpu_kernel_runs(monkeypatch, cpu_kernels, mode):
    """No host copy of the values: the stage's CPU kernels (the module cpu_kernels' encode,
    decode and histogram) are never called for CuPy input."""
    def refuse(*a, **k):
        raise AssertionError("the CPU kernels ran for a CuPy tensor")

    for name in ("encode", "decode", "histogram"):
        monkeypatch.setattr(cpu_kernels, name, refuse)
    bits = layers(1)[0]
    blob = kvzip.compress(cupy.asarray(bits), dtype="bf16", mode=mode)
    assert last_path() == "staged"
    np.testing.assert_array_equal(cupy.asnumpy(kvzip.decompress(blob)).view(np.uint16), bits)


def assert_real_kv_variant_matches(variant, mode):
    for i, x in enumerate(layers(3)):
        assert_device_matches(kt.kv_variant(x, variant, layer=i, seed=i), "bf16", mode)


def assert_large_real_kv_matches(mode):
    """2^24 values of the sample tiled, as is and channel-scaled with a checksum."""
    sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample().values()])
    bits = np.resize(sample, 1 << 24).reshape(-1, 64)
    assert_device_matches(bits, "bf16", mode)
    assert_device_matches(kt.kv_variant(bits, "chan-scaled"), "bf16", mode, checksum=True)


def assert_unaligned_view_matches(mode):
    bits = layers(1)[0].reshape(-1)
    rows = (bits.size - 3) // 64
    dev = cupy.asarray(bits)[3:3 + 64 * rows].reshape(-1, 64)  # 6 bytes past an aligned start
    blob = kvzip.compress(dev, dtype="bf16", mode=mode)
    assert blob.get().tobytes() == cpu_blob(bits[3:3 + 64 * rows].reshape(-1, 64), "bf16", mode)


def outcome(blob, device: bool):
    try:
        x = kvzip.decompress(cupy.asarray(np.frombuffer(blob, np.uint8)) if device else np.frombuffer(blob, np.uint8))
    except kvzip.FormatError as e:
        return "error", str(e)
    return "ok", (cupy.asnumpy(x) if device else np.asarray(x)).tobytes()


def assert_forgeries_fail_as_on_the_cpu(blobs):
    """Every (name, blob) decodes on the GPU as on the CPU, error message included; most fail."""
    tried = errors = 0
    for name, blob in blobs:
        want, got = outcome(blob, False), outcome(blob, True)
        assert got == want, name
        tried += 1
        errors += want[0] == "error"
    assert tried > 40 and errors > 30
