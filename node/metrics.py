"""Prometheus metrics of one node, on a registry of its own (several nodes may share a process in tests)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvmesh.node.engine.boundary import EngineAPI
from kvmesh.node.looplag import LAG_BUCKETS
from kvmesh.node.protocol import (
    Event,
    Handoff,
    ReplicaReady,
    ReplicaRefused,
    ReplicaSent,
    TurnFinished,
)

E = TypeVar("E")


class Metrics:
    def __init__(self, node_name: str):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.handoffs = Counter("kvmesh_handoffs", "Handoffs served here, by class and link", ["cls", "src", "dst"], registry=r)
        self.shortfall = Counter("kvmesh_handoff_shortfall", "Handoffs served here, by why they were not warm "
                                 "as placement predicted (reason none: they were)", ["reason"], registry=r)
        self.stale_cold = Counter("kvmesh_stale_state_cold", "Cold handoffs although a usable replica was stored", registry=r)
        self.turns = Counter("kvmesh_turns", "Turns run on this host", ["ok"], registry=r)
        self.resumed = Counter("kvmesh_streams_resumed", "Streamed answers continued on another host after "
                               "their serving host stopped mid-answer (counted on the entry node)", registry=r)
        self.kv_bytes = Counter("kvmesh_kvshare_bytes", "kv_share bytes by peer and direction", ["peer", "direction"], registry=r)
        self.kv_seconds = Counter("kvmesh_kvshare_seconds", "kv_share transfer seconds by peer and direction", ["peer", "direction"], registry=r)
        self.refused = Counter("kvmesh_replicas_refused", "Replicas refused, by reason", ["reason"], registry=r)
        self.overloaded = Counter("kvmesh_turns_refused_overloaded", "Turns this entry refused as overloaded, by "
                                  "whether they were a new session's first", ["session"], registry=r)
        self.pushes_held_back = Counter("kvmesh_replica_pushes_held_back", "Replicas not pushed at a turn's end: the "
                                        "host the session would move to had turns queued", registry=r)
        self.ready_lag = Histogram("kvmesh_replica_ready_lag_seconds", "Replica usable after its last byte",
                                   buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5), registry=r)
        self.ttft = Histogram("kvmesh_ttft_seconds", "Time to first token of turns run here",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=r)
        self.decision = Histogram("kvmesh_placement_decision_seconds", "Placement decision time",
                                  buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 5e-3), registry=r)
        self.slots_busy = Gauge("kvmesh_slots_busy", "Engine slots busy", registry=r)
        self.slots_total = Gauge("kvmesh_slots", "Engine slots", registry=r)
        self.queue = Gauge("kvmesh_queue_depth", "Turns waiting for a slot", registry=r)
        self.store_bytes = Gauge("kvmesh_replica_store_bytes", "Replica store bytes on disk", registry=r)
        self.cache_used = Gauge("kvmesh_kv_cache_used_bytes", "KV pool bytes in use", registry=r)
        self.loop_lag = Histogram("kvmesh_event_loop_lag_seconds", "How late the node's event loop ran a periodic timer",
                                  buckets=LAG_BUCKETS, registry=r)

    def on_refused(self, new_session: bool) -> None:
        self.overloaded.labels("new" if new_session else "running").inc()

    def on_event(self, ev: Event) -> None:
        """Hub listener: count the events that feed a metric (the others pass by)."""
        handler = _HANDLERS.get(type(ev))
        if handler is not None:
            handler(self, ev)

    def _on_handoff(self, ev: Handoff) -> None:
        self.handoffs.labels(ev.cls, ev.src, ev.dst).inc()
        self.shortfall.labels(ev.shortfall).inc()
        if ev.stale_state:
            self.stale_cold.inc()

    def _on_turn_finished(self, ev: TurnFinished) -> None:
        self.turns.labels(str(ev.ok).lower()).inc()
        if ev.ok:
            self.ttft.observe(ev.ttft_s)

    def _on_replica_sent(self, ev: ReplicaSent) -> None:
        self.kv_bytes.labels(ev.dst, "out").inc(ev.bytes)
        self.kv_seconds.labels(ev.dst, "out").inc(ev.seconds)

    def _on_replica_ready(self, ev: ReplicaReady) -> None:
        self.kv_bytes.labels(ev.src, "in").inc(ev.bytes)
        self.kv_seconds.labels(ev.src, "in").inc(ev.recv_s)
        self.ready_lag.observe(ev.lag_s)

    def _on_replica_refused(self, ev: ReplicaRefused) -> None:
        self.refused.labels(ev.reason).inc()

    def render(self, engine: EngineAPI, store_bytes: int) -> tuple[bytes, str]:
        """The exposition text (and its content type), gauges read from the engine now."""
        self.slots_busy.set(engine.slots.busy)
        self.slots_total.set(engine.slots.slots)
        self.queue.set(engine.slots.queued)
        self.store_bytes.set(store_bytes)
        self.cache_used.set((engine.pool.num_blocks - engine.blocks.num_free) * engine.block_bytes)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _entry(cls: type[E], fn: Callable[[Metrics, E], None]) -> tuple[type[Any], Callable[[Metrics, Any], None]]:
    """One row of the handler table; typed so a handler can only be filed under the event class it takes."""
    return cls, fn


_HANDLERS: dict[type[Any], Callable[[Metrics, Any], None]] = dict([
    _entry(Handoff, Metrics._on_handoff),
    _entry(TurnFinished, Metrics._on_turn_finished),
    _entry(ReplicaSent, Metrics._on_replica_sent),
    _entry(ReplicaReady, Metrics._on_replica_ready),
    _entry(ReplicaRefused, Metrics._on_replica_refused),
])
