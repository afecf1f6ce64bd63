"""KV blocks leaving and entering an engine: exported views, pins, and the import transaction.

`Engine.export` hands out `ExportedBlock`s, `Engine.pin` a `PinnedBlocks` for another thread
to read, and `Engine.begin_import` an `ImportTxn` (kv_share's `ImportAPI`). The transaction
needs only the engine's bookkeeping, named by `ImportHost`, so this module imports nothing of
`node.engine.engine` (which imports it).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvmesh.node.engine.blocks import BlockManager, BlockPool
from kvmesh.node.engine.sequence import Sequence
from kvmesh.node.engine.turns import EngineCounters
from kvmesh.node.errors import ImportRefused


@dataclass(frozen=True)
class ExportedBlock:
    index: int
    hash: bytes
    tokens: np.ndarray  # [block_size] int32
    data: memoryview  # the block's KV bytes (zero-copy on CPU)


@dataclass
class PinnedBlocks:
    """A session's full blocks, pinned in the pool; a thread other than the pinning one may read
    their bytes. `release` (idempotent) unpins them once no thread reads them any more."""

    ids: list[int]
    hashes: list[bytes]
    tokens: np.ndarray  # [len(ids) * block_size] the pinned blocks' token ids
    read: Callable[[int], memoryview]  # a block's bytes by id (a host copy when the pool is on an accelerator)
    _release: Callable[[list[int]], None]
    _released: bool = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release(self.ids)


class ImportHost(Protocol):
    """What an import uses of the engine it lands in (`Engine` is one): its block bookkeeping,
    its session table and its own LRU eviction."""

    blocks: BlockManager
    pool: BlockPool
    block_size: int
    block_bytes: int
    counters: EngineCounters
    sessions: collections.OrderedDict[str, Sequence]

    def _make_room(self, n: int, *, spare: str | None = None) -> bool: ...

    def cached_prefix(self, session: str, token_ids: list[int] | np.ndarray) -> int: ...


class ImportTxn:
    """A replica import in progress: blocks reserved, bytes landing, hashes advertised on commit."""

    def __init__(self, engine: ImportHost, session: str, tokens: np.ndarray, hashes: list[bytes]):
        self.engine, self.session, self.tokens, self.hashes = engine, session, tokens, hashes
        bm, bs = engine.blocks, engine.block_size
        self.block_ids: list[int] = []
        self.missing: list[int] = []
        for i, h in enumerate(hashes):
            bid = bm.lookup(h, tokens[i * bs : (i + 1) * bs])
            if bid is None:
                break
            bm.acquire(bid)
            self.block_ids.append(bid)
        need = len(hashes) - len(self.block_ids)
        if need and not engine._make_room(need):
            bm.release(self.block_ids)
            engine.counters.imports_refused += 1
            raise ImportRefused(f"no room for {need} blocks: {bm.num_free} free, every other block held by a running turn "
                                f"or pinned by a replica push reading it", reason="no_room")
        start = len(self.block_ids)
        self.block_ids += bm.allocate(need)
        self.missing = list(range(start, len(hashes)))
        self._done = False

    def buffer(self, i: int) -> memoryview:
        """Writable bytes of block i (CPU pools): receive straight into the pool."""
        return self.engine.pool.bytes_view(self.block_ids[i])

    def write(self, i: int, data: memoryview | bytes | np.ndarray) -> None:
        size = data.nbytes if isinstance(data, np.ndarray) else memoryview(data).nbytes
        if size != self.engine.block_bytes:
            raise ImportRefused(f"block {i} is {size} bytes; this engine's blocks are {self.engine.block_bytes}", reason="size")
        self.engine.pool.write_bytes(self.block_ids[i], data)

    def commit(self, upto: int | None = None) -> int:
        """Advertise the written blocks and make them the session's table; returns its tokens."""
        e, bs = self.engine, self.engine.block_size
        n = len(self.hashes) if upto is None else upto
        for i in self.missing:
            if i < n:
                e.blocks.register(self.block_ids[i], self.hashes[i], self.tokens[i * bs : (i + 1) * bs])
        e.blocks.release(self.block_ids[n:])
        ids = self.block_ids[:n]
        self._done = True
        e.counters.imported_blocks += len([i for i in self.missing if i < n])
        cur = e.sessions.get(self.session)
        if cur is not None and (cur.busy or (cur.num_tokens >= n * bs and cur.hashes[: n] == self.hashes[:n])):
            # A running turn or a longer copy of the same prefix wins; ours stay cached by hash.
            e.blocks.release(ids)
            return e.cached_prefix(self.session, self.tokens[: n * bs])
        if cur is not None:  # replaced, not evicted
            e.blocks.release(e.sessions.pop(self.session).block_ids)
        e.sessions[self.session] = Sequence(self.session, self.tokens[: n * bs].copy(), ids, self.hashes[:n])
        return n * bs

    def abort(self) -> None:
        """Nothing of this import becomes visible: reserved blocks go back unregistered."""
        if not self._done:
            self.engine.blocks.release(self.block_ids)
            self._done = True
