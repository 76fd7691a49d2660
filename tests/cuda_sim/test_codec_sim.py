"""The CUDA codec kernels (stages/fused.py) under the Numba CUDA simulator.

    NUMBA_ENABLE_CUDASIM=1 python -m pytest -q tests/cuda_sim

The simulator runs every GPU thread in Python, so inputs stay at a few hundred to a few
thousand values.  Checked: backend="cuda" writes the very bytes backend="cpu" writes (every
format, chunk sizes 8/64/4096, escape-free, listed escapes, plane-coded, stored raw, checksum),
each backend decodes the other's blobs (the shipped codebook, whose escapes these inputs
have, and codebook="auto"), forged blobs raise FormatError on the CUDA backend (its
validation is the kernels' own error flag, separate code from the CPU twin), and the CUDA kernels
really ran (kernel launches counted).
"""
from __future__ import annotations

import os

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 set before Numba is imported", allow_module_level=True)

import collections  # noqa: E402
import json  # noqa: E402
import struct  # noqa: E402

import numpy as np  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import kvzip  # noqa: E402
from kvzip import FormatError, container  # noqa: E402
from kvzip import stages as S  # noqa: E402
from kvzip import testing as kt  # noqa: E402
from kvzip.backends import CUDABackend, get_backend  # noqa: E402
from kvzip.trace import last_path  # noqa: E402
from kvzip.checksum import sum64  # noqa: E402
from kvzip.formats import FORMATS  # noqa: E402

FMTS = list(FORMATS.values())
CUDA_STAGED = kvzip.Pipeline([S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(), S.Serialize()], fuse=False)


@pytest.fixture
def launches(monkeypatch):
    """Names of the CUDA kernels launched during the test."""
    seen = collections.Counter()
    orig = CUDABackend.launch

    def counting(self, kernel, blocks, threads, *args):
        name = getattr(kernel, "__name__", None) or getattr(getattr(kernel, "py_func", None), "__name__", repr(kernel))
        seen[name] += 1
        return orig(self, kernel, blocks, threads, *args)

    monkeypatch.setattr(CUDABackend, "launch", counting)
    return seen


def test_simulator_backend_is_active():
    be = get_backend("cuda")
    assert be.name == "cuda" and be.simulated
    from kvzip.gpu import programs

    assert not programs.applicable(be)  # the CUDA C++ fast path needs a real GPU: Numba kernels here


def data_for(fmt, kind, n, chunk):
    """escape-free / listed / plane: KV-like values; plane puts a chunk of random bits in."""
    if kind == "escape-free":
        return kt.kv_like_bits(fmt, n, seed=n + fmt.width)
    bits = kt.kv_like_bits(fmt, n, escape_rate=0.01, seed=n + fmt.width + 1)
    if kind == "plane":  # random bits in the tail: the chunks there are plane-coded, the rest compress
        span = min(chunk, n // 6)
        rng = np.random.default_rng(chunk)
        bits[n - span:] = rng.integers(0, 1 << fmt.width, span, dtype=np.uint64).astype(fmt.uint_dtype)
    return bits


@pytest.mark.parametrize("fmt", FMTS, ids=[f.name for f in FMTS])
@pytest.mark.parametrize("chunk", [8, 64, 4096])
@pytest.mark.parametrize("kind", ["escape-free", "listed", "plane"])
def test_cuda_bytes_equal_cpu_bytes(fmt, chunk, kind, launches):
    # A plane-coded chunk costs its raw size, so plane coding without the stored-raw fallback
    # needs other chunks that compress: with chunk 4096, more than one chunk.
    n = (5101 if kind == "plane" else 2003) if chunk == 4096 else 1001
    bits = data_for(fmt, kind, n, chunk).reshape(-1, 1) if n % 2 else data_for(fmt, kind, n, chunk)
    checksum = kind == "listed"
    cpu = kvzip.compress(bits, None, dtype=fmt.name, chunk=chunk, checksum=checksum, backend="cpu")
    gpu = kvzip.compress(bits, None, dtype=fmt.name, chunk=chunk, checksum=checksum, backend="cuda")
    np.testing.assert_array_equal(gpu, cpu)
    assert launches["encode_groups"] == 1, dict(launches)  # the CUDA encode kernels ran
    inf = kvzip.info(cpu)
    expect_stored = fmt.name == "e4m3" or (chunk == 8 and fmt.name in ("fp16", "e5m2"))
    assert inf["stored_raw"] == expect_stored, inf
    if kind == "plane" and not expect_stored:
        assert inf["raw_chunks"] > 0, inf
    if kind == "listed" and not expect_stored and fmt.name in ("bf16", "fp32") and chunk > 8:
        assert inf["escapes"] > 0, inf
    # each backend decodes the other's blob
    for blob in (cpu, gpu):
        for backend in ("cuda", "cpu"):
            out = kvzip.decompress(blob, backend=backend)
            np.testing.assert_array_equal(np.asarray(out).view(fmt.uint_dtype), bits)
    if not expect_stored:
        assert launches["decode_groups"] == 2 and launches["patch_escapes"] == 2, dict(launches)


@pytest.mark.parametrize("fmt", FMTS, ids=[f.name for f in FMTS])
def test_cuda_auto_codebook_bytes_equal_cpu_bytes(fmt, launches):
    """codebook="auto" (compress's default; the other tests give None, the shipped codebook whose
    escapes they are about): the Numba kernels write the CPU's bytes and decode them."""
    bits = data_for(fmt, "listed", 1001, 64)
    cpu = kvzip.compress(bits, dtype=fmt.name, chunk=64, backend="cpu")
    gpu = kvzip.compress(bits, dtype=fmt.name, chunk=64, backend="cuda")
    np.testing.assert_array_equal(gpu, cpu)
    assert fmt.name == "e4m3" or kvzip.info(cpu)["pipeline"][1] == {"id": "top16_pack", "codebook": "auto"}
    for backend in ("cuda", "cpu"):
        np.testing.assert_array_equal(np.asarray(kvzip.decompress(gpu, backend=backend)).view(fmt.uint_dtype), bits)


@pytest.mark.parametrize("fmt", FMTS, ids=[f.name for f in FMTS])
def test_cuda_staged_path_matches(fmt):
    """fuse=False on the CUDA backend (array-level stages) also writes the same bytes."""
    bits = data_for(fmt, "plane", 600, 64)
    pipe = kvzip.Pipeline(kvzip.splitzip_pipeline(chunk=64).stages, fuse=False)
    a = pipe.encode(bits, dtype=fmt.name, backend="cuda")
    b = kvzip.compress(bits, None, dtype=fmt.name, chunk=64, backend="cpu")
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(np.asarray(CUDA_STAGED.decode(b, backend="cuda")).view(fmt.uint_dtype), bits)


def test_cuda_fused_path_reported(launches):
    bits = data_for(FORMATS["bf16"], "listed", 1000, 256)
    pipe = kvzip.splitzip_pipeline(chunk=256)
    blob = pipe.encode(bits, dtype="bf16", backend="cuda")
    assert last_path() == "fused"
    out = pipe.decode(blob, backend="cuda")
    assert last_path() == "fused"
    np.testing.assert_array_equal(out.view(np.uint16), bits)
    assert {"encode_groups", "count_escapes", "scatter_escapes", "decode_groups", "patch_escapes"} <= set(launches)


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_cuda_equals_cpu_random(data):
    fmt = data.draw(kt.formats())
    cb = data.draw(st.one_of(st.none(), kt.codebooks(fmt)))
    chunk = data.draw(st.sampled_from([8, 16, 64, 256]))
    bits = data.draw(st.one_of(kt.bit_arrays(fmt, max_size=300), kt.escape_heavy_arrays(fmt, cb, max_size=600),
                               kt.kv_like_arrays(fmt, cb, max_size=600)))
    cpu = kvzip.compress(bits, cb, dtype=fmt.name, chunk=chunk, backend="cpu")
    gpu = kvzip.compress(bits, cb, dtype=fmt.name, chunk=chunk, backend="cuda")
    np.testing.assert_array_equal(gpu, cpu)
    np.testing.assert_array_equal(np.asarray(kvzip.decompress(cpu, backend="cuda")).view(fmt.uint_dtype), bits)


def test_edge_shapes_on_cuda():
    for fmt in FMTS:
        for shape in [(), (0,), (1,), (7,), (3, 0, 5), (9, 1)]:
            n = int(np.prod(shape, dtype=np.int64))
            bits = kt.kv_like_bits(fmt, n, seed=1).reshape(shape)
            for chunk in (8, 4096):
                gpu = kvzip.compress(bits, None, dtype=fmt.name, chunk=chunk, backend="cuda")
                np.testing.assert_array_equal(gpu, kvzip.compress(bits, None, dtype=fmt.name, chunk=chunk, backend="cpu"))
                out = kvzip.decompress(gpu, backend="cuda")
                assert out.shape == shape
                np.testing.assert_array_equal(np.asarray(out).view(fmt.uint_dtype), bits)


def test_stacked_quantize_on_cuda():
    Q = kt.quantize_fp8_available()
    if Q is None:
        pytest.skip("QuantizeFP8 has not landed")
    x = kt.kv_like_bits("bf16", 512, seed=3).reshape(64, 8)
    pipe = kvzip.Pipeline([Q("e5m2", "channel"), S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(64), S.Serialize()])
    a = pipe.encode(x, dtype="bf16", backend="cuda")
    b = pipe.encode(x, dtype="bf16", backend="cpu")
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(kvzip.decompress(a, backend="cuda").view(np.uint16),
                                  kvzip.decompress(a, backend="cpu").view(np.uint16))


# --------------------------------------------------------------------------- forged blobs on CUDA
def unpack(blob: bytes):
    hdr = container.parse_header(blob, len(blob))
    return hdr.meta, hdr.flags, [(n, d, blob[hdr.header_len + o: hdr.header_len + o + nb]) for n, d, o, nb in hdr.streams]


def rebuild(meta, streams, flags=0):
    offsets, plen = container.layout([len(b) for _, _, b in streams])
    payload = bytearray(plen)
    for off, (_, _, b) in zip(offsets, streams):
        payload[off:off + len(b)] = b
    cks = sum64(np, np.frombuffer(bytes(payload), np.uint8)) if flags & container.FLAG_CHECKSUM else 0
    return container.build_header(meta, [(n, d, len(b)) for n, d, b in streams], flags, cks) + bytes(payload)


def put(streams, name, arr):
    return [(n, d, arr.tobytes() if n == name else b) for n, d, b in streams]


def get(streams, name):
    n, d, b = next(s for s in streams if s[0] == name)
    return np.frombuffer(b, container.STREAM_DTYPES[d]).copy()


def _base(fmt="bf16", chunk=64):
    bits = data_for(FORMATS[fmt], "plane", 1000, chunk)
    blob = bytes(kvzip.compress(bits, None, dtype=fmt, chunk=chunk, backend="cpu"))
    inf = kvzip.info(blob)
    assert inf["escapes"] > 0 and inf["raw_chunks"] > 0 and not inf["stored_raw"], inf
    return unpack(blob)


def forgeries():
    out = {}
    for fmt in ("bf16", "e5m2", "fp32"):
        meta, flags, s = _base(fmt)
        counts, pos, exp, high = get(s, "esc_count"), get(s, "esc_pos"), get(s, "esc_exp"), get(s, "exp_high")
        listed = np.where(counts == 0xFFFF, 0, counts)
        c = int(np.flatnonzero(listed > 0)[0])
        k = int((np.cumsum(listed) - listed)[c])
        p = pos.copy(); p[k] = 64  # noqa: E702
        out[f"{fmt} position outside chunk"] = rebuild(meta, put(s, "esc_pos", p), flags)
        p = pos.copy(); p[-1] = 0xFFFF  # noqa: E702
        out[f"{fmt} position 0xFFFF"] = rebuild(meta, put(s, "esc_pos", p), flags)
        cc = counts.copy(); cc[c] += 1  # noqa: E702
        out[f"{fmt} count one too many"] = rebuild(meta, put(s, "esc_count", cc), flags)
        cc = counts.copy(); cc[c] -= 1  # noqa: E702
        out[f"{fmt} count one too few"] = rebuild(meta, put(s, "esc_count", cc), flags)
        cc = counts.copy(); cc[c] = 0xFFFE  # noqa: E702
        out[f"{fmt} count over capacity"] = rebuild(meta, put(s, "esc_count", cc), flags)
        cc = counts.copy(); cc[int(np.flatnonzero(counts == 0)[0])] = 0xFFFF  # noqa: E702
        out[f"{fmt} extra plane chunk"] = rebuild(meta, put(s, "esc_count", cc), flags)
        out[f"{fmt} exp_high short"] = rebuild(meta, put(s, "exp_high", high[:-1]), flags)
        out[f"{fmt} exp_high long"] = rebuild(meta, put(s, "exp_high", np.append(high, np.uint8(0))), flags)
        if listed[c] >= 2:
            p = pos.copy(); p[k + 1] = p[k]  # noqa: E702
            out[f"{fmt} duplicate position"] = rebuild(meta, put(s, "esc_pos", p), flags)
        if FORMATS[fmt].exp_bits < 8:
            e = exp.copy(); e[0] = 40  # noqa: E702
            out[f"{fmt} exponent out of range"] = rebuild(meta, put(s, "esc_exp", e), flags)
        m = json.loads(json.dumps(meta)); m["n"], m["shape"] = 2000, [2000]  # noqa: E702
        out[f"{fmt} n too large"] = rebuild(m, s, flags)
        m = json.loads(json.dumps(meta)); m["codebook"]["exponents"][3] = m["codebook"]["exponents"][4]  # noqa: E702
        out[f"{fmt} duplicate codebook exponent"] = rebuild(m, s, flags)
        out[f"{fmt} codes short"] = rebuild(meta, put(s, "codes", get(s, "codes")[:-1]), flags)
    return out


FORGED = forgeries()


@pytest.mark.parametrize("name", list(FORGED))
def test_forged_blob_raises_on_cuda(name):
    blob = np.frombuffer(FORGED[name], np.uint8).copy()  # writable: see test_read_only_blob_on_simulated_cuda
    for dec in (lambda b: kvzip.decompress(b, backend="cuda"), lambda b: CUDA_STAGED.decode(b, backend="cuda")):
        with pytest.raises(FormatError):
            dec(blob)
    with pytest.raises(FormatError):  # and the CPU agrees
        kvzip.decompress(blob, backend="cpu")


def test_read_only_blob_on_simulated_cuda():
    bits = kt.kv_like_bits("bf16", 100, seed=1)
    blob = bytes(kvzip.compress(bits, None, dtype="bf16", backend="cpu"))
    np.testing.assert_array_equal(kvzip.decompress(blob, backend="cuda").view(np.uint16), bits)


def test_truncated_and_flipped_on_cuda():
    bits = data_for(FORMATS["fp16"], "listed", 800, 64)
    blob = bytes(kvzip.compress(bits, None, dtype="fp16", chunk=64, checksum=True, backend="cuda"))
    H = struct.unpack_from("<I", blob, 12)[0]
    for cut in (0, 47, H - 1, H, len(blob) - 1):
        with pytest.raises(FormatError):
            kvzip.decompress(bytearray(blob[:cut]), backend="cuda")
    rng = np.random.default_rng(0)
    for _ in range(20):
        raw = bytearray(blob)
        i = int(rng.integers(len(raw)))
        raw[i] ^= 1 << int(rng.integers(8))
        with pytest.raises(FormatError):
            kvzip.decompress(raw, backend="cuda")


@pytest.mark.parametrize("variant", ["chan-scaled", "zeros-5%"])
def test_cuda_kernels_match_cpu_on_real_kv_variants(variant):
    """The Numba-CUDA kernels on real KV whose channels are scaled by powers of two (escapes in
    every chunk) or with exact zeros: the CPU's bytes, and the values back."""
    from kvzip.data import load_sample

    t = sorted(load_sample("code").items())[0][1]
    bits = np.ascontiguousarray(kt.kv_variant(np.ascontiguousarray(t).view(np.uint16), variant, layer=1)).ravel()[:6000]
    gpu = kvzip.compress(bits, None, dtype="bf16", chunk=256, backend="cuda")
    np.testing.assert_array_equal(np.asarray(gpu), kvzip.compress(bits, None, dtype="bf16", chunk=256, backend="cpu"))
    np.testing.assert_array_equal(np.asarray(kvzip.decompress(gpu, backend="cuda")).view(np.uint16), bits)


@pytest.mark.parametrize("fmt", ["bf16", "e5m2", "e4m3"])
def test_ratio_mode_on_the_cuda_backend(fmt):
    """mode="ratio" (ChannelPack, no CUDA kernels yet) on backend="cuda": its streams go to the
    host and back, and the blob is the CPU backend's byte for byte; either backend decodes it."""
    bits = kt.kv_like_bits(fmt, 3 * 64 * 40, escape_rate=0.01, seed=5).reshape(3, 40, 64)
    cpu = bytes(kvzip.compress(bits, dtype=fmt, mode="ratio", backend="cpu"))
    gpu = kvzip.compress(bits, dtype=fmt, mode="ratio", backend="cuda")
    assert bytes(np.asarray(gpu)) == cpu
    for backend in ("cpu", "cuda"):
        back = np.asarray(kvzip.decompress(np.frombuffer(cpu, np.uint8), backend=backend))
        np.testing.assert_array_equal(back.reshape(-1).view(bits.dtype), bits.reshape(-1))
