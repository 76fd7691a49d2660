"""sum64 on a GPU (one-pass kernel) equals the NumPy form, which is the specification."""
import numpy as np
import pytest

import cupy  # tests/conftest.py collects tests/gpu only where CuPy sees a GPU

from kvzip.checksum import sum64, sum64_finish, sum64_start

rng = np.random.default_rng(64)


@pytest.mark.parametrize("words", [0, 1, 2, 31, 32, 33, 255, 256, 257, 4099, 1 << 20, (1 << 23) + 7])
def test_sum64_gpu_matches_numpy(words):
    host = rng.integers(0, 256, words * 8, dtype=np.uint8)
    assert sum64(cupy, cupy.asarray(host)) == sum64(np, host)


def test_sum64_gpu_all_ones_and_start_finish():
    host = np.full(8 * 100_003, 0xFF, dtype=np.uint8)
    dev = cupy.asarray(host)
    assert sum64_finish(sum64_start(cupy, dev), dev.shape[0]) == sum64(np, host)
    with pytest.raises(ValueError):
        sum64(cupy, dev[:12])
