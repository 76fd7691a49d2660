"""QuantizeFP8's fast GPU path (kvzip/gpu/quantize_kernels.py: tables built from fp8_bits' logic, then
lookups) against the CPU twin, byte for byte, on the device machine (skipped without a GPU):
every 16-bit pattern, scales spanning the whole exponent range, ragged lengths, misaligned
input (which takes the Numba kernels), hostile scales on decode."""
import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

import kvzip
from kvzip import execution
from kvzip import stages as S
from kvzip.gpu.executor import ShapeEncoder
from kvzip.backends import get_backend
from kvzip.data import load_sample
from kvzip.formats import FORMATS
from kvzip.frame import Frame
from kvzip.gpu import layout_cache, quantize_kernels
from kvzip.stages.quantize_fp8 import QuantizeFP8

CPU, GPU = get_backend("cpu"), get_backend("cuda")
PAIRS = [(src, fp8) for src in ("bf16", "fp16") for fp8 in ("e5m2", "e4m3")]
rng = np.random.default_rng(7)


def frame(backend, bits, fmt, **streams):
    meta = {"dtype": FORMATS[fmt].dtype_name, "shape": [bits.size], "n": bits.size, "format": fmt}
    return Frame(backend, {"data": backend.from_numpy(bits), **streams}, meta)


def assert_same_both_ways(src, fp8, bits, expect_fast=True):
    """Encode and decode on the CPU and the GPU; every stream byte-identical."""
    stage = QuantizeFP8(fp8)
    gpu_in = frame(GPU, bits, src)
    assert quantize_kernels.usable(GPU, src, fp8, "tensor", gpu_in.streams["data"]) == expect_fast
    cpu, gpu = stage.encode(frame(CPU, bits, src)), stage.encode(gpu_in)
    for name in ("data", "scales"):
        assert cpu.streams[name].tobytes() == GPU.to_numpy(gpu.streams[name]).tobytes(), name
    a, b = stage.decode(cpu).streams["data"], GPU.to_numpy(stage.decode(gpu).streams["data"])
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("src,fp8", PAIRS)
def test_every_16bit_pattern_matches_cpu(src, fp8):
    # NaNs, infinities and subnormals included; the amax is the largest finite magnitude.
    assert_same_both_ways(src, fp8, rng.permutation(np.arange(1 << 16, dtype=np.uint16)))


@pytest.mark.parametrize("src,fp8", PAIRS)
@pytest.mark.parametrize("top_exponent", [0, 1, 3, 9, 15, 20, 30, 127, 200, 254])
def test_scales_across_the_exponent_range_match_cpu(src, fp8, top_exponent):
    # Values with biased exponents up to top_exponent (clipped to the source's range), so the
    # scale walks from the 2^-126 clamp to huge; rounding ties and subnormal codes are hit.
    f = FORMATS[src]
    top = min(top_exponent, (1 << f.exp_bits) - 2)
    exps = rng.integers(0, top + 1, 100_003).astype(np.uint16)
    bits = (rng.integers(0, 2, exps.size).astype(np.uint16) << 15) | (exps << f.mant_bits) | \
        rng.integers(0, 1 << f.mant_bits, exps.size).astype(np.uint16)
    assert_same_both_ways(src, fp8, bits)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 15, 17, 4095, 1 << 20])
def test_ragged_lengths_match_cpu(n):
    assert_same_both_ways("bf16", "e5m2", rng.integers(0, 1 << 16, n, dtype=np.uint64).astype(np.uint16))


def test_misaligned_input_takes_the_numba_kernels_and_matches_cpu():
    bits = rng.integers(0, 1 << 16, 5001, dtype=np.uint64).astype(np.uint16)
    stage = QuantizeFP8("e5m2")
    gpu_in = frame(GPU, bits, "bf16")
    gpu_in.streams["data"] = cupy.asarray(np.concatenate([np.zeros(1, np.uint16), bits]))[1:]  # 2 bytes off alignment
    assert not quantize_kernels.usable(GPU, "bf16", "e5m2", "tensor", gpu_in.streams["data"])
    cpu, gpu = stage.encode(frame(CPU, bits, "bf16")), stage.encode(gpu_in)
    assert cpu.streams["data"].tobytes() == GPU.to_numpy(gpu.streams["data"]).tobytes()


@pytest.mark.parametrize("src,fp8", PAIRS)
@pytest.mark.parametrize("scale", [np.nan, np.inf, -np.inf, 0.0, -2.5, 1e-45, 2.0 ** -126, 3e38, 1.0, 0.0173])
def test_decode_of_every_code_under_hostile_scales_matches_cpu(src, fp8, scale):
    codes = np.tile(np.arange(256, dtype=np.uint8), 3)
    outs = []
    for backend in (CPU, GPU):
        scales = backend.from_numpy(np.array([scale], np.float32))
        f = Frame(backend, {"data": backend.from_numpy(codes), "scales": scales},
                  {"dtype": FORMATS[src].dtype_name, "shape": [codes.size], "n": codes.size, "format": fp8,
                   "quantize_fp8": {"source_format": src}})
        outs.append(backend.to_numpy(QuantizeFP8(fp8).decode(f).streams["data"]))
    assert outs[0].tobytes() == outs[1].tobytes()


def test_fast_path_off_uses_numba_and_agrees(monkeypatch):
    bits = rng.integers(0, 1 << 16, 10_000, dtype=np.uint64).astype(np.uint16)
    fast = QuantizeFP8("e4m3").encode(frame(GPU, bits, "bf16"))
    monkeypatch.setattr(quantize_kernels, "ENABLED", False)
    slow = QuantizeFP8("e4m3").encode(frame(GPU, bits, "bf16"))
    for name in ("data", "scales"):
        assert GPU.to_numpy(fast.streams[name]).tobytes() == GPU.to_numpy(slow.streams[name]).tobytes()


def real_kv_bf16(n, part):
    """Part `part` of the shipped real KV (BF16 bits), n values: compressible, as stored-raw blobs
    would take the general path."""
    sample = np.concatenate([v.view(np.uint16).ravel() for v in load_sample("prose").values()])
    return sample[part * n:(part + 1) * n].copy()


@pytest.mark.parametrize("fast", [True, False])
def test_quantized_blobs_decode_through_remembered_layouts(fast, monkeypatch):
    """After one decode of a QuantizeFP8 (per tensor) pipeline's blob, blobs of its layout skip the
    header checks (kvzip/gpu/layout_cache.py) and still decode to what the CPU gives, singly and
    in a batch: dequantized by kvz_decode as it stores, or (fast path off) by the Numba kernel."""
    monkeypatch.setattr(quantize_kernels, "ENABLED", fast)
    calls = []  # per blob decoded through a remembered layout: "fused" into kvz_decode, or "stage"
    stage_decode, decode_jobs = layout_cache._dequantized, layout_cache.programs.decode_jobs
    run_one = layout_cache.GuessedDecode.run

    def spy_jobs(*a, dequantize=False, **k):
        calls.extend(["fused"] * a[3].shape[0] if dequantize else [])
        return decode_jobs(*a, dequantize=dequantize, **k)

    def spy_one(self, *a):  # decompress's single blobs (their first call and repeats)
        calls.extend(["fused"] if self.scale_at is not None else [])
        return run_one(self, *a)

    monkeypatch.setattr(layout_cache, "_dequantized", lambda *a: calls.append("stage") or stage_decode(*a))
    monkeypatch.setattr(layout_cache.programs, "decode_jobs", spy_jobs)
    monkeypatch.setattr(layout_cache.GuessedDecode, "run", spy_one)
    via = "fused" if fast else "stage"
    layout_cache.forget()
    pipe = kvzip.Pipeline([QuantizeFP8("e5m2"), S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(), S.Serialize()])
    inputs = [real_kv_bf16(3 * 4101, part) for part in range(3)]  # one shape, other values and scales
    expect = [pipe.decode(pipe.encode(b.reshape(3, -1), dtype="bf16")).reshape(-1).view(np.uint16) for b in inputs]
    blobs = [pipe.encode(cupy.asarray(b).reshape(3, -1), dtype="bf16") for b in inputs]
    # info() decodes as decompress validates: on the host copies, so that it leaves the GPU's
    # remembered layouts and the spies above alone
    assert not any(kvzip.info(b.get())["stored_raw"] for b in blobs)
    got = [pipe.decode(blob) for blob in blobs]
    assert len(layout_cache._layouts) == 1 and calls == [via] * 2  # the first blob took the general path
    got += kvzip.decompress_many(blobs)
    assert calls == [via] * 5
    for g, e in zip(got, expect + expect):
        assert g.shape == (3, 4101)
        np.testing.assert_array_equal(g.reshape(-1).view(np.uint16).get(), e)
    layout_cache.forget()


def with_outliers(bits, rate):
    """bits with a fraction `rate` of values pushed to magnitudes far outside the rest, whose FP8
    exponents then miss the codebook: escapes (3.6 % overfills kvz_encode's per-chunk slot, so
    kvz_scan collects them again from the input; 10 % makes chunks plane-coded)."""
    hit = rng.random(bits.size) < rate
    out = bits.copy()
    out[hit] = (out[hit] & 0x807F) | (rng.integers(60, 75, int(hit.sum())) << 7).astype(np.uint16)
    return out


@pytest.mark.parametrize("src,fp8", PAIRS)
@pytest.mark.parametrize("rate", [0.0, 0.036, 0.10])
@pytest.mark.parametrize("n", [4096 * 37 + 5, 1 << 18])
def test_quantizing_lane_writes_the_general_paths_bytes(src, fp8, rate, n, monkeypatch):
    """Once a QuantizeFP8 (per tensor) pipeline has encoded a shape on the fast path, later tensors
    of the shape take its lane: one program that quantizes as it loads (kvz_encode<..., QT>).
    Its blobs must be the CPU's, byte for byte, escapes redone from the input and plane-coded
    chunks included."""
    bits = with_outliers(real_kv_bf16(n, 0), rate)
    if src == "fp16":  # the same magnitudes' spread in fp16 bits
        bits = (bits.view(np.uint16) & 0x8000) | ((bits & 0x7FFF) >> 3)
    pipe = kvzip.Pipeline([QuantizeFP8(fp8), S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(), S.Serialize()])
    cpu = pipe.encode(bits, dtype=src)
    first = pipe.encode(cupy.asarray(bits), dtype=src)  # general path: registers the lane
    np.testing.assert_array_equal(first.get(), cpu)
    stored = kvzip.info(cpu)["stored_raw"]
    encoder, = [e for e in execution._encoders.values() if e is not None and e.pipe.key == pipe.key and e.shape == (n,) and e.fmt.name == src]
    assert encoder.fmt.name == src and (stored or (encoder.lane is not None and encoder.lane.quantize == src))

    def no_general_path(self, frame):
        raise AssertionError("took the general path")

    if not stored:
        monkeypatch.setattr(ShapeEncoder, "encode_frame", no_general_path)
    for _ in range(2):  # the second run replays the CUDA graph
        again = pipe.encode(cupy.asarray(bits), dtype=src)
        np.testing.assert_array_equal(again.get(), cpu)
    back = pipe.decode(again)
    np.testing.assert_array_equal(back.reshape(-1).view(np.uint16).get(), pipe.decode(cpu).reshape(-1).view(np.uint16))
