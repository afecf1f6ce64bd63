"""What a mesh shows of itself: the /v1/events websocket (snapshot, replay, live) and /metrics (Prometheus)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from support.conversation import Conversation

from kvmesh.node.lab.launcher import wait_for
from kvmesh.node.protocol import PROTOCOL_VERSION, ClusterViewEvent

from .helpers import Mesh, whole_blocks


def move_warm(m: Mesh, conv: Conversation) -> tuple[str, str, str]:
    """Turn on a home, replica to the holder, migrate to the third host, turn there (a warm handoff).
    Returns (home, holder, target)."""
    t1 = m.turn(conv, "a")
    home = t1.host
    m.settle(conv)
    holder = m.wait_replica(conv.session, home, whole_blocks(t1.prompt_tokens))
    target = next(n for n in m.names if n not in (home, holder))
    r = m.admin(home, f"/v1/admin/sessions/{conv.session}/migrate", {"target": target})
    assert r.status_code == 200 and r.json()["ok"], r.text
    m.wait_home(conv.session, target)
    t2 = m.turn(conv, holder)
    assert t2.host == target and t2.handoff == "warm", t2
    return home, holder, target


def test_events_snapshot_then_replay_then_live(shared_mesh: Mesh, events) -> None:  # type: ignore[no-untyped-def]
    """/v1/events sends a snapshot, then the replay ring (replay=True), then live turn, handoff and replica events."""
    m = shared_mesh
    streams = {n: events(m.api(n)) for n in m.names}
    for n, st in streams.items():
        first = st.wait(lambda e: True, f"the first event from {n}")
        assert isinstance(first, ClusterViewEvent) and first.type == "snapshot", first
        assert first.node == n and first.v == PROTOCOL_VERSION and first.replay is False and first.ts > 0
        assert sorted(h.name for h in first.cluster.hosts) == sorted(m.names)
        # Every node published peer_up for its peers when it started: the ring is never empty here.
        st.wait(lambda e: e.replay, f"a replayed event from {n}")

    conv = Conversation("events-1", seed=1001)
    home, holder, target = move_warm(m, conv)
    s = conv.session

    def on(n: str, what: str, pred) -> object:  # type: ignore[no-untyped-def]
        return streams[n].wait(lambda e: not e.replay and getattr(e, "session", None) == s and pred(e),
                               f"a live {what} event for {s} from {n}")

    started = on(home, "turn_started", lambda e: e.type == "turn_started" and e.host == home)
    finished = on(home, "turn_finished", lambda e: e.type == "turn_finished" and e.host == home)
    sent = on(home, "replica_sent", lambda e: e.type == "replica_sent" and e.dst == holder)
    on(home, "migrate_started", lambda e: e.type == "migrate_started" and e.dst == target)
    on(home, "migrate_completed", lambda e: e.type == "migrate_completed" and e.dst == target and e.ok)
    ready = on(holder, "replica_ready", lambda e: e.type == "replica_ready" and e.src == home)
    ready_t = on(target, "replica_ready", lambda e: e.type == "replica_ready" and e.src == home)
    handoff = on(target, "handoff", lambda e: e.type == "handoff")
    on(target, "turn_finished", lambda e: e.type == "turn_finished" and e.host == target)
    assert started.prompt_tokens == finished.prompt_tokens == conv.turns[0].prompt_tokens  # type: ignore[attr-defined]
    assert sent.tokens == ready.tokens >= whole_blocks(conv.turns[0].prompt_tokens)  # type: ignore[attr-defined]
    assert (handoff.src, handoff.dst, handoff.cls) == (home, target, "warm")  # type: ignore[attr-defined]
    # With the measurements: the reuse placement predicted, the replica's age; no mismatch on a warm handoff.
    assert handoff.predicted_reused_tokens is not None  # type: ignore[attr-defined]
    assert handoff.predicted_reused_tokens >= whole_blocks(conv.turns[0].prompt_tokens)  # type: ignore[attr-defined]
    assert handoff.replica_age_s is not None and handoff.mismatch_token is None  # type: ignore[attr-defined]
    assert handoff.reused_tokens == conv.turns[1].cached and handoff.prompt_tokens == conv.turns[1].prompt_tokens  # type: ignore[attr-defined]

    for n, st in streams.items():
        assert st.error is None, f"{n}: {st.error!r}"
        evs = st.received()
        assert isinstance(evs[0], ClusterViewEvent) and all(not isinstance(e, ClusterViewEvent) for e in evs[1:])
        flags = [e.replay for e in evs[1:]]
        k = flags.index(False) if False in flags else len(flags)
        assert k >= 1 and not any(flags[k:]), f"{n}: replayed events after live ones: {flags}"
        assert all(e.node == n and e.v == PROTOCOL_VERSION for e in evs[1:])
        seqs = [e.seq for e in evs[1:]]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), f"{n}: seq not increasing: {seqs}"
    ev_home = streams[home].received()
    assert ev_home.index(started) < ev_home.index(finished) < ev_home.index(sent)  # type: ignore[arg-type]
    ev_t = streams[target].received()
    assert ev_t.index(ready_t) < ev_t.index(handoff)  # type: ignore[arg-type]

    # A consumer that reconnects gets the same events again from the ring, marked replay, same (node, seq).
    again = events(m.api(home))
    rep = again.wait(lambda e: e.replay and e.type == "turn_finished" and e.session == s,
                     f"the replayed turn_finished of {s}")
    assert (rep.node, rep.seq) == (finished.node, finished.seq)  # type: ignore[attr-defined]


def test_events_include_periodic_host_status(shared_mesh: Mesh, events) -> None:  # type: ignore[no-untyped-def]
    """/v1/events carries periodic host_status events for the node's host."""
    st = events(shared_mesh.api("b"))
    first = st.wait(lambda e: e.type == "host_status" and not e.replay, "a host_status event from b", timeout=5.0)
    assert first.host.name == "b" and first.host.slots == 2 and first.node == "b"
    st.wait(lambda e: e.type == "host_status" and e.seq > first.seq, "a second host_status event from b", timeout=5.0)
    # Periodic status is coalesced: it is not replayed to a consumer that connects later.
    later = events(shared_mesh.api("b"))
    later.wait(lambda e: not e.replay and e.type != "snapshot", "a live event on the second connection", timeout=5.0)
    assert not any(e.replay and e.type == "host_status" for e in later.received())


def metrics(m: Mesh, n: str) -> dict[str, list]:  # type: ignore[type-arg]
    r = m.http.get(m.api(n) + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain"), r.headers
    return {f.name: f.samples for f in text_string_to_metric_families(r.text)}


def value(fams: dict[str, list], name: str, **labels: str) -> float:  # type: ignore[type-arg]
    base = name.removesuffix("_total")
    return sum(s.value for s in fams.get(base, []) if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_metrics_are_prometheus_text(shared_mesh: Mesh) -> None:
    """/metrics is Prometheus text with handoffs by class and link, kv_share bytes by peer and direction,
    slot occupancy, queue depth and replica store bytes."""
    m = shared_mesh
    conv = Conversation("metrics-1", seed=1101)
    home, holder, target = move_warm(m, conv)
    fams = {n: metrics(m, n) for n in m.names}
    for n, f in fams.items():
        for name in ("kvmesh_handoffs", "kvmesh_kvshare_bytes", "kvmesh_slots_busy", "kvmesh_queue_depth",
                     "kvmesh_replica_store_bytes"):
            assert name in f, f"{n}: no {name} in /metrics"
        assert 0 <= value(f, "kvmesh_slots_busy") <= 2 and value(f, "kvmesh_queue_depth") >= 0
        assert value(f, "kvmesh_replica_store_bytes") > 0, f"{n} stores nothing?"
    assert value(fams[target], "kvmesh_handoffs_total", cls="warm", src=home, dst=target) >= 1
    for peer in (holder, target):
        out = value(fams[home], "kvmesh_kvshare_bytes_total", peer=peer, direction="out")
        inn = value(fams[peer], "kvmesh_kvshare_bytes_total", peer=home, direction="in")
        assert out > 0 and inn > 0, (peer, out, inn)
        assert out == m.stats(home)["kvshare"]["out"][peer]["bytes"]
        assert inn == m.stats(peer)["kvshare"]["in"][home]["bytes"]
    # The handoff counters agree with the cluster view.
    wait_for(lambda: m.cluster(target)["counters"]["warm"] >= 1, "the cluster to count the handoff")
    # Every placement decision is timed: wall time and the deciding thread's own CPU time.
    st = m.stats(home)
    assert st["decisions"] >= 1 and 0 < st["decision_cpu_p99_ms"] <= st["decision_p99_ms"] + 0.05, st


def test_metrics_have_transfer_seconds_for_both_directions(shared_mesh: Mesh) -> None:
    """kvmesh_kvshare_seconds has samples for both directions of a link after a replica crossed it."""
    m = shared_mesh
    conv = Conversation("metrics-2", seed=1102)
    t1 = m.turn(conv, "a")
    m.settle(conv)
    holder = m.wait_replica(conv.session, t1.host, whole_blocks(t1.prompt_tokens))
    assert value(metrics(m, t1.host), "kvmesh_kvshare_seconds_total", peer=holder, direction="out") > 0
    assert value(metrics(m, holder), "kvmesh_kvshare_seconds_total", peer=t1.host, direction="in") > 0
