"""Small GPU workload for compute-sanitizer (memcheck, racecheck): every format, the fast
CUDA C++ path and the Numba-CUDA kernels, escape-free / escape-heavy / plane-coded chunks, the
batch API, forged blobs, repeated shapes (graph replay, encode lanes, remembered layouts)
and the BF16 decoder's tail dealt in parts.  Run as
    compute-sanitizer --tool memcheck --error-exitcode 9 python benchmarks/sanitize_check.py
"""
import cupy
import numpy as np

import kvzip
from kvzip.formats import FORMATS
from kvzip.gpu import programs

rng = np.random.default_rng(7)


def case(fmt, n, heavy):
    x = (rng.standard_normal(n) * 0.05).astype(np.float32)
    import ml_dtypes

    bits = x.astype(np.dtype(getattr(ml_dtypes, fmt.dtype_name, fmt.dtype_name))).view(fmt.uint_dtype).copy()
    if heavy:
        bits[: n // 3] = rng.integers(0, 2**fmt.width, n // 3, dtype=np.uint64).astype(fmt.uint_dtype)
    return bits


for enabled in (True, False):
    programs.ENABLED = enabled
    for fmt in FORMATS.values():
        for n, heavy in ((5000, False), (20000, True), (1, False), (0, False)):
            bits = case(fmt, n, heavy)
            blob = kvzip.compress(cupy.asarray(bits), dtype=fmt.name, chunk=1024)
            back = kvzip.decompress(blob)
            assert np.array_equal(back.get().view(fmt.uint_dtype).ravel(), bits), (fmt.name, n, enabled)
    # Listed escapes past the encoder's per-chunk slot and past one 32-escape decode batch, over
    # more than one scan block (256 chunks).
    bits = case(FORMATS["bf16"], 300_000, False)
    hit = rng.random(bits.shape[0]) < 0.06
    bits[hit] = (bits[hit] & 0x807F) | (rng.integers(200, 250, int(hit.sum())) << 7).astype(np.uint16)
    back = kvzip.decompress(kvzip.compress(cupy.asarray(bits), dtype="bf16", chunk=1024))
    assert np.array_equal(back.get().view(np.uint16).ravel(), bits), ("sprinkled", enabled)
    xs = [cupy.asarray(case(FORMATS["bf16"], n, h)) for n, h in ((4096, False), (9000, True), (300, False))]
    backs = kvzip.decompress_many(kvzip.compress_many(xs, dtype="bf16"))
    assert all(bool(cupy.array_equal(a, b.reshape(-1).view(a.dtype))) for a, b in zip(xs, backs))
    bad = kvzip.compress(xs[1], dtype="bf16").copy()
    bad[-40:] = 255
    try:
        kvzip.decompress(bad)
    except kvzip.FormatError:
        pass
# Repeated shapes: CUDA graph replay, the encode lanes and remembered decode layouts, with escape
# counts that differ from call to call.
programs.ENABLED = True
for rate in (0.0, 0.01, 0.05, 0.002):
    bits = case(FORMATS["bf16"], 70_000, False)
    hit = rng.random(bits.shape[0]) < rate
    bits[hit] = (bits[hit] & 0x807F) | (rng.integers(200, 250, int(hit.sum())) << 7).astype(np.uint16)
    back = kvzip.decompress(kvzip.compress(cupy.asarray(bits), dtype="bf16"))
    assert np.array_equal(back.get().view(np.uint16).ravel(), bits), ("repeated", rate)
    xs = [cupy.asarray(bits), cupy.asarray(bits[::-1].copy())]
    backs = kvzip.decompress_many(kvzip.compress_many(xs, dtype="bf16"))
    assert all(bool(cupy.array_equal(a, b.reshape(-1).view(a.dtype))) for a, b in zip(xs, backs)), ("many", rate)
# The BF16 decoder's tail in parts (more chunks than its warps: 4096 of 4096 values), escape-heavy
# and plane-coded chunks among them.
bits = case(FORMATS["bf16"], 1 << 24, False)
bits[-(1 << 22)::10] = 200 << 7
bits[-(1 << 20)::3] = 201 << 7
back = kvzip.decompress(kvzip.compress(cupy.asarray(bits), dtype="bf16"))
assert np.array_equal(back.get().view(np.uint16).ravel(), bits), "tail parts"
# A longer batch (header checks on the GPU), repeated so the second pass takes the lanes and
# remembered layouts; then a short blob and a forged one among them.
xs = [cupy.asarray(case(FORMATS["bf16"], 20_000 + (i % 3), i == 5)) for i in range(19)]
for _ in range(2):
    blobs = kvzip.compress_many(xs, dtype="bf16")
    backs = kvzip.decompress_many(blobs)
    assert all(bool(cupy.array_equal(a, b.reshape(-1).view(a.dtype))) for a, b in zip(xs, backs)), "long batch"
forged = list(blobs)
forged[9] = blobs[9].copy()
forged[9][-64:] = 255
forged[3] = blobs[3][:20]
try:
    kvzip.decompress_many(forged)
except kvzip.FormatError:
    pass
# QuantizeFP8 per tensor (kvzip/gpu/kernels/quantize.cu) in front, ragged lengths; repeated, so later
# decodes take the remembered layout with the dequantize fused into kvz_decode.
from kvzip import stages as S  # noqa: E402

qpipe = kvzip.Pipeline([S.QuantizeFP8("e5m2"), S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(), S.Serialize()])
for n in (70_001, 70_001, 70_001, 13):
    bits = case(FORMATS["bf16"], n, False)
    blob = qpipe.encode(cupy.asarray(bits), dtype="bf16")
    first, again = qpipe.decode(blob), qpipe.decode(blob)
    assert bool(cupy.array_equal(first, again)), ("quantized", n)
    kvzip.decompress_many([blob, blob])
# Guessed layouts (no header read-back; the scan's guess_head): a blob of another shape, one cut at
# the guessed layout's fixed bytes, one with a broken header: each must miss on the GPU without
# reading past its blob, and go the checked way.
from kvzip.gpu import layout_cache  # noqa: E402

x = cupy.asarray(case(FORMATS["bf16"], 50_000, False))
blob = kvzip.compress(x, dtype="bf16")
kvzip.decompress(blob)
layout = layout_cache.guess(blob.shape[0])
assert layout is not None
broken = blob.copy()
broken[44] ^= 1
for b in (kvzip.compress(x.reshape(100, 500), dtype="bf16"), blob[:layout.fixed_bytes], broken, blob):
    for call in (kvzip.decompress, lambda b: kvzip.decompress_many([blob, b, blob])):
        try:
            call(b)
        except kvzip.FormatError:
            pass
print("sanitize workload done")
