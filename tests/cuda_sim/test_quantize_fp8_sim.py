"""QuantizeFP8 on the CUDA backend under the Numba CUDA simulator: the kernels must give the
very bytes the CPU twin gives.

Run in its own process with the simulator switched on before Numba is imported:
    NUMBA_ENABLE_CUDASIM=1 python -m pytest tests/cuda_sim/test_quantize_fp8_sim.py
Inputs stay at a few hundred values: the simulator runs every thread in Python.
"""
from __future__ import annotations

import os

import pytest

if os.environ.get("NUMBA_ENABLE_CUDASIM") != "1":
    pytest.skip("needs NUMBA_ENABLE_CUDASIM=1 set before Numba is imported", allow_module_level=True)

import math  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

from kvzip.backends import get_backend  # noqa: E402
from kvzip.formats import FORMATS  # noqa: E402
from kvzip.frame import Frame  # noqa: E402
from kvzip.stages import quantize_fp8  # noqa: E402
from kvzip.stages.quantize_fp8 import QuantizeFP8  # noqa: E402

CPU, GPU = get_backend("cpu"), get_backend("cuda")
FMAX = {"e5m2": 57344.0, "e4m3": 448.0}
VALUE_DTYPE = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp32": np.float32}
CASES = [(src, fp8, g) for src in ("bf16", "fp16", "fp32") for fp8 in ("e5m2", "e4m3") for g in ("tensor", "channel")]
SHAPE = [37, 8]  # 296 values, 8 channels; 37 rows so the grid has a ragged last block


def frame(backend, bits, fmt, shape, **streams):
    f = FORMATS[fmt]
    meta = {"dtype": f.dtype_name, "shape": list(shape), "n": bits.size, "format": fmt}
    return Frame(backend, {"data": backend.from_numpy(bits), **streams}, meta)


def specials(src, large=True):
    vals = [np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-45, -1e-40, 6e-8, 1e-5] + [65504.0, 3e38] * large
    with np.errstate(over="ignore"):
        return np.array(vals, np.float32).astype(VALUE_DTYPE[src]).view(FORMATS[src].uint_dtype)


def random_bits(src, fp8, seed, shape=SHAPE):
    """Random bit patterns (every exponent, NaN payloads, subnormals), then a band of values
    around the FP8 range with fmax pinned in the first row so most scales are exactly 1.0 and
    the FP8 rounding ties and subnormals are hit; the specials go last."""
    f = FORMATS[src]
    rng = np.random.default_rng(seed)
    n = math.prod(shape)
    bits = rng.integers(0, 1 << f.width, n, dtype=np.uint64).astype(f.uint_dtype)
    if seed % 2:
        low, high = (-12, 8) if fp8 == "e4m3" else (-19, 15)  # below the subnormals .. below fmax
        exps = rng.integers(low, high, n)
        vals = np.ldexp(rng.uniform(1, 2, n), exps) * rng.choice([-1, 1], n)
        vals[: shape[-1]] = FMAX[fp8]
        bits = vals.astype(np.float32).astype(VALUE_DTYPE[src]).view(f.uint_dtype)
    sp = specials(src, large=not seed % 2)  # large values would move the band's scale off 1
    bits[-sp.size:] = sp
    return bits


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("src,fp8,granularity", CASES)
def test_cuda_encode_decode_bytes_equal_cpu(src, fp8, granularity, seed):
    assert GPU.simulated and GPU.name == "cuda"
    bits = random_bits(src, fp8, seed)
    stage = QuantizeFP8(fp8, granularity)
    enc_cpu, enc_gpu = stage.encode(frame(CPU, bits, src, SHAPE)), stage.encode(frame(GPU, bits, src, SHAPE))
    for name in ("data", "scales"):
        a, b = enc_cpu.streams[name], GPU.to_numpy(enc_gpu.streams[name])
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), name
    assert enc_cpu.meta == enc_gpu.meta
    if seed % 2:
        assert (enc_cpu.streams["scales"] == 1.0).all()  # the band really runs at scale 1
    dec_cpu, dec_gpu = stage.decode(enc_cpu), stage.decode(enc_gpu)
    a, b = dec_cpu.streams["data"], GPU.to_numpy(dec_gpu.streams["data"])
    assert a.dtype == b.dtype == FORMATS[src].uint_dtype and a.tobytes() == b.tobytes()
    assert dec_cpu.meta == dec_gpu.meta


@pytest.mark.parametrize("max_blocks", [None, 1])
@pytest.mark.parametrize("shape", [[23, 13], [3, 150], [299]])
@pytest.mark.parametrize("granularity", ["tensor", "channel"])
def test_cuda_grid_layouts_equal_cpu(shape, granularity, max_blocks, monkeypatch):
    # Channel counts that do not divide the grid, more channels than a block has threads, and
    # (max_blocks=1) a grid smaller than the tensor, so each thread strides over several rows.
    if max_blocks:
        monkeypatch.setattr(quantize_fp8, "_MAX_BLOCKS", max_blocks)
    bits = random_bits("bf16", "e4m3", 3, shape)
    stage = QuantizeFP8("e4m3", granularity)
    cpu, gpu = stage.encode(frame(CPU, bits, "bf16", shape)), stage.encode(frame(GPU, bits, "bf16", shape))
    for name in ("data", "scales"):
        assert cpu.streams[name].tobytes() == GPU.to_numpy(gpu.streams[name]).tobytes(), name
    assert stage.decode(cpu).streams["data"].tobytes() == GPU.to_numpy(stage.decode(gpu).streams["data"]).tobytes()


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # simulated float32 overflow
@pytest.mark.parametrize("src,fp8,granularity", CASES[::3])
def test_cuda_decode_of_every_code_and_hostile_scales_equals_cpu(src, fp8, granularity):
    # All 256 codes, against scales a forged blob could carry (NaN, Inf, 0, subnormal, huge):
    # decode must still agree byte for byte.
    codes = np.tile(np.arange(256, dtype=np.uint8), 2)
    shape = [64, 8]
    n_scales = 8 if granularity == "channel" else 1
    scales = np.array([np.nan, np.inf, 0.0, 1e-45, 3e38, 1.0, 2.0 ** -126, 0.01], np.float32)[:n_scales]
    if granularity == "tensor":
        scales = np.array([3e38], np.float32)
    meta_extra = {"quantize_fp8": {"source_format": src}}
    outs = []
    for backend in (CPU, GPU):
        f = Frame(backend, {"data": backend.from_numpy(codes), "scales": backend.from_numpy(scales)},
                  {"dtype": FORMATS[src].dtype_name, "shape": shape, "n": codes.size, "format": fp8, **meta_extra})
        outs.append(backend.to_numpy(QuantizeFP8(fp8, granularity).decode(f).streams["data"]))
    assert outs[0].tobytes() == outs[1].tobytes()


@pytest.mark.parametrize("shape", [[0], [3, 0], []])
def test_cuda_edge_shapes_equal_cpu(shape):
    n = math.prod(shape)
    bits = np.full(n, 0x4040, np.uint16)  # bf16 3.0
    for granularity in ("tensor", "channel"):
        stage = QuantizeFP8("e4m3", granularity)
        cpu, gpu = stage.encode(frame(CPU, bits, "bf16", shape)), stage.encode(frame(GPU, bits, "bf16", shape))
        for name in ("data", "scales"):
            assert cpu.streams[name].tobytes() == GPU.to_numpy(gpu.streams[name]).tobytes()
        assert stage.decode(cpu).streams["data"].tobytes() == GPU.to_numpy(stage.decode(gpu).streams["data"]).tobytes()
