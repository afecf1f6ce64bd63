"""Before a turn: the engine must hold what this host holds of the session. `ensure_imported` waits for
a replica still landing while that beats recomputing what it brings (`keep_waiting`), then restores the
prompt's blocks from the host-memory tier and the store's replica: blocks reserved on the loop, copied
(and the stored ones digested) on worker threads, committed on the loop, so a node importing 1 GB still
answers every other turn and event. A pool too full for the whole restore restores what fits. Where the
model resumes only at a state snapshot (window mode, recurrent state: `node.engine.snapshots`), the stored
replica's snapshot goes into the engine's snapshots first (read and checked on a worker thread), so the
blocks it makes usable count in what the engine holds."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kvmesh.node.engine.boundary import EngineAPI
from kvmesh.node.engine.hashing import block_hashes, chain_seed
from kvmesh.node.engine.snapshots import Snapshots
from kvmesh.node.errors import ImportRefused, KVMeshError
from kvmesh.node.kvshare.common import _await_worker
from kvmesh.node.kvshare.explain import HandoffNotes, store_match_blocks
from kvmesh.node.kvshare.hosttier import HostTier
from kvmesh.node.kvshare.landing import _Inbound
from kvmesh.node.kvshare.store import ReplicaStore
from kvmesh.node.kvshare.store.restore import StoreImport
from kvmesh.node.kvshare.stream import _Job
from kvmesh.node.protocol import Event, ReplicaImported

log = logging.getLogger("kvmesh.kvshare")

IMPORT_THREADS = 2  # store -> engine imports copying at once (memcpy and digests let go of the GIL)
MAX_INBOUND_WAIT_S = 30.0  # a turn never waits longer than this for a replica still landing
INBOUND_CHECK_S = 0.1  # while a turn waits for a landing replica, its progress is judged this often
FREE_PINNED_S = 2.0  # a restore waits at most this long for kv_share's own pins on the pool to let go


def keep_waiting(rest_s: float, at_stake: int, prefill_tps: float) -> bool:
    """Whether a turn should keep waiting for the rest of a replica still landing: only while it is
    expected to land sooner than the engine would recompute the tokens at stake. A replica is usable
    only once it lands whole (the receiver commits at its end), so every token it brings beyond
    what this host held is at stake, not just those still on the wire."""
    return at_stake > 0 and rest_s < at_stake / max(prefill_tps, 1.0)


class Imports:
    """The import path. It is given what it uses: the host's name, the engine, the store, the replicas
    landing now (the receiver's map, read here), the handoff notes it records each turn's start in, a
    publish function, what pins pool blocks a restore may need: the pushes under way
    (`pushes_moving`) and the store's write-behinds (`writes_pending`), and the host-memory tier
    (`hosttier.py`) a restore takes blocks from before the store, and the engine's snapshots (None: its model
    keeps none)."""

    def __init__(self, name: str, engine: EngineAPI, store: ReplicaStore, *, inbound: Mapping[str, _Inbound],
                 notes: HandoffNotes, publish: Callable[[Event], object], pushes_moving: Callable[[], list[_Job]],
                 writes_pending: Callable[[], list[concurrent.futures.Future[None]]], tier: HostTier,
                 snapshots: Snapshots | None = None):
        self.name = name
        self.engine = engine
        self.snapshots = snapshots
        self.store = store
        self.tier = tier
        self._seed = chain_seed(engine.fingerprint)
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
        """Ask the engine what it holds; if the store and the host-memory tier (or a replica landing now)
        hold more of this prompt, import it before the turn runs. Returns tokens imported."""
        ib = self._inbound.get(session)
        if ib is not None:
            await self._wait_inbound(session, ib)
        if self.snapshots is not None:
            await self._restore_snapshot(session, prompt, self.snapshots)
        e = self.engine
        held = e.cached_prefix(session, prompt)
        stored_blocks = store_match_blocks(self.store, e, session, prompt)
        hashes = self._restorable(prompt, stored_blocks)
        self._notes.note_before(session, prompt, ib, len(hashes) * e.block_size)
        self._notes.used(session)
        if len(hashes) * e.block_size <= held:
            return 0
        t0 = time.monotonic()
        try:
            tokens = await self._import_from_store(session, prompt, hashes)
        except KVMeshError as err:
            # An optimisation failed: the turn runs with what the engine has.
            log.warning("import of %s from the store failed (%s); running without it", session, err)
            return 0
        secs = time.monotonic() - t0
        if secs > 0 and tokens:
            self._import_rates.append((tokens // e.block_size * e.block_bytes) / secs)
        self._publish(ReplicaImported(session=session, host=self.name, tokens=tokens, seconds=round(secs, 4)))
        return tokens

    async def _restore_snapshot(self, session: str, prompt: np.ndarray, snapshots: Snapshots) -> None:
        """Put the stored replica's snapshot into the engine's snapshots when the prompt extends it and the engine
        has none as far; on a worker thread (a disk read, a digest). A corrupt one drops the stored replica: the
        turn recomputes what it would have brought, never resumes from it."""
        m = self.store.manifest(session)
        w = m.snapshot if m is not None and m.fingerprint == self.engine.fingerprint else None
        if m is None or w is None or w.pos > len(prompt):
            return

        def restore() -> None:
            if not np.array_equal(m.tokens[: w.pos], prompt[: w.pos]) or snapshots.usable(prompt, w.pos) >= w.pos:
                return
            got = self.store.read_snapshot(session)
            if got is None:
                return
            tokens, blob = got  # as read: the version may have changed since the manifest was looked at
            if len(tokens) <= len(prompt) and np.array_equal(tokens, prompt[: len(tokens)]):
                if (why := snapshots.put(tokens, blob, received=True)) is not None:
                    log.warning("the stored snapshot of %s at %d was refused: %s", session, len(tokens), why)

        assert self._loop is not None
        try:
            await self._loop.run_in_executor(self._import_pool(), restore)
        except KVMeshError as err:
            log.warning("the stored snapshot of %s was not restored (%s); the turn resumes without it", session, err)

    def _restorable(self, prompt: np.ndarray, stored: int) -> list[bytes]:
        """Chain hashes of the prompt's leading blocks this host can restore: the `stored` ones its store
        holds of the session, then on while the host-memory tier holds the next (any session's)."""
        bs, tier = self.engine.block_size, self.tier
        hashes = block_hashes(self._seed, prompt, bs)
        n = min(stored, len(hashes))
        while n < len(hashes) and tier.holds(hashes[n], prompt[n * bs : (n + 1) * bs]):
            n += 1
        return hashes[:n]

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
                async with asyncio.timeout(min(INBOUND_CHECK_S, t0 + MAX_INBOUND_WAIT_S - now)):
                    await ib.arrived.wait()
        log.info("turn of %s waited %.2fs for its replica from %s to land", session, time.monotonic() - t0, ib.src)

    async def _import_from_store(self, session: str, prompt: np.ndarray, hashes: list[bytes]) -> int:
        """Reserve the engine's blocks here on the loop, copy and digest on a worker thread,
        commit back on the loop. Whatever fails (or cancels the await), the import is aborted:
        the engine gets nothing, and its reserved blocks go back only once the worker stopped."""
        imp = await self._reserve(session, prompt, hashes)
        if imp is None:
            return 0
        assert self._loop is not None
        cancel = threading.Event()
        fut = self._loop.run_in_executor(self._import_pool(), imp.copy, cancel)
        try:
            await _await_worker(fut, stop=cancel.set, release=imp.abort)
        except asyncio.CancelledError:
            raise  # aborted by _await_worker once the worker returns
        except BaseException:
            imp.abort()
            raise
        return imp.txn.commit()

    async def _reserve(self, session: str, prompt: np.ndarray, hashes: list[bytes]) -> StoreImport | None:
        """The engine's blocks for the restore. When the pool has no room, pushes and write-behinds (which
        pin pool blocks) let go first: a user's turn comes first. When running turns hold the rest, the
        leading blocks there is room for (None: no more than the engine holds)."""
        e = self.engine

        def begin(n: int) -> StoreImport | None:
            """The import of the first n blocks; None when the pool has no room for it."""
            try:
                return self.store.begin_restore(e, session, self.tier, tokens=prompt, hashes=hashes[:n])
            except ImportRefused as err:
                if err.reason != "no_room":
                    raise
                return None

        if (imp := begin(len(hashes))) is not None:
            return imp
        if (imp := await self._free_pinned(session, lambda: begin(len(hashes)))) is not None:
            return imp
        held = e.cached_prefix(session, prompt)
        fit = min(held // e.block_size + e.blocks.num_free, len(hashes))
        if fit * e.block_size <= held:
            return None
        log.warning("restore of %s: running turns hold the pool; %d of its %d restorable blocks fit", session,
                    fit, len(hashes))
        return begin(fit)

    def _import_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """Worker threads for store -> engine imports (not the disk thread: a turn's import must
        not queue behind write-behinds). Made on first use."""
        if self._imports is None:
            self._imports = concurrent.futures.ThreadPoolExecutor(IMPORT_THREADS, thread_name_prefix="kvshare-import")
        return self._imports

    async def _free_pinned(self, session: str, room: Callable[[], StoreImport | None],
                           limit_s: float = FREE_PINNED_S) -> StoreImport | None:
        """Let go of the pool blocks kv_share pins until `room()` (the restore's reservation) succeeds;
        its import, or None when kv_share pinned nothing or the room did not come within limit_s.

        Pushes in flight are stopped (each ends refused: "preempted"; the session's next turn
        replicates it again); store write-behinds, memory copies into the host tier (or, where it has
        no room, disk copies), are waited for, each one freeing its blocks as it ends."""
        jobs = self._pushes_moving()
        writes = [asyncio.wrap_future(f) for f in self._writes_pending()]
        if not jobs and not writes:
            return None
        # Stopping a push is worth a warning; waiting out a write-behind's memory copy is routine.
        log.log(logging.WARNING if jobs else logging.INFO, "restore of %s needs pool blocks that %d replica push(es) "
                "and %d store write(s) pin", session, len(jobs), len(writes))
        for j in jobs:
            j.preempt()
        waits: set[asyncio.Future[Any]] = {asyncio.shield(j.done) for j in jobs} | {asyncio.shield(w) for w in writes}
        deadline = time.monotonic() + limit_s
        while waits and (left := deadline - time.monotonic()) > 0:
            _, waits = await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.sleep(0)  # a write-behind hands its pins back through the loop
            if (imp := room()) is not None:
                return imp
        return None
