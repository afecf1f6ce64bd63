"""Unit tests of the console's plain-Python state model (no Textual)."""

from __future__ import annotations

import pytest
from kvm_helpers import NODE1, NODE2, T0, Clock, host, make_view

from kvmesh.console.format import fmt_shortfall
from kvmesh.console.state import ConsoleState, describe, normalize_url
from kvmesh.node.protocol import (
    DrainProgress,
    DrainStarted,
    Handoff,
    HostStatus,
    MigrateCompleted,
    ReplicaEvicted,
    ReplicaReady,
    ReplicaSent,
    TurnFinished,
    TurnStarted,
    Undrained,
)


def handoff(seq: int, cls: str = "warm", session: str = "s-001", src: str = "node-2", dst: str = "node-3",
            ts: float = T0 + 1, node: str = "node-3", replay: bool = False) -> Handoff:
    return Handoff(ts=ts, node=node, seq=seq, session=session, src=src, dst=dst, cls=cls,  # type: ignore[arg-type]
                   prompt_tokens=1000, reused_tokens=990, replay=replay)


def test_snapshot_builds_hosts_sessions_links_counters(state: ConsoleState) -> None:
    """A snapshot fills hosts (by name), sessions, links and counters and names the connection."""
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    assert state.host_names() == ["node-1", "node-2", "node-3"]
    assert len(state.sessions) == 6
    assert set(state.links) == {("node-1", "node-2"), ("node-2", "node-3")}
    assert (state.counters.warm, state.counters.partial, state.counters.cold) == (50, 1, 1)
    assert state.nodes[NODE1].name == "node-1"
    s0 = state.sessions["s-000"]
    assert s0.replica_host == "node-2" and s0.freshness(state.clock()).kind == "fresh"
    assert state.sessions["s-002"].freshness(state.clock()).kind == "behind"


def test_replay_is_logged_not_reapplied_then_live_applies(state: ConsoleState) -> None:
    """Replayed events go to the log only (already in the snapshot); live events change state."""
    state.node_connected(NODE1)
    state.feed(NODE1, make_view(seq=0))
    state.feed(NODE1, handoff(seq=5, replay=True))
    assert state.counters.warm == 50, "a replayed handoff must not be counted twice"
    assert any(e.kind == "handoff" and e.replay for e in state.log)
    state.feed(NODE1, handoff(seq=6, cls="cold"))
    assert state.counters.cold == 2
    assert state.sessions["s-001"].last_handoff == "cold"
    assert state.links[("node-2", "node-3")].cold == 2


def test_replay_newer_than_snapshot_watermark_is_applied(state: ConsoleState) -> None:
    """A replayed event past the snapshot's seq watermark (same node) was not in the snapshot: apply it."""
    state.node_connected(NODE1)
    state.feed(NODE1, make_view(node="node-3", seq=10))
    state.feed(NODE1, handoff(seq=9, replay=True, node="node-3"))
    state.feed(NODE1, handoff(seq=11, replay=True, node="node-3", cls="partial"))
    assert state.counters.warm == 50
    assert state.counters.partial == 2


def test_dedupe_by_node_and_seq(state: ConsoleState) -> None:
    """The same (node, seq) is applied once, whichever stream delivers it; another node's seq is distinct."""
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    assert state.feed(NODE1, handoff(seq=7)) is True
    assert state.feed(NODE2, handoff(seq=7)) is False
    assert state.feed(NODE1, handoff(seq=7, node="node-2", dst="node-1")) is True
    assert state.counters.warm == 52
    assert state.duplicates == 1


def test_reconnect_rebuilds_from_new_snapshot(clock: Clock) -> None:
    """After a reconnect the new snapshot replaces sessions and counters; missed events come as replay."""
    state = ConsoleState(clock=clock)
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    state.feed(NODE1, handoff(seq=1))
    state.node_disconnected(NODE1, "reset")
    assert state.nodes[NODE1].stale_since == clock()
    clock.advance(5)
    state.node_connected(NODE1)
    snap = make_view(seq=3, ts=clock(), n_sessions=4)
    snap.cluster.counters.warm = 60
    state.feed(NODE1, snap)
    state.feed(NODE1, handoff(seq=1, replay=True))  # seen before: deduped
    state.feed(NODE1, handoff(seq=2, replay=True))  # missed while down: logged, not re-counted
    assert len(state.sessions) == 4
    assert state.counters.warm == 60
    changes = state.take_changes()
    assert changes.cluster_view and {"s-004", "s-005"} <= changes.removed_sessions
    assert state.nodes[NODE1].connected and state.nodes[NODE1].stale_since is None
    assert [e.seq for e in state.log if e.kind == "handoff"] == [1, 2]


def test_out_of_order_events_do_not_roll_back(state: ConsoleState) -> None:
    """A late event (lower seq from the same node) cannot overwrite newer state; counts add up; log in time order."""
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    newer = HostStatus(ts=T0 + 20, node="node-2", seq=3, host=host("node-2", 2, busy=3))
    older = HostStatus(ts=T0 + 15, node="node-2", seq=2, host=host("node-2", 2, busy=1))
    state.feed(NODE1, newer)
    state.feed(NODE1, older)
    assert state.hosts["node-2"].info.busy == 3
    state.feed(NODE1, handoff(seq=10, ts=T0 + 30, dst="node-3"))
    state.feed(NODE1, handoff(seq=9, ts=T0 + 25, dst="node-1", cls="partial"))
    s = state.sessions["s-001"]
    assert s.home == "node-3" and s.last_handoff == "warm"
    assert state.counters.warm == 51 and state.counters.partial == 2
    times = [e.ts for e in state.log]
    assert times == sorted(times)


def test_pause_queues_in_order_and_resume_applies_all(state: ConsoleState) -> None:
    """While paused nothing changes and events queue ("N pending"); resume applies them in order, none dropped."""
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    state.pause()
    state.feed(NODE1, TurnFinished(ts=T0 + 1, node="node-1", seq=1, session="s-000", host="node-1",
                                   prompt_tokens=500, cached_tokens=400, completion_tokens=10, ttft_s=0.1, total_s=1))
    state.feed(NODE1, MigrateCompleted(ts=T0 + 2, node="node-1", seq=2, session="s-000", src="node-1",
                                       dst="node-3", ok=True))
    state.feed(NODE1, handoff(seq=3, session="s-000", src="node-3", dst="node-2", ts=T0 + 3))
    assert state.pending_count == 3
    assert state.sessions["s-000"].home == "node-1"
    assert state.resume() == 3
    s = state.sessions["s-000"]
    assert s.home == "node-2", "applied in arrival order: turn, migrate, handoff"
    assert s.turns == 4 and s.moves == 2
    assert state.pending_count == 0


def test_connection_status_is_live_while_paused(state: ConsoleState) -> None:
    """A node lost while paused shows at once; its reconnect snapshot waits in the queue."""
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    state.pause()
    state.node_disconnected(NODE1, "gone")
    assert state.host_state("node-1")[0] == "DISCONNECTED"
    state.node_connected(NODE1)
    state.feed(NODE1, make_view(n_sessions=2))
    assert len(state.sessions) == 6 and state.pending_count == 1
    state.resume()
    assert len(state.sessions) == 2


def test_disconnected_node_kept_dimmed_with_stale_since(clock: Clock) -> None:
    """A lost node stays, marked DISCONNECTED with the time it went stale; it comes back on reconnect."""
    state = ConsoleState(clock=clock)
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    lost_at = clock()
    state.node_disconnected(NODE1, "ConnectionClosed")
    clock.advance(30)
    state.node_disconnected(NODE1, "refused")  # retries do not move the stale time
    assert "node-1" in state.hosts
    word, level, since = state.host_state("node-1")
    assert (word, level, since) == ("DISCONNECTED", "stale", lost_at)
    assert state.live_hosts() == ["node-2", "node-3"]
    assert any("lost node-1" in e.text for e in state.log)
    state.node_connected(NODE1)
    assert state.host_state("node-1")[0] == "UP"


def test_host_missing_from_new_snapshot_is_kept(state: ConsoleState) -> None:
    """A host absent from a later snapshot is kept and marked MISSING, never silently dropped."""
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    snap = make_view(seq=2)
    snap.cluster.hosts = [h for h in snap.cluster.hosts if h.name != "node-3"]
    state.feed(NODE1, snap)
    assert state.host_state("node-3")[0] == "MISSING"


def test_drain_and_migrate_events_update_state_and_log(state: ConsoleState) -> None:
    """Drain start/progress/undrain and replica/migrate events update hosts and sessions and reach the log."""
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    state.feed(NODE1, DrainStarted(ts=T0 + 1, node="node-2", seq=1, host="node-2", sessions=4))
    state.feed(NODE1, DrainProgress(ts=T0 + 2, node="node-2", seq=2, host="node-2", done=1, total=4))
    assert state.host_state("node-2") == ("DRAIN 1/4", "warn", None)
    state.feed(NODE1, Undrained(ts=T0 + 3, node="node-2", seq=3, host="node-2"))
    assert state.host_state("node-2")[0] == "UP"
    state.feed(NODE1, ReplicaReady(ts=T0 + 4, node="node-3", seq=1, session="s-001", src="node-2", dst="node-3",
                                   tokens=11_000, bytes=1, lag_s=0.01, imported=True))
    assert state.sessions["s-001"].replica_host == "node-3"
    state.feed(NODE1, ReplicaEvicted(ts=T0 + 5, node="node-3", seq=2, session="s-001", host="node-3",
                                     where="store"))
    assert state.sessions["s-001"].replica_host is None
    kinds = [e.kind for e in state.log]
    assert {"drain_started", "drain_progress", "undrained", "replica_ready", "replica_evicted"} <= set(kinds)


def test_link_throughput_history_spreads_transfer_over_its_duration(clock: Clock) -> None:
    """replica_sent bytes are spread over the seconds the transfer took, for the sparkline and Mb/s."""
    state = ConsoleState(clock=clock)
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    end = float(int(clock()))  # a whole second, so the buckets are exact
    state.feed(NODE1, ReplicaSent(ts=end, node="node-1", seq=1, session="s-000", src="node-1", dst="node-2",
                                  blocks=8, bytes=2_000_000, seconds=2.0, tokens=4096))
    clock.now = end + 1.5
    link = state.links[("node-1", "node-2")]
    hist = link.history_bps(clock(), 4)
    assert hist == [0.0, 8e6, 8e6, 0.0]
    assert link.transfers == 13 and link.last_transfer_bytes == 2_000_000
    assert link.goodput_gbps == pytest.approx(0.008)


def test_bad_frames_are_counted_not_fatal(state: ConsoleState) -> None:
    """Unparseable or unknown-type frames are skipped and counted; the next good one still applies."""
    state.node_connected(NODE1)
    assert state.feed_frame(NODE1, "{not json") is False
    assert state.feed_frame(NODE1, '{"type": "from_the_future", "v": 9}') is False
    assert state.bad_frames == 2
    assert state.feed_frame(NODE1, make_view().model_dump_json()) is True
    assert len(state.sessions) == 6


def test_discovery_offers_unknown_peers_once(state: ConsoleState) -> None:
    """Peers listed in a snapshot with an API URL are offered for connection, once, minus the node itself."""
    state.add_node("http://127.0.0.1:8001/")
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    assert state.take_discovered() == {"node-2": "http://127.0.0.1:8002", "node-3": "http://127.0.0.1:8003"}
    assert state.take_discovered() == {}
    assert normalize_url("HTTP://LocalHost:8000/") == "http://localhost:8000"


def test_log_is_capped(clock: Clock) -> None:
    """The event log keeps at most its cap (newest kept)."""
    state = ConsoleState(clock=clock, log_cap=50)
    state.node_connected(NODE1)
    for i in range(1, 200):
        state.feed(NODE1, handoff(seq=i, ts=T0 + i))
    entries = state.log_entries()
    assert len(entries) == 50 and entries[-1].seq == 199


def test_restarted_node_reusing_seqs_is_not_deduped(state: ConsoleState) -> None:
    """A node that restarts counts seq from 1 again: same seq with a new ts is a new event, not a duplicate."""
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    assert state.feed(NODE1, handoff(seq=1, ts=T0 + 1))
    assert state.feed(NODE1, handoff(seq=2, ts=T0 + 2))
    assert not state.feed(NODE1, handoff(seq=2, ts=T0 + 2, replay=True)), "a true replay is still a duplicate"
    assert state.feed(NODE1, handoff(seq=1, ts=T0 + 100, cls="cold")), "restarted node: new event"
    assert state.feed(NODE1, handoff(seq=2, ts=T0 + 101, cls="cold"))
    assert state.counters.cold == 3


def test_replica_consumed_when_session_moves_onto_it(state: ConsoleState) -> None:
    """When a session's home moves to its replica host, that replica became the live cache: no replica shown."""
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    s = state.sessions["s-000"]
    assert (s.home, s.replica_host) == ("node-1", "node-2")
    state.feed(NODE1, handoff(seq=1, session="s-000", src="node-1", dst="node-2"))
    assert (s.home, s.replica_host) == ("node-2", None)
    assert s.freshness(state.clock()).kind == "none"


def test_skewed_host_clocks_do_not_block_updates(state: ConsoleState) -> None:
    """Across nodes the order is arrival, never the hosts' clocks: a host 60 s behind still moves the session."""
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    state.feed(NODE1, handoff(seq=5, node="node-3", ts=T0 + 100, session="s-001", src="node-2", dst="node-3"))
    state.feed(NODE1, handoff(seq=7, node="node-1", ts=T0 + 40, session="s-001", src="node-3", dst="node-1"))
    assert state.sessions["s-001"].home == "node-1"
    state.feed(NODE1, HostStatus(ts=T0 + 1, node="node-2", seq=9, host=host("node-2", 2, busy=4)))
    state.feed(NODE1, HostStatus(ts=T0 - 50, node="node-2", seq=10, host=host("node-2", 2, busy=2)))
    assert state.hosts["node-2"].info.busy == 2, "node-2's own stream is ordered by seq, its clock stepped back"


def test_a_late_event_of_an_older_turn_does_not_move_the_home_back(state: ConsoleState) -> None:
    """Across hosts a session's turns are ordered by turn_seq: the old host's late turn_finished of turn 7,
    arriving after turn 8 started elsewhere, neither moves the home back nor marks the session idle."""
    state.node_connected(NODE1)
    state.feed(NODE1, make_view())
    state.feed(NODE1, TurnStarted(ts=T0 + 5, node="node-3", seq=4, session="s-001", host="node-3", prompt_tokens=900,
                                  cached_tokens=880, turn_seq=8))
    s = state.sessions["s-001"]
    assert (s.home, s.active, s.home_seq) == ("node-3", True, 8)
    late = dict(session="s-001", host="node-1", prompt_tokens=800, cached_tokens=790, completion_tokens=9,
                ttft_s=0.1, total_s=0.5)
    state.feed(NODE1, TurnFinished(ts=T0 + 9, node="node-1", seq=20, turn_seq=7, **late))  # type: ignore[arg-type]
    assert (s.home, s.active) == ("node-3", True)
    state.feed(NODE1, TurnFinished(ts=T0 + 9, node="node-3", seq=5, session="s-001", host="node-3", prompt_tokens=900,
                                   cached_tokens=880, completion_tokens=12, ttft_s=0.1, total_s=0.4, turn_seq=8))
    assert (s.home, s.active, s.resident_tokens) == ("node-3", False, 912)
    # Turn 9 moves it on, whatever the hosts' clocks say.
    state.feed(NODE1, handoff(seq=21, node="node-1", ts=T0 - 60, session="s-001", src="node-3", dst="node-1"))
    assert s.home == "node-1", "an event without a turn_seq (an older node) is applied in arrival order"


def test_handoff_shortfalls_are_counted_per_reason(state: ConsoleState) -> None:
    """Shortfall counts come from the snapshot, grow with live handoffs, and show compactly (non-zero only)."""
    state.node_connected(NODE1)
    snap = make_view()
    snap.cluster.counters.shortfall = {"none": 48, "replica_in_flight": 2, "unexplained": 0}
    state.feed(NODE1, snap)
    ev = handoff(seq=3, cls="partial").model_copy(update={"shortfall": "evicted", "predicted_reused_tokens": 990})
    state.feed(NODE1, ev)
    assert state.counters.shortfall == {"none": 48, "replica_in_flight": 2, "unexplained": 0, "evicted": 1}
    assert snap.cluster.counters.shortfall.get("evicted") is None, "the snapshot's own counts must stay as sent"
    assert fmt_shortfall(state.counters.shortfall) == "in flight 2, evicted 1"
    assert fmt_shortfall({"none": 5}) == ""
    assert "evicted" in describe(ev)[0]


def test_a_handoff_short_by_prediction_says_so_without_a_shortfall_of_tokens(state: ConsoleState) -> None:
    """A partial handoff that reused what was predicted names why the prediction was short, not a gap."""
    ev = handoff(seq=4, cls="partial").model_copy(update={"shortfall": "new_input", "predicted_reused_tokens": 990})
    line = describe(ev)[0]
    assert line.endswith("as predicted: new input") and "short of" not in line, line
    behind = ev.model_copy(update={"shortfall": "replica_behind"})
    assert describe(behind)[0].endswith("as predicted: replica behind")
    assert fmt_shortfall({"none": 3, "new_input": 2, "replica_behind": 1}) == "new input 2, replica behind 1"
