"""The replica pushes of one node, on the event loop: one transfer per (session, target) at a time, a
newer replica replacing a queued one (and a moving one only once it stalls or no longer matches the
session), send permits given by value when the link cannot carry every replica (`pushorder`), and
around each push's sender thread (`stream.PushStream`) its pins, its events and its link's accounting.
A push carries the session's newest state snapshot too, where the model keeps them (`node.engine.snapshots`):
its bytes count in what the push weighs and in what the link carried."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

from kvmesh.node.config import KVShareConfig
from kvmesh.node.engine.boundary import EngineAPI
from kvmesh.node.engine.snapshots import Snapshots
from kvmesh.node.kvshare import wire
from kvmesh.node.kvshare.common import MAX_UNUSED_TRACKED, _await_worker, _remember
from kvmesh.node.kvshare.links import LinkStats
from kvmesh.node.kvshare.pushorder import PushFacts, PushGate, push_key
from kvmesh.node.kvshare.stream import PushResult, PushStream, _Job
from kvmesh.node.protocol import Event, ReplicaRefused, ReplicaSent, ReplicaStarted, ReplicaSuperseded

log = logging.getLogger("kvmesh.kvshare")


class ThinkTimes:
    """How long sessions think between turns (a turn's end to the next one's start), learnt from the
    turns that end here: when a session's next turn is expected."""

    def __init__(self) -> None:
        self._turns: dict[str, tuple[float, float]] = {}  # session -> (last turn end, its think-time EWMA)
        self._think_s = 10.0  # think-time EWMA over all sessions: the guess for one without history

    def note_turn(self, session: str, turn_s: float) -> None:
        """Learn the session's think time (its last turn's end to this turn's start)."""
        now = time.monotonic()
        prev = self._turns.get(session)
        think = prev[1] if prev else self._think_s
        if prev is not None:
            gap = max(0.0, now - turn_s - prev[0])
            think = 0.5 * think + 0.5 * gap
            self._think_s = 0.9 * self._think_s + 0.1 * gap
        _remember(self._turns, session, (now, think), MAX_UNUSED_TRACKED)

    def last_turn(self, session: str) -> tuple[float, float]:
        """(monotonic time its last turn ended, its think time); now and the mesh-wide guess if unknown."""
        return self._turns.get(session, (time.monotonic(), self._think_s))


class PushSender:
    """The push queue and its sends. It is given what it uses: the host's name, the engine, its config
    section, the stats of its outgoing links (by target), the sessions' think times, the thread-side
    stream, a publish function, a peer resolver, the generation counter it shares with the store's
    write-behinds, and the engine's snapshots (None: its model keeps none)."""

    def __init__(self, name: str, engine: EngineAPI, cfg: KVShareConfig, *, out: dict[str, LinkStats],
                 think: ThinkTimes, stream: PushStream, publish: Callable[[Event], object],
                 peer_address: Callable[[str], str | None], next_generation: Callable[[], int],
                 snapshots: Snapshots | None = None):
        self.name = name
        self.engine = engine
        self.snapshots = snapshots
        self.cfg = cfg
        self.out = out
        self._think = think
        self._stream = stream
        self._publish = publish
        self._peer_address = peer_address
        self._next_generation = next_generation
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._queued: dict[tuple[str, str], _Job] = {}
        # Twice the gate's permits: a push waiting for the receiver's verdict has given its permit back.
        self._send_pool = concurrent.futures.ThreadPoolExecutor(2 * cfg.concurrency, thread_name_prefix="kvshare-send")
        self._gate = PushGate(cfg.concurrency)
        self._landed_tokens: dict[tuple[str, str], int] = {}  # what the last landed push left at the target
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def stop(self) -> None:
        for job in [*self._jobs.values(), *self._queued.values()]:
            job.supersede()
        self._send_pool.shutdown(wait=False, cancel_futures=True)

    def inflight_to(self, session: str) -> str | None:
        for s, t in self._jobs:
            if s == session:
                return t
        return None

    def pending(self) -> int:
        """Pushes queued or moving (one per session and target)."""
        return len(self._jobs.keys() | self._queued.keys())

    def moving(self) -> list[_Job]:
        """The pushes under way now (each pins the pool blocks it sends from)."""
        return [j for j in self._jobs.values() if j.started and not j.done.done()]

    def push_facts(self, session: str, target: str) -> PushFacts:
        """What the push gate weighs: bytes the target lacks (its blocks' and the snapshot's that goes with
        them), time to the session's next turn, and the chance that turn moves (this host, its home, has no
        free slot now, or is nearly full)."""
        e = self.engine
        lacks = max(0, e.resident_tokens(session) - self._landed_tokens.get((session, target), 0))
        # A model's snapshots are all about one size (its window's cells, its recurrent state): the last one's.
        snap = self.snapshots.last_bytes if self.snapshots is not None else 0
        end, think = self._think.last_turn(session)
        load = e.slots
        p_move = 1.0 if load.queued or load.busy >= load.slots else load.busy / max(1, load.slots)
        return PushFacts(bytes_needed=lacks * e.kv_bytes_per_token + snap, next_turn_in_s=end + think - time.monotonic(),
                         p_move=p_move)

    def _push_key(self, job: _Job) -> tuple[float, float]:
        if self._queued.get((job.session, job.target)) is not job:
            return (-2.0, 0.0)  # superseded while waiting: let it go at once
        return push_key(self.push_facts(job.session, job.target), self.out[job.target].goodput_bps())

    def _link_freer(self) -> Callable[[], None]:
        """A callable, safe from any thread and idempotent, that gives one gate permit back."""
        loop, released = self._loop, threading.Event()
        assert loop is not None

        def free() -> None:
            if released.is_set():
                return
            released.set()
            try:
                on_loop = asyncio.get_running_loop() is loop
            except RuntimeError:  # a sender thread
                on_loop = False
            if on_loop:
                self._gate.release()
            else:
                loop.call_soon_threadsafe(self._gate.release)

        return free

    def submit(self, session: str, target: str) -> asyncio.Future[PushResult]:
        """Queue a replica push; a newer one supersedes an older one queued. One in flight is
        superseded only if the session no longer extends what it sends, or once it stalls
        (`supersede_stall_s`): otherwise it finishes and the newer one sends the delta after it.
        (Restarting a progressing transfer on every turn starves a slow link: nothing lands.)"""
        assert self._loop is not None
        key = (session, target)
        old = self._queued.pop(key, None)
        if old is not None:
            old.done.set_result(PushResult(False, reason="superseded"))
            self._superseded(session, target)
        running = self._jobs.get(key)
        if running is not None and running.started and not running.cancel.is_set() and not self._extends(running):
            self._supersede_running(running)
        job = _Job(session, target, self._loop.create_future())
        self._queued[key] = job
        asyncio.ensure_future(self._run_job(job))
        return job.done

    def _extends(self, job: _Job) -> bool:
        """Whether the session's blocks in the engine now still start with what `job` sends."""
        if job.offer_tip is None:
            return True  # not exported yet: it will send the newest state
        n, tip = job.offer_tip
        return self.engine.block_hash(job.session, n - 1) == tip

    def _supersede_running(self, job: _Job) -> None:
        job.supersede()
        self.out[job.target].superseded_in_flight += 1
        self._superseded(job.session, job.target)

    def _superseded(self, session: str, target: str) -> None:
        self.out[target].superseded += 1
        self._publish(ReplicaSuperseded(session=session, src=self.name, dst=target))

    async def _run_job(self, job: _Job) -> None:
        key = (job.session, job.target)
        # At most one transfer per (session, target): wait for the running one to end (without
        # holding a concurrency permit), replacing it if it stalls.
        while (running := self._jobs.get(key)) is not None and self._queued.get(key) is job:
            if not running.cancel.is_set() and time.monotonic() - running.progress_at > self.cfg.supersede_stall_s:
                self._supersede_running(running)
            await asyncio.sleep(0.02)
        if self._queued.get(key) is not job:
            return  # superseded while waiting
        # The most valuable queued push gets the next free permit (pushorder), not the oldest. A permit
        # covers the push's use of the link: it is given back once the last byte is sent, not when the
        # receiver has answered, so the next push fills the link while this one is verified and landed.
        # While it waits for a permit the link to its target is backlogged: there is more to send than
        # the link carries (a push waiting for its own session's previous one is not counted: it waits
        # for that delta to land, not for the link).
        link = self.out[job.target]
        link.queue_changed(+1)
        try:
            await self._gate.acquire(lambda: self._push_key(job))
        finally:
            link.queue_changed(-1)
        job.link_free = self._link_freer()
        try:
            while key in self._jobs:  # superseded, still winding down
                await asyncio.sleep(0.01)
            if self._queued.get(key) is not job:
                return  # superseded while waiting
            del self._queued[key]
            self._jobs[key] = job
            job.started = True
            job.progress_at = time.monotonic()
            try:
                result = await self._send(job)
            except Exception as e:  # noqa: BLE001 - a failed push never fails a turn
                log.exception("replica push of %s to %s failed", job.session, job.target)
                result = PushResult(False, reason="error", message=type(e).__name__)
            finally:
                self._jobs.pop(key, None)
        finally:
            job.link_free()
        if not job.done.done():
            job.done.set_result(result)

    async def _send(self, job: _Job) -> PushResult:
        e = self.engine
        addr = self._peer_address(job.target)
        if addr is None:
            return PushResult(False, reason="unknown_peer", message=f"{job.target} is not a configured peer")
        generation = self._next_generation()
        pinned = self.engine.pin(job.session)
        if pinned is None:
            return PushResult(False, reason="nothing", message="the engine holds no whole block of this session")
        try:
            offer = wire.Offer(session=job.session, sender=self.name, fingerprint=e.fingerprint, block_size=e.block_size,
                               block_bytes=e.block_bytes, n_blocks=len(pinned.ids), generation=generation,
                               sent_at=time.time())
            job.offer_tip = (len(pinned.ids), pinned.hashes[-1])
            self._publish(ReplicaStarted(session=job.session, src=self.name, dst=job.target, blocks=len(pinned.ids),
                                         tokens=len(pinned.ids) * e.block_size))
            assert self._loop is not None
            snapshot = self.snapshots.newest if self.snapshots is not None else None
            fut = self._loop.run_in_executor(self._send_pool, self._stream.send, addr, offer, pinned, job,
                                             self.out[job.target].backlog_s_now, snapshot)
            result = await _await_worker(fut, stop=job.supersede, release=pinned.release)
        except asyncio.CancelledError:
            raise  # the pins go once the sender thread has stopped
        except BaseException:
            pinned.release()
            raise
        pinned.release()
        if job.preempted and not result.ok:
            result = PushResult(False, reason="preempted", bytes_sent=result.bytes_sent,
                                message="a turn on this host needed the pool blocks the push was sending from")
        self._account(job, result)
        return result

    def _account(self, job: _Job, result: PushResult) -> None:
        """The push's figures on its link, and its event."""
        st = self.out[job.target]
        st.wire["replica_landed" if result.ok else "replica_cut"] += result.wire_sent
        st.wire["replica_replies"] += result.wire_received
        if result.ok:
            st.add(result.bytes_sent, result.seconds)
            st.landed_backlogged_bytes += result.backlogged_bytes
            if result.snapshot_bytes:
                st.snapshots += 1
                st.snapshot_bytes += result.snapshot_bytes
            _remember(self._landed_tokens, (job.session, job.target), result.tokens, MAX_UNUSED_TRACKED)
            self._publish(ReplicaSent(session=job.session, src=self.name, dst=job.target, blocks=result.blocks_sent,
                                      bytes=result.bytes_sent, seconds=round(result.seconds, 4), tokens=result.tokens,
                                      snapshot_bytes=result.snapshot_bytes))
        elif result.reason != "superseded":
            st.refused[result.reason] += 1
            if result.snapshot_bytes:
                st.snapshots_failed += 1
            self._publish(ReplicaRefused(session=job.session, src=self.name, dst=job.target, reason=result.reason,
                                         message=result.message))
