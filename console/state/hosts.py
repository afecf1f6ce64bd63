"""Hosts as the console shows them: one row per name, upserted, never dropped, never reordered.

A cluster view upserts every host it names and marks the others missing (kept on
screen, shown stale); `host_status`, peer and drain events update a row in place.
`state` turns a row and its node's connection into the word the hosts table shows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from kvmesh.console.state.changes import Changes, advance
from kvmesh.console.state.nodes import Nodes
from kvmesh.node.protocol import (
    DrainCompleted,
    DrainProgress,
    DrainStarted,
    HostInfo,
    HostStatus,
    PeerDown,
    PeerUp,
    Undrained,
)

HostLevel = Literal["ok", "warn", "error", "stale"]


@dataclass(slots=True)
class HostRow:
    name: str
    info: HostInfo
    ts: float = 0.0  # wall time of the data in `info` (display: "missing since")
    last: tuple[str, int] = ("", 0)  # (node, seq) of the last event applied to this row
    drain_done: int = 0
    drain_total: int = 0
    missing: bool = False  # absent from the latest cluster view: kept on screen, shown stale


class Hosts:
    """Every host any cluster view or event named, by name."""

    def __init__(self, changes: Changes, nodes: Nodes) -> None:
        self.rows: dict[str, HostRow] = {}
        self._changes = changes
        self._nodes = nodes

    def apply_view(self, infos: Iterable[HostInfo], ts: float) -> None:
        seen_hosts = set()
        for info in infos:
            seen_hosts.add(info.name)
            row = self.rows.get(info.name)
            if row is None:
                self.rows[info.name] = HostRow(name=info.name, info=info, ts=ts)
            else:
                row.info = info
                row.ts = ts
                row.missing = False
                row.last = ("", 0)  # the cluster view is the new baseline (its node may have restarted)
        for name, row in self.rows.items():
            if name not in seen_hosts:
                row.missing = True  # kept: a host never silently leaves the screen

    def touch(self, name: str | None) -> None:
        """Ask for a host's row to be rendered again."""
        if name and name in self.rows:
            self._changes.hosts.add(name)

    def _host(self, name: str) -> HostRow | None:
        row = self.rows.get(name)
        if row is not None:
            self._changes.hosts.add(name)
        return row

    # ---- per-event handlers ------------------------------------------------------

    def on_host_status(self, ev: HostStatus) -> None:
        row = self.rows.get(ev.host.name)
        if row is None:
            self.rows[ev.host.name] = HostRow(name=ev.host.name, info=ev.host, ts=ev.ts, last=(ev.node, ev.seq))
            self._changes.hosts.add(ev.host.name)
            return
        if advance(row, ev):
            row.info = ev.host
            row.ts = ev.ts
            row.missing = False
            self._changes.hosts.add(ev.host.name)

    def on_peer(self, ev: PeerUp | PeerDown) -> None:
        row = self._host(ev.peer)
        if row is not None and advance(row, ev):
            row.info.reachable = isinstance(ev, PeerUp)

    def on_drain_started(self, ev: DrainStarted) -> None:
        row = self._host(ev.host)
        if row is not None:
            row.info.draining = True
            row.drain_done, row.drain_total = 0, ev.sessions

    def on_drain_progress(self, ev: DrainProgress) -> None:
        row = self._host(ev.host)
        if row is not None:
            row.info.draining = True
            row.drain_done, row.drain_total = ev.done, ev.total

    def on_drain_completed(self, ev: DrainCompleted) -> None:
        row = self._host(ev.host)
        if row is not None:
            row.drain_done = row.drain_total = ev.moved + ev.failed

    def on_undrained(self, ev: Undrained) -> None:
        row = self._host(ev.host)
        if row is not None:
            row.info.draining = False
            row.drain_done = row.drain_total = 0

    # ---- derived views ------------------------------------------------------------------

    def names(self) -> list[str]:
        """Hosts in name order: the order never follows load."""
        return sorted(self.rows)

    def state(self, name: str) -> tuple[str, HostLevel, float | None]:
        """(word, level, stale_since) for a host; the word carries the meaning, not the colour."""
        row = self.rows[name]
        conn = self._nodes.for_host(name)
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

    def live(self) -> list[str]:
        """Hosts a session can be moved to: reachable, not draining, not disconnected."""
        return [n for n in self.names() if self.state(n)[0] == "UP"]

    def block_size(self, *names: str | None) -> int:
        """Tokens per block on the first of these hosts whose engine said; 0 when none did."""
        for name in names:
            row = self.rows.get(name) if name else None
            if row is not None and row.info.block_size > 0:
                return row.info.block_size
        return 0
