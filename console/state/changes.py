"""What changed since the UI last looked, and the ordering rule every row keeps.

Hosts, sessions, links, counters and the event log all mark what they touch in
one shared `Changes`; the refresh timer takes it (`Changes.take`) and patches
only those rows. `advance` is the "latest value never goes backwards within one
node's stream" rule that host, session and link rows share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.node.protocol import Event

LinkKey = tuple[str, str]


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
    full: bool = False  # every row may have changed (a theme, a layout)
    cluster_view: bool = False  # a node's cluster view was applied (its rows are marked one by one)

    def any(self) -> bool:
        return bool(
            self.hosts or self.sessions or self.removed_sessions or self.links
            or self.counters or self.log or self.nodes or self.full or self.cluster_view
        )

    def take(self) -> Changes:
        """Everything marked so far, as a new object; this one starts empty.

        The parts of the state hold this object and keep marking into it, so it is
        emptied in place rather than replaced (the sets move over, nothing is copied)."""
        taken = Changes(
            hosts=self.hosts, sessions=self.sessions, removed_sessions=self.removed_sessions, links=self.links,
            counters=self.counters, log=self.log, nodes=self.nodes, full=self.full, cluster_view=self.cluster_view,
        )
        self.hosts, self.sessions, self.removed_sessions, self.links = set(), set(), set(), set()
        self.counters = self.log = self.nodes = self.full = self.cluster_view = False
        return taken

    def merge(self, changes: Changes) -> None:
        """Put taken changes back (a view that was not on screen patches them later)."""
        self.hosts |= changes.hosts
        self.sessions |= changes.sessions
        self.removed_sessions |= changes.removed_sessions
        self.links |= changes.links
        self.counters |= changes.counters
        self.log |= changes.log
        self.nodes |= changes.nodes
        self.full |= changes.full
        self.cluster_view |= changes.cluster_view


class Ordered(Protocol):
    """A row holding "latest value" fields: it remembers the last event applied to it."""

    last: tuple[str, int]  # (node, seq)


def is_late(last: tuple[str, int], ev: Event) -> bool:
    """Same node, lower seq than what was applied last: a late event (clocks are not consulted)."""
    return bool(ev.seq) and ev.node == last[0] and ev.seq < last[1]


def advance(row: Ordered, ev: Event) -> bool:
    """True (and remember the event) unless it is late within its node's stream."""
    if is_late(row.last, ev):
        return False
    if ev.seq:
        row.last = (ev.node, ev.seq)
    return True
