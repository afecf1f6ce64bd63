"""The stored responses this host keeps: each conversation's record in memory, and its disk copy.

Records are held in memory, least recently used first, within `responses.budget_bytes` (counted as their JSON):
past it the least recently used conversation's record goes whole, on disk too. Expiry (`responses.ttl_s`) is
checked on every lookup, and expired entries are collected on every change and by `sweep`.

Each record is one file, `<session_key>.json` in the store's directory, rewritten whole (temp name, optional
fsync, rename: no reader sees half a file) by one writer thread, in the order the changes were made, so the
event loop never writes and an older copy never lands after a newer one. At start the directory is read back
on a worker thread; a file that does not parse is removed, and said so.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import time
from collections.abc import Callable
from pathlib import Path

from pydantic import ValidationError

from kvmesh.node.kvshare.store.files import TEMP_PREFIX, unlink_quietly, write_file
from kvmesh.node.responses.record import Record, StoredRecord
from kvmesh.node.sessionids import session_key

log = logging.getLogger("kvmesh.responses")
SUFFIX = ".json"


def _read_all(root: Path) -> list[StoredRecord]:
    """Every record on disk (on a worker thread); temp leftovers and files that do not parse are removed."""
    out: list[StoredRecord] = []
    for path in sorted(root.iterdir()):
        if path.name.startswith(TEMP_PREFIX):
            unlink_quietly(path)
            continue
        if not path.name.endswith(SUFFIX):
            continue
        try:
            rec = StoredRecord.model_validate_json(path.read_bytes())
        except (OSError, ValidationError) as e:
            log.warning("stored responses %s are unreadable (%s): removed", path.name, type(e).__name__)
            unlink_quietly(path)
            continue
        if session_key(rec.session) + SUFFIX != path.name:
            log.warning("stored responses %s name another conversation: removed", path.name)
            unlink_quietly(path)
            continue
        out.append(rec)
    return out


class ResponseStore:
    """The records of this host, by conversation key."""

    def __init__(self, root: Path, budget_bytes: int, *, fsync: bool, clock: Callable[[], float] = time.time):
        self.root = root
        self.budget_bytes = budget_bytes
        self.fsync = fsync
        self.clock = clock
        self.records: collections.OrderedDict[str, Record] = collections.OrderedDict()
        self.evictions = 0
        self._writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="responses-disk")

    async def load(self) -> None:
        """Read the disk copies back (a restart loses nothing that was written)."""
        self.root.mkdir(parents=True, exist_ok=True)
        for rec in await asyncio.get_running_loop().run_in_executor(self._writer, _read_all, self.root):
            self.merge(rec, persist=False)

    def close(self) -> None:
        self._writer.shutdown(wait=True)

    def usage_bytes(self) -> int:
        return sum(r.bytes for r in self.records.values())

    def get(self, session: str) -> Record | None:
        rec = self.records.get(session)
        if rec is not None:
            self.records.move_to_end(session)
        return rec

    def merge(self, incoming: StoredRecord, *, persist: bool = True, known_only: bool = False) -> Record | None:
        """Take a copy in (a new turn's, a peer's, the disk's); the record if it changed, else None. `known_only`:
        only into a record already here (a deletion's tombstone is no reason to start one)."""
        session = incoming.session
        rec = self.records.get(session)
        if rec is None:
            if known_only:
                return None
            rec = self.records[session] = Record(session)
        self.records.move_to_end(session)
        changed = rec.merge(incoming.entries)
        changed = rec.collect(self.clock()) or changed
        if changed and persist:
            self._persist(rec)
        self._bound()
        if rec.empty():
            self._drop(session)
            return None
        return rec if changed and session in self.records else None

    def delete(self, session: str, response_id: str) -> bool:
        rec = self.records.get(session)
        if rec is None or not rec.delete(response_id):
            return False
        rec.collect(self.clock())
        self._persist(rec)
        return True

    def sweep(self) -> int:
        """Collect every record's expired entries; returns the records dropped whole."""
        now, dropped = self.clock(), 0
        for session, rec in list(self.records.items()):
            if rec.collect(now):
                if rec.empty():
                    self._drop(session)
                    dropped += 1
                else:
                    self._persist(rec)
        return dropped

    def _bound(self) -> None:
        total = self.usage_bytes()
        while total > self.budget_bytes and self.records:
            session, rec = next(iter(self.records.items()))
            total -= rec.bytes
            self._drop(session)
            self.evictions += 1
            log.info("stored responses of %s evicted: over responses.budget_bytes (%d)", session, self.budget_bytes)

    def _drop(self, session: str) -> None:
        self.records.pop(session, None)
        self._writer.submit(unlink_quietly, self._path(session))

    def _path(self, session: str) -> Path:
        return self.root / (session_key(session) + SUFFIX)

    def _persist(self, rec: Record) -> None:
        if rec.empty():
            self._drop(rec.session)
            return
        snapshot, path = rec.dump(), self._path(rec.session)
        self._writer.submit(self._write, snapshot, path).add_done_callback(_logged)

    def _write(self, snapshot: StoredRecord, path: Path) -> None:
        write_file(path.parent, path.name, snapshot.model_dump_json().encode(), self.fsync)


def _logged(f: concurrent.futures.Future[None]) -> None:
    if (e := f.exception()) is not None:
        log.warning("a stored-responses disk copy was not written: %s: %s", type(e).__name__, e)
