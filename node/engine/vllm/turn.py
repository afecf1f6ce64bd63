"""One turn on the vLLM engine: plan the pool blocks, stream vLLM's answer, keep what it stored.

Before: the prompt's leading whole blocks this host holds are pinned (the load list); pool blocks are
allocated for the later full blocks of the prompt and of up to `REPLY_BLOCKS` blocks of the reply (the
store list; a block the pool already has by hash is not stored twice). After: the blocks the connector
sealed are registered under their chained hashes (node.engine.hashing, kv_share's) and become the
session's table; a loaded block the connector refused (its bytes did not check) is forgotten, and the
table ends before it: vLLM recomputed it, and the next turn stores it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator

import httpx
import numpy as np
import torch

from kvmesh.node.engine.boundary import GenerateRequest, TextDelta, TurnBegin, TurnDone, TurnStats
from kvmesh.node.engine.export_import import ImportTxn
from kvmesh.node.engine.hashing import block_hashes
from kvmesh.node.engine.prefix import BlockPrefix
from kvmesh.node.engine.sequence import Sequence
from kvmesh.node.engine.sessiontable import SessionTable
from kvmesh.node.engine.tokenizer import Tokenizer
from kvmesh.node.engine.vllm.layout import BAD
from kvmesh.node.engine.vllm.pool import ShmPool
from kvmesh.node.engine.vllm.stream import request_body, stream

log = logging.getLogger("kvmesh.engine.vllm")

REPLY_BLOCKS = 8  # pool blocks reserved for a reply's full blocks; a longer reply's rest is stored by the next turn


class NoRunner:
    """The prefix index's runner where vLLM computes: the index only matches; turns commit here."""

    async def load(self, slot: int, block_ids: list[int], tokens: np.ndarray) -> int | None:
        raise NotImplementedError("vLLM loads blocks through its connector")

    async def forward(self, slot: int, tokens: np.ndarray, start: int) -> torch.Tensor:
        raise NotImplementedError("vLLM computes")

    async def store(self, slot: int, block_id: int, block_index: int, block_hash: bytes | None) -> None:
        raise NotImplementedError("vLLM stores blocks through its connector")

    def close(self) -> None:
        pass


class SealedImport:
    """An `ImportTxn` whose landed blocks are sealed once committed, so vLLM's worker accepts them."""

    def __init__(self, txn: ImportTxn, pool: ShmPool):
        self.txn, self.pool = txn, pool

    @property
    def missing(self) -> list[int]:
        return self.txn.missing

    def buffer(self, i: int) -> memoryview:
        return self.txn.buffer(i)

    def write(self, i: int, data: memoryview | bytes | np.ndarray) -> None:
        self.txn.write(i, data)

    def commit(self, upto: int | None = None) -> int:
        n = len(self.txn.hashes) if upto is None else upto
        tokens = self.txn.commit(upto)
        self.pool.seal_later([self.txn.block_ids[i] for i in self.txn.missing if i < n])
        return tokens

    def abort(self) -> None:
        self.txn.abort()


class VllmTurn:
    """Runs turns over one engine's session table, prefix index and pool, through its vLLM client."""

    def __init__(self, table: SessionTable, prefix: BlockPrefix, pool: ShmPool, *, seed_hash: bytes, model_name: str,
                 url: str, tokenizer: Tokenizer):
        self.table, self.prefix, self.pool, self.seed_hash = table, prefix, pool, seed_hash
        self.blocks, self.counters, self.block_size = table.blocks, table.counters, table.blocks.block_size
        self.model_name, self.url, self.tokenizer = model_name, url, tokenizer
        self.prefill_backlog = 0  # prompt tokens of running turns still to be prefilled
        self._clients: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}

    def client(self) -> httpx.AsyncClient:
        """The running loop's client of vLLM (a client's connections belong to the loop that opened them)."""
        loop = asyncio.get_running_loop()
        for other in [lp for lp in self._clients if lp.is_closed()]:
            del self._clients[other]
        if (c := self._clients.get(loop)) is None:
            # No kept-alive connections: vLLM's server closes an idle one after 5 s, and a turn that picked one as
            # it closed failed with ReadError under load (2 of 113 turns in bench handoff). Loopback connects are
            # cheap, but on a starved box one took over 5 s (1 of 144 turns): a dead vLLM refuses at once instead.
            c = self._clients[loop] = httpx.AsyncClient(base_url=self.url, timeout=httpx.Timeout(600.0, connect=60.0),
                                                        limits=httpx.Limits(max_keepalive_connections=0))
        return c

    async def moved(self, url: str) -> None:
        """vLLM serves at a new address (it was started again): the old clients go."""
        self.url, old = url, list(self._clients.values())
        self._clients.clear()
        for c in old:
            with contextlib.suppress(RuntimeError):
                await c.aclose()

    async def aclose(self) -> None:
        if (c := self._clients.pop(asyncio.get_running_loop(), None)) is not None:
            await c.aclose()

    async def run(self, req: GenerateRequest, tokens: np.ndarray, t0: float) -> AsyncGenerator[TurnBegin | TextDelta | TurnDone, None]:
        e, bs = self, self.block_size
        stats = TurnStats(req.session, prompt_tokens=len(tokens), cached_tokens=0, queue_s=time.monotonic() - t0)
        match = e.prefix.match(req.session, tokens)
        n_load = min(match.full_blocks, (len(tokens) - 1) // bs)  # at least one token computed, for its logits
        held = list(match.block_ids[:n_load])  # pinned for the turn: eviction cannot reuse them
        for bid in held:
            e.blocks.acquire(bid)
        store, fresh = self._plan(req, tokens, match.hashes, n_load, held)
        seq = e.table.get(req.session)
        if seq is not None:
            seq.busy = True
        out_ids: list[int] = []
        done = False
        try:
            await e.pool.seals(held + fresh)
            e.pool.reset(fresh)
            stats.cached_tokens = n_load * bs
            yield TurnBegin(stats)
            async with contextlib.aclosing(self._answer(req, tokens, held[:n_load], store, n_load, out_ids, stats, t0)) as deltas:
                async for delta in deltas:
                    yield delta
            done = True
        finally:
            kv_tokens = np.concatenate([tokens, np.asarray(out_ids[:-1], dtype=np.int32)]) if out_ids else tokens
            good = self._commit(req.session, kv_tokens, n_load, held, store, fresh, keep=done)
            if good < n_load:  # vLLM recomputed from the first block that did not check
                stats.cached_tokens = min(stats.cached_tokens, good * bs)
        stats.completion_tokens = len(out_ids)
        stats.total_s = time.monotonic() - t0
        e.counters.turns += 1
        yield TurnDone(stats)

    def _plan(self, req: GenerateRequest, tokens: np.ndarray, hashes: list[bytes], n_load: int,
              held: list[int]) -> tuple[list[int], list[int]]:
        """The store list from block `n_load` on (-1 where the pool holds that block already: `held`
        grows by it) and the fresh blocks allocated for it."""
        e, bs = self, self.block_size
        reply = min(-(-req.max_tokens // bs), REPLY_BLOCKS) * bs
        total = (len(tokens) + min(req.max_tokens, reply) - 1) // bs
        store: list[int] = []
        fresh: list[int] = []
        for j in range(n_load, total):
            bid = e.blocks.lookup(hashes[j], tokens[j * bs : (j + 1) * bs]) if j < len(hashes) else None
            if bid is not None:
                e.blocks.acquire(bid)
                held.append(bid)
                store.append(-1)
            elif e.table.make_room(1, spare=req.session):
                bid = e.blocks.allocate(1)[0]
                fresh.append(bid)
                store.append(bid)
            else:
                break  # the pool is full of running turns: store the prefix that fits
        return store, fresh

    async def _answer(self, req: GenerateRequest, tokens: np.ndarray, load: list[int], store: list[int], first: int,
                      out_ids: list[int], stats: TurnStats, t0: float) -> AsyncGenerator[TextDelta, None]:
        e = self
        body = request_body(e.model_name, req, tokens.tolist(), {"load": load, "store": store, "first": first})
        t1 = time.monotonic()
        todo = len(tokens) - len(load) * e.block_size
        e.prefill_backlog += todo
        try:
            async for piece in stream(e.client(), body, e.tokenizer.token_bytes):
                if piece.token_ids and not out_ids:
                    stats.ttft_s = time.monotonic() - t0
                    stats.prefill_s = time.monotonic() - t1
                    e.prefill_backlog -= todo
                    todo = 0
                out_ids += piece.token_ids
                if piece.cached_tokens is not None:
                    stats.cached_tokens = piece.cached_tokens
                if piece.finish_reason is not None:
                    stats.finish_reason = "stop" if piece.finish_reason == "stop" else "length"
                    stats.stop_sequence = piece.stop_reason
                if piece.text or piece.logprobs:
                    yield TextDelta(piece.text, piece.logprobs)
        finally:
            e.prefill_backlog -= todo
        c = e.counters
        computed = len(tokens) - stats.cached_tokens
        c.prefill_tokens += computed
        c.cached_tokens += stats.cached_tokens
        c.prefill_s += stats.prefill_s
        if computed >= 256 and stats.prefill_s > 0:
            c.recent_prefill_tps.append(computed / stats.prefill_s)

    def _commit(self, session: str, kv_tokens: np.ndarray, n_load: int, held: list[int], store: list[int],
                fresh: list[int], *, keep: bool) -> int:
        """The session's table from what the pool now holds: loaded blocks that checked, then the stored
        (sealed) and already-held blocks in order; every other pin and fresh block goes back. Returns
        how many loaded blocks checked before the first that did not."""
        e, bs, bm = self, self.block_size, self.blocks
        bad = [bid for bid in held[:n_load] if int(e.pool.file.states[bid]) == BAD]
        if bad:
            log.warning("session %s: %d pool blocks did not check and were recomputed", session, len(bad))
            bm.forget(bad)
            e.counters.restores_failed += len(bad)
        hashes = block_hashes(e.seed_hash, kv_tokens, bs)
        table: list[int] = []
        for bid in held[:n_load]:
            if bid in bad:
                break
            table.append(bid)
        good = len(table)
        extra = iter(held[n_load:])
        if keep and len(table) == n_load:
            for j, bid in enumerate(store, start=n_load):
                if j >= len(hashes):
                    break
                if bid < 0:
                    table.append(next(extra))
                    continue
                if not e.pool.sealed(bid):
                    break
                bm.register(bid, hashes[j], kv_tokens[j * bs : (j + 1) * bs])
                table.append(bid)
        kept = set(table)
        bm.release([b for b in held if b not in kept] + [b for b in fresh if b not in kept])
        seq = e.table.get(session)
        if seq is not None:
            seq.busy = False
        if not keep and seq is not None:
            bm.release(table)
            return good  # a failed turn leaves the session's previous table as it was
        e.table.install(Sequence(session, kv_tokens[: len(table) * bs].copy(), table, hashes[: len(table)]))
        return good
