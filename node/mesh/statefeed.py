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
subscriber asks for a baseline: so a mirror is the sender's state at some seq, or known to be out
of date, never silently wrong (the field report's bug was trusting a memory of engine state).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.node.protocol import HostInfo, LinkInfo, PeerStatus, SessionHolding, StateBaseline, StateDelta

_Fields = dict[str, object]


@dataclass
class _Flat:
    host: _Fields
    fields: _Fields
    sessions: dict[str, _Fields]
    links: dict[str, _Fields]


def _flat(status: PeerStatus, scope: Callable[[str], bool] | None) -> _Flat:
    d = status.model_dump(mode="json")
    host = d.pop("host")
    host.pop("last_seen", None)  # the receiver's to set (when it last heard): sent, it would change every tick
    sessions = {s["session"]: s for s in d.pop("sessions") if scope is None or scope(s["session"])}
    links = {f"{li['src']}>{li['dst']}": li for li in d.pop("links")}
    return _Flat(host, d, sessions, links)


def _keyed(old: dict[str, _Fields], new: dict[str, _Fields], defaults: _Fields) -> tuple[dict[str, _Fields], list[str]]:
    """Per key, the fields that changed (a new key: all that differ from `defaults`), and the keys gone."""
    out = {}
    for k, now in new.items():
        diff = _changed(old.get(k, defaults), now)
        if diff:
            out[k] = diff
    return out, sorted(k for k in old if k not in new)


def _changed(old: _Fields, new: _Fields) -> _Fields:
    return {k: v for k, v in new.items() if old.get(k, _MISSING) != v}


_MISSING = object()
_NO_FIELDS: _Fields = {}  # a new session or link is sent whole (its key fields included)


class StateFeed:
    """One subscriber's view of this host's status: what it was sent, and the next message for it."""

    def __init__(self, epoch: float, *, scope: Callable[[str], bool] | None = None) -> None:
        self.epoch = epoch
        self.seq = 0
        self._scope = scope  # which sessions this subscriber is sent (None: all)
        self._sent = _Flat({}, {}, {}, {})

    def baseline(self, status: PeerStatus) -> StateBaseline:
        """The whole (scoped) status: the stream's first message, and the answer to a resync."""
        self._sent = _flat(status, self._scope)
        self.seq += 1
        sessions = [s for s in status.sessions if s.session in self._sent.sessions]
        return StateBaseline(epoch=self.epoch, seq=self.seq,
                             status=status.model_copy(update={"sessions": sessions}))

    def delta(self, status: PeerStatus) -> StateDelta | None:
        """What changed since the last message, as the next seq; None when nothing did."""
        now, sent = _flat(status, self._scope), self._sent
        sessions, removed = _keyed(sent.sessions, now.sessions, _NO_FIELDS)
        links, links_removed = _keyed(sent.links, now.links, _NO_FIELDS)
        out = StateDelta(epoch=self.epoch, seq=self.seq + 1, host=_changed(sent.host, now.host),
                         fields=_changed(sent.fields, now.fields), sessions=sessions, removed=removed, links=links,
                         links_removed=links_removed)
        if _empty(out):
            return None
        self._sent = now
        self.seq += 1
        return out

    def heartbeat(self) -> StateDelta:
        """Nothing changed: the last seq again, so the mirror knows the sender is alive and in step."""
        return StateDelta(epoch=self.epoch, seq=self.seq)


_PARTS = ("host", "fields", "sessions", "removed", "links", "links_removed")


def _empty(msg: StateDelta) -> bool:
    return not any(getattr(msg, k) for k in _PARTS)


def encode(msg: StateBaseline | StateDelta) -> str:
    """A message as sent: a delta without its empty parts (a heartbeat is about 60 bytes)."""
    if isinstance(msg, StateBaseline):
        return msg.model_dump_json()
    return msg.model_dump_json(exclude={k for k in _PARTS if not getattr(msg, k)})


class StateMirror:
    """A peer's status rebuilt from its stream; `apply` says False when out of step (ask for a baseline)."""

    def __init__(self) -> None:
        self.epoch: float | None = None
        self.seq = 0
        self.status: PeerStatus | None = None
        self.sessions: dict[str, SessionHolding] = {}
        self.changed: list[str] = []  # the sessions the last message applied added or changed
        self.resyncs = 0  # baselines asked for after a gap

    def apply(self, msg: StateBaseline | StateDelta) -> bool:
        if isinstance(msg, StateBaseline):
            self.epoch, self.seq = msg.epoch, msg.seq
            self.sessions = {s.session: s for s in msg.status.sessions}
            self.status = msg.status
            self.changed = list(self.sessions)
            return True
        if self.status is None or msg.epoch != self.epoch or msg.seq not in (self.seq, self.seq + 1):
            return False
        if msg.seq == self.seq:
            self.changed = []
            return _empty(msg)  # a heartbeat carries nothing
        st = self.status
        host = HostInfo.model_validate({**st.host.model_dump(mode="json"), **msg.host}) if msg.host else st.host
        for s in msg.removed:
            self.sessions.pop(s, None)
        for s, diff in msg.sessions.items():
            old = self.sessions.get(s)
            base = old.model_dump(mode="json") if old is not None else {}
            self.sessions[s] = SessionHolding.model_validate({**base, **diff, "session": s})
        links = st.links
        if msg.links or msg.links_removed:
            have = {f"{li.src}>{li.dst}": li.model_dump(mode="json") for li in st.links}
            for k in msg.links_removed:
                have.pop(k, None)
            for k, diff in msg.links.items():
                have[k] = {**have.get(k, {}), **diff}
            links = [LinkInfo.model_validate(li) for li in have.values()]
        fields = {**st.model_dump(mode="json", exclude={"host", "sessions", "links"}), **msg.fields} if msg.fields else None
        self.status = (PeerStatus.model_validate({**fields, "host": host, "links": links}) if fields is not None
                       else st.model_copy(update={"host": host, "links": links}))
        self.status.sessions = list(self.sessions.values())
        self.changed = list(msg.sessions)
        self.seq = msg.seq
        return True

    def out_of_step(self) -> None:
        """The subscriber asked for a baseline: nothing applies until it comes."""
        self.status, self.resyncs = None, self.resyncs + 1
