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

import channel_modes
from channel_modes import layers

import kvzip
from kvzip import testing as kt
from kvzip.formats import FORMATS


MODE = "ratio"


@pytest.mark.parametrize("fmt", ["bf16", "e5m2"])
def test_cupy_tensors_give_the_cpu_blob(fmt):
    bits = layers(1)[0] if fmt == "bf16" else kt.kv_like_bits(fmt, 3 * 512 * 64, seed=3).reshape(3, 512, 64)
    blob = kvzip.compress(cupy.asarray(bits), dtype=fmt, mode="ratio")
    assert type(blob) is cupy.ndarray
    assert blob.get().tobytes() == bytes(kvzip.compress(bits, dtype=fmt, mode="ratio", backend="cpu"))
    back = kvzip.decompress(blob)
    np.testing.assert_array_equal(cupy.asnumpy(back).reshape(-1).view(bits.dtype), bits.reshape(-1))


def test_streams_for_serialize_where_the_header_is_version_1():
    """QuantizeFP8 in front: the blob takes a version-1 header, so ChannelPack hands its streams
    (views of its payload buffer) to Serialize instead of writing the blob itself; the bytes are
    the CPU's all the same."""
    import torch

    pipe = kvzip.Pipeline([kvzip.stages.QuantizeFP8("e5m2"), kvzip.stages.ChannelPack(1024), kvzip.stages.Serialize()])
    x = torch.from_numpy(layers(1)[0].astype(np.int16)).view(torch.bfloat16)
    blob = pipe.encode(x.cuda())
    assert bytes(blob.cpu().numpy()) == bytes(pipe.encode(x).numpy())
    assert torch.equal(kvzip.decompress(blob).cpu(), kvzip.decompress(pipe.encode(x)))


@pytest.mark.parametrize("mode", ["ratio", "storage"])
def test_torch_callers_memory_comes_from_torch(mode):
    """Stage by stage on a torch caller's tensors, CuPy allocates from torch's caching allocator:
    the blobs and the decoded tensors are torch's memory, not blocks of CuPy's pool (a
    receiver decoding GiBs of KV into torch's cache ran out of memory while CuPy's pool held
    what torch had freed)."""
    import torch

    host = layers()
    xs = [torch.from_numpy(x.astype(np.int16)).view(torch.bfloat16).cuda() for x in host]
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()
    held = pool.total_bytes()
    blobs = kvzip.compress_many(xs, mode=mode)
    one = kvzip.compress(xs[0], mode=mode)
    backs = kvzip.decompress_many(blobs) + [kvzip.decompress(one)]
    torch.cuda.synchronize()
    assert pool.total_bytes() - held < min(x.numel() for x in xs)  # none of them is CuPy's
    for back, x in zip(backs, xs + xs[:1]):
        assert torch.equal(back, x)
    for blob, x in zip(blobs, xs):
        assert bytes(blob.cpu().numpy()) == bytes(kvzip.compress(x.cpu(), mode=mode).numpy())


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
    return channel_modes.cpu_blob(bits, fmt, MODE, **kw)


def assert_device_matches(bits, fmt, **kw):
    return channel_modes.assert_device_matches(bits, fmt, MODE, **kw)


def test_the_stage_runs_the_device_kernels(monkeypatch):
    from kvzip.stages import channel_pack_cpu

    channel_modes.assert_no_cpu_kernel_runs(monkeypatch, channel_pack_cpu, MODE)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("chunk,last", [(8, 16), (64, 128), (512, 96), (4096, 256), (32768, 2)])
def test_chunks_and_channels(fmt, chunk, last):
    f = FORMATS[fmt]
    rng = np.random.default_rng(chunk + last)
    n = int(rng.integers(1, 40)) * last * 7
    bits = kt.kv_like_bits(f, n, escape_rate=0.02, seed=chunk).reshape(-1, last)
    assert_device_matches(bits, fmt, chunk=chunk)


def test_more_scan_tiles_than_the_gpu_runs_at_once():
    """Chunks of 8 over 2^23 values: 2^20 chunks, 512 tiles of kvz_ch_scan, more blocks than an
    H100 or H200 holds at once (3 an SM), so tiles look back at tiles that are still running or
    not yet started; the offsets, and so the bytes, are still the CPU's, and decode checks them."""
    bits = kt.kv_like_bits(FORMATS["bf16"], 1 << 23, escape_rate=0.02, seed=11).reshape(-1, 64)
    assert_device_matches(bits, "bf16", chunk=8)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_random_bits_plane_code_every_chunk(fmt):
    f = FORMATS[fmt]
    bits = kt._rng_bits(5, f, 5 * 4096 + 3).reshape(-1)
    assert_device_matches(bits, fmt)


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


def test_forged_blobs_fail_as_on_the_cpu():
    channel_modes.assert_forgeries_fail_as_on_the_cpu(forged_blobs())


def test_forged_fp8_tables_fail_on_the_device_as_on_the_cpu():
    """The scan checks the tables on the device: an E5M2 table entry past 2**5, a repeat, and
    both (the CPU reports the entry out of range first), alone and in a batch."""
    bits = kt.kv_like_bits(FORMATS["e5m2"], 3 * 512 * 64, escape_rate=0.01, seed=4).reshape(3, 512, 64)
    meta, flags, streams = kt.blob_parts(cpu_blob(bits, "e5m2"))

    def with_tables(*edits):
        out = []
        for k, dt, b in streams:
            if k == "tables":
                b = bytearray(b)
                for at, v in edits:
                    b[at] = b[v] if v < 0 else v  # v < 0: copy entry -v (a repeat)
            out.append((k, dt, bytes(b)))
        return kt.build_blob(meta, out, flags)

    good = cupy.asarray(np.frombuffer(cpu_blob(bits, "e5m2"), np.uint8))
    for edits in [((20, 32),), ((31, -30),), ((31, -30), (900, 255))]:
        blob = with_tables(*edits)
        want = channel_modes.outcome(blob, False)
        assert want[0] == "error" and "channel table" in want[1], (edits, want)
        assert channel_modes.outcome(blob, True) == want, edits
        with pytest.raises(kvzip.FormatError) as e:
            kvzip.decompress_many([good, cupy.asarray(np.frombuffer(blob, np.uint8)), good])
        assert str(e.value) == want[1], edits


# ----------------------------------------------------------------------------- batches
def batch_inputs():
    """A compress_many batch of every kind the batch path meets: real layers, another format,
    a last axis of one channel, an empty tensor, random bits (stored raw), tiny tensors."""
    f = FORMATS["e5m2"]
    return [(x, "bf16") for x in layers(3)] + [
        (kt.kv_like_bits(f, 3 * 512 * 64, escape_rate=0.01, seed=4).reshape(3, 512, 64), "e5m2"),
        (layers(1)[0].reshape(-1, 96)[:40], "bf16"),
        (np.zeros((0, 64), np.uint16), "bf16"),
        (kt._rng_bits(2, FORMATS["bf16"], 3 * 4096).reshape(-1, 64), "bf16"),
        (layers(1)[0].reshape(-1)[:5], "bf16")]


@pytest.mark.parametrize("checksum", [False, True])
def test_compress_many_gives_each_tensors_cpu_blob(checksum):
    """compress_many of the ratio mode queues every tensor's kernels before one wait: each blob
    is the CPU's byte for byte, and decompress_many (the tables checked on the device, one wait)
    returns every tensor."""
    import torch

    for dt in ("bf16", "e5m2"):
        items = [(bits, fmt) for bits, fmt in batch_inputs() if fmt == dt]
        torch_dtype = {"bf16": torch.bfloat16, "e5m2": torch.float8_e5m2}[dt]
        xs = [torch.from_numpy(b.astype(np.int16) if dt == "bf16" else b).view(torch_dtype).cuda() for b, _ in items]
        blobs = kvzip.compress_many(xs, mode="ratio", checksum=checksum)
        for blob, (bits, fmt) in zip(blobs, items):
            assert bytes(blob.cpu().numpy()) == cpu_blob(bits, fmt, checksum=checksum)
        for back, x in zip(kvzip.decompress_many(blobs), xs):
            assert back.shape == x.shape and back.dtype == x.dtype
            assert not x.numel() or torch.equal(back.view(torch.uint8), x.view(torch.uint8))


def test_decompress_many_batch_of_cpu_blobs_and_modes():
    """Ratio blobs made on the CPU, beside speed and storage blobs, in one decompress_many of
    CuPy blobs: every tensor back, in order."""
    items = batch_inputs()
    blobs = [cupy.asarray(np.frombuffer(cpu_blob(b, fmt), np.uint8)) for b, fmt in items]
    blobs.insert(2, kvzip.compress(cupy.asarray(layers(1)[0]), dtype="bf16"))
    blobs.insert(5, kvzip.compress(cupy.asarray(layers(1)[0]), dtype="bf16", mode="storage"))
    want = [b for b, _ in items]
    want.insert(2, layers(1)[0])
    want.insert(5, layers(1)[0])
    for got, bits in zip(kvzip.decompress_many(blobs), want):
        np.testing.assert_array_equal(cupy.asnumpy(got).reshape(-1).view(bits.dtype), bits.reshape(-1))


def test_a_forged_blob_in_a_batch_fails_as_alone():
    """Forged tables or counts in a batch of good blobs: decompress_many raises the error that
    blob raises alone (the first forged one by position, whichever check finds it)."""
    good = [cupy.asarray(np.frombuffer(cpu_blob(x, "bf16"), np.uint8)) for x in layers(3)]
    forged = dict(forged_blobs())
    count = next(k for k in forged if k.startswith("esc_count[1]="))
    second = next(k for k in forged if k.startswith("sec_count[0]="))
    for first, second in [("tables repeat", count), (count, "tables repeat"), (second, count),
                          ("codes[7]", "tables repeat")]:
        a, b = (cupy.asarray(np.frombuffer(forged[k], np.uint8)) for k in (first, second))
        want = channel_modes.outcome(forged[first], True)
        if want[0] == "ok":
            continue
        with pytest.raises(kvzip.FormatError) as e:
            kvzip.decompress_many([good[0], a, good[1], b, good[2]])
        assert str(e.value) == want[1], (first, second)


# ----------------------------------------------------------------------------- calibrated tables
def test_calibrated_tables_give_the_cpu_blob():
    """A ChannelCodebook's tables, copied up instead of the histogram and ranking kernels: the
    blob is the CPU's byte for byte (alone, in a compress_many batch beside tensors coded with
    their own tables' pipeline, and as streams for Serialize), and decodes on the GPU."""
    host = layers(3)
    cb = kvzip.calibrate_channels(host[:1], format="bf16")
    blobs = kvzip.compress_many([cupy.asarray(x) for x in host], codebook=cb, dtype="bf16", mode="ratio")
    for blob, x in zip(blobs, host):
        assert blob.get().tobytes() == bytes(kvzip.compress(x, codebook=cb, dtype="bf16", mode="ratio"))
        np.testing.assert_array_equal(cupy.asnumpy(kvzip.decompress(blob)).view(np.uint16), x)
    one = kvzip.compress(cupy.asarray(host[1]), codebook=cb, dtype="bf16", mode="ratio")
    assert one.get().tobytes() == blobs[1].get().tobytes()
    pipe = kvzip.Pipeline([kvzip.stages.ChannelPack(1024, cb), kvzip.stages.Serialize(checksum=True)])
    assert pipe.encode(cupy.asarray(host[2]), dtype="bf16").get().tobytes() == bytes(
        pipe.encode(host[2], dtype="bf16", backend="cpu"))


def test_a_torch_batch_is_one_batch(monkeypatch):
    """compress_many and decompress_many queue all of a caller's tensors as one batch, one wait
    (the batch is keyed by the caller's Origin)."""
    import torch

    from kvzip.gpu import channel_pack as gpu

    calls = {"encode": [], "decode": []}
    encode_blobs, decode_many = gpu.encode_blobs, gpu.decode_many
    monkeypatch.setattr(gpu, "encode_blobs", lambda jobs: calls["encode"].append(len(jobs)) or encode_blobs(jobs))
    monkeypatch.setattr(gpu, "decode_many", lambda jobs: calls["decode"].append(len(jobs)) or decode_many(jobs))
    xs = [torch.from_numpy(x.astype(np.int16)).view(torch.bfloat16).cuda() for x in layers(3)]
    backs = kvzip.decompress_many(kvzip.compress_many(xs, mode="ratio"))
    assert calls == {"encode": [3], "decode": [3]}
    assert all(torch.equal(b, x) for b, x in zip(backs, xs))
