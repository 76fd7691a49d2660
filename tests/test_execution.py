"""kvzip/execution.py's one executor choice, the immutable Pipeline and the per-thread path
record (kvzip/trace.py), on the CPU."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import kvzip
from kvzip import execution, testing as kt
from kvzip.trace import last_path


def test_a_pipeline_cannot_be_changed():
    pipe = kvzip.splitzip_pipeline()
    with pytest.raises(AttributeError, match="immutable"):
        pipe.fuse = False
    with pytest.raises(AttributeError):
        pipe.stages.append(kvzip.stages.Serialize())  # a tuple
    assert kvzip.Pipeline(pipe.stages, fuse=False).fuse is False
    with pytest.raises(TypeError):
        kvzip.Pipeline(pipe.stages, fuse=0)


def test_equal_pipelines_share_a_key_and_differ_from_the_unfused():
    a, b = kvzip.splitzip_pipeline(chunk=256), kvzip.splitzip_pipeline(chunk=256)
    assert a is not b and a.key == b.key and a == b and hash(a) == hash(b)
    assert kvzip.Pipeline(a.stages, fuse=False).key != a.key
    assert kvzip.splitzip_pipeline(chunk=512).key != a.key


def test_the_choice_is_made_once_per_shape_and_stays_bounded(monkeypatch):
    monkeypatch.setattr(execution, "MAX_ENCODERS", 8)
    execution.forget()
    pipe = kvzip.splitzip_pipeline()
    for n in range(1, 21):  # twenty shapes through a cache of eight
        bits = kt.kv_like_bits("bf16", n, seed=n)
        np.testing.assert_array_equal(kvzip.decompress(pipe.encode(bits, dtype="bf16")).view(np.uint16), bits)
        assert len(execution._encoders) <= 8
    keys = list(execution._encoders)
    assert [k[2] for k in keys] == [(n,) for n in range(13, 21)]  # the oldest went first
    assert all(v is None for v in execution._encoders.values())  # on the CPU: the staged executor
    pipe.encode(kt.kv_like_bits("bf16", 20, seed=1), dtype="bf16")
    assert list(execution._encoders) == keys  # a shape seen before: no new choice
    execution.forget()
    assert not execution._encoders


def test_the_path_is_per_thread():
    bits = kt.kv_like_bits("bf16", 5000, seed=3)
    fused, staged = kvzip.splitzip_pipeline(), kvzip.Pipeline(kvzip.splitzip_pipeline().stages, fuse=False)
    seen = {}
    start = threading.Barrier(2)

    def run(name, pipe):
        start.wait()
        for _ in range(20):
            pipe.encode(bits, dtype="bf16")
            seen.setdefault(name, set()).add(last_path())

    threads = [threading.Thread(target=run, args=a) for a in (("fused", fused), ("staged", staged))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"fused": {"fused"}, "staged": {"staged"}}


def test_compress_reuses_one_pipeline_for_equal_codebook_objects():
    """A Codebook object reaches the same cached pipeline as an equal one (by format, exponents
    and name: all a blob records of it), so its calls take the paths a named codebook's take; the
    bytes are those of a freshly built pipeline."""
    from kvzip import api

    bits = kt.kv_like_bits("bf16", 20000, seed=9)
    a = kvzip.calibrate(bits, format="bf16", name="mine")
    b = kvzip.Codebook(a.exponents, "bf16", "mine", provenance={"other": "record"})
    assert api._default(a, False, 4096) is api._default(b, False, 4096)
    assert api._default(a, False, 4096) is not api._default(a, True, 4096)
    assert api._default(kvzip.Codebook(a.exponents, "bf16", "other"), False, 4096) is not api._default(a, False, 4096)
    np.testing.assert_array_equal(kvzip.compress(bits, codebook=a, dtype="bf16"),
                                  kvzip.splitzip_pipeline(a).encode(bits, dtype="bf16"))
    assert kvzip.info(kvzip.compress(bits, codebook=b, dtype="bf16"))["codebook"] == "mine"
    # its dict too (to_dict's, provenance and all), checked as from_dict checks it
    assert api._default(a.to_dict(), False, 4096) is api._default(a, False, 4096)
    np.testing.assert_array_equal(kvzip.compress(bits, codebook=a.to_dict(), dtype="bf16"),
                                  kvzip.splitzip_pipeline(a.to_dict()).encode(bits, dtype="bf16"))
    for bad, why in (({**a.to_dict(), "extra": 1}, "unknown codebook key"),
                     ({**a.to_dict(), "exponents": list(a.exponents[:15])}, "exactly 16"),
                     ({**a.to_dict(), "coverage": 2.0}, "coverage"),
                     ({**a.to_dict(), "provenance": 3}, "provenance must be a dict")):
        with pytest.raises(ValueError, match=why):
            kvzip.compress(bits, codebook=bad, dtype="bf16")


def test_a_codebook_keeps_its_own_provenance():
    """An empty provenance the caller fills afterwards does not change the (immutable) codebook."""
    record: dict = {}
    cb = kvzip.Codebook(tuple(range(16)), "bf16", provenance=record)
    record["later"] = 1
    assert cb.provenance == {}
