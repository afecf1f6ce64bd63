"""Peer state pushed as deltas, sans I/O: the sender's `StateFeed` and the receiver's `StateMirror`.

A node streams its status to each peer that subscribes (`/v1/peer/state`; the asyncio shells are
node.mesh.statestream) instead of being polled for all of it. Each subscriber has a feed of its
own, and each message is the difference, field by field, between the status now and the status
that subscriber was last sent: a slow reader gets fewer, larger deltas rather than a queue, so
nothing is ever dropped to keep up, and a tick where nothing changed sends nothing (a heartbeat
every so often says the sender is alive). A feed may be scoped to some sessions (the ones a
directory host answers for, node.mesh.directory).

Every delta carries the next sequence number. A mirror applies a delta only onto the state it was
computed from (the same epoch, its own seq plus one) and otherwise says it is out of step, and the
subscriber asks for a snapshot: so a mirror is the sender's state at some seq, or known to be out
of date, never silently wrong (the field report's bug was trusting a memory of engine state).
"""

from __future__ import annotations

from collections.abc import Callable

from kvmesh.node.protocol import HostInfo, PeerStatus, SessionHolding, StateDelta, StateSnapshot

_Fields = dict[str, object]


def _flat(status: PeerStatus, scope: Callable[[str], bool] | None) -> tuple[_Fields, _Fields, dict[str, _Fields]]:
    d = status.model_dump(mode="json")
    host = d.pop("host")
    sessions = {s["session"]: s for s in d.pop("sessions") if scope is None or scope(s["session"])}
    return host, d, sessions


def _changed(old: _Fields, new: _Fields) -> _Fields:
    return {k: v for k, v in new.items() if old.get(k, _MISSING) != v}


_MISSING = object()
_SESSION_DEFAULTS = SessionHolding(session="-").model_dump(mode="json")


class StateFeed:
    """One subscriber's view of this host's status: what it was sent, and the next message for it."""

    def __init__(self, epoch: float, *, scope: Callable[[str], bool] | None = None) -> None:
        self.epoch = epoch
        self.seq = 0
        self._scope = scope  # which sessions this subscriber is sent (None: all)
        self._host: _Fields = {}
        self._fields: _Fields = {}
        self._sessions: dict[str, _Fields] = {}

    def snapshot(self, status: PeerStatus) -> StateSnapshot:
        """The whole (scoped) status: the stream's first message, and the answer to a resync."""
        self._host, self._fields, self._sessions = _flat(status, self._scope)
        self.seq += 1
        sessions = [SessionHolding.model_validate(s) for s in self._sessions.values()]
        return StateSnapshot(epoch=self.epoch, seq=self.seq,
                             status=status.model_copy(update={"sessions": sessions}))

    def delta(self, status: PeerStatus) -> StateDelta | None:
        """What changed since the last message, as the next seq; None when nothing did."""
        host, fields, sessions = _flat(status, self._scope)
        out = StateDelta(epoch=self.epoch, seq=self.seq + 1, host=_changed(self._host, host),
                         fields=_changed(self._fields, fields),
                         removed=sorted(s for s in self._sessions if s not in sessions))
        for s, now in sessions.items():
            before = self._sessions.get(s)
            diff = _changed(before if before is not None else _SESSION_DEFAULTS, now)
            if before is None:
                diff["session"] = s
            if diff:
                out.sessions[s] = diff
        if not (out.host or out.fields or out.sessions or out.removed):
            return None
        self._host, self._fields, self._sessions = host, fields, sessions
        self.seq += 1
        return out

    def heartbeat(self) -> StateDelta:
        """Nothing changed: the last seq again, so the mirror knows the sender is alive and in step."""
        return StateDelta(epoch=self.epoch, seq=self.seq)


def encode(msg: StateSnapshot | StateDelta) -> str:
    """A message as sent: a delta without its empty parts (a heartbeat is about 50 bytes)."""
    if isinstance(msg, StateSnapshot):
        return msg.model_dump_json()
    return msg.model_dump_json(exclude={k for k in ("host", "fields", "sessions", "removed") if not getattr(msg, k)})


class StateMirror:
    """A peer's status rebuilt from its stream; `apply` says False when out of step (ask for a snapshot)."""

    def __init__(self) -> None:
        self.epoch: float | None = None
        self.seq = 0
        self.status: PeerStatus | None = None
        self.sessions: dict[str, SessionHolding] = {}
        self.resyncs = 0  # snapshots asked for after a gap

    def apply(self, msg: StateSnapshot | StateDelta) -> bool:
        if isinstance(msg, StateSnapshot):
            self.epoch, self.seq = msg.epoch, msg.seq
            self.sessions = {s.session: s for s in msg.status.sessions}
            self.status = msg.status
            return True
        if self.status is None or msg.epoch != self.epoch or msg.seq not in (self.seq, self.seq + 1):
            return False
        if msg.seq == self.seq:
            return not (msg.host or msg.fields or msg.sessions or msg.removed)  # a heartbeat carries nothing
        st = self.status
        host = HostInfo.model_validate({**st.host.model_dump(mode="json"), **msg.host}) if msg.host else st.host
        for s in msg.removed:
            self.sessions.pop(s, None)
        for s, diff in msg.sessions.items():
            old = self.sessions.get(s)
            base = old.model_dump(mode="json") if old is not None else {}
            self.sessions[s] = SessionHolding.model_validate({**base, **diff, "session": s})
        fields = {**st.model_dump(mode="json", exclude={"host", "sessions"}), **msg.fields} if msg.fields else None
        self.status = (PeerStatus.model_validate({**fields, "host": host}) if fields is not None
                       else st.model_copy(update={"host": host}))
        self.status.sessions = list(self.sessions.values())
        self.seq = msg.seq
        return True

    def out_of_step(self) -> None:
        """The subscriber asked for a snapshot: nothing applies until it comes."""
        self.status, self.resyncs = None, self.resyncs + 1
