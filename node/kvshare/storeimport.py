"""Imports from the replica store into an engine: reserve the engine's blocks, copy the
stored payloads into them (any thread), then commit or abort where the import began.

Only blocks the engine lacks are copied, each straight from the mapped segment into the
engine's pool, each payload digest checked once per process; the copies go through numpy,
which lets go of the GIL, so an event loop in another thread keeps running meanwhile.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvmesh.node.errors import ImportRefused
from kvmesh.node.kvshare.index import Entry, ReplicaIndex

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
    entry: Entry
    txn: ImportAPI

    @property
    def session(self) -> str:
        return self.entry.manifest.session

    def copy(self, cancel: threading.Event | None = None) -> None:
        """Copy every block the engine lacks, checking each payload digest (once per process).
        Raises ImportRefused('digest') on a corrupt block, ImportCancelled once `cancel` is set."""
        index, entry, session = self.index, self.entry, self.session
        try:
            for i in self.txn.missing:
                if cancel is not None and cancel.is_set():
                    raise ImportCancelled(session)
                with index.lock:
                    view = index.view(entry, i)
                if not index.verify(entry, i, view):
                    raise ImportRefused(f"replica of {session!r}: block {i} on disk is corrupt (digest mismatch)", reason="digest")
                copy_block(self.txn, i, view)
        finally:
            # The engine has its copy now: the mapped pages need not count in this process's RSS.
            index.trim_maps_of(session)


def begin_import(index: ReplicaIndex, engine: EngineAPI, session: str, *, upto_blocks: int | None = None) -> StoreImport | None:
    """`ReplicaStore.begin_import`: the engine's blocks reserved for the session's replica (or its first
    `upto_blocks`), the session now the most recently used; None when there is nothing to import."""
    entry = index.use(session)
    m = entry.manifest
    n = m.n_blocks if upto_blocks is None else max(0, min(upto_blocks, m.n_blocks))
    if n == 0:
        return None
    txn = engine.begin_import(session, m.fingerprint, m.tokens[: n * m.block_size], m.hashes[:n])
    return StoreImport(index, entry, txn)


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


def copy_block(txn: ImportAPI, i: int, view: memoryview) -> None:
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
