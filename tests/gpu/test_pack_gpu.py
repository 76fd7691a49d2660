"""The packed container on a GPU (tests/test_pack.py is the CPU side, with the format's forgeries):
pack of CuPy or torch CUDA blobs gives one array of their framework on their device, byte for byte
the CPU pack of the same blobs, its members copied device to device (no payload byte through the
host); unpack hands out views of it; decompress_many decodes it and names a bad member."""
import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

import kvzip
from kvzip import packed as packing
from kvzip.backends import get_backend
from kvzip.data import load_sample
from kvzip.errors import FormatError

D2D = 3  # cudaMemcpyDeviceToDevice


def layers(count=6):
    return [np.asarray(v).view(np.uint16) for v in list(load_sample("code").values())[:count]]


def cpu_pack(blobs) -> bytes:
    return bytes(kvzip.pack([np.asarray(b) for b in blobs]))


@pytest.fixture
def copies(monkeypatch):
    """Every cudaMemcpyAsync the Python side makes, as (kind, bytes)."""
    seen, real = [], cupy.cuda.runtime.memcpyAsync

    def record(dst, src, n, kind, stream):
        seen.append((kind, n))
        return real(dst, src, n, kind, stream)

    monkeypatch.setattr(cupy.cuda.runtime, "memcpyAsync", record)
    return seen


def test_cupy_pack_is_the_cpu_pack_copied_device_to_device(copies):
    host = layers()
    blobs = kvzip.compress_many([cupy.asarray(x) for x in host], dtype="bf16")
    want = cpu_pack([cupy.asnumpy(b) for b in blobs])
    copies.clear()
    got = kvzip.pack(blobs)
    assert copies == [(D2D, b.shape[0]) for b in blobs]  # the members; the header went by ndarray.set
    assert type(got) is cupy.ndarray and got.dtype == cupy.uint8 and got.device.id == blobs[0].device.id
    assert cupy.asnumpy(got).tobytes() == want
    members = kvzip.unpack(got)
    at = packing.header_len(len(blobs))
    for m, b in zip(members, blobs):  # views of the container itself, at the table's offsets
        assert type(m) is cupy.ndarray and m.data.ptr == got.data.ptr + at and m.shape == b.shape
        assert bool((m == b).all())
        at += b.shape[0]
    backs = kvzip.decompress_many(got)
    assert all(type(t) is cupy.ndarray and cupy.asnumpy(t).view(np.uint16).tobytes() == x.tobytes()
               for t, x in zip(backs, host))
    assert cupy.asnumpy(kvzip.compress_many([cupy.asarray(x) for x in host], dtype="bf16", packed=True)).tobytes() == want


def test_pack_on_a_side_stream_is_ordered_there():
    host = layers(3)
    stream = cupy.cuda.Stream(non_blocking=True)
    inputs = [cupy.asarray(x) for x in host]
    cupy.cuda.get_current_stream().synchronize()
    with stream:  # every step queued on the side stream, which nothing else waits for
        blobs = kvzip.compress_many(inputs, dtype="bf16")
        got = kvzip.pack(blobs)
        backs = kvzip.decompress_many(got)
    stream.synchronize()  # before any copy to the host (CuPy's plain ones go by the null stream)
    assert cupy.asnumpy(got).tobytes() == cpu_pack([cupy.asnumpy(b) for b in blobs])
    assert all(cupy.asnumpy(t).view(np.uint16).tobytes() == x.tobytes() for t, x in zip(backs, host))


def test_torch_cuda_round_trip(copies):
    torch = pytest.importorskip("torch")
    host = layers()
    tensors = [torch.from_numpy(x.view(np.int16).copy()).view(torch.bfloat16).cuda() for x in host]
    blobs = kvzip.compress_many(tensors)
    want = cpu_pack([b.cpu().numpy() for b in blobs])
    copies.clear()
    got = kvzip.pack(blobs)
    assert [kind for kind, _ in copies] == [D2D] * len(blobs)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.uint8 and got.device == tensors[0].device
    assert got.cpu().numpy().tobytes() == want
    members = kvzip.unpack(got)
    at = packing.header_len(len(blobs))
    for m, b in zip(members, blobs):
        assert isinstance(m, torch.Tensor) and m.data_ptr() == got.data_ptr() + at and torch.equal(m, b)
        at += b.numel()
    backs = kvzip.decompress_many(got)
    assert all(isinstance(t, torch.Tensor) and t.is_cuda and torch.equal(t.view(torch.int16), x.view(torch.int16))
               for t, x in zip(backs, tensors))
    assert torch.equal(kvzip.compress_many(tensors, packed=True), got)


def test_unpack_reads_back_the_header_alone(monkeypatch):
    blobs = kvzip.compress_many([cupy.asarray(x) for x in layers()], dtype="bf16")
    got = kvzip.pack(blobs)
    be, reads = get_backend("cuda"), []
    real = be.read_bytes
    monkeypatch.setattr(be, "read_bytes", lambda a, n: reads.append(n) or real(a, n))
    kvzip.unpack(got)
    assert reads == [min(got.shape[0], packing.READ_AHEAD)]  # one read-back, no payload byte beyond it


def test_a_bad_member_and_a_bad_call_on_the_gpu():
    blobs = kvzip.compress_many([cupy.asarray(x) for x in layers(4)], dtype="bf16")
    got = kvzip.pack(blobs)
    bad = got.copy()
    at = packing.header_len(4) + blobs[0].shape[0] + blobs[1].shape[0]  # member 2's magic
    bad[at] ^= 0x5A
    with pytest.raises(FormatError, match="packed member 2 of 4: "):
        kvzip.decompress_many(bad)
    forged = got.copy()
    forged[8] = 9  # an unknown version, CRC not resealed: either check stops it
    with pytest.raises(FormatError):
        kvzip.unpack(forged)
    with pytest.raises(FormatError, match="packed container.*decompress_many"):
        kvzip.decompress(got)
    with pytest.raises(TypeError, match="member 1 is a numpy .* member 0 a cupy"):
        kvzip.pack([blobs[0], cupy.asnumpy(blobs[1])])
