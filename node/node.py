"""The node agent: the composition root that builds one host's parts and wires them together.

Each part is given only what it uses: kv_share gets the engine, its config section, a
publish function and a peer resolver; the mesh gets the engine, its config section, a
publish function and kv_share as a `ReplicaView`; the turn path (node.mesh.turn) and the
operator's actions (node.mesh.actions) get the engine, the mesh and kv_share. None of
them sees the Node. The API is served from the Node (node.api).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import psutil
import torch

from kvmesh.node.config import NodeConfig, is_loopback
from kvmesh.node.engine.engine import Engine
from kvmesh.node.engine.vllm.engine import VllmEngine
from kvmesh.node.events import EventHub
from kvmesh.node.kvshare.service import KVShare
from kvmesh.node.looplag import LoopLagMonitor
from kvmesh.node.mesh.actions import Operator
from kvmesh.node.mesh.discovery import Discovery, DnsSource
from kvmesh.node.mesh.kubesource import KubeSource
from kvmesh.node.mesh.mesh import Mesh
from kvmesh.node.mesh.placement import home_of
from kvmesh.node.mesh.threads import Threads
from kvmesh.node.mesh.turn import TurnPath
from kvmesh.node.metrics import Metrics
from kvmesh.node.protocol import (
    Event,
    HostInfo,
    HostStatus,
    PeerUp,
    ReplicaEvicted,
)
from kvmesh.node.responses.service import StoredResponses
from kvmesh.node.tls import client_context

log = logging.getLogger("kvmesh.node")


class Node:
    """One host's parts, built from its config and wired together."""

    def __init__(self, cfg: NodeConfig):
        self.cfg = cfg
        self.name = cfg.name
        self.zone = cfg.mesh.zone
        self.started = time.time()  # wall time, reported as such
        self._started_mono = time.monotonic()
        self.api_url = ""  # known once the API listens (see serving_at)
        self.stopping = False  # SIGTERM arrived: draining on the way out (node.shutdown)
        self.hub = EventHub(cfg.name)
        # kind "vllm": vLLM computes in a process of its own, over this node's block pool (node.engine.vllm).
        self.engine: Engine | VllmEngine = VllmEngine(cfg.engine, name=cfg.name) if cfg.engine.kind == "vllm" else Engine(cfg.engine)
        self.metrics = Metrics(cfg.name)
        self.hub.on_publish(self.metrics.on_event)
        self.hub.on_publish(self._on_event)
        self.loop_lag = LoopLagMonitor(observe=self.metrics.loop_lag.observe)
        self.kv_cfg = kv_cfg = cfg.kvshare.for_context(self.engine.max_context)
        if (never := kv_cfg.never_replicates(self.engine.max_context)) is not None:
            log.warning("node %s: %s", cfg.name, never)
        # A window-mode or recurrent model's snapshots travel in its replicas, as frames of the same push.
        self.kvshare = KVShare(cfg.name, self.engine, kv_cfg, secrets=cfg.mesh.secrets(),
                               publish=self.hub.publish, peer_address=self._peer_kvshare,
                               snapshots=self.engine.snapshots)
        self.mesh = Mesh(cfg.name, cfg.mesh, self.engine, self.kvshare, publish=self.hub.publish,
                         host_info=self.host_info, on_decision=self.metrics.decision.observe,
                         on_refused=self.metrics.on_refused, on_push_held_back=self.metrics.pushes_held_back.inc,
                         verify=client_context(cfg.api.tls) if cfg.api.tls else True)
        # A session's conversations past mesh.max_threads: its least recently used one's cache goes first.
        threads = Threads(max_threads=cfg.mesh.max_threads, on_forget=self.engine.evict)
        self.turns = TurnPath(cfg.name, self.engine, self.mesh, self.kvshare, threads, publish=self.hub.publish,
                              forward_timeout_s=cfg.mesh.forward_timeout_s, on_resumed=self.metrics.resumed.inc)
        peers = self.mesh.peers
        # Stored Responses live with their conversation: its home and replica holder (node.responses.service).
        self.responses = StoredResponses(cfg.name, cfg.responses, store_dir=cfg.kvshare.store_dir,
                                         fsync=cfg.kvshare.fsync == "always", where=self.mesh, peers=peers)
        self.hub.on_publish(self.responses.on_event)
        self.operator = Operator(cfg.name, self.engine, self.mesh, push=self.kvshare.push, publish=self.hub.publish)
        self.discovery: Discovery | None = None
        if cfg.mesh.discovery != "static":
            source = DnsSource(cfg.mesh, self.api_port) if cfg.mesh.discovery == "dns" else KubeSource(cfg.mesh)
            self.discovery = Discovery(cfg.name, source, interval_s=cfg.mesh.discovery_interval_s,
                                       secrets_=cfg.mesh.secrets(), client=lambda: peers.client, admit=peers.add,
                                       remove=peers.remove, scheme="https" if cfg.api.tls else "http")
        self._tasks: set[asyncio.Task[Any]] = set()
        self.engine.on_evict = self._engine_evicted
        self.client_keys = tuple(cfg.api.key_values())  # never logged
        if not self.client_keys and not is_loopback(cfg.api.host):
            log.warning("node %s: the API listens on %s with NO API KEY: anyone who can reach the port can run turns "
                        "on this host. Set api.keys or KVMESH_API_KEY (kvmesh init writes one).", cfg.name, cfg.api.host)
        log.info(
            "node %s: engine %s, %d slots of %d tokens, %d KV blocks of %d tokens (%.2f MiB each), fingerprint %s; "
            "replicating sessions from %d tokens",
            self.name, cfg.engine.kind, cfg.engine.slots, self.engine.max_context, self.engine.pool.num_blocks,
            self.engine.block_size, self.engine.block_bytes / 2**20, self.engine.fingerprint[:12], kv_cfg.replicate_min_tokens,
        )

    def _on_event(self, ev: Event) -> None:
        if isinstance(ev, PeerUp):
            self.reoffer_replicas()

    def reoffer_replicas(self) -> int:
        """A peer came (back) up: push each session homed here whose predicted next host lacks its
        whole blocks. A turn that ended while every other host looked unreachable queued no replica,
        and none would follow until the session's next turn; this is that replica. Returns how many."""
        if not self.kv_cfg.enabled:
            return 0
        n = 0
        for s in list(self.engine.sessions):
            if self.kvshare.inflight_to(s) or not self.kvshare.worth_replicating(s):
                continue
            held = self.mesh.holdings(s)
            if home_of(held) != self.name:
                continue
            d = self.mesh.predict_next(s)
            if d is None or d.host == self.name:
                continue
            whole = self.engine.resident_tokens(s) // self.engine.block_size * self.engine.block_size
            there = held.get(d.host)
            if there is not None and max(there.resident, there.stored, there.inbound) >= whole:
                continue
            self.kvshare.submit(s, d.host)
            n += 1
        if n:
            log.info("node %s: a peer is up: %d replicas offered again", self.name, n)
        return n

    def _peer_kvshare(self, name: str) -> str | None:
        """A peer's kv_share address: from the peer table, which DNS discovery may change at run time."""
        p = self.mesh.peers.peers.get(name)
        return p.cfg.kvshare if p is not None else None

    def api_port(self) -> int:
        """The port the API listens on (known once bound; the configured one before)."""
        tail = self.api_url.rsplit(":", 1)[-1]
        return int(tail) if tail.isdigit() else self.cfg.api.port

    def serving_at(self, url: str) -> None:
        """The API's address, once its listener is bound (the port may have been 0): what this
        host reports of itself to peers and consoles."""
        self.api_url = url

    async def start(self) -> None:
        self.loop_lag.start()
        await self.kvshare.start()
        loop = asyncio.get_running_loop()

        def store_evicted(session: str) -> None:  # called on the store's thread
            loop.call_soon_threadsafe(self.kvshare.store_evicted, session)
            loop.call_soon_threadsafe(self.hub.publish, ReplicaEvicted(session=session, host=self.name, where="store"))

        self.kvshare.store.on_evict = store_evicted
        await self.mesh.start()
        await self.responses.start()
        if self.discovery is not None:
            self.discovery.start()
        task = asyncio.ensure_future(self._status_loop())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _engine_evicted(self, session: str) -> None:
        self.kvshare.engine_evicted(session)  # so a handoff that finds less here can say why
        self.hub.publish(ReplicaEvicted(session=session, host=self.name, where="engine"))

    async def _status_loop(self, every_s: float = 1.0) -> None:
        """Periodic host status: one coalesced event a second (not kept in the replay ring)."""
        while True:
            await asyncio.sleep(every_s)
            self.hub.publish(HostStatus(host=self.host_info()))

    async def begin_drain(self) -> None:
        """Stop taking turns and push every resident session to its next host (SIGTERM's warm drain)."""
        result = await self.operator.host_action("drain")
        log.warning("node %s: %s", self.name, result.message)

    def drain_pending(self) -> str | None:
        """What a draining node still waits for before it exits: running or queued turns, the drain's
        pushes, replicas of turns that ended during the drain; None when nothing."""
        s, task = self.engine.slots, self.operator.drain_task
        waits = [f"{s.busy} running and {s.queued} queued turns" if s.busy or s.queued else "",
                 "the drain's pushes" if task is not None and not task.done() else "",
                 f"{n} replica pushes" if (n := self.kvshare.pushes_pending()) else ""]
        return ", ".join(w for w in waits if w) or None

    def ready(self) -> bool:
        """Whether a load balancer should send clients here: started, and neither draining nor stopping."""
        return not self.stopping and not self.mesh.draining

    async def stop(self) -> None:
        self.loop_lag.stop()
        for t in self._tasks:
            t.cancel()
        self.operator.stop()
        if self.discovery is not None:
            await self.discovery.stop()
        await self.mesh.stop()
        await self.responses.stop()
        await self.kvshare.stop()
        self.engine.close()

    # ---- what this host reports ----------------------------------------------

    def host_info(self) -> HostInfo:
        e = self.engine
        vm = psutil.virtual_memory()
        gpu_used = gpu_total = None
        if e.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(e.device)
            gpu_used, gpu_total = total - free, total
        in_bps, out_bps = (float(f"{r:.3g}") for r in self.kvshare.rates())  # 3 digits: pushed only when they move
        return HostInfo(
            name=self.name, api=self.api_url, reachable=True, draining=self.mesh.draining, slots=e.slots.slots,
            busy=e.slots.busy, queued=e.slots.queued, mem_used_bytes=(vm.total - vm.available) >> 20 << 20,  # whole MiB
            mem_total_bytes=vm.total,
            gpu_mem_used_bytes=gpu_used, gpu_mem_total_bytes=gpu_total, kv_cache_bytes=e.pool.num_blocks * e.block_bytes,
            kv_cache_used_bytes=(e.pool.num_blocks - e.blocks.num_free) * e.block_bytes,
            store_bytes=self.kvshare.store_bytes(), kvshare_in_bps=in_bps, kvshare_out_bps=out_bps,
            prefill_tps=e.prefill_rate(), prefill_backlog_tokens=e.prefill_backlog(),
            queued_tokens=e.slots.queued_tokens, last_seen=time.time(),
            block_size=e.block_size, no_replicas=e.inexact_reason or "", zone=self.zone,
        )

    def stats(self) -> dict[str, object]:
        m = self.mesh
        return {
            "node": self.name,
            "handoffs": m.book.counters.model_dump(),
            "decision_p50_ms": round(m.decision_ms(0.5), 4),
            "decision_p99_ms": round(m.decision_ms(0.99), 4),
            "decision_cpu_p99_ms": round(m.decision_ms(0.99, cpu=True), 4),
            "decisions": len(m.decision_s),
            "admission": {"enabled": m.admission.enabled, "wait_s": m.admission.wait_s,
                          "new_wait_s": m.admission.new_wait_s, "refused": dict(m.refused)},
            **self.loop_lag.stats(),
            "engine": {"turns": self.engine.counters.turns, "prefill_tokens": self.engine.counters.prefill_tokens,
                       "cached_tokens": self.engine.counters.cached_tokens,
                       "evicted_sessions": self.engine.counters.evicted_sessions,
                       "imported_blocks": self.engine.counters.imported_blocks,
                       "settled_tokens": self.engine.counters.settled_tokens,
                       "prefill_tps": round(self.engine.prefill_rate(), 1),
                       "weights": self.engine.weights.as_dict() if self.engine.weights is not None else None},
            "kvshare": self.kvshare.stats(),
            "responses": self.responses.stats(),
            "snapshots": self.kvshare.snapshot_stats(),
            "replicate_min_tokens": self.kv_cfg.replicate_min_tokens, "max_context": self.engine.max_context,
            "block_size": self.engine.block_size, "fingerprint": self.engine.fingerprint,
            "peer_wire": m.peers.wire_by_peer(),
            # How each peer's state arrives: "pushed" (its /v1/peer/state stream) or "polled".
            "peer_state": {p.name: "pushed" if p.streaming else "polled" for p in m.peers.peers.values()},
            "directory": len(m.members()) > m.directory_after_hosts,
        }

    def render_metrics(self) -> tuple[bytes, str]:
        """Prometheus exposition text and its content type."""
        return self.metrics.render(self.engine, self.kvshare.store_bytes())

    def health(self) -> dict[str, object]:
        s = self.engine.slots
        status = "stopping" if self.stopping else "draining" if self.mesh.draining else "ok"
        return {"status": status, "node": self.name, "model": self.engine.model_name,
                "slots": s.slots, "busy": s.busy, "queued": s.queued, "uptime_s": round(time.monotonic() - self._started_mono, 1)}
