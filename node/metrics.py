"""Prometheus metrics of one node, on a registry of its own (several nodes may share a process in tests)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvmesh.node.looplag import LAG_BUCKETS
from kvmesh.node.protocol import Event

if TYPE_CHECKING:
    from kvmesh.node.node import Node


class Metrics:
    def __init__(self, node_name: str):
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.handoffs = Counter("kvmesh_handoffs", "Handoffs served here, by class and link", ["cls", "src", "dst"], registry=r)
        self.stale_cold = Counter("kvmesh_stale_state_cold", "Cold handoffs although a usable replica was stored", registry=r)
        self.turns = Counter("kvmesh_turns", "Turns run on this host", ["ok"], registry=r)
        self.resumed = Counter("kvmesh_streams_resumed", "Streamed answers continued on another host after "
                               "their serving host stopped mid-answer (counted on the entry node)", registry=r)
        self.kv_bytes = Counter("kvmesh_kvshare_bytes", "kv_share bytes by peer and direction", ["peer", "direction"], registry=r)
        self.kv_seconds = Counter("kvmesh_kvshare_seconds", "kv_share transfer seconds by peer and direction", ["peer", "direction"], registry=r)
        self.refused = Counter("kvmesh_replicas_refused", "Replicas refused, by reason", ["reason"], registry=r)
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

    def on_event(self, ev: Event) -> None:
        t = ev.type
        if t == "handoff":
            self.handoffs.labels(ev.cls, ev.src, ev.dst).inc()  # type: ignore[union-attr]
            if ev.stale_state:  # type: ignore[union-attr]
                self.stale_cold.inc()
        elif t == "turn_finished":
            self.turns.labels(str(ev.ok).lower()).inc()  # type: ignore[union-attr]
            if ev.ok:  # type: ignore[union-attr]
                self.ttft.observe(ev.ttft_s)  # type: ignore[union-attr]
        elif t == "replica_sent":
            self.kv_bytes.labels(ev.dst, "out").inc(ev.bytes)  # type: ignore[union-attr]
            self.kv_seconds.labels(ev.dst, "out").inc(ev.seconds)  # type: ignore[union-attr]
        elif t == "replica_ready":
            self.kv_bytes.labels(ev.src, "in").inc(ev.bytes)  # type: ignore[union-attr]
            self.kv_seconds.labels(ev.src, "in").inc(ev.recv_s)  # type: ignore[union-attr]
            self.ready_lag.observe(ev.lag_s)  # type: ignore[union-attr]
        elif t == "replica_refused":
            self.refused.labels(ev.reason).inc()  # type: ignore[union-attr]


def render_metrics(node: Node) -> tuple[bytes, str]:
    m = node.metrics
    e = node.engine
    m.slots_busy.set(e.slots.busy)
    m.slots_total.set(e.slots.slots)
    m.queue.set(e.slots.queued)
    m.store_bytes.set(node.kvshare.store_bytes())
    m.cache_used.set((e.pool.num_blocks - e.blocks.num_free) * e.block_bytes)
    return generate_latest(m.registry), CONTENT_TYPE_LATEST
