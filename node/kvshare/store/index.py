"""The replica index: which sessions the store holds, least recently used first, under a
byte budget; reads of their blocks through the mapped segments; evictions.

At start it indexes what is on disk (in the order of the manifests' "updated" stamps) and
evicts down to the budget. Short operations take `lock` (the index and the open mappings);
disk changes (commits and evictions) are serialised by `commit_lock`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import re
import shutil
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvmesh.node.engine.hashing import payload_digest
from kvmesh.node.kvshare.store.files import TEMP_PREFIX, remove_tree, unlink_quietly
from kvmesh.node.kvshare.store.manifest import Corrupt, Manifest, disk_bytes, load_dir, manifest_session
from kvmesh.node.kvshare.store.segment import SegmentMaps, StoreError
from kvmesh.node.protocol import is_valid_session_id, session_key

# One logger for every part of the store, so what operators filter on did not change with the split.
log = logging.getLogger("kvmesh.kvshare.store")

_KEY_RE = re.compile(r"[0-9a-f]{32}")  # a session directory's name: protocol.session_key


@dataclass
class Entry:
    manifest: Manifest
    disk_bytes: int
    verified: bytearray  # 1 = payload digest checked since this process loaded it
    # Which replica of the session this is: a new one after an eviction (file names start over),
    # the same across the deltas written to it. Open mappings are keyed by it.
    incarnation: int = 0


class ReplicaIndex:
    """The held sessions, in LRU order, under `budget_bytes`; their open mappings in `maps`."""

    def __init__(self, root: Path, budget_bytes: int, maps: SegmentMaps) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.maps = maps
        self.evictions = 0
        # Called with the session id after a budget or explicit eviction (any thread).
        self.on_evict: Callable[[str], None] | None = None
        self.dropped = 0  # sessions removed because their files were corrupt
        self.lock = threading.RLock()  # the index, and `maps`
        self.commit_lock = threading.RLock()  # disk changes: commits and evictions
        self.entries: OrderedDict[str, Entry] = OrderedDict()  # least recently used first
        # Sessions this host last wrote as its own (persist_own), not as a received replica: over the
        # budget, received replicas go first (a replica is a session's second copy; the own one is where
        # its next turn most likely runs). Not persisted: after a restart every session counts as a replica.
        self.own: set[str] = set()
        self._incarnations = itertools.count(1)
        self._scan()
        with self.commit_lock:
            self.enforce_budget(keep=None)

    def dir(self, session: str) -> Path:
        return self.root / session_key(session)

    def new_incarnation(self) -> int:
        return next(self._incarnations)

    # ---- queries ---------------------------------------------------------------

    def sessions(self) -> list[str]:
        """Held sessions, least recently used first."""
        with self.lock:
            return list(self.entries)

    def get(self, session: str) -> Entry | None:
        with self.lock:
            return self.entries.get(session)

    def use(self, session: str) -> Entry:
        """The session's entry, now the most recently used; StoreError('missing') when none is held."""
        with self.lock:
            entry = self.entries.get(session)
            if entry is None:
                raise StoreError(f"no replica of session {session!r}", reason="missing")
            self.entries.move_to_end(session)
            return entry

    def touch(self, session: str) -> None:
        """Mark the session used now (it becomes the last to be evicted)."""
        with self.lock:
            if session in self.entries:
                self.entries.move_to_end(session)

    def usage_bytes(self) -> int:
        """Bytes on disk of every held session (segments, tokens, manifests)."""
        with self.lock:
            return sum(e.disk_bytes for e in self.entries.values())

    def open_maps(self) -> int:
        with self.lock:
            return len(self.maps)

    # ---- reads ---------------------------------------------------------------------

    def block_view(self, session: str, i: int, *, verify: bool) -> memoryview:
        """Block i's payload, its digest checked first with verify=True (`ReplicaStore.block_view`)."""
        with self.lock:
            entry = self.entries.get(session)
            if entry is None:
                raise StoreError(f"no replica of session {session!r}", reason="missing")
            view = self.view(entry, i)
        if verify and not self.verify(entry, i, view):
            raise StoreError(f"replica of {session!r}: block {i} on disk is corrupt (digest mismatch)", reason="digest")
        return view

    def read_snapshot(self, session: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The session's stored snapshot: the tokens it follows and its payload read from disk, digest checked;
        None when it holds none. One that fails its check drops the session: StoreError('digest')."""
        entry = self.get(session)
        if entry is None or (w := entry.manifest.snapshot) is None:
            return None
        try:
            data = np.fromfile(self.dir(session) / w.file, dtype=np.uint8)
        except OSError as e:
            raise StoreError(f"the snapshot of {session!r} cannot be read: {e}", reason="missing") from e
        if len(data) != w.nbytes or payload_digest(data) != w.digest:
            self.drop(session, f"its snapshot at {w.pos} on disk failed its payload digest check")
            raise StoreError(f"replica of {session!r}: the snapshot on disk is corrupt (digest mismatch)", reason="digest")
        return entry.manifest.tokens[: w.pos], data

    def verify(self, entry: Entry, i: int, view: memoryview) -> bool:
        """Block i's payload digest, checked once per process; a mismatch drops the session."""
        if entry.verified[i]:
            return True
        m = entry.manifest
        if payload_digest(view) != m.digests[i]:
            self.drop(m.session, f"block {i} on disk failed its payload digest check")
            return False
        entry.verified[i] = 1
        return True

    def view(self, entry: Entry, i: int) -> memoryview:
        """Block i's payload, mapped from its segment (the caller holds lock)."""
        m = entry.manifest
        if not 0 <= i < m.n_blocks:
            raise IndexError(f"block {i} of {m.session!r}: the replica has {m.n_blocks} blocks")
        seg = m.segment_of(i)
        mm = self._map(entry, seg.file)
        return self.maps.view(mm, (i - seg.first) * m.block_bytes, m.block_bytes)

    def _map(self, entry: Entry, file: str) -> mmap.mmap:
        """The open mapping of one of the entry's segment files, opened (and the least recently
        used one closed) as needed."""
        session = entry.manifest.session
        key = (session, entry.incarnation, file)
        mm = self.maps.cached(key)
        if mm is not None:
            return mm
        current = self.entries.get(session)
        if current is None or current.incarnation != entry.incarnation:
            # Evicted since the caller looked it up: the path may name another replica's file by now.
            raise StoreError(f"the replica of {session!r} was evicted during the read", reason="missing")
        return self.maps.open(key, self.dir(session) / file)

    def trim_maps_of(self, session: str) -> None:
        """Drop the pages reads of the session touched from RSS (views stay valid)."""
        with self.lock:
            self.maps.trim_of(session)

    # ---- writes ------------------------------------------------------------------------

    def install(self, manifest: Manifest, seg_first: int) -> None:
        """Swap a committed manifest into the index, most recently used; blocks from seg_first on
        were checked as they were written, those before keep what the old entry knew."""
        session = manifest.session
        live = {s.file for s in manifest.segments} | {manifest.tokens_file}
        verified = bytearray(manifest.n_blocks)
        with self.lock:
            old = self.entries.get(session)
            if old is not None:
                verified[:seg_first] = old.verified[:seg_first]
                self.maps.close_of(session, keep=live)
            verified[seg_first:] = b"\x01" * (manifest.n_blocks - seg_first)  # checked as they were written
            incarnation = old.incarnation if old is not None else self.new_incarnation()
            self.entries[session] = Entry(manifest, disk_bytes(self.dir(session), manifest), verified, incarnation)
            self.entries.move_to_end(session)

    def forget_empty_dir(self, session: str) -> None:
        """An aborted first write leaves no directory behind."""
        with self.lock:
            if session not in self.entries:
                with contextlib.suppress(OSError):
                    os.rmdir(self.dir(session))

    # ---- eviction ----------------------------------------------------------------------

    def evict(self, session: str) -> None:
        """Delete the session's replica (no-op when none is held)."""
        with self.commit_lock:
            if self._remove(session):
                self.evictions += 1
                self._evicted(session)

    def _evicted(self, session: str) -> None:
        if self.on_evict is not None:
            self.on_evict(session)

    def drop(self, session: str, why: str) -> None:
        log.warning("dropping the replica of session %r: %s", session, why)
        with self.commit_lock:
            if self._remove(session):
                self.dropped += 1

    def mark_own(self, session: str, own: bool) -> None:
        """Whether the session's latest write was this host's own copy (True) or a received replica."""
        with self.lock:
            if own and session in self.entries:
                self.own.add(session)
            else:
                self.own.discard(session)

    def _remove(self, session: str) -> bool:
        with self.lock:
            self.own.discard(session)
            entry = self.entries.pop(session, None)
            if entry is None:
                return False
            self.maps.close_of(session)
        remove_tree(self.root, self.dir(session))
        return True

    def enforce_budget(self, keep: str | None) -> None:
        """Evict least recently used sessions (never `keep`; received replicas before own sessions)
        until usage fits the budget."""
        while self.usage_bytes() > self.budget_bytes:
            with self.lock:
                victim = next((s for s in self.entries if s != keep and s not in self.own), None)
                if victim is None:
                    victim = next((s for s in self.entries if s != keep), None)
            if victim is None:
                return
            log.info("evicting the replica of session %r: over the %d-byte budget", victim, self.budget_bytes)
            self._remove(victim)
            self.evictions += 1
            self._evicted(victim)

    def close(self) -> None:
        """Release mapped segments (views still held elsewhere stay valid)."""
        with self.lock:
            self.maps.close()

    # ---- start-up ----------------------------------------------------------------------

    def _scan(self) -> None:
        """Index what is on disk; delete temp leftovers; drop sessions that do not check out."""
        found: list[Entry] = []
        for path in sorted(self.root.iterdir()):
            name = path.name
            if name.startswith(TEMP_PREFIX):
                log.info("removing leftover %s", path)
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    unlink_quietly(path)
                continue
            if path.is_dir() and not _KEY_RE.fullmatch(name):
                path = self._rename_legacy(path) or path
            if not path.is_dir() or not _KEY_RE.fullmatch(path.name):
                log.warning("ignoring %s: not a replica directory", path)
                continue
            try:
                m, held = load_dir(path)
            except Corrupt as e:
                log.warning("dropping the replica in %s/: %s", path.name, e)
                self.dropped += 1
                remove_tree(self.root, path)
                continue
            found.append(Entry(m, held, bytearray(m.n_blocks), self.new_incarnation()))
        for entry in sorted(found, key=lambda e: e.manifest.updated):
            self.entries[entry.manifest.session] = entry

    def _rename_legacy(self, path: Path) -> Path | None:
        """A directory named by the session id itself (before session keys): renamed to its key
        when its manifest names that very session and the key is free; None otherwise."""
        session = manifest_session(path)
        if session is None:
            return None
        target = self.dir(session)
        if session != path.name or not is_valid_session_id(session) or target.exists():
            return None
        os.rename(path, target)
        log.info("renamed the replica directory of %r to its key %s", session, target.name)
        return target
