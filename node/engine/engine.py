"""The engine: sessions, slots, prefix reuse, generation, export and import.

The engine is the only source of truth for what it holds: `cached_prefix`
answers from the block manager's live state, never from anyone's memory of it.
All bookkeeping runs on the event loop thread; runners only touch tensors.

Beside it: a turn's request, events and stats (`turns`), exported blocks, pins and the
import transaction (`export_import`), and each kind's construction (`backends`). Their
names stay importable from here, where kv_share, the mesh and the API have always found them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator

import numpy as np
import torch

from kvmesh.node.config import EngineConfig
from kvmesh.node.engine.backends import make_runner, open_backend
from kvmesh.node.engine.batcher import DecodeBatcher
from kvmesh.node.engine.blocks import BlockManager, BlockPool
from kvmesh.node.engine.constraint import Grammars
from kvmesh.node.engine.export_import import ExportedBlock, ImportTxn, PinnedBlocks
from kvmesh.node.engine.hashing import as_tokens, block_hashes, chain_seed
from kvmesh.node.engine.hf import Checkpoint
from kvmesh.node.engine.live import LiveCaches
from kvmesh.node.engine.llamacpp import RestoreFailed
from kvmesh.node.engine.model import ModelConfig
from kvmesh.node.engine.picker import LogprobFeed, Picker
from kvmesh.node.engine.runner import Runner, blocks_for
from kvmesh.node.engine.scripted import ScriptedRunner
from kvmesh.node.engine.sequence import Match, Sequence
from kvmesh.node.engine.slots import SlotScheduler
from kvmesh.node.engine.tokenizer import Tokenizer
from kvmesh.node.engine.turns import EngineCounters, GenerateRequest, TextDelta, TurnBegin, TurnDone, TurnStats
from kvmesh.node.errors import ContextLengthExceeded, ImportRefused, InvalidRequest

__all__ = ["Engine", "EngineCounters", "ExportedBlock", "GenerateRequest", "ImportTxn", "PinnedBlocks", "TextDelta",
           "TurnBegin", "TurnDone", "TurnStats"]

log = logging.getLogger("kvmesh.engine")


class Engine:
    """N slots over one block pool; a torch model (tiny preset or a local checkpoint), a GGUF model
    in llama.cpp (node.engine.llamacpp) or the sim cost model underneath."""

    def __init__(self, cfg: EngineConfig, *, model_cfg: ModelConfig | None = None):
        self.cfg = cfg
        self.model_name = cfg.served_model
        backend = open_backend(cfg, model_cfg)
        self.block_size = backend.block_size
        # kind "torch": a Hugging Face checkpoint directory; its digest is in the fingerprint.
        self.checkpoint: Checkpoint | None = backend.checkpoint
        self.tokenizer: Tokenizer = backend.tokenizer
        self.model_cfg = backend.model_cfg
        self.dtype, self.device = backend.dtype, backend.device
        self.kv_bytes_per_token, self.block_bytes = backend.kv_bytes_per_token, backend.block_bytes
        self.fingerprint, self.max_context = backend.fingerprint, self.model_cfg.max_context
        self.seed_hash = chain_seed(self.fingerprint)
        # A pool in tokens is sized from this model's own bytes per token (a bench need not know them).
        num_blocks = max(4, -(-cfg.cache_tokens // self.block_size) if cfg.cache_tokens else cfg.cache_bytes // self.block_bytes)
        # A model whose cache cannot be cut into blocks reuses only what its slot still holds (node.engine.live).
        if (reason := backend.inexact_reason) is not None:
            num_blocks = 4  # no block is ever written
            log.warning("%s: %s, so it is served without blocks or replicas: a session reuses only the cache its "
                        "slot still holds, and a turn that moves host recomputes its prompt", self.model_name, reason)
        self.inexact_reason, self.weights = reason, backend.weights  # weights: llama.cpp's buffers, and why
        self.pool = BlockPool(num_blocks, backend.block_shape, self.dtype, self.device)
        self.blocks = BlockManager(num_blocks, self.block_size)
        runner = make_runner(cfg, backend, self.pool, self.seed_hash)
        if cfg.kind == "sim" and cfg.sim.scripted_reply is not None:
            # Test only (node.engine.scripted): the real sim runner with its logits replaced by a fixed reply.
            runner = ScriptedRunner(runner, self.tokenizer.encode(cfg.sim.scripted_reply), self.tokenizer.eos_id)
        self.runner: Runner = runner
        # Which session each llama.cpp slot holds: a turn goes back to its own slot (no restore), others to empty
        # or least recently used ones. For a model without blocks that is its cache itself (node.engine.live).
        self.slot_caches = LiveCaches(cfg.slots, backend.llama.held_tokens) if backend.llama else None
        self.live = self.slot_caches if self.inexact_reason else None
        self.snapshots = backend.llama.snapshots if backend.llama else None  # window caches, recurrent states (snapshots)
        self.swa = cfg.llamacpp.swa if backend.llama is not None and backend.llama.model.n_swa else None  # its mode
        self.slots = SlotScheduler(cfg.slots, cfg.queue_max, cfg.queue_timeout_s)
        self.sessions: collections.OrderedDict[str, Sequence] = collections.OrderedDict()  # LRU first
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        # The byte tokenizer masks what a random-weight model may emit; a real model is not masked.
        mask = self.tokenizer.generation_mask()
        self._allowed = None if mask is None else torch.from_numpy(mask)
        self._stop_ids = frozenset(self.tokenizer.eos_ids) | frozenset(self.model_cfg.eos_ids)
        self.grammars = Grammars(self.tokenizer, self._stop_ids)  # constrained turns' vocabulary (node.engine.constraint)
        self.counters = EngineCounters()
        self._prefill_backlog = 0  # tokens of prompts being prefilled now (placement's TTFT estimate)
        self.on_evict: Callable[[str], None] | None = None  # called with the session whenever a cache is dropped

    # ---- what the engine holds ------------------------------------------------

    def _match(self, session: str, tokens: np.ndarray, slot: int | None = None) -> Match:
        """Longest resident prefix of `tokens`: whole blocks by hash chain (any session's),
        then the session's own last block token by token (live caches: what its slot holds,
        on `slot` if given). No side effects."""
        if self.live is not None:
            n = self.live.cached_prefix(session, tokens) if slot is None else self.live.reusable(session, slot, tokens)
            return Match(tokens=n, block_ids=[], full_blocks=0, hashes=[])
        bs = self.block_size
        hashes = block_hashes(self.seed_hash, tokens, bs)
        seq = self.sessions.get(session)
        ids: list[int] = []
        for i, h in enumerate(hashes):
            if seq is not None and i < len(seq.hashes) and seq.hashes[i] == h:
                ids.append(seq.block_ids[i])
                continue
            bid = self.blocks.lookup(h, tokens[i * bs : (i + 1) * bs])
            if bid is None:
                break
            ids.append(bid)
        if self.snapshots is not None:  # such a model resumes only at a snapshot (node.engine.snapshots)
            ids = ids[: self.snapshots.usable(tokens, len(ids) * bs) // bs]
        full = len(ids)
        n = full * bs
        # Same prefix as the session's own sequence up to here (the chain hash says so):
        # the session's next block may still match part-way (its unhashed tail, or a
        # full block the prompt only partly repeats).
        same_prefix = seq is not None and (full == 0 or (full <= len(seq.hashes) and seq.hashes[full - 1] == hashes[full - 1]))
        if self.cfg.tail_reused and seq is not None and same_prefix and full < len(seq.block_ids) and n < len(tokens):
            theirs = seq.tokens[n : n + bs]
            ours = tokens[n : n + len(theirs)]
            diff = np.flatnonzero(theirs[: len(ours)] != ours)
            m = int(diff[0]) if len(diff) else min(len(theirs), len(ours))
            if m:
                ids.append(seq.block_ids[full])
                n += m
        return Match(tokens=n, block_ids=ids, full_blocks=full, hashes=hashes)

    def cached_prefix(self, session: str, token_ids: list[int] | np.ndarray) -> int:
        """How many leading tokens of `token_ids` this engine holds right now."""
        return self._match(session, as_tokens(token_ids)).tokens

    def resident_tokens(self, session: str) -> int:
        if self.live is not None:
            return self.live.resident(session)
        seq = self.sessions.get(session)
        return seq.num_tokens if seq else 0

    def block_hash(self, session: str, i: int) -> bytes | None:
        """The chain hash of the session's i-th full block, if the engine holds that block."""
        seq = self.sessions.get(session)
        return seq.hashes[i] if seq is not None and 0 <= i < len(seq.hashes) else None

    def session_tokens(self, session: str) -> np.ndarray | None:
        if self.live is not None:
            return None if (t := self.live.tokens(session)) is None else t.copy()
        seq = self.sessions.get(session)
        return None if seq is None else seq.tokens

    # ---- memory --------------------------------------------------------------

    def _make_room(self, n: int, *, spare: str | None = None) -> bool:
        """Evict idle sessions, least recently used first, until n blocks are free."""
        while not self.blocks.can_allocate(n):
            victim = next((s for s in self.sessions.values() if not s.busy and s.session != spare), None)
            if victim is None:
                return False
            self._drop(victim.session)
            self.counters.evicted_sessions += 1
        return True

    def _drop(self, session: str) -> None:
        if (seq := self.sessions.pop(session, None)) is not None:
            self.blocks.release(seq.block_ids)
        if self.on_evict is not None:
            self.on_evict(session)

    def evict(self, session: str) -> bool:
        """Drop a session's resident cache (its blocks stay addressable until reused)."""
        seq = self.sessions.get(session)
        if not (self.live.drop(session) if self.live is not None else seq is not None and not seq.busy):
            return False
        self._drop(session)
        self.counters.evicted_sessions += 1
        return True

    def evict_all(self) -> int:
        """Drop every idle session and forget every unreferenced block: a cold cache."""
        n = 0
        for s in self.live.sessions() if self.live is not None else []:
            n += self.evict(s)
        for s in [s for s, q in self.sessions.items() if not q.busy]:
            self._drop(s)
            n += 1
        self.blocks.forget_all()
        self.counters.evicted_sessions += n
        return n

    # ---- turns ---------------------------------------------------------------

    def validate(self, req: GenerateRequest) -> np.ndarray:
        tokens = as_tokens(req.prompt)
        if len(tokens) == 0:
            raise InvalidRequest("the prompt is empty", param="messages")
        if len(tokens) >= self.max_context:
            raise ContextLengthExceeded(f"the prompt is {len(tokens)} tokens; this model's context is "
                                        f"{self.max_context} tokens", param="messages")
        if req.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        return tokens

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TurnBegin | TextDelta | TurnDone]:
        """Run one turn: wait for a slot, reuse what is cached, prefill the rest, decode."""
        tokens = self.validate(req)
        t0 = time.monotonic()
        # One turn per session at a time; the lock lives while anyone holds or awaits it. It is taken
        # before the slot: a turn waiting for its session's previous turn holds no slot another could use.
        lock, users = self._locks.get(req.session, (asyncio.Lock(), 0))
        self._locks[req.session] = (lock, users + 1)
        try:
            async with lock:
                slot = await self.slots.acquire(self.slot_caches.preference(req.session) if self.slot_caches else (),
                                                prefill_tokens=max(0, len(tokens) - self.resident_tokens(req.session)))
                try:
                    if req.prepare is not None:
                        await req.prepare()
                    async for ev in self._turn(slot, req, tokens, t0):
                        yield ev
                finally:
                    self.slots.release(slot)
        finally:
            lock, users = self._locks[req.session]
            if users == 1:
                del self._locks[req.session]
            else:
                self._locks[req.session] = (lock, users - 1)

    async def _turn(self, slot: int, req: GenerateRequest, tokens: np.ndarray, t0: float) -> AsyncIterator[TurnBegin | TextDelta | TurnDone]:
        bs = self.block_size
        stats = TurnStats(req.session, prompt_tokens=len(tokens), cached_tokens=0, queue_s=time.monotonic() - t0)
        match = self._match(req.session, tokens, slot)
        # Another session's cache in this slot is gone from here on; the slot is this session's once it commits.
        overwritten = self.slot_caches.take(slot, req.session) if self.slot_caches is not None else None
        if self.live is not None and overwritten is not None:
            self._drop(overwritten)
            self.counters.evicted_sessions += 1
        reuse = min(match.tokens, len(tokens) - 1)  # at least one token is computed, for logits
        load_ids = match.block_ids[: blocks_for(reuse, bs)]
        for bid in load_ids:
            self.blocks.acquire(bid)  # pinned: eviction cannot hand them out mid-turn
        seq = self.sessions.get(req.session)
        if seq is not None:
            seq.busy = True
        committed = False
        pins_held = True  # until _commit takes them over
        try:
            stats.cached_tokens = reuse
            yield TurnBegin(stats)
            logits, reuse = await self._prefill(slot, tokens, reuse, load_ids, stats)
            out_ids: list[int] = []
            async with contextlib.aclosing(self._decode(slot, req, len(tokens), logits, out_ids, stats, t0)) as steps:
                async for delta in steps:
                    yield delta
            stats.completion_tokens = len(out_ids)
            # KV exists for the prompt and every generated token but the last one.
            kv_tokens = np.concatenate([tokens, np.asarray(out_ids[:-1], dtype=np.int32)]) if out_ids else tokens
            pins_held = False
            await self._commit(slot, req.session, kv_tokens, match, reuse, load_ids)
            committed = True
            stats.total_s = time.monotonic() - t0
            self.counters.turns += 1
            yield TurnDone(stats)
        finally:
            if pins_held:
                self.blocks.release(load_ids)
            if not committed and (s := self.sessions.get(req.session)) is not None:
                s.busy = False

    async def _prefill(self, slot: int, tokens: np.ndarray, reuse: int, load_ids: list[int],
                       stats: TurnStats) -> tuple[torch.Tensor, int]:
        """Load the reused prefix into the slot, compute the rest; returns the last position's logits
        and the tokens really reused (0 when a block did not restore)."""
        t1 = time.monotonic()
        try:
            if (held := await self.runner.load(slot, load_ids, tokens[:reuse])) is not None and held < reuse:
                reuse = stats.cached_tokens = held  # resumed at an earlier snapshot
        except RestoreFailed as e:
            # The runner erased the slot's sequence: nothing half-restored. The blocks from the
            # bad one on stop being advertised, and this turn computes its whole prompt.
            log.warning("session %s: %s; recomputing its %d prompt tokens", stats.session, e, len(tokens))
            self.blocks.forget(load_ids[e.block :])
            self.counters.restores_failed += 1
            reuse = stats.cached_tokens = 0
            await self.runner.load(slot, [], tokens[:0])
        stats.load_s = time.monotonic() - t1
        t2 = time.monotonic()
        todo = len(tokens) - reuse
        self._prefill_backlog += todo
        try:
            logits = await self.runner.forward(slot, tokens[reuse:], reuse)
        finally:
            self._prefill_backlog -= todo
        stats.prefill_s = time.monotonic() - t2
        self._count_prefill(len(tokens) - reuse, stats.prefill_s, reuse)
        return logits, reuse

    async def _decode(self, slot: int, req: GenerateRequest, pos: int, logits: torch.Tensor, out_ids: list[int],
                      stats: TurnStats, t0: float) -> AsyncGenerator[TextDelta, None]:
        """Sample from `logits` on, one token per step from position `pos`, until a stop or a limit.

        Appends every sampled token to `out_ids` and sets the stats' TTFT and finish reason.
        Text is held back by the longest stop string's length less one, so a stop string
        split across tokens is never streamed."""
        decoder = self.tokenizer.incremental_decoder()
        text, emitted = "", 0
        hold = max((len(s) for s in req.stop), default=1) - 1
        feed = None if req.top_logprobs is None else LogprobFeed(self.tokenizer.token_bytes, req.top_logprobs)
        async with contextlib.aclosing(self._tokens(slot, req, pos, logits, feed)) as tokens:
            async for tok in tokens:
                if not out_ids:
                    stats.ttft_s = time.monotonic() - t0
                if tok in self._stop_ids and not req.ignore_eos:
                    stats.finish_reason = "stop"
                    break
                out_ids.append(tok)
                text += decoder.decode(self.tokenizer.token_bytes(tok))
                if feed is not None:
                    feed.ends.append(len(text))
                hits = [(i, s) for s in req.stop if (i := text.find(s, max(0, emitted - len(s)))) >= 0]
                if hits:
                    cut, stats.stop_sequence = min(hits)
                    text = text[:cut]
                    stats.finish_reason = "stop"
                    break
                if len(text) - hold > emitted:
                    yield TextDelta(text[emitted : len(text) - hold], None if feed is None else feed.upto(len(text) - hold))
                    emitted = len(text) - hold
                if len(out_ids) >= req.max_tokens or pos + len(out_ids) >= self.max_context:
                    stats.finish_reason = "length"
                    break
        text += decoder.decode(b"", final=True) if stats.finish_reason == "length" else ""
        if len(text) > emitted or (feed is not None and feed.sent < len(feed.ends)):
            yield TextDelta(text[emitted:], None if feed is None else feed.upto(len(text)))

    async def _tokens(self, slot: int, req: GenerateRequest, pos: int, logits: torch.Tensor,
                      feed: LogprobFeed | None = None) -> AsyncGenerator[int, None]:
        """The turn's sampled tokens: the first from the prefill's logits, each next one fed at the
        following position, until a stop token or a limit. A runner with a `DecodeBatcher` decodes
        ahead on its compute thread (node.engine.batcher); others step through `forward`."""
        mask = None if req.constraint is None else await self.grammars.mask(req.constraint)
        pick = Picker(req, self._allowed, self._stop_ids, pos, self.max_context, mask, feed)  # constraint, logprobs
        tok, last = pick(logits)
        yield tok
        batcher = getattr(self.runner, "decoder", None)
        if last:
            return
        if isinstance(batcher, DecodeBatcher):
            async with contextlib.aclosing(batcher.run_ahead(slot, tok, pos, pick)) as ahead:
                async for tok in ahead:
                    yield tok
            return
        while not last:
            row = await self.runner.forward(slot, np.array([tok], dtype=np.int32), pos + pick.picked - 1)
            tok, last = pick(row)
            yield tok

    def _count_prefill(self, n: int, secs: float, reused: int) -> None:
        c = self.counters
        c.prefill_tokens += n
        c.cached_tokens += reused
        c.prefill_s += secs
        if n >= 256 and secs > 0:
            c.recent_prefill_tps.append(n / secs)

    def prefill_backlog(self) -> int:
        """Prompt tokens of running turns still to be prefilled (each counted whole until it is done)."""
        return self._prefill_backlog

    def prefill_rate(self) -> float:
        """Measured prefill tokens/s (recent turns), for placement's TTFT estimates."""
        r = self.counters.recent_prefill_tps
        if r:
            return sorted(r)[len(r) // 2]
        return self.cfg.sim.prefill_tps if self.cfg.kind == "sim" else 8000.0

    async def _commit(self, slot: int, session: str, kv_tokens: np.ndarray, match: Match, reuse: int, pinned: list[int]) -> None:
        """Store the turn's KV as the session's block table; reuse whole blocks, dedupe by hash.

        Owns `pinned` from the call on. Bookkeeping changes only after every new block is
        written, so a cancelled or failed commit leaves the previous table as it was."""
        if self.slot_caches is not None:
            self.slot_caches.wrote(slot, session)
        if self.live is not None:  # the slot holds the turn's cache; nothing is cut into blocks
            return
        bs = self.block_size
        keep = reuse // bs  # leading blocks reused whole: their pins become the new table's refs
        table = list(pinned[:keep])
        self.blocks.release(pinned[keep:])
        hashes = list(match.hashes[:keep])
        prev = hashes[-1] if hashes else None
        hashes += block_hashes(self.seed_hash, kv_tokens, bs, start=keep, prev=prev)
        fresh: list[tuple[int, int]] = []  # (block index, new block id) still to be written
        try:
            for j in range(keep, blocks_for(len(kv_tokens), bs)):
                h = hashes[j] if j < len(hashes) else None
                if h is not None and (bid := self.blocks.lookup(h, kv_tokens[j * bs : (j + 1) * bs])) is not None:
                    self.blocks.acquire(bid)
                elif self._make_room(1, spare=session):
                    bid = self.blocks.allocate(1)[0]
                    fresh.append((j, bid))
                else:
                    break  # the pool is full of running turns: keep the prefix that fits
                table.append(bid)
            for j, bid in fresh:
                await self.runner.store(slot, bid, j, hashes[j] if j < len(hashes) else None)
        except BaseException:
            self.blocks.release(table)
            raise
        for j, bid in fresh:
            if j < len(hashes):
                self.blocks.register(bid, hashes[j], kv_tokens[j * bs : (j + 1) * bs])
        stored = min(len(kv_tokens), len(table) * bs)
        old = self.sessions.pop(session, None)
        if old is not None:
            self.blocks.release(old.block_ids)
        self.sessions[session] = Sequence(session, kv_tokens[:stored].copy(), table, hashes[: stored // bs])

    # ---- export / import -----------------------------------------------------

    @contextlib.contextmanager
    def export(self, session: str, from_block: int = 0) -> Iterator[list[ExportedBlock]]:
        """The session's full blocks from `from_block`, pinned for as long as the caller reads them."""
        seq = self.sessions.get(session)
        if seq is None:
            yield []
            return
        bs = self.block_size
        ids = seq.block_ids[from_block : len(seq.hashes)]
        for bid in ids:
            self.blocks.acquire(bid)
        try:
            yield [
                ExportedBlock(from_block + k, seq.hashes[from_block + k], seq.tokens[(from_block + k) * bs : (from_block + k + 1) * bs], self.pool.read_bytes(bid))
                for k, bid in enumerate(ids)
            ]
        finally:
            self.blocks.release(ids)

    def pin(self, session: str) -> PinnedBlocks | None:
        """The session's full blocks pinned, none of their bytes read (unlike `export`): the threads
        that send or store them read them. None when the engine holds no full block of it."""
        seq = self.sessions.get(session)
        if seq is None or not seq.hashes:
            return None
        n = len(seq.hashes)
        ids = list(seq.block_ids[:n])
        for bid in ids:
            self.blocks.acquire(bid)
        return PinnedBlocks(ids, list(seq.hashes), np.ascontiguousarray(seq.tokens[: n * self.block_size]),
                            self.pool.read_bytes, self.blocks.release)

    def begin_import(self, session: str, fingerprint: str, tokens: np.ndarray, hashes: list[bytes]) -> ImportTxn:
        """Check a replica's fingerprint and hash chain, then reserve blocks for what is missing."""
        bs = self.block_size
        tokens = as_tokens(tokens)
        if self.inexact_reason is not None:
            self.counters.imports_refused += 1
            raise ImportRefused(f"this engine keeps no blocks: {self.inexact_reason}", reason="inexact")
        if fingerprint != self.fingerprint:
            self.counters.imports_refused += 1
            raise ImportRefused(f"model fingerprint {fingerprint[:12]} is not this engine's {self.fingerprint[:12]}", reason="fingerprint")
        if len(tokens) != len(hashes) * bs:
            self.counters.imports_refused += 1
            raise ImportRefused(f"{len(tokens)} tokens do not fill {len(hashes)} blocks of {bs}", reason="shape")
        if block_hashes(self.seed_hash, tokens, bs) != list(hashes):
            self.counters.imports_refused += 1
            raise ImportRefused("block hashes do not match the hash chain of the tokens", reason="hash_chain")
        return ImportTxn(self, session, tokens, list(hashes))

    def import_blocks(self, session: str, fingerprint: str, tokens: np.ndarray, hashes: list[bytes], data: list[memoryview | bytes | np.ndarray]) -> int:
        """Import whole blocks (tokens, hashes, KV bytes per block); returns tokens now resident."""
        txn = self.begin_import(session, fingerprint, tokens, hashes)
        try:
            for i in txn.missing:
                txn.write(i, data[i])
            return txn.commit()
        except BaseException:
            txn.abort()
            raise

    def close(self) -> None:
        self.runner.close()

