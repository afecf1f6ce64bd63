"""What every engine over kvmesh's block bookkeeping shares: what it holds, how blocks leave and enter,
and how a turn is admitted. `Engine` (our runners, llama.cpp, the sim) and `VllmEngine` differ only in
how an admitted turn runs (`run`) and, for vLLM, in what an import does once committed.

Its parts are the engine's: the session table (`sessiontable`), the prefix index (`prefix`), the
transfers (`export_import`), the session locks (`admission`) and the slots (`slots`).
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, Callable, Sequence

import numpy as np

from kvmesh.node.engine.admission import SessionLocks
from kvmesh.node.engine.boundary import (
    Admission,
    ExportedBlock,
    GenerateRequest,
    ImportAPI,
    PinnedBlocks,
    TextDelta,
    TurnBegin,
    TurnDone,
)
from kvmesh.node.engine.export_import import BlockTransfers
from kvmesh.node.engine.hashing import as_tokens
from kvmesh.node.engine.prefix import PrefixIndex
from kvmesh.node.engine.sessiontable import SessionTable
from kvmesh.node.engine.slots import SlotScheduler
from kvmesh.node.errors import ContextLengthExceeded, InvalidRequest


class BlockHolding(ABC):
    """The shared front of an engine: set `table`, `prefix`, `transfers`, `slots`, `_locks` and `max_context`
    when built, and define `run`."""

    table: SessionTable
    prefix: PrefixIndex
    transfers: BlockTransfers
    slots: SlotScheduler
    _locks: SessionLocks
    max_context: int

    @property
    def on_evict(self) -> Callable[[str], None] | None:
        """Called with the session whenever a cache is dropped (the node tells kv_share)."""
        return self.table.on_evict

    @on_evict.setter
    def on_evict(self, hook: Callable[[str], None] | None) -> None:
        self.table.on_evict = hook

    # ---- what the engine holds ------------------------------------------------

    def cached_prefix(self, session: str, token_ids: list[int] | np.ndarray) -> int:
        """How many leading tokens of `token_ids` this engine holds right now."""
        return self.prefix.match(session, as_tokens(token_ids)).tokens

    def resident_tokens(self, session: str) -> int:
        return self.prefix.resident(session)

    def block_hash(self, session: str, i: int) -> bytes | None:
        """The chain hash of the session's i-th full block, if the engine holds that block."""
        seq = self.table.get(session)
        return seq.hashes[i] if seq is not None and 0 <= i < len(seq.hashes) else None

    def session_tokens(self, session: str) -> np.ndarray | None:
        return self.prefix.tokens(session)

    def evict(self, session: str) -> bool:
        """Drop a session's resident cache (its blocks stay addressable until reused)."""
        return self.prefix.evict(session)

    def evict_all(self) -> int:
        """Drop every idle session and forget every unreferenced block: a cold cache."""
        return self.prefix.evict_all()

    # ---- blocks leaving and entering ------------------------------------------

    def export(self, session: str, from_block: int = 0) -> contextlib.AbstractContextManager[list[ExportedBlock]]:
        """The session's full blocks from `from_block`, pinned for as long as the caller reads them."""
        return self.transfers.export(session, from_block)

    def pin(self, session: str) -> PinnedBlocks | None:
        """The session's full blocks pinned for readers on other threads; None when there is none."""
        return self.transfers.pin(session)

    def begin_import(self, session: str, fingerprint: str, tokens: np.ndarray, hashes: list[bytes]) -> ImportAPI:
        """Check a replica's fingerprint and hash chain, then reserve blocks for what is missing."""
        return self.transfers.begin_import(session, fingerprint, tokens, hashes)

    def import_blocks(self, session: str, fingerprint: str, tokens: np.ndarray, hashes: list[bytes],
                      data: list[memoryview | bytes | np.ndarray]) -> int:
        """Import whole blocks (tokens, hashes, KV bytes per block); returns tokens now resident."""
        txn = self.begin_import(session, fingerprint, tokens, hashes)
        try:
            for i in txn.missing:
                txn.write(i, data[i])
            return txn.commit()
        except BaseException:
            txn.abort()
            raise

    # ---- turns ---------------------------------------------------------------

    def validate(self, req: GenerateRequest) -> np.ndarray:
        """The request's prompt as token ids; raises the API's errors for a bad request."""
        tokens = as_tokens(req.prompt)
        if len(tokens) == 0:
            raise InvalidRequest("the prompt is empty", param="messages")
        if len(tokens) >= self.max_context:
            raise ContextLengthExceeded(f"the prompt is {len(tokens)} tokens; this model's context is "
                                        f"{self.max_context} tokens", param="messages")
        if req.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        return tokens

    def slot_preference(self, session: str) -> Sequence[int]:
        """Slots for a turn of `session`, best first (none: any free one)."""
        return ()

    async def admit(self, req: GenerateRequest) -> Admission:
        """Validate the turn, then wait for its session's lock and a slot (node.engine.admission)."""
        tokens = self.validate(req)
        t0 = time.monotonic()
        await self._locks.acquire(req.session)
        try:
            slot = await self.slots.acquire(self.slot_preference(req.session),
                                            prefill_tokens=max(0, len(tokens) - self.resident_tokens(req.session)))
        except BaseException:
            self._locks.release(req.session)
            raise

        def release() -> None:
            self.slots.release(slot)
            self._locks.release(req.session)
        return Admission(req, tokens, slot, t0, release)

    @abstractmethod
    def run(self, adm: Admission) -> AsyncGenerator[TurnBegin | TextDelta | TurnDone, None]:
        """Run an admitted turn: TurnBegin, TextDeltas, then TurnDone; releases the admission at its end."""

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[TurnBegin | TextDelta | TurnDone, None]:
        """Admit and run one turn (benches and tests; the turn path imports a replica in between)."""
        adm = await self.admit(req)
        async with contextlib.aclosing(self.run(adm)) as events:
            async for ev in events:
                yield ev
