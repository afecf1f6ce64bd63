"""The console's collector policy (console/heap.py): freezes while snapshots land, one settle after them, young
freezes in the steady state and a full settle at most every FULL_EVERY_S; nothing below MIN_SESSIONS."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvmesh.console import heap


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.timers: list[Callable[[], None]] = []

    def timer(self, delay: float, callback: Callable[[], None]) -> Callable[[], object]:
        self.timers.append(callback)
        return lambda: self.calls.append("timer stopped")


@pytest.fixture
def rec(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    r = Recorder()
    monkeypatch.setattr(heap.gc, "freeze", lambda: r.calls.append("freeze"))
    monkeypatch.setattr(heap.gc, "unfreeze", lambda: r.calls.append("unfreeze"))
    monkeypatch.setattr(heap.gc, "collect", lambda gen=2: r.calls.append(f"collect{gen}"))
    return r


def test_snapshots_freeze_then_settle_once_then_young_freezes(rec: Recorder) -> None:
    """Each snapshot refresh freezes and re-arms one settle; the settle collects all once; after it, a young
    collection and freeze every YOUNG_EVERY_S; a full settle again only FULL_EVERY_S later."""
    now = [0.0]
    s = heap.HeapSettler(lambda: 20_000, clock=lambda: now[0])
    s.after_refresh(True, rec.timer)
    s.after_refresh(True, rec.timer)
    assert rec.calls == ["freeze", "freeze", "timer stopped"] and len(rec.timers) == 2
    rec.calls.clear()
    rec.timers[-1]()
    assert rec.calls == ["unfreeze", "collect2", "freeze"]
    rec.calls.clear()
    for t in (0.5, 1.0, heap.YOUNG_EVERY_S + 0.1, heap.YOUNG_EVERY_S + 0.5):
        now[0] = t
        s.after_refresh(False, rec.timer)
    assert rec.calls == ["collect1", "freeze"]
    rec.calls.clear()
    now[0] = heap.FULL_EVERY_S + 1
    s.after_refresh(False, rec.timer)
    assert rec.calls == ["unfreeze", "collect2", "freeze"]


def test_a_small_console_leaves_the_collector_alone(rec: Recorder) -> None:
    """Below MIN_SESSIONS nothing is frozen or collected."""
    s = heap.HeapSettler(lambda: heap.MIN_SESSIONS - 1)
    s.after_refresh(True, rec.timer)
    s.after_refresh(False, rec.timer)
    assert rec.calls == [] and rec.timers == []
