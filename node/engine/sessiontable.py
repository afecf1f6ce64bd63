"""The session table: which sessions' caches the engine holds, as block tables, least recently used first.

One place installs a session's table (a turn's commit, a replica's import), drops one and evicts idle
ones to make room, so the two paths that install a table agree on what "replaced" and "evicted" mean.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

from kvmesh.node.engine.blocks import BlockManager
from kvmesh.node.engine.boundary import EngineCounters
from kvmesh.node.engine.sequence import Sequence


class SessionTable:
    """Sessions' block tables over one `BlockManager`; the table holds one reference on each block it lists."""

    def __init__(self, blocks: BlockManager, counters: EngineCounters):
        self.blocks, self.counters = blocks, counters
        self.seqs: collections.OrderedDict[str, Sequence] = collections.OrderedDict()  # LRU first
        self.on_evict: Callable[[str], None] | None = None  # called with the session whenever a cache is dropped

    def get(self, session: str) -> Sequence | None:
        return self.seqs.get(session)

    def install(self, seq: Sequence) -> None:
        """Make `seq` its session's table (most recently used); its blocks' references pass to the table,
        and the table it replaces gives its own back (replaced, not evicted: no hook is called)."""
        if (old := self.seqs.pop(seq.session, None)) is not None:
            self.blocks.release(old.block_ids)
        self.seqs[seq.session] = seq

    def drop(self, session: str) -> None:
        """Forget the session's table and tell the hook (the node tells kv_share its cache is gone here)."""
        if (seq := self.seqs.pop(session, None)) is not None:
            self.blocks.release(seq.block_ids)
        if self.on_evict is not None:
            self.on_evict(session)

    def make_room(self, n: int, *, spare: str | None = None) -> bool:
        """Evict idle sessions, least recently used first (never `spare`), until n blocks are free."""
        while not self.blocks.can_allocate(n):
            victim = next((s for s in self.seqs.values() if not s.busy and s.session != spare), None)
            if victim is None:
                return False
            self.drop(victim.session)
            self.counters.evicted_sessions += 1
        return True

    def idle(self) -> list[str]:
        return [s for s, q in self.seqs.items() if not q.busy]
