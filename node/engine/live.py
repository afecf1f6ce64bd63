"""Live caches: how an engine reuses KV for a model whose cache cannot be cut into blocks.

A model whose llama.cpp sequence state kvmesh cannot read (a layout newer than its parser,
`llamastate.learn`) cannot be cut into blocks. It is served without blocks and without replicas:
a session's cache is what the slot that ran it last still holds, and a turn reuses it only if its
prompt extends every token of it. (Models with recurrent state, hybrid or not, keep blocks and
snapshots of it: node.engine.snapshots.) The truth is the runner's own record of
what each slot's sequence holds (`held`), asked each time, never a copy kept here; this class only
remembers which session wrote each slot last.

`LivePrefix` is such an engine's prefix index (node.engine.prefix). Every llama.cpp engine also uses
`LiveCaches` to choose a turn's slot (`preference`): the one still holding
the session, so a block model's turn skips restoring from the pool too. A block model's turn also keeps
its slot's cells past the session's last full block, token by token, where that is exact (`OwnTail`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Callable
from typing import Protocol

import numpy as np

from kvmesh.node.engine.deferred import Deferred
from kvmesh.node.engine.sequence import Match
from kvmesh.node.engine.sessiontable import SessionTable
from kvmesh.node.engine.tailshapes import Shapes

log = logging.getLogger("kvmesh.engine")

# Seconds a slot sits idle after a turn before its last partial block is settled: a client answering at once (no
# tool time, a benchmark) sends its next turn within milliseconds; one thinking or running a tool leaves seconds.
SETTLE_AFTER_S = 0.2


class LiveCaches:
    """Which session's cache each slot holds now, and what a turn of it may reuse."""

    def __init__(self, slots: int, held: Callable[[int], np.ndarray]):
        self.slots = slots
        self._held = held  # the tokens slot i's sequence holds now (the runner's record)
        self._owner: dict[int, str] = {}  # slot -> the session whose turn wrote it last, least recent first

    def slot_of(self, session: str) -> int | None:
        return next((slot for slot, s in self._owner.items() if s == session), None)

    def preference(self, session: str) -> list[int]:
        """Slots for a turn of `session`, best first: its own, then slots nobody's cache is in, then the
        least recently written (whose cache is the least likely to be asked for again)."""
        own = self.slot_of(session)
        return [*([own] if own is not None else []), *(i for i in range(self.slots) if i not in self._owner),
                *(i for i in self._owner if i != own)]

    def tokens(self, session: str) -> np.ndarray | None:
        slot = self.slot_of(session)
        return None if slot is None else self._held(slot)

    def resident(self, session: str) -> int:
        toks = self.tokens(session)
        return 0 if toks is None else len(toks)

    def cached_prefix(self, session: str, tokens: np.ndarray) -> int:
        """Tokens of `tokens` a turn of `session` would reuse: all the slot holds, if the prompt extends it."""
        held = self.tokens(session)
        if held is None or not 0 < len(held) < len(tokens) or not np.array_equal(tokens[: len(held)], held):
            return 0
        return len(held)

    def owns(self, slot: int, session: str) -> bool:
        return self._owner.get(slot) == session

    def reusable(self, session: str, slot: int, tokens: np.ndarray) -> int:
        """What a turn of `session` on `slot` reuses: the session's cache only if it is on this slot."""
        return self.cached_prefix(session, tokens) if self._owner.get(slot) == session else 0

    def take(self, slot: int, session: str) -> str | None:
        """A turn of `session` starts on `slot`: its sequence changes from now on. Returns the other session
        whose cache it held, now nobody's; the slot is `session`'s again only once the turn ends well (`wrote`)."""
        owner = self._owner.get(slot)
        if owner is None or owner == session:
            return None
        del self._owner[slot]
        return owner

    def wrote(self, slot: int, session: str) -> None:
        """A turn of `session` ended well on `slot`: the slot holds its cache (the most recent)."""
        self._owner.pop(slot, None)
        self._owner[slot] = session

    def drop(self, session: str) -> bool:
        """Forget the session's cache (its slot's tokens are recomputed on its next turn)."""
        slot = self.slot_of(session)
        if slot is None:
            return False
        del self._owner[slot]
        return True

    def sessions(self) -> list[str]:
        return list(self._owner.values())


class LivePrefix:
    """The prefix index of a model without blocks: a session reuses what its slot still holds, nothing else."""

    def __init__(self, live: LiveCaches, table: SessionTable):
        """`table` stays empty (no block is ever cut); it is where a dropped cache is reported (`on_evict`)."""
        self.live, self.table = live, table

    def match(self, session: str, tokens: np.ndarray, slot: int | None = None) -> Match:
        n = self.live.cached_prefix(session, tokens) if slot is None else self.live.reusable(session, slot, tokens)
        return Match(tokens=n, block_ids=[], full_blocks=0, hashes=[])

    def resident(self, session: str) -> int:
        return self.live.resident(session)

    def tokens(self, session: str) -> np.ndarray | None:
        return None if (t := self.live.tokens(session)) is None else t.copy()

    def slot_taken(self, overwritten: str) -> None:
        self.table.drop(overwritten)  # its cache was only that slot's sequence
        self.table.counters.evicted_sessions += 1

    async def commit(self, slot: int, session: str, kv_tokens: np.ndarray, match: Match, reuse: int,
                     pinned: list[int]) -> None:
        pass  # the slot holds the turn's cache; nothing is cut into blocks (`pinned` is empty: no block matched)

    def evict(self, session: str) -> bool:
        if not self.live.drop(session):
            return False
        self.table.drop(session)
        self.table.counters.evicted_sessions += 1
        return True

    def evict_all(self) -> int:
        return sum(self.evict(s) for s in self.live.sessions())


class TailRunner(Protocol):
    """What `OwnTail` uses of a llama.cpp runner (node.engine.llamacpp)."""

    shapes: Shapes

    def held_tokens(self, slot: int) -> np.ndarray: ...

    def held_kinds(self, slot: int) -> np.ndarray: ...

    def settle(self, slot: int, n: int, floor: int) -> concurrent.futures.Future[int]: ...

    def idle(self) -> bool: ...


class OwnTail:
    """A block model's turn keeps the cells its session's slot holds past the last full block, token by token,
    where that computes what a host holding the whole blocks computes (node.engine.tailshapes); each turn's end
    settles its last partial block for the next, on the compute thread, once the slot has sat `SETTLE_AFTER_S` and the
    compute thread is idle (node.engine.deferred: a next turn that comes first recomputes those cells in its own
    prefill instead, as a host holding only the blocks would)."""

    def __init__(self, live: LiveCaches, runner: TailRunner, counted: Callable[[int], None]):
        """`counted`: told the cells each settle recomputed (on the event loop)."""
        self.live, self.runner, self.counted = live, runner, counted
        self._settling: dict[int, Deferred[int]] = {}  # slot -> its settle, until it ends

    def reuse(self, session: str, slot: int | None, tokens: np.ndarray, floor: int) -> int:
        own = self.live.slot_of(session) if slot is None else slot
        if own is None or not self.live.owns(own, session):
            return floor
        held, kinds = self.runner.held_tokens(own), self.runner.held_kinds(own)
        n = min(len(held), len(tokens), len(kinds))
        diff = np.flatnonzero(held[:n] != tokens[:n])
        common = int(diff[0]) if len(diff) else n
        return self.runner.shapes.reuse(kinds, common, floor, len(tokens))

    def settle(self, slot: int, n: int, floor: int) -> None:
        """Settle the slot's `n` committed tokens (its turn kept blocks to `floor`) unless its next turn comes first."""
        loop = asyncio.get_running_loop()
        job = Deferred(SETTLE_AFTER_S, lambda: self.runner.settle(slot, n, floor), when=self.runner.idle)
        self._settling[slot] = job

        def ended(f: concurrent.futures.Future[int]) -> None:  # on the event loop
            if self._settling.get(slot) is job:
                del self._settling[slot]
            if f.cancelled():
                return
            if (e := f.exception()) is not None:  # the runner erased the slot: its next turn recomputes
                log.warning("slot %d: settling its last block failed: %s", slot, e)
            else:
                self.counted(f.result())

        def back_on_loop(f: concurrent.futures.Future[int]) -> None:
            try:
                loop.call_soon_threadsafe(ended, f)
            except RuntimeError:  # that turn's loop has closed: nobody reads the counters there
                pass
        job.done.add_done_callback(back_on_loop)

    async def take(self, slot: int) -> None:
        """A turn starts on the slot: a settle not yet started is dropped (the reply's cells stay of a kind no
        turn keeps, so this turn recomputes them, as a host holding only blocks would); one running is waited for."""
        if (job := self._settling.get(slot)) is not None and not job.cancel():
            await self.ready(slot)

    async def ready(self, slot: int) -> None:
        """Wait until the slot's settle, if one is due, has ended (however it ended)."""
        if (job := self._settling.get(slot)) is not None:
            await asyncio.wait([asyncio.wrap_future(job.done)])
