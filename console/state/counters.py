"""The mesh-wide handoff counters the counters panel shows: warm / partial / cold,
colds from stale state, and handoffs short of their predicted reuse by reason.

A cluster view replaces them unless it comes from another node than the last one taken and counts
fewer handoffs: every node's cluster view sums all its peers' counters, and one that just (re)started
has not heard from its peers yet, so in a mesh of many nodes its total would drop the counters to
a fraction. (The node the counters came from is believed, fewer or not: it reconnected.)
Every live `handoff` event adds to them. Counts are commutative, so (unlike "latest value"
fields) they are never checked for order.
"""

from __future__ import annotations

from kvmesh.console.state.changes import Changes
from kvmesh.node.protocol import Handoff, HandoffCounters


class Counters:
    """Holds the current `HandoffCounters` (a new object after each cluster view)."""

    def __init__(self, changes: Changes) -> None:
        self.handoffs = HandoffCounters()
        self._changes = changes
        self._source = ""  # the node whose cluster view the counters were last taken from

    def apply_view(self, counters: HandoffCounters, source: str = "") -> None:
        if counters.total < self.handoffs.total and source != self._source:
            return
        self._source = source
        self.handoffs = counters.model_copy(deep=True)  # its shortfall dict is counted into

    def on_handoff(self, ev: Handoff) -> None:
        c = self.handoffs
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
