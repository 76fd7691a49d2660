"""Format stability against committed fixtures (tests/golden, written by make_golden.py).

* every committed blob still decodes to the committed values (old blobs stay readable);
* encoding every committed input today gives the committed blob byte for byte, on the fused
  and on the staged path (the bitstream has not drifted).

A failure here is a format change.  If it is intended, regenerate with
``python tests/golden/make_golden.py`` and say so in the change (and bump the container
version if old blobs no longer decode)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvzip
from kvzip import testing as kt
from kvzip.formats import FORMATS

GOLDEN = Path(__file__).resolve().parent / "golden"
MANIFEST = json.loads((GOLDEN / "manifest.json").read_text())
CASES = MANIFEST["cases"]


def load(name):
    case = CASES[name]
    fmt = FORMATS[case["format"]]
    x = np.load(GOLDEN / case["input"], allow_pickle=False)
    blob = (GOLDEN / case["blob"]).read_bytes()
    want = np.load(GOLDEN / case["output"], allow_pickle=False) if "output" in case else x
    return case, fmt, x, blob, want


def test_fixture_set_is_complete_and_small():
    """The fixtures cover every format, a checksum, plane coding, stored raw and a lossy pipeline."""
    assert {c["format"] for c in CASES.values()} == set(FORMATS)
    assert any(c["info"]["checksum"] for c in CASES.values())
    assert any(c["info"]["raw_chunks"] for c in CASES.values())
    assert any(c["info"]["stored_raw"] for c in CASES.values())
    assert any(c["info"]["escapes"] for c in CASES.values())
    if getattr(kvzip.stages, "QuantizeFP8", None) is not None:
        assert any(not c["lossless"] for c in CASES.values())
    total = sum(p.stat().st_size for p in GOLDEN.iterdir())
    assert total < 256 << 10, f"golden fixtures take {total} bytes; keep them small"


@pytest.mark.parametrize("name", list(CASES))
def test_golden_blob_decodes_to_stored_values(name):
    case, fmt, x, blob, want = load(name)
    assert list(x.shape) == case["shape"] and x.dtype == fmt.uint_dtype
    out = kvzip.decompress(blob)
    assert out.dtype.name == fmt.dtype_name  # a lossy pipeline decodes to its source format too
    assert out.shape == tuple(case["shape"])
    np.testing.assert_array_equal(np.asarray(out).view(want.dtype), want)
    for fuse in (True, False):  # the staged decoder reads it too
        pipe = kvzip.Pipeline.from_config(case["pipeline"], fuse=fuse)
        np.testing.assert_array_equal(np.asarray(pipe.decode(blob)).view(want.dtype), want)
    inf = kvzip.info(blob)
    for key, value in case["info"].items():
        assert inf[key] == pytest.approx(value) if isinstance(value, float) else inf[key] == value, key


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "staged"])
def test_golden_input_encodes_to_the_same_bytes(name, fuse):
    case, fmt, x, blob, _ = load(name)
    if any(s["id"] == "quantize_fp8" for s in case["pipeline"]["stages"]) and \
            getattr(kvzip.stages, "QuantizeFP8", None) is None:
        pytest.skip("QuantizeFP8 is not in this kvzip")
    pipe = kvzip.Pipeline.from_config(case["pipeline"], fuse=fuse)
    got = np.asarray(pipe.encode(x, dtype=fmt.name)).tobytes()
    if got != blob:
        diff = next(i for i, (a, b) in enumerate(zip(got, blob)) if a != b) if len(got) == len(blob) else None
        pytest.fail(f"{name}: encoding today gives {len(got)} bytes, the fixture has {len(blob)}"
                    f"{'' if diff is None else f'; first difference at byte {diff}'}: the bitstream changed")


def test_golden_blobs_are_canonical_containers():
    for name in CASES:
        blob = (GOLDEN / CASES[name]["blob"]).read_bytes()
        assert blob[:8] == b"KVZIP\x00\r\n" and int.from_bytes(blob[8:10], "little") in (1, 2, 3, 4)
        assert len(blob) % 16 == 0


V1_CASES = [name for name in CASES if "blob_v1" in CASES[name]]


def test_every_compact_fixture_has_its_version1_blob():
    """The blobs kvzip wrote before the compact header are kept: every case whose blob is
    version 2 (or the ratio mode's version 3, the storage mode's 4) today has one, so every version's reader is
    pinned."""
    assert V1_CASES and all(int.from_bytes((GOLDEN / CASES[n]["blob"]).read_bytes()[8:10], "little") in (2, 3, 4)
                            for n in V1_CASES)
    assert all(int.from_bytes((GOLDEN / CASES[n]["blob"]).read_bytes()[8:10], "little") == 1
               for n in CASES if n not in V1_CASES)


@pytest.mark.parametrize("name", V1_CASES)
def test_version1_blob_decodes_and_is_the_compact_ones_twin(name):
    """A version-1 blob (written by kvzip before version 2) decodes to the committed values, and
    is byte for byte the compact blob with its version-1 header: the compact header stands for
    exactly that header."""
    case, fmt, x, blob, want = load(name)
    old = (GOLDEN / case["blob_v1"]).read_bytes()
    assert int.from_bytes(old[8:10], "little") == 1
    assert kt.version1(blob) == old
    np.testing.assert_array_equal(np.asarray(kvzip.decompress(old)).view(want.dtype), want)
    assert kvzip.info(old)["pipeline"] == kvzip.info(blob)["pipeline"]
