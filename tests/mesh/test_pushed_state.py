"""Peer state pushed as deltas on real nodes: every peer streams, turns are seen at once, the control plane
shrinks against polling, and past `directory_after_hosts` a session's state goes to its directory host only."""

from __future__ import annotations

import time
from typing import Any

from support.conversation import Conversation

from kvmesh.node.lab.launcher import wait_for
from kvmesh.node.mesh.directory import directory_host

from .helpers import Mesh


def _control_bytes(m: Mesh) -> int:
    """Peer-status bytes (pushed or polled, both directions) every node has counted so far."""
    total = 0
    for n in m.names:
        for per in m.stats(n)["peer_wire"].values():
            total += per["in"].get("peer_status", 0) + per["out"].get("peer_status", 0)
    return total


def _quiet_rate(m: Mesh, seconds: float = 3.0) -> float:
    b0, t0 = _control_bytes(m), time.monotonic()
    time.sleep(seconds)
    return (_control_bytes(m) - b0) / (time.monotonic() - t0) / len(m.names)


def _sessions(m: Mesh, n: int, tag: str) -> list[Conversation]:
    convs = [Conversation(f"{tag}-{i}", chars=1500, seed=i) for i in range(n)]
    for i, c in enumerate(convs):
        m.turn(c, m.names[i % 3])
    for c in convs:
        m.settle(c)
    return convs


def test_pushed_state_is_a_fraction_of_polling_and_turns_are_seen_everywhere(make_mesh: Any) -> None:
    """Each node streams every peer's state; with 9 sessions held, a quiet mesh's control plane costs under a
    fifth of the same mesh polling (push_state = false), and every node still sees every turn."""
    rates = {}
    for push in (True, False):
        m: Mesh = make_mesh(mesh={"push_state": push})
        want = "pushed" if push else "polled"
        for n in m.names:
            wait_for(lambda n=n, m=m, want=want: set(m.stats(n)["peer_state"].values()) == {want},
                     f"{n}'s peers all {want}")
        convs = _sessions(m, 9, f"cp-{want}")
        c = convs[0]
        m.turn(c, c.turns[-1].host)
        m.settle(c)  # seen by every node: a delta (or a poll) carried it
        rates[want] = _quiet_rate(m)
        m.stop()
    assert rates["pushed"] < rates["polled"] / 5, rates


def test_past_the_directory_threshold_only_the_directory_host_mirrors_a_session(make_mesh: Any) -> None:
    """directory_after_hosts = 2 on three hosts: a session's state reaches its directory host only, and an entry
    that is neither home nor directory asks the directory and forwards the turn to the home in one hop, warm."""
    m: Mesh = make_mesh(mesh={"directory_after_hosts": 2})
    assert all(m.stats(n)["directory"] for n in m.names)
    for i in range(40):
        conv = Conversation(f"dir-{i}", chars=3000, seed=i)
        home = m.turn(conv, "a").host
        d = directory_host(conv.session, m.names)
        bystanders = [n for n in m.names if n not in (home, d)]
        if len(bystanders) == 1 and d != "a":
            break
    else:
        raise AssertionError("no session had its directory, home and a third host apart")
    (bystander,) = bystanders
    wait_for(lambda: (s := m.session_info(d, conv.session)) is not None and s["home"] == home,
             f"the directory {d} to see {home} as the home")
    time.sleep(1.0)  # a few push intervals: had b been sent the session, it would know it by now
    # It may hold a replica of its own, but it was never told where the session lives.
    info = m.session_info(bystander, conv.session)
    assert info is None or info["home"] is None, f"{bystander}, not the directory, mirrored the home: {info}"
    prev = conv.turns[-1].prompt_tokens
    t = m.turn(conv, bystander)
    assert t.host == home and t.handoff == "none" and t.cached >= prev - 256, t


def test_the_state_stream_needs_the_secret_and_answers_a_resync_with_a_snapshot(shared_mesh: Mesh) -> None:
    """/v1/peer/state: refused without the mesh secret (HTTP 403 at the handshake); with it, a snapshot first,
    and a fresh snapshot (a later seq) whenever the subscriber says "resync"."""
    import asyncio

    import websockets
    from websockets.asyncio.client import connect

    from kvmesh.node.protocol import STATE_ADAPTER, StateBaseline

    url = shared_mesh.api("a").replace("http://", "ws://") + "/v1/peer/state?subscriber=b"

    async def go() -> tuple[int, int, int]:
        try:
            async with connect(url, open_timeout=5):
                pass
            refused = 0
        except websockets.InvalidStatus as e:
            refused = e.response.status_code
        async with connect(url, additional_headers=shared_mesh.peer_headers(), open_timeout=5) as ws:
            first = STATE_ADAPTER.validate_json(await ws.recv())
            assert isinstance(first, StateBaseline) and first.status.host.name == "a"
            await ws.send("resync")
            while True:
                msg = STATE_ADAPTER.validate_json(await asyncio.wait_for(ws.recv(), 5))
                if isinstance(msg, StateBaseline):
                    return refused, first.seq, msg.seq

    refused, seq0, seq1 = asyncio.run(go())
    assert refused == 403 and seq1 > seq0
