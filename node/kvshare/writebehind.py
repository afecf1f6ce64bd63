"""Write-behind: sessions' blocks copied from the engine's pool into this host's replica store on one
disk thread, off the path of every turn and every landing: the disk copy of a replica that landed in
the pool, and this host's own sessions, so an eviction here is restored from disk, not recomputed."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable

import numpy as np

from kvmesh.node.engine.boundary import EngineAPI
from kvmesh.node.engine.hashing import payload_digest
from kvmesh.node.kvshare.store import ReplicaStore

log = logging.getLogger("kvmesh.kvshare")


class WriteBehind:
    """The store's write-behinds. It is given the engine whose pool it copies from, the store, and the
    generation counter it shares with the pushes."""

    def __init__(self, engine: EngineAPI, store: ReplicaStore, *, next_generation: Callable[[], int]):
        self.engine = engine
        self.store = store
        self._next_generation = next_generation
        self._disk = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvshare-disk")
        self._writes: set[concurrent.futures.Future[None]] = set()  # write-behinds queued or running (they pin blocks)
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def stop(self) -> None:
        self._disk.shutdown(wait=True)

    def pending(self) -> list[concurrent.futures.Future[None]]:
        """The write-behinds queued or running (each pins the pool blocks it copies)."""
        return list(self._writes)

    def persist_own(self, session: str) -> None:
        """Write-behind this host's own session to its store (delta), so an eviction here is
        restored from disk rather than recomputed."""
        e = self.engine
        pinned = e.pin(session)  # for its hashes and tokens only: the write-behind pins what it copies
        if pinned is None:
            return
        pinned.release()
        have = self.store.held_prefix_blocks(session, e.fingerprint, pinned.hashes)
        if have < len(pinned.hashes):
            self.write_behind(session, pinned.tokens, pinned.hashes, have)

    def write_behind(self, session: str, tokens: np.ndarray, hashes: list[bytes], first_block: int) -> None:
        """Copy blocks [first_block, n) from the engine's pool to the store on the disk thread.

        The blocks are pinned here (on the loop) and stay pinned until the disk write ends, so the
        pool cannot reuse them meanwhile; their bytes are read, digested and written on the disk thread."""
        e = self.engine
        bs = e.block_size
        ids: list[int] = []
        for i in range(first_block, len(hashes)):
            bid = e.blocks.lookup(hashes[i], tokens[i * bs : (i + 1) * bs])
            if bid is None:
                break
            e.blocks.acquire(bid)
            ids.append(bid)
        if not ids:
            return
        read = e.pool.read_bytes
        n = first_block + len(ids)
        gen = self._next_generation()
        loop = self._loop
        assert loop is not None

        def write() -> None:
            try:
                w = self.store.begin_write(session, fingerprint=e.fingerprint, block_size=bs, block_bytes=e.block_bytes,
                                           tokens=tokens[: n * bs], hashes=hashes[:n], first_block=first_block,
                                           generation=gen)
                with w:
                    for k, bid in enumerate(ids):
                        v = read(bid)
                        w.write_block(first_block + k, v, payload_digest(v))
                    w.commit()
                self.store.mark_own(session, True)
            except Exception as err:  # noqa: BLE001 - the store is an optimisation
                log.warning("store write of %s failed: %s", session, err)
            finally:
                loop.call_soon_threadsafe(e.blocks.release, ids)

        fut = self._disk.submit(write)
        self._writes.add(fut)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._writes.discard, f))  # the set is the loop's
