"""Threads: which conversations are one client session (an affinity group), counted as rows come and go.

A client's session id names a group; each conversation in it (the main one, each subagent's, side
requests) is a kvmesh session of its own (own cache, replica, handoffs), so the sessions table keeps
one row per conversation and reads a group's rows as one. `SessionInfo.group` says which group a
conversation is of: the main conversation's key is the group itself, another's is `<group>#<8 hex>`,
and "" comes from an older node (the session is its own group). Live events carry no group, so a
conversation the console has only seen live is placed by the form of its key until a cluster view names it.

Only threads are indexed (a group's conversations other than its main), per group: at 20,000
sessions most groups are a main alone, and those cost nothing here.
"""

from __future__ import annotations

import re

_THREAD_KEY = re.compile(r"(.+)#[0-9a-f]{8}")


def group_of_key(sid: str) -> str:
    """The group a session key names by its form: `<group>#<8 hex>` is a thread of `<group>`; else its own."""
    m = _THREAD_KEY.fullmatch(sid)
    return m.group(1) if m else sid


def group_id(sid: str, group: str | None) -> str:
    """A session's group: what a cluster view said (`group`; "" from an older node: its own), else (None: seen
    only live) what its key's form says."""
    if group:
        return group
    return sid if group is not None else group_of_key(sid)


class Threads:
    """Group -> the ids of its threads the console knows; thread -> its group. A main is not listed."""

    def __init__(self) -> None:
        self.of_group: dict[str, set[str]] = {}
        self._group: dict[str, str] = {}

    def group(self, sid: str) -> str:
        """The group of a known thread, else `sid` itself (a main, or a session of its own)."""
        return self._group.get(sid, sid)

    def count(self, group: str) -> int:
        """How many threads of `group` (other than its main) are known."""
        return len(self.of_group.get(group, ()))

    def set(self, sid: str, group: str) -> list[str]:
        """`sid` is of `group` now; returns the groups whose thread set changed (0, 1 or 2 of them)."""
        old = self._group.get(sid, sid)
        if old == group:
            return []
        changed = []
        if old != sid:
            self._leave(sid, old)
            changed.append(old)
        if group != sid:
            self._group[sid] = group
            self.of_group.setdefault(group, set()).add(sid)
            changed.append(group)
        return changed

    def remove(self, sid: str) -> list[str]:
        """`sid` is gone; returns the group whose thread set changed, if it was a thread."""
        group = self._group.get(sid)
        if group is None:
            return []
        self._leave(sid, group)
        return [group]

    def _leave(self, sid: str, group: str) -> None:
        del self._group[sid]
        members = self.of_group.get(group)
        if members is not None:
            members.discard(sid)
            if not members:
                del self.of_group[group]
