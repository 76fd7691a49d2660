"""stages/call_graphs.py's per-thread cache of call shapes: least recently used entries go once
there are more than MAX_SHAPES or their workspaces pass MAX_BYTES, the newest always stays, and
each thread has its own.  (CallShape itself needs a GPU: tests/gpu covers it.)"""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from kvzip.stages import call_graphs


def entry(nbytes):
    return SimpleNamespace(shape=SimpleNamespace(nbytes=nbytes))


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    call_graphs.release()
    monkeypatch.setattr(call_graphs, "MAX_SHAPES", 3)
    monkeypatch.setattr(call_graphs, "MAX_BYTES", 100)
    yield
    call_graphs.release()


def test_built_once_then_reused():
    built = []
    a = call_graphs.cached("a", lambda: built.append(1) or entry(10))
    assert call_graphs.cached("a", lambda: built.append(1) or entry(10)) is a
    assert built == [1]


def test_least_recently_used_goes_past_the_count():
    for key in "abc":
        call_graphs.cached(key, lambda: entry(1))
    call_graphs.cached("a", lambda: entry(1))  # a is now the most recent
    call_graphs.cached("d", lambda: entry(1))
    assert len(call_graphs.entries()) == 3
    rebuilt = []
    for key in "acb":  # a and c survived; b, the least recently used, was dropped
        call_graphs.cached(key, lambda key=key: rebuilt.append(key) or entry(1))
    assert rebuilt == ["b"]


def test_bytes_cap_drops_old_entries_but_keeps_the_newest():
    call_graphs.cached("small", lambda: entry(60))
    call_graphs.cached("big", lambda: entry(70))  # 130 > 100: small goes
    assert [e.shape.nbytes for e in call_graphs.entries()] == [70]
    call_graphs.cached("huge", lambda: entry(500))  # alone over the cap: kept, the older one goes
    assert [e.shape.nbytes for e in call_graphs.entries()] == [500]


def test_each_thread_has_its_own():
    call_graphs.cached("a", lambda: entry(1))
    seen = []
    t = threading.Thread(target=lambda: seen.append(len(call_graphs.entries())))
    t.start()
    t.join()
    assert seen == [0] and len(call_graphs.entries()) == 1
