"""The benchmark's inputs (kvzip.bench) are what its docs say: the real sample, converted or
quantized on the CPU, tiled to the requested length."""
import numpy as np
import pytest

from kvzip.bench import _sample_bits, e5m2_bits, format_bits, gpu_tag, widened_bits


def test_float32_input_is_the_bf16_sample_exactly():
    bf16 = _sample_bits(1 << 16)
    f32 = widened_bits(bf16, (1 << 16) + 5, np.float32)
    assert f32.dtype == np.uint32 and f32.shape == ((1 << 16) + 5,)
    np.testing.assert_array_equal(f32[: 1 << 16] >> 16, bf16)  # widening a bfloat16 is exact
    assert not (f32 & 0xFFFF).any()
    np.testing.assert_array_equal(f32[1 << 16:], f32[:5])  # tiled


def test_float16_input_rounds_the_sample_to_nearest():
    bf16 = _sample_bits(1 << 14)
    f16 = widened_bits(bf16, 1 << 14, np.float16)
    assert f16.dtype == np.uint16
    expect = (bf16.astype(np.uint32) << 16).view(np.float32).astype(np.float16)
    np.testing.assert_array_equal(f16.view(np.float16), expect)
    assert np.isfinite(f16.view(np.float16)).all()  # the KV sample fits float16's range


def test_e5m2_input_is_tiled_to_length():
    bits = e5m2_bits(_sample_bits(1 << 15), 3 << 14)
    assert bits.dtype == np.uint8 and bits.shape == (3 << 14,)
    np.testing.assert_array_equal(bits[1 << 15:], bits[: 1 << 14])  # the quantized 2^15 values, repeated


def test_format_bits_names_each_input():
    n = 1 << 14
    host = _sample_bits(n)
    assert format_bits("bf16", host, n) is host
    np.testing.assert_array_equal(format_bits("e5m2", host, n), e5m2_bits(host, n))
    np.testing.assert_array_equal(format_bits("fp16", host, n), widened_bits(host, n, np.float16))
    assert format_bits("fp32", host, n).dtype == np.uint32
    e4m3 = format_bits("e4m3", host, n)  # the ratio bench's third format, quantized as E5M2 is
    assert e4m3.dtype == np.uint8 and not np.array_equal(e4m3, e5m2_bits(host, n))
    np.testing.assert_array_equal(e4m3, e5m2_bits(host, n, "e4m3"))
    with pytest.raises(KeyError):
        format_bits("int8", host, n)


def test_quantize_pipelines_are_the_lossy_pipeline_and_its_quantizer():
    from kvzip.bench import quantize_pipelines

    pipe, qonly = quantize_pipelines()
    assert [type(s).__name__ for s in pipe.stages] == ["QuantizeFP8", "ExponentSplit", "Top16Pack", "EscapeStream",
                                                      "Serialize"]
    assert [type(s).__name__ for s in qonly.stages] == ["QuantizeFP8", "Serialize"]
    bits = _sample_bits(1 << 12)
    # The pipeline decodes to what the quantizer alone gives back (lossless after it).
    np.testing.assert_array_equal(pipe.decode(pipe.encode(bits, dtype="bf16")),
                                  qonly.decode(qonly.encode(bits, dtype="bf16")))


def test_batch_parts_are_64_consecutive_views_of_8_mib():
    from kvzip.bench import MiB, batch_parts

    x = np.zeros(1 << 28, np.uint16)
    parts = batch_parts(x)
    assert len(parts) == 64 and all(p.nbytes == 8 * MiB and p.base is x for p in parts)
    assert [p.__array_interface__["data"][0] - x.__array_interface__["data"][0] for p in parts] == \
        [i * 8 * MiB for i in range(64)]


@pytest.mark.parametrize("name, tag", [
    ("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("Tesla V100-SXM2-16GB", "v100"), ("NVIDIA A100-SXM4-80GB", "a100"), ("NVIDIA L40S", "l40s"),
    ("", "gpu"), (None, "gpu"),
])
def test_gpu_tag_names_the_card_that_measured(name, tag):
    """Result files are named by the card that measured them (an H100's figures never land in an
    h200 file)."""
    assert gpu_tag(name) == tag
