"""The event log: the nodes' events and the console's own entries, one line each, in time order.

Entries are kept sorted by (ts, arrival order), so a late event lands where its
time puts it; the log is capped and trimmed in batches. Event types too frequent
for the main log (turns, host status, pushes starting) go to their own, smaller
ring. `describe` is the one place an event becomes a line of text.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kvmesh.console.format import (
    CLASS_WORDS,
    PREDICTION_SHORT,
    SHORTFALL_WORDS,
    UNICODE,
    Glyphs,
    fmt_bytes,
    fmt_seconds,
    fmt_tokens,
)
from kvmesh.console.state.changes import Changes
from kvmesh.node.protocol import (
    DrainCompleted,
    DrainProgress,
    DrainStarted,
    Event,
    Handoff,
    HostStatus,
    MigrateCompleted,
    MigrateStarted,
    PeerDown,
    PeerUp,
    ReplicaEvicted,
    ReplicaImported,
    ReplicaReady,
    ReplicaRefused,
    ReplicaSent,
    ReplicaStarted,
    ReplicaSuperseded,
    TurnFinished,
    TurnStarted,
    Undrained,
)

Level = Literal["info", "ok", "warn", "error"]

# Event types too frequent for the main log: they go to their own, smaller ring
# so a burst of turns never pushes a drain's progress out of the log.
NOISY_TYPES = frozenset({"turn_started", "turn_finished", "host_status", "replica_started"})
# Console-originated log entries (action requests and results) use this as node.
CONSOLE_NODE = "console"


@dataclass(slots=True)
class LogEntry:
    ts: float
    node: str
    seq: int
    kind: str  # event type, or "console" / "action" for the console's own entries
    text: str
    level: Level = "info"
    replay: bool = False
    order: int = 0  # tie-break for equal timestamps: arrival order

    @property
    def sort_key(self) -> tuple[float, int]:
        return (self.ts, self.order)


class EventLog:
    """The main log (sorted, capped at `cap`) and the noisy ring (the last `noisy_cap` entries)."""

    def __init__(self, changes: Changes, clock: Callable[[], float], cap: int, noisy_cap: int) -> None:
        self.cap = cap
        self.noisy_cap = noisy_cap
        self.entries: list[LogEntry] = []  # sorted by (ts, order)
        self.noisy: deque[LogEntry] = deque(maxlen=noisy_cap)
        self.version = 0
        self._changes = changes
        self._clock = clock
        self._order = itertools.count(1)
        self._console_seq = itertools.count(1)

    def add_event(self, ev: Event, glyphs: Glyphs) -> None:
        text, level = describe(ev, glyphs)
        entry = LogEntry(
            ts=ev.ts or self._clock(), node=ev.node, seq=ev.seq, kind=ev.type, text=text,
            level=level, replay=ev.replay, order=next(self._order),
        )
        if ev.type in NOISY_TYPES:
            self.noisy.append(entry)
        else:
            self._insert(entry)
        self.version += 1
        self._changes.log = True

    def add_console(self, text: str, level: Level = "info", kind: str = "console", ts: float | None = None) -> LogEntry:
        """An entry from the console itself: action requests, results, connection changes."""
        entry = LogEntry(
            ts=ts if ts is not None else self._clock(), node=CONSOLE_NODE, seq=next(self._console_seq),
            kind=kind, text=text, level=level, order=next(self._order),
        )
        self._insert(entry)
        self.version += 1
        self._changes.log = True
        return entry

    def _insert(self, entry: LogEntry) -> None:
        log = self.entries
        if not log or entry.sort_key >= log[-1].sort_key:
            log.append(entry)
        else:
            bisect.insort(log, entry, key=lambda e: e.sort_key)  # a late event: keep time order
        if len(log) > self.cap + self.cap // 10:
            del log[: len(log) - self.cap]  # trim in batches, not per entry

    def merged(self, include_noisy: bool = False) -> list[LogEntry]:
        """The event log, oldest first, capped at `cap`."""
        main = self.entries[-self.cap :]
        if not include_noisy or not self.noisy:
            return main
        merged = main + list(self.noisy)
        merged.sort(key=lambda e: e.sort_key)
        return merged


def describe(ev: Event, g: Glyphs = UNICODE) -> tuple[str, Level]:
    """One event as a log line (without time and type, which the log shows in columns)."""
    line = _describe_session_event(ev, g)
    return line if line is not None else _describe_mesh_event(ev, g)


def _describe_session_event(ev: Event, g: Glyphs) -> tuple[str, Level] | None:
    """Turns, handoffs and replicas; None for any other event."""
    a = g.arrow
    if isinstance(ev, TurnStarted):
        return f"{ev.session} on {ev.host}: {fmt_tokens(ev.prompt_tokens)} prompt, {fmt_tokens(ev.cached_tokens)} cached", "info"
    if isinstance(ev, TurnFinished):
        level: Level = "info" if ev.ok else "error"
        return (
            f"{ev.session} on {ev.host}: ttft {fmt_seconds(ev.ttft_s)}, {ev.completion_tokens} tok"
            f" in {fmt_seconds(ev.total_s)}" + ("" if ev.ok else " FAILED")
        ), level
    if isinstance(ev, Handoff):
        word = CLASS_WORDS[ev.cls]
        pct = 100 * ev.reused_tokens / ev.prompt_tokens if ev.prompt_tokens else 100.0
        extra = " (stale state)" if ev.stale_state else ""
        if ev.shortfall in PREDICTION_SHORT:
            extra += f", as predicted: {SHORTFALL_WORDS[ev.shortfall]}"
        elif ev.shortfall != "none":
            extra += f", short of {fmt_tokens(ev.predicted_reused_tokens or 0)} predicted: {SHORTFALL_WORDS[ev.shortfall]}"
        lvl: Level = "ok" if ev.cls == "warm" else ("warn" if ev.cls == "partial" else "error")
        return f"{g.handoff(ev.cls)} {word} {ev.session} {ev.src}{a}{ev.dst} reused {pct:.0f}%{extra}", lvl
    if isinstance(ev, ReplicaStarted):
        return f"{ev.session} {ev.src}{a}{ev.dst} moving: {ev.blocks} blocks offered, {fmt_tokens(ev.tokens)} tok", "info"
    if isinstance(ev, ReplicaSent):
        return (
            f"{ev.session} {ev.src}{a}{ev.dst} {fmt_bytes(ev.bytes)} ({ev.blocks} blocks,"
            f" {fmt_tokens(ev.tokens)} tok) in {fmt_seconds(ev.seconds)}"
        ), "info"
    if isinstance(ev, ReplicaReady):
        where = "engine" if ev.imported else "store"
        return f"{ev.session} ready on {ev.dst} ({where}), {fmt_tokens(ev.tokens)} tok, +{fmt_seconds(ev.lag_s)}", "ok"
    if isinstance(ev, ReplicaImported):
        return f"{ev.session} imported on {ev.host}, {fmt_tokens(ev.tokens)} tok in {fmt_seconds(ev.seconds)}", "info"
    if isinstance(ev, ReplicaEvicted):
        return f"{ev.session} evicted from {ev.host} {ev.where}", "info"
    if isinstance(ev, ReplicaRefused):
        return f"{ev.session} {ev.src}{a}{ev.dst} refused: {ev.reason} {ev.message}".rstrip(), "warn"
    if isinstance(ev, ReplicaSuperseded):
        return f"{ev.session} {ev.src}{a}{ev.dst} superseded", "info"
    return None


def _describe_mesh_event(ev: Event, g: Glyphs) -> tuple[str, Level]:
    """Hosts, peers, drains and migrations."""
    a = g.arrow
    if isinstance(ev, HostStatus):
        h = ev.host
        return f"{h.name} busy {h.busy}/{h.slots} queue {h.queued}", "info"
    if isinstance(ev, PeerUp):
        return f"{ev.peer} is up", "ok"
    if isinstance(ev, PeerDown):
        return f"{ev.peer} is DOWN" + (f": {ev.reason}" if ev.reason else ""), "error"
    if isinstance(ev, DrainStarted):
        return f"drain {ev.host} started: {ev.sessions} sessions to move", "warn"
    if isinstance(ev, DrainProgress):
        return f"drain {ev.host}: {ev.done}/{ev.total} moved", "info"
    if isinstance(ev, DrainCompleted):
        lvl2: Level = "ok" if not ev.failed else "error"
        return f"drain {ev.host} completed: {ev.moved} moved, {ev.failed} failed", lvl2
    if isinstance(ev, Undrained):
        return f"{ev.host} undrained: taking turns again", "ok"
    if isinstance(ev, MigrateStarted):
        return f"migrate {ev.session} {ev.src}{a}{ev.dst} started", "info"
    if isinstance(ev, MigrateCompleted):
        if ev.ok:
            return f"migrate {ev.session} {ev.src}{a}{ev.dst} completed", "ok"
        return f"migrate {ev.session} {ev.src}{a}{ev.dst} FAILED: {ev.message}", "error"
    return ev.type, "info"  # pragma: no cover - every type is handled above

