"""KV blocks leaving and entering an engine: exported views, pins, and the import transaction.

`BlockTransfers` (the engine's `export`, `pin` and `begin_import`) hands out `ExportedBlock`s, a
`PinnedBlocks` for another thread to read, and an `ImportTxn` (kv_share's `ImportAPI`). Both work
on the engine's session table (node.engine.sessiontable), the one place a block table is installed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol

import numpy as np

from kvmesh.node.engine.blocks import BlockPool
from kvmesh.node.engine.boundary import ExportedBlock, PinnedBlocks
from kvmesh.node.engine.hashing import as_tokens, block_hashes
from kvmesh.node.engine.sequence import Sequence
from kvmesh.node.engine.sessiontable import SessionTable
from kvmesh.node.errors import ImportRefused


class ImportHost(Protocol):
    """What an import uses of the engine it lands in (`BlockTransfers` is one): its session table (with
    its block bookkeeping and LRU eviction), its pool, and what it holds of a prompt now."""

    table: SessionTable
    pool: BlockPool
    block_size: int
    block_bytes: int

    def cached_prefix(self, session: str, tokens: np.ndarray) -> int: ...


class ImportTxn:
    """A replica import in progress: blocks reserved, bytes landing, hashes advertised on commit."""

    def __init__(self, engine: ImportHost, session: str, tokens: np.ndarray, hashes: list[bytes]):
        self.engine, self.session, self.tokens, self.hashes = engine, session, tokens, hashes
        bm, bs = engine.table.blocks, engine.block_size
        self.block_ids: list[int] = []
        self.missing: list[int] = []
        for i, h in enumerate(hashes):
            bid = bm.lookup(h, tokens[i * bs : (i + 1) * bs])
            if bid is None:
                break
            bm.acquire(bid)
            self.block_ids.append(bid)
        need = len(hashes) - len(self.block_ids)
        if need and not engine.table.make_room(need):
            bm.release(self.block_ids)
            engine.table.counters.imports_refused += 1
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
        bm, n = e.table.blocks, len(self.hashes) if upto is None else upto
        for i in self.missing:
            if i < n:
                bm.register(self.block_ids[i], self.hashes[i], self.tokens[i * bs : (i + 1) * bs])
        bm.release(self.block_ids[n:])
        ids = self.block_ids[:n]
        self._done = True
        e.table.counters.imported_blocks += len([i for i in self.missing if i < n])
        cur = e.table.get(self.session)
        if cur is not None and (cur.busy or (cur.num_tokens >= n * bs and cur.hashes[: n] == self.hashes[:n])):
            # A running turn or a longer copy of the same prefix wins; ours stay cached by hash.
            bm.release(ids)
            return e.cached_prefix(self.session, self.tokens[: n * bs])
        e.table.install(Sequence(self.session, self.tokens[: n * bs].copy(), ids, self.hashes[:n]))
        return n * bs

    def abort(self) -> None:
        """Nothing of this import becomes visible: reserved blocks go back unregistered."""
        if not self._done:
            self.engine.table.blocks.release(self.block_ids)
            self._done = True


class BlockTransfers:
    """An engine's blocks leaving (exports, pins) and entering (imports), over its session table."""

    def __init__(self, table: SessionTable, pool: BlockPool, *, seed_hash: bytes, fingerprint: str,
                 cached_prefix: Callable[[str, np.ndarray], int], inexact_reason: str | None):
        """`cached_prefix` is the engine's own answer (its prefix index); `inexact_reason` why this
        engine keeps no blocks, so every import is refused (None: it keeps them)."""
        self.table, self.pool, self.seed_hash, self.fingerprint = table, pool, seed_hash, fingerprint
        self.block_size, self.block_bytes = table.blocks.block_size, pool.block_bytes
        self.cached_prefix, self.inexact_reason = cached_prefix, inexact_reason

    @contextlib.contextmanager
    def export(self, session: str, from_block: int = 0) -> Iterator[list[ExportedBlock]]:
        """The session's full blocks from `from_block`, pinned for as long as the caller reads them."""
        seq, bm = self.table.get(session), self.table.blocks
        if seq is None:
            yield []
            return
        bs = self.block_size
        ids = seq.block_ids[from_block : len(seq.hashes)]
        for bid in ids:
            bm.acquire(bid)
        try:
            yield [ExportedBlock(from_block + k, seq.hashes[from_block + k],
                                 seq.tokens[(from_block + k) * bs : (from_block + k + 1) * bs], self.pool.read_bytes(bid))
                   for k, bid in enumerate(ids)]
        finally:
            bm.release(ids)

    def pin(self, session: str) -> PinnedBlocks | None:
        """The session's full blocks pinned, none of their bytes read (unlike `export`): the threads
        that send or store them read them. None when the engine holds no full block of it."""
        seq, bm = self.table.get(session), self.table.blocks
        if seq is None or not seq.hashes:
            return None
        n = len(seq.hashes)
        ids = list(seq.block_ids[:n])
        for bid in ids:
            bm.acquire(bid)
        return PinnedBlocks(ids, list(seq.hashes), np.ascontiguousarray(seq.tokens[: n * self.block_size]),
                            self.pool.read_bytes, bm.release)

    def begin_import(self, session: str, fingerprint: str, tokens: np.ndarray, hashes: list[bytes]) -> ImportTxn:
        """Check a replica's fingerprint and hash chain, then reserve blocks for what is missing."""
        bs = self.block_size
        tokens = as_tokens(tokens)
        if self.inexact_reason is not None:
            raise self._refused(f"this engine keeps no blocks: {self.inexact_reason}", "inexact")
        if fingerprint != self.fingerprint:
            raise self._refused(f"model fingerprint {fingerprint[:12]} is not this engine's {self.fingerprint[:12]}",
                                "fingerprint")
        if len(tokens) != len(hashes) * bs:
            raise self._refused(f"{len(tokens)} tokens do not fill {len(hashes)} blocks of {bs}", "shape")
        if block_hashes(self.seed_hash, tokens, bs) != list(hashes):
            raise self._refused("block hashes do not match the hash chain of the tokens", "hash_chain")
        return ImportTxn(self, session, tokens, list(hashes))

    def _refused(self, why: str, reason: str) -> ImportRefused:
        self.table.counters.imports_refused += 1
        return ImportRefused(why, reason=reason)
