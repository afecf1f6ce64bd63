"""Every node's snapshot is one part of the console's sessions: parts union, merge by owner, and a node's
departure takes only its own part (past `directory_after_hosts` no snapshot is the mesh; issue 32)."""

from __future__ import annotations

from kvm_helpers import NODE1, NODE2, T0, Clock, host

from kvmesh.console.state import ConsoleState
from kvmesh.node.protocol import (
    ClusterView,
    ClusterViewEvent,
    SessionInfo,
    TurnFinished,
    merge_clusters,
    merge_session_parts,
)

NODE3 = "http://127.0.0.1:8003"


def part(node: str, sessions: list[SessionInfo], ts: float = T0, seq: int = 0) -> ClusterViewEvent:
    """`node`'s snapshot: every host (hosts are whole in each), only these sessions."""
    hosts = [host(f"node-{i}", i) for i in (1, 2, 3)]
    return ClusterViewEvent(ts=ts, node=node, seq=seq, cluster=ClusterView(
        node=node, ts=ts, hosts=hosts, sessions=sessions, scope="partial"))


def info(sid: str, home: str | None, seq: int, tokens: int = 4096, **kw: object) -> SessionInfo:
    return SessionInfo(session=sid, home=home, home_seq=seq, resident_tokens=tokens, turns=seq,
                       last_turn_at=T0 - 5, **kw)  # type: ignore[arg-type]


def test_each_snapshot_replaces_only_its_own_part(clock: Clock) -> None:
    """Two nodes' partial snapshots add up to the union; a later one from node-1 drops only what node-1 listed."""
    state = ConsoleState(clock=clock)
    state.feed(NODE1, part("node-1", [info("a", "node-1", 1), info("b", "node-1", 2)]))
    state.feed(NODE2, part("node-2", [info("c", "node-2", 1), info("b", "node-1", 2)]))
    assert set(state.sessions) == {"a", "b", "c"}
    state.feed(NODE1, part("node-1", [info("d", "node-1", 1)]))
    # a: node-1 no longer lists it, nobody else does: gone; b: node-2 still lists it; c: node-2's.
    assert set(state.sessions) == {"b", "c", "d"}
    assert state.session_parts("b") == 1


def test_parts_merge_by_owner_highest_turn_sequence_is_home() -> None:
    """The home is the host with the highest home_seq any part names; an older home's cache is the replica
    candidate, beside a store replica another part names, and the larger wins."""
    old_home = info("s", "node-1", 3, tokens=9000)  # node-1 ran turn 3 and still holds its cache
    new_home = info("s", "node-2", 4, tokens=9500)  # node-2 ran turn 4 (it is home now)
    stored = info("s", None, 0, tokens=0, replica_host="node-3", replica_tokens=8704, replica_age_s=2.0)
    merged = merge_session_parts([(old_home, T0), (new_home, T0), (stored, T0 - 1)], T0)
    assert (merged.home, merged.home_seq, merged.resident_tokens) == ("node-2", 4, 9500)
    assert (merged.replica_host, merged.replica_tokens, merged.replica_behind_tokens) == ("node-1", 9000, 500)
    assert merged.turns == 4  # the largest count any part saw, never their sum
    merged = merge_session_parts([(new_home, T0), (stored, T0 - 1)], T0)
    assert (merged.replica_host, merged.replica_tokens, merged.replica_age_s) == ("node-3", 8704, 3.0)


def test_a_node_gone_past_the_grace_takes_only_its_own_part(clock: Clock) -> None:
    """A disconnected node keeps its part while it may come back; past the grace its part goes, and only the
    sessions no other node lists go with it."""
    state = ConsoleState(clock=clock, part_grace_s=60)
    for url, name, sids in ((NODE1, "node-1", ["a", "shared"]), (NODE2, "node-2", ["b", "shared"])):
        state.node_connected(url)
        state.feed(url, part(name, [info(s, name if s != "shared" else "node-1", 1) for s in sids]))
    state.node_disconnected(NODE1, "reset")
    clock.advance(30)
    state.tick()
    assert set(state.sessions) == {"a", "b", "shared"}
    clock.advance(31)
    state.tick()
    assert set(state.sessions) == {"b", "shared"}


def test_a_session_seen_live_on_a_node_that_restarts_without_it_is_removed(clock: Clock) -> None:
    """A session known only from live events on node-3 goes when node-3's next snapshot does not list it; one
    homed elsewhere stays."""
    state = ConsoleState(clock=clock)
    state.feed(NODE3, part("node-3", []))
    state.feed(NODE1, part("node-1", []))
    for i, (sid, h) in enumerate((("x", "node-3"), ("y", "node-1"))):
        state.feed(NODE3 if h == "node-3" else NODE1, TurnFinished(
            ts=T0, node=h, seq=i + 1, session=sid, host=h, prompt_tokens=900, cached_tokens=0,
            completion_tokens=8, ttft_s=0.1, total_s=0.2, turn_seq=1))
    assert set(state.sessions) == {"x", "y"}
    state.feed(NODE3, part("node-3", [], seq=0))  # it came back and holds nothing
    assert set(state.sessions) == {"y"}


def test_a_live_turn_newer_than_every_snapshot_keeps_its_home(clock: Clock) -> None:
    """A snapshot from a node that has not heard of the session's latest turn does not move its home back."""
    state = ConsoleState(clock=clock)
    state.feed(NODE1, part("node-1", [info("s", "node-1", 1)]))
    state.feed(NODE2, TurnFinished(ts=T0, node="node-2", seq=1, session="s", host="node-2", prompt_tokens=900,
                                   cached_tokens=0, completion_tokens=8, ttft_s=0.1, total_s=0.2, turn_seq=2))
    state.feed(NODE1, part("node-1", [info("s", "node-1", 1)]))
    assert state.sessions["s"].home == "node-2"


def test_a_fan_in_of_partial_snapshots_is_the_mesh() -> None:
    """merge_clusters (GET /v1/cluster?scope=mesh) lists every node's sessions once, merged, and says it is whole."""
    a = part("node-1", [info("a", "node-1", 1), info("b", "node-1", 2)]).cluster
    b = part("node-2", [info("b", "node-2", 3), info("c", "node-2", 1)]).cluster
    whole = merge_clusters(a, [b])
    assert [s.session for s in whole.sessions] == ["a", "b", "c"]
    assert whole.sessions[1].home == "node-2" and whole.sessions[1].replica_host == "node-1"
    assert (whole.scope, whole.parts) == ("mesh", ["node-1", "node-2"])


def test_a_node_that_has_not_heard_its_peers_does_not_drop_the_counters(clock: Clock) -> None:
    """Handoff counters from a snapshot counting fewer than the console has (a node just restarted) are not taken;
    a snapshot counting more is."""
    state = ConsoleState(clock=clock)
    full = part("node-1", [])
    full.cluster.counters.warm = 500
    state.feed(NODE1, full)
    fresh = part("node-2", [])
    fresh.cluster.counters.warm = 3
    state.feed(NODE2, fresh)
    assert state.counters.warm == 500
    more = part("node-2", [])
    more.cluster.counters.warm = 510
    state.feed(NODE2, more)
    assert state.counters.warm == 510
