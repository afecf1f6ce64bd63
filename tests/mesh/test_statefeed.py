"""Pushed peer state (node.mesh.statefeed, sans I/O): deltas rebuild the sender's status exactly; gaps are caught."""

from __future__ import annotations

import random

from kvmesh.node.mesh.directory import directory_host
from kvmesh.node.mesh.statefeed import StateFeed, StateMirror, encode
from kvmesh.node.protocol import STATE_ADAPTER, HostInfo, LinkInfo, PeerStatus, SessionHolding, StateDelta


def _status(rng: random.Random, sessions: dict[str, int], busy: int) -> PeerStatus:
    links = [LinkInfo(src="a", dst=d, bytes_sent=rng.randrange(3) << 20, throughput_bps=rng.choice([0.0, 1e6]))
             for d in ("b", "c", "d") if rng.random() < 0.7]
    return PeerStatus(host=HostInfo(name="a", slots=4, busy=busy, mem_used_bytes=rng.randrange(1 << 30)),
                      sessions=[SessionHolding(session=s, resident_tokens=n, home_seq=n // 100) for s, n in sessions.items()],
                      links=links, mean_turn_s=1.5)


def _wire(msg: object) -> object:
    return STATE_ADAPTER.validate_json(encode(msg))  # type: ignore[arg-type]


def test_a_mirror_fed_the_deltas_equals_the_sender_after_every_change() -> None:
    """Sessions and links added, changed and dropped at random: after each delta (as sent) the mirror is the status."""
    rng = random.Random(7)
    feed, mirror = StateFeed(epoch=1.0), StateMirror()
    sessions: dict[str, int] = {}
    st = _status(rng, sessions, 0)
    assert mirror.apply(_wire(feed.baseline(st)))  # type: ignore[arg-type]
    for step in range(300):
        op = rng.random()
        if op < 0.4 or not sessions:
            sessions[f"s{rng.randrange(60)}"] = rng.randrange(1, 20_000)
        elif op < 0.7:
            sessions.pop(rng.choice(sorted(sessions)))
        st = _status(rng, sessions, rng.randrange(5))
        delta = feed.delta(st)
        assert delta is not None  # the host's memory figure changes every step
        assert mirror.apply(_wire(delta)), step  # type: ignore[arg-type]
        assert mirror.status is not None
        got = {s.session: s for s in mirror.status.sessions}
        assert got == {s.session: s for s in st.sessions}, step
        assert mirror.status.host == st.host and mirror.status.mean_turn_s == st.mean_turn_s
        assert sorted(mirror.status.links, key=lambda li: li.dst) == st.links, step


def test_nothing_changed_sends_nothing_and_a_heartbeat_is_tiny() -> None:
    """An unchanged status gives no delta; the heartbeat repeats the seq, applies, and is under 80 bytes."""
    rng = random.Random(1)
    st = _status(rng, {"x": 500}, 1)
    feed, mirror = StateFeed(epoch=2.0), StateMirror()
    mirror.apply(feed.baseline(st))
    assert feed.delta(st) is None
    beat = feed.heartbeat()
    assert beat.seq == feed.seq and mirror.apply(beat) and len(encode(beat)) < 80


def test_a_gap_or_a_restarted_sender_is_refused_until_a_snapshot() -> None:
    """A lost delta, or one from another epoch, is not applied (the mirror would be wrong); a snapshot heals it."""
    rng = random.Random(2)
    feed, mirror = StateFeed(epoch=3.0), StateMirror()
    mirror.apply(feed.baseline(_status(rng, {"x": 100}, 0)))
    feed.delta(_status(rng, {"x": 200}, 0))  # lost on the way
    later = feed.delta(_status(rng, {"x": 300}, 0))
    assert later is not None and not mirror.apply(later)
    mirror.out_of_step()
    assert mirror.status is None and mirror.resyncs == 1
    assert not mirror.apply(StateDelta(epoch=3.0, seq=feed.seq + 1, fields={"mean_turn_s": 2.0}))
    assert mirror.apply(feed.baseline(_status(rng, {"x": 300}, 0)))
    assert mirror.status is not None and mirror.status.sessions[0].resident_tokens == 300
    other = StateFeed(epoch=4.0)  # the sender restarted: its seq numbers start again
    other.baseline(_status(rng, {}, 0))
    d = other.delta(_status(rng, {"y": 1}, 0))
    assert d is not None and not mirror.apply(d)


def test_a_scoped_feed_carries_only_its_sessions() -> None:
    """A feed scoped to a directory host's sessions sends nothing about the others."""
    rng = random.Random(3)
    members = [f"h{i}" for i in range(20)]
    names = [f"s{i}" for i in range(200)]
    mine = {s for s in names if directory_host(s, members) == "h4"}
    assert 0 < len(mine) < 40  # about 1/20 of them
    feed = StateFeed(epoch=1.0, scope=lambda s: s in mine)
    snap = feed.baseline(_status(rng, {s: 100 for s in names}, 0))
    assert {s.session for s in snap.status.sessions} == mine
    d = feed.delta(_status(rng, {s: 200 for s in names}, 0))
    assert d is not None and set(d.sessions) == mine


def test_the_directory_moves_only_a_departed_hosts_sessions() -> None:
    """Rendezvous hashing: when one of 64 hosts leaves, only the sessions it answered for change directory."""
    members = [f"h{i}" for i in range(64)]
    names = [f"s{i}" for i in range(3000)]
    before = {s: directory_host(s, members) for s in names}
    after = {s: directory_host(s, [m for m in members if m != "h9"]) for s in names}
    moved = {s for s in names if before[s] != after[s]}
    assert moved == {s for s in names if before[s] == "h9"} and moved
