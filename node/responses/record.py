"""One conversation's stored responses: the record that travels with the conversation (sans-I/O).

A record holds every stored response of one conversation key. Each `StoredEntry` is one response: the
response object as it was answered, the scope that made it, and its input, kept as a delta: the items sent
after its parent's conversation (the `previous_response_id` it continued: that response's whole input, then
its output). An entry with no parent keeps its whole input. So a chain of n turns costs its text once, not
n times, and the whole input of any entry is its ancestors' items and outputs, then its own items.

Records merge as sets (a peer's copy, the entry node's new turn): an entry is immutable once made, except that
a deletion wins over any copy that still has it. A deleted or expired entry is kept, content and all, while a
live descendant needs it for its input; a deleted one then stays a bare tombstone until it would have expired,
so an older copy merged later does not bring it back.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvmesh.node.responses.ids import MAX_ID_CHARS
from kvmesh.node.sessionids import SessionId


class StoredEntry(BaseModel):
    """One stored response, as it is kept on disk and sent to a peer."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    scope: str = Field(max_length=64)  # node.responses.ids.scope_of: a digest of the key that made it
    group: SessionId  # the session id its chain runs under (each follow-up is a turn of it)
    source: str = Field("", max_length=64)  # what named that session (node.api.sessionid)
    created: float
    expires: float
    parent: str | None = Field(None, max_length=MAX_ID_CHARS)  # the previous_response_id its input continues
    items: list[dict[str, Any]] = Field(default_factory=list)  # input items after the parent's conversation
    response: dict[str, Any] | None = None  # the response object; None: a bare tombstone
    deleted: bool = False


class StoredRecord(BaseModel):
    """A conversation's stored responses, whole: the disk copy's content and a peer call's body."""

    model_config = ConfigDict(extra="forbid")

    session: SessionId  # the conversation key (node.mesh.threads), which every entry's id names
    entries: list[StoredEntry] = Field(default_factory=list)


def _merged(old: StoredEntry | None, new: StoredEntry) -> StoredEntry:
    if old is None:
        return new
    deleted = old.deleted or new.deleted
    base = old if old.response is not None or new.response is None else new
    if base is old and old.deleted == deleted:
        return old
    return base.model_copy(update={"deleted": deleted})


def _size(e: StoredEntry) -> int:
    return len(e.model_dump_json())


class Record:
    """A conversation's stored responses on this host: merged, looked up, collected."""

    def __init__(self, session: str):
        self.session = session
        self.entries: dict[str, StoredEntry] = {}
        self._sizes: dict[str, int] = {}
        self.version = 0  # bumped by every change: what a peer was last sent is compared with it

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values())

    def merge(self, entries: Iterable[StoredEntry]) -> bool:
        """Take a copy's entries in; whether anything changed."""
        changed = False
        for e in entries:
            old = self.entries.get(e.id)
            new = _merged(old, e)
            if new is not old:
                self.entries[e.id] = new
                self._sizes[e.id] = _size(new)
                changed = True
        if changed:
            self.version += 1
        return changed

    def dump(self) -> StoredRecord:
        return StoredRecord(session=self.session, entries=list(self.entries.values()))

    def find(self, response_id: str, scope: str, now: float) -> StoredEntry | None:
        """The response, if it is here, alive, and the scope's; else None (all three look alike to a caller)."""
        e = self.entries.get(response_id)
        if e is None or e.deleted or e.response is None or e.expires <= now or e.scope != scope:
            return None
        return e if self.input_items(response_id) is not None else None

    def input_items(self, response_id: str) -> list[dict[str, Any]] | None:
        """The response's whole input (its ancestors' items and outputs, then its own items); None if an
        ancestor's content is not here."""
        chain: list[StoredEntry] = []
        at: str | None = response_id
        while at is not None:
            e = self.entries.get(at)
            if e is None or e.response is None or any(c.id == at for c in chain):
                return None
            chain.append(e)
            at = e.parent
        out: list[dict[str, Any]] = []
        for e in reversed(chain[1:]):
            out += e.items
            out += e.response["output"] if e.response is not None else []
        return out + chain[0].items

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        """What a turn continuing the response starts from: its whole input, then its output."""
        items = self.input_items(response_id)
        e = self.entries.get(response_id)
        if items is None or e is None or e.response is None:
            return None
        return items + list(e.response.get("output") or [])

    def delete(self, response_id: str) -> bool:
        e = self.entries.get(response_id)
        if e is None or e.deleted:
            return False
        return self.merge([e.model_copy(update={"deleted": True})])

    def collect(self, now: float) -> bool:
        """Drop what no live response needs: expired entries, deleted ones' content (a bare tombstone stays until it
        would have expired). Whether anything changed."""
        live = [e for e in self.entries.values() if not e.deleted and e.response is not None and e.expires > now]
        needed: set[str] = set()
        for e in live:
            at: str | None = e.id
            while at is not None and at not in needed and at in self.entries:
                needed.add(at)
                at = self.entries[at].parent
        changed = False
        for rid, e in list(self.entries.items()):
            if rid in needed:
                continue
            if e.deleted and e.expires > now:
                if e.response is not None or e.items:
                    self.entries[rid] = bare = StoredEntry(id=e.id, scope=e.scope, group=e.group, created=e.created,
                                                           expires=e.expires, deleted=True)
                    self._sizes[rid] = _size(bare)
                    changed = True
                continue
            del self.entries[rid]
            del self._sizes[rid]
            changed = True
        if changed:
            self.version += 1
        return changed

    def empty(self) -> bool:
        return not self.entries
