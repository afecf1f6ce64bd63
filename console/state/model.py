"""`ConsoleState`: the one object widgets read, composed of the parts in this package.

It answers for the parts (hosts, sessions, links, counters, the event log, the
console's connections) and hands what arrives to `Stream` (dedupe, pause) and on
to `Router` (which part each event changes). See the package docstring for the rules.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from collections.abc import Set as AbstractSet

from kvmesh.console.format import UNICODE, Glyphs
from kvmesh.console.state.changes import Changes, LinkKey
from kvmesh.console.state.counters import Counters
from kvmesh.console.state.eventlog import EventLog, Level, LogEntry
from kvmesh.console.state.hosts import HostLevel, HostRow, Hosts
from kvmesh.console.state.links import LinkRow, Links
from kvmesh.console.state.nodes import NodeConn, Nodes
from kvmesh.console.state.router import Router
from kvmesh.console.state.sessions import IDLE_AFTER_S, Lifecycle, ReplicaFreshness, SessionRow, Sessions
from kvmesh.console.state.stream import Stream
from kvmesh.node.protocol import Event, HandoffCounters

# A node whose stream is lost keeps its part of the sessions this long (shown on a DISCONNECTED host: a
# restart is back well within it); past it the node is taken as gone and its part is dropped (state/parts.py).
PART_GRACE_S = 120.0


class ConsoleState:
    """The whole mesh as the console knows it. See the package docstring (`kvmesh.console.state`) for the rules."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.time,
        log_cap: int = 1000,
        noisy_log_cap: int = 300,
        glyphs: Glyphs = UNICODE,
        idle_after_s: float = IDLE_AFTER_S,
        part_grace_s: float = PART_GRACE_S,
    ) -> None:
        self.clock = clock
        self.part_grace_s = part_grace_s
        self.glyphs = glyphs
        self.idle_after_s = idle_after_s
        self._changes = Changes()
        self._nodes = Nodes(self._changes, clock)
        self._hosts = Hosts(self._changes, self._nodes)
        self._sessions = Sessions(self._changes, clock, self._hosts)
        self._links = Links(self._changes, clock)
        self._counters = Counters(self._changes)
        self._log = EventLog(self._changes, clock, log_cap, noisy_log_cap)
        self._router = Router(
            self._changes, self._nodes, self._hosts, self._sessions, self._links, self._counters, self._log, clock
        )
        self._stream = Stream(self._apply, self._log, self._changes, clock)

    # ---- what widgets read -------------------------------------------------------

    def threads_of(self, group: str) -> AbstractSet[str]:
        """The conversations of a client session (an affinity group) other than its main one, as known now
        (the main conversation's id is the group's; `SessionRow.group_id` names a row's group)."""
        return self._sessions.threads.of_group.get(group, frozenset())

    def thread_count(self, group: str) -> int:
        """How many conversations of `group` other than its main one are known."""
        return self._sessions.threads.count(group)

    def session_parts(self, sid: str) -> int:
        """How many nodes' cluster views list the session (0: only live events have)."""
        return len(self._sessions.parts.of(sid))

    @property
    def hosts(self) -> dict[str, HostRow]:
        return self._hosts.rows

    @property
    def sessions(self) -> dict[str, SessionRow]:
        return self._sessions.rows

    @property
    def links(self) -> dict[LinkKey, LinkRow]:
        return self._links.rows

    @property
    def counters(self) -> HandoffCounters:
        return self._counters.handoffs

    @property
    def nodes(self) -> dict[str, NodeConn]:
        """The console's connections, by normalized URL."""
        return self._nodes.conns

    @property
    def log(self) -> list[LogEntry]:
        """The main event log, sorted by (ts, order); `log_entries` caps it and merges the noisy ring."""
        return self._log.entries

    @property
    def log_version(self) -> int:
        return self._log.version

    @property
    def lifecycle_counts(self) -> dict[Lifecycle, int]:
        """How many sessions are in each lifecycle state, as of the last tick."""
        return self._sessions.lifecycle_counts

    @property
    def paused(self) -> bool:
        return self._stream.paused

    @property
    def pending_count(self) -> int:
        return len(self._stream.pending)

    @property
    def events_total(self) -> int:
        return self._stream.events_total

    @property
    def duplicates(self) -> int:
        return self._stream.duplicates

    @property
    def bad_frames(self) -> int:
        return self._stream.bad_frames

    @property
    def events_per_s(self) -> float:
        return self._stream.events_per_s

    # ---- connections -----------------------------------------------------------

    def add_node(self, url: str, *, discovered: bool = False) -> NodeConn:
        return self._nodes.add(url, discovered=discovered)

    def node_connected(self, url: str) -> None:
        conn, was_stale = self._nodes.connected(url)
        self._hosts.touch(conn.name)
        if was_stale is not None:
            self.log_console(f"reconnected to {conn.name or conn.url}; rebuilding from its snapshot")

    def node_disconnected(self, url: str, reason: str = "") -> None:
        conn, was_connected = self._nodes.disconnected(url, reason)
        if was_connected:
            self.log_console(
                f"lost {conn.name or conn.url}" + (f": {reason}" if reason else "") + "; reconnecting",
                level="warn",
            )
        self._hosts.touch(conn.name)

    def node_refused(self, url: str, message: str) -> None:
        """The node refused the stream's credentials: said once in the log (again only if what it says changes),
        not a "reconnecting" line per try, since trying again cannot help until the key or the node changes."""
        conn = self._nodes.add(url)
        if conn.error != message:
            self.log_console(message, level="error")
        self._nodes.disconnected(url, message)
        self._hosts.touch(conn.name)

    def connected_count(self) -> tuple[int, int]:
        return self._nodes.connected_count()

    def take_discovered(self) -> dict[str, str]:
        """Peers seen in cluster views (host name -> API URL) that the console has no stream for yet."""
        return self._nodes.take_discovered()

    # ---- ingest ----------------------------------------------------------------

    def feed_frame(self, url: str, data: str | bytes) -> bool:
        """One websocket text frame. Malformed or unknown frames are counted and skipped."""
        return self._stream.feed_frame(url, data)

    def feed(self, url: str, event: Event) -> bool:
        """Accept one parsed event from `url`. Returns False for a duplicate."""
        return self._stream.feed(url, event)

    def pause(self) -> None:
        self._stream.pause()

    def resume(self) -> int:
        """Apply everything queued while paused, in arrival order; returns how many."""
        return self._stream.resume()

    def _apply(self, url: str, event: Event) -> None:
        # Glyphs are read per event, not handed to the router once: the app sets them after construction.
        self._router.apply(url, event, self.glyphs)

    # ---- event log -----------------------------------------------------------------

    def log_console(self, text: str, level: Level = "info", kind: str = "console", ts: float | None = None) -> LogEntry:
        """An entry from the console itself: action requests, results, connection changes."""
        return self._log.add_console(text, level, kind, ts)

    def log_entries(self, include_noisy: bool = False) -> list[LogEntry]:
        """The event log, oldest first, capped at the `log_cap` it was made with."""
        return self._log.merged(include_noisy)

    # ---- periodic ---------------------------------------------------------------------

    def tick(self) -> None:
        """Called on the UI timer: age out link history, update the event rate and the lifecycles."""
        now = self.clock()
        for conn in self._nodes.conns.values():
            if not conn.connected and conn.stale_since is not None and now - conn.stale_since > self.part_grace_s:
                self._router.drop_node(conn, now)
        if self._sessions.update_lifecycles(now, self.idle_after_s):
            self._changes.nodes = True
        self._links.tick(now)
        self._stream.tick(now)

    def take_changes(self) -> Changes:
        return self._changes.take()

    def merge_changes(self, changes: Changes) -> None:
        """Put taken changes back (a view that was not on screen patches them later)."""
        self._changes.merge(changes)

    def touch_session(self, sid: str) -> None:
        """Ask for a session's row to be rendered again (its mark changed, say)."""
        self._sessions.touch(sid)

    def touch_host(self, name: str) -> None:
        self._hosts.touch(name)

    def mark_all_dirty(self) -> None:
        """For a theme or glyph change: every cell must be rendered again."""
        self._changes.full = True
        self._changes.counters = True
        self._changes.log = True
        self._changes.nodes = True

    # ---- derived views ------------------------------------------------------------------

    def lifecycle(self, sid: str) -> Lifecycle:
        """A session's lifecycle as of the last tick (a session new since then is computed now)."""
        return self._sessions.lifecycle(sid, self.idle_after_s)

    def block_size(self, s: SessionRow) -> int:
        """Tokens per block on the session's home (else its replica's) engine; 0 when no node said."""
        return self._sessions.block_size(s)

    def replica_freshness(self, s: SessionRow, now: float | None = None) -> ReplicaFreshness:
        return s.freshness(self.clock() if now is None else now, self.block_size(s))

    def host_names(self) -> list[str]:
        """Hosts in name order: the order never follows load."""
        return self._hosts.names()

    def host_state(self, name: str) -> tuple[str, HostLevel, float | None]:
        """(word, level, stale_since) for a host; the word carries the meaning, not the colour."""
        return self._hosts.state(name)

    def is_stale_host(self, name: str) -> bool:
        return self.host_state(name)[1] == "stale"

    def live_hosts(self) -> list[str]:
        """Hosts a session can be moved to: reachable, not draining, not disconnected."""
        return self._hosts.live()
