"""This host's record of the sessions it served, and its handoff accounting.

Records say what happened here (turns, moves, when the session was last homed
here). They never say what the engine holds: that is asked of the engine.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from kvmesh.node.protocol import HandoffClass, HandoffCounters, ShortfallReason


@dataclass
class SessionRecord:
    session: str
    home_seq: int = 0
    rehomed: bool = False  # a peer is its home now (its stored copy here was made a replica)
    turn_seq: int = 0
    last_turn_at: float = 0.0  # wall time, for display
    turns: int = 0
    moves: int = 0
    last_handoff: HandoffClass | None = None
    last_prompt_tokens: int = 0
    id_source: str = ""  # what named the session in its last turn here (node.api.sessionid)
    group: str = ""  # the client's session id this conversation belongs to (node.mesh.threads)
    opening: str = ""  # what tells it apart within its group (node.mesh.threads signature)


@dataclass(frozen=True)
class HandoffRecord:
    """A turn that moved here: from where, its class, and why it reused less than predicted."""

    src: str
    cls: HandoffClass
    stale: bool = False  # cold although a usable replica was stored here
    shortfall: ShortfallReason = "none"


@dataclass
class LinkCounts:
    warm: int = 0
    partial: int = 0
    cold: int = 0


class SessionBook:
    """Session records (LRU-capped) plus handoff counters: mesh-wide share, per link, per session."""

    def __init__(self, cap: int = 100_000):
        self.records: collections.OrderedDict[str, SessionRecord] = collections.OrderedDict()
        self.cap = cap
        self.counters = HandoffCounters()
        self.links_in: dict[str, LinkCounts] = collections.defaultdict(LinkCounts)  # by source host

    def get(self, session: str) -> SessionRecord:
        rec = self.records.get(session)
        if rec is None:
            rec = self.records[session] = SessionRecord(session)
            while len(self.records) > self.cap:
                self.records.popitem(last=False)
        else:
            self.records.move_to_end(session)
        return rec

    def turn_served(self, session: str, prompt_tokens: int, handoff: HandoffRecord | None, seq: int,
                    source: str = "", group: str = "", opening: str = "") -> SessionRecord:
        """Record a turn that ran here; `handoff` when it moved here."""
        rec = self.get(session)
        rec.id_source = source or rec.id_source
        rec.group = group or rec.group or session
        rec.opening = opening or rec.opening
        rec.turns += 1
        rec.rehomed = False
        rec.turn_seq = max(seq, rec.turn_seq + 1)
        rec.home_seq = max(rec.home_seq, rec.turn_seq)
        rec.last_turn_at = time.time()
        rec.last_prompt_tokens = prompt_tokens
        if handoff is not None:
            src, cls = handoff.src, handoff.cls
            rec.moves += 1
            rec.last_handoff = cls
            c = self.counters
            setattr(c, cls, getattr(c, cls) + 1)
            if handoff.stale and cls == "cold":
                c.stale_state_cold += 1
            c.shortfall[handoff.shortfall] = c.shortfall.get(handoff.shortfall, 0) + 1
            lc = self.links_in[src]
            setattr(lc, cls, getattr(lc, cls) + 1)
        return rec

    def adopt(self, session: str, seq: int) -> None:
        """Make this host the session's home (a migration landed here)."""
        rec = self.get(session)
        rec.rehomed = False
        rec.home_seq = max(rec.home_seq, seq)
