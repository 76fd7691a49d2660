"""Issue 26 on a real GPU: a decoded CuPy or torch CUDA tensor never aliases the blob, another
result or a caller buffer, on every decode path (guessed layout, known header, the repeated-call
shortcut, the general path, stored raw, the split-only pipeline, batches); torch's negative bit
on CUDA tensors is resolved; bad CUDA blobs raise FormatError like CPU ones."""
import ml_dtypes
import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

import kvzip
from kvzip import FormatError
from kvzip import stages as S
from kvzip import testing as kt

torch = pytest.importorskip("torch")


def _kv_bits(n, seed=0):
    x = (np.random.default_rng(seed).standard_normal(n) * 0.05).astype(ml_dtypes.bfloat16)
    return x.view(np.uint16)


def _span(a):
    if isinstance(a, cupy.ndarray):
        return a.data.ptr, a.data.ptr + a.nbytes
    return a.data_ptr(), a.data_ptr() + a.numel() * a.element_size()


def _disjoint(a, b):
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a1 <= b0 or b1 <= a0 or a0 == a1 or b0 == b1


def _host(a) -> bytes:
    """a's bytes, copied to the host."""
    if isinstance(a, cupy.ndarray):
        return cupy.asnumpy(a).tobytes()
    return a.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _scribble(blob):
    """Overwrite the caller's blob buffer (as a caller reusing it would)."""
    if isinstance(blob, cupy.ndarray):
        blob.fill(0x55)
    else:
        blob.fill_(0x55)
    cupy.cuda.Device().synchronize()


def _check_private(y, blob, *others):
    assert _disjoint(y, blob)
    for o in others:
        assert _disjoint(y, o)
    before = _host(y)
    _scribble(blob)
    assert _host(y) == before


@pytest.mark.parametrize("framework", ["cupy", "torch"])
@pytest.mark.parametrize("kind", ["splitzip", "stored", "split", "checksum"])
def test_decoded_gpu_tensor_never_aliases_the_blob(framework, kind):
    n = {"stored": 8}.get(kind, 1 << 16)
    bits = _kv_bits(n)
    x = cupy.asarray(bits) if framework == "cupy" else torch.from_numpy(bits.view(np.int16)).cuda().view(torch.bfloat16)
    dtype = "bfloat16" if framework == "cupy" else None
    if kind == "split":
        make = lambda: kvzip.Pipeline([S.ExponentSplit(), S.Serialize()]).encode(x, dtype=dtype)  # noqa: E731
    else:
        make = lambda: kvzip.compress(x, dtype=dtype, checksum=kind == "checksum")  # noqa: E731
    # Three decodes of fresh blobs of one layout: the general path, then the remembered and guessed
    # layouts, then the repeated-call shortcut; each result its own memory, kept after the next.
    results = []
    for _ in range(4):
        blob = make()
        y = kvzip.decompress(blob)
        _check_private(y, blob, *[r[0] for r in results])
        results.append((y, _host(y)))
    for y, host in results:
        assert _host(y) == host


@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_decoded_gpu_batch_never_aliases_the_blobs(framework):
    arrays = [_kv_bits(1 << 14, seed) for seed in range(6)] + [_kv_bits(8, 9)]
    if framework == "cupy":
        xs = [cupy.asarray(a) for a in arrays]
    else:
        xs = [torch.from_numpy(a.view(np.int16)).cuda().view(torch.bfloat16) for a in arrays]
    dtype = "bfloat16" if framework == "cupy" else None
    for _ in range(3):  # general, known and guessed layouts
        blobs = kvzip.compress_many(xs, dtype=dtype)
        ys = kvzip.decompress_many(blobs)
        hosts = [_host(y) for y in ys]
        for y in ys:
            for b in blobs:
                assert _disjoint(y, b)
            for other in ys:
                assert other is y or _disjoint(y, other)
        for b in blobs:
            _scribble(b)
        for y, h in zip(ys, hosts):
            assert _host(y) == h


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float32", "float8_e5m2"])
def test_torch_cuda_negative_bit_is_resolved(name):
    base = torch.tensor([1.0, -2.0, 0.0, 0.5] * 4096, dtype=torch.float32).to(getattr(torch, name))
    want = kvzip.decompress(kvzip.compress(torch._neg_view(base)))  # the CPU path (tests/test_hardening.py)
    got = kvzip.decompress(kvzip.compress(torch._neg_view(base.cuda())))
    kt.assert_bits_equal(got.cpu(), want)


def test_bad_cuda_blobs_raise_format_error():
    blob = kvzip.compress(cupy.asarray(_kv_bits(1 << 14)), dtype="bfloat16")
    host = cupy.asnumpy(blob).tobytes()
    meta, flags, streams = kt.blob_parts(host)
    forged = [host[:-16], kt.build_blob({**meta, "n": meta["n"] + 1}, streams, flags),
              kt.with_metadata_text(host, b'{"meta": ' + b"[" * 40 + b"]" * 40 + b', "streams": []}')]
    for bad in forged:
        dev = cupy.asarray(np.frombuffer(bad, np.uint8))
        for call in (kvzip.decompress, kvzip.info, lambda b: kvzip.decompress_many([b])):
            with pytest.raises(FormatError):
                call(dev)
    assert np.array_equal(cupy.asnumpy(kvzip.decompress(blob)).view(np.uint16), _kv_bits(1 << 14))
