"""The console's model of the mesh: plain Python, fed snapshots and events, no Textual.

Everything the screen shows is read from one `ConsoleState`. The ingest side
calls `feed_frame` / `feed` with what arrives on each node's websocket and
`node_connected` / `node_disconnected` as sockets come and go; the UI side reads
the tables here and calls `take_changes()` on its refresh timer to learn which
rows to patch. Keeping it free of Textual means the tricky parts (rebuild on
reconnect, dedupe, replay vs live, out-of-order, pause) are unit-tested directly.

Rules this model keeps:
- A snapshot replaces the mesh-wide picture (hosts are upserted and never dropped,
  sessions absent from it are removed, counters are replaced).
- Events are identified by `(node, seq)` and applied at most once.
- Replayed events (`replay=True`) are already reflected in the snapshot that
  preceded them, so they go to the event log only, unless they are newer than the
  snapshot's watermark (`SnapshotEvent.seq` from the same node, when the node
  sets it). Applying them again would double-count handoffs and roll hosts back
  to older values.
- "Latest value" fields (a host's status, a session's home) never go backwards
  within one node's stream: an event with a lower seq than the last one applied
  from the same node is late and does not overwrite newer state. Across nodes, a
  session's turns are ordered by their turn sequence (`turn_seq`, the mesh's own
  order): a late event of an older turn does not move the home back. Otherwise
  the order is arrival order, never the hosts' clocks (they can be skewed by
  seconds). Counts (handoffs, turns) are commutative and always applied.
- While paused, events queue in arrival order and are applied in that order on
  resume; nothing is dropped. Connection status is not queued: it is about the
  console's own sockets, and an operator must see a node go away even when paused.
- A node whose socket is lost stays, marked DISCONNECTED with the time it went stale.
"""

from __future__ import annotations

import bisect
import itertools
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from pydantic import ValidationError

from kvmesh.console.format import (
    CLASS_WORDS,
    SHORTFALL_WORDS,
    UNICODE,
    Glyphs,
    fmt_bytes,
    fmt_seconds,
    fmt_tokens,
)
from kvmesh.node.protocol import (
    PROTOCOL_VERSION,
    ClusterSnapshot,
    DrainCompleted,
    DrainProgress,
    DrainStarted,
    Event,
    Handoff,
    HandoffCounters,
    HostInfo,
    HostStatus,
    LinkInfo,
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
    SessionInfo,
    SnapshotEvent,
    TurnFinished,
    TurnStarted,
    Undrained,
    parse_event,
)

LinkKey = tuple[str, str]
Level = Literal["info", "ok", "warn", "error"]
HostLevel = Literal["ok", "warn", "error", "stale"]
FreshKind = Literal["fresh", "behind", "inflight", "stale", "none"]
Lifecycle = Literal["running", "idle", "ended"]
LIFECYCLES: tuple[Lifecycle, ...] = ("running", "idle", "ended")

# A replica missing whole blocks is "behind" while a push can still be coming: the
# node pushes after each turn, and a busy link queues pushes by value. Behind for
# longer than this with nothing moving (or refused outright) is "stale".
REPLICA_PUSH_GRACE_S = 60.0
# A session with no turn for longer than this has ended (the default view hides it).
IDLE_AFTER_S = 300.0
# How many seqs per node the dedupe remembers; a node's replay ring is far
# smaller (2,000), so a seq older than this is not a replay but a restarted node.
DEDUPE_WINDOW = 20_000
# Per-second throughput buckets kept per link (the sparkline's history).
LINK_HISTORY_S = 120
# Event types too frequent for the main log: they go to their own, smaller ring
# so a burst of turns never pushes a drain's progress out of the log.
NOISY_TYPES = frozenset({"turn_started", "turn_finished", "host_status", "replica_started"})
# Console-originated log entries (action requests and results) use this as node.
CONSOLE_NODE = "console"


def normalize_url(url: str) -> str:
    """A node's base URL as a key: scheme and host lower-cased, no trailing slash."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    scheme, rest = url.split("://", 1)
    host, sep, path = rest.partition("/")
    return f"{scheme.lower()}://{host.lower()}{sep}{path}"


def _is_late(last: tuple[str, int], ev: Event) -> bool:
    """Same node, lower seq than what was applied last: a late event (clocks are not consulted)."""
    return bool(ev.seq) and ev.node == last[0] and ev.seq < last[1]


@dataclass(slots=True)
class HostRow:
    name: str
    info: HostInfo
    ts: float = 0.0  # wall time of the data in `info` (display: "missing since")
    last: tuple[str, int] = ("", 0)  # (node, seq) of the last event applied to this row
    drain_done: int = 0
    drain_total: int = 0
    missing: bool = False  # absent from the latest snapshot: kept on screen, shown stale


@dataclass(slots=True)
class SessionRow:
    sid: str
    home: str | None = None
    resident_tokens: int = 0
    replica_host: str | None = None
    replica_tokens: int = 0
    replica_behind_tokens: int = 0
    replica_at: float | None = None  # wall time the replica was last written
    last_handoff: str | None = None
    turns: int = 0
    moves: int = 0
    last_turn_at: float = 0.0
    last: tuple[str, int] = ("", 0)  # (node, seq) of the last "latest value" update
    home_seq: int = 0  # turn sequence of the turn that put the session on `home` (the mesh's order)
    active: bool = False  # a turn is running now
    migrating_to: str | None = None
    behind_since: float | None = None  # when the replica began missing whole blocks (None: not known to)
    push_refused: bool = False  # the last push of it was refused: no transfer is coming
    inflight_to: str | None = None  # a push of it is moving to this host...
    inflight_at: float = 0.0  # ...since then,
    inflight_tokens: int = 0  # ...covering this many tokens,
    inflight_eta_s: float | None = None  # ...expected to take this long (the link's last measured rate)

    @classmethod
    def from_info(cls, info: SessionInfo, snap_ts: float) -> SessionRow:
        replica_at = None
        if info.replica_host and info.replica_age_s is not None:
            replica_at = snap_ts - info.replica_age_s
        return cls(
            sid=info.session, home=info.home, resident_tokens=info.resident_tokens,
            replica_host=info.replica_host, replica_tokens=info.replica_tokens,
            replica_behind_tokens=info.replica_behind_tokens, replica_at=replica_at,
            last_handoff=info.last_handoff, turns=info.turns, moves=info.moves,
            last_turn_at=info.last_turn_at, home_seq=info.home_seq,
        )

    def missing_tokens(self, block_size: int) -> int:
        """Tokens of whole blocks the replica lacks; a partial last block is never replicated.

        With the block size unknown (an older node), every token counts."""
        if block_size <= 0:
            return self.replica_behind_tokens
        return max(0, self.resident_tokens // block_size - self.replica_tokens // block_size) * block_size

    def freshness(self, now: float, block_size: int = 0) -> ReplicaFreshness:
        """How usable the replica is (see `ReplicaFreshness`)."""
        if self.inflight_to:
            progress = None
            if self.inflight_eta_s:
                progress = min(0.99, max(0.0, now - self.inflight_at) / self.inflight_eta_s)
            return ReplicaFreshness("inflight", self.inflight_tokens, self.inflight_at, progress)
        if not self.replica_host:
            return ReplicaFreshness("none", 0, None)
        missing = self.missing_tokens(block_size)
        if missing <= 0:
            return ReplicaFreshness("fresh", 0, self.replica_at)
        since = self.behind_since if self.behind_since is not None else self.replica_at
        if self.push_refused or (since is not None and now - since > REPLICA_PUSH_GRACE_S):
            return ReplicaFreshness("stale", missing, since)
        return ReplicaFreshness("behind", missing, since)

    def lifecycle(self, now: float, idle_after_s: float = IDLE_AFTER_S) -> Lifecycle:
        """running: a turn in flight; idle: held somewhere and a turn within `idle_after_s`; else ended."""
        if self.active:
            return "running"
        if self.resident_tokens <= 0 and not self.replica_host:
            return "ended"  # resident nowhere: a next turn would start from scratch anyway
        if not self.last_turn_at or now - self.last_turn_at > idle_after_s:
            return "ended"
        return "idle"


@dataclass(frozen=True, slots=True)
class ReplicaFreshness:
    """A replica's state as the sessions table shows it.

    fresh: holds every whole block of the session (the partial last block never moves);
    behind: whole blocks missing (`tokens`), since `since`, and a push may still come;
    inflight: a push of it is moving now (`tokens` offered, since `since`, `progress` 0-1
    estimated from the link's last measured rate, None when the link has none yet);
    stale: whole blocks missing and no push coming (refused, or none for REPLICA_PUSH_GRACE_S);
    none: no replica. `since` is the replica's write time for fresh.
    """

    kind: FreshKind
    tokens: int
    since: float | None
    progress: float | None = None


@dataclass(slots=True)
class LinkRow:
    src: str
    dst: str
    bytes_sent: int = 0
    transfers: int = 0
    last_transfer_s: float | None = None
    last_transfer_bytes: int | None = None
    last_transfer_at: float | None = None
    last: tuple[str, int] = ("", 0)  # (node, seq) of the last transfer applied
    goodput_gbps: float | None = None
    blocks_per_s: float | None = None  # the last transfer's rate in blocks (estimates in-flight progress)
    snap_bps: float = 0.0  # throughput the node reported in the last snapshot
    snap_ts: float = 0.0
    warm: int = 0
    partial: int = 0
    cold: int = 0
    # bytes per whole wall-clock second, spread over each transfer's duration
    buckets: dict[int, float] = field(default_factory=dict)

    @property
    def key(self) -> LinkKey:
        return (self.src, self.dst)

    def add_transfer(self, end_ts: float, seconds: float, nbytes: int) -> None:
        """Spread a transfer's bytes over the seconds it took, so the sparkline shows a rate."""
        seconds = max(seconds, 1e-3)
        start = end_ts - seconds
        t = start
        while t < end_ts:
            sec = math.floor(t)
            nxt = min(end_ts, sec + 1.0)
            self.buckets[sec] = self.buckets.get(sec, 0.0) + nbytes * (nxt - t) / seconds
            t = nxt

    def history_bps(self, now: float, n: int) -> list[float]:
        """Bits per second for each of the last `n` complete seconds, oldest first."""
        last = math.floor(now) - 1
        return [self.buckets.get(s, 0.0) * 8 for s in range(last - n + 1, last + 1)]

    def now_bps(self, now: float, window: int = 3) -> float:
        """Recent throughput: the mean of the last few seconds, else the snapshot's figure."""
        if self.buckets:
            return sum(self.history_bps(now, window)) / window
        if self.snap_ts and now - self.snap_ts < 10:
            return self.snap_bps
        return 0.0

    def trim(self, now: float) -> None:
        cutoff = math.floor(now) - LINK_HISTORY_S
        for sec in [s for s in self.buckets if s < cutoff]:
            del self.buckets[sec]


@dataclass(slots=True)
class NodeConn:
    """The console's own connection to one node's event stream."""

    url: str
    name: str | None = None  # learned from the node's snapshot
    connected: bool = False
    ever_connected: bool = False
    connected_since: float | None = None
    stale_since: float | None = None  # when the stream was lost (None while connected)
    error: str = ""
    reconnects: int = 0
    snapshot_node: str | None = None
    snapshot_seq: int = 0  # watermark: events from snapshot_node with seq <= this are in the snapshot
    discovered: bool = False


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


@dataclass
class Changes:
    """What changed since the UI last looked; the refresh timer patches only these."""

    hosts: set[str] = field(default_factory=set)
    sessions: set[str] = field(default_factory=set)
    removed_sessions: set[str] = field(default_factory=set)
    links: set[LinkKey] = field(default_factory=set)
    counters: bool = False
    log: bool = False
    nodes: bool = False
    full: bool = False  # a snapshot was applied: every row may have changed

    def any(self) -> bool:
        return bool(
            self.hosts or self.sessions or self.removed_sessions or self.links
            or self.counters or self.log or self.nodes or self.full
        )


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


class ConsoleState:
    """The whole mesh as the console knows it. See the module docstring for the rules."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        log_cap: int = 1000,
        noisy_log_cap: int = 300,
        glyphs: Glyphs = UNICODE,
        idle_after_s: float = IDLE_AFTER_S,
    ) -> None:
        self.clock = clock
        self.glyphs = glyphs
        self.idle_after_s = idle_after_s
        # Each session's lifecycle as of the last tick, and how many are in each state.
        self.lifecycles: dict[str, Lifecycle] = {}
        self.lifecycle_counts: dict[Lifecycle, int] = dict.fromkeys(LIFECYCLES, 0)
        self.hosts: dict[str, HostRow] = {}
        self.sessions: dict[str, SessionRow] = {}
        self.links: dict[LinkKey, LinkRow] = {}
        self.counters = HandoffCounters()
        self.nodes: dict[str, NodeConn] = {}  # by normalized URL
        self.snapshot_ts: float = 0.0
        self.log_cap = log_cap
        self.noisy_log_cap = noisy_log_cap
        self.log: list[LogEntry] = []  # sorted by (ts, order)
        self.noisy_log: deque[LogEntry] = deque(maxlen=noisy_log_cap)
        self.log_version = 0
        self.paused = False
        self.pending: list[tuple[str, Event]] = []
        self.events_total = 0
        self.duplicates = 0
        self.bad_frames = 0
        self.newer_protocol_seen = False
        self._dedupe = _Dedupe()
        self._order = itertools.count(1)
        self._console_seq = itertools.count(1)
        self._changes = Changes()
        self._discovered: dict[str, str] = {}  # host name -> url, not yet connected
        self._rate_window: deque[tuple[float, int]] = deque()
        self.events_per_s = 0.0

    # ---- connections -----------------------------------------------------------

    def add_node(self, url: str, *, discovered: bool = False) -> NodeConn:
        key = normalize_url(url)
        conn = self.nodes.get(key)
        if conn is None:
            conn = self.nodes[key] = NodeConn(url=key, discovered=discovered)
            self._changes.nodes = True
        return conn

    def node_connected(self, url: str) -> None:
        conn = self.add_node(url)
        now = self.clock()
        if conn.ever_connected:
            conn.reconnects += 1
        conn.connected = True
        conn.ever_connected = True
        conn.connected_since = now
        conn.error = ""
        was_stale = conn.stale_since
        conn.stale_since = None
        self._changes.nodes = True
        self._touch_host_of(conn)
        if was_stale is not None:
            self.log_console(f"reconnected to {conn.name or conn.url}; rebuilding from its snapshot")

    def node_disconnected(self, url: str, reason: str = "") -> None:
        conn = self.add_node(url)
        conn.error = reason
        if conn.connected or conn.stale_since is None:
            conn.stale_since = self.clock() if conn.ever_connected else conn.stale_since
        if conn.connected:
            self.log_console(
                f"lost {conn.name or conn.url}" + (f": {reason}" if reason else "") + "; reconnecting",
                level="warn",
            )
        conn.connected = False
        self._changes.nodes = True
        self._touch_host_of(conn)

    def _touch_host_of(self, conn: NodeConn) -> None:
        if conn.name and conn.name in self.hosts:
            self._changes.hosts.add(conn.name)

    def conn_for_host(self, name: str) -> NodeConn | None:
        for conn in self.nodes.values():
            if conn.name == name:
                return conn
        return None

    def connected_count(self) -> tuple[int, int]:
        return sum(1 for c in self.nodes.values() if c.connected), len(self.nodes)

    def take_discovered(self) -> dict[str, str]:
        """Peers seen in snapshots (host name -> API URL) that the console has no stream for yet."""
        found, self._discovered = self._discovered, {}
        return found

    # ---- ingest ----------------------------------------------------------------

    def feed_frame(self, url: str, data: str | bytes) -> bool:
        """One websocket text frame. Malformed or unknown frames are counted and skipped."""
        try:
            event = parse_event(data)
        except ValidationError as exc:
            self.bad_frames += 1
            if self.bad_frames <= 3 or self.bad_frames % 1000 == 0:
                # An unknown type usually means a newer node: say so, without flooding.
                self.log_console(f"skipped unreadable event from {url} ({exc.error_count()} errors)", level="warn")
            return False
        return self.feed(url, event)

    def feed(self, url: str, event: Event) -> bool:
        """Accept one parsed event from `url`. Returns False for a duplicate."""
        if not isinstance(event, SnapshotEvent):
            if not self._dedupe.first_time(event.node, event.seq, event.ts):
                self.duplicates += 1
                return False
        if event.v > PROTOCOL_VERSION and not self.newer_protocol_seen:
            self.newer_protocol_seen = True
            self.log_console(
                f"{event.node or url} speaks protocol v{event.v}, this console v{PROTOCOL_VERSION}",
                level="warn",
            )
        if self.paused:
            self.pending.append((normalize_url(url), event))
            self._changes.nodes = True  # the pending count in the header changes
            return True
        self._apply(normalize_url(url), event)
        return True

    def pause(self) -> None:
        self.paused = True
        self._changes.nodes = True

    def resume(self) -> int:
        """Apply everything queued while paused, in arrival order; returns how many."""
        self.paused = False
        queued, self.pending = self.pending, []
        for url, event in queued:
            self._apply(url, event)
        self._changes.nodes = True
        return len(queued)

    @property
    def pending_count(self) -> int:
        return len(self.pending)

    def _apply(self, url: str, event: Event) -> None:
        conn = self.add_node(url)
        if isinstance(event, SnapshotEvent):
            self._apply_snapshot(conn, event)
            return
        self.events_total += 1
        now = self.clock()
        self._rate_window.append((now, 1))
        if event.replay and not self._newer_than_snapshot(conn, event):
            self._log_event(event)
            return
        handler = _HANDLERS.get(event.type)
        if handler is not None:
            handler(self, event)
        self._log_event(event)

    def _newer_than_snapshot(self, conn: NodeConn, event: Event) -> bool:
        return bool(
            conn.snapshot_seq
            and conn.snapshot_node
            and event.node == conn.snapshot_node
            and event.seq > conn.snapshot_seq
        )

    # ---- snapshots ---------------------------------------------------------------

    def _apply_snapshot(self, conn: NodeConn, event: SnapshotEvent) -> None:
        snap: ClusterSnapshot = event.cluster
        conn.name = snap.node or event.node or conn.name
        conn.snapshot_node = event.node or snap.node
        conn.snapshot_seq = event.seq
        self.snapshot_ts = snap.ts or event.ts
        ts = self.snapshot_ts
        seen_hosts = set()
        for info in snap.hosts:
            seen_hosts.add(info.name)
            row = self.hosts.get(info.name)
            if row is None:
                self.hosts[info.name] = HostRow(name=info.name, info=info, ts=ts)
            else:
                row.info = info
                row.ts = ts
                row.missing = False
                row.last = ("", 0)  # the snapshot is the new baseline (its node may have restarted)
            if info.api:
                self._maybe_discover(info)
        for name, row in self.hosts.items():
            if name not in seen_hosts:
                row.missing = True  # kept: a host never silently leaves the screen
        new_sessions = {si.session: SessionRow.from_info(si, ts) for si in snap.sessions}
        removed = set(self.sessions) - set(new_sessions)
        self.sessions = new_sessions
        self._changes.removed_sessions |= removed
        self._changes.sessions -= removed
        for li in snap.links:
            link = self.links.get((li.src, li.dst))
            if link is None:
                link = self.links[(li.src, li.dst)] = LinkRow(src=li.src, dst=li.dst)
            _link_from_info(link, li, ts)
        self.counters = snap.counters.model_copy(deep=True)  # its shortfall dict is counted into
        self._changes.full = True
        self._changes.counters = True
        self._changes.nodes = True
        self.log_console(
            f"snapshot from {conn.name}: {len(snap.hosts)} hosts, {len(snap.sessions)} sessions,"
            f" {len(snap.links)} links",
            ts=event.ts or None,
        )

    def _maybe_discover(self, info: HostInfo) -> None:
        api = normalize_url(info.api)
        if api in self.nodes or self.conn_for_host(info.name) is not None:
            return
        self._discovered[info.name] = api

    # ---- per-event handlers ------------------------------------------------------

    def _session(self, sid: str) -> SessionRow:
        row = self.sessions.get(sid)
        if row is None:
            row = self.sessions[sid] = SessionRow(sid=sid)
            self._changes.removed_sessions.discard(sid)
        self._changes.sessions.add(sid)
        return row

    def _host(self, name: str) -> HostRow | None:
        row = self.hosts.get(name)
        if row is not None:
            self._changes.hosts.add(name)
        return row

    def _link(self, src: str, dst: str) -> LinkRow:
        row = self.links.get((src, dst))
        if row is None:
            row = self.links[(src, dst)] = LinkRow(src=src, dst=dst)
        self._changes.links.add((src, dst))
        return row

    @staticmethod
    def _move_home(s: SessionRow, host: str) -> None:
        """The session now lives on `host`; a replica that was there became its live cache."""
        s.home = host
        if s.replica_host == host:
            s.replica_host = None
            s.replica_tokens = s.replica_behind_tokens = 0
            s.replica_at = s.behind_since = None
            s.push_refused = False

    @staticmethod
    def _in_turn_order(s: SessionRow, ev: TurnStarted | TurnFinished | Handoff) -> bool:
        """False for an event of an older turn of the session than the one that set its home (a
        turn's events come from the host that ran it, so across hosts they can arrive late)."""
        if ev.turn_seq and ev.turn_seq < s.home_seq:
            return False
        s.home_seq = max(s.home_seq, ev.turn_seq)
        return True

    @staticmethod
    def _advance(row: SessionRow | HostRow | LinkRow, ev: Event) -> bool:
        """True (and remember the event) unless it is late within its node's stream."""
        if _is_late(row.last, ev):
            return False
        if ev.seq:
            row.last = (ev.node, ev.seq)
        return True

    def _on_turn_started(self, ev: TurnStarted) -> None:
        s = self._session(ev.session)
        if self._advance(s, ev) and self._in_turn_order(s, ev):
            self._move_home(s, ev.host)
            s.active = True

    def _on_turn_finished(self, ev: TurnFinished) -> None:
        s = self._session(ev.session)
        s.turns += 1
        if self._advance(s, ev) and self._in_turn_order(s, ev):
            self._move_home(s, ev.host)
            s.active = False
            s.last_turn_at = ev.ts
            if ev.ok:
                s.resident_tokens = ev.prompt_tokens + ev.completion_tokens
            if s.replica_host:
                s.replica_behind_tokens = max(0, s.resident_tokens - s.replica_tokens)
                if s.behind_since is None and s.missing_tokens(self.block_size(s)) > 0:
                    s.behind_since = ev.ts or self.clock()  # this turn left the replica whole blocks short

    def _on_handoff(self, ev: Handoff) -> None:
        c = self.counters
        if ev.cls == "warm":
            c.warm += 1
        elif ev.cls == "partial":
            c.partial += 1
        else:
            c.cold += 1
        if ev.stale_state:
            c.stale_state_cold += 1
        c.shortfall[ev.shortfall] = c.shortfall.get(ev.shortfall, 0) + 1
        self._changes.counters = True
        link = self._link(ev.src, ev.dst)
        setattr(link, ev.cls, getattr(link, ev.cls) + 1)
        s = self._session(ev.session)
        s.moves += 1
        if self._advance(s, ev) and self._in_turn_order(s, ev):
            s.last_handoff = ev.cls
            self._move_home(s, ev.dst)

    def _on_replica_sent(self, ev: ReplicaSent) -> None:
        link = self._link(ev.src, ev.dst)
        link.bytes_sent += ev.bytes
        link.transfers += 1
        if self._advance(link, ev):
            link.last_transfer_at = ev.ts
            link.last_transfer_s = ev.seconds
            link.last_transfer_bytes = ev.bytes
            link.goodput_gbps = ev.bytes * 8 / ev.seconds / 1e9 if ev.seconds > 0 else None
            if ev.seconds > 0 and ev.blocks > 0:
                link.blocks_per_s = ev.blocks / ev.seconds
        link.add_transfer(ev.ts or self.clock(), ev.seconds, ev.bytes)
        self._end_inflight(ev.session, ev.dst)

    def _on_replica_started(self, ev: ReplicaStarted) -> None:
        s = self._session(ev.session)
        if not self._advance(s, ev):
            return
        s.inflight_to, s.inflight_at, s.inflight_tokens = ev.dst, ev.ts or self.clock(), ev.tokens
        s.push_refused = False
        # Only the blocks the target lacks cross the wire: estimate the time from those and the link's rate.
        rate = self.links[(ev.src, ev.dst)].blocks_per_s if (ev.src, ev.dst) in self.links else None
        bs = self.block_size(s)
        held = s.replica_tokens // bs if bs and s.replica_host == ev.dst else 0
        s.inflight_eta_s = max(1, ev.blocks - held) / rate if rate else None

    def _end_inflight(self, sid: str, dst: str) -> SessionRow | None:
        s = self.sessions.get(sid)
        if s is not None and s.inflight_to == dst:
            s.inflight_to, s.inflight_eta_s = None, None
            self._changes.sessions.add(sid)
        return s

    def _on_replica_refused(self, ev: ReplicaRefused) -> None:
        s = self._end_inflight(ev.session, ev.dst)
        if s is not None and s.replica_host in (ev.dst, None):
            s.push_refused = True  # no transfer is coming: a replica missing blocks is stale now
            self._changes.sessions.add(ev.session)

    def _on_replica_superseded(self, ev: ReplicaSuperseded) -> None:
        self._end_inflight(ev.session, ev.dst)  # a newer push replaces it (its own replica_started follows)

    def _on_replica_ready(self, ev: ReplicaReady) -> None:
        s = self._session(ev.session)
        if self._advance(s, ev):
            s.replica_host = ev.dst
            s.replica_tokens = ev.tokens
            s.replica_at = ev.ts  # the replica's age is shown in the receiving host's clock
            s.replica_behind_tokens = max(0, s.resident_tokens - ev.tokens)
            s.push_refused = False
            # A turn that ran while it moved can leave it short already: behind from now.
            s.behind_since = (ev.ts or self.clock()) if s.missing_tokens(self.block_size(s)) > 0 else None
        self._end_inflight(ev.session, ev.dst)

    def _on_replica_imported(self, ev: ReplicaImported) -> None:
        s = self._session(ev.session)
        if s.home == ev.host:
            s.resident_tokens = max(s.resident_tokens, ev.tokens)

    def _on_replica_evicted(self, ev: ReplicaEvicted) -> None:
        s = self.sessions.get(ev.session)
        if s is None:
            return
        self._changes.sessions.add(ev.session)
        if ev.where == "store" and s.replica_host == ev.host:
            s.replica_host = None
            s.replica_tokens = 0
            s.replica_behind_tokens = 0
            s.replica_at = s.behind_since = None
        elif ev.where == "engine" and s.home == ev.host:
            s.resident_tokens = 0

    def _on_host_status(self, ev: HostStatus) -> None:
        row = self.hosts.get(ev.host.name)
        if row is None:
            self.hosts[ev.host.name] = HostRow(name=ev.host.name, info=ev.host, ts=ev.ts, last=(ev.node, ev.seq))
            self._changes.hosts.add(ev.host.name)
            return
        if self._advance(row, ev):
            row.info = ev.host
            row.ts = ev.ts
            row.missing = False
            self._changes.hosts.add(ev.host.name)

    def _on_peer(self, ev: PeerUp | PeerDown) -> None:
        row = self._host(ev.peer)
        if row is not None and self._advance(row, ev):
            row.info.reachable = isinstance(ev, PeerUp)

    def _on_drain_started(self, ev: DrainStarted) -> None:
        row = self._host(ev.host)
        if row is not None:
            row.info.draining = True
            row.drain_done, row.drain_total = 0, ev.sessions

    def _on_drain_progress(self, ev: DrainProgress) -> None:
        row = self._host(ev.host)
        if row is not None:
            row.info.draining = True
            row.drain_done, row.drain_total = ev.done, ev.total

    def _on_drain_completed(self, ev: DrainCompleted) -> None:
        row = self._host(ev.host)
        if row is not None:
            row.drain_done = row.drain_total = ev.moved + ev.failed

    def _on_undrained(self, ev: Undrained) -> None:
        row = self._host(ev.host)
        if row is not None:
            row.info.draining = False
            row.drain_done = row.drain_total = 0

    def _on_migrate_started(self, ev: MigrateStarted) -> None:
        self._session(ev.session).migrating_to = ev.dst

    def _on_migrate_completed(self, ev: MigrateCompleted) -> None:
        s = self._session(ev.session)
        s.migrating_to = None
        if ev.ok:
            s.moves += 1
            if self._advance(s, ev):
                self._move_home(s, ev.dst)

    # ---- event log -----------------------------------------------------------------

    def _log_event(self, ev: Event) -> None:
        text, level = describe(ev, self.glyphs)
        entry = LogEntry(
            ts=ev.ts or self.clock(), node=ev.node, seq=ev.seq, kind=ev.type, text=text,
            level=level, replay=ev.replay, order=next(self._order),
        )
        if ev.type in NOISY_TYPES:
            self.noisy_log.append(entry)
        else:
            self._insert_log(entry)
        self.log_version += 1
        self._changes.log = True

    def log_console(self, text: str, level: Level = "info", kind: str = "console", ts: float | None = None) -> LogEntry:
        """An entry from the console itself: action requests, results, connection changes."""
        entry = LogEntry(
            ts=ts if ts is not None else self.clock(), node=CONSOLE_NODE, seq=next(self._console_seq),
            kind=kind, text=text, level=level, order=next(self._order),
        )
        self._insert_log(entry)
        self.log_version += 1
        self._changes.log = True
        return entry

    def _insert_log(self, entry: LogEntry) -> None:
        if not self.log or entry.sort_key >= self.log[-1].sort_key:
            self.log.append(entry)
        else:
            bisect.insort(self.log, entry, key=lambda e: e.sort_key)  # a late event: keep time order
        if len(self.log) > self.log_cap + self.log_cap // 10:
            del self.log[: len(self.log) - self.log_cap]  # trim in batches, not per entry

    def log_entries(self, include_noisy: bool = False) -> list[LogEntry]:
        """The event log, oldest first, capped at log_cap."""
        main = self.log[-self.log_cap :]
        if not include_noisy or not self.noisy_log:
            return main
        merged = main + list(self.noisy_log)
        merged.sort(key=lambda e: e.sort_key)
        return merged

    # ---- periodic ---------------------------------------------------------------------

    def tick(self) -> None:
        """Called on the UI timer: age out link history, update the event rate and the lifecycles."""
        now = self.clock()
        self._update_lifecycles(now)
        for link in self.links.values():
            if link.buckets:
                link.trim(now)
                self._changes.links.add(link.key)  # the sparkline moves with time
        window = 5.0
        while self._rate_window and self._rate_window[0][0] < now - window:
            self._rate_window.popleft()
        rate = sum(n for _, n in self._rate_window) / window
        if rate != self.events_per_s:
            self.events_per_s = rate
            self._changes.nodes = True

    def _update_lifecycles(self, now: float) -> None:
        """Re-derive every session's lifecycle (time alone ends a session); changed rows are marked dirty."""
        old = self.lifecycles
        new: dict[str, Lifecycle] = {}
        counts: dict[Lifecycle, int] = dict.fromkeys(LIFECYCLES, 0)
        idle_after = self.idle_after_s
        dirty = self._changes.sessions
        for sid, row in self.sessions.items():
            life = row.lifecycle(now, idle_after)
            new[sid] = life
            counts[life] += 1
            if old.get(sid) != life:
                dirty.add(sid)
        self.lifecycles = new
        if counts != self.lifecycle_counts:
            self.lifecycle_counts = counts
            self._changes.nodes = True

    def lifecycle(self, sid: str) -> Lifecycle:
        """A session's lifecycle as of the last tick (a session new since then is computed now)."""
        life = self.lifecycles.get(sid)
        if life is None:
            row = self.sessions.get(sid)
            return row.lifecycle(self.clock(), self.idle_after_s) if row is not None else "ended"
        return life

    def block_size(self, s: SessionRow) -> int:
        """Tokens per block on the session's home (else its replica's) engine; 0 when no node said."""
        for name in (s.home, s.replica_host):
            row = self.hosts.get(name) if name else None
            if row is not None and row.info.block_size > 0:
                return row.info.block_size
        return 0

    def replica_freshness(self, s: SessionRow, now: float | None = None) -> ReplicaFreshness:
        return s.freshness(self.clock() if now is None else now, self.block_size(s))

    def take_changes(self) -> Changes:
        changes, self._changes = self._changes, Changes()
        return changes

    def merge_changes(self, changes: Changes) -> None:
        """Put taken changes back (a view that was not on screen patches them later)."""
        c = self._changes
        c.hosts |= changes.hosts
        c.sessions |= changes.sessions
        c.removed_sessions |= changes.removed_sessions
        c.links |= changes.links
        c.counters |= changes.counters
        c.log |= changes.log
        c.nodes |= changes.nodes
        c.full |= changes.full

    def touch_session(self, sid: str) -> None:
        """Ask for a session's row to be rendered again (its mark changed, say)."""
        if sid in self.sessions:
            self._changes.sessions.add(sid)

    def touch_host(self, name: str) -> None:
        if name in self.hosts:
            self._changes.hosts.add(name)

    def mark_all_dirty(self) -> None:
        """For a theme or glyph change: every cell must be rendered again."""
        self._changes.full = True
        self._changes.counters = True
        self._changes.log = True
        self._changes.nodes = True

    # ---- derived views ------------------------------------------------------------------

    def host_names(self) -> list[str]:
        """Hosts in name order: the order never follows load."""
        return sorted(self.hosts)

    def host_state(self, name: str) -> tuple[str, HostLevel, float | None]:
        """(word, level, stale_since) for a host; the word carries the meaning, not the colour."""
        row = self.hosts[name]
        conn = self.conn_for_host(name)
        if conn is not None and conn.ever_connected and not conn.connected:
            return "DISCONNECTED", "stale", conn.stale_since
        if row.missing:
            return "MISSING", "stale", row.info.last_seen or row.ts
        if not row.info.reachable:
            return "UNREACHABLE", "error", row.info.last_seen or None
        if row.info.draining:
            if row.drain_total:
                return f"DRAIN {row.drain_done}/{row.drain_total}", "warn", None
            return "DRAINING", "warn", None
        return "UP", "ok", None

    def is_stale_host(self, name: str) -> bool:
        return self.host_state(name)[1] == "stale"

    def live_hosts(self) -> list[str]:
        """Hosts a session can be moved to: reachable, not draining, not disconnected."""
        return [n for n in self.host_names() if self.host_state(n)[0] == "UP"]



def _link_from_info(row: LinkRow, info: LinkInfo, ts: float) -> None:
    row.last = ("", 0)  # the snapshot is the new baseline
    row.bytes_sent = info.bytes_sent
    row.transfers = info.transfers
    row.last_transfer_s = info.last_transfer_s
    row.last_transfer_bytes = info.last_transfer_bytes
    row.goodput_gbps = info.goodput_gbps
    row.snap_bps = info.throughput_bps
    row.snap_ts = ts
    row.warm, row.partial, row.cold = info.warm, info.partial, info.cold


_HANDLERS: dict[str, Callable[[ConsoleState, Event], None]] = {
    "turn_started": ConsoleState._on_turn_started,  # type: ignore[dict-item]
    "turn_finished": ConsoleState._on_turn_finished,  # type: ignore[dict-item]
    "handoff": ConsoleState._on_handoff,  # type: ignore[dict-item]
    "replica_started": ConsoleState._on_replica_started,  # type: ignore[dict-item]
    "replica_sent": ConsoleState._on_replica_sent,  # type: ignore[dict-item]
    "replica_refused": ConsoleState._on_replica_refused,  # type: ignore[dict-item]
    "replica_superseded": ConsoleState._on_replica_superseded,  # type: ignore[dict-item]
    "replica_ready": ConsoleState._on_replica_ready,  # type: ignore[dict-item]
    "replica_imported": ConsoleState._on_replica_imported,  # type: ignore[dict-item]
    "replica_evicted": ConsoleState._on_replica_evicted,  # type: ignore[dict-item]
    "host_status": ConsoleState._on_host_status,  # type: ignore[dict-item]
    "peer_up": ConsoleState._on_peer,  # type: ignore[dict-item]
    "peer_down": ConsoleState._on_peer,  # type: ignore[dict-item]
    "drain_started": ConsoleState._on_drain_started,  # type: ignore[dict-item]
    "drain_progress": ConsoleState._on_drain_progress,  # type: ignore[dict-item]
    "drain_completed": ConsoleState._on_drain_completed,  # type: ignore[dict-item]
    "undrained": ConsoleState._on_undrained,  # type: ignore[dict-item]
    "migrate_started": ConsoleState._on_migrate_started,  # type: ignore[dict-item]
    "migrate_completed": ConsoleState._on_migrate_completed,  # type: ignore[dict-item]
}


def describe(ev: Event, g: Glyphs = UNICODE) -> tuple[str, Level]:
    """One event as a log line (without time and type, which the log shows in columns)."""
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
        if ev.shortfall != "none":
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

