"""The storage mode (ChannelRans, container version 4) on a real GPU: CuPy tensors compress on
the device (kvzip/gpu/kernels/channel_rans.cu) to the CPU reference's bytes, for every format,
edge sizes, chunk sizes and channel counts, real KV and its adversarial variants, random and
wide-exponent bits; GPU blobs and CPU blobs decode on the GPU to the values; forged blobs raise
the CPU path's FormatError with its message; the stage runs no CPU kernel for CuPy input; the
tables are made on the device (kvz_rans_tables), the writer's rule's shift, stream and table
words on the histograms of tests/test_channel_rans_kernels_host.py, with no host rule in an
encode."""
import numpy as np
import pytest

import channel_modes  # CuPy: tests/conftest.py collects tests/gpu only where it sees a GPU
import cupy
from channel_modes import layers

import kvzip
from kvzip import testing as kt
from kvzip.formats import FORMATS


MODE = "storage"


def assert_device_matches(bits, fmt, **kw):
    return channel_modes.assert_device_matches(bits, fmt, MODE, **kw)


@pytest.mark.parametrize("fmt", ["bf16", "e5m2"])
def test_cupy_tensors_give_the_cpu_blob(fmt):
    bits = layers(1)[0] if fmt == "bf16" else kt.kv_like_bits(fmt, 3 * 512 * 64, seed=3).reshape(3, 512, 64)
    assert_device_matches(bits, fmt)


def test_the_stage_runs_the_device_kernels(monkeypatch):
    from kvzip.stages import channel_rans_cpu

    channel_modes.assert_no_cpu_kernel_runs(monkeypatch, channel_rans_cpu, MODE)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("chunk,channels", [(32, 1), (64, 2), (256, 32), (4096, 64), (65536, 128), (1 << 20, 256),
                                            (1024, 256)])
def test_chunks_and_channels(fmt, chunk, channels):
    f = FORMATS[fmt]
    rng = np.random.default_rng(chunk + channels)
    n = int(rng.integers(1, 40)) * channels * 97
    bits = kt.kv_like_bits(f, n, escape_rate=0.02, seed=chunk).reshape(-1, channels)
    assert_device_matches(bits, fmt, chunk=chunk)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_random_and_wide_bits(fmt):
    """Every bit pattern (tables of every exponent, the widest search) and a channel-dependent
    exponent offset over 256 channels (256 tables in shared memory)."""
    f = FORMATS[fmt]
    assert_device_matches(kt._rng_bits(5, f, 5 * 65536 + 3).reshape(-1), fmt)
    bits = kt.kv_like_bits(f, 256 * 4096, escape_rate=0.05, seed=6).reshape(-1, 256).astype(np.uint64)
    E, M = f.exp_bits, f.mant_bits
    e = ((bits >> np.uint64(M)) + np.arange(256, dtype=np.uint64)) & np.uint64((1 << E) - 1)
    mask = np.uint64(((1 << E) - 1) << M)
    assert_device_matches(((bits & ~mask) | (e << np.uint64(M))).astype(f.uint_dtype), fmt)


# ----------------------------------------------------------------------------- the writer's rule
def _device_rule(hist, fmt):
    from kvzip.gpu import channel_rans as gpu

    stream, words, shift, ng, top = gpu.choose_tables(cupy.asarray(hist.astype(np.uint32).reshape(-1)), fmt,
                                                      hist.shape[0])
    return shift, stream.get(), words.get(), ng, top


def test_device_tables_are_the_writers_rule():
    """kvz_rans_tables on the device gives what the host harness checks against the reference:
    the synthetic histograms (ties, empty, one and every exponent, counts near 2**32, 256 x 257)
    and real KV of every format."""
    from test_channel_rans_kernels_host import BY_E, RULE_CASES, real_histograms, reference_rule

    for label, E, hist in RULE_CASES + list(real_histograms()):
        got, want = _device_rule(hist, BY_E[E]), reference_rule(hist, BY_E[E])
        assert got[0] == want[0] and np.array_equal(got[1], want[1]) and np.array_equal(got[2], want[2]), label
        assert got[3:] == want[3:], label


def test_the_encode_runs_no_host_rule(monkeypatch):
    """The writer's rule never runs on the host for a CuPy tensor, and the blob is the CPU's."""
    from kvzip.stages import channel_rans as cr

    bits = layers(1)[0]
    want = channel_modes.cpu_blob(bits, "bf16", MODE)

    def refuse(*a, **k):
        raise AssertionError("the host's writer's rule ran for a CuPy tensor")

    for module, name in ((cr, "choose_shift"), (cr, "group_tables"), (cr, "tables_bytes")):
        monkeypatch.setattr(module, name, refuse)
    assert kvzip.compress(cupy.asarray(bits), dtype="bf16", mode=MODE).get().tobytes() == want


# ----------------------------------------------------------------------------- forged blobs
def forged_blobs():
    """(name, blob) pairs: each count's fields, the states, the words and escapes (lengths and
    contents) and the tables, on a blob of three chunks with escapes."""
    bits = kt.kv_like_bits(FORMATS["bf16"], 3 * 1024 + 64, escape_rate=0.02, seed=9).reshape(-1, 64)
    base = channel_modes.cpu_blob(bits, "bf16", MODE, chunk=1024)
    meta, flags, streams = kt.blob_parts(base)
    parts = {k: np.frombuffer(b, {"uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32}[dt])
             for k, dt, b in streams}

    def with_(name, fn):
        out = [(k, dt, fn(parts[k].copy()).tobytes() if k == name else b) for k, dt, b in streams]
        return kt.build_blob(meta, out, flags)

    def put(k, v):
        def fn(a):
            a[k] = v % (1 << (8 * a.itemsize))
            return a
        return fn

    for name in ("word_count", "esc_count"):
        for c in range(parts[name].size):
            v = int(parts[name][c])
            for new in (v + 1, v - 1, 0, 1025, 2**32 - 1):
                if new % 2**32 != v:
                    yield f"{name}[{c}]={new}", with_(name, put(c, new))
    for k, v in ((0, 0xFFFF), (31, 0x10001), (40, 2**32 - 1), (95, 0)):
        yield f"states[{k}]={v}", with_("states", put(k, v))
    for name in ("words", "esc_exp"):
        yield f"{name} longer", with_(name, lambda a: np.append(a, a[:1] * 0))
        yield f"{name} shorter", with_(name, lambda a: a[:-1])
    for k in (0, 1, parts["words"].size - 1):
        yield f"words[{k}]^", with_("words", lambda a: a.__setitem__(k, a[k] ^ 0x0F0F) or a)
    for k in (0, parts["esc_exp"].size - 1):
        for v in (0, 120, 127, 255):
            yield f"esc_exp[{k}]={v}", with_("esc_exp", put(k, v))
    yield "tables short", with_("tables", lambda a: a[:-1])
    yield "tables frequency", with_("tables", lambda a: a.__setitem__(5, a[5] ^ 0x10) or a)


def test_forged_blobs_fail_as_on_the_cpu():
    channel_modes.assert_forgeries_fail_as_on_the_cpu(forged_blobs())
