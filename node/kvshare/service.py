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

`KVShare` is the face the node, the mesh and the turn path see; it builds the parts and wires them,
each given only what it uses:
- `links.py`: each link's figures (`LinkStats`), a push's byte counts, the kernel's TCP_INFO;
- `sender.py`: the push queue, its permits and each push's pins, events and accounting;
  `stream.py`: one push on the wire, on its sender thread;
- `receiver.py`: the listener and each inbound transfer's thread; `landing.py`: the loop's decisions on
  them, and the replicas landing now;
- `imports.py`: before a turn, the wait for a landing replica and the store -> engine import;
- `explain.py`: what explains a handoff's reuse, and the replica bytes no turn used;
- `writebehind.py`: the store's copies of the pool's blocks, through the host-memory tier (`hosttier.py`)
  to the disk thread.

Where the model keeps state snapshots (window mode, recurrent state: `node.engine.snapshots`), a replica is
its blocks and the newest snapshot they reach, one push on the wire (the snapshot a frame after the blocks),
counted on the link, landed and stored with the blocks, restored with them before a turn.
"""

from __future__ import annotations

import asyncio
import itertools
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil

from kvmesh.node.config import KVShareConfig
from kvmesh.node.engine.boundary import EngineAPI
from kvmesh.node.engine.snapshots import Snapshots
from kvmesh.node.kvshare.explain import HandoffNotes, ReuseExplained
from kvmesh.node.kvshare.hosttier import HostTier
from kvmesh.node.kvshare.imports import Imports
from kvmesh.node.kvshare.landing import Landing
from kvmesh.node.kvshare.links import Links
from kvmesh.node.kvshare.pushorder import PushFacts
from kvmesh.node.kvshare.receiver import Listener
from kvmesh.node.kvshare.sender import PushSender, ThinkTimes
from kvmesh.node.kvshare.store import ReplicaStore
from kvmesh.node.kvshare.stream import PushResult, PushStream
from kvmesh.node.kvshare.writebehind import WriteBehind
from kvmesh.node.protocol import Event, LinkInfo
from kvmesh.node.tls import client_context, server_context

# Without a configured mesh secret the mesh is loopback-only; kv_share still signs its frames.
DEV_SECRET = b"kvmesh-loopback-only-dev-secret"


HOST_TIER_RATIO = 2  # an unset host tier holds this many times the KV pool (SGLang HiCache's default ratio)...
HOST_TIER_MAX_SHARE = 8  # ...and at most 1/8 of the host's memory: several nodes may share a host, and it is real RAM


def host_tier_blocks(cfg: KVShareConfig, engine: EngineAPI) -> int:
    """Blocks of the host-memory tier: `host_tier_bytes`' worth, unset HOST_TIER_RATIO times the KV pool's;
    none for a model whose cache is not cut into blocks. Twice the pool: a burst of turns ending at once
    stages up to a pool's worth while the disk still writes the one before."""
    if engine.inexact_reason is not None:
        return 0
    if cfg.host_tier_bytes is None:
        cap = psutil.virtual_memory().total // HOST_TIER_MAX_SHARE // engine.block_bytes
        return min(HOST_TIER_RATIO * engine.pool.num_blocks, cap)
    return cfg.host_tier_bytes // engine.block_bytes


class KVShare:
    """kv_share of one node. It is given what it uses: the host's name, the engine, its config
    section, the mesh secrets, a publish function for its events, a peer resolver (host name
    -> that host's kv_share address, None for a host outside the mesh), and the engine's snapshots
    (None: its model keeps none)."""

    def __init__(self, name: str, engine: EngineAPI, cfg: KVShareConfig, *, secrets: list[bytes],
                 publish: Callable[[Event], object], peer_address: Callable[[str], str | None],
                 snapshots: Snapshots | None = None):
        self.name = name
        self.engine = engine
        self.snapshots = snapshots
        self.cfg = cfg
        self.secret = secrets[0] if secrets else DEV_SECRET
        self.previous_secret = secrets[1] if len(secrets) > 1 else None
        self._tmpdir: tempfile.TemporaryDirectory[str] | None = None
        if cfg.store_dir:
            root = Path(cfg.store_dir)
        else:
            self._tmpdir = tempfile.TemporaryDirectory(prefix=f"kvmesh-store-{name}-")
            root = Path(self._tmpdir.name)
        self.store = ReplicaStore(root, cfg.store_budget_bytes, fsync=cfg.fsync)
        self.links = Links()
        self.address = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        tls = cfg.tls
        next_generation = itertools.count(1).__next__  # one sequence for offers and the store's own writes
        self._notes = HandoffNotes(engine, self.store)
        self.tier = HostTier(host_tier_blocks(cfg, engine), engine.block_bytes)
        self._writes = WriteBehind(engine, self.store, next_generation=next_generation, tier=self.tier,
                                   snapshots=snapshots)
        self._landing = Landing(name, engine, self.store, inn=self.links.inn, publish=publish,
                                on_landed=self._notes.landed, on_refused=self._notes.refused,
                                write_behind=self._writes.write_behind)
        self._receiver = Listener(cfg, self.store, self._landing, secret=self.secret,
                                  previous_secret=self.previous_secret,
                                  server_tls=server_context(tls) if tls else None, snapshots=snapshots)
        self._think = ThinkTimes()
        stream = PushStream(self.secret, cfg, client_context(tls) if tls else None)
        self._sender = PushSender(name, engine, cfg, out=self.links.out, think=self._think, stream=stream,
                                  publish=publish, peer_address=peer_address, next_generation=next_generation,
                                  snapshots=snapshots)
        self._imports = Imports(name, engine, self.store, inbound=self._landing.inbound, notes=self._notes,
                                publish=publish, pushes_moving=self._sender.moving, writes_pending=self._writes.pending,
                                tier=self.tier, snapshots=snapshots)

    # ---- lifecycle -------------------------------------------------------------

    async def start(self) -> None:
        self._loop = loop = asyncio.get_running_loop()
        self._sender.start(loop)
        self._imports.start(loop)
        self._writes.start(loop)
        if self.tier.n_blocks:
            threading.Thread(target=self.tier.pretouch, name="kvshare-tier-touch", daemon=True).start()
        if self.cfg.enabled:  # off: no listener, so no peer's replica is accepted here
            self.address = self._receiver.start(loop)

    async def stop(self) -> None:
        self.tier.stop()
        self._receiver.stop()
        self._sender.stop()
        self._imports.stop()
        self._writes.stop()
        if self._tmpdir is not None:
            self._tmpdir.cleanup()

    # ---- facts for the mesh ----------------------------------------------------

    @property
    def wasted_bytes(self) -> int:
        return self._notes.wasted_bytes

    def store_evicted(self, session: str) -> None:
        self._notes.store_evicted(session)

    def engine_evicted(self, session: str) -> None:
        """The engine dropped the session's resident cache (its LRU, to make room)."""
        self._notes.engine_evicted(session)

    def store_tokens(self, session: str) -> tuple[int, float | None]:
        m = self.store.manifest(session)
        if m is None or m.fingerprint != self.engine.fingerprint:
            return 0, None
        return m.num_tokens, m.updated

    def rehomed(self, session: str) -> None:
        """The session's home is another host now: this host's stored copy is a replica (evicted first)."""
        self.store.mark_own(session, False)

    def store_sessions(self) -> list[str]:
        return self.store.sessions()

    def store_bytes(self) -> int:
        return self.store.usage_bytes()

    def inbound(self, session: str) -> tuple[int, float | None, int]:
        """(tokens of a replica of it landing here, seconds until it is expected whole, tokens landed so far)."""
        ib = self._landing.inbound.get(session)
        if ib is None:
            return 0, None, 0
        return ib.tokens, ib.rest_s(time.monotonic()), ib.landed

    def inbound_sessions(self) -> list[str]:
        return list(self._landing.inbound)

    def pushes_pending(self) -> int:
        """Replica pushes queued or moving from here (a draining node waits for them)."""
        return self._sender.pending()

    def inflight_to(self, session: str) -> str | None:
        return self._sender.inflight_to(session)

    def import_bps(self) -> float:
        return self._imports.import_bps()

    def rates(self) -> tuple[float, float]:
        return self.links.rates()

    def links_out(self) -> list[LinkInfo]:
        return self.links.links_out(self.name)

    def snapshot_stats(self) -> dict[str, int] | None:
        """The engine's snapshots and those replicas carried over the links (None: the model keeps none)."""
        if self.snapshots is None:
            return None
        return {**self.snapshots.stats(), **self.links.snapshot_totals()}

    def stats(self) -> dict[str, object]:
        return {
            "address": self.address,
            **self.links.stats(),
            "import_bps": self.import_bps(),
            "pushes_pending": self.pushes_pending(),
            "store_bytes": self.store.usage_bytes(),
            "store_budget_bytes": self.store.budget_bytes,
            "store_evictions": self.store.evictions,
            "host_tier": self.tier.stats(),
            "wasted_replica_bytes": self.wasted_bytes,
        }

    # ---- before a turn: the engine must hold what the store holds ---------------

    async def ensure_imported(self, session: str, prompt: np.ndarray) -> int:
        """Ask the engine what it holds; if the store (or a replica landing now) holds more
        of this prompt, import it before the turn runs. Returns tokens imported."""
        return await self._imports.ensure_imported(session, prompt)

    def explain(self, session: str, prompt: np.ndarray, reused: int, predicted: int | None,
                best_held: int | None = None) -> ReuseExplained:
        """Why a turn of `session` that moved here reused `reused` tokens when placement predicted
        `predicted`, with `best_held` of it on the host that held most (see `HandoffNotes.explain`)."""
        return self._notes.explain(session, prompt, reused, predicted, best_held)

    # ---- after a turn: replicate to the predicted next host ---------------------

    def worth_replicating(self, session: str) -> bool:
        """Whether the session's cache here is big enough to replicate (and to keep on disk)."""
        e = self.engine
        if e.inexact_reason is not None:
            return False  # its cache is live only (node.engine.live): nothing to cut into blocks
        return e.resident_tokens(session) >= max(self.cfg.replicate_min_tokens, e.block_size)

    def after_turn(self, session: str, target: str | None, turn_s: float = 0.0) -> None:
        """A turn of `session` ended here after `turn_s` seconds: push the replica to `target`
        (the host placement predicts next, decided where the turn ended), and keep this host's own copy."""
        self._notes.ran_here(session)
        self._think.note_turn(session, turn_s)
        if not self.worth_replicating(session):
            return
        if target is not None and target != self.name and self.cfg.enabled:
            self.submit(session, target)
        if self.cfg.persist_own:
            self._writes.persist_own(session)

    def push_facts(self, session: str, target: str) -> PushFacts:
        """What the push gate weighs (see `PushSender.push_facts`)."""
        return self._sender.push_facts(session, target)

    def submit(self, session: str, target: str) -> asyncio.Future[PushResult]:
        """Queue a replica push (see `PushSender.submit` for what supersedes what)."""
        return self._sender.submit(session, target)

    async def push(self, session: str, target: str) -> PushResult:
        if not self.cfg.enabled:
            return PushResult(ok=False, reason="disabled", message=f"kv_share is off on {self.name} (kvshare.enabled = false)")
        return await self.submit(session, target)
