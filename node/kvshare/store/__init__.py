"""The on-disk replica store: KV blocks of sessions, kept across restarts.

A replica is a session's whole blocks: tokens, chained hashes, payload digests
and the KV payloads. Each session has one directory, named by the digest of its
id (`protocol.session_key`: 32 hex digits, whatever the id holds: '/', '..',
non-ASCII); the id itself is in the manifest::

    root/<key>/manifest.json      the commit point; names the session and every other file
    root/<key>/tokens-<seq>.bin   int32 LE token ids of every stored block
    root/<key>/seg-<seq>.kv       one delta: payloads of a contiguous run of
                                  blocks, back to back from offset 0
    root/<key>/snap-<seq>.bin     the state snapshot the replica resumes at (window cells,
                                  recurrent state: node.engine.snapshots), where the model
                                  keeps them; the manifest names its position and digest

A directory named by the id itself (the format before session keys) is renamed
to its key when the store opens.

Every file is written under a temporary name (starting with "~", which a session
key cannot), renamed once complete, and only becomes part of the replica
when a new manifest.json naming it replaces the old one by rename. So a torn or
corrupt write never becomes visible: until that last rename, readers see the
previous replica; after a crash the next start deletes the leftovers.

With fsync="always" each file is fsynced before its rename and the directory
after, so a replica that was visible survives power loss; "never" leaves that to
the page cache. The store holds a host's received replicas and its own sessions
alike: each write appends one delta segment to what is held (or, when the
prefix diverges, keeps the common blocks and drops the rest). Segments are
compacted into one when there are many.

The store is safe to use from several threads: short index operations take one
lock, commits (the disk work) are serialised by another. One process owns a
root at a time.

Reads map segment files. At most `max_open_maps` mappings are open across the
whole store (least recently used closed first), so open files do not grow with
the sessions held. A mapping is never closed under a view a caller still holds:
it is dropped from the store and unmapped when the last such view goes. Mapped
pages a read touched count in the process's RSS while mapped; once views worth
`trim_bytes` were handed out, every open mapping is told the pages are not
needed (MADV_DONTNEED: a later read faults them back in from the page cache).

The store is composed of parts, each in its own module: `files` (temp names, write-then-rename,
directory fsync), `manifest` (what is held of a session, manifest.json, the checks at start),
`segment` (a delta's segment file being written; the open mappings reads are served from),
`index` (the held sessions in LRU order under the budget, reads, evictions, the scan at start),
`write` (the checks and delta plan of a write, its commit) and `restore` (store ->
engine imports). `ReplicaStore` here composes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvmesh.node.kvshare.store import restore
from kvmesh.node.kvshare.store.index import Entry, ReplicaIndex
from kvmesh.node.kvshare.store.manifest import Manifest, common_prefix
from kvmesh.node.kvshare.store.restore import StoreImport, copy_block
from kvmesh.node.kvshare.store.segment import MAX_OPEN_MAPS, TRIM_BYTES, SegmentMaps, SegmentWriter
from kvmesh.node.kvshare.store.write import FsyncPolicy, ReplicaWrites
from kvmesh.node.kvshare.wire import check_session_id

if TYPE_CHECKING:
    import threading
    from collections import OrderedDict

    from kvmesh.node.engine.boundary import EngineAPI
    from kvmesh.node.kvshare.hosttier import HostTier

# SegmentWriter and copy_block live in `segment` and `restore`; kv_share's service imports them from here.
__all__ = ["ReplicaStore", "SegmentWriter", "copy_block"]


class ReplicaStore:
    """Replicas of sessions on disk, under a byte budget, least recently used evicted first."""

    def __init__(
        self,
        root: str | Path,
        budget_bytes: int,
        fsync: FsyncPolicy = "always",
        *,
        max_open_maps: int = MAX_OPEN_MAPS,
        trim_bytes: int = TRIM_BYTES,
    ) -> None:
        if fsync not in ("always", "never"):
            raise ValueError(f"fsync must be 'always' or 'never', not {fsync!r}")
        if budget_bytes < 0:
            raise ValueError("budget_bytes must be >= 0")
        if max_open_maps < 1:
            raise ValueError("max_open_maps must be >= 1")
        if trim_bytes < 0:
            raise ValueError("trim_bytes must be >= 0 (0: never trim)")
        self.root = Path(root)
        self.fsync: FsyncPolicy = fsync
        self.root.mkdir(parents=True, exist_ok=True)
        self._maps = SegmentMaps(max_open_maps, trim_bytes)
        self._index = ReplicaIndex(self.root, budget_bytes, self._maps)  # scans the root, evicts down to the budget
        self._writes = ReplicaWrites(self._index, fsync)

    # ---- settings and counters (held by the parts) ---------------------------------

    @property
    def budget_bytes(self) -> int:
        return self._index.budget_bytes

    @property
    def max_open_maps(self) -> int:
        return self._maps.max_open

    @property
    def trim_bytes(self) -> int:
        return self._maps.trim_bytes

    @property
    def evictions(self) -> int:
        return self._index.evictions

    @property
    def dropped(self) -> int:
        """Sessions removed because their files were corrupt."""
        return self._index.dropped

    @property
    def maps_deferred(self) -> int:
        """Mappings dropped while a caller still held a view (released with it)."""
        return self._maps.deferred

    @property
    def on_evict(self) -> Callable[[str], None] | None:
        """Called with the session id after a budget or explicit eviction (any thread)."""
        return self._index.on_evict

    @on_evict.setter
    def on_evict(self, hook: Callable[[str], None] | None) -> None:
        self._index.on_evict = hook

    # The index's lock and entries, and a read through an entry, for tests that hold a stale entry.
    @property
    def _lock(self) -> threading.RLock:
        return self._index.lock

    @property
    def _entries(self) -> OrderedDict[str, Entry]:
        return self._index.entries

    def _view(self, entry: Entry, i: int) -> memoryview:
        return self._index.view(entry, i)

    # ---- queries ---------------------------------------------------------------

    def sessions(self) -> list[str]:
        """Held sessions, least recently used first."""
        return self._index.sessions()

    def manifest(self, session: str) -> Manifest | None:
        check_session_id(session)
        entry = self._index.get(session)
        return entry.manifest if entry else None

    def held_prefix_blocks(self, session: str, fingerprint: str, hashes: Sequence[bytes]) -> int:
        """How many leading blocks of `hashes` this store holds for the session."""
        m = self.manifest(session)
        if m is None or m.fingerprint != fingerprint:
            return 0
        return common_prefix(m.hashes, hashes)

    def usage_bytes(self) -> int:
        """Bytes on disk of every held session (segments, tokens, manifests)."""
        return self._index.usage_bytes()

    def open_maps(self) -> int:
        """Segment mappings the store holds open now (never more than `max_open_maps`)."""
        return self._index.open_maps()

    def touch(self, session: str) -> None:
        """Mark the session used now (it becomes the last to be evicted)."""
        check_session_id(session)
        self._index.touch(session)

    def block_view(self, session: str, i: int, *, verify: bool = False) -> memoryview:
        """Read-only view of block i's payload, mapped from its segment.

        With verify=True its payload digest is checked first (once per process, as
        `import_into` does); a corrupt block drops the session and raises StoreError('digest').
        """
        check_session_id(session)
        return self._index.block_view(session, i, verify=verify)

    def read_snapshot(self, session: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The session's stored state snapshot, (the tokens it follows, its payload), its digest checked (a corrupt one drops the
        session: StoreError('digest')); None when it holds none. A disk read: call it off the event loop."""
        check_session_id(session)
        return self._index.read_snapshot(session)

    # ---- writing ----------------------------------------------------------------

    def begin_write(
        self,
        session: str,
        *,
        fingerprint: str,
        block_size: int,
        block_bytes: int,
        tokens: np.ndarray,
        hashes: Sequence[bytes],
        first_block: int,
        generation: int,
    ) -> SegmentWriter:
        """Start writing blocks first_block..len(hashes)-1 of a replica; blocks before it are kept."""
        check_session_id(session)
        return self._writes.begin(
            session, fingerprint=fingerprint, block_size=block_size, block_bytes=block_bytes, tokens=tokens,
            hashes=hashes, first_block=first_block, generation=generation,
        )  # fmt: skip

    def mark_own(self, session: str, own: bool) -> None:
        """Record who wrote the session's replica last: this host of its own session, or a sender."""
        self._index.mark_own(session, own)

    # ---- import into an engine ------------------------------------------------------

    def import_into(self, engine: EngineAPI, session: str, *, upto_blocks: int | None = None) -> int:
        """Import the session's replica (or its first `upto_blocks`) into `engine`; returns tokens resident.

        Only blocks the engine lacks are copied, each straight from the mapped
        segment into the engine's pool, each payload digest checked once per
        process. Any failure aborts the engine's import: it gets nothing.
        All in the calling thread: an event loop uses `begin_import` instead.
        """
        check_session_id(session)
        return restore.import_into(self._index, engine, session, upto_blocks=upto_blocks)

    def begin_import(self, engine: EngineAPI, session: str, *, upto_blocks: int | None = None) -> StoreImport | None:
        """Reserve the engine's blocks for the session's replica (or its first `upto_blocks`); None when
        there is nothing to import. Call it where the engine's bookkeeping lives (its event loop); then
        `copy()` on any thread, then `txn.commit()` or `txn.abort()` back where it began."""
        check_session_id(session)
        return restore.begin_import(self._index, engine, session, upto_blocks=upto_blocks)

    def begin_restore(self, engine: EngineAPI, session: str, tier: HostTier, *, tokens: np.ndarray,
                      hashes: list[bytes]) -> StoreImport:
        """Reserve the engine's blocks for a prompt's leading blocks (`hashes`, `tokens` theirs) that the
        host-memory tier or the session's replica here holds, each to be copied from the tier where it holds
        it, else from the replica; as `begin_import`, on the engine's loop, then `copy()` on any thread."""
        check_session_id(session)
        return restore.begin_restore(self._index, tier, engine, session, tokens, hashes)

    # ---- eviction ----------------------------------------------------------------------

    def evict(self, session: str) -> None:
        """Delete the session's replica (no-op when none is held)."""
        check_session_id(session)
        self._index.evict(session)

    def close(self) -> None:
        """Release mapped segments (views still held elsewhere stay valid)."""
        self._index.close()
