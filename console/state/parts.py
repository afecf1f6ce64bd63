"""Each node's part of the sessions table: what its last cluster view listed, kept per source.

Why parts. Past `mesh.directory_after_hosts` no node's cluster view is the mesh: each lists the sessions it
holds and those it is directory for (node.mesh.directory), so a console that let the last cluster view
replace the table showed one node's share of it (issue 32: 30 of 55 sessions on 24 hosts). The
console follows every node anyway (one stream each, for its live events), so it keeps every node's
last cluster view as that node's part and shows their union: a cluster view replaces only its own source's
part, a node gone for good takes only its own part with it, and where several parts name a session
they are merged by owner (`node.protocol.merge_session_parts`: the host with the highest turn
sequence is home, the largest other holder is the replica). In a small mesh every part lists every
session and the merge changes nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvmesh.node.protocol import SessionInfo


class SessionParts:
    """Per source (a node's URL): its last cluster view's sessions and that cluster view's time; and per session,
    which sources list it (so a session's parts are found without walking every source)."""

    def __init__(self) -> None:
        self._parts: dict[str, tuple[float, dict[str, SessionInfo]]] = {}
        self._sources: dict[str, set[str]] = {}  # session id -> sources whose part lists it

    def has(self, source: str) -> bool:
        return source in self._parts

    def replace(self, source: str, infos: Iterable[SessionInfo], ts: float) -> set[str]:
        """`source`'s part is now `infos` (as of `ts`); returns every session id whose parts changed."""
        new = {i.session: i for i in infos}
        old = self._parts.get(source, (0.0, {}))[1]
        self._parts[source] = (ts, new)
        for sid in old.keys() - new.keys():
            self._unlist(sid, source)
        for sid in new.keys() - old.keys():
            self._sources.setdefault(sid, set()).add(source)
        return old.keys() | new.keys()

    def drop(self, source: str) -> set[str]:
        """Forget `source`'s part (the node left the mesh); returns the session ids it listed."""
        _, old = self._parts.pop(source, (0.0, {}))
        for sid in old:
            self._unlist(sid, source)
        return set(old)

    def of(self, sid: str) -> list[tuple[SessionInfo, float]]:
        """What each part says of `sid`, with that part's cluster view time."""
        out = []
        for source in self._sources.get(sid, ()):
            ts, part = self._parts[source]
            out.append((part[sid], ts))
        return out

    def count(self, source: str) -> int:
        return len(self._parts.get(source, (0.0, {}))[1])

    def _unlist(self, sid: str, source: str) -> None:
        sources = self._sources.get(sid)
        if sources is not None:
            sources.discard(source)
            if not sources:
                del self._sources[sid]
