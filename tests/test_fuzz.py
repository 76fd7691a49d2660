"""Fuzz harness: Hypothesis draws forgeries of real blobs (kvzip.testing.hostile_blobs: bit flips,
truncation, forged prefix fields, forged metadata values and deep JSON, duplicate keys, edited
streams, all resealed with valid CRCs) and a worker process (tests/fuzz_worker.py) decodes each
four ways under an address-space limit.  Each blob must be rejected with FormatError by every
decoder, or accepted by every one with the same result (info() included); a crash, a hang, a
memory blow-up or any other exception fails the test with the blob.

Profiles: the CI default runs FUZZ_EXAMPLES (2,000) examples, about 30 s on a 2-core machine;
KVZIP_FUZZ=long runs fifty times as many, with fresh random draws each run, for a local or
nightly run (100,000 examples took 10 minutes on that machine).
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvzip
from kvzip import stages as S
from kvzip import testing as kt

LONG = os.environ.get("KVZIP_FUZZ") == "long"
FUZZ_EXAMPLES = 100_000 if LONG else 2_000
HEADROOM = 1 << 30  # address space the worker may add to what it holds after warming up
TIMEOUT_S = 120  # for one blob, four decodes


def _base_blobs() -> list[bytes]:
    """Real blobs of every kind a decoder meets: each format, split and stored, with and without
    a checksum, small chunks, escapes, 0-d and empty tensors, the ratio and storage modes, and QuantizeFP8 in
    front."""
    rng = np.random.default_rng(26)

    def kv(n, dtype):
        return (rng.standard_normal(n) * 0.05).astype(dtype)

    esc = kv(600, np.float16)
    esc[::7] = 30000.0
    ratio_kv = kv(8192, ml_dtypes.bfloat16)  # escapes, and random bits that plane-code a chunk
    ratio_kv[::50] = rng.integers(0, 1 << 16, 164, dtype=np.uint16).view(ml_dtypes.bfloat16)
    ratio_kv[2048:3072] = rng.integers(0, 1 << 16, 1024, dtype=np.uint16).view(ml_dtypes.bfloat16)
    blobs = [
        kvzip.compress(kv(600, ml_dtypes.bfloat16)),
        kvzip.compress(kv(600, ml_dtypes.bfloat16), checksum=True, chunk=64),
        kvzip.compress(esc, chunk=8),
        kvzip.compress(kv(300, np.float32).reshape(3, 100)),
        kvzip.compress(kv(600, ml_dtypes.float8_e5m2)),
        kvzip.compress(kv(64, ml_dtypes.float8_e4m3fn)),
        kvzip.compress(np.arange(8, dtype=np.float16)),
        kvzip.compress(np.float32(1.5)),
        kvzip.compress(np.zeros((0, 3), ml_dtypes.bfloat16)),
        kvzip.Pipeline([S.ExponentSplit(), S.Serialize()]).encode(kv(100, np.float16)),
        kvzip.compress(ratio_kv.reshape(128, 64), mode="ratio", chunk=1024),
        kvzip.compress(esc.reshape(20, 30), mode="ratio", chunk=64, checksum=True),
        kvzip.compress(kv(4096, ml_dtypes.float8_e4m3fn).reshape(128, 32), mode="ratio", chunk=512),
        kvzip.compress(ratio_kv.reshape(128, 64), mode="storage", chunk=1024),
        kvzip.compress(esc.reshape(20, 30), mode="storage", chunk=64, checksum=True),
        kvzip.compress(kv(4096, ml_dtypes.float8_e5m2).reshape(128, 32), mode="storage", chunk=512),
    ]
    Q = kt.quantize_fp8_available()
    if Q is not None:
        blobs.append(kvzip.Pipeline([Q("e5m2"), S.ExponentSplit(), S.Top16Pack(), S.EscapeStream(256),
                                     S.Serialize()]).encode(kv(512, ml_dtypes.bfloat16)))
        blobs.append(kvzip.Pipeline([Q("e4m3", "channel"), S.Serialize()]).encode(kv(256, np.float16).reshape(16, 16)))
    return [b.tobytes() for b in blobs]


BASES = _base_blobs()


class Worker:
    """tests/fuzz_worker.py, started on first use and again after it dies."""

    def __init__(self, tmp: Path):
        self.tmp, self.proc = tmp, None

    def start(self):
        paths = []
        for k, b in enumerate(BASES):
            p = self.tmp / f"base{k}.kvz"
            p.write_bytes(b)
            paths.append(str(p))
        env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("fuzz_worker.py")), str(HEADROOM),
                                      *paths], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env)
        line = self._line(600)
        assert line == "READY", f"fuzz worker did not start: {line!r} {self._stderr()}"

    def _line(self, timeout: float) -> str | None:
        """The worker's next line; None if it gives none within timeout; "" if it died."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        return self.proc.stdout.readline().decode().strip()

    def _stderr(self) -> str:
        if self.proc.poll() is None:
            return ""
        return self.proc.stderr.read().decode(errors="replace")[-3000:]

    def decode(self, blob: bytes) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        self.proc.stdin.write((len(blob) + 1).to_bytes(8, "little") + blob)
        self.proc.stdin.flush()
        line = self._line(TIMEOUT_S)
        if not line:  # a hang (no answer in time) or a death (end of its output)
            hung = line is None
            if hung:
                self.proc.kill()
            self.proc.wait()
            why = f"hung for {TIMEOUT_S} s" if hung else f"died with exit status {self.proc.returncode}"
            self.proc = None
            raise AssertionError(f"decoding a {len(blob)}-byte blob {why}; blob = {blob.hex()[:4000]}")
        return json.loads(line)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.write(bytes(8))
            self.proc.stdin.flush()
            self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("fuzz"))
    yield w
    w.stop()


@pytest.fixture(scope="module")
def other_worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("fuzz_other"))
    yield w
    w.stop()


def _check(results: dict, blob: bytes):
    others = {k: v for k, v in results.items() if v[0] == "other"}
    assert not others, f"{others}; blob = {blob.hex()[:4000]}"
    accepted = {k for k, v in results.items() if v[0] == "ok"}
    # The staged pipeline decodes any blob the others do (fuse=False only changes how).
    assert accepted in (set(), set(results)), f"decoders disagree on acceptance: {results}; blob = {blob.hex()[:4000]}"
    if accepted:
        arrays = {tuple(map(str, v[1:])) for k, v in results.items() if k != "info"}
        assert len(arrays) == 1, f"decoders disagree on the result: {results}"
        info, ref = results["info"], results["decompress"]
        assert info[1:3] == ref[1:3], f"info() and decompress disagree: {results}"


def test_worker_reports_what_it_is_given(worker):
    """The harness itself: a base blob decodes everywhere, junk is a FormatError everywhere."""
    ok = worker.decode(BASES[0])
    assert {v[0] for v in ok.values()} == {"ok"}
    for bad in (b"KVZIP\x00\r\n" + bytes(40), b""):
        assert {v[0] for v in worker.decode(bad).values()} == {"FormatError"}


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=not LONG,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(blob=kt.hostile_blobs(BASES))
def test_hostile_blobs_are_rejected_or_decoded_alike(worker, blob):
    _check(worker.decode(blob), blob)


@settings(max_examples=150 if LONG else 15, deadline=None, derandomize=not LONG,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
@given(blobs=st.lists(kt.hostile_blobs(BASES), min_size=24, max_size=24))
def test_answers_do_not_depend_on_what_came_before(worker, other_worker, blobs):
    """Validation is a function of the blob: two processes that saw the same blobs in opposite
    orders (each after its own earlier history) give every blob the same answer."""
    forward = [worker.decode(b) for b in blobs]
    backward = [other_worker.decode(b) for b in reversed(blobs)][::-1]
    for b, f, r in zip(blobs, forward, backward):
        assert f == r, f"{f} != {r}; blob = {b.hex()[:4000]}"
