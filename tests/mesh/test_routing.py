"""Placement across a three-node mesh: affinity, moving off a busy home to the replica holder, and
staying warm when the replica holder's engine evicted the imported replica (re-import from its store)."""

from __future__ import annotations

from support.conversation import Conversation

from kvmesh.node.lab.launcher import wait_for

from .helpers import Mesh, whole_blocks


def test_affinity_keeps_a_session_on_its_host_with_cached_tokens(shared_mesh: Mesh) -> None:
    """Consecutive turns of one session, sent through every entry node, run on one host and reuse its cache."""
    m = shared_mesh
    conv = Conversation("affinity-1", seed=101)
    first = m.turn(conv, "a")
    assert first.status == 200 and first.handoff == "none" and first.cached == 0
    home = first.host
    assert home in m.names
    for entry in ("a", "a", "b", "c", home):
        if entry != conv.turns[-1].host:
            m.settle(conv)  # a different entry: once it has heard of the last turn (the last test covers one that has not)
        prev_prompt = conv.turns[-1].prompt_tokens
        t = m.turn(conv, entry)
        assert t.host == home, f"turn via {entry} left the session's host {home} for {t.host}"
        assert t.handoff == "none"
        assert t.cached == t.cached_usage, "X-Kvmesh-Cached-Tokens disagrees with usage.prompt_tokens_details"
        assert t.cached >= prev_prompt, f"only {t.cached} of the previous {prev_prompt}-token prompt reused"
        assert t.reused >= 0.9
    # The mesh agrees on the home, from every node.
    for e in m.names:
        info = wait_for(lambda e=e: (s := m.session_info(e, conv.session)) and s["turns"] == len(conv.turns) and s,
                        f"{e} to count {len(conv.turns)} turns of {conv.session}")
        assert info["home"] == home and info["moves"] == 0 and info["last_handoff"] is None
        assert info["resident_tokens"] >= conv.turns[-1].prompt_tokens


def test_busy_home_moves_the_turn_to_the_replica_holder_warm(make_mesh) -> None:  # type: ignore[no-untyped-def]
    """With every slot of the home busy, the next turn runs on the replica holder and is warm."""
    m: Mesh = make_mesh(slots=1)
    conv = Conversation("busy-long", seed=202)
    t1 = m.turn(conv, "b")
    home = t1.host
    m.settle(conv)
    t2 = m.turn(conv, "c")
    assert t2.host == home and t2.handoff == "none"
    # The replica of the latest turn (its whole blocks) has landed where the session would go next.
    holder = m.wait_replica(conv.session, home, whole_blocks(t2.prompt_tokens))
    assert holder != home
    assert m.transfers_in(holder, home) >= 1
    with m.hold_slot("busy-hog", home):
        m.settle(conv)
        for entry in m.names:  # the hog stays busy for ~10 s: one turn per entry node
            m.settle(conv)
            prev_prompt = conv.turns[-1].prompt_tokens
            t = m.turn(conv, entry)
            if entry == m.names[0]:
                assert t.host == holder, f"busy {home}: turn via {entry} ran on {t.host}, replica is on {holder}"
                assert t.handoff == "warm", t
            else:  # now homed on the holder, which is free: it stays there
                assert t.host == holder and t.handoff == "none", t
            assert t.reused >= 0.9, f"{t.cached}/{t.prompt_tokens} reused"
            assert t.cached >= whole_blocks(prev_prompt)
    counters = wait_for(lambda: (c := m.cluster("a")["counters"])["warm"] >= 1 and c,
                        "the cluster to count the warm handoff")
    assert counters["cold"] == 0 and counters["partial"] == 0 and counters["stale_state_cold"] == 0


# A KV pool of 52 blocks (of 256 tokens, 100 KiB each at kv_scale 0.02): one ~8k-token conversation
# (32 blocks) fits, two do not.
SMALL_POOL = 52 * 256 * 400


def test_evicted_replica_is_reimported_and_the_move_stays_warm(make_mesh, events) -> None:  # type: ignore[no-untyped-def]
    """Replica imported, then evicted by the holder's engine under memory pressure (announced as replica_evicted):
    the next turn that moves there is still warm, re-imported from the holder's store."""
    m: Mesh = make_mesh(slots=1, cache_bytes=SMALL_POOL)
    conv = Conversation("evict-long", seed=303)
    t1 = m.turn(conv, "a")
    home = t1.host
    holder = m.wait_replica(conv.session, home, whole_blocks(t1.prompt_tokens))
    held = m.holding(holder, conv.session)
    assert held["resident_tokens"] >= whole_blocks(t1.prompt_tokens), f"replica not imported on arrival: {held}"
    assert held["store_tokens"] >= whole_blocks(t1.prompt_tokens)
    evicted_before = m.stats(holder)["engine"]["evicted_sessions"]
    ws = events(m.api(holder))

    # Memory pressure on the holder: another conversation of the same size lands in its engine (run there,
    # or migrated there), so the idle replica is evicted and its blocks handed out again.
    filler = Conversation("evict-filler", seed=304)
    f1 = m.turn(filler, holder)
    if f1.host != holder:
        r = m.admin(holder, f"/v1/admin/sessions/{filler.session}/migrate", {"target": holder})
        assert r.status_code == 200 and r.json()["ok"], r.text
    wait_for(lambda: m.holding(holder, conv.session)["resident_tokens"] == 0,
             f"{holder}'s engine to evict {conv.session}")
    assert m.stats(holder)["engine"]["evicted_sessions"] > evicted_before
    ev = ws.wait(lambda e: e.type == "replica_evicted" and e.session == conv.session,
                 f"a replica_evicted event for {conv.session} on {holder}")
    assert ev.host == holder and ev.where == "engine", ev
    assert m.holding(holder, conv.session)["store_tokens"] >= whole_blocks(t1.prompt_tokens)
    for e in m.names:  # every entry still sees the holder as the replica holder (its store has it)
        wait_for(lambda e=e: (m.session_info(e, conv.session) or {}).get("replica_host") == holder,
                 f"{e} to see {holder} still holding {conv.session}")

    imported_before = m.stats(holder)["engine"]["imported_blocks"]
    with m.hold_slot("evict-hog", home):
        m.settle(conv)
        entry = next(n for n in m.names if n not in (home, holder))
        t = m.turn(conv, entry)
    assert t.host == holder, f"busy {home}: the turn ran on {t.host}, the replica is stored on {holder}"
    assert t.handoff == "warm", t
    assert t.cached >= whole_blocks(t1.prompt_tokens) and t.reused >= 0.9
    # It was warm because the replica was imported again from the store, before the turn ran.
    ev = ws.wait(lambda e: e.type == "replica_imported" and e.session == conv.session,
                 f"a replica_imported event for {conv.session} on {holder}")
    assert ev.host == holder and ev.tokens >= whole_blocks(t1.prompt_tokens)
    assert m.stats(holder)["engine"]["imported_blocks"] > imported_before
    for e in m.names:
        c = wait_for(lambda e=e: (c := m.cluster(e)["counters"])["warm"] >= 1 and c, f"{e} to count the handoff")
        assert c["stale_state_cold"] == 0 and c["cold"] == 0, c


def test_replica_bytes_used_by_a_move_are_not_counted_as_wasted(make_mesh) -> None:  # type: ignore[no-untyped-def]
    """Replicas (a full one, then deltas) that a warm move then uses are not reported as wasted bytes."""
    m: Mesh = make_mesh(slots=1)
    conv = Conversation("waste-1", seed=404)
    t1 = m.turn(conv, "a")
    home = t1.host
    holder = m.wait_replica(conv.session, home, whole_blocks(t1.prompt_tokens))
    m.settle(conv)
    t2 = m.turn(conv, "a")
    assert t2.host == home
    n = m.transfers_in(holder, home)
    wait_for(lambda: m.transfers_in(holder, home) > n or
             m.holding(holder, conv.session)["store_tokens"] >= whole_blocks(t2.prompt_tokens),
             "the delta of turn 2 to land")
    m.wait_replica(conv.session, home, whole_blocks(t2.prompt_tokens))
    with m.hold_slot("waste-hog", home):
        m.settle(conv)
        t3 = m.turn(conv, "a")
    assert t3.host == holder and t3.handoff == "warm"
    assert m.stats(holder)["kvshare"]["wasted_replica_bytes"] == 0


def test_a_turn_through_an_entry_that_has_not_polled_the_home_yet_is_placed_and_counted(make_mesh) -> None:  # type: ignore[no-untyped-def]
    """A turn sent to an entry that holds the session's replica but has not heard where it ran stays on the
    session's (free) home, or counts as a handoff."""
    # Forced, not waited for: c polls its peers only when it starts (FROZEN_MESH), so it never hears
    # where the session ran; b is draining, so a's replica of the session can only go to c.
    m: Mesh = make_mesh(slots=2, frozen="c")
    m.set_draining("a", "b", True)
    wait_for(lambda: m.host_info("a", "b")["draining"], "a to see b draining")
    conv = Conversation("unheard-1", seed=160)
    t1 = m.turn(conv, "a", pin=True)
    assert t1.host == "a" and t1.status == 200
    wait_for(lambda: m.holding("c", conv.session)["store_tokens"] >= whole_blocks(t1.prompt_tokens),
             f"a's replica of {conv.session} to land on c")
    info = m.session_info("c", conv.session)
    assert info is not None and info["home"] is None, f"c heard where {conv.session} ran: {info}"
    t2 = m.turn(conv, "c")
    assert t2.host == "a" or t2.handoff != "none", \
        f"{conv.session}: ran on a, then on {t2.host} (free home) with X-Kvmesh-Handoff: none"


def test_mesh_policy_session_hash_places_every_turn_by_the_hash_and_pushes_no_replica(make_mesh) -> None:  # type: ignore[no-untyped-def]
    """mesh.policy = "session_hash": each session's turns, through every entry, run on its rendezvous-hash host
    (kvmesh would put new sessions by load and spread), a second conversation under its id (a subagent) with
    them, and no replica is pushed anywhere."""
    from kvmesh.node.mesh.directory import directory_host

    m: Mesh = make_mesh(mesh={"policy": "session_hash"})
    for i in range(4):
        conv = Conversation(f"hashed-{i}", seed=300 + i)
        sub = Conversation(conv.session, seed=400 + i)  # its own system prompt: another conversation of the id
        want = directory_host(conv.session, m.names)
        for entry in m.names:
            for c in (conv, sub):
                t = m.turn(c, entry)
                assert t.status == 200 and t.host == want, (c.session, entry, t.host, want)
        keys = {s["session"] for s in m.cluster(want)["sessions"] if s.get("group") == conv.session}
        assert len(keys) == 2, keys  # the node told the two conversations apart, and hashed the id for both
    assert all(m.transfers_in(h, src) == 0 for h in m.names for src in m.names if src != h)
