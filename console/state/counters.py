"""The mesh-wide handoff counters the counters panel shows: warm / partial / cold,
colds from stale state, and handoffs short of their predicted reuse by reason.

A snapshot replaces them; every live `handoff` event adds to them. Counts are
commutative, so (unlike "latest value" fields) they are never checked for order.
"""

from __future__ import annotations

from kvmesh.console.state.changes import Changes
from kvmesh.node.protocol import Handoff, HandoffCounters


class Counters:
    """Holds the current `HandoffCounters` (a new object after each snapshot)."""

    def __init__(self, changes: Changes) -> None:
        self.handoffs = HandoffCounters()
        self._changes = changes

    def apply_snapshot(self, counters: HandoffCounters) -> None:
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
