"""Imports from the replica store into an engine: reserve the engine's blocks, copy the
stored payloads into them (any thread), then commit or abort where the import began.

Only blocks the engine lacks are copied, each straight from the mapped segment into the
engine's pool, each payload digest checked once per process; the copies go through numpy,
which lets go of the GIL, so an event loop in another thread keeps running meanwhile.
A restore (`begin_restore`) takes the blocks the host-memory tier holds from there instead
(`hosttier.py`: this host's own pool's bytes, a memory copy, no digest to check), the rest
from the store.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from kvmesh.node.errors import ImportRefused
from kvmesh.node.kvshare.hosttier import HostTier
from kvmesh.node.kvshare.store.index import Entry, ReplicaIndex
from kvmesh.node.kvshare.store.manifest import common_prefix

if TYPE_CHECKING:
    from kvmesh.node.engine.boundary import EngineAPI, ImportAPI


class ImportCancelled(ImportRefused):
    """A store import was told to stop before it copied every block."""

    def __init__(self, session: str) -> None:
        super().__init__(f"the import of {session!r} from the store was cancelled", reason="cancelled")


@dataclass
class StoreImport:
    """A store -> engine import whose blocks are reserved (`ReplicaStore.begin_import`).

    `copy()` is the bulk byte work (page-cache reads, digests, copies into the pool) and
    may run on a worker thread: the reserved blocks are the txn's alone until it commits
    or aborts, which happens back on the engine's thread once `copy()` has returned.
    """

    index: ReplicaIndex
    entry: Entry | None  # None: every block comes from the tier
    txn: ImportAPI
    session: str
    tier: HostTier | None = None
    from_tier: dict[int, int] = field(default_factory=dict)  # block index -> the tier's block, pinned

    def copy(self, cancel: threading.Event | None = None) -> None:
        """Copy every block the engine lacks, checking each stored payload's digest (once per process).
        Raises ImportRefused('digest') on a corrupt block, ImportCancelled once `cancel` is set."""
        index, entry, session = self.index, self.entry, self.session
        try:
            for i in self.txn.missing:
                if cancel is not None and cancel.is_set():
                    raise ImportCancelled(session)
                if self.tier is not None and (t := self.from_tier.get(i)) is not None:
                    copy_block(self.txn, i, self.tier.view(t))
                    continue
                if entry is None:
                    raise ImportRefused(f"block {i} of {session!r} is neither in the tier nor stored", reason="missing")
                with index.lock:
                    view = index.view(entry, i)
                if not index.verify(entry, i, view):
                    raise ImportRefused(f"replica of {session!r}: block {i} on disk is corrupt (digest mismatch)", reason="digest")
                copy_block(self.txn, i, view)
        finally:
            self.release_tier()
            # The engine has its copy now: the mapped pages need not count in this process's RSS.
            index.trim_maps_of(session)

    def abort(self) -> None:
        """Nothing of the import becomes visible; the tier's blocks are unpinned (where it began, once no copy runs)."""
        self.release_tier()
        self.txn.abort()

    def release_tier(self) -> None:
        """Unpin the tier's blocks this import reads (idempotent; any thread)."""
        pinned, self.from_tier = list(self.from_tier.values()), {}
        if self.tier is not None and pinned:
            self.tier.unpin(pinned)


def begin_import(index: ReplicaIndex, engine: EngineAPI, session: str, *, upto_blocks: int | None = None) -> StoreImport | None:
    """`ReplicaStore.begin_import`: the engine's blocks reserved for the session's replica (or its first
    `upto_blocks`), the session now the most recently used; None when there is nothing to import."""
    entry = index.use(session)
    m = entry.manifest
    n = m.n_blocks if upto_blocks is None else max(0, min(upto_blocks, m.n_blocks))
    if n == 0:
        return None
    txn = engine.begin_import(session, m.fingerprint, m.tokens[: n * m.block_size], m.hashes[:n])
    return StoreImport(index, entry, txn, session)


def begin_restore(index: ReplicaIndex, tier: HostTier, engine: EngineAPI, session: str, tokens: np.ndarray,
                  hashes: list[bytes]) -> StoreImport:
    """`ReplicaStore.begin_restore`: the engine's blocks reserved for the prompt's leading blocks (`hashes`,
    `tokens` theirs) that the tier or the session's stored replica holds, as far as one of them holds the
    next; each block the engine lacks comes from the tier where it holds it (pinned here), else from the
    store. Call it on the engine's loop: what the tier and the store hold is read here, not earlier."""
    bs = engine.block_size
    entry = index.get(session)
    stored = 0
    if entry is not None and (m := entry.manifest).fingerprint == engine.fingerprint and m.block_bytes == engine.block_bytes:
        stored = common_prefix(m.hashes, hashes)
    pins: dict[int, int] = {}
    n = len(hashes)
    for i in range(n):
        t = tier.pin(hashes[i], tokens[i * bs : (i + 1) * bs])
        if t is not None:
            pins[i] = t
        elif i >= stored:
            n = i
            break
    try:
        if n == 0:
            raise ImportRefused(f"neither the tier nor the store holds the first block of {session!r}", reason="missing")
        txn = engine.begin_import(session, engine.fingerprint, tokens[: n * bs], hashes[:n])
    except BaseException:
        tier.unpin(list(pins.values()))
        raise
    if stored:
        index.use(session)  # the most recently used
    missing = set(txn.missing)
    tier.unpin([t for i, t in pins.items() if i not in missing])  # the engine holds those already
    from_tier = {i: t for i, t in pins.items() if i in missing}
    tier.hits += len(from_tier)
    return StoreImport(index, entry if stored else None, txn, session, tier, from_tier)


def import_into(index: ReplicaIndex, engine: EngineAPI, session: str, *, upto_blocks: int | None = None) -> int:
    """`ReplicaStore.import_into`: begin, copy and commit in the calling thread; any failure aborts."""
    imp = begin_import(index, engine, session, upto_blocks=upto_blocks)
    if imp is None:
        return 0
    try:
        imp.copy()
        return imp.txn.commit()
    except BaseException:
        imp.txn.abort()
        raise


def copy_bytes(dst: memoryview, src: memoryview | bytes | np.ndarray) -> None:
    """dst[:] = src through numpy, which lets go of the GIL while it copies (a memoryview
    assignment holds it throughout: an event loop in another thread would wait for the copy)."""
    np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))  # type: ignore[arg-type]  # buffers


def copy_block(txn: ImportAPI, i: int, view: memoryview | np.ndarray) -> None:
    """One memcpy from the page cache into the engine's pool block."""
    try:
        dst = txn.buffer(i)
    except RuntimeError:
        dst = None  # an accelerator pool: the engine copies host -> device
    if dst is not None:
        if len(view) != len(dst):
            raise ImportRefused(f"block {i} is {len(view)} bytes; the engine's blocks are {len(dst)}", reason="size")
        copy_bytes(dst, view)
        return
    with warnings.catch_warnings():
        # torch warns that the mapped source is read-only; it only reads it.
        warnings.simplefilter("ignore", UserWarning)
        txn.write(i, view)
