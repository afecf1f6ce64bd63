"""Where each event goes: a cluster view rebuilds every part, a live event reaches the parts
it touches (a handoff: counters, its link and its session), and every event is logged.

Replayed events (`replay=True`) are already reflected in the cluster view that preceded
them, so they go to the event log only, unless they are newer than the cluster view's
watermark (`ClusterViewEvent.seq` from the same node, when the node sets it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvmesh.console.format import Glyphs
from kvmesh.console.state.changes import Changes
from kvmesh.console.state.counters import Counters
from kvmesh.console.state.eventlog import EventLog
from kvmesh.console.state.hosts import Hosts
from kvmesh.console.state.links import Links
from kvmesh.console.state.nodes import NodeConn, Nodes
from kvmesh.console.state.replicas import Replicas
from kvmesh.console.state.sessions import Sessions
from kvmesh.node.protocol import ClusterView, ClusterViewEvent, Event, Handoff, ReplicaSent, ReplicaStarted


class Router:
    """Applies events (already deduplicated, in order) to the parts of the state."""

    def __init__(
        self, changes: Changes, nodes: Nodes, hosts: Hosts, sessions: Sessions, links: Links, counters: Counters,
        log: EventLog, clock: Callable[[], float],
    ) -> None:
        self.view_ts: float = 0.0
        self._changes = changes
        self._nodes = nodes
        self._hosts = hosts
        self._sessions = sessions
        self._links = links
        self._counters = counters
        self._log = log
        self._replicas = Replicas(sessions, clock)
        self._handlers = self._make_handlers()

    def _make_handlers(self) -> dict[str, Callable[[Any], None]]:
        """The handler for each event type (each takes its own event class, hence `Any`)."""
        h, s, r = self._hosts, self._sessions, self._replicas
        return {
            "turn_started": s.on_turn_started,
            "turn_finished": s.on_turn_finished,
            "handoff": self._on_handoff,
            "replica_started": self._on_replica_started,
            "replica_sent": self._on_replica_sent,
            "replica_refused": r.on_refused,
            "replica_superseded": r.on_superseded,
            "replica_ready": r.on_ready,
            "replica_imported": r.on_imported,
            "replica_evicted": r.on_evicted,
            "host_status": h.on_host_status,
            "peer_up": h.on_peer,
            "peer_down": h.on_peer,
            "drain_started": h.on_drain_started,
            "drain_progress": h.on_drain_progress,
            "drain_completed": h.on_drain_completed,
            "undrained": h.on_undrained,
            "migrate_started": s.on_migrate_started,
            "migrate_completed": s.on_migrate_completed,
        }

    def apply(self, url: str, event: Event, glyphs: Glyphs) -> None:
        """One event from the node at (normalized) `url`; `glyphs` are for its log line."""
        conn = self._nodes.add(url)
        if isinstance(event, ClusterViewEvent):
            self._apply_view(conn, event)
            return
        if event.replay and not self._newer_than_view(conn, event):
            self._log.add_event(event, glyphs)
            return
        handler = self._handlers.get(event.type)
        if handler is not None:
            handler(event)
        self._log.add_event(event, glyphs)

    def _newer_than_view(self, conn: NodeConn, event: Event) -> bool:
        return bool(
            conn.view_seq
            and conn.view_node
            and event.node == conn.view_node
            and event.seq > conn.view_seq
        )

    def _apply_view(self, conn: NodeConn, event: ClusterViewEvent) -> None:
        view: ClusterView = event.cluster
        conn.name = view.node or event.node or conn.name
        conn.view_node = event.node or view.node
        conn.view_seq = event.seq
        self.view_ts = view.ts or event.ts
        ts = self.view_ts
        self._hosts.apply_view(view.hosts, ts)
        for info in view.hosts:
            if info.api:
                self._nodes.maybe_discover(info)
        # Only this node's part of the sessions is replaced: past the directory threshold its cluster view
        # lists what it holds and what it is directory for, never the whole mesh (state/parts.py).
        self._sessions.apply_view(conn.url, conn.name, view.sessions, ts)
        self._links.apply_view(view.links, ts)
        self._counters.apply_view(view.counters, conn.url)
        ch = self._changes
        ch.hosts.update(info.name for info in view.hosts)
        ch.links.update((li.src, li.dst) for li in view.links)
        ch.cluster_view = ch.counters = ch.nodes = True
        part = " (its part: the mesh is past the directory threshold)" if view.scope == "partial" else ""
        self._log.add_console(
            f"snapshot from {conn.name}: {len(view.hosts)} hosts, {len(view.sessions)} sessions{part},"
            f" {len(view.links)} links; {len(self._sessions.rows)} sessions in all",
            ts=event.ts or None,
        )

    def drop_node(self, conn: NodeConn, now: float) -> None:
        """A node gone for good (disconnected past the grace): its part of the sessions goes, the rest stays."""
        if self._sessions.parts.has(conn.url):
            n = self._sessions.drop_part(conn.url, conn.name, now)
            self._log.add_console(f"{conn.name or conn.url} gone; dropped its part ({n} sessions listed)", level="warn")

    # ---- events that touch more than one part ---------------------------------------

    def _on_handoff(self, ev: Handoff) -> None:
        self._counters.on_handoff(ev)
        self._links.on_handoff(ev)
        self._sessions.on_handoff(ev)

    def _on_replica_sent(self, ev: ReplicaSent) -> None:
        self._links.on_replica_sent(ev)
        self._replicas.end_inflight(ev.session, ev.dst)

    def _on_replica_started(self, ev: ReplicaStarted) -> None:
        self._replicas.on_started(ev, self._links.blocks_per_s(ev.src, ev.dst))
