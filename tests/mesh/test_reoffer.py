"""A replica is not lost to bad timing: a turn that ends while every other host looks unreachable queues no
push, and when a peer comes back up the session's replica is offered again, without waiting for its next turn."""

from __future__ import annotations

import signal

from support.conversation import Conversation

from kvmesh.node.lab.launcher import wait_for

from .helpers import Mesh, whole_blocks


def test_a_peer_coming_back_gets_the_replica_a_turn_could_not_send(make_mesh) -> None:  # type: ignore[no-untyped-def]
    """b and c frozen (SIGSTOP) until a marks them down; a turn on a pushes nothing; once they thaw, a's replica of
    the session lands on one of them with no further turn."""
    m: Mesh = make_mesh()
    conv = Conversation("reoffer-1", chars=6000)
    procs = [m.nodes[n].proc for n in ("b", "c")]
    assert all(p is not None for p in procs)
    for p in procs:
        p.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        wait_for(lambda: not any(h["reachable"] for h in m.cluster("a")["hosts"] if h["name"] != "a"),
                 "a to mark b and c unreachable")
        t = m.turn(conv, "a", pin=True)
        assert t.host == "a"
        stats = m.stats("a")["kvshare"]
        assert not stats["out"], f"no push could be queued with every peer down: {stats['out']}"
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
    holder = m.wait_replica(conv.session, "a", whole_blocks(t.prompt_tokens), entries=["a"], timeout=30)
    assert holder in ("b", "c")
