"""The ratio mode (ChannelPack, container version 3) on a real GPU: CuPy tensors compress on the
device (kvzip/gpu/kernels/channel.cu) to the CPU reference's bytes, for every format, edge sizes
and chunk sizes, real KV and its adversarial variants; GPU blobs and CPU blobs decode on the GPU
to the values; forged blobs raise the CPU path's FormatError; and the fast path's decoders (a
guessed layout, the header checks of a batch) hand version-3 blobs to the checked path instead
of mistaking them for a remembered layout, alone and mixed with version-2 blobs in one
decompress_many."""
import struct

import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

import kvzip
from kvzip import testing as kt
from kvzip.data import load_sample
from kvzip.formats import FORMATS
from kvzip.trace import last_path


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


# ----------------------------------------------------------------------------- the device kernels
def cpu_blob(bits, fmt, **kw) -> bytes:
    return bytes(kvzip.compress(bits, dtype=fmt, mode="ratio", backend="cpu", **kw))


def assert_device_matches(bits, fmt, **kw):
    """GPU blob == CPU blob; the GPU decodes both to the values."""
    dev = cupy.asarray(bits)
    blob = kvzip.compress(dev, dtype=fmt, mode="ratio", **kw)
    want = cpu_blob(bits, fmt, **kw)
    assert blob.get().tobytes() == want
    for b in (blob, cupy.asarray(np.frombuffer(want, np.uint8))):
        back = kvzip.decompress(b)
        assert type(back) is cupy.ndarray
        np.testing.assert_array_equal(cupy.asnumpy(back).reshape(-1).view(bits.dtype), bits.reshape(-1))
    return want


def test_the_stage_runs_the_device_kernels(monkeypatch):
    """No host copy of the values: ChannelPack's CPU kernels are never called for CuPy input."""
    from kvzip.stages import channel_pack_cpu

    def refuse(*a, **k):
        raise AssertionError("the CPU kernels ran for a CuPy tensor")

    for name in ("encode", "decode", "histogram"):
        monkeypatch.setattr(channel_pack_cpu, name, refuse)
    bits = layers(1)[0]
    blob = kvzip.compress(cupy.asarray(bits), dtype="bf16", mode="ratio")
    assert last_path() == "staged"
    np.testing.assert_array_equal(cupy.asnumpy(kvzip.decompress(blob)).view(np.uint16), bits)


SIZES = (0, 1, 7, 8, 4095, 4096, 4097, 3 * 4096 + 5, 100_003)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("n", SIZES)
def test_sizes_and_formats(fmt, n):
    f = FORMATS[fmt]
    flat = kt.kv_like_bits(f, n, escape_rate=0.01, seed=n)
    shape = (n // 64, 64) if n % 64 == 0 and n else (n,)  # 64 channels, or one (a 1-D tensor of odd length)
    assert_device_matches(flat.reshape(shape), fmt)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("chunk,last", [(8, 16), (64, 128), (512, 96), (4096, 256), (32768, 2)])
def test_chunks_and_channels(fmt, chunk, last):
    f = FORMATS[fmt]
    rng = np.random.default_rng(chunk + last)
    n = int(rng.integers(1, 40)) * last * 7
    bits = kt.kv_like_bits(f, n, escape_rate=0.02, seed=chunk).reshape(-1, last)
    assert_device_matches(bits, fmt, chunk=chunk)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_random_bits_plane_code_every_chunk(fmt):
    f = FORMATS[fmt]
    bits = kt._rng_bits(5, f, 5 * 4096 + 3).reshape(-1)
    assert_device_matches(bits, fmt)


@pytest.mark.parametrize("variant", kt.KV_VARIANTS)
def test_real_kv_variants(variant):
    for i, x in enumerate(layers(3)):
        assert_device_matches(kt.kv_variant(x, variant, layer=i, seed=i), "bf16")


def test_large_real_kv_sampled_tables():
    """2^24 values: the sampled histogram (auto_codebook's runs), many chunks, both formats."""
    sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample().values()])
    bits = np.resize(sample, 1 << 24).reshape(-1, 64)
    assert_device_matches(bits, "bf16")
    assert_device_matches(kt.kv_variant(bits, "chan-scaled"), "bf16", checksum=True)


def test_unaligned_input_views():
    bits = layers(1)[0].reshape(-1)
    rows = (bits.size - 3) // 64
    dev = cupy.asarray(bits)[3:3 + 64 * rows].reshape(-1, 64)  # 6 bytes past an aligned start
    blob = kvzip.compress(dev, dtype="bf16", mode="ratio")
    assert blob.get().tobytes() == cpu_blob(bits[3:3 + 64 * rows].reshape(-1, 64), "bf16")


# ----------------------------------------------------------------------------- forged blobs
def forged_blobs():
    """(name, blob) pairs: each count stream's fields, the variable streams' lengths and
    contents, the tables, on a blob with escapes, second-level codes and a plane-coded chunk."""
    f = FORMATS["bf16"]
    bits = kt.kv_like_bits(f, 4 * 32 * 64, escape_rate=0.02, seed=9).reshape(4, 32, 64)
    bits.reshape(-1)[1024:1536] = kt._rng_bits(10, f, 512)  # chunk 2 plane-coded at chunk 512
    base = cpu_blob(bits, "bf16", chunk=512)
    meta, flags, streams = kt.blob_parts(base)
    parts = {k: bytearray(b) for k, _, b in streams}

    def with_(name, fn):
        out = [(k, dt, bytes(fn(bytearray(b))) if k == name else b) for k, dt, b in streams]
        return kt.build_blob(meta, out, flags)

    def u16(k, v):
        def fn(b):
            struct.pack_into("<H", b, 2 * k, v % 0x10000)
            return b
        return fn

    nchunks = len(parts["esc_count"]) // 2
    for name in ("esc_count", "sec_count"):
        for k in range(nchunks):
            v = struct.unpack_from("<H", parts[name], 2 * k)[0]
            for new in (v + 1, v - 1, 0xFFFF, 400, 0):
                if new % 0x10000 != v:
                    yield f"{name}[{k}]={new}", with_(name, u16(k, new))
    for name in ("sec_codes", "esc_pos", "esc_exp", "exp_high"):
        yield f"{name} longer", with_(name, lambda b: b + bytes(2 if name == "esc_pos" else 1))
        yield f"{name} shorter", with_(name, lambda b: b[:-2 if name == "esc_pos" else -1])
    for k in (0, 1, len(parts["esc_pos"]) // 2 - 1):
        for v in (0, 511, 600, 65535):
            yield f"esc_pos[{k}]={v}", with_("esc_pos", u16(k, v))
    yield "esc_exp=255", with_("esc_exp", lambda b: b[:-1] + bytes([255]))
    yield "tables repeat", with_("tables", lambda b: b.__setitem__(1, b[0]) or b)
    yield "tables short", with_("tables", lambda b: b[:-15])
    for at in (0, 7, 100, 1000):
        yield f"codes[{at}]", with_("codes", lambda b: b.__setitem__(at, b[at] ^ 0xFF) or b)


def outcome(blob, device: bool):
    try:
        x = kvzip.decompress(cupy.asarray(np.frombuffer(blob, np.uint8)) if device else np.frombuffer(blob, np.uint8))
    except kvzip.FormatError as e:
        return "error", str(e)
    return "ok", (cupy.asnumpy(x) if device else np.asarray(x)).tobytes()


def test_forged_blobs_fail_as_on_the_cpu():
    tried = errors = 0
    for name, blob in forged_blobs():
        want, got = outcome(blob, False), outcome(blob, True)
        assert got == want, name
        tried += 1
        errors += want[0] == "error"
    assert tried > 40 and errors > 30

