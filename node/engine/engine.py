"""The engine: composes its parts and runs a turn (admit, reuse, prefill, decode, commit).

The engine is the only source of truth for what it holds: `cached_prefix`
answers from the prefix index's live state, never from anyone's memory of it.
All bookkeeping runs on the event loop thread; runners only touch tensors.

Its parts, one concept each: the session table (`sessiontable`: LRU, install, drop), the prefix
index (`prefix`: blocks by chained hash, or `live`: what a slot still holds), admission (`admission`:
the session's lock, then a slot), the decode loop (`decode`: sampling, stop strings, logprobs),
exports and imports (`export_import`), and each kind's construction and runner (`backends`).
The types it implements are the protocol's (`boundary`, `turns`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence

import numpy as np
import torch

from kvmesh.node.config import EngineConfig
from kvmesh.node.engine.admission import SessionLocks
from kvmesh.node.engine.backends import make_runner, open_backend
from kvmesh.node.engine.blocks import BlockManager, BlockPool
from kvmesh.node.engine.boundary import (
    Admission,
    EngineCounters,
    ExportedBlock,
    GenerateRequest,
    PinnedBlocks,
    TextDelta,
    TurnBegin,
    TurnDone,
    TurnStats,
)
from kvmesh.node.engine.decode import DecodeLoop
from kvmesh.node.engine.decoder import ModelConfig
from kvmesh.node.engine.export_import import BlockTransfers, ImportTxn
from kvmesh.node.engine.hashing import chain_seed
from kvmesh.node.engine.hf import Checkpoint
from kvmesh.node.engine.holding import BlockHolding
from kvmesh.node.engine.live import LiveCaches, LivePrefix, OwnTail
from kvmesh.node.engine.llamarestore import RestoreFailed
from kvmesh.node.engine.prefix import BlockPrefix, PrefixIndex
from kvmesh.node.engine.runner import Runner, blocks_for
from kvmesh.node.engine.scripted import ScriptedRunner
from kvmesh.node.engine.sequence import Match
from kvmesh.node.engine.sessiontable import SessionTable
from kvmesh.node.engine.slots import SlotScheduler
from kvmesh.node.engine.tokenizer import Tokenizer

__all__ = ["Engine", "EngineCounters", "ExportedBlock", "GenerateRequest", "ImportTxn", "PinnedBlocks", "TextDelta",
           "TurnBegin", "TurnDone", "TurnStats"]

log = logging.getLogger("kvmesh.engine")


class Engine(BlockHolding):
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
        self.snapshots = backend.llama.snapshots if backend.llama else None  # window caches, recurrent states (snapshots)
        self.swa = cfg.llamacpp.swa if backend.llama is not None and backend.llama.model.n_swa else None  # its mode
        self.slots = SlotScheduler(cfg.slots, cfg.queue_max, cfg.queue_timeout_s)
        self.counters = EngineCounters()
        self.table = SessionTable(self.blocks, self.counters)
        self.sessions = self.table.seqs  # LRU first
        # Unset reuse_tail: a llama.cpp turn keeps its slot's own cells token by token where that computes what
        # whole blocks (a replica) compute, to the bit (node.engine.tailshapes), and whole blocks elsewhere.
        self.own_tail: OwnTail | None = None
        if backend.llama is not None and self.slot_caches is not None and cfg.reuse_tail is None and reason is None:
            if (why := backend.llama.exact_tail) is None:
                self.own_tail = OwnTail(self.slot_caches, backend.llama, self._count_settled)
            else:
                log.info("%s: a turn reuses whole blocks of its session's cache only: %s", self.model_name, why)
        self.prefix: PrefixIndex = (
            LivePrefix(self.slot_caches, self.table) if reason is not None and self.slot_caches is not None
            else BlockPrefix(self.table, runner, self.seed_hash, resumable=self.snapshots, tail_reused=cfg.tail_reused,
                             own=self.own_tail))
        self.transfers = BlockTransfers(self.table, self.pool, seed_hash=self.seed_hash, fingerprint=self.fingerprint,
                                        cached_prefix=self.cached_prefix, inexact_reason=reason)
        self._locks = SessionLocks()
        self._stop_ids = frozenset(self.tokenizer.eos_ids) | frozenset(self.model_cfg.eos_ids)
        self.decode = DecodeLoop(runner, self.tokenizer, self._stop_ids, self.max_context)
        self.grammars = self.decode.grammars  # constrained turns' vocabulary (node.engine.constraint)
        self._prefill_backlog = 0  # tokens of prompts being prefilled now (placement's TTFT estimate)

    # ---- turns ---------------------------------------------------------------

    def slot_preference(self, session: str) -> Sequence[int]:
        """A llama.cpp turn goes back to the slot still holding its session (node.engine.live)."""
        return self.slot_caches.preference(session) if self.slot_caches else ()

    async def run(self, adm: Admission) -> AsyncGenerator[TurnBegin | TextDelta | TurnDone, None]:
        """Run an admitted turn: reuse what is cached, prefill the rest, decode; the admission is released
        when it ends, however it ends."""
        try:
            async for ev in self._turn(adm.slot, adm.req, adm.tokens, adm.t0):
                yield ev
        finally:
            adm.release()

    async def _turn(self, slot: int, req: GenerateRequest, tokens: np.ndarray, t0: float) -> AsyncIterator[TurnBegin | TextDelta | TurnDone]:
        bs = self.block_size
        stats = TurnStats(req.session, prompt_tokens=len(tokens), cached_tokens=0, queue_s=time.monotonic() - t0)
        if self.own_tail is not None:
            await self.own_tail.take(slot)  # the last turn's settle on this slot: dropped, or ended
        match = self.prefix.match(req.session, tokens, slot)
        # Another session's cache in this slot is gone from here on; the slot is this session's once it commits.
        overwritten = self.slot_caches.take(slot, req.session) if self.slot_caches is not None else None
        if overwritten is not None:
            self.prefix.slot_taken(overwritten)
        reuse = min(match.tokens, len(tokens) - 1)  # at least one token is computed, for logits
        load_ids = match.block_ids[: blocks_for(reuse, bs)]
        for bid in load_ids:
            self.blocks.acquire(bid)  # pinned: eviction cannot hand them out mid-turn
        seq = self.table.get(req.session)
        if seq is not None:
            seq.busy = True
        committed = False
        pins_held = True  # until _commit takes them over
        try:
            stats.cached_tokens = reuse
            yield TurnBegin(stats)
            logits, reuse = await self._prefill(slot, tokens, reuse, load_ids, stats)
            out_ids: list[int] = []
            async with contextlib.aclosing(self.decode.run(slot, req, len(tokens), logits, out_ids, stats, t0)) as steps:
                async for delta in steps:
                    yield delta
            stats.completion_tokens = len(out_ids)
            # KV exists for the prompt and every generated token but the last one.
            kv_tokens = np.concatenate([tokens, np.asarray(out_ids[:-1], dtype=np.int32)]) if out_ids else tokens
            pins_held = False
            await self._commit(slot, req.session, kv_tokens, match, reuse, load_ids)
            committed = True
            if self.own_tail is not None:
                self.own_tail.settle(slot, len(kv_tokens), reuse // bs * bs)
            stats.total_s = time.monotonic() - t0
            self.counters.turns += 1
            yield TurnDone(stats)
        finally:
            if pins_held:
                self.blocks.release(load_ids)
            if not committed and (s := self.table.get(req.session)) is not None:
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

    def _count_prefill(self, n: int, secs: float, reused: int) -> None:
        c = self.counters
        c.prefill_tokens += n
        c.cached_tokens += reused
        c.prefill_s += secs
        if n >= 256 and secs > 0:
            c.recent_prefill_tps.append(n / secs)

    def _count_settled(self, n: int) -> None:
        self.counters.settled_tokens += n
        self.counters.prefill_tokens += n

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
        """Keep the turn's KV as the session's cache (the prefix index's strategy); owns `pinned` from the call on."""
        if self.slot_caches is not None:
            self.slot_caches.wrote(slot, session)
        await self.prefix.commit(slot, session, kv_tokens, match, reuse, pinned)

    # ---- export / import -----------------------------------------------------

    def close(self) -> None:
        self.runner.close()

