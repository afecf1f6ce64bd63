"""SlotScheduler: N slots, a bounded FIFO wait queue, Overloaded on a full queue or a timeout."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.node.engine.slots import SlotScheduler
from kvmesh.node.errors import Overloaded


async def _settle() -> None:
    """Let every ready task run until it blocks."""
    for _ in range(5):
        await asyncio.sleep(0)


def test_free_slots_are_handed_out_without_waiting() -> None:
    """With N slots, N acquires succeed at once with distinct slot ids."""

    async def go() -> None:
        s = SlotScheduler(3, queue_max=0, queue_timeout_s=1.0)
        got = [await s.acquire() for _ in range(3)]
        assert sorted(got) == [0, 1, 2]
        assert s.busy == 3 and not s.has_free_slot()
        s.release(got[1])
        assert s.busy == 2 and s.has_free_slot()
        assert s.expected_wait_s() == 0.0

    asyncio.run(go())


def test_full_queue_raises_overloaded_immediately() -> None:
    """1 slot, queue_max 1: the third concurrent acquire raises Overloaded without waiting."""

    async def go() -> None:
        s = SlotScheduler(1, queue_max=1, queue_timeout_s=30.0)
        await s.acquire()
        waiter = asyncio.create_task(s.acquire())
        await _settle()
        assert s.queued == 1 and not waiter.done()
        assert not s.can_admit()
        with pytest.raises(Overloaded) as ei:
            await asyncio.wait_for(s.acquire(), 1.0)  # would hit the 30 s queue timeout if it queued
        assert ei.value.status == 429
        assert ei.value.retry_after_s >= 0
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(go())


def test_waiter_times_out_with_overloaded() -> None:
    """A queued acquire raises Overloaded after queue_timeout_s and leaves the queue."""

    async def go() -> None:
        s = SlotScheduler(1, queue_max=4, queue_timeout_s=0.05)
        slot = await s.acquire()
        with pytest.raises(Overloaded):
            await s.acquire()
        assert s.queued == 0
        # The slot goes back to the free list, not to the expired waiter.
        s.release(slot)
        assert s.has_free_slot() and s.busy == 0
        assert await s.acquire() == slot

    asyncio.run(go())


def test_release_hands_slot_to_first_waiter() -> None:
    """Release wakes waiters in FIFO order; each gets the released slot."""

    async def go() -> None:
        s = SlotScheduler(1, queue_max=3, queue_timeout_s=5.0)
        slot = await s.acquire()
        order: list[str] = []

        async def wait(name: str) -> int:
            got = await s.acquire()
            order.append(name)
            return got

        tasks = []
        for name in ("w1", "w2", "w3"):
            tasks.append(asyncio.create_task(wait(name)))
            await _settle()  # enqueue in a known order
        assert s.queued == 3
        s.release(slot)
        await _settle()
        assert order == ["w1"] and tasks[0].result() == slot
        assert s.queued == 2 and not s.has_free_slot()
        s.release(slot)
        await _settle()
        assert order == ["w1", "w2"]
        s.release(slot)
        await _settle()
        assert order == ["w1", "w2", "w3"]
        s.release(slot)
        assert s.busy == 0

    asyncio.run(go())


def test_free_slot_is_not_taken_past_queued_waiters() -> None:
    """While anyone is queued, has_free_slot is False so a newcomer cannot jump the queue."""

    async def go() -> None:
        s = SlotScheduler(1, queue_max=2, queue_timeout_s=5.0)
        slot = await s.acquire()
        first = asyncio.create_task(s.acquire())
        await _settle()
        s.release(slot)  # handed to `first`, which has not run yet
        late = asyncio.create_task(s.acquire())
        await _settle()
        assert first.done() and first.result() == slot
        assert not late.done()
        s.release(slot)
        await _settle()
        assert late.result() == slot

    asyncio.run(go())


def test_cancelled_waiter_gives_up_its_place() -> None:
    """A cancelled waiter does not swallow the next released slot."""

    async def go() -> None:
        s = SlotScheduler(1, queue_max=2, queue_timeout_s=5.0)
        slot = await s.acquire()
        gone = asyncio.create_task(s.acquire())
        await _settle()
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert s.queued == 0
        s.release(slot)
        assert s.busy == 0 and s.has_free_slot()

    asyncio.run(go())


def test_expected_wait_grows_with_queue() -> None:
    """With no free slot the expected wait is positive and grows with the queue length."""

    async def go() -> None:
        s = SlotScheduler(1, queue_max=4, queue_timeout_s=5.0)
        await s.acquire()
        w0 = s.expected_wait_s()
        t = asyncio.create_task(s.acquire())
        await _settle()
        assert 0 < w0 < s.expected_wait_s()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(go())


def test_queued_tokens_count_what_waiting_turns_will_prefill() -> None:
    """Turns waiting for a slot count their prefill in queued_tokens until they get one, or give up."""

    async def go() -> None:
        s = SlotScheduler(1, queue_max=4, queue_timeout_s=0.2)
        first = await s.acquire(prefill_tokens=999)  # running, not queued
        a = asyncio.create_task(s.acquire(prefill_tokens=30_000))
        b = asyncio.create_task(s.acquire(prefill_tokens=500))
        await _settle()
        assert s.queued == 2 and s.queued_tokens == 30_500
        s.release(first)
        assert await a == first
        await _settle()
        assert s.queued_tokens == 500
        with pytest.raises(Overloaded):
            await b  # timed out
        assert s.queued_tokens == 0

    asyncio.run(go())
