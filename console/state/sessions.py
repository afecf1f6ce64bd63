"""Sessions: one row per session id, where it lives, its lifecycle and its replica's freshness.

Every node's cluster view is one part of the table (`parts.py`: past the directory threshold no node
lists every session); a cluster view replaces its own source's part and re-derives only the sessions
that part named (or that the console has living on that node), so what other nodes said stays. A
session no part lists and no live event vouches for is removed. Turn, handoff and migrate events
move a session's home. Across nodes a session's turns
are ordered by their turn sequence (`turn_seq`), so a late event of an older turn
does not move the home back. Lifecycles (running / idle / ended) are re-derived on
the UI's tick, since time alone ends a session. Replica events are `replicas.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

from kvmesh.console.state.changes import Changes, advance
from kvmesh.console.state.hosts import Hosts
from kvmesh.console.state.parts import SessionParts
from kvmesh.console.state.threads import Threads, group_id
from kvmesh.node.protocol import (
    Handoff,
    MigrateCompleted,
    MigrateStarted,
    SessionInfo,
    TurnFinished,
    TurnStarted,
    merge_session_parts,
)

FreshKind = Literal["fresh", "behind", "inflight", "stale", "none"]
Lifecycle = Literal["running", "idle", "ended"]
LIFECYCLES: tuple[Lifecycle, ...] = ("running", "idle", "ended")

# A replica missing whole blocks is "behind" while a push can still be coming: the
# node pushes after each turn, and a busy link queues pushes by value. Behind for
# longer than this with nothing moving (or refused outright) is "stale".
REPLICA_PUSH_GRACE_S = 60.0
# A session with no turn for longer than this has ended (the default view hides it).
IDLE_AFTER_S = 300.0
# Every row's lifecycle is re-derived this often (rows events touch, every tick): time alone only ends one.
LIFECYCLE_SWEEP_S = 2.0


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
    id_source: str = ""  # what the client sent that named it (a header, a body field, or "digest")
    # The client session (affinity group) it is a conversation of, as a cluster view said ("": an older node, its
    # own); None: seen only live, placed by its key's form (`threads.py`). `group_id` is the answer.
    group: str | None = None
    from_live: bool = False  # made by a live event, not (yet) listed by any node's cluster view

    @classmethod
    def from_info(cls, info: SessionInfo, view_ts: float) -> SessionRow:
        replica_at = None
        if info.replica_host and info.replica_age_s is not None:
            replica_at = view_ts - info.replica_age_s
        return cls(
            sid=info.session, home=info.home, resident_tokens=info.resident_tokens,
            replica_host=info.replica_host, replica_tokens=info.replica_tokens,
            replica_behind_tokens=info.replica_behind_tokens, replica_at=replica_at,
            last_handoff=info.last_handoff, turns=info.turns, moves=info.moves,
            last_turn_at=info.last_turn_at, home_seq=info.home_seq, id_source=info.id_source, group=info.group,
        )

    @property
    def group_id(self) -> str:
        """The client session it is a conversation of (itself for a main conversation, see `threads.py`)."""
        return group_id(self.sid, self.group)

    @property
    def is_thread(self) -> bool:
        """A conversation of a group other than its main one (a subagent's, a side request)."""
        return self.group_id != self.sid

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


def _move_home(s: SessionRow, host: str) -> None:
    """The session now lives on `host`; a replica that was there became its live cache."""
    s.home = host
    if s.replica_host == host:
        s.replica_host = None
        s.replica_tokens = s.replica_behind_tokens = 0
        s.replica_at = s.behind_since = None
        s.push_refused = False


def _in_turn_order(s: SessionRow, ev: TurnStarted | TurnFinished | Handoff) -> bool:
    """False for an event of an older turn of the session than the one that set its home (a
    turn's events come from the host that ran it, so across hosts they can arrive late)."""
    if ev.turn_seq and ev.turn_seq < s.home_seq:
        return False
    s.home_seq = max(s.home_seq, ev.turn_seq)
    return True


class Sessions:
    """Every session the mesh holds (or held, until the next cluster view), by id."""

    def __init__(self, changes: Changes, clock: Callable[[], float], hosts: Hosts) -> None:
        self.rows: dict[str, SessionRow] = {}
        self.parts = SessionParts()
        self.threads = Threads()  # each group's conversations other than its main
        # Each session's lifecycle as of the last tick, and how many are in each state.
        self.lifecycles: dict[str, Lifecycle] = {}
        self.lifecycle_counts: dict[Lifecycle, int] = dict.fromkeys(LIFECYCLES, 0)
        self._swept_at = float("-inf")  # when every row's lifecycle was last re-derived
        self.changes = changes
        self._clock = clock
        self._hosts = hosts

    def apply_view(self, source: str, host: str | None, infos: Iterable[SessionInfo], ts: float) -> int:
        """`source`'s cluster view (from the node named `host`) is its part now; returns how many rows changed."""
        again = self.parts.has(source)
        affected = self.parts.replace(source, infos, ts)
        if again and host:
            # A node that comes back may have forgotten sessions the console saw live on it.
            affected |= {sid for sid, row in self.rows.items() if row.home == host}
        for sid in affected:
            self._rebuild(sid, host, ts)
        return len(affected)

    def drop_part(self, source: str, host: str | None, now: float) -> int:
        """The node at `source` left: its part goes, and with it only what no other part lists."""
        affected = self.parts.drop(source)
        for sid in affected:
            self._rebuild(sid, host, now)
        return len(affected)

    def _rebuild(self, sid: str, host: str | None, ts: float) -> None:
        """Re-derive one session's row from every part that lists it (see the module docstring)."""
        pairs = self.parts.of(sid)
        old = self.rows.get(sid)
        if not pairs:
            if old is not None and (not old.from_live or old.home in (None, host)):
                del self.rows[sid]
                self.changes.removed_sessions.add(sid)
                self.changes.sessions.discard(sid)
                self._regroup(self.threads.remove(sid))
            return
        # One part (a small mesh, or the first node to list it): that node's view is the merge.
        info = pairs[0][0] if len(pairs) == 1 else merge_session_parts(pairs, ts)
        new = SessionRow.from_info(info, pairs[0][1] if len(pairs) == 1 else ts)
        if old is not None:
            if old.home_seq > new.home_seq:
                if old.group != new.group:  # ...but a cluster view is the only word on its group
                    old.group = new.group
                    self._regroup(self.threads.set(sid, old.group_id))
                    self.changes.sessions.add(sid)
                return  # live events have moved it past what any cluster view says
            if old.home == new.home and new.home != host:
                new.active = old.active  # a cluster view from another node says nothing of a turn running there
            new.migrating_to = old.migrating_to
            if old.inflight_to:
                new.inflight_to, new.inflight_at = old.inflight_to, old.inflight_at
                new.inflight_tokens, new.inflight_eta_s = old.inflight_tokens, old.inflight_eta_s
        self.rows[sid] = new
        self.changes.sessions.add(sid)
        self.changes.removed_sessions.discard(sid)
        self._regroup(self.threads.set(sid, new.group_id))

    def _regroup(self, groups: list[str]) -> None:
        """These groups gained or lost a thread: their main rows count them, so they are drawn again."""
        for g in groups:
            self.touch(g)

    def session(self, sid: str) -> SessionRow:
        """The session's row, created if new, marked to be rendered again."""
        row = self.rows.get(sid)
        if row is None:
            row = self.rows[sid] = SessionRow(sid=sid, from_live=True)
            self.changes.removed_sessions.discard(sid)
            self._regroup(self.threads.set(sid, row.group_id))
        self.changes.sessions.add(sid)
        return row

    def touch(self, sid: str) -> None:
        """Ask for a session's row to be rendered again (its mark changed, say)."""
        if sid in self.rows:
            self.changes.sessions.add(sid)

    def block_size(self, s: SessionRow) -> int:
        """Tokens per block on the session's home (else its replica's) engine; 0 when no node said."""
        return self._hosts.block_size(s.home, s.replica_host)

    # ---- per-event handlers ------------------------------------------------------

    def on_turn_started(self, ev: TurnStarted) -> None:
        s = self.session(ev.session)
        if advance(s, ev) and _in_turn_order(s, ev):
            _move_home(s, ev.host)
            s.active = True

    def on_turn_finished(self, ev: TurnFinished) -> None:
        s = self.session(ev.session)
        s.turns += 1
        if advance(s, ev) and _in_turn_order(s, ev):
            _move_home(s, ev.host)
            s.active = False
            s.last_turn_at = ev.ts
            if ev.ok:
                s.resident_tokens = ev.prompt_tokens + ev.completion_tokens
            if s.replica_host:
                s.replica_behind_tokens = max(0, s.resident_tokens - s.replica_tokens)
                if s.behind_since is None and s.missing_tokens(self.block_size(s)) > 0:
                    s.behind_since = ev.ts or self._clock()  # this turn left the replica whole blocks short

    def on_handoff(self, ev: Handoff) -> None:
        s = self.session(ev.session)
        s.moves += 1
        if advance(s, ev) and _in_turn_order(s, ev):
            s.last_handoff = ev.cls
            _move_home(s, ev.dst)

    def on_migrate_started(self, ev: MigrateStarted) -> None:
        self.session(ev.session).migrating_to = ev.dst

    def on_migrate_completed(self, ev: MigrateCompleted) -> None:
        s = self.session(ev.session)
        s.migrating_to = None
        if ev.ok:
            s.moves += 1
            if advance(s, ev):
                _move_home(s, ev.dst)

    # ---- lifecycles -----------------------------------------------------------------

    def update_lifecycles(self, now: float, idle_after: float) -> bool:
        """Re-derive lifecycles (changed rows are marked dirty); True when the counts per state changed.

        Events mark the rows they change, so each tick re-derives those; time alone only ends an idle
        session (minutes), so every row is looked at once per LIFECYCLE_SWEEP_S, not every tick: at
        20,000 sessions a walk of all of them is ~40 ms."""
        if now - self._swept_at >= LIFECYCLE_SWEEP_S or now < self._swept_at:
            self._swept_at = now
            return self._sweep(now, idle_after)
        lifecycles, rows, dirty = self.lifecycles, self.rows, self.changes.sessions
        counts = dict(self.lifecycle_counts)
        for sid in self.changes.removed_sessions:
            gone = lifecycles.pop(sid, None)
            if gone is not None:
                counts[gone] -= 1
        for sid in list(dirty):
            row = rows.get(sid)
            if row is None:
                continue
            life, old = row.lifecycle(now, idle_after), lifecycles.get(sid)
            if life != old:
                if old is not None:
                    counts[old] -= 1
                counts[life] += 1
                lifecycles[sid] = life
        if counts != self.lifecycle_counts:
            self.lifecycle_counts = counts
            return True
        return False

    def _sweep(self, now: float, idle_after: float) -> bool:
        old = self.lifecycles
        new: dict[str, Lifecycle] = {}
        counts: dict[Lifecycle, int] = dict.fromkeys(LIFECYCLES, 0)
        dirty = self.changes.sessions
        for sid, row in self.rows.items():
            life = row.lifecycle(now, idle_after)
            new[sid] = life
            counts[life] += 1
            if old.get(sid) != life:
                dirty.add(sid)
        self.lifecycles = new
        if counts != self.lifecycle_counts:
            self.lifecycle_counts = counts
            return True
        return False

    def lifecycle(self, sid: str, idle_after_s: float) -> Lifecycle:
        """A session's lifecycle as of the last tick (a session new since then is computed now)."""
        life = self.lifecycles.get(sid)
        if life is None:
            row = self.rows.get(sid)
            return row.lifecycle(self._clock(), idle_after_s) if row is not None else "ended"
        return life
