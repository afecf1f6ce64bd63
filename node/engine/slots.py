"""Engine slots: N concurrent turns, then a bounded FIFO wait queue with a timeout."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Sequence

from kvmesh.node.errors import Overloaded


class SlotScheduler:
    """Hands out slot indices; a full queue or an expired wait raises `Overloaded` (HTTP 429)."""

    def __init__(self, slots: int, queue_max: int, queue_timeout_s: float):
        self.slots = slots
        self.queue_max = queue_max
        self.queue_timeout_s = queue_timeout_s
        self._free: list[int] = list(range(slots - 1, -1, -1))
        self._waiters: collections.deque[asyncio.Future[int]] = collections.deque()
        self._recent_turn_s: collections.deque[float] = collections.deque(maxlen=32)
        self._started: dict[int, float] = {}
        self._waiting_tokens: dict[asyncio.Future[int], int] = {}  # what each waiter will prefill

    @property
    def busy(self) -> int:
        return self.slots - len(self._free)

    @property
    def queued(self) -> int:
        return sum(1 for w in self._waiters if not w.done())

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens the queued turns will prefill (a queue of long prompts takes longer than its length says)."""
        return sum(n for w, n in self._waiting_tokens.items() if not w.done())

    def has_free_slot(self) -> bool:
        return bool(self._free) and not self.queued

    def mean_turn_s(self) -> float:
        return sum(self._recent_turn_s) / len(self._recent_turn_s) if self._recent_turn_s else 1.0

    def expected_wait_s(self) -> float:
        """Queue position x recent turn time, spread over the slots."""
        if self.has_free_slot():
            return 0.0
        return (self.queued + 1) * self.mean_turn_s() / self.slots

    def can_admit(self) -> bool:
        return self.has_free_slot() or self.queued < self.queue_max

    async def acquire(self, prefer: Sequence[int] = (), *, prefill_tokens: int = 0) -> int:
        """A free slot (the first of `prefer` that is free), else one once freed, in arrival order;
        `prefill_tokens`: what the turn will prefill, counted in `queued_tokens` while it waits."""
        if self.has_free_slot():
            slot = next((s for s in prefer if s in self._free), self._free[-1])
            self._free.remove(slot)
            return self._take(slot)
        if not self.can_admit():
            raise Overloaded(
                f"all {self.slots} slots busy and {self.queued} turns already queued", retry_after_s=self.expected_wait_s()
            )
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._waiting_tokens[fut] = prefill_tokens
        try:
            async with asyncio.timeout(self.queue_timeout_s):  # not wait_for: see node.mesh.statestream
                slot = await asyncio.shield(fut)
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result(), finished=False)  # handed over just as we gave up
            fut.cancel()
            raise Overloaded(
                f"no slot freed within {self.queue_timeout_s:g}s", retry_after_s=self.expected_wait_s()
            ) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release(fut.result(), finished=False)
            fut.cancel()
            raise
        finally:
            del self._waiting_tokens[fut]
        return self._take(slot)

    def _take(self, slot: int) -> int:
        self._started[slot] = time.monotonic()
        return slot

    def release(self, slot: int, *, finished: bool = True) -> None:
        started = self._started.pop(slot, None)
        if finished and started is not None:
            self._recent_turn_s.append(time.monotonic() - started)
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(slot)
                return
        self._free.append(slot)
