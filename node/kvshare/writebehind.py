"""Write-behind: sessions' blocks copied from the engine's pool into this host's replica store, off the
path of every turn and every landing: the disk copy of a replica that landed in the pool, and this host's
own sessions, so an eviction here is restored from the store, not recomputed.

With a host-memory tier (`hosttier.py`) a write-behind is two steps: the pool blocks are pinned on the
loop and copied into the tier on the stage thread (one memcpy each), then let go; the disk copy is
written from the tier on the disk thread, the tier's blocks pinned until it is. So the pool is pinned
for a memory copy only, never while writes queue on the disk: a restore waiting for pool room waits
for stages (`pending`), not for the disk. Without a tier, or when it has no room, the pool blocks stay
pinned until the disk write ends, as before the tier.

Where the model keeps state snapshots (`node.engine.snapshots`), each disk write takes the newest one the
written blocks reach along (looked up on the disk thread), so the stored replica resumes as the engine's
would; a turn that added no block but a newer snapshot writes that alone."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvmesh.node.engine.boundary import EngineAPI
from kvmesh.node.engine.hashing import payload_digest
from kvmesh.node.engine.snapshots import Snapshots
from kvmesh.node.kvshare.hosttier import HostTier, Staged
from kvmesh.node.kvshare.store import ReplicaStore, SegmentWriter

log = logging.getLogger("kvmesh.kvshare")

BlockBytes = Callable[[int], memoryview | np.ndarray]  # the k-th block of a write's bytes


class WriteBehind:
    """The store's write-behinds. It is given the engine whose pool it copies from, the store, the
    generation counter it shares with the pushes, the host-memory tier (None: none), and the engine's
    snapshots (None: its model keeps none)."""

    def __init__(self, engine: EngineAPI, store: ReplicaStore, *, next_generation: Callable[[], int],
                 tier: HostTier | None = None, snapshots: Snapshots | None = None):
        self.engine = engine
        self.snapshots = snapshots
        self.store = store
        self.tier = tier
        self._next_generation = next_generation
        self._disk = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvshare-disk")
        self._stage = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvshare-stage")
        self._writes: set[concurrent.futures.Future[None]] = set()  # what pins pool blocks now: stages, untiered writes
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def stop(self) -> None:
        self._stage.shutdown(wait=True)
        self._disk.shutdown(wait=True)

    def pending(self) -> list[concurrent.futures.Future[None]]:
        """The write-behinds that pin pool blocks now: stages into the tier, and disk writes read from the pool."""
        return list(self._writes)

    def persist_own(self, session: str) -> None:
        """Write-behind this host's own session to its store (delta), so an eviction here is
        restored from the store rather than recomputed."""
        e = self.engine
        pinned = e.pin(session)  # for its hashes and tokens only: the write-behind pins what it copies
        if pinned is None:
            return
        pinned.release()
        have = self.store.held_prefix_blocks(session, e.fingerprint, pinned.hashes)
        if have < len(pinned.hashes) or self.snapshots is not None:  # every block held: perhaps a newer snapshot
            self.write_behind(session, pinned.tokens, pinned.hashes, have)

    def write_behind(self, session: str, tokens: np.ndarray, hashes: list[bytes], first_block: int) -> None:
        """Copy blocks [first_block, n) from the engine's pool to the store: through the tier as far as it
        has room (see the module docstring), the rest straight from the pool on the disk thread.

        The pool blocks are pinned here (on the loop), so the pool cannot reuse them before they are copied."""
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
            if self.snapshots is not None and 0 < first_block == len(hashes):
                self._snapshot_only(_DeltaWrite(session, tokens[: first_block * bs], hashes, first_block,
                                                self._next_generation()))
            return
        n = first_block + len(ids)
        st = None
        if self.tier is not None:
            st = self.tier.stage(hashes[first_block:n], [tokens[i * bs : (i + 1) * bs] for i in range(first_block, n)])
        pins = _PoolPins(self._loop_(), e.blocks.release, ids, staged=len(st.ids) if st is not None else 0)
        self._track(pins.done)
        write = _DeltaWrite(session, tokens[: n * bs], hashes[:n], first_block, self._next_generation())
        try:
            self._stage.submit(self._staging, write, pins, st)
        except RuntimeError:  # stopped: nothing is written
            pins.release_staged()
            pins.release_rest()
            if st is not None and self.tier is not None:
                self.tier.unpin(st.ids)

    def _staging(self, write: _DeltaWrite, pins: _PoolPins, st: Staged | None) -> None:
        """The stage thread's work: copy the staged blocks from the pool into the tier and let go of their
        pool blocks, then queue the disk write (through here, so disk writes keep the order they were asked in)."""
        tier, read = self.tier, self.engine.pool.read_bytes
        staged: list[int] = st.ids if st is not None else []
        try:
            if st is not None and tier is not None:
                for k, copied in enumerate(st.copy):
                    if copied:
                        np.copyto(tier.view(st.ids[k]), np.frombuffer(read(pins.ids[k]), dtype=np.uint8))
                tier.staged_whole(st)
        except BaseException:
            log.exception("staging %s in the host tier failed; its store copy is not written", write.session)
            pins.release_staged()
            pins.release_rest()
            if tier is not None:
                tier.unpin(staged)
            return
        pins.release_staged()

        def block(k: int) -> memoryview | np.ndarray:
            return tier.view(staged[k]) if k < len(staged) and tier is not None else read(pins.ids[k])

        def release() -> None:
            pins.release_rest()
            if tier is not None and staged:
                tier.unpin(staged)

        try:
            self._disk.submit(self._disk_write, write, block, release)
        except RuntimeError:  # stopped: the disk copy is not written
            release()

    def _snapshot_only(self, d: _DeltaWrite) -> None:
        """Every block of the session is stored: a disk write of its newest snapshot alone, if that is newer."""
        def no_block(k: int) -> memoryview:
            raise IndexError(k)

        try:
            self._disk.submit(self._disk_write, d, no_block, lambda: None)
        except RuntimeError:  # stopped: nothing is written
            pass

    def _newer_snapshot(self, d: _DeltaWrite, w: SegmentWriter) -> None:
        """Give the write the newest snapshot its blocks reach, unless the store keeps one as far already."""
        if self.snapshots is None or (snap := self.snapshots.newest(d.tokens)) is None:
            return
        m = self.store.manifest(d.session)
        held = m.snapshot.pos if m is not None and m.snapshot is not None else 0
        if snap.pos > held or held > d.first_block * self.engine.block_size:
            w.set_snapshot(snap.pos, snap.blob, payload_digest(snap.blob))

    def _disk_write(self, d: _DeltaWrite, block: BlockBytes, release: Callable[[], None]) -> None:
        """The disk thread's work: blocks [first_block, n) written as one delta of the session's replica,
        the k-th read by `block(k)`, with its newest snapshot; `release` runs once they are no longer read,
        whatever happened."""
        e = self.engine
        try:
            w = self.store.begin_write(d.session, fingerprint=e.fingerprint, block_size=e.block_size,
                                       block_bytes=e.block_bytes, tokens=d.tokens, hashes=d.hashes,
                                       first_block=d.first_block, generation=d.generation)
            with w:
                for k in range(len(d.hashes) - d.first_block):
                    v = block(k)
                    w.write_block(d.first_block + k, v, payload_digest(v))
                self._newer_snapshot(d, w)
                if d.first_block == len(d.hashes) and w.snapshot is None:
                    return  # nothing new: the held version stands (the writer aborts, `release` still runs)
                w.commit()
            self.store.mark_own(d.session, True)
        except Exception as err:  # noqa: BLE001 - the store is an optimisation
            log.warning("store write of %s failed: %s", d.session, err)
        finally:
            release()

    def _loop_(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "WriteBehind.start first"
        return self._loop

    def _track(self, fut: concurrent.futures.Future[None]) -> None:
        loop = self._loop
        assert loop is not None
        self._writes.add(fut)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._writes.discard, f))  # the set is the loop's


@dataclass(frozen=True)
class _DeltaWrite:
    """One write-behind: blocks [first_block, len(hashes)) of the session, `tokens` those of its blocks."""

    session: str
    tokens: np.ndarray
    hashes: list[bytes]
    first_block: int
    generation: int


class _PoolPins:
    """A write-behind's pins on pool blocks (`ids`, in block order): the first `staged` go once the tier
    has their copy, the rest once the disk write read them; `done` once all are let go. Released from any
    thread: the engine's bookkeeping changes on its loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, release: Callable[[list[int]], None], ids: list[int], *,
                 staged: int) -> None:
        self.ids = ids
        self._loop, self._release, self._staged = loop, release, staged
        self._left = [ids[:staged], ids[staged:]]
        self.done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def release_staged(self) -> None:
        self._let_go(0)

    def release_rest(self) -> None:
        self._let_go(1)

    def _let_go(self, part: int) -> None:
        ids, self._left[part] = self._left[part], []
        if ids:
            self._loop.call_soon_threadsafe(self._release, ids)
        if not any(self._left) and not self.done.done():
            self.done.set_result(None)
