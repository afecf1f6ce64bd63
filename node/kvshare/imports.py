"""Before a turn: the engine must hold what this host holds of the session. `ensure_imported` waits for
a replica still landing while that beats recomputing what it brings (`keep_waiting`), then imports the
store's replica: blocks reserved on the loop, copied and digested on worker threads, committed on the
loop, so a node importing 1 GB still answers every other turn and event."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping

import numpy as np

from kvmesh.node.engine.boundary import EngineAPI
from kvmesh.node.errors import ImportRefused, KVMeshError
from kvmesh.node.kvshare.common import _await_worker
from kvmesh.node.kvshare.explain import HandoffNotes, store_match_blocks
from kvmesh.node.kvshare.landing import _Inbound
from kvmesh.node.kvshare.store import ReplicaStore
from kvmesh.node.kvshare.stream import _Job
from kvmesh.node.protocol import Event, ReplicaImported

log = logging.getLogger("kvmesh.kvshare")

IMPORT_THREADS = 2  # store -> engine imports copying at once (memcpy and digests let go of the GIL)
MAX_INBOUND_WAIT_S = 30.0  # a turn never waits longer than this for a replica still landing
INBOUND_CHECK_S = 0.1  # while a turn waits for a landing replica, its progress is judged this often


def keep_waiting(rest_s: float, at_stake: int, prefill_tps: float) -> bool:
    """Whether a turn should keep waiting for the rest of a replica still landing: only while it is
    expected to land sooner than the engine would recompute the tokens at stake. A replica is usable
    only once it lands whole (the receiver commits at its end), so every token it brings beyond
    what this host held is at stake, not just those still on the wire."""
    return at_stake > 0 and rest_s < at_stake / max(prefill_tps, 1.0)


class Imports:
    """The import path. It is given what it uses: the host's name, the engine, the store, the replicas
    landing now (the receiver's map, read here), the handoff notes it records each turn's start in, a
    publish function, and what pins pool blocks a restore may need: the pushes under way
    (`pushes_moving`) and the store's write-behinds (`writes_pending`)."""

    def __init__(self, name: str, engine: EngineAPI, store: ReplicaStore, *, inbound: Mapping[str, _Inbound],
                 notes: HandoffNotes, publish: Callable[[Event], object], pushes_moving: Callable[[], list[_Job]],
                 writes_pending: Callable[[], list[concurrent.futures.Future[None]]]):
        self.name = name
        self.engine = engine
        self.store = store
        self._inbound = inbound
        self._notes = notes
        self._publish = publish
        self._pushes_moving = pushes_moving
        self._writes_pending = writes_pending
        self._import_rates: collections.deque[float] = collections.deque(maxlen=32)
        self._imports: concurrent.futures.ThreadPoolExecutor | None = None  # see _import_pool
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def stop(self) -> None:
        if self._imports is not None:
            self._imports.shutdown(wait=False, cancel_futures=True)

    def import_bps(self) -> float:
        r = sorted(self._import_rates)
        return r[len(r) // 2] if r else 2e9

    async def ensure_imported(self, session: str, prompt: np.ndarray) -> int:
        """Ask the engine what it holds; if the store (or a replica landing now) holds more
        of this prompt, import it before the turn runs. Returns tokens imported."""
        ib = self._inbound.get(session)
        if ib is not None:
            await self._wait_inbound(session, ib)
        e = self.engine
        held = e.cached_prefix(session, prompt)
        stored_blocks = store_match_blocks(self.store, e, session, prompt)
        self._notes.note_before(session, prompt, ib, stored_blocks * e.block_size)
        self._notes.used(session)
        if stored_blocks * e.block_size <= held:
            return 0
        t0 = time.monotonic()
        try:
            tokens = await self._import_from_store(session, stored_blocks)
        except KVMeshError as err:
            # An optimisation failed: the turn runs with what the engine has.
            log.warning("import of %s from the store failed (%s); running without it", session, err)
            return 0
        secs = time.monotonic() - t0
        if secs > 0:
            self._import_rates.append((stored_blocks * e.block_bytes) / secs)
        self._publish(ReplicaImported(session=session, host=self.name, tokens=tokens, seconds=round(secs, 4)))
        return tokens

    async def _wait_inbound(self, session: str, ib: _Inbound) -> None:
        """Wait for a replica of the session still landing while that beats recomputing what it
        has yet to bring (judged every INBOUND_CHECK_S from its observed rate), at most
        MAX_INBOUND_WAIT_S; return as soon as it lands."""
        t0 = time.monotonic()
        while not ib.arrived.is_set():
            now = time.monotonic()
            rest_tokens, rest_s = ib.tokens - ib.held, ib.rest_s(now)  # none of it is usable before the end
            prefill = self.engine.prefill_rate()
            if now - t0 >= MAX_INBOUND_WAIT_S or not keep_waiting(rest_s, rest_tokens, prefill):
                log.info("turn of %s runs now, after %.2fs: its replica from %s has %d of %d tokens here; the rest "
                         "is expected in %.2fs, recomputing what it brings takes %.2fs", session, now - t0, ib.src, ib.landed,
                         ib.tokens, rest_s, rest_tokens / max(prefill, 1.0))
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ib.arrived.wait(), min(INBOUND_CHECK_S, t0 + MAX_INBOUND_WAIT_S - now))
        log.info("turn of %s waited %.2fs for its replica from %s to land", session, time.monotonic() - t0, ib.src)

    async def _import_from_store(self, session: str, upto_blocks: int) -> int:
        """Reserve the engine's blocks here on the loop, copy and digest on a worker thread,
        commit back on the loop. Whatever fails (or cancels the await), the import is aborted:
        the engine gets nothing, and its reserved blocks go back only once the worker stopped."""
        e = self.engine
        try:
            imp = self.store.begin_import(e, session, upto_blocks=upto_blocks)
        except ImportRefused as err:
            # Pushes and store write-behinds pin the pool blocks they read; a user's turn comes first.
            if err.reason != "no_room" or not await self._free_pinned(session):
                raise
            imp = self.store.begin_import(e, session, upto_blocks=upto_blocks)
        if imp is None:
            return 0
        assert self._loop is not None
        cancel = threading.Event()
        fut = self._loop.run_in_executor(self._import_pool(), imp.copy, cancel)
        try:
            await _await_worker(fut, stop=cancel.set, release=imp.txn.abort)
        except asyncio.CancelledError:
            raise  # aborted by _await_worker once the worker returns
        except BaseException:
            imp.txn.abort()
            raise
        return imp.txn.commit()

    def _import_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """Worker threads for store -> engine imports (not the disk thread: a turn's import must
        not queue behind write-behinds). Made on first use."""
        if self._imports is None:
            self._imports = concurrent.futures.ThreadPoolExecutor(IMPORT_THREADS, thread_name_prefix="kvshare-import")
        return self._imports

    async def _free_pinned(self, session: str, limit_s: float = 2.0) -> bool:
        """Free the pool blocks kv_share pins so a restore can have them; True once they are free
        (False when kv_share pinned nothing, or they did not come free within limit_s).

        Pushes in flight are stopped (each ends refused: "preempted"; the session's next turn
        replicates it again); store write-behinds, short disk copies, are waited for."""
        jobs = self._pushes_moving()
        writes = [asyncio.wrap_future(f) for f in self._writes_pending()]
        if not jobs and not writes:
            return False
        log.warning("restore of %s needs pool blocks that %d replica push(es) and %d store write(s) pin",
                    session, len(jobs), len(writes))
        for j in jobs:
            j.preempt()
        waits = [asyncio.shield(j.done) for j in jobs] + [asyncio.shield(w) for w in writes]
        _, pending = await asyncio.wait(waits, timeout=limit_s)
        await asyncio.sleep(0)  # a write-behind hands its pins back through the loop
        return not pending
