"""Replica pushes go by value when the link cannot carry them all: the key, and the gate that applies it."""

from __future__ import annotations

import asyncio

from kvmesh.node.kvshare.pushorder import PushFacts, PushGate, push_key

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
