"""BF16 weight matrices to test and measure weight formats with, as uint16 bit patterns: synthetic
ones of a few kinds, and the 2-D BF16 tensors of a safetensors file (read without a framework)."""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

KINDS = ("student_t", "random_bits", "narrow", "specials")


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bits, rounded to nearest even (NaN kept a quiet NaN)."""
    u = x.astype(np.float32).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0) | (u >> 16).astype(np.uint16), rounded)


def synthetic(kind: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    """A (rows, cols) uint16 matrix of one kind:

    student_t    trained-weight-like: Student-t (3 degrees of freedom) times a per-row scale
                 spread over a factor of ~8, so the exponents fill a band of ~7-10 values;
    random_bits  every 16-bit pattern equally likely: most weights fall back;
    narrow       exponents from a random band of 1 to 12 values anywhere in 0..255 (subnormals,
                 infinities and NaNs included when the band reaches an end);
    specials     student_t with a tenth of the weights replaced by zeros, -0, infinities, NaNs
                 with payloads, subnormals and the largest finite values.
    """
    rows, cols = shape
    if kind == "random_bits":
        return rng.integers(0, 1 << 16, shape, dtype=np.uint16)
    if kind == "narrow":
        width = int(rng.integers(1, 13))
        low = int(rng.integers(0, 257 - width))
        exponent = rng.integers(low, low + width, shape, dtype=np.uint16)
        return (rng.integers(0, 2, shape, dtype=np.uint16) << 15) | (exponent << 7) | rng.integers(0, 128, shape, dtype=np.uint16)
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    scale = 0.02 * np.exp2(rng.uniform(-1.5, 1.5, (rows, 1)))
    w = _bf16_bits(rng.standard_t(3, shape) * scale)
    if kind == "specials":
        special = np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7F81, 0x0001, 0x807F, 0x7F7F, 0xFF7F],
                           np.uint16)
        hit = rng.random(shape) < 0.1
        w[hit] = rng.choice(special, int(hit.sum()))
    return w


def read_bf16_matrices(path) -> dict:
    """{name: (rows, cols) uint16} of every 2-D BF16 tensor of a safetensors file, in file order."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack_from("<Q", raw)
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, entry in header.items():
        if name == "__metadata__" or entry["dtype"] != "BF16" or len(entry["shape"]) != 2:
            continue
        begin, end = entry["data_offsets"]
        out[name] = np.frombuffer(raw, "<u2", (end - begin) // 2, 8 + n + begin).reshape(entry["shape"])
    return out
