"""Compression ratio on real KV caches (SmolLM2-135M-Instruct, BF16).

Codebooks are calibrated on prose and measured on held-out code and HTML, as in SplitZip:

* BF16, lossless: >= 1.325 (ceiling 16/12 = 1.333);
* E5M2 (QuantizeFP8 per tensor, then lossless): >= 1.135 against the FP8 bytes (ceiling 8/7 = 1.143);
* the same floors with the shipped default codebooks.

Each kind of text is compressed as one tensor (all layers' k and v concatenated), which is what
a transfer of a whole KV cache does; per-tensor figures (one header per tensor) are printed too.
Run with ``pytest -s`` to see the measured figures; they are also in every assertion message.

The ratio mode (compress(mode="ratio"), issue 28) is held to its targets per layer tensor on the
held-out SmolLM2 files and on MiniLM (a second family): BF16 >= 1.42 / 1.40, E5M2 >= 1.22,
E4M3 >= 1.10, each tensor alone; and on every adversarial variant of the shipped sample.

The shipped sample (kvzip.data) always runs; the full captures in ../shared/data/kv (relative to
the repository root) run when present, and are skipped only when absent.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import kvzip
from kvzip import testing as kt
from kvzip.backends import get_backend
from kvzip.data import load_sample
from kvzip.frame import Frame
from kvzip.stages import QuantizeFP8

BF16_FLOOR = 1.325
E5M2_FLOOR = 1.135
KV_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "kv"
FILES = {k: KV_DIR / f for k, f in (("prose", "smollm2-135m_prose_2048.safetensors"),
                                    ("code", "smollm2-135m_code_512.safetensors"),
                                    ("html", "smollm2-135m_html_512.safetensors"))}


def report(msg):
    print(f"\n[real data] {msg}")
    return msg


def bf16_bits(tensors: dict) -> np.ndarray:
    """All tensors' raw BF16 bits, concatenated in key order."""
    return np.concatenate([np.ascontiguousarray(tensors[k]).view(np.uint16).ravel() for k in sorted(tensors)])


def quantize_e5m2(tensors: dict) -> np.ndarray:
    """Per-tensor FP8 E5M2 codes from the QuantizeFP8 stage (what the stacked pipeline sends),
    concatenated in key order."""
    stage, cpu, out = QuantizeFP8("e5m2", "tensor"), get_backend("cpu"), []
    for k in sorted(tensors):
        bits = np.ascontiguousarray(tensors[k]).view(np.uint16).ravel()
        frame = Frame(cpu, {"data": bits}, {"dtype": "bfloat16", "shape": list(tensors[k].shape),
                                            "n": bits.size, "format": "bf16"})
        out.append(stage.encode(frame).streams["data"])
    return np.concatenate(out)


def measure(bits, fmt, codebook, label):
    """Compress, check the round trip, return (ratio, info)."""
    blob = kvzip.compress(bits, codebook, dtype=fmt)
    np.testing.assert_array_equal(np.asarray(kvzip.decompress(blob)).view(bits.dtype), bits)
    inf = kvzip.info(blob)
    assert not inf["stored_raw"], label
    report(f"{label}: {bits.size} values, ratio {inf['ratio']:.4f}, escapes {inf['escape_rate']:.4%}, "
           f"plane-coded chunks {inf['raw_chunks']}")
    return inf["ratio"], inf


def per_tensor_ratio(tensors, codebook, label):
    raw = comp = 0
    for k in sorted(tensors):
        blob = kvzip.compress(tensors[k], codebook)
        raw, comp = raw + tensors[k].nbytes, comp + len(blob)
    report(f"{label}: per-tensor compression ({len(tensors)} tensors, one header each): {raw / comp:.4f}")
    return raw / comp


# --------------------------------------------------------------------------- shipped sample
@pytest.fixture(scope="module")
def sample():
    return {kind: load_sample(kind) for kind in ("prose", "code", "html")}


@pytest.mark.parametrize("variant", kt.KV_VARIANTS)
def test_sample_variants_round_trip_and_agree(sample, variant):
    """Each adversarial-but-real variant of the shipped sample's layers (per-layer and per-channel
    power-of-two scales, exact zeros, a wide exponent range) round-trips bit for bit, fused and
    staged write the same bytes, and no blob is larger than raw plus its header."""
    fused, staged = kvzip.splitzip_pipeline(), kvzip.Pipeline(kvzip.splitzip_pipeline().stages, fuse=False)
    for layer, (key, t) in enumerate(sorted(sample["code"].items())[:8]):
        bits = kt.kv_variant(t.view(np.uint16), variant, layer=layer, seed=layer)
        blob = fused.encode(bits, dtype="bf16")
        np.testing.assert_array_equal(blob, staged.encode(bits, dtype="bf16"), err_msg=f"{variant} {key}")
        np.testing.assert_array_equal(kvzip.decompress(blob).view(np.uint16), bits, err_msg=f"{variant} {key}")
        assert blob.nbytes <= bits.nbytes + 1024, (variant, key, blob.nbytes, bits.nbytes)


def test_power_of_two_scaling_is_exact(sample):
    bits = bf16_bits(sample["code"])
    for s in (-4, -1, 3, 7):
        back = kt.scale_pow2(kt.scale_pow2(bits, s), -s)
        np.testing.assert_array_equal(back, bits)
    with pytest.raises(ValueError, match="exact range"):
        kt.scale_pow2(np.array([0x7F00], np.uint16), 1)  # the largest binade doubled: infinity
    with pytest.raises(ValueError, match="exact range"):
        kt.scale_pow2(np.array([0x0081], np.uint16), -8)  # into the subnormals, losing bits


def test_sample_bf16_prose_codebook(sample):
    cb = kvzip.calibrate(sample["prose"], name="prose-sample")
    report(f"BF16 codebook calibrated on the prose sample: {cb}")
    for kind in ("code", "html"):
        ratio, _ = measure(bf16_bits(sample[kind]), "bf16", cb, f"sample {kind} BF16, prose codebook")
        assert ratio >= BF16_FLOOR, f"sample {kind}: BF16 ratio {ratio:.4f} < {BF16_FLOOR}"
    per_tensor_ratio(sample["code"], cb, "sample code BF16")


def test_sample_e5m2_prose_codebook(sample):
    cb = kvzip.calibrate(quantize_e5m2(sample["prose"]), format="e5m2", name="prose-sample-e5m2")
    report(f"E5M2 codebook calibrated on the quantized prose sample: {cb}")
    for kind in ("code", "html"):
        ratio, _ = measure(quantize_e5m2(sample[kind]), "e5m2", cb, f"sample {kind} E5M2, prose codebook")
        assert ratio >= E5M2_FLOOR, f"sample {kind}: E5M2 ratio {ratio:.4f} < {E5M2_FLOOR}"


def test_sample_shipped_default_codebooks(sample):
    for kind in ("code", "html"):
        ratio, inf = measure(bf16_bits(sample[kind]), "bf16", None, f"sample {kind} BF16, shipped bf16-kv")
        assert inf["codebook"] == "bf16-kv"
        assert ratio >= BF16_FLOOR, f"sample {kind}: BF16 ratio {ratio:.4f} with bf16-kv < {BF16_FLOOR}"
        ratio, inf = measure(quantize_e5m2(sample[kind]), "e5m2", None, f"sample {kind} E5M2, shipped e5m2-kv")
        assert inf["codebook"] == "e5m2-kv"
        assert ratio >= E5M2_FLOOR, f"sample {kind}: E5M2 ratio {ratio:.4f} with e5m2-kv < {E5M2_FLOOR}"


def test_sample_stacked_pipeline(sample):
    """QuantizeFP8 + SplitZip in one pipeline: about 2 x 8/7 against BF16, and the lossless part
    changes nothing the quantizer produced."""
    x = kt.as_float(bf16_bits(sample["code"]), "bf16")
    pipe = kvzip.Pipeline([QuantizeFP8("e5m2"), kvzip.stages.ExponentSplit(), kvzip.stages.Top16Pack(),
                           kvzip.stages.EscapeStream(), kvzip.stages.Serialize()])
    blob = pipe.encode(x)
    ratio = x.nbytes / len(blob)
    report(f"sample code: QuantizeFP8(e5m2) + SplitZip, one tensor: {ratio:.4f} against BF16 "
           f"({ratio / 2:.4f} against the FP8 bytes)")
    assert ratio / 2 >= E5M2_FLOOR, f"stacked pipeline: {ratio / 2:.4f} against FP8 < {E5M2_FLOOR}"
    ref = kvzip.decompress(kvzip.Pipeline([QuantizeFP8("e5m2"), kvzip.stages.Serialize()]).encode(x))
    np.testing.assert_array_equal(kvzip.decompress(blob).view(np.uint16), ref.view(np.uint16))


# --------------------------------------------------------------------------- full captures
needs_files = pytest.mark.skipif(not all(p.exists() for p in FILES.values()),
                                 reason=f"real KV captures not found in {KV_DIR}")


@pytest.fixture(scope="module")
def full():
    from safetensors.numpy import load_file

    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy for safetensors)

    return {kind: load_file(str(path)) for kind, path in FILES.items()}


@needs_files
def test_full_bf16_prose_codebook(full):
    cb = kvzip.calibrate(FILES["prose"], name="prose-full")  # straight from the .safetensors file
    report(f"BF16 codebook calibrated on {FILES['prose'].name}: {cb}")
    for kind in ("code", "html"):
        ratio, _ = measure(bf16_bits(full[kind]), "bf16", cb, f"{FILES[kind].name} BF16, prose codebook")
        assert ratio >= BF16_FLOOR, f"{kind}: BF16 ratio {ratio:.4f} < {BF16_FLOOR}"
        per_tensor_ratio(full[kind], cb, f"{FILES[kind].name} BF16")


@needs_files
def test_full_e5m2_prose_codebook(full):
    cb = kvzip.calibrate(quantize_e5m2(full["prose"]), format="e5m2", name="prose-full-e5m2")
    report(f"E5M2 codebook calibrated on quantized {FILES['prose'].name}: {cb}")
    for kind in ("code", "html"):
        ratio, _ = measure(quantize_e5m2(full[kind]), "e5m2", cb, f"{FILES[kind].name} E5M2, prose codebook")
        assert ratio >= E5M2_FLOOR, f"{kind}: E5M2 ratio {ratio:.4f} < {E5M2_FLOOR}"


@needs_files
def test_full_shipped_default_codebooks(full):
    for kind in ("prose", "code", "html"):
        ratio, _ = measure(bf16_bits(full[kind]), "bf16", None, f"{FILES[kind].name} BF16, shipped bf16-kv")
        assert ratio >= BF16_FLOOR, f"{kind}: BF16 ratio {ratio:.4f} with bf16-kv < {BF16_FLOOR}"
        ratio, _ = measure(quantize_e5m2(full[kind]), "e5m2", None, f"{FILES[kind].name} E5M2, shipped e5m2-kv")
        assert ratio >= E5M2_FLOOR, f"{kind}: E5M2 ratio {ratio:.4f} with e5m2-kv < {E5M2_FLOOR}"


# --------------------------------------------------------------------------- the ratio mode
# Issue 28's targets, each layer tensor compressed alone (raw = the tensor's bytes; for E5M2 and
# E4M3 the FP8 bits QuantizeFP8 gives, one scale a tensor, are the input).
RATIO_TARGETS = {("smollm2", "bf16"): 1.42, ("minilm", "bf16"): 1.40, ("smollm2", "e5m2"): 1.22,
                 ("minilm", "e5m2"): 1.22, ("smollm2", "e4m3"): 1.10, ("minilm", "e4m3"): 1.10}
HELD_OUT = {"smollm2": ("smollm2-135m_code_512.safetensors", "smollm2-135m_html_512.safetensors"),
            "minilm": ("minilm-l6_code_1024.safetensors", "minilm-l6_prose_2048.safetensors")}
SAMPLE_RATIO_FLOOR = 1.34  # the shipped sample's layers are [3, 64, 64]: the tables are 4 % of a blob


def fp8_bits(t, fmt: str) -> np.ndarray:
    """A layer tensor's FP8 bits (QuantizeFP8, one scale for the tensor), in the tensor's shape."""
    bits = np.ascontiguousarray(t).view(np.uint16)
    if fmt == "bf16":
        return bits
    frame = Frame(get_backend("cpu"), {"data": bits.reshape(-1)},
                  {"dtype": "bfloat16", "shape": [bits.size], "n": bits.size, "format": "bf16"})
    return QuantizeFP8(fmt, "tensor").encode(frame).streams["data"].reshape(bits.shape)


@pytest.mark.parametrize("variant", kt.KV_VARIANTS)
def test_sample_variants_ratio_mode(sample, variant):
    """Every variant of every sample layer round-trips in the ratio mode, above the floor and
    never below the speed mode (per-channel tables follow per-channel and per-layer scales)."""
    for layer, (key, t) in enumerate(sorted(sample["code"].items())):
        bits = kt.kv_variant(t.view(np.uint16), variant, layer=layer, seed=layer)
        blob = kvzip.compress(bits, dtype="bf16", mode="ratio")
        np.testing.assert_array_equal(kvzip.decompress(blob).view(np.uint16), bits, err_msg=f"{variant} {key}")
        ratio = bits.nbytes / blob.nbytes
        assert ratio >= SAMPLE_RATIO_FLOOR, (variant, key, ratio)
        assert blob.nbytes <= kvzip.compress(bits, dtype="bf16").nbytes, (variant, key)


needs_both_families = pytest.mark.skipif(not all((KV_DIR / f).exists() for fs in HELD_OUT.values() for f in fs),
                                         reason=f"real KV captures not found in {KV_DIR}")


@needs_both_families
@pytest.mark.parametrize("fmt", ["bf16", "e5m2", "e4m3"])
@pytest.mark.parametrize("family", sorted(HELD_OUT))
def test_full_ratio_mode_meets_the_targets_per_layer_tensor(family, fmt):
    """Held-out SmolLM2 files (code, html) and MiniLM's: every layer tensor alone, bit-exact, at
    or above issue 28's target."""
    from safetensors.numpy import load_file

    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy for safetensors)

    target, ratios = RATIO_TARGETS[(family, fmt)], []
    for name in HELD_OUT[family]:
        for key, t in sorted(load_file(str(KV_DIR / name)).items()):
            bits = fp8_bits(t, fmt)
            blob = kvzip.compress(bits, dtype=fmt, mode="ratio")
            np.testing.assert_array_equal(np.asarray(kvzip.decompress(blob)).view(bits.dtype), bits)
            ratios.append((bits.nbytes / blob.nbytes, f"{name} {key}"))
    worst = min(ratios)
    report(f"ratio mode, {family} {fmt}: {len(ratios)} layer tensors, min {worst[0]:.4f} ({worst[1]}), "
           f"median {np.median([r for r, _ in ratios]):.4f}, target {target}")
    assert worst[0] >= target, f"{family} {fmt}: {worst[1]} at {worst[0]:.4f} < {target}"
