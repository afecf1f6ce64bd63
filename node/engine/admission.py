"""Admission: a turn holds its session's lock, then a slot, before it touches the cache (an `Admission`).

The lock comes first, so a turn waiting for its session's previous turn holds no slot another
could use. Between `Engine.admit` and `Engine.run` the turn path may bring the cache up to date
(kv_share imports a stored replica there): nothing can evict it in between, and nothing else
of the session runs.
"""

from __future__ import annotations

import asyncio


class SessionLocks:
    """One turn per session at a time; a session's lock lives while anyone holds or awaits it."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        """Sessions whose lock someone holds or awaits."""
        return len(self._locks)

    async def acquire(self, session: str) -> None:
        lock, users = self._locks.get(session, (asyncio.Lock(), 0))
        self._locks[session] = (lock, users + 1)
        try:
            await lock.acquire()
        except BaseException:
            self._leave(session)
            raise

    def release(self, session: str) -> None:
        self._locks[session][0].release()
        self._leave(session)

    def _leave(self, session: str) -> None:
        lock, users = self._locks[session]
        if users == 1:
            del self._locks[session]
        else:
            self._locks[session] = (lock, users - 1)
