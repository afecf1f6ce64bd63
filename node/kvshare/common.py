"""What every kv_share part shares: awaiting a worker thread from the event loop without freeing what
it still uses, and the capped maps that bound what kv_share remembers per session."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
K = TypeVar("K")

MAX_UNUSED_TRACKED = 10_000  # sessions whose received replica bytes wait to be used (or counted wasted)
MAX_EXPLAINED = 10_000  # sessions whose last refusal, eviction or pre-turn state is kept to explain a handoff


def _remember(d: dict[K, T], key: K, value: T, cap: int = MAX_EXPLAINED) -> None:
    """Keep the latest `value` for `key`, forgetting the least recently set keys beyond `cap`."""
    d.pop(key, None)
    d[key] = value
    while len(d) > cap:
        d.pop(next(iter(d)))


async def _await_worker(fut: asyncio.Future[T], *, stop: Callable[[], None], release: Callable[[], None]) -> T:
    """Await a worker thread's result. When the awaiting task is cancelled, the worker cannot be:
    `stop` asks it to end early, and `release` (freeing what the worker uses: pool blocks,
    pins) runs on the loop only once it has returned. Other outcomes are the caller's to clean up."""
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        stop()

        def after(f: asyncio.Future[T]) -> None:
            if not f.cancelled():
                f.exception()  # retrieved: the cancelled caller no longer wants it
            release()

        fut.add_done_callback(after)
        raise
