"""kv_share on one node: the replica store, the listener, the sender, and the import-before-run rule.

Threads do the socket and disk I/O (blocking calls release the GIL and keep
Python out of the byte path); every engine and index decision runs on the
event loop thread, so the engine's bookkeeping has a single writer.

Receiving: payloads land straight in the engine's pre-touched pool
(`ImportTxn.buffer`), each verified as it lands; at END the import commits and
the replica is ready. The store's disk copy is written behind, off that path.
Sending: blocks are pinned on the loop and sent from the pool as they are, read by the sender thread.
Bulk byte work (copies, digests, fsync) never runs on the event loop: imports from the store
reserve their blocks on the loop and copy on worker threads; a node importing 1 GB still
answers every other turn and event.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import logging
import select
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypeVar

import numpy as np

from kvmesh.node.config import KVShareConfig
from kvmesh.node.engine.boundary import EngineAPI, ImportAPI
from kvmesh.node.engine.engine import PinnedBlocks
from kvmesh.node.engine.hashing import payload_digest
from kvmesh.node.errors import ImportRefused, KVMeshError
from kvmesh.node.kvshare import wire
from kvmesh.node.kvshare.pushorder import PushFacts, PushGate, push_key
from kvmesh.node.kvshare.store import ReplicaStore, SegmentWriter, copy_block
from kvmesh.node.protocol import (
    Event,
    LinkInfo,
    ReplicaImported,
    ReplicaReady,
    ReplicaRefused,
    ReplicaSent,
    ReplicaStarted,
    ReplicaSuperseded,
    ShortfallReason,
)
from kvmesh.node.tls import client_context, server_context

log = logging.getLogger("kvmesh.kvshare")
T = TypeVar("T")
K = TypeVar("K")

# Inbound transfers served at once; an offer must be complete within OFFER_DEADLINE_S (or two
# io_timeout_s) of connecting: each read is bounded by io_timeout_s, this bounds a trickling client.
MAX_INBOUND_CONNECTIONS = 64
OFFER_DEADLINE_S = 10.0
MAX_UNUSED_TRACKED = 10_000  # sessions whose received replica bytes wait to be used (or counted wasted)
IMPORT_THREADS = 2  # store -> engine imports copying at once (memcpy and digests let go of the GIL)
MAX_INBOUND_WAIT_S = 30.0  # a turn never waits longer than this for a replica still landing
INBOUND_CHECK_S = 0.1  # while a turn waits for a landing replica, its progress is judged this often
MAX_EXPLAINED = 10_000  # sessions whose last refusal, eviction or pre-turn state is kept to explain a handoff

# Without a configured mesh secret the mesh is loopback-only; kv_share still signs its frames.
DEV_SECRET = b"kvmesh-loopback-only-dev-secret"


@dataclass
class LinkStats:
    """One direction of one link, as seen from this node."""

    bytes: int = 0
    transfers: int = 0
    seconds: float = 0.0
    last_s: float | None = None
    last_bytes: int | None = None
    superseded: int = 0  # replicas replaced by a newer one: queued, or in flight (counted in both)
    superseded_in_flight: int = 0
    refused: collections.Counter[str] = field(default_factory=collections.Counter)
    ready_lag_s: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=256))
    import_s: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=256))
    window: collections.deque[tuple[float, int]] = field(default_factory=lambda: collections.deque(maxlen=512))
    # Bytes on the link by kind, as the kernel counted them on the push's socket (TCP_INFO):
    # replica_landed / replica_cut went to the target, replica_replies came back from it.
    wire: collections.Counter[str] = field(default_factory=collections.Counter)
    backlogged_s: float = 0.0  # time with at least one push to this target waiting for a send permit
    landed_backlogged_bytes: int = 0  # bytes of replicas that landed, acknowledged while a push was queued
    _queued: int = 0
    _backlog_since: float = 0.0

    def queue_changed(self, delta: int) -> None:
        """A push to this target was queued (+1) or left the queue (-1)."""
        now = time.monotonic()
        if self._queued == 0 and delta > 0:
            self._backlog_since = now
        self._queued += delta
        if self._queued == 0:
            self.backlogged_s += now - self._backlog_since

    def backlog_s_now(self) -> float:
        return self.backlogged_s + (time.monotonic() - self._backlog_since if self._queued else 0.0)

    def goodput_bps(self) -> float:
        """Bits/s of recent whole transfers (a 1 Gb/s guess before the first)."""
        return 8 * self.bytes / self.seconds if self.seconds > 0 and self.bytes else 1e9

    def add(self, nbytes: int, secs: float) -> None:
        self.bytes += nbytes
        self.transfers += 1
        self.seconds += secs
        self.last_s, self.last_bytes = secs, nbytes
        self.window.append((time.monotonic(), nbytes))

    def rate_bps(self, horizon: float = 5.0) -> float:
        now = time.monotonic()
        return 8 * sum(b for t, b in self.window if now - t <= horizon) / horizon


@dataclass
class PushResult:
    ok: bool
    tokens: int = 0
    blocks_sent: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    reason: str = ""
    message: str = ""
    wire_sent: int = 0  # payload bytes the kernel put on the link (TCP_INFO bytes_sent, with resends)
    wire_received: int = 0
    backlogged_bytes: int = 0  # bytes acknowledged while another push to the target was queued (_Progress)


@dataclass
class _Job:
    session: str
    target: str
    done: asyncio.Future[PushResult]
    cancel: threading.Event = field(default_factory=threading.Event)
    started: bool = False
    preempted: bool = False  # stopped to free the pool blocks it pinned for a turn here
    offer_tip: tuple[int, bytes] | None = None  # (blocks offered, hash of the last one) once exported
    progress_at: float = 0.0  # monotonic time the socket last took bytes (sender thread writes it)
    sock: socket.socket | None = None  # while sending: closing it unblocks a stalled send
    link_free: Callable[[], None] | None = None  # gives the push's gate permit back (once); see _stream

    def supersede(self) -> None:
        self.cancel.set()
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)


@dataclass
class _Inbound:
    """A replica being received. The loop makes it; the receiving thread writes `landed` and
    `t_first` (plain int/float stores), the loop reads them: no lock, nothing ever blocks on it."""

    src: str
    tokens: int  # tokens the replica carries (whole blocks offered)
    started: float
    eta_s: float  # expected transfer time, estimated when it was offered (from the link's past rate)
    held: int = 0  # tokens of it this host held already (not sent)
    landed: int = 0  # tokens in place so far: `held`, then each verified block as it lands
    t_first: float = 0.0  # monotonic time the first block began to arrive (0: none yet)
    offered: np.ndarray | None = None  # the replica's token ids (to tell a divergent prompt)
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # landed whole, or ended

    def rest_s(self, now: float) -> float:
        """Expected seconds until the rest lands: at the rate observed on this transfer once blocks
        have landed, else what is left of the estimate made when it was offered; once that has
        passed with nothing landed, as long again as it has taken so far (a stalled link is not
        waited for beyond what recomputing would cost)."""
        got, t_first = self.landed - self.held, self.t_first
        if got > 0 and 0 < t_first < now:
            return (self.tokens - self.landed) * (now - t_first) / got
        left = self.started + self.eta_s - now
        return left if left > 0 else now - self.started


def keep_waiting(rest_s: float, at_stake: int, prefill_tps: float) -> bool:
    """Whether a turn should keep waiting for the rest of a replica still landing: only while it is
    expected to land sooner than the engine would recompute the tokens at stake. A replica is usable
    only once it lands whole (the receiver commits at its end), so every token it brings beyond
    what this host held is at stake, not just those still on the wire."""
    return at_stake > 0 and rest_s < at_stake / max(prefill_tps, 1.0)


@dataclass(frozen=True)
class _Before:
    """What this host held of a session when a turn of it started (after any wait and import)."""

    mismatch: int | None  # where the prompt stopped matching the best cache/replica held (its end if it matched)
    diverged: bool  # ...because a token differed (not because what was held ended there)
    inflight: tuple[int, int] | None  # (tokens landed, tokens offered) of a replica still landing
    store_usable: int = 0  # tokens of the prompt the store's replica matched (whole blocks) as the turn began


@dataclass(frozen=True)
class ReuseExplained:
    """Why a handoff reused what it did (kv_share's answer to `explain`)."""

    shortfall: ShortfallReason = "none"
    mismatch_token: int | None = None  # where the prompt stopped matching the best cache held before the turn
    stale_state: bool = False  # the store held >= 90% of the prompt, yet < 90% was reused
    replica_age_s: float | None = None
    inflight_landed: int | None = None
    inflight_offered: int | None = None
    refused_reason: str | None = None
    evicted_from: Literal["engine", "store"] | None = None


def _remember(d: dict[K, T], key: K, value: T, cap: int = MAX_EXPLAINED) -> None:
    """Keep the latest `value` for `key`, forgetting the least recently set keys beyond `cap`."""
    d.pop(key, None)
    d[key] = value
    while len(d) > cap:
        d.pop(next(iter(d)))


class _Superseded(Exception):
    pass


@dataclass
class _Progress:
    """One push's bytes so far, on its sender thread."""

    backlog_s: Callable[[], float]  # the link's time backlogged so far (LinkStats.backlog_s_now)
    sent: int = 0  # handed to the socket
    acked: int = 0  # acknowledged by the receiver (TCP_INFO), as last sampled
    backlogged: int = 0  # ...of which while another push waited for a send permit
    clock: Callable[[], float] = time.monotonic
    _at: float = 0.0
    _backlog_at: float = 0.0

    def __post_init__(self) -> None:
        self._at, self._backlog_at = self.clock(), self.backlog_s()

    def acked_to(self, acked: int) -> None:
        """Sampled per block and at the verdict. Bytes acknowledged since the last sample count as
        backlogged in the share of that interval the link was backlogged: judged by the state at the
        sample alone, the bytes acknowledged while the receiver lands a push (seconds) were all
        counted whenever a push happened to be queued at the verdict, which put useful utilisation
        above 1."""
        now, backlog = self.clock(), self.backlog_s()
        span = now - self._at
        share = min(1.0, max(0.0, backlog - self._backlog_at) / span) if span > 0 else 0.0
        self.backlogged += round((acked - self.acked) * share)
        self.acked, self._at, self._backlog_at = acked, now, backlog


@dataclass
class _Plan:
    """The receiver's decision on an offer, made on the event loop."""

    refuse: tuple[str, str] | None = None
    first_missing: int = 0
    txn: ImportAPI | None = None  # payloads land in the engine's pool...
    store_only: bool = False  # ...or, when the engine has no room, in the store
    engine_held: int = 0
    store_held: int = 0
    tokens: np.ndarray | None = None
    hashes: list[bytes] = field(default_factory=list)
    inbound: _Inbound | None = None  # its progress, for turns that wait on it


@dataclass
class _Conn:
    """One inbound connection's state, on its receiving thread."""

    rx: wire.Receiver
    offer: wire.Offer | None = None
    src: str = "?"
    plan: _Plan = field(default_factory=_Plan)
    txn: ImportAPI | None = None  # reserved in the engine, not committed yet
    writer: SegmentWriter | None = None  # a store write, not committed yet
    received: int = 0
    t_first: float = 0.0
    first_block_seen: bool = False


class KVShare:
    _imports: concurrent.futures.ThreadPoolExecutor | None = None  # see _import_pool

    """kv_share of one node. It is given what it uses: the host's name, the engine, its config
    section, the mesh secrets, a publish function for its events, and a peer resolver (host name
    -> that host's kv_share address, None for a host outside the mesh)."""

    def __init__(self, name: str, engine: EngineAPI, cfg: KVShareConfig, *, secrets: list[bytes],
                 publish: Callable[[Event], object], peer_address: Callable[[str], str | None]):
        self.name = name
        self.engine = engine
        self.cfg = cfg
        self._publish = publish
        self._peer_address = peer_address
        self.secret = secrets[0] if secrets else DEV_SECRET
        self.previous_secret = secrets[1] if len(secrets) > 1 else None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        if cfg.store_dir:
            root = Path(cfg.store_dir)
        else:
            self._tmpdir = tempfile.TemporaryDirectory(prefix=f"kvmesh-store-{name}-")
            root = Path(self._tmpdir.name)
        self.store = ReplicaStore(root, cfg.store_budget_bytes, fsync=cfg.fsync)
        self.out: dict[str, LinkStats] = collections.defaultdict(LinkStats)  # by target
        self.inn: dict[str, LinkStats] = collections.defaultdict(LinkStats)  # by source
        self.wasted_bytes = 0
        self._unused: dict[str, int] = {}  # replica bytes received per session, not yet used by a turn
        self._jobs: dict[tuple[str, str], _Job] = {}
        self._queued: dict[tuple[str, str], _Job] = {}
        self._inbound: dict[str, _Inbound] = {}
        # To explain a handoff that reused less than predicted (each LRU-capped at MAX_EXPLAINED):
        self._before: dict[str, _Before] = {}  # what was held when the session's last turn here started
        self._refusals: dict[str, str] = {}  # the reason this host refused the session's latest replica
        self._evictions: dict[str, Literal["engine", "store"]] = {}  # evicted here since it last landed or ran
        self._generation = 0
        self._import_rates: collections.deque[float] = collections.deque(maxlen=32)
        # Twice the gate's permits: a push waiting for the receiver's verdict has given its permit back.
        self._send_pool = concurrent.futures.ThreadPoolExecutor(2 * cfg.concurrency, thread_name_prefix="kvshare-send")
        self._disk = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvshare-disk")
        self._writes: set[concurrent.futures.Future[None]] = set()  # write-behinds queued or running (they pin blocks)
        self._gate = PushGate(cfg.concurrency)
        self._landed_tokens: dict[tuple[str, str], int] = {}  # what the last landed push left at the target
        self._turns: dict[str, tuple[float, float]] = {}  # session -> (last turn end, its think-time EWMA)
        self._think_s = 10.0  # think-time EWMA over all sessions: the guess for one without history
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._closing = threading.Event()
        self._conn_slots = threading.BoundedSemaphore(MAX_INBOUND_CONNECTIONS)
        self.address = ""
        tls = cfg.tls
        self._server_tls = server_context(tls) if tls else None
        self._client_tls = client_context(tls) if tls else None

    # ---- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        host, port = self.cfg.listen.rsplit(":", 1)
        sock = socket.create_server((host, int(port)), backlog=64, reuse_port=False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.cfg.socket_buffer_bytes)
        self._listener = sock
        h, p = sock.getsockname()[:2]
        self.address = f"{h}:{p}"
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvshare-listen", daemon=True)
        self._accept_thread.start()

    async def stop(self) -> None:
        self._closing.set()
        for job in [*self._jobs.values(), *self._queued.values()]:
            job.supersede()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        self._send_pool.shutdown(wait=False, cancel_futures=True)
        if self._imports is not None:
            self._imports.shutdown(wait=False, cancel_futures=True)
        self._disk.shutdown(wait=True)
        if self._tmpdir is not None:
            self._tmpdir.cleanup()

    # ---- facts for the mesh ----------------------------------------------------

    def store_evicted(self, session: str) -> None:
        self.wasted_bytes += self._unused.pop(session, 0)
        _remember(self._evictions, session, "store")

    def engine_evicted(self, session: str) -> None:
        """The engine dropped the session's resident cache (its LRU, to make room)."""
        _remember(self._evictions, session, "engine")

    def store_tokens(self, session: str) -> tuple[int, float | None]:
        m = self.store.manifest(session)
        if m is None or m.fingerprint != self.engine.fingerprint:
            return 0, None
        return m.num_tokens, m.updated

    def store_sessions(self) -> list[str]:
        return self.store.sessions()

    def store_bytes(self) -> int:
        return self.store.usage_bytes()

    def inbound(self, session: str) -> tuple[int, float | None, int]:
        """(tokens of a replica of it landing here, seconds until it is expected whole, tokens landed so far)."""
        ib = self._inbound.get(session)
        if ib is None:
            return 0, None, 0
        return ib.tokens, ib.rest_s(time.monotonic()), ib.landed

    def inbound_sessions(self) -> list[str]:
        return list(self._inbound)

    def inflight_to(self, session: str) -> str | None:
        for s, t in self._jobs:
            if s == session:
                return t
        return None

    def import_bps(self) -> float:
        r = sorted(self._import_rates)
        return r[len(r) // 2] if r else 2e9

    def rates(self) -> tuple[float, float]:
        return sum(s.rate_bps() for s in self.inn.values()), sum(s.rate_bps() for s in self.out.values())

    def links_out(self) -> list[LinkInfo]:
        me = self.name
        return [
            LinkInfo(src=me, dst=dst, bytes_sent=s.bytes, transfers=s.transfers, last_transfer_s=s.last_s,
                     last_transfer_bytes=s.last_bytes, throughput_bps=s.rate_bps(),
                     goodput_gbps=(8 * s.last_bytes / s.last_s / 1e9) if s.last_s and s.last_bytes else None)
            for dst, s in sorted(self.out.items())
        ]

    def stats(self) -> dict[str, object]:
        def pct(xs: collections.deque[float], q: float) -> float | None:
            v = sorted(xs)
            return round(v[min(len(v) - 1, int(q * len(v)))], 4) if v else None

        return {
            "address": self.address,
            "out": {d: {"bytes": s.bytes, "transfers": s.transfers, "seconds": round(s.seconds, 3),
                        "superseded": s.superseded, "superseded_in_flight": s.superseded_in_flight,
                        "refused": dict(s.refused), "wire": dict(s.wire), "backlogged_s": round(s.backlog_s_now(), 3),
                        "landed_backlogged_bytes": s.landed_backlogged_bytes} for d, s in self.out.items()},
            "in": {src: {"bytes": s.bytes, "transfers": s.transfers, "seconds": round(s.seconds, 3),
                         "ready_lag_p50_s": pct(s.ready_lag_s, 0.5), "ready_lag_max_s": pct(s.ready_lag_s, 1.0),
                         "refused": dict(s.refused)} for src, s in self.inn.items()},
            "import_bps": self.import_bps(),
            "store_bytes": self.store.usage_bytes(),
            "store_budget_bytes": self.store.budget_bytes,
            "store_evictions": self.store.evictions,
            "wasted_replica_bytes": self.wasted_bytes,
        }

    # ---- before a turn: the engine must hold what the store holds ---------------

    def _store_match_blocks(self, session: str, prompt: np.ndarray) -> int:
        """Whole blocks of the stored replica that match the prompt's prefix."""
        m = self.store.manifest(session)
        e = self.engine
        if m is None or m.fingerprint != e.fingerprint:
            return 0
        n = min(len(m.tokens), len(prompt))
        diff = np.flatnonzero(m.tokens[:n] != prompt[:n])
        same = int(diff[0]) if len(diff) else n
        return same // e.block_size

    async def ensure_imported(self, session: str, prompt: np.ndarray) -> int:
        """Ask the engine what it holds; if the store (or a replica landing now) holds more
        of this prompt, import it before the turn runs. Returns tokens imported."""
        ib = self._inbound.get(session)
        if ib is not None:
            await self._wait_inbound(session, ib)
        e = self.engine
        held = e.cached_prefix(session, prompt)
        stored_blocks = self._store_match_blocks(session, prompt)
        self._note_before(session, prompt, ib, stored_blocks * e.block_size)
        self._unused.pop(session, None)  # whatever replica is here is now being used
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

    def _note_before(self, session: str, prompt: np.ndarray, ib: _Inbound | None, store_usable: int) -> None:
        """Remember what this host holds of the session as its turn starts (to explain the handoff
        later, once the turn has replaced the engine's cache): where the prompt stops matching the
        largest cache or replica held (the engine's, the store's, or one still landing), and how
        much of a replica still landing is here."""
        m = self.store.manifest(session)
        held = [t for t in (self.engine.session_tokens(session), m.tokens if m is not None else None,
                            ib.offered if ib is not None else None) if t is not None and len(t)]
        mismatch, diverged = None, False
        if held:
            best = max(held, key=len)
            n = min(len(best), len(prompt))
            diff = np.flatnonzero(best[:n] != prompt[:n])
            mismatch, diverged = (int(diff[0]), True) if len(diff) else (n, False)
        inflight = (ib.landed, ib.tokens) if ib is not None and not ib.arrived.is_set() else None
        _remember(self._before, session, _Before(mismatch, diverged, inflight, store_usable))

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
        jobs = [j for j in self._jobs.values() if j.started and not j.done.done()]
        writes = [asyncio.wrap_future(f) for f in self._writes]
        if not jobs and not writes:
            return False
        log.warning("restore of %s needs pool blocks that %d replica push(es) and %d store write(s) pin",
                    session, len(jobs), len(writes))
        for j in jobs:
            j.preempted = True
            j.supersede()
        waits = [asyncio.shield(j.done) for j in jobs] + [asyncio.shield(w) for w in writes]
        _, pending = await asyncio.wait(waits, timeout=limit_s)
        await asyncio.sleep(0)  # a write-behind hands its pins back through the loop
        return not pending

    def explain(self, session: str, prompt: np.ndarray, reused: int, predicted: int | None) -> ReuseExplained:
        """Why a turn of `session` that moved here reused `reused` tokens when placement predicted
        `predicted`: one reason, checked in order. The prompt diverged from what was held before
        the predicted point; else a replica was still landing when the turn ran; else this host
        refused the session's latest replica; else it evicted the session; else unexplained."""
        e = self.engine
        before = self._before.pop(session, None)
        m = self.store.manifest(session)
        age = round(time.time() - m.updated, 3) if m is not None else None
        # Stale state: the store held a usable replica when the turn began, and the turn did not use it
        # (what landed during the turn does not count: that is a replica in flight).
        usable = before.store_usable if before is not None else self._store_match_blocks(session, prompt) * e.block_size
        stale = usable >= 0.9 * len(prompt) and reused < 0.9 * len(prompt)
        mismatch = before.mismatch if before is not None else None
        base = ReuseExplained(mismatch_token=mismatch, stale_state=stale, replica_age_s=age)
        # Reuse comes in whole blocks: a prediction inside the last block is met by the block before it.
        expected = (predicted or 0) // e.block_size * e.block_size
        if reused >= expected:
            return base
        if before is not None and before.diverged and mismatch is not None and mismatch < expected:
            return dataclasses.replace(base, shortfall="prompt_diverged")
        if before is not None and before.inflight is not None:
            landed, offered = before.inflight
            return dataclasses.replace(base, shortfall="replica_in_flight", inflight_landed=landed,
                                       inflight_offered=offered)
        if session in self._refusals:
            return dataclasses.replace(base, shortfall="replica_refused", refused_reason=self._refusals[session])
        if session in self._evictions:
            return dataclasses.replace(base, shortfall="evicted", evicted_from=self._evictions[session])
        return dataclasses.replace(base, shortfall="unexplained")

    # ---- after a turn: replicate to the predicted next host ---------------------

    def worth_replicating(self, session: str) -> bool:
        """Whether the session's cache here is big enough to replicate (and to keep on disk)."""
        e = self.engine
        return e.resident_tokens(session) >= max(self.cfg.replicate_min_tokens, e.block_size)

    def after_turn(self, session: str, target: str | None, turn_s: float = 0.0) -> None:
        """A turn of `session` ended here after `turn_s` seconds: push the replica to `target`
        (the host placement predicts next, decided where the turn ended), and keep this host's own copy."""
        self._evictions.pop(session, None)  # it ran here: the engine holds it afresh
        self._note_turn(session, turn_s)
        if not self.worth_replicating(session):
            return
        if target is not None and target != self.name:
            self.submit(session, target)
        if self.cfg.persist_own:
            self._persist_own(session)

    def _note_turn(self, session: str, turn_s: float) -> None:
        """Learn the session's think time (its last turn's end to this turn's start)."""
        now = time.monotonic()
        prev = self._turns.get(session)
        think = prev[1] if prev else self._think_s
        if prev is not None:
            gap = max(0.0, now - turn_s - prev[0])
            think = 0.5 * think + 0.5 * gap
            self._think_s = 0.9 * self._think_s + 0.1 * gap
        _remember(self._turns, session, (now, think), MAX_UNUSED_TRACKED)

    def push_facts(self, session: str, target: str) -> PushFacts:
        """What the push gate weighs: bytes the target lacks, time to the session's next turn, and
        the chance that turn moves (this host, its home, has no free slot now, or is nearly full)."""
        e = self.engine
        lacks = max(0, e.resident_tokens(session) - self._landed_tokens.get((session, target), 0))
        end, think = self._turns.get(session, (time.monotonic(), self._think_s))
        load = e.slots
        p_move = 1.0 if load.queued or load.busy >= load.slots else load.busy / max(1, load.slots)
        return PushFacts(bytes_needed=lacks * e.kv_bytes_per_token, next_turn_in_s=end + think - time.monotonic(),
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

    async def push(self, session: str, target: str) -> PushResult:
        return await self.submit(session, target)

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
        self._generation += 1
        pinned = self.engine.pin(job.session)
        if pinned is None:
            return PushResult(False, reason="nothing", message="the engine holds no whole block of this session")
        try:
            offer = wire.Offer(session=job.session, sender=self.name, fingerprint=e.fingerprint, block_size=e.block_size,
                               block_bytes=e.block_bytes, n_blocks=len(pinned.ids), generation=self._generation,
                               sent_at=time.time())
            job.offer_tip = (len(pinned.ids), pinned.hashes[-1])
            self._publish(ReplicaStarted(session=job.session, src=self.name, dst=job.target, blocks=len(pinned.ids),
                                         tokens=len(pinned.ids) * e.block_size))
            assert self._loop is not None
            fut = self._loop.run_in_executor(self._send_pool, self._send_blocking, addr, offer, pinned, job)
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
        st = self.out[job.target]
        st.wire["replica_landed" if result.ok else "replica_cut"] += result.wire_sent
        st.wire["replica_replies"] += result.wire_received
        if result.ok:
            st.add(result.bytes_sent, result.seconds)
            st.landed_backlogged_bytes += result.backlogged_bytes
            _remember(self._landed_tokens, (job.session, job.target), result.tokens, MAX_UNUSED_TRACKED)
            self._publish(ReplicaSent(session=job.session, src=self.name, dst=job.target, blocks=result.blocks_sent,
                                      bytes=result.bytes_sent, seconds=round(result.seconds, 4), tokens=result.tokens))
        elif result.reason != "superseded":
            st.refused[result.reason] += 1
            self._publish(ReplicaRefused(session=job.session, src=self.name, dst=job.target, reason=result.reason,
                                         message=result.message))
        return result

    def _send_blocking(self, addr: str, offer: wire.Offer, pinned: PinnedBlocks, job: _Job) -> PushResult:
        host, port = addr.rsplit(":", 1)
        tx = wire.Sender(self.secret)
        try:
            raw = socket.create_connection((host, int(port)), timeout=self.cfg.connect_timeout_s)
        except OSError as err:
            return PushResult(False, reason="superseded" if job.cancel.is_set() else "unreachable", message=str(err))
        sock = self._client_tls.wrap_socket(raw) if self._client_tls else raw
        job.sock = sock
        result = PushResult(False, reason="error")
        try:
            result = self._stream(sock, tx, offer, pinned, job)
        finally:
            result.wire_sent, result.wire_received = tcp_bytes(sock)
            if not result.ok:
                # Drop what is still queued in the socket: a cut transfer must not keep the link busy.
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            sock.close()
        return result

    def _stream(self, sock: socket.socket, tx: wire.Sender, offer: wire.Offer, pinned: PinnedBlocks,
                job: _Job) -> PushResult:
        """Offer, then send the blocks the receiver lacks, then wait for its verdict."""
        prog = _Progress(self.out[job.target].backlog_s_now)
        try:
            sock.settimeout(self.cfg.io_timeout_s)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.cfg.socket_buffer_bytes)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            frame = tx.offer_bytes(offer, pinned.tokens, pinned.hashes)
            sock.sendall(frame)
            prog.sent += len(frame)
            ev = self._read_reply(sock, tx)
            if isinstance(ev, wire.PeerRefused):
                return PushResult(False, reason=ev.reason, message=ev.message)
            assert isinstance(ev, wire.Accepted)
            t0 = time.monotonic()  # transfer time counts from the first block
            refused = self._send_blocks(sock, tx, pinned, job, ev.first_missing, prog)
            if refused is not None:
                return refused
            if job.link_free is not None:
                job.link_free()  # the link is free for the next push while the receiver lands this one
            done = self._read_reply(sock, tx)
            prog.acked_to(tcp_acked(sock))
            secs = time.monotonic() - t0
            if isinstance(done, wire.PeerRefused):
                return PushResult(False, reason=done.reason, message=done.message, bytes_sent=prog.sent, seconds=secs)
            assert isinstance(done, wire.Completed)
            return PushResult(True, tokens=done.tokens, blocks_sent=len(pinned.ids) - ev.first_missing,
                              bytes_sent=prog.sent, seconds=secs, backlogged_bytes=prog.backlogged)
        except _Superseded:
            return PushResult(False, reason="superseded", bytes_sent=prog.sent)
        except (OSError, wire.ProtocolError) as err:
            if job.cancel.is_set():
                return PushResult(False, reason="superseded", bytes_sent=prog.sent)
            reason = err.reason if isinstance(err, wire.ProtocolError) else "unreachable"
            return PushResult(False, reason=reason, message=str(err), bytes_sent=prog.sent)

    def _send_blocks(self, sock: socket.socket, tx: wire.Sender, pinned: PinnedBlocks, job: _Job, first: int,
                     prog: _Progress) -> PushResult | None:
        """Send blocks first.. and END; a refusal the receiver sent mid-stream, or None once END is sent."""
        prog.acked_to(tcp_acked(sock))
        for i in range(first, len(pinned.ids)):
            if job.cancel.is_set():
                raise _Superseded()
            if select.select([sock], [], [], 0)[0]:
                return None  # the receiver spoke mid-stream: a refusal, read as its verdict
            data = pinned.read(pinned.ids[i])  # here, not on the loop: off an accelerator it is a copy
            hdr = tx.block_header(i, data)
            try:
                sock.sendall(hdr)
                sock.sendall(data)
                job.progress_at = time.monotonic()
            except OSError:
                if job.cancel.is_set():
                    raise _Superseded() from None
                refusal = self._late_refusal(sock, tx)
                if refusal is not None:
                    return PushResult(False, reason=refusal.reason, message=refusal.message, bytes_sent=prog.sent)
                raise
            prog.sent += len(hdr) + data.nbytes
            prog.acked_to(tcp_acked(sock))
        end = tx.end()
        sock.sendall(end)
        prog.sent += len(end)
        return None

    def _late_refusal(self, sock: socket.socket, tx: wire.Sender) -> wire.PeerRefused | None:
        """After a failed send, the receiver's refusal may still be readable: find it."""
        try:
            sock.settimeout(1.0)
            ev = self._read_reply(sock, tx)
        except (OSError, wire.ProtocolError):
            return None
        return ev if isinstance(ev, wire.PeerRefused) else None

    @staticmethod
    def _read_reply(sock: socket.socket, tx: wire.Sender) -> wire.SenderEvent:
        while True:
            data = sock.recv(max(1, tx.want()))
            events = tx.feed(data) if data else tx.eof()
            if events:
                return events[0]

    def _persist_own(self, session: str) -> None:
        """Write-behind this host's own session to its store (delta), so an eviction here is
        restored from disk rather than recomputed."""
        e = self.engine
        pinned = e.pin(session)  # for its hashes and tokens only: the write-behind pins what it copies
        if pinned is None:
            return
        pinned.release()
        have = self.store.held_prefix_blocks(session, e.fingerprint, pinned.hashes)
        if have < len(pinned.hashes):
            self._write_behind(session, pinned.tokens, pinned.hashes, have)

    def _write_behind(self, session: str, tokens: np.ndarray, hashes: list[bytes], first_block: int) -> None:
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
        self._generation += 1
        gen = self._generation
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
            except Exception as err:  # noqa: BLE001 - the store is an optimisation
                log.warning("store write of %s failed: %s", session, err)
            finally:
                loop.call_soon_threadsafe(e.blocks.release, ids)

        fut = self._disk.submit(write)
        self._writes.add(fut)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(self._writes.discard, f))  # the set is the loop's

    # ---- receiving -------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                conn, addr = self._listener.accept()
            except OSError:
                return
            if not self._conn_slots.acquire(blocking=False):
                conn.close()  # at the connection cap: the sender retries on its next turn
                continue
            threading.Thread(target=self._serve_conn, args=(conn,), name="kvshare-recv", daemon=True).start()

    def _wrap(self, conn: socket.socket) -> socket.socket:
        if self._server_tls is None:
            return conn
        conn.settimeout(self.cfg.io_timeout_s)  # the handshake too is bounded
        return self._server_tls.wrap_socket(conn, server_side=True)

    def _call(self, fn, *args):  # type: ignore[no-untyped-def]
        """Run fn on the event loop thread and wait for it (engine bookkeeping has one writer)."""
        assert self._loop is not None

        async def run():  # type: ignore[no-untyped-def]
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=30)

    def _serve_conn(self, conn: socket.socket) -> None:
        """One inbound transfer, on its own thread: the bytes (payloads, digests, the store's
        copies and fsyncs) stay on this thread; the loop only decides and commits."""
        st = _Conn(wire.Receiver(self.secret, self.previous_secret))
        try:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.cfg.socket_buffer_bytes)
            conn = self._wrap(conn)
            conn.settimeout(self.cfg.io_timeout_s)
            offer_deadline = time.monotonic() + min(OFFER_DEADLINE_S, 2 * self.cfg.io_timeout_s)
            while not st.rx.done:
                if st.offer is None and time.monotonic() > offer_deadline:
                    raise wire.ProtocolError(wire.Reason.TRUNCATED, "the offer did not arrive in time")
                for ev in self._recv_events(conn, st):
                    if not self._on_event(conn, st, ev):
                        return
        except (OSError, KVMeshError, concurrent.futures.CancelledError, concurrent.futures.TimeoutError) as err:
            reason = getattr(err, "reason", None) or ("connection" if isinstance(err, OSError) else type(err).__name__)
            if st.offer is not None and not self._closing.is_set():
                self._call(self._refused, st.offer, st.src, reason, str(err))
        finally:
            if st.txn is not None and not self._closing.is_set():
                self._call(self._abort, st.offer, st.txn)
            if st.writer is not None:
                st.writer.abort()
            conn.close()
            self._conn_slots.release()

    @staticmethod
    def _recv_events(conn: socket.socket, st: _Conn) -> list[wire.ReceiverEvent]:
        """Read what the socket has: payloads straight into their target (the engine's pool)."""
        view = st.rx.payload_view()
        if view is not None:
            n = conn.recv_into(view)
            st.received += n
            return st.rx.payload_filled(n) if n else st.rx.eof()
        data = conn.recv(max(1, st.rx.want()))
        st.received += len(data)
        return st.rx.feed(data) if data else st.rx.eof()

    def _on_event(self, conn: socket.socket, st: _Conn, ev: wire.ReceiverEvent) -> bool:
        """Act on one receiver event; False once the connection is done (refused)."""
        if isinstance(ev, wire.Refused):
            conn.sendall(ev.reply)
            _linger_close(conn)
            self._call(self._refused, st.offer, st.src, ev.reason, ev.message)
            return False
        if isinstance(ev, wire.OfferReceived):
            return self._accept_offer(conn, st, ev)
        if isinstance(ev, wire.BlockHeader) and not st.first_block_seen:
            # Transfer time counts from the first block's first byte, as raw TCP's does.
            st.first_block_seen, st.t_first = True, time.monotonic()
        elif isinstance(ev, wire.BlockReceived):
            if st.writer is not None:
                st.writer.write_block(ev.index, ev.data, ev.digest)
            ib = st.plan.inbound
            if ib is not None and st.offer is not None:  # progress for a turn that waits on it: plain stores
                if not ib.t_first:
                    ib.t_first = st.t_first
                ib.landed = (ev.index + 1) * st.offer.block_size
        elif isinstance(ev, wire.EndReceived):
            last_byte = time.monotonic()
            assert st.offer is not None
            committed = self._land(st)
            tokens = self._call(self._on_complete, st.offer, st.plan, st.received, last_byte, st.t_first, committed)
            st.txn = st.writer = None  # committed
            conn.sendall(st.rx.result_ok(tokens))
        return True

    def _accept_offer(self, conn: socket.socket, st: _Conn, ev: wire.OfferReceived) -> bool:
        """Let the loop decide on the offer, open the store write here if it goes to the store,
        and answer: refuse (False) or accept from the first block this host lacks."""
        st.offer, st.src = ev.offer, ev.offer.sender
        st.plan = plan = self._call(self._on_offer, ev)
        refuse = plan.refuse
        if refuse is None and plan.store_only:
            try:  # blocks carried over from the held replica are verified and copied here, not on the loop
                st.writer = self.store.begin_write(ev.offer.session, fingerprint=ev.offer.fingerprint,
                                                   block_size=ev.offer.block_size, block_bytes=ev.offer.block_bytes,
                                                   tokens=ev.tokens, hashes=ev.hashes, first_block=plan.store_held,
                                                   generation=ev.offer.generation)
            except KVMeshError as err:
                refuse = (getattr(err, "reason", "store"), str(err))
        if refuse is not None:
            reason, message = refuse
            conn.sendall(st.rx.refuse(reason, message))
            _linger_close(conn)
            self._call(self._refused, st.offer, st.src, reason, message)
            return False
        st.txn = txn = plan.txn
        target = (lambda h, t=txn: t.buffer(h.index)) if txn is not None else None
        conn.sendall(st.rx.accept(plan.first_missing, payload_target=target))
        st.t_first = time.monotonic()
        return True

    def _land(self, st: _Conn) -> int | None:
        """END verified; on this thread, the bytes still to move: the blocks the store held but the
        engine lacked go into the import (each digest checked), or the store's write commits (fsync).
        Returns the tokens the store committed (store-only), else None."""
        assert st.offer is not None
        if st.txn is not None:
            for i in range(st.plan.engine_held, st.plan.store_held):
                copy_block(st.txn, i, self.store.block_view(st.offer.session, i, verify=True))
            return None
        assert st.writer is not None
        return st.writer.commit().num_tokens

    def _on_offer(self, ev: wire.OfferReceived) -> _Plan:
        """Decide on the loop: refuse, or the first block to send and where payloads land."""
        e, offer = self.engine, ev.offer
        if offer.fingerprint != e.fingerprint:
            return _Plan(refuse=("fingerprint", "model fingerprint differs from this engine's"))
        if offer.block_size != e.block_size or offer.block_bytes != e.block_bytes:
            return _Plan(refuse=("shape", f"blocks of {offer.block_size} tokens/{offer.block_bytes} bytes; "
                                          f"this engine uses {e.block_size}/{e.block_bytes}"))
        store_held = self.store.held_prefix_blocks(offer.session, offer.fingerprint, ev.hashes)
        try:
            txn = e.begin_import(offer.session, offer.fingerprint, ev.tokens, ev.hashes)
        except ImportRefused as err:
            if err.reason != "no_room":
                return _Plan(refuse=(err.reason, str(err)))
            # Every KV block is held by a running turn: the replica goes to the store only
            # (the slow path: disk on the critical path), to be imported before its next turn.
            # The receiving thread opens the store write (it copies and verifies held blocks).
            ib = self._track_inbound(offer, store_held, ev.tokens)
            return _Plan(store_only=True, first_missing=store_held, store_held=store_held, inbound=ib)
        engine_held = txn.missing[0] if txn.missing else offer.n_blocks
        first = max(engine_held, store_held)
        ib = self._track_inbound(offer, first, ev.tokens)
        return _Plan(txn=txn, first_missing=first, engine_held=engine_held, store_held=store_held, tokens=ev.tokens,
                     hashes=ev.hashes, inbound=ib)

    def _track_inbound(self, offer: wire.Offer, first: int, tokens: np.ndarray) -> _Inbound:
        st = self.inn.get(offer.sender)
        rate = st.bytes / st.seconds if st is not None and st.seconds > 0 else 1e9  # measured on this link
        held = first * offer.block_size
        ib = self._inbound[offer.session] = _Inbound(
            offer.sender, offer.num_tokens, time.monotonic(), eta_s=(offer.n_blocks - first) * offer.block_bytes / rate,
            held=held, landed=held, offered=tokens)
        return ib

    def _on_complete(self, offer: wire.Offer, plan: _Plan, received: int, last_byte: float, t_first: float,
                     committed: int | None) -> int:
        """END verified and every byte in place (`_land`): commit the import, the replica is ready.
        `committed`: the tokens the store committed when the replica went to the store only."""
        txn = plan.txn
        if txn is not None:
            tokens = txn.commit()
        else:
            assert committed is not None
            tokens = committed
        ready = time.monotonic()
        lag = ready - last_byte
        st = self.inn[offer.sender]
        st.add(received, max(1e-9, last_byte - t_first))
        st.ready_lag_s.append(lag)
        ib = self._inbound.pop(offer.session, None)
        if ib is not None:
            ib.landed = ib.tokens
            ib.arrived.set()
        # A replica of it landed whole: an earlier refusal or eviction no longer explains anything.
        self._refusals.pop(offer.session, None)
        self._evictions.pop(offer.session, None)
        # A delta builds on the replica before it: those bytes stay useful. Replica bytes
        # are wasted only if the store drops them before any turn here used them.
        self._unused[offer.session] = self._unused.get(offer.session, 0) + received
        while len(self._unused) > MAX_UNUSED_TRACKED:  # sessions that ended and never came back
            self.wasted_bytes += self._unused.pop(next(iter(self._unused)))
        self._publish(ReplicaReady(session=offer.session, src=offer.sender, dst=self.name, tokens=tokens,
                                           bytes=received, lag_s=round(lag, 5), imported=txn is not None,
                                           recv_s=round(last_byte - t_first, 5),
                                           blocks=offer.n_blocks - plan.first_missing))
        if txn is not None and plan.tokens is not None:
            self._write_behind(offer.session, plan.tokens, plan.hashes, plan.store_held)
        return tokens

    def _abort(self, offer: wire.Offer | None, txn: ImportAPI) -> None:
        txn.abort()
        if offer is not None:
            ib = self._inbound.pop(offer.session, None)
            if ib is not None:
                ib.arrived.set()

    def _refused(self, offer: wire.Offer | None, src: str, reason: str, message: str) -> None:
        self.inn[src].refused[reason] += 1
        session = offer.session if offer is not None else "?"
        if offer is not None:
            _remember(self._refusals, offer.session, reason)
            ib = self._inbound.pop(offer.session, None)
            if ib is not None:
                ib.arrived.set()
        log.info("refused a replica of %s from %s: %s (%s)", session, src, reason, message)
        self._publish(ReplicaRefused(session=session, src=src, dst=self.name, reason=reason,
                                             message=message[:200]))


async def _await_worker(fut: asyncio.Future[T], *, stop: Callable[[], None], release: Callable[[], None]) -> T:
    """Await a worker thread's result. When the awaiting task is cancelled, the worker cannot be:
    `stop` asks it to end early, and `release` (freeing what the worker uses: pool blocks,
    pins) runs on the loop only once it has returned. Other outcomes are the caller's to clean up."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        stop()

        def after(f: asyncio.Future[T]) -> None:
            if not f.cancelled():
                f.exception()  # retrieved: the cancelled caller no longer wants it
            release()

        fut.add_done_callback(after)
        raise


def _tcp_info_u64(sock: socket.socket, *offsets: int) -> tuple[int, ...]:
    """Counters of struct tcp_info at these byte offsets, as the kernel keeps them for this TCP
    socket; all 0 where the kernel does not say (no TCP_INFO, or a struct too short)."""
    end = max(offsets) + 8
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, end)
    except (OSError, AttributeError):
        return (0,) * len(offsets)
    if len(info) < end:
        return (0,) * len(offsets)
    return tuple(struct.unpack_from("Q", info, off)[0] for off in offsets)


def tcp_bytes(sock: socket.socket) -> tuple[int, int]:
    """(payload bytes sent, including resends; payload bytes received) on this TCP socket
    (tcpi_bytes_sent at 200, tcpi_bytes_received at 128; Linux 4.19+)."""
    sent, received = _tcp_info_u64(sock, 200, 128)
    return sent, received


def tcp_acked(sock: socket.socket) -> int:
    """Payload bytes the peer has acknowledged on this TCP socket (tcpi_bytes_acked at 120)."""
    return _tcp_info_u64(sock, 120)[0]


def _linger_close(conn: socket.socket, limit_s: float = 1.0) -> None:
    """Half-close after a refusal and drain briefly, so the sender reads the refusal
    instead of a connection reset caused by its own unread bytes."""
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(0.2)
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline and conn.recv(1 << 20):
            pass
