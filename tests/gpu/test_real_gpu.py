"""Real-GPU checks, run on the device machine (skipped where there is no CUDA GPU):
the GPU backend writes the same bytes as the CPU backend, decodes either's blobs, keeps the
caller's framework and stream, and rejects corrupted blobs."""
import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError
except Exception:  # no driver / no device
    pytest.skip("no CUDA GPU", allow_module_level=True)

import kvzip  # noqa: E402
from kvzip import stages as S  # noqa: E402
from kvzip.data import load_sample  # noqa: E402
from kvzip.formats import FORMATS  # noqa: E402

rng = np.random.default_rng(1234)


def random_bits(fmt, n):
    return rng.integers(0, 2**fmt.width, n, dtype=np.uint64).astype(fmt.uint_dtype)


def real_bf16(n):
    sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample("prose").values()])
    return np.resize(sample, n)


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
@pytest.mark.parametrize("n", [0, 1, 13, 4096, 100_003, 1 << 20])
@pytest.mark.parametrize("chunk", [8, 4096, 65536])
def test_gpu_bytes_equal_cpu_random(fmt, n, chunk):
    bits = random_bits(fmt, n)
    cpu = kvzip.compress(bits, dtype=fmt.name, chunk=chunk, checksum=True)
    gpu = kvzip.compress(cupy.asarray(bits), dtype=fmt.name, chunk=chunk, checksum=True)
    assert isinstance(gpu, cupy.ndarray)
    np.testing.assert_array_equal(cpu, gpu.get())
    back = kvzip.decompress(gpu)
    np.testing.assert_array_equal(cupy.asnumpy(back).view(fmt.uint_dtype).ravel(), bits)
    np.testing.assert_array_equal(np.asarray(kvzip.decompress(gpu.get())).view(fmt.uint_dtype).ravel(), bits)


@pytest.mark.parametrize("n", [1 << 16, (1 << 22) + 5])
def test_gpu_real_kv_bf16(n):
    bits = real_bf16(n)
    cpu = kvzip.compress(bits, dtype="bf16")
    gpu = kvzip.compress(cupy.asarray(bits), dtype="bf16")
    np.testing.assert_array_equal(cpu, gpu.get())
    assert kvzip.info(cpu)["ratio"] > 1.3
    np.testing.assert_array_equal(kvzip.decompress(gpu).get(), bits)


def test_escape_heavy_chunks_plane_coded_on_gpu():
    bits = real_bf16(1 << 18)
    bits[: 1 << 14] = random_bits(FORMATS["bf16"], 1 << 14)  # first chunks full of escapes
    cpu = kvzip.compress(bits, dtype="bf16")
    gpu = kvzip.compress(cupy.asarray(bits), dtype="bf16")
    np.testing.assert_array_equal(cpu, gpu.get())
    assert kvzip.info(cpu)["raw_chunks"] > 0
    np.testing.assert_array_equal(kvzip.decompress(gpu).get(), bits)


def test_torch_cuda_round_trip_on_callers_stream():
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 2048, 64, device="cuda", dtype=torch.bfloat16) * 0.1
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        blob = kvzip.compress(x)
        back = kvzip.decompress(blob)
    s.synchronize()
    assert blob.is_cuda and blob.dtype == torch.uint8
    assert back.is_cuda and back.dtype == torch.bfloat16 and back.shape == x.shape
    assert torch.equal(back.view(torch.int16), x.view(torch.int16))
    cpu_blob = kvzip.compress(x.cpu())
    assert torch.equal(cpu_blob, blob.cpu())


def test_corrupted_blob_raises_on_gpu():
    bits = real_bf16(1 << 16)
    blob = kvzip.compress(cupy.asarray(bits), dtype="bf16", checksum=True)
    bad = blob.copy()
    bad[-100] ^= 1
    with pytest.raises(kvzip.FormatError):
        kvzip.decompress(bad)
    with pytest.raises(kvzip.FormatError):
        kvzip.decompress(blob[:-16])


def test_forged_escape_position_raises_on_gpu():
    bits = real_bf16(1 << 16)
    blob = kvzip.compress(bits, dtype="bf16")
    streams = kvzip.info(blob)["streams"]
    assert streams["esc_pos"] > 0
    # rebuild with a position past the chunk end through the staged encoder's streams
    from kvzip import container
    from kvzip.backends import get_backend

    be = get_backend("cpu")
    hdr = container.parse_header(container.read_head(be, blob), blob.shape[0])
    views = container.stream_views(be, blob.copy(), hdr)
    views["esc_pos"][0] = 60000
    names = [s[0] for s in hdr.streams]
    described = [(k, views[k].dtype.name, views[k].nbytes) for k in names]
    offsets, plen = container.layout([d[2] for d in described])
    forged = container.assemble(be, container.build_header(hdr.meta, described, 0), [views[k] for k in names], plen, offsets)
    with pytest.raises(kvzip.FormatError):
        kvzip.decompress(cupy.asarray(forged))
    with pytest.raises(kvzip.FormatError):
        kvzip.decompress(forged)


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3"])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_quantize_pipeline_gpu_equals_cpu(fmt, granularity):
    bits = real_bf16(3 * 4096 * 64)
    pipe = kvzip.Pipeline([S.QuantizeFP8(fmt, granularity), S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(),
                           S.Serialize(checksum=True)])
    cpu = pipe.encode(bits.reshape(3, 4096, 64), dtype="bf16")
    gpu = pipe.encode(cupy.asarray(bits).reshape(3, 4096, 64), dtype="bf16")
    np.testing.assert_array_equal(cpu, gpu.get())
    np.testing.assert_array_equal(np.asarray(pipe.decode(cpu)).view(np.uint16), pipe.decode(gpu).get())
