"""Real-GPU checks, run on the device machine (skipped where there is no CUDA GPU):
the GPU backend writes the same bytes as the CPU backend, decodes either's blobs, keeps the
caller's framework and stream, and rejects corrupted blobs.  With the shipped codebook
(codebook=None) throughout: these inputs' escapes are its escapes; codebook="auto", compress's
default, has test_auto_codebook_gpu.py."""
import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

import kvzip
from kvzip import execution
from kvzip import stages as S
from kvzip.gpu import graphs, programs, tuning
from kvzip.stages.escape_stream import escape_capacity
from kvzip.data import load_sample
from kvzip.formats import FORMATS
from kvzip.trace import last_path

rng = np.random.default_rng(1234)


def compress(x, **kw):
    return kvzip.compress(x, None, **kw)


def compress_many(xs, **kw):
    return kvzip.compress_many(xs, None, **kw)


def bits_of(a, fmt="bf16"):
    """Host copy of a decoded array's raw bits (CuPy 14 returns bfloat16 arrays, older ones uint16)."""
    f = FORMATS[fmt] if isinstance(fmt, str) else fmt
    a = a.get() if hasattr(a, "get") else np.asarray(a)
    return a.reshape(-1).view(f.uint_dtype)


def random_bits(fmt, n):
    return rng.integers(0, 2**fmt.width, n, dtype=np.uint64).astype(fmt.uint_dtype)


def real_bf16(n):
    sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample("prose").values()])
    return np.resize(sample, n)


@pytest.fixture(params=["fast", "numba"])
def gpu_path(request, monkeypatch):
    """Run a test on the CUDA C++ fast path and on the Numba-CUDA kernels."""
    monkeypatch.setattr(programs, "ENABLED", request.param == "fast")
    return request.param


def pipeline(chunk=4096, checksum=False, codebook=None):
    return kvzip.Pipeline([S.ExponentSplit(), S.Top16Pack(codebook), S.EscapeStream(chunk), S.Serialize(checksum)])


@pytest.mark.parametrize("fmt", list(FORMATS.values()), ids=list(FORMATS))
@pytest.mark.parametrize("n", [0, 1, 13, 4096, 100_003, 1 << 20])
@pytest.mark.parametrize("chunk", [8, 256, 4096, 65536])
def test_gpu_bytes_equal_cpu_random(fmt, n, chunk, gpu_path):
    bits = random_bits(fmt, n)
    cpu = compress(bits, dtype=fmt.name, chunk=chunk, checksum=True)
    pipe = pipeline(chunk, checksum=True)
    gpu = pipe.encode(cupy.asarray(bits), dtype=fmt.name)
    assert isinstance(gpu, cupy.ndarray)
    np.testing.assert_array_equal(cpu, gpu.get())
    back = pipe.decode(gpu)
    np.testing.assert_array_equal(bits_of(back, fmt), bits)
    np.testing.assert_array_equal(np.asarray(kvzip.decompress(gpu.get())).view(fmt.uint_dtype).ravel(), bits)


@pytest.mark.parametrize("fmt", ["bf16", "e5m2", "fp16", "fp32"])
@pytest.mark.parametrize("chunk", [256, 4096, 65536])
def test_fast_path_runs_and_matches_cpu_on_kv_like_data(fmt, chunk):
    f = FORMATS[fmt]
    scale = 4096.0 if fmt == "e5m2" else 0.05  # e5m2-kv is calibrated on scaled (amax -> 57344) values
    x = (rng.standard_normal(300_001) * scale).astype(np.float32)
    import ml_dtypes

    bits = x.astype(np.dtype(getattr(ml_dtypes, f.dtype_name, f.dtype_name))).view(f.uint_dtype)
    pipe = pipeline(chunk)
    gpu = pipe.encode(cupy.asarray(bits), dtype=fmt)
    assert last_path() == "fast"
    np.testing.assert_array_equal(compress(bits, dtype=fmt, chunk=chunk), gpu.get())
    back = pipe.decode(gpu)
    assert last_path() == "fast"
    np.testing.assert_array_equal(bits_of(back, f), bits)


def test_misaligned_input_takes_numba_path():
    bits = cupy.asarray(real_bf16((1 << 16) + 1))[1:]
    pipe = pipeline()
    blob = pipe.encode(bits, dtype="bf16")
    assert last_path() == "fused"
    np.testing.assert_array_equal(blob.get(), compress(bits.get(), dtype="bf16"))


@pytest.mark.parametrize("n", [1 << 16, (1 << 22) + 5])
def test_gpu_real_kv_bf16(n, gpu_path):
    bits = real_bf16(n)
    cpu = compress(bits, dtype="bf16")
    gpu = compress(cupy.asarray(bits), dtype="bf16")
    np.testing.assert_array_equal(cpu, gpu.get())
    assert kvzip.info(cpu)["ratio"] > 1.3
    np.testing.assert_array_equal(bits_of(kvzip.decompress(gpu)), bits)


def test_scans_look_back_past_one_round():
    """Tensors of 300 scan blocks (256 chunks each: chunk 64, 4.9M values), whose decoupled
    look-back takes rounds of 32 predecessors, alone and in a batch, equal the CPU's bytes and
    decode back."""
    n = 300 * 256 * 64 + 13
    bits = real_bf16(n)
    hit = rng.random(n) < 0.01
    bits[hit] = (bits[hit] & 0x807F) | (rng.integers(200, 250, int(hit.sum())) << 7).astype(np.uint16)
    pipe = pipeline(64)
    cpu = compress(bits, dtype="bf16", chunk=64)
    gpu = pipe.encode(cupy.asarray(bits), dtype="bf16")
    np.testing.assert_array_equal(cpu, gpu.get())
    np.testing.assert_array_equal(bits_of(pipe.decode(gpu)), bits)
    xs = [cupy.asarray(bits[:n - 4096]), cupy.asarray(bits)]
    blobs = pipe.encode_many(xs, dtype="bf16")
    np.testing.assert_array_equal(blobs[0].get(), compress(bits[:n - 4096], dtype="bf16", chunk=64))
    np.testing.assert_array_equal(blobs[1].get(), cpu)
    for x, y in zip(xs, pipe.decode_many(blobs)):
        np.testing.assert_array_equal(bits_of(y), x.get())


def test_escape_heavy_chunks_plane_coded_on_gpu(gpu_path):
    bits = real_bf16(1 << 18)
    bits[: 1 << 14] = random_bits(FORMATS["bf16"], 1 << 14)  # first chunks full of escapes
    bits[1 << 15: (1 << 15) + 600] = random_bits(FORMATS["bf16"], 600)  # listed, but past the shared buffer
    cpu = compress(bits, dtype="bf16")
    gpu = compress(cupy.asarray(bits), dtype="bf16")
    np.testing.assert_array_equal(cpu, gpu.get())
    assert kvzip.info(cpu)["raw_chunks"] > 0
    np.testing.assert_array_equal(bits_of(kvzip.decompress(gpu)), bits)


def real_e5m2(n):
    """The real sample quantized to E5M2 (kvzip bench's data), tiled to n."""
    from kvzip.bench import e5m2_bits

    return e5m2_bits(real_bf16(1 << 20), n)


@pytest.mark.parametrize("fmt", ["bf16", "e5m2"])
@pytest.mark.parametrize("rate", [0.004, 0.03, 0.12])
@pytest.mark.parametrize("chunk", [16, 32, 1024, 4096, 65536])
def test_listed_escapes_at_every_density_match_cpu(fmt, rate, chunk, gpu_path):
    """Escapes sprinkled at a rate: a few per chunk (one register batch), more than 32 (several
    batches in decode), several in one E5M2 quad (32 values, encode_e5m2_quads), and more than
    the encoder's per-chunk slot (collected again).  Chunks of 16 values are below a quad."""
    n = (1 << 19) + 77
    hit = rng.random(n) < rate
    if fmt == "bf16":
        bits = real_bf16(n)
        bits[hit] = (bits[hit] & 0x807F) | (rng.integers(200, 250, int(hit.sum())) << 7).astype(np.uint16)
    else:  # exponents 1-6: never among the quantized sample's Top-16
        bits = real_e5m2(n)
        bits[hit] = (bits[hit] & 0x83) | (rng.integers(1, 7, int(hit.sum())) << 2).astype(np.uint8)
    cpu = compress(bits, dtype=fmt, chunk=chunk)
    pipe = pipeline(chunk)
    gpu = pipe.encode(cupy.asarray(bits), dtype=fmt)
    np.testing.assert_array_equal(cpu, gpu.get())
    if 2 * rate * chunk < escape_capacity(FORMATS[fmt], chunk // 8):  # else many chunks are plane-coded
        assert kvzip.info(cpu)["escapes"] > 0
    np.testing.assert_array_equal(bits_of(pipe.decode(gpu), fmt), bits)


def test_torch_cuda_round_trip_on_callers_stream():
    torch = pytest.importorskip("torch")
    x = torch.randn(3, 2048, 64, device="cuda", dtype=torch.bfloat16) * 0.1
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        blob = compress(x)
        back = kvzip.decompress(blob)
    s.synchronize()
    assert blob.is_cuda and blob.dtype == torch.uint8
    assert back.is_cuda and back.dtype == torch.bfloat16 and back.shape == x.shape
    assert torch.equal(back.view(torch.int16), x.view(torch.int16))
    cpu_blob = compress(x.cpu())
    assert torch.equal(cpu_blob, blob.cpu())


def test_corrupted_blob_raises_on_gpu(gpu_path):
    bits = real_bf16(1 << 16)
    blob = compress(cupy.asarray(bits), dtype="bf16", checksum=True)
    bad = blob.copy()
    bad[-100] ^= 1
    with pytest.raises(kvzip.FormatError):
        kvzip.decompress(bad)
    with pytest.raises(kvzip.FormatError):
        kvzip.decompress(blob[:-16])


@pytest.mark.parametrize("forge", ["past_chunk", "at_chunk_end", "unordered", "over_capacity", "short_stream"])
def test_forged_escapes_raise_on_gpu(gpu_path, forge):
    bits = real_bf16(1 << 16)
    bits[:32] = 0x3F80  # no escapes at the start of chunk 0 ...
    bits[10] = bits[20] = 200 << 7  # ... but two (exponent 200) at positions 10 and 20
    blob = compress(bits, dtype="bf16")
    from kvzip import container
    from kvzip.backends import get_backend

    be = get_backend("cpu")
    hdr = container.parse_header(container.read_head(be, blob), blob.shape[0])
    views = {k: v.copy() for k, v in container.stream_views(be, blob, hdr).items()}
    assert list(views["esc_pos"][:2]) == [10, 20]
    if forge == "past_chunk":
        views["esc_pos"][1] = 60000
    elif forge == "at_chunk_end":
        views["esc_pos"][1] = 4096
    elif forge == "unordered":
        views["esc_pos"][1] = 10
    elif forge == "over_capacity":
        views["esc_count"][0] = 4000
    else:
        views["esc_exp"] = views["esc_exp"][:-1]
        views["esc_pos"] = views["esc_pos"][:-1]
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
    np.testing.assert_array_equal(bits_of(pipe.decode(cpu)), bits_of(pipe.decode(gpu)))


def test_batch_api_matches_single_calls_and_uses_one_launch_set():
    sizes = [0, 1, 4096, 100_003, 1 << 20, 77]
    xs = [cupy.asarray(real_bf16(n)) for n in sizes] + [cupy.asarray(random_bits(FORMATS["e5m2"], 5000))]
    dtypes = ["bf16"] * len(sizes) + ["e5m2"]
    blobs = [compress_many([x], dtype=d)[0] for x, d in zip(xs, dtypes)]
    many_bf16 = compress_many(xs[:-1], dtype="bf16")
    for a, b in zip(many_bf16, blobs):
        np.testing.assert_array_equal(a.get(), b.get())
    for a, x in zip(many_bf16, xs):
        np.testing.assert_array_equal(a.get(), compress(x.get(), dtype="bf16"))
    backs = kvzip.decompress_many(many_bf16 + [blobs[-1]])
    for back, x, d in zip(backs, xs, dtypes):
        np.testing.assert_array_equal(bits_of(back, d), x.get())


def test_batch_decode_reports_the_bad_blob():
    xs = [cupy.asarray(real_bf16(1 << 16)) for _ in range(3)]
    blobs = compress_many(xs, dtype="bf16", checksum=True)
    blobs[1] = blobs[1].copy()
    blobs[1][-20] ^= 4
    with pytest.raises(kvzip.FormatError):
        kvzip.decompress_many(blobs)


def test_torch_batch_round_trip():
    torch = pytest.importorskip("torch")
    xs = [torch.randn(3, 512 + i, 64, device="cuda", dtype=torch.bfloat16) for i in range(8)]
    blobs = compress_many(xs)
    assert all(b.is_cuda and b.dtype == torch.uint8 for b in blobs)
    for x, y in zip(xs, kvzip.decompress_many(blobs)):
        assert y.dtype == torch.bfloat16 and torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_torch_batches_of_like_tensors_skip_the_import_and_match_cpu(monkeypatch):
    """A batch of like torch tensors (a serving loop's layers) is imported once, the rest read by
    address, and its blobs decode through blob_addresses; tensors unlike the run (another dtype,
    a non-contiguous view, a CPU tensor) are imported in full, blobs unlike the rest (a
    misaligned view) send the batch the general way.  Every blob equals the CPU's bytes."""
    torch = pytest.importorskip("torch")
    from kvzip import arrays

    base = torch.as_tensor(real_bf16(1 << 20).view(np.int16), device="cuda").view(torch.bfloat16)
    like = [base[i * (1 << 16):(i + 1) * (1 << 16)].view(64, 1024) for i in range(6)]
    xs = like[:3] + [like[3].to(torch.float16), like[4].view(1024, 64).t(), like[5].cpu(), like[0]]
    pipe = pipeline()
    pipe.encode_many(xs)  # lanes for each shape and format
    imported = []
    monkeypatch.setattr(arrays, "import_tensor", lambda x, dtype=None, f=arrays.import_tensor: imported.append(x) or f(x, dtype))
    blobs = pipe.encode_many(xs)
    assert [any(t is x for t in imported) for x in xs] == [True, False, False, True, True, True, True]
    for x, b in zip(xs, blobs):
        np.testing.assert_array_equal(b.cpu().numpy(), compress(x.cpu()).numpy())
    bf16 = [(x, b) for x, b in zip(xs, blobs) if b.is_cuda and x.dtype == torch.bfloat16]
    found = arrays.blob_addresses([b for _, b in bf16])
    assert found is not None and found[0].framework == "torch" and found[2] == [b.numel() for _, b in bf16]
    pipe.decode_many([b for _, b in bf16])  # the layout is remembered; next time it is guessed
    monkeypatch.setattr(arrays, "import_blobs", lambda *a: pytest.fail("a like batch imports no blob"))
    for (x, _), y in zip(bf16, pipe.decode_many([b for _, b in bf16])):
        assert y.is_cuda and y.dtype == x.dtype and y.shape == x.shape
        assert torch.equal(y.cpu().view(torch.int16), x.cpu().contiguous().view(torch.int16))
    monkeypatch.undo()
    first = bf16[0][1]
    shifted = torch.empty(first.numel() + 1, dtype=torch.uint8, device="cuda")[1:]
    shifted.copy_(first)
    assert arrays.blob_addresses([b for _, b in bf16] + [shifted]) is None  # misaligned: the checked way
    assert torch.equal(pipe.decode_many([shifted])[0].view(torch.int16), like[0].view(torch.int16))


def test_blobs_at_unaligned_addresses_decode(gpu_path):
    """A blob viewed at an odd offset (its 2-byte streams unaligned) decodes, alone and in a batch."""
    bits = real_bf16(100_003)
    blob = compress(cupy.asarray(bits), dtype="bf16")
    for shift in (1, 2, 8):
        view = cupy.empty(blob.size + shift, cupy.uint8)[shift:]
        view[...] = blob
        np.testing.assert_array_equal(bits_of(kvzip.decompress(view)), bits)
        np.testing.assert_array_equal(bits_of(kvzip.decompress_many([blob, view])[1]), bits)


def test_blobs_sized_from_the_published_totals_match_cpu():
    """Lane batches size their blobs from the totals kvz_encode publishes tensor by tensor (before
    the scan ends): an empty tensor (no chunk: never published), escape-heavy and plain ones,
    and a tensor whose lane payload comes out larger than its values (stored raw by the general
    path), all byte-equal to the CPU; a batch of empty tensors alone has no kvz_encode at all."""
    heavy = real_bf16(1 << 16)
    heavy[::7] = random_bits(FORMATS["bf16"], heavy[::7].shape[0])
    xs = [real_bf16(0), real_bf16(5), real_bf16(4096), heavy, real_bf16((1 << 18) + 3), real_bf16(1 << 14)]
    pipe = pipeline()
    execution.forget()  # lanes are shared by equal pipelines: the first round must find none (one batch of six)
    for round_ in range(3):
        if round_ == 2:  # the last tensor's lane now meets incompressible values
            xs[-1] = random_bits(FORMATS["bf16"], 1 << 14)
        blobs = pipe.encode_many([cupy.asarray(x) for x in xs], dtype="bf16")
        for x, b in zip(xs, blobs):
            np.testing.assert_array_equal(b.get(), compress(x, dtype="bf16"))
    prog = [e for e in graphs.entries() if isinstance(e, programs._EncodeProgram) and len(e.plans) == len(xs)][-1]
    assert int(prog.ready[0]) == 0 and all(int(w) >> 63 for w in prog.ready[1:len(xs)])  # the empty one has no chunk
    empty = [cupy.asarray(real_bf16(0))] * 2
    for _ in range(2):
        assert [b.get().tobytes() for b in pipe.encode_many(empty, dtype="bf16")] == \
            [compress(real_bf16(0), dtype="bf16").tobytes()] * 2


def test_torch_batch_on_a_side_stream():
    """A batch on the caller's torch side stream; the second round goes through the lanes and
    remembered layouts."""
    torch = pytest.importorskip("torch")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        xs = [torch.randn(2, 256, 64, device="cuda", dtype=torch.bfloat16) * (i + 1) for i in range(24)]
        rounds = []
        for _ in range(2):
            blobs = compress_many(xs)
            rounds.append((blobs, kvzip.decompress_many(blobs)))
    side.synchronize()
    for blobs, backs in rounds:
        for x, b, y in zip(xs, blobs, backs):
            np.testing.assert_array_equal(b.cpu().numpy(), compress(x.cpu()).numpy())
            assert y.dtype == torch.bfloat16 and torch.equal(x.view(torch.int16), y.view(torch.int16))


@pytest.mark.parametrize("fmt", ["e5m2", "e4m3", "bf16"])
def test_batches_whose_chunks_pass_through_every_queue_match_cpu(fmt):
    """Past the chunks dealt one a warp (at most 3168 here), the dense kernels' warps claim chunks
    from four queues, every fourth chunk each (claim_chunk): a batch of more chunks than warps,
    with tensors of odd chunk counts, an empty one and one-value ones, so that the queues' chunks
    cross tensors at every offset.  Real and escape-heavy tensors alternate."""
    f = FORMATS[fmt]
    sizes = [4096 * 1601, 1, 4096 + 5, 0, 4096 * 1999 - 7, 77, 4096 * 3]
    real = {"e5m2": real_e5m2, "bf16": real_bf16}.get(fmt)
    xs = [random_bits(f, n) if i % 2 or real is None else real(n) for i, n in enumerate(sizes)]
    for _ in range(2):  # the second call replays the first one's program
        blobs = compress_many([cupy.asarray(x) for x in xs], dtype=fmt)
        for blob, x in zip(blobs, xs):
            np.testing.assert_array_equal(blob.get(), compress(x, dtype=fmt))
    for back, x in zip(kvzip.decompress_many(blobs), xs):
        np.testing.assert_array_equal(bits_of(back, fmt), x)


def test_long_mixed_batches_through_lanes_match_single_calls():
    """A long batch through its lanes (the second call): every blob must still be the CPU's, with
    formats mixed, an incompressible tensor stored raw mid-batch, and a quantizing pipeline's
    lanes (a program run each)."""
    from kvzip.gpu import graphs

    graphs.release()
    e5m2 = FORMATS["e5m2"]
    shapes = [(1 << 14,), (3, 4096), (1 << 14,), (77, 129)]
    xs, dtypes = [], []
    for i in range(37):
        if i % 9 == 4:
            xs.append(cupy.asarray(random_bits(e5m2, 5000 + i)))
            dtypes.append("e5m2")
        else:
            shape = shapes[i % len(shapes)]
            xs.append(cupy.asarray(np.roll(real_bf16(int(np.prod(shape))), i)).reshape(shape))
            dtypes.append("bf16")
    xs[20] = cupy.asarray(random_bits(FORMATS["bf16"], 1 << 14))  # no escapes saved: stored raw
    for d in ("bf16", "e5m2"):
        idx = [i for i, t in enumerate(dtypes) if t == d]
        for _ in range(2):  # the second call goes through the lanes the first one left
            for i, blob in zip(idx, compress_many([xs[i] for i in idx], dtype=d)):
                np.testing.assert_array_equal(blob.get(), compress(xs[i].get(), dtype=d))
    assert any(e.shape.graph for e in graphs.entries())  # the lanes' programs replayed
    qpipe = kvzip.Pipeline([S.QuantizeFP8("e5m2"), S.ExponentSplit(), S.Top16Pack("e5m2-kv"), S.EscapeStream(),
                            S.Serialize()])
    qs = [cupy.asarray(real_bf16(4096 * 3 + i)) for i in range(12)]
    for _ in range(2):
        for q, blob in zip(qs, qpipe.encode_many(qs, dtype="bf16")):
            np.testing.assert_array_equal(blob.get(), qpipe.encode(q.get(), dtype="bf16"))


def test_batches_mixing_frameworks_shapes_and_formats_match_single_calls():
    """compress_many / decompress_many on one list holding CuPy arrays (1-D raw bits, N-D typed,
    strided), CUDA torch tensors and a NumPy array: each blob is the one compress gives, and each
    result comes back in its blob's framework, dtype and shape, the first time (full checks)
    and the second (remembered layouts, one decode run per framework)."""
    torch = pytest.importorskip("torch")
    from kvzip.gpu import layout_cache

    layout_cache.forget()
    bits = real_bf16(3 * 4096 * 8 + 11)
    cu = cupy.asarray(bits)
    half = cupy.asarray(random_bits(FORMATS["fp16"], 4096)).view(cupy.float16).reshape(64, 64)
    xs = [cu[:4096], cu[4096:8192], torch.as_tensor(bits[:8192].view(np.int16), device="cuda").view(torch.bfloat16),
          half, cu[:8192].reshape(2, 4096)[:, ::2], bits[:4096].view(np.uint16), cu[8192:12288],
          torch.as_tensor(bits[:3000].view(np.int16), device="cuda").view(torch.bfloat16).reshape(30, 100)]
    dtypes = ["bf16", "bf16", None, None, "bf16", "bf16", "bf16", None]
    singles = [compress(x, dtype=d) for x, d in zip(xs, dtypes)]
    for round_ in range(2):
        blobs = [compress_many(xs[i:i + 1], dtype=d)[0] for i, d in enumerate(dtypes)] if round_ else []
        raw = [i for i, d in enumerate(dtypes) if d]
        typed = [i for i, d in enumerate(dtypes) if not d]
        many = [None] * len(xs)
        for idx, d in ((raw, "bf16"), (typed, None)):
            for i, blob in zip(idx, compress_many([xs[i] for i in idx], dtype=d)):
                many[i] = blob
        for got, want in zip(many + blobs, singles + (singles if round_ else [])):
            host = lambda b: b.cpu().numpy() if hasattr(b, "cpu") else b.get() if hasattr(b, "get") else b
            np.testing.assert_array_equal(host(got), host(want))
        backs = kvzip.decompress_many(many)
        for x, y in zip(xs, backs):
            assert type(y) is type(x) and tuple(y.shape) == tuple(x.shape)
            if isinstance(x, torch.Tensor):
                assert y.dtype == x.dtype and y.is_cuda and torch.equal(y.view(torch.int16), x.view(torch.int16))
            else:
                xb = x.get() if hasattr(x, "get") else x
                yb = y.get() if hasattr(y, "get") else y
                np.testing.assert_array_equal(np.ascontiguousarray(yb).view(xb.dtype) if yb.dtype != xb.dtype else yb,
                                              xb)


def test_call_shape_zeroes_the_region_after_its_upload_every_run():
    """A ("zero", i) right after ("upload", i) rides on the upload (region i's staging stays zero)
    instead of a memset node: a kernel that counts into region i sees it zeroed on every run,
    eager and replayed, and staging region i is refused."""
    from kvzip.gpu import graphs

    bump = cupy.RawKernel(r"""extern "C" __global__ void bump(const unsigned long long* table, unsigned long long* counts) {
        atomicAdd(&counts[threadIdx.x], table[threadIdx.x]);
    }""", "bump")
    R = graphs.Region
    shape = graphs.CallShape((8 * 32, 8 * 32), (("upload", 1), ("zero", 1),
                                                     ("launch", bump, (1,), (32,), (R(0), R(1))), ("download", 1, 8 * 32)))
    assert ("zero", 1) not in shape.ops and shape.zeroed == 1
    stream = cupy.cuda.get_current_stream()
    for run in range(4):  # eager, capture, then graph replays
        table = np.arange(32, dtype=np.uint64) + run
        shape.put(0, table)
        np.testing.assert_array_equal(shape.run(stream).view(np.uint64), table)
    assert shape.graph
    with pytest.raises(ValueError, match="zeroed"):
        shape.put(1, np.ones(32, np.uint64))


def test_replayed_call_shapes_match_cpu_and_still_catch_forgeries(monkeypatch):
    """From its second use a call shape runs as one CUDA graph (kvzip/gpu/graphs.py), encode
    goes through the pipeline's lane for the shape and decode through the remembered layout
    (kvzip/gpu/layout_cache.py): later calls with other values, escape counts and output buffers
    must give the CPU's bytes, and a forged blob of the same layout must still be caught, on a
    torch stream too."""
    from kvzip.gpu import graphs, layout_cache

    graphs.release()
    layout_cache.forget()
    lane_decodes = []  # decodes on a guessed layout: (blobs, wrong guesses)
    real_guessed, real_one = layout_cache.decode_guessed, layout_cache.GuessedDecode.run

    def spy(layouts, blobs, labels=None, origin=None):
        got, misses = real_guessed(layouts, blobs, labels, origin)
        lane_decodes.append((len(blobs), len(misses)))
        return got, misses

    def spy_one(self, *args):  # a single blob's decode on a guessed layout, first or repeated
        got = real_one(self, *args)
        lane_decodes.append((1, int(got is None)))
        return got

    monkeypatch.setattr(layout_cache, "decode_guessed", spy)
    monkeypatch.setattr(layout_cache.GuessedDecode, "run", spy_one)
    base = real_bf16((1 << 18) + 3)
    pipe = pipeline()
    for rate in (0.0, 0.001, 0.02, 0.06):
        bits = rng.permutation(base)
        hit = rng.random(bits.shape[0]) < rate
        bits[hit] = (bits[hit] & 0x807F) | (rng.integers(200, 250, int(hit.sum())) << 7).astype(np.uint16)
        gpu = pipe.encode(cupy.asarray(bits), dtype="bf16")
        assert last_path() == "fast"
        np.testing.assert_array_equal(gpu.get(), compress(bits, dtype="bf16"))
        np.testing.assert_array_equal(bits_of(pipe.decode(gpu)), bits)
    shapes = [e.shape for e in graphs.entries()]
    # The encode lane's program (4 uses), the first decode's (the checked way) and the guessed
    # layout's: the common decoder's for the blob of 0.1 % escapes, the escape-heavy one's
    # (programs.heavy) for the two of 2 and 6 %.
    assert sorted(s.uses for s in shapes) == [1, 1, 2, 4] and all(s.graph for s in shapes if s.uses > 1)
    assert lane_decodes == [(1, 0)] * 3  # every decode after the first, although the escape counts differ
    from kvzip import container
    from kvzip.backends import get_backend

    host = gpu.get()
    hdr = container.parse_header(container.read_head(get_backend("cpu"), host), host.shape[0])
    at = hdr.header_len + next(off for name, _, off, _ in hdr.streams if name == "esc_count")
    bad = gpu.copy()
    bad[at:at + 2] = cupy.asarray([0xA0, 0x0F], np.uint8)  # chunk 0 claims 4000 escapes: the kernel's check
    with pytest.raises(kvzip.FormatError):
        pipe.decode(bad)
    np.testing.assert_array_equal(bits_of(pipe.decode(gpu)), bits)  # the shape stays usable
    rnd = random_bits(FORMATS["bf16"], bits.shape[0])  # incompressible: the encode lane hands over, raw is stored
    blob = pipe.encode(cupy.asarray(rnd), dtype="bf16")
    assert last_path() == "stored"
    np.testing.assert_array_equal(blob.get(), compress(rnd, dtype="bf16"))
    np.testing.assert_array_equal(bits_of(pipe.decode(blob)), rnd)
    torch = pytest.importorskip("torch")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = torch.as_tensor(bits.view(np.int16), device="cuda").view(torch.bfloat16)
        blobs = [compress(t) for _ in range(3)]
        backs = [kvzip.decompress(b) for b in blobs]
    s.synchronize()
    for b, y in zip(blobs, backs):
        np.testing.assert_array_equal(b.cpu().numpy(), compress(bits, dtype="bf16"))
        assert torch.equal(y.view(torch.int16), t.view(torch.int16))


def test_batch_decode_names_the_bad_blob_by_its_place():
    from kvzip import container
    from kvzip.backends import get_backend
    from kvzip.gpu import layout_cache

    xs = [cupy.asarray(real_bf16((1 << 16) + 5)) for _ in range(3)]
    blobs = compress_many(xs, dtype="bf16")
    for back, x in zip(kvzip.decompress_many(blobs), xs):  # the layout is remembered from here on
        assert bool(cupy.array_equal(back.reshape(-1).view(x.dtype), x))
    host = blobs[1].get()
    hdr = container.parse_header(container.read_head(get_backend("cpu"), host), host.shape[0])
    at = hdr.header_len + next(off for name, _, off, _ in hdr.streams if name == "esc_count")
    bad = [b.copy() for b in blobs]
    bad[1][at:at + 2] = cupy.asarray([0xA0, 0x0F], np.uint8)  # chunk 0 claims 4000 escapes
    with pytest.raises(kvzip.FormatError, match="blob 1"):
        kvzip.decompress_many(bad)  # through the remembered layout
    layout_cache.forget()
    with pytest.raises(kvzip.FormatError, match="blob 1"):
        kvzip.decompress_many(bad)  # through the full checks


def test_encodes_returning_before_their_scan_give_cpu_bytes_on_any_stream():
    """A CuPy caller's encode returns once its blobs are sized, while the scan still writes their
    escapes (Tuning.early_return): the next call of the program on the same stream follows it
    there, one on another stream waits for it first, and every blob is the CPU's."""
    from kvzip.gpu import graphs

    graphs.release()
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    xs = [real_bf16(1 << 22), rng.permutation(real_bf16(1 << 22))]
    xs[1][::97] = 250 << 7  # escapes enough to keep the scan busy
    want = [compress(x, dtype="bf16") for x in xs]
    got = []
    for on, which in [(0, 0), (0, 1), (1, 1), (1, 0), (0, 0), (1, 1)]:  # same stream, then a switch
        with streams[on]:
            got.append((compress(cupy.asarray(xs[which]), dtype="bf16"), which))
    detached = [e.shape.detached for e in graphs.entries() if hasattr(e, "publishes")]
    assert any(d is not None for d in detached) == tuning.tuning_for("bf16").early_return
    for s in streams:
        s.synchronize()
    for blob, which in got:
        np.testing.assert_array_equal(blob.get(), want[which])


def test_cuda_addresses_is_cuda_address_for_a_whole_batch():
    """arrays.cuda_addresses (a batch's check, by maps over the list) gives each tensor's
    cuda_address where all are alike, and None where any one is not: another dtype, shape,
    framework or device placement, a strided view, a 16-byte misaligned start.  compress_many
    gives the CPU's bytes either way (the loop takes the batches it refuses)."""
    torch = pytest.importorskip("torch")
    from kvzip import arrays

    base = cupy.asarray(real_bf16(8 * 4096 + 64))
    alike = [base[i * 4096:(i + 1) * 4096] for i in range(8)]
    origin, ptrs = arrays.cuda_addresses(alike)
    assert origin.framework == "cupy" and ptrs == [arrays.cuda_address(x, origin) for x in alike]
    tensors = [torch.from_dlpack(x) for x in alike]  # the same memory
    t_origin, t_ptrs = arrays.cuda_addresses(tensors)
    assert t_origin.framework == "torch" and t_ptrs == ptrs
    refused = {
        "dtype": alike[:-1] + [alike[-1].view(cupy.int16)],
        "shape": alike[:-1] + [base[:4096 * 2].reshape(2, 4096)[0:1]],
        "framework": alike[:-1] + [tensors[-1]],
        "strided": alike[:-1] + [base[:8192:2]],
        "misaligned": alike[:-1] + [base[3:4096 + 3]],
        "cpu": [t.cpu() for t in tensors],
    }
    for why, xs in refused.items():
        assert arrays.cuda_addresses(xs) is None, why
    assert arrays.cuda_addresses([]) is None and arrays.cuda_addresses([base.get()]) is None
    for xs in (alike, refused["misaligned"], refused["strided"]):
        for _ in range(2):  # the second call through the lanes
            blobs = compress_many(xs, dtype="bf16")
            for blob, x in zip(blobs, xs):
                np.testing.assert_array_equal(blob.get(), compress(x.get(), dtype="bf16"))


@pytest.mark.parametrize("heavy", [False, True], ids=["real", "escape-heavy"])
def test_broken_escapes_raise_in_first_and_queued_chunks(heavy):
    """Escape positions are checked by kvz_scan (check_block_escapes), whose verdict the host
    reads before the decoder ends, and, where a scan block holds too many escapes for that
    (escape-heavy data), by kvz_decode as it applies them, on a warp's first chunk (decoded
    before the scan is done, patched after: finish_early_chunk) and on chunks it takes from the
    queue later.  Each way a broken position raises, a batch names the bad blob, and good calls
    after bad ones decode."""
    from kvzip import container
    from kvzip.backends import get_backend
    from kvzip.gpu import graphs

    bits = real_bf16(1 << 24)  # 4096 chunks: more than the decoder's warps (3168 on an H200)
    if heavy:
        bits[::10] = 200 << 7  # an exponent far outside the codebook: ~410 escapes a chunk
    blob = compress(cupy.asarray(bits), dtype="bf16")
    graphs.release()
    np.testing.assert_array_equal(bits_of(kvzip.decompress(blob)), bits)
    (program,) = [e for e in graphs.entries() if isinstance(e, programs._DecodeProgram)]
    if tuning.tuning_for("bf16").early_verdict:
        assert program.shape.early64[program.errors_nb // 8 - 1] == heavy  # the scan deferred its checks
    host = blob.get()
    hdr = container.parse_header(container.read_head(get_backend("cpu"), host), host.shape[0])
    start = {name: hdr.header_len + off for name, _, off, _ in hdr.streams}
    counts = np.frombuffer(host[start["esc_count"]:start["esc_pos"]], np.uint16)
    two = np.nonzero(counts >= 2)[0]
    for chunk in (two[0], two[-1]):  # a warp's first chunk, and one taken from the queue
        before = int(counts[:chunk].sum())
        bad = blob.copy()
        pos = start["esc_pos"] + 2 * (before + 1)
        bad[pos:pos + 2] = bad[pos - 2:pos]  # a position repeated: not increasing
        with pytest.raises(kvzip.FormatError, match="position"):
            kvzip.decompress(bad)
        with pytest.raises(kvzip.FormatError, match="blob 1"):
            kvzip.decompress_many([blob, bad, blob])
        np.testing.assert_array_equal(bits_of(kvzip.decompress(blob)), bits)


def _decoder_split(program):
    """(units, split_at, part_shift) of a decode program's kvz_decode launch."""
    (args,) = [op[4] for op in program.shape.ops if op[0] in ("launch", "dependent") and len(op[4]) == 10]
    return int(args[2]), int(args[8]), int(args[9])


@pytest.mark.parametrize("shift", [1, 2, 3])
@pytest.mark.parametrize("chunk", [4096, 8192])
def test_decoder_tail_parts_match_input(shift, chunk, request):
    """kvz_decode deals its last chunks as 2^shift parts each (Tuning.split_shift): each part
    decodes its share of the chunk's steps and skips the escapes before them.  Real values, a
    tail of escape-heavy chunks (more than 32 escapes a part: several loads of them to skip) and
    plane-coded ones, in one tensor and in a batch whose parts span its tensors, decode to the
    input; broken escapes in a part still raise."""
    from kvzip.gpu import graphs

    tuned = tuning.override(formats=("bf16",), split_shift=shift)  # programs rebuilt, on exit too
    tuned.__enter__()
    request.addfinalizer(lambda: tuned.__exit__(None, None, None))
    n = 4096 * chunk  # 4096 chunks: more than the decoder's warps (3168 on an H200)
    bits = real_bf16(n)
    bits[-1024 * chunk::10] = 200 << 7  # an exponent far outside the codebook, in the last quarter
    bits[-256 * chunk::3] = 201 << 7  # a third of the values: plane-coded chunks
    pipe = pipeline(chunk)
    blob = pipe.encode(cupy.asarray(bits), dtype="bf16")
    np.testing.assert_array_equal(bits_of(pipe.decode(blob)), bits)
    # the program that decoded it (another may be one on a layout guessed from an earlier test's)
    chunks = n // chunk
    splits = [_decoder_split(e) for e in graphs.entries() if isinstance(e, programs._DecodeProgram)]
    (split_at,) = {at for units, at, got in splits if got == shift and 0 < at < chunks
                   and units == at + ((chunks - at) << shift)}
    parts = [cupy.asarray(bits[i * (n // 4):(i + 1) * (n // 4)]) for i in range(4)]
    blobs = pipe.encode_many(parts, dtype="bf16")
    for got, x in zip(pipe.decode_many(blobs), parts):
        np.testing.assert_array_equal(bits_of(got), x.get())
    # a repeated escape position in the last listed chunk with escapes (dealt in parts): found by
    # the scan on real values, by the part's decoder on escape-heavy ones (the scan defers them)
    from kvzip import container
    from kvzip.backends import get_backend

    for values in (real_bf16(n), bits):
        blob = pipe.encode(cupy.asarray(values), dtype="bf16")
        host = blob.get()
        hdr = container.parse_header(container.read_head(get_backend("cpu"), host), host.shape[0])
        start = {name: hdr.header_len + off for name, _, off, _ in hdr.streams}
        counts = np.frombuffer(host[start["esc_count"]:start["esc_pos"]], np.uint16).astype(np.int64)
        listed = np.where(counts == 0xFFFF, 0, counts)  # plane-coded chunks list none
        last = int(np.nonzero((counts >= 2) & (counts != 0xFFFF))[0][-1])
        assert last >= split_at
        bad = blob.copy()
        pos = start["esc_pos"] + 2 * (int(listed[:last].sum()) + 1)
        bad[pos:pos + 2] = bad[pos - 2:pos]
        with pytest.raises(kvzip.FormatError, match="position"):
            pipe.decode(bad)
        np.testing.assert_array_equal(bits_of(pipe.decode(blob)), values)
    graphs.release()
