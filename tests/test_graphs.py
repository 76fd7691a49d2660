"""kvzip/gpu/graphs.py's per-thread cache of call shapes: least recently used entries go once
there are more than MAX_SHAPES or their workspaces pass MAX_BYTES, the newest always stays, and
each thread has its own.  And await_word, the host's wait for a word a kernel writes to pinned
memory, against a stand-in stream.  (CallShape itself needs a GPU: tests/gpu covers it.)"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import numpy as np
import pytest

from kvzip.gpu import graphs


def entry(nbytes, settled=None):
    """A stand-in for a cached program: its shape's size, and a settle that notes the entry."""
    e = SimpleNamespace()
    e.shape = SimpleNamespace(nbytes=nbytes, settle=lambda: settled.append(e) if settled is not None else None)
    return e


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    graphs.release()
    monkeypatch.setattr(graphs, "MAX_SHAPES", 3)
    monkeypatch.setattr(graphs, "MAX_BYTES", 100)
    yield
    graphs.release()


def test_built_once_then_reused():
    built = []
    a = graphs.cached("a", lambda: built.append(1) or entry(10))
    assert graphs.cached("a", lambda: built.append(1) or entry(10)) is a
    assert built == [1]


def test_least_recently_used_goes_past_the_count():
    for key in "abc":
        graphs.cached(key, lambda: entry(1))
    graphs.cached("a", lambda: entry(1))  # a is now the most recent
    graphs.cached("d", lambda: entry(1))
    assert len(graphs.entries()) == 3
    rebuilt = []
    for key in "acb":  # a and c survived; b, the least recently used, was dropped
        graphs.cached(key, lambda key=key: rebuilt.append(key) or entry(1))
    assert rebuilt == ["b"]


def test_bytes_cap_drops_old_entries_but_keeps_the_newest():
    graphs.cached("small", lambda: entry(60))
    graphs.cached("big", lambda: entry(70))  # 130 > 100: small goes
    assert [e.shape.nbytes for e in graphs.entries()] == [70]
    graphs.cached("huge", lambda: entry(500))  # alone over the cap: kept, the older one goes
    assert [e.shape.nbytes for e in graphs.entries()] == [500]


def test_dropped_and_released_entries_settle_first():
    """A dropped entry's shape may have a detached call still running: it is settled before its
    workspace goes, as is every entry on release()."""
    settled = []
    small = graphs.cached("small", lambda: entry(60, settled))
    big = graphs.cached("big", lambda: entry(70, settled))
    assert settled == [small]
    graphs.release()
    assert settled == [small, big]


def test_each_thread_has_its_own():
    graphs.cached("a", lambda: entry(1))
    seen = []
    t = threading.Thread(target=lambda: seen.append(len(graphs.entries())))
    t.start()
    t.join()
    assert seen == [0] and len(graphs.entries()) == 1


def test_kept_values_are_per_thread_and_go_with_release(monkeypatch):
    """remember / recall: what a thread keeps (the repeated calls' shortcuts) is its own, is
    dropped by release() with the programs it points at, and nothing is kept or found while
    KEEP is off."""
    assert graphs.recall("decode") is None
    graphs.remember("decode", "d1")
    graphs.remember("encode", "e1")
    graphs.remember("decode", "d2")
    assert (graphs.recall("decode"), graphs.recall("encode")) == ("d2", "e1")
    seen = []
    t = threading.Thread(target=lambda: seen.append(graphs.recall("decode")))
    t.start()
    t.join()
    assert seen == [None]
    graphs.release()
    assert graphs.recall("decode") is None and graphs.recall("encode") is None
    graphs.remember("decode", "d3")
    monkeypatch.setattr(graphs, "KEEP", False)
    assert graphs.recall("decode") is None
    graphs.remember("encode", "e2")
    monkeypatch.setattr(graphs, "KEEP", True)
    assert graphs.recall("decode") == "d3" and graphs.recall("encode") is None


class _Stream:
    """A stand-in for a CUDA stream: the status await_word asks for, and a synchronize that
    raises (as CuPy's does) when the status is an error."""

    def __init__(self, status):
        self.status, self.synced = status, 0

    def synchronize(self):
        self.synced += 1
        if self.status not in (0, graphs._NOT_READY):
            raise RuntimeError(f"cuda error {self.status}")


@pytest.fixture
def stand_in(monkeypatch):
    """await_word asks the stand-in stream for its status; each look gives up the CPU through
    a hook the test may use to play the kernel."""
    looks = []
    monkeypatch.setattr(graphs, "_stream_status", lambda stream: stream.status)
    monkeypatch.setattr(graphs, "_yield_cpu", lambda: looks.append(1))
    return looks


def test_await_word_returns_at_once_on_a_written_word(stand_in):
    words = np.array([0, 7], np.uint64)
    assert graphs.await_word(words, 1, _Stream(graphs._NOT_READY))
    assert not stand_in


def test_await_word_polls_until_the_kernel_writes(monkeypatch, stand_in):
    words = np.zeros(1, np.uint32)
    monkeypatch.setattr(graphs, "_yield_cpu", lambda: stand_in.append(1) or (len(stand_in) == 1000 and words.fill(1)))
    stream = _Stream(graphs._NOT_READY)
    assert graphs.await_word(words, 0, stream)
    assert len(stand_in) == 1000 and stream.synced == 0


def test_await_word_gives_false_when_the_stream_finished_without_the_word(stand_in):
    stream = _Stream(0)
    assert not graphs.await_word(np.zeros(1, np.uint32), 0, stream)
    assert stream.synced == 1 and len(stand_in) == 255  # asked at the 256th look


def test_await_word_raises_a_failed_streams_error(stand_in):
    with pytest.raises(RuntimeError, match="cuda error 700"):
        graphs.await_word(np.zeros(1, np.uint64), 0, _Stream(700))


def test_await_word_with_a_value_waits_for_that_value(monkeypatch, stand_in):
    """A download's flag is the shape's run count: an earlier call's count is not this call's."""
    words = np.array([4], np.uint32)  # the previous call's flag
    monkeypatch.setattr(graphs, "_yield_cpu", lambda: stand_in.append(1) or (len(stand_in) == 10 and words.fill(5)))
    assert graphs.await_word(words, 0, _Stream(graphs._NOT_READY), 5)
    assert len(stand_in) == 10
    assert not graphs.await_word(np.array([4], np.uint32), 0, _Stream(0), 5)  # finished at 4: never 5
