"""Which replica push goes next when the link cannot carry them all: the most valuable one.

A push is worth the prefill it saves if the session moves before its next turn
and the replica has landed by then. Recompute saved per byte sent is the same
for every delta (both grow with its tokens), so per second of link a push is
worth `p_move x on_time`: the chance the session's next turn moves (its home
has no free slot), times the part of the transfer that can land before that
turn. Equal values go earliest deadline first, which lands the most replicas in
time on a link that is briefly oversubscribed.

`PushGate` is the asyncio side: at most `permits` pushes move at once, and a
freed permit goes to the waiter with the best key (FIFO among equals), where a
plain semaphore would hand it to the oldest.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PushFacts:
    """What the sender knows of one queued push when it picks the next."""

    bytes_needed: int  # what the target lacks (estimated from what landed there before)
    next_turn_in_s: float  # expected time to the session's next turn, from its own turn history
    p_move: float  # chance that turn cannot run at home (0..1)


def push_key(f: PushFacts, link_bps: float) -> tuple[float, float]:
    """Sort key, lowest first: (-value per link-second, deadline)."""
    send_s = 8 * f.bytes_needed / max(link_bps, 1.0)
    deadline = max(0.0, f.next_turn_in_s)
    on_time = 1.0 if send_s <= deadline else deadline / send_s
    return (-round(f.p_move * on_time, 6), deadline)


class PushGate:
    """At most `permits` holders at once; each freed permit goes to the waiter whose `key()` is
    lowest when the permit frees (keys are asked then, so they see the latest facts)."""

    def __init__(self, permits: int):
        self._free = permits
        self._waiters: dict[int, tuple[Callable[[], tuple[float, float]], asyncio.Future[None]]] = {}
        self._order = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, key: Callable[[], tuple[float, float]]) -> None:
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        n = next(self._order)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[n] = (key, fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.release()  # granted and cancelled at once: pass the permit on
            raise
        finally:
            self._waiters.pop(n, None)

    def release(self) -> None:
        self._free += 1
        self._grant()

    def _grant(self) -> None:
        while self._free > 0:
            live = [(key(), n, fut) for n, (key, fut) in self._waiters.items() if not fut.done()]
            if not live:
                return
            _, n, fut = min(live, key=lambda x: (x[0], x[1]))
            del self._waiters[n]
            self._free -= 1
            fut.set_result(None)
