"""What arrives on the nodes' sockets, on its way to the tables: frames parsed, events
deduplicated by (node, seq), queued while paused, and counted (events, duplicates,
unreadable frames, the event rate).

While paused, events queue in arrival order and are applied in that order on
resume; nothing is dropped. Connection status is not queued (it is `nodes.py`'s,
about the console's own sockets): an operator must see a node go away even when paused.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from pydantic import ValidationError

from kvmesh.console.state.changes import Changes
from kvmesh.console.state.eventlog import EventLog
from kvmesh.console.state.nodes import normalize_url
from kvmesh.node.protocol import PROTOCOL_VERSION, ClusterViewEvent, Event, parse_event

# How many seqs per node the dedupe remembers; a node's replay ring is far
# smaller (2,000), so a seq older than this is not a replay but a restarted node.
DEDUPE_WINDOW = 20_000
# The event rate in the top bar is the mean over this many seconds.
RATE_WINDOW_S = 5.0


class _Dedupe:
    """Remembers which events were seen, per node, in a bounded window of seqs.

    An event is identified by (node, seq), and its `ts` (stamped once, when the
    node published it) tells a replayed copy from a different event that reuses
    the seq: a node that restarts counts from 1 again. Same seq with another ts,
    or a seq far below anything a replay ring could hold, means a new process:
    forget that node's history rather than drop its new events as duplicates.
    """

    def __init__(self, window: int = DEDUPE_WINDOW) -> None:
        self.window = window
        self._seen: dict[str, dict[int, float]] = {}
        self._max: dict[str, int] = {}
        self.restarts = 0

    def first_time(self, node: str, seq: int, ts: float) -> bool:
        if seq <= 0:
            return True  # no identity to dedupe on
        seen = self._seen.get(node)
        if seen is None:
            seen = self._seen[node] = {}
        top = self._max.get(node, 0)
        if seq in seen:
            if seen[seq] == ts:
                return False
            seen = self._reset(node)
        elif seq <= top - self.window:
            seen = self._reset(node)
        seen[seq] = ts
        if seq > self._max.get(node, 0):
            self._max[node] = seq
            if len(seen) > 2 * self.window:
                cutoff = seq - self.window
                self._seen[node] = {k: v for k, v in seen.items() if k > cutoff}
        return True

    def _reset(self, node: str) -> dict[int, float]:
        self.restarts += 1
        self._max[node] = 0
        seen = self._seen[node] = {}
        return seen



class Stream:
    """Every event from every node, before `apply` puts it into the tables."""

    def __init__(
        self, apply: Callable[[str, Event], None], log: EventLog, changes: Changes, clock: Callable[[], float]
    ) -> None:
        self.paused = False
        self.pending: list[tuple[str, Event]] = []
        self.events_total = 0
        self.duplicates = 0
        self.bad_frames = 0
        self.newer_protocol_seen = False
        self.events_per_s = 0.0
        self._apply = apply
        self._log = log
        self._changes = changes
        self._clock = clock
        self._dedupe = _Dedupe()
        self._rate_window: deque[tuple[float, int]] = deque()

    def feed_frame(self, url: str, data: str | bytes) -> bool:
        """One websocket text frame. Malformed or unknown frames are counted and skipped."""
        try:
            event = parse_event(data)
        except ValidationError as exc:
            self.bad_frames += 1
            if self.bad_frames <= 3 or self.bad_frames % 1000 == 0:
                # An unknown type usually means a newer node: say so, without flooding.
                self._log.add_console(f"skipped unreadable event from {url} ({exc.error_count()} errors)", level="warn")
            return False
        return self.feed(url, event)

    def feed(self, url: str, event: Event) -> bool:
        """Accept one parsed event from `url`. Returns False for a duplicate."""
        if not isinstance(event, ClusterViewEvent):
            if not self._dedupe.first_time(event.node, event.seq, event.ts):
                self.duplicates += 1
                return False
        if event.v > PROTOCOL_VERSION and not self.newer_protocol_seen:
            self.newer_protocol_seen = True
            self._log.add_console(
                f"{event.node or url} speaks protocol v{event.v}, this console v{PROTOCOL_VERSION}",
                level="warn",
            )
        if self.paused:
            self.pending.append((normalize_url(url), event))
            self._changes.nodes = True  # the pending count in the header changes
            return True
        self._deliver(normalize_url(url), event)
        return True

    def pause(self) -> None:
        self.paused = True
        self._changes.nodes = True

    def resume(self) -> int:
        """Apply everything queued while paused, in arrival order; returns how many."""
        self.paused = False
        queued, self.pending = self.pending, []
        for url, event in queued:
            self._deliver(url, event)
        self._changes.nodes = True
        return len(queued)

    def _deliver(self, url: str, event: Event) -> None:
        if not isinstance(event, ClusterViewEvent):
            self.events_total += 1
            self._rate_window.append((self._clock(), 1))
        self._apply(url, event)

    def tick(self, now: float) -> None:
        """Update the event rate (the top bar is marked dirty when it changed)."""
        window = RATE_WINDOW_S
        while self._rate_window and self._rate_window[0][0] < now - window:
            self._rate_window.popleft()
        rate = sum(n for _, n in self._rate_window) / window
        if rate != self.events_per_s:
            self.events_per_s = rate
            self._changes.nodes = True
