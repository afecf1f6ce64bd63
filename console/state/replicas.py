"""How replica events change a session's replica: pushes starting and landing, refused or
superseded, imports into an engine and evictions. What they feed is `SessionRow.freshness`.

Replicas move whole KV blocks; a push in flight is shown with a progress estimated
from the link's last measured rate, which the caller passes in (links are not ours).
"""

from __future__ import annotations

from collections.abc import Callable

from kvmesh.console.state.changes import advance
from kvmesh.console.state.sessions import SessionRow, Sessions
from kvmesh.node.protocol import (
    ReplicaEvicted,
    ReplicaImported,
    ReplicaReady,
    ReplicaRefused,
    ReplicaStarted,
    ReplicaSuperseded,
)


class Replicas:
    """The replica event handlers, over the sessions table."""

    def __init__(self, sessions: Sessions, clock: Callable[[], float]) -> None:
        self._sessions = sessions
        self._clock = clock

    def on_started(self, ev: ReplicaStarted, blocks_per_s: float | None) -> None:
        """A push began; `blocks_per_s` is the link's last measured rate (None: not measured yet)."""
        s = self._sessions.session(ev.session)
        if not advance(s, ev):
            return
        s.inflight_to, s.inflight_at, s.inflight_tokens = ev.dst, ev.ts or self._clock(), ev.tokens
        s.push_refused = False
        # Only the blocks the target lacks cross the wire: estimate the time from those and the link's rate.
        bs = self._sessions.block_size(s)
        held = s.replica_tokens // bs if bs and s.replica_host == ev.dst else 0
        s.inflight_eta_s = max(1, ev.blocks - held) / blocks_per_s if blocks_per_s else None

    def end_inflight(self, sid: str, dst: str) -> SessionRow | None:
        s = self._sessions.rows.get(sid)
        if s is not None and s.inflight_to == dst:
            s.inflight_to, s.inflight_eta_s = None, None
            self._sessions.changes.sessions.add(sid)
        return s

    def on_refused(self, ev: ReplicaRefused) -> None:
        s = self.end_inflight(ev.session, ev.dst)
        if s is not None and s.replica_host in (ev.dst, None):
            s.push_refused = True  # no transfer is coming: a replica missing blocks is stale now
            self._sessions.changes.sessions.add(ev.session)

    def on_superseded(self, ev: ReplicaSuperseded) -> None:
        self.end_inflight(ev.session, ev.dst)  # a newer push replaces it (its own replica_started follows)

    def on_ready(self, ev: ReplicaReady) -> None:
        s = self._sessions.session(ev.session)
        if advance(s, ev):
            s.replica_host = ev.dst
            s.replica_tokens = ev.tokens
            s.replica_at = ev.ts  # the replica's age is shown in the receiving host's clock
            s.replica_behind_tokens = max(0, s.resident_tokens - ev.tokens)
            s.push_refused = False
            # A turn that ran while it moved can leave it short already: behind from now.
            s.behind_since = (ev.ts or self._clock()) if s.missing_tokens(self._sessions.block_size(s)) > 0 else None
        self.end_inflight(ev.session, ev.dst)

    def on_imported(self, ev: ReplicaImported) -> None:
        s = self._sessions.session(ev.session)
        if s.home == ev.host:
            s.resident_tokens = max(s.resident_tokens, ev.tokens)

    def on_evicted(self, ev: ReplicaEvicted) -> None:
        s = self._sessions.rows.get(ev.session)
        if s is None:
            return
        self._sessions.changes.sessions.add(ev.session)
        if ev.where == "store" and s.replica_host == ev.host:
            s.replica_host = None
            s.replica_tokens = 0
            s.replica_behind_tokens = 0
            s.replica_at = s.behind_since = None
        elif ev.where == "engine" and s.home == ev.host:
            s.resident_tokens = 0
