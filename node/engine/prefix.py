"""The prefix index: what of a prompt an engine holds, and how a finished turn's cache is kept.

Two strategies behind one interface, chosen once when the engine is built:
- `BlockPrefix`: the cache is cut into blocks with chained hashes (any session's blocks serve any
  prompt they prefix); a turn's KV is committed as the session's block table;
- `LivePrefix` (node.engine.live): a model whose cache cannot be cut into blocks reuses only what
  its slot still holds.
The engine asks the index and never branches on which one it has.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from kvmesh.node.engine.blocks import BlockManager
from kvmesh.node.engine.hashing import block_hashes
from kvmesh.node.engine.runner import Runner, blocks_for
from kvmesh.node.engine.sequence import Match, Sequence
from kvmesh.node.engine.sessiontable import SessionTable


class Resumable(Protocol):
    """Where a model with window or recurrent state can resume (node.engine.snapshots)."""

    def usable(self, tokens: np.ndarray, n: int) -> int: ...


class OwnCells(Protocol):
    """A slot's own cells past a session's last full block, kept token by token where exact (node.engine.live)."""

    def reuse(self, session: str, slot: int | None, tokens: np.ndarray, floor: int) -> int:
        """Leading tokens of `tokens` the session's slot (`slot`, else the one holding it) serves; >= `floor`."""


class PrefixIndex(Protocol):
    """What the engine asks of its cache, whatever its strategy."""

    def match(self, session: str, tokens: np.ndarray, slot: int | None = None) -> Match:
        """Longest resident prefix of `tokens` a turn of `session` (on `slot`, if given) reuses. No side effects."""

    def resident(self, session: str) -> int: ...

    def tokens(self, session: str) -> np.ndarray | None:
        """The tokens of the session's resident cache (a copy the caller may keep), or None."""

    def slot_taken(self, overwritten: str) -> None:
        """A turn took the slot that held `overwritten`'s cache."""

    async def commit(self, slot: int, session: str, kv_tokens: np.ndarray, match: Match, reuse: int,
                     pinned: list[int]) -> None:
        """Keep the turn's KV as the session's cache; owns `pinned` (the reused blocks' pins) from the call on."""

    def evict(self, session: str) -> bool:
        """Drop an idle session's resident cache; False when it has none or a turn of it runs."""

    def evict_all(self) -> int:
        """Drop every idle session's cache and forget what nobody holds: a cold cache. Returns sessions dropped."""


class BlockPrefix:
    """Blocks by chained hash, then the session's own last block token by token (from its block table, or
    from the cells its slot still holds)."""

    def __init__(self, table: SessionTable, runner: Runner, seed_hash: bytes, *, resumable: Resumable | None,
                 tail_reused: bool, own: OwnCells | None = None):
        """`resumable`: a model that resumes only at a snapshot (window or recurrent state), else None;
        `tail_reused`: a prompt may reuse part of the session's next block, not only whole ones, from the block
        table; `own`: from the cells the session's slot holds, where they compute what whole blocks would."""
        self.table, self.runner, self.seed_hash = table, runner, seed_hash
        self.blocks: BlockManager = table.blocks
        self.block_size = table.blocks.block_size
        self.resumable, self.tail_reused, self.own = resumable, tail_reused, own

    def match(self, session: str, tokens: np.ndarray, slot: int | None = None) -> Match:
        bs = self.block_size
        hashes = block_hashes(self.seed_hash, tokens, bs)
        seq = self.table.get(session)
        ids: list[int] = []
        for i, h in enumerate(hashes):
            if seq is not None and i < len(seq.hashes) and seq.hashes[i] == h:
                ids.append(seq.block_ids[i])
                continue
            bid = self.blocks.lookup(h, tokens[i * bs : (i + 1) * bs])
            if bid is None:
                break
            ids.append(bid)
        if self.resumable is not None:  # such a model resumes only at a snapshot (node.engine.snapshots)
            ids = ids[: self.resumable.usable(tokens, len(ids) * bs) // bs]
        full = len(ids)
        n = full * bs
        # Same prefix as the session's own sequence up to here (the chain hash says so):
        # the session's next block may still match part-way (its unhashed tail, or a
        # full block the prompt only partly repeats).
        same_prefix = seq is not None and (full == 0 or (full <= len(seq.hashes) and seq.hashes[full - 1] == hashes[full - 1]))
        if self.tail_reused and seq is not None and same_prefix and full < len(seq.block_ids) and n < len(tokens):
            theirs = seq.tokens[n : n + bs]
            ours = tokens[n : n + len(theirs)]
            diff = np.flatnonzero(theirs[: len(ours)] != ours)
            m = int(diff[0]) if len(diff) else min(len(theirs), len(ours))
            if m:
                ids.append(seq.block_ids[full])
                n += m
        elif self.own is not None and n < len(tokens):
            n = self.own.reuse(session, slot, tokens, n)  # the slot keeps them: no block of them is loaded
        return Match(tokens=n, block_ids=ids, full_blocks=full, hashes=hashes)

    def resident(self, session: str) -> int:
        seq = self.table.get(session)
        return seq.num_tokens if seq else 0

    def tokens(self, session: str) -> np.ndarray | None:
        seq = self.table.get(session)
        return None if seq is None else seq.tokens

    def slot_taken(self, overwritten: str) -> None:
        pass  # its blocks are in the pool, not in the slot

    async def commit(self, slot: int, session: str, kv_tokens: np.ndarray, match: Match, reuse: int,
                     pinned: list[int]) -> None:
        """Store the turn's KV as the session's block table; reuse whole blocks, dedupe by hash.

        Bookkeeping changes only after every new block is written, so a cancelled or failed
        commit leaves the previous table as it was."""
        bs, bm = self.block_size, self.blocks
        keep = reuse // bs  # leading blocks reused whole: their pins become the new table's refs
        table = list(pinned[:keep])
        bm.release(pinned[keep:])
        hashes = list(match.hashes[:keep])
        prev = hashes[-1] if hashes else None
        hashes += block_hashes(self.seed_hash, kv_tokens, bs, start=keep, prev=prev)
        fresh: list[tuple[int, int]] = []  # (block index, new block id) still to be written
        try:
            for j in range(keep, blocks_for(len(kv_tokens), bs)):
                h = hashes[j] if j < len(hashes) else None
                if h is not None and (bid := bm.lookup(h, kv_tokens[j * bs : (j + 1) * bs])) is not None:
                    bm.acquire(bid)
                elif self.table.make_room(1, spare=session):
                    bid = bm.allocate(1)[0]
                    fresh.append((j, bid))
                else:
                    break  # the pool is full of running turns: keep the prefix that fits
                table.append(bid)
            for j, bid in fresh:
                await self.runner.store(slot, bid, j, hashes[j] if j < len(hashes) else None)
        except BaseException:
            bm.release(table)
            raise
        for j, bid in fresh:
            if j < len(hashes):
                bm.register(bid, hashes[j], kv_tokens[j * bs : (j + 1) * bs])
        stored = min(len(kv_tokens), len(table) * bs)
        self.table.install(Sequence(session, kv_tokens[:stored].copy(), table, hashes[: stored // bs]))

    def evict(self, session: str) -> bool:
        seq = self.table.get(session)
        if seq is None or seq.busy:
            return False
        self.table.drop(session)
        self.table.counters.evicted_sessions += 1
        return True

    def evict_all(self) -> int:
        idle = self.table.idle()
        for s in idle:
            self.table.drop(s)
        self.blocks.forget_all()
        self.table.counters.evicted_sessions += len(idle)
        return len(idle)
