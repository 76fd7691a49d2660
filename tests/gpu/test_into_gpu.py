"""compress_into / decompress_into on a GPU (tests/test_into.py is the CPU side and the argument
checks): blobs byte for byte the CPU reference's, sizes and statuses in device memory, calls
captured in CUDA graphs (global capture mode, in which any host synchronisation or allocation on
the capturing thread fails the capture) and replayed on new values, no allocation once a shape
has its program, and the statuses of blobs that are not the expected layout."""
import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

import kvzip
from kvzip import container
from kvzip import testing as kt
from kvzip.data import load_sample
from kvzip.gpu import into as gpu_into
from kvzip.gpu import programs


def same_bits(a, b, msg=""):
    """Raw bit arrays (NumPy) equal element for element."""
    np.testing.assert_array_equal(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1), msg)


def real_bf16(n, roll=0):
    sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample().values()])
    return np.roll(np.resize(sample, n), roll)


def cpu_blob(bits, fmt="bf16", **kw):
    return bytes(kvzip.compress(bits, dtype=fmt, backend="cpu", **kw))


def into_blob(x, fmt="bf16", **kw):
    """(blob bytes, size) of compress_into of device array x."""
    dst = cupy.zeros(kvzip.compress_bound(x, dtype=fmt, **kw), np.uint8)
    size = cupy.zeros(1, np.int64)
    kvzip.compress_into(x, dst, size, dtype=fmt, **kw)
    n = int(size.get()[0])
    return cupy.asnumpy(dst[:n]).tobytes(), n


def assert_into_blob(got: bytes, bits, fmt="bf16", **kw):
    """got (compress_into's blob of bits) is the CPU reference's blob, or where that stores the
    values raw (compress_into never does), a blob of the same values."""
    want = cpu_blob(bits, fmt, **kw)
    if container.parse_header(want[:4096], len(want)).flags & container.FLAG_STORED:
        back = kvzip.decompress(np.frombuffer(got, np.uint8), backend="cpu")
        same_bits(np.asarray(back).view(bits.dtype), bits)
    else:
        assert got == want


@pytest.mark.parametrize("n", [1, 7, 4096, 4097, 65536 + 5, 1 << 20])
@pytest.mark.parametrize("variant", ["as-is", "layer-scaled", "chan-scaled", "zeros-5%"])
def test_compress_into_is_the_cpu_blob(n, variant):
    bits = real_bf16(n, n)
    if n % 64 == 0:
        bits = kt.kv_variant(bits.reshape(-1, 64), variant, layer=5).reshape(-1)
    got, size = into_blob(cupy.asarray(bits))
    assert_into_blob(got, bits)
    assert size == len(got)


@pytest.mark.parametrize("fmt", ["fp16", "e5m2", "e4m3"])
def test_compress_into_other_formats(fmt):
    bits = kt.kv_like_bits(fmt, 50_000, escape_rate=0.01, seed=4)
    got, _ = into_blob(cupy.asarray(bits), fmt)
    assert_into_blob(got, bits, fmt)


def test_compress_into_auto_codebook_is_the_cpu_blob():
    bits = kt.kv_variant(real_bf16(1 << 18).reshape(-1, 64), "layer-scaled", layer=6).reshape(-1)
    got, _ = into_blob(cupy.asarray(bits), codebook="auto")
    assert got == cpu_blob(bits, codebook="auto")


def test_incompressible_values_give_a_blob_within_the_bound_that_decodes():
    bits = np.random.default_rng(0).integers(0, 1 << 16, 100_000, dtype=np.uint16)
    got, size = into_blob(cupy.asarray(bits))
    assert len(cpu_blob(bits)) < size <= kvzip.compress_bound(((100_000,), "bfloat16"))
    same_bits(cupy.asnumpy(kvzip.decompress(cupy.asarray(np.frombuffer(got, np.uint8)))).view(np.uint16),
                         bits)
    out = cupy.empty(bits.shape, np.uint16)
    status = cupy.full(1, -1, np.int64)
    buffer = cupy.zeros(size + 4096, np.uint8)  # a buffer longer than the blob, as compress_into's dst
    buffer[:size] = cupy.asarray(np.frombuffer(got, np.uint8))
    kvzip.decompress_into(buffer, out, status, dtype="bf16")
    assert int(status.get()[0]) == 0
    same_bits(cupy.asnumpy(out), bits)


@pytest.mark.parametrize("n", [4097, 65536 + 5, 1 << 20])
def test_decompress_into_with_status_decodes_compress_blobs(n):
    bits = real_bf16(n, 1)
    blob = kvzip.compress(cupy.asarray(bits), dtype="bf16")
    out = cupy.zeros(n, np.uint16)
    status = cupy.full(1, -1, np.int64)
    kvzip.decompress_into(blob, out, status, dtype="bf16")
    assert int(status.get()[0]) == 0
    same_bits(cupy.asnumpy(out), bits)


def test_statuses_of_blobs_not_of_the_layout():
    bits = real_bf16(1 << 16)
    x = cupy.asarray(bits)
    blob = kvzip.compress(x, dtype="bf16")
    out = cupy.zeros(bits.shape, np.uint16)
    status = cupy.zeros(1, np.int64)

    def status_of(b):
        status[...] = -1
        kvzip.decompress_into(b, out, status, dtype="bf16")
        return int(status.get()[0])

    assert status_of(blob) == 0
    bad = blob.copy()
    bad[20] ^= 1  # the header's CRC no longer holds
    assert status_of(bad) == programs.GUESS_MISSED
    other = kvzip.compress(cupy.asarray(bits[::-1].copy()).reshape(256, 256), dtype="bf16")  # another shape
    assert status_of(kvzip.compress(x, None, dtype="bf16")) == programs.GUESS_MISSED  # the shipped codebook
    assert status_of(other) == programs.GUESS_MISSED
    raw = kvzip.compress(cupy.asarray(np.random.default_rng(1).integers(0, 1 << 16, 1 << 16, dtype=np.uint16)),
                         dtype="bf16")
    assert status_of(raw) == programs.GUESS_MISSED  # stored raw
    assert status_of(blob[:64]) == programs.GUESS_MISSED  # shorter than any blob of the layout: no kernel runs
    assert "expected layout" in kvzip.status_text(programs.GUESS_MISSED)
    # Without status_out the host looks: the raw blob decodes the checked way, a bad one raises.
    kvzip.decompress_into(raw, out, dtype="bf16")
    same_bits(cupy.asnumpy(out), cupy.asnumpy(kvzip.decompress(raw)).view(np.uint16).reshape(-1))
    with pytest.raises(kvzip.FormatError):
        kvzip.decompress_into(bad, out, dtype="bf16")
    with pytest.raises(ValueError, match="shape"):
        kvzip.decompress_into(other, out, dtype="bf16")


def test_escape_corruption_is_a_status():
    bits = kt.kv_variant(real_bf16(1 << 16).reshape(-1, 64), "chan-scaled").reshape(-1)
    blob, size = into_blob(cupy.asarray(bits))
    u8 = np.frombuffer(blob, np.uint8).copy()
    hdr = container.parse_header(u8[:4096].tobytes(), size)
    pos = next(s for s in hdr.streams if s[0] == "esc_pos")
    assert pos[3] >= 4
    u8[hdr.header_len + pos[2]:hdr.header_len + pos[2] + 2] = 0xFF  # an escape position outside its chunk
    out = cupy.empty(bits.shape, np.uint16)
    status = cupy.full(1, -1, np.int64)
    kvzip.decompress_into(cupy.asarray(u8), out, status, dtype="bf16")
    code = int(status.get()[0])
    assert code not in (0, programs.GUESS_MISSED)
    with pytest.raises(kvzip.FormatError):
        kvzip.decompress(cupy.asarray(u8))


def captured(fn, stream):
    """fn() captured on stream in global mode: a host synchronisation or an allocation on this
    thread inside it fails the capture."""
    with stream:
        stream.begin_capture(cupy.cuda.runtime.streamCaptureModeGlobal)
        try:
            fn()
        finally:
            graph = stream.end_capture()
    return graph


@pytest.mark.parametrize("warm", [True, False])
def test_a_captured_round_trip_replays_on_new_values(warm):
    """Captured once (after a warm-up call on another stream, or as the shape's first calls),
    replayed on each KV variant written into the same input."""
    n = 1 << 20
    x = cupy.asarray(real_bf16(n))
    dst = cupy.zeros(kvzip.compress_bound(x, dtype="bf16"), np.uint8)
    size, status = cupy.zeros(1, np.int64), cupy.full(1, -1, np.int64)
    out = cupy.zeros(n, np.uint16)
    gpu_into.release()
    if warm:
        kvzip.compress_into(x, dst, size, dtype="bf16")
        kvzip.decompress_into(dst, out, status, dtype="bf16")
        cupy.cuda.get_current_stream().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    graph = captured(lambda: (kvzip.compress_into(x, dst, size, dtype="bf16"),
                              kvzip.decompress_into(dst, out, status, dtype="bf16")), stream)
    for variant, layer in (("as-is", 0), ("layer-scaled", 3), ("chan-scaled", 0), ("zeros-5%", 0)):
        bits = kt.kv_variant(real_bf16(n, 7 * layer).reshape(-1, 64), variant, layer=layer).reshape(-1)
        x.set(bits)
        status.fill(-1)
        out.fill(0)
        graph.launch(stream)
        stream.synchronize()
        got = int(size.get()[0])
        assert cupy.asnumpy(dst[:got]).tobytes() == cpu_blob(bits), variant
        assert int(status.get()[0]) == 0, variant
        same_bits(cupy.asnumpy(out), bits, variant)


def test_sixty_four_calls_in_one_graph():
    n, k = 1 << 22, 64
    xs = [cupy.asarray(real_bf16(n, 1000 * i)) for i in range(k)]
    bound = kvzip.compress_bound(xs[0], dtype="bf16")
    dst = cupy.zeros(k * bound, np.uint8)
    sizes = cupy.zeros(k, np.int64)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        kvzip.compress_into(xs[0], dst[:bound], sizes[:1], dtype="bf16")  # builds the shape's program

    def body():
        for i, x in enumerate(xs):
            kvzip.compress_into(x, dst[i * bound:(i + 1) * bound], sizes[i:i + 1], dtype="bf16")

    graph = captured(body, stream)
    graph.launch(stream)
    stream.synchronize()
    got = sizes.get()
    for i in (0, 17, 63):
        assert cupy.asnumpy(dst[i * bound:i * bound + got[i]]).tobytes() == cpu_blob(cupy.asnumpy(xs[i]))


def test_calls_on_forked_streams_in_one_graph():
    """Captured on four streams forked from the capturing one: each stream has its own program,
    so the branches may overlap; every blob and decode is right."""
    n, k = 1 << 20, 16
    xs = [cupy.asarray(real_bf16(n, 333 * i)) for i in range(k)]
    bound = kvzip.compress_bound(xs[0], dtype="bf16")
    dst, sizes = cupy.zeros(k * bound, np.uint8), cupy.zeros(k, np.int64)
    outs, status = cupy.zeros((k, n), np.uint16), cupy.full(k, -1, np.int64)
    stream = cupy.cuda.Stream(non_blocking=True)
    branches = [cupy.cuda.Stream(non_blocking=True) for _ in range(4)]
    fork, joins = cupy.cuda.Event(), [cupy.cuda.Event() for _ in branches]

    def body():
        fork.record(stream)
        for j, (branch, join) in enumerate(zip(branches, joins)):
            branch.wait_event(fork)
            with branch:
                for i in range(j, k, 4):
                    kvzip.compress_into(xs[i], dst[i * bound:(i + 1) * bound], sizes[i:i + 1], dtype="bf16")
                    kvzip.decompress_into(dst[i * bound:(i + 1) * bound], outs[i], status[i:i + 1], dtype="bf16")
            join.record(branch)
            stream.wait_event(join)

    graph = captured(body, stream)
    graph.launch(stream)
    stream.synchronize()
    got = sizes.get()
    assert (status.get() == 0).all()
    for i in range(k):
        assert cupy.asnumpy(dst[i * bound:i * bound + got[i]]).tobytes() == cpu_blob(cupy.asnumpy(xs[i]))
        same_bits(cupy.asnumpy(outs[i]), cupy.asnumpy(xs[i]))


def test_eager_calls_repeat_their_graph_and_follow_new_addresses():
    """Outside a capture a call runs as a graph kept for its addresses: the same buffers again
    reuse it, other buffers get their own; both give the right bytes."""
    x = cupy.asarray(real_bf16(1 << 18))
    bound = kvzip.compress_bound(x, dtype="bf16")
    a, b = cupy.zeros(bound, np.uint8), cupy.zeros(bound, np.uint8)
    size = cupy.zeros(1, np.int64)
    want = cpu_blob(cupy.asnumpy(x))
    for dst in (a, a, b, a):
        dst.fill(0)
        kvzip.compress_into(x, dst, size, dtype="bf16")
        assert cupy.asnumpy(dst[:int(size.get()[0])]).tobytes() == want
    program = next(p for p in gpu_into._programs.values() if isinstance(p, gpu_into._IntoEncode)
                   and p.program.plans[0].n == x.shape[0])
    assert len(program.graphs) >= 2


def test_no_allocation_once_the_shape_has_its_program():
    x = cupy.asarray(real_bf16(1 << 20))
    dst = cupy.zeros(kvzip.compress_bound(x, dtype="bf16"), np.uint8)
    size, status = cupy.zeros(1, np.int64), cupy.zeros(1, np.int64)
    out = cupy.zeros(1 << 20, np.uint16)
    kvzip.compress_into(x, dst, size, dtype="bf16")
    kvzip.decompress_into(dst, out, status, dtype="bf16")
    cupy.cuda.get_current_stream().synchronize()
    pool, pinned = cupy.get_default_memory_pool(), cupy.get_default_pinned_memory_pool()
    before = (pool.used_bytes(), pool.total_bytes(), pinned.n_free_blocks())
    for _ in range(3):
        kvzip.compress_into(x, dst, size, dtype="bf16")
        kvzip.decompress_into(dst, out, status, dtype="bf16")
    cupy.cuda.get_current_stream().synchronize()
    assert (pool.used_bytes(), pool.total_bytes(), pinned.n_free_blocks()) == before
    assert int(status.get()[0]) == 0


def test_bad_device_arguments_raise_before_any_kernel():
    x = cupy.asarray(real_bf16(1 << 16))
    need = kvzip.compress_bound(x, dtype="bf16")
    dst, size = cupy.zeros(need + 16, np.uint8), cupy.zeros(1, np.int64)
    big = cupy.zeros(2 * need, np.uint8)
    cases = [
        (lambda: kvzip.compress_into(x, dst[:need - 1], size, dtype="bf16"), "holds"),
        (lambda: kvzip.compress_into(x, dst[1:], size, dtype="bf16"), "multiple of 16"),
        (lambda: kvzip.compress_into(x, dst, cupy.zeros(1, np.int32), dtype="bf16"), "int64"),
        (lambda: kvzip.compress_into(x, dst, np.zeros(1, np.int64), dtype="bf16"), "one device"),
        (lambda: kvzip.compress_into(x[::2], dst, size, dtype="bf16"), "contiguous"),
        (lambda: kvzip.compress_into(big[:x.nbytes].view(np.uint16), big, size, dtype="bf16"), "overlap"),
        (lambda: kvzip.decompress_into(dst, x, cupy.zeros(1, np.int32), dtype="bf16"), "int64"),
    ]
    dst.fill(7)
    for call, words in cases:
        with pytest.raises((ValueError, TypeError), match=words):
            call()
    assert int(dst.max().get()) == 7 and int(dst.min().get()) == 7  # nothing was written


def test_torch_tensors():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    bits = real_bf16(1 << 18)
    x = torch.from_numpy(bits.view(np.int16)).cuda().view(torch.bfloat16)
    dst = torch.zeros(kvzip.compress_bound(x), dtype=torch.uint8, device="cuda")
    size = torch.zeros(1, dtype=torch.int64, device="cuda")
    kvzip.compress_into(x, dst, size)
    n = int(size.item())
    assert dst[:n].cpu().numpy().tobytes() == cpu_blob(bits)
    out = torch.empty_like(x)
    status = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    kvzip.decompress_into(dst, out, status)
    assert int(status.item()) == 0 and torch.equal(out.view(torch.int16), x.view(torch.int16))


@pytest.mark.parametrize("codebook", [None, "auto"])
@pytest.mark.parametrize("how", ["eager", "graph", "forked"])
def test_many_tensors_in_a_graph_and_on_forked_streams(codebook, how):
    """bench_into's pattern: k different tensors compress_into'd, then decompress_into'd, one call
    each, eagerly, as one graph on one stream, and as one graph forked over four streams (each
    its own workspace): every blob is compress_many's, every status 0, every tensor back."""
    k, n, ways = 16, 1 << 20, 4
    x = cupy.asarray(real_bf16(k * n, 3))
    parts = [x[i * n:(i + 1) * n] for i in range(k)]
    bound = kvzip.compress_bound(parts[0], codebook, dtype="bf16")
    dst, sizes = cupy.zeros(k * bound, np.uint8), cupy.zeros(k, np.int64)
    outs, status = cupy.zeros((k, n), np.uint16), cupy.full(k, -1, np.int64)
    stream = cupy.cuda.Stream(non_blocking=True)
    branches = [cupy.cuda.Stream(non_blocking=True) for _ in range(ways)]

    def enc(i):
        kvzip.compress_into(parts[i], dst[i * bound:(i + 1) * bound], sizes[i:i + 1], codebook, dtype="bf16")

    def dec(i):
        kvzip.decompress_into(dst[i * bound:(i + 1) * bound], outs[i], status[i:i + 1], codebook, dtype="bf16")

    def issue(call):
        if how != "forked":
            for i in range(k):
                call(i)
            return
        fork = cupy.cuda.Event()
        fork.record(stream)
        for j, branch in enumerate(branches):
            branch.wait_event(fork)
            with branch:
                for i in range(j, k, ways):
                    call(i)
            join = cupy.cuda.Event()
            join.record(branch)
            stream.wait_event(join)

    def run(call):
        with stream:
            if how == "eager":
                issue(call)
            else:
                stream.begin_capture(cupy.cuda.runtime.streamCaptureModeGlobal)
                try:
                    issue(call)
                finally:
                    graph = stream.end_capture()
                graph.launch(stream)
        stream.synchronize()

    run(enc)
    want = [bytes(b.get()) for b in kvzip.compress_many(parts, codebook, dtype="bf16")]
    got = [bytes(dst[i * bound:i * bound + int(s)].get()) for i, s in enumerate(sizes.get())]
    assert [len(g) for g in got] == [len(w) for w in want]
    assert got == want
    run(dec)
    assert status.get().tolist() == [0] * k
    for i in range(k):
        same_bits(cupy.asnumpy(outs[i]), cupy.asnumpy(parts[i]), f"tensor {i}")
