"""Replica pushes go by value when the link cannot carry them all: the key, the gate that applies it, and real nodes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from support.conversation import Conversation

from kvmesh.node.kvshare.pushorder import PushFacts, PushGate, push_key
from kvmesh.node.lab.launcher import wait_for
from kvmesh.node.protocol import ReplicaSent, ReplicaStarted

from .service_helpers import Pair, start_pair

GBIT = 1e9


def test_a_push_likelier_to_be_needed_goes_first() -> None:
    """Higher chance the session moves wins, whatever the deadlines."""
    likely = PushFacts(bytes_needed=10 << 20, next_turn_in_s=30.0, p_move=0.9)
    unlikely = PushFacts(bytes_needed=10 << 20, next_turn_in_s=1.0, p_move=0.2)
    assert sorted([unlikely, likely], key=lambda f: push_key(f, GBIT)) == [likely, unlikely]


def test_equal_value_goes_earliest_deadline_first() -> None:
    """Among pushes that can all land in time, the session whose next turn comes first goes first."""
    soon = PushFacts(bytes_needed=50 << 20, next_turn_in_s=2.0, p_move=1.0)
    later = PushFacts(bytes_needed=5 << 20, next_turn_in_s=20.0, p_move=1.0)
    assert sorted([later, soon], key=lambda f: push_key(f, GBIT)) == [soon, later]


def test_a_push_that_cannot_land_before_its_turn_yields_to_one_that_can() -> None:
    """A 1 GiB delta due in 1 s (8.6 s to send) is worth less per link-second than one that lands in time."""
    late = PushFacts(bytes_needed=1 << 30, next_turn_in_s=1.0, p_move=1.0)
    in_time = PushFacts(bytes_needed=100 << 20, next_turn_in_s=5.0, p_move=1.0)
    assert push_key(late, GBIT)[0] > push_key(in_time, GBIT)[0]
    assert sorted([late, in_time], key=lambda f: push_key(f, GBIT)) == [in_time, late]


def test_gate_hands_freed_permits_to_the_best_waiter() -> None:
    """With one permit held, waiters get it in key order (asked when it frees), not in arrival order."""

    async def main() -> list[str]:
        gate = PushGate(1)
        await gate.acquire(lambda: (0.0, 0.0))
        keys = {"first-come": (-0.2, 5.0), "best": (-1.0, 9.0), "middle": (-1.0, 1.0)}
        got: list[str] = []

        async def waiter(name: str) -> None:
            await gate.acquire(lambda: keys[name])
            got.append(name)
            await asyncio.sleep(0.01)
            gate.release()

        tasks = [asyncio.create_task(waiter(n)) for n in keys]
        await asyncio.sleep(0.01)
        assert gate.waiting == 3
        keys["best"] = (-1.0, 0.5)  # facts change while waiting: the key is asked at grant time
        gate.release()
        await asyncio.gather(*tasks)
        return got

    assert asyncio.run(main()) == ["best", "middle", "first-come"]


def test_gate_passes_a_permit_on_when_a_waiter_is_cancelled() -> None:
    """A cancelled waiter never keeps a permit: the next one gets it."""

    async def main() -> bool:
        gate = PushGate(1)
        await gate.acquire(lambda: (0.0, 0.0))
        doomed = asyncio.create_task(gate.acquire(lambda: (-1.0, 0.0)))
        other = asyncio.create_task(gate.acquire(lambda: (0.0, 1.0)))
        await asyncio.sleep(0.01)
        doomed.cancel()
        gate.release()
        await asyncio.wait_for(other, 1.0)
        return doomed.cancelled()

    assert asyncio.run(main())


@pytest.fixture(scope="module")
def serial_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """Nodes a and b whose kv_share moves one push at a time (concurrency 1), a's pushes to b through a proxy."""
    pair = start_pair(tmp_path_factory.mktemp("serial-pair"), kvshare={"concurrency": 1})
    try:
        yield pair
    finally:
        pair.proxy.resume()
        pair.stop()


def test_queued_pushes_start_by_value_not_arrival(serial_pair: Pair) -> None:
    """Real nodes, one push at a time: while a big push holds the link, a session whose turns come quickly goes
    before one queued earlier whose turns are far apart (earliest next turn first)."""
    p = serial_pair
    soon, late = Conversation("order-soon", chars=1500), Conversation("order-late", chars=1500)
    big = Conversation("order-big", chars=6000)
    with p.events("a") as ev_a:
        p.turn("a", late, grow=300)  # one turn: its think time is the node's default guess (seconds)
        for _ in range(4):  # back-to-back turns: its own think time is learned as ~0
            p.turn("a", soon, grow=300)
        wait_for(lambda: len(ev_a.live(ReplicaSent, session=soon.session)) >= 1, "soon's first replica to land")
        # late's first push too, so only the pushes queued below wait behind the big one (a loaded box is slow)
        wait_for(lambda: len(ev_a.live(ReplicaSent, session=late.session)) >= 1, "late's first replica to land")
        p.wait_quiet("a")  # soon's later pushes too: one still going would hold the link instead of the big one
        p.proxy.reset_counts()  # count only the big push's connection below
        p.proxy.pause()
        try:
            p.turn("a", big)
            wait_for(lambda: p.proxy.connections >= 1 and ev_a.live(ReplicaStarted, session=big.session),
                     "the big push to hold the link")
            p.turn("a", late, grow=300)  # queued first...
            p.turn("a", soon, grow=300)  # ...queued second, but its next turn is due sooner
            time.sleep(0.3)  # both are queued behind the big push
        finally:
            p.proxy.resume()
        ev_a.wait_live(ReplicaSent, session=big.session)

        def started_after_big() -> list[str]:
            # The first start of the big push is the one that held the link (a loaded box may retry it later).
            # Counting starts after it, not sends: a session may have had more than one replica land before.
            got = ev_a.received()
            big_at = got.index(ev_a.live(ReplicaStarted, session=big.session)[0])
            return [e.session for e in got[big_at + 1:]
                    if isinstance(e, ReplicaStarted) and e.session in (soon.session, late.session)]

        wait_for(lambda: {soon.session, late.session} <= set(started_after_big()), "both queued pushes to start")
        after = started_after_big()
    assert after[:2] == [soon.session, late.session], after
