"""The threaded CPU kernels (stages/fused_cpu.py): the same bytes, values and errors for any
number of threads as the staged reference (fuse=False) and as one thread."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvzip
from kvzip import cpu_parallel
from kvzip import stages as S
from kvzip import testing as kt
from kvzip.data import load_sample
from kvzip.formats import FORMATS

THREADS = (1, 2, 3)


@pytest.fixture
def tiny_ranges(monkeypatch):
    """Every chunk range worth a thread: small inputs then split over all the threads asked for."""
    monkeypatch.setattr(cpu_parallel, "MIN_BYTES_PER_THREAD", 1)


def pipeline(chunk, fuse=True, checksum=False):
    return kvzip.Pipeline([S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(chunk), S.Serialize(checksum)], fuse=fuse)


def encode_each_way(bits, fmt, chunk):
    """The blob from the staged path and from the fused CPU path at each thread count."""
    staged = np.asarray(pipeline(chunk, fuse=False).encode(bits, dtype=fmt))
    fused = {}
    for t in THREADS:
        with cpu_parallel.threads(t):
            pipe = pipeline(chunk)
            fused[t] = np.asarray(pipe.encode(bits, dtype=fmt))
    return staged, fused


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_threads_write_the_staged_bytes(tiny_ranges, data):
    fmt = data.draw(st.sampled_from(sorted(FORMATS)))
    bits = data.draw(st.one_of(kt.escape_heavy_arrays(fmt, max_size=6000), kt.kv_like_arrays(fmt, max_size=6000)))
    chunk = data.draw(st.sampled_from([8, 64, 256, 1024]))
    staged, fused = encode_each_way(bits, fmt, chunk)
    for t, blob in fused.items():
        np.testing.assert_array_equal(blob, staged, err_msg=f"{t} threads, {fmt}, chunk {chunk}")
        with cpu_parallel.threads(t):
            back = kvzip.decompress(blob)
        np.testing.assert_array_equal(np.asarray(back).view(FORMATS[fmt].uint_dtype).reshape(-1), bits)


def test_threads_on_real_kv(tiny_ranges):
    """The shipped SmolLM2 sample, every kind, with and without the checksum."""
    for kind in ("prose", "code", "html"):
        bits = np.concatenate([v.view(np.uint16).ravel() for v in load_sample(kind).values()])
        staged, fused = encode_each_way(bits, "bf16", 4096)
        for t, blob in fused.items():
            np.testing.assert_array_equal(blob, staged, err_msg=f"{kind}, {t} threads")
            with cpu_parallel.threads(t):
                np.testing.assert_array_equal(np.asarray(kvzip.decompress(blob)).view(np.uint16), bits)
                summed = np.asarray(pipeline(4096, checksum=True).encode(bits, dtype="bf16"))
            np.testing.assert_array_equal(summed, np.asarray(pipeline(4096, fuse=False, checksum=True)
                                                             .encode(bits, dtype="bf16")))


def test_default_threads_split_a_large_input():
    """Without the test's small ranges, a few MiB still split over two threads and agree."""
    bits = kt.kv_like_bits("bf16", 3 << 20, escape_rate=0.002, seed=5)
    with cpu_parallel.threads(1):
        one = np.asarray(kvzip.compress(bits, dtype="bf16"))
    with cpu_parallel.threads(2):
        assert len(cpu_parallel.split(-(-bits.size // 4096), 8192)) == 2
        two = np.asarray(kvzip.compress(bits, dtype="bf16"))
        np.testing.assert_array_equal(np.asarray(kvzip.decompress(two)).view(np.uint16), bits)
    np.testing.assert_array_equal(one, two)


def _corrupt_escape_streams(blob, rng):
    """The blob with a few bytes of esc_count, esc_pos or esc_exp changed (no checksum: the
    decode kernels' own checks must catch it)."""
    from kvzip import container

    hdr = container.parse_header(blob.tobytes(), blob.shape[0])
    spans = {name: (hdr.header_len + off, nb) for name, _, off, nb in hdr.streams if nb}
    name = rng.choice(sorted(k for k in spans if k.startswith("esc_")))
    start, nb = spans[name]
    bad = blob.copy()
    for i in rng.integers(start, start + nb, size=3):
        bad[i] = rng.integers(0, 256)
    return bad


def _outcome(blob):
    try:
        return "ok", np.asarray(kvzip.decompress(blob)).tobytes()
    except kvzip.FormatError as e:
        return "error", str(e)


def test_decode_errors_do_not_depend_on_threads(tiny_ranges):
    """Corrupt escape streams: the same error (the first chunk's, as one thread sees it) or the
    same values at every thread count."""
    rng = np.random.default_rng(11)
    bits = kt.kv_like_bits("bf16", 20000, escape_rate=0.01, seed=3)
    blob = np.asarray(pipeline(256).encode(bits, dtype="bf16"))
    errors = 0
    for _ in range(examples(40)):
        bad = _corrupt_escape_streams(blob, rng)
        outcomes = set()
        for t in THREADS:
            with cpu_parallel.threads(t):
                outcomes.add(_outcome(bad))
        assert len(outcomes) == 1, outcomes
        errors += next(iter(outcomes))[0] == "error"
    assert errors  # the corruption did reach the kernels' checks


def test_checksum_at_any_thread_count(tiny_ranges):
    """sum64 summed over word ranges in threads equals the array formula (the CuPy code path)."""
    from kvzip import checksum

    rng = np.random.default_rng(2)
    for nbytes in (0, 8, 24, 4096, 1 << 16):
        payload = rng.integers(0, 256, nbytes, dtype=np.uint8)
        words = payload.view(np.uint64)
        with np.errstate(over="ignore"):
            terms = checksum.mix(np, words + np.arange(words.shape[0], dtype=np.uint64) * checksum.GOLDEN)
            want = int(checksum.mix(np, np.asarray([int(terms.sum(dtype=np.uint64)) ^ nbytes], np.uint64))[0])
        for t in THREADS:
            with cpu_parallel.threads(t):
                assert checksum.sum64(np, payload) == want


def test_thread_count_arguments():
    with pytest.raises(ValueError):
        cpu_parallel.set_threads(0)
    with pytest.raises(ValueError):
        with cpu_parallel.threads(True):
            pass
    cpu_parallel.set_threads(3)
    try:
        assert cpu_parallel.get_threads() == 3
        with cpu_parallel.threads(1):
            assert cpu_parallel.get_threads() == 1
        assert cpu_parallel.get_threads() == 3
    finally:
        cpu_parallel.set_threads(None)
    assert cpu_parallel.get_threads() == cpu_parallel.available_cores()


def test_calls_from_many_threads_at_once(tiny_ranges):
    """Callers in several threads, each with its own thread count (the pool grows meanwhile):
    every one gets the reference bytes."""
    from concurrent.futures import ThreadPoolExecutor

    bits = kt.kv_like_bits("bf16", 40000, escape_rate=0.003, seed=9)
    want = np.asarray(pipeline(512, fuse=False).encode(bits, dtype="bf16"))

    def work(t):
        with cpu_parallel.threads(t):
            blob = np.asarray(pipeline(512).encode(bits, dtype="bf16"))
            back = np.asarray(kvzip.decompress(blob)).view(np.uint16)
        return np.array_equal(blob, want) and np.array_equal(back, bits)

    with ThreadPoolExecutor(6) as pool:
        assert all(pool.map(work, [1, 2, 3, 4, 5, 6] * 3))
