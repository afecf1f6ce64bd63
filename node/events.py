"""In-process event hub: publish protocol events, keep a replay ring, fan out to subscribers.

kvshare and mesh publish here; the API serves it over websockets. A slow
subscriber never stalls the node: its bounded queue overflows and it is cut
off (the websocket closes; the consumer reconnects and rebuilds from a snapshot).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable

from kvmesh.node.protocol import Event


class Subscription:
    def __init__(self, hub: EventHub, maxsize: int):
        self.hub = hub
        self.queue: asyncio.Queue[Event | None] = asyncio.Queue(maxsize)
        self.overflowed = False

    def _offer(self, ev: Event) -> None:
        if self.overflowed:
            return
        try:
            self.queue.put_nowait(ev)
        except asyncio.QueueFull:
            self.overflowed = True  # cut off; the consumer's next get() sees None
            self.queue = asyncio.Queue(1)
            self.queue.put_nowait(None)

    async def get(self) -> Event | None:
        """The next event, or None once this subscriber fell too far behind."""
        return await self.queue.get()

    def close(self) -> None:
        self.hub._subs.discard(self)


class EventHub:
    def __init__(self, node: str, ring: int = 2000, clock: Callable[[], float] = time.time):
        self.node = node
        self._seq = itertools.count(1)
        self.ring: collections.deque[Event] = collections.deque(maxlen=ring)
        self._subs: set[Subscription] = set()
        self._clock = clock
        self._listeners: list[Callable[[Event], None]] = []
        self.epoch = clock()
        self.last_seq = 0

    def publish(self, ev: Event) -> Event:
        """Stamp (node, seq, ts) and deliver; never blocks."""
        self.last_seq = next(self._seq)
        ev = ev.model_copy(update={"node": self.node, "epoch": self.epoch, "seq": self.last_seq,
                                   "ts": ev.ts or self._clock()})
        if ev.type != "host_status":  # periodic status is coalesced: only the latest matters, not the history
            self.ring.append(ev)
        for sub in list(self._subs):
            sub._offer(ev)
        for fn in self._listeners:
            fn(ev)
        return ev

    def stamp(self, ev: Event) -> Event:
        """Stamp a per-consumer snapshot without publishing it (it is not history): its seq is
        the last event it already reflects, so a consumer knows which replayed events are newer."""
        return ev.model_copy(update={"node": self.node, "epoch": self.epoch, "seq": self.last_seq, "ts": self._clock()})

    def on_publish(self, fn: Callable[[Event], None]) -> None:
        """In-process listener (metrics, counters): called synchronously for every event."""
        self._listeners.append(fn)

    def subscribe(self, maxsize: int = 1000) -> tuple[Subscription, list[Event]]:
        """A live subscription plus the replay ring as of now (no gap, no overlap)."""
        sub = Subscription(self, maxsize)
        self._subs.add(sub)
        replay = [e.model_copy(update={"replay": True}) for e in self.ring]
        return sub, replay

    @property
    def subscribers(self) -> int:
        return len(self._subs)
