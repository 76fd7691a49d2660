"""What the ratio mode (ChannelPack) and the storage mode (ChannelRans) must both do on a real
GPU, each mode's kernels against its CPU reference: real KV and its adversarial variants, 2^24
values of real KV (many chunks, sampled or full histograms, with and without a checksum), and
input views that start off a 16-byte boundary, sizes around each mode's chunk for every format
(tests/gpu/channel_modes.py holds the checks)."""
import pytest

import channel_modes  # CuPy: tests/conftest.py collects tests/gpu only where it sees a GPU

from kvzip import testing as kt
from kvzip.formats import FORMATS

MODES = ("ratio", "storage")
SIZES = {"ratio": (0, 1, 7, 8, 4095, 4096, 4097, 3 * 4096 + 5, 100_003),  # around its 4096-value chunk
         "storage": (0, 1, 7, 8, 31, 32, 33, 65535, 65536, 65537, 3 * 65536 + 5, 300_007)}  # 65536


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("mode,n", [(mode, n) for mode in MODES for n in SIZES[mode]])
def test_sizes_and_formats(fmt, mode, n):
    flat = kt.kv_like_bits(FORMATS[fmt], n, escape_rate=0.01, seed=n)
    shape = (n // 64, 64) if n % 64 == 0 and n else (n,)  # 64 channels, or one (a 1-D tensor of odd length)
    channel_modes.assert_device_matches(flat.reshape(shape), fmt, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("variant", kt.KV_VARIANTS)
def test_real_kv_variants(variant, mode):
    channel_modes.assert_real_kv_variant_matches(variant, mode)


@pytest.mark.parametrize("mode", MODES)
def test_large_real_kv(mode):
    channel_modes.assert_large_real_kv_matches(mode)


@pytest.mark.parametrize("mode", MODES)
def test_unaligned_input_views(mode):
    channel_modes.assert_unaligned_view_matches(mode)
