"""A small slice of real KV cache shipped with kvzip, for the demo, tests and quick experiments.

``kv_sample.npz`` holds BF16 KV from SmolLM2-135M-Instruct on three kinds of text: prose tokens
0:128 and code and HTML tokens 0:64 of every layer's k and v (made by tools/make_codebooks.py).
"""
from __future__ import annotations

import json
from importlib import resources

import ml_dtypes
import numpy as np

SAMPLE_KINDS = ("prose", "code", "html")
_FILE = "kv_sample.npz"


def _open():
    return resources.files(__name__).joinpath(_FILE).open("rb")


def load_sample(kind: str | None = None) -> dict[str, np.ndarray]:
    """The shipped KV sample as ``{"prose/layer00.k": bfloat16 [3, tokens, 64], ...}``.

    ``kind``: "prose", "code", "html", or None for all three.
    """
    if kind is not None and kind not in SAMPLE_KINDS:
        raise ValueError(f"unknown sample kind {kind!r}; choose from {SAMPLE_KINDS} or None")
    with _open() as f, np.load(f, allow_pickle=False) as npz:
        keys = sorted(k for k in npz.files if "/" in k and (kind is None or k.split("/")[0] == kind))
        # Stored as uint16 bits (np.load knows no bfloat16); same bits, bfloat16 view.
        return {k: npz[k].view(ml_dtypes.bfloat16) for k in keys}


def sample_metadata() -> dict:
    """Where the sample came from: model, source files, token ranges, layout."""
    with _open() as f, np.load(f, allow_pickle=False) as npz:
        return json.loads(npz["meta"].item())
