"""The engine: sessions, slots, prefix reuse, generation, export and import.

The engine is the only source of truth for what it holds: `cached_prefix`
answers from the block manager's live state, never from anyone's memory of it.
All bookkeeping runs on the event loop thread; runners only touch tensors.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from kvmesh.node.config import EngineConfig
from kvmesh.node.engine.blocks import BlockManager, BlockPool
from kvmesh.node.engine.hashing import as_tokens, block_hashes, chain_seed
from kvmesh.node.engine.hf import Checkpoint, load_decoder, open_checkpoint
from kvmesh.node.engine.llamacpp import LlamaModel, LlamaRunner, RestoreFailed
from kvmesh.node.engine.llamacpp import fingerprint as llama_fingerprint
from kvmesh.node.engine.model import ModelConfig, fingerprint, preset
from kvmesh.node.engine.runner import Runner, SimCost, SimRunner, TorchRunner, blocks_for
from kvmesh.node.engine.sampling import sample
from kvmesh.node.engine.scripted import ScriptedRunner
from kvmesh.node.engine.sequence import Match, Sequence
from kvmesh.node.engine.slots import SlotScheduler
from kvmesh.node.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from kvmesh.node.errors import ContextLengthExceeded, ImportRefused, InvalidRequest

log = logging.getLogger("kvmesh.engine")


@dataclass
class GenerateRequest:
    session: str
    prompt: list[int] | np.ndarray
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Awaited once the slot and the session are held, just before the cache is matched:
    # the node imports a stored replica here, so nothing can evict it in between.
    prepare: Callable[[], Awaitable[object]] | None = None


@dataclass
class TurnStats:
    session: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int = 0
    finish_reason: str = "length"
    queue_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0


@dataclass
class TurnBegin:
    """First event of every turn: the slot is held and the reused prefix is known."""

    stats: TurnStats


@dataclass
class TextDelta:
    text: str


@dataclass
class TurnDone:
    stats: TurnStats


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


@dataclass
class EngineCounters:
    turns: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    evicted_sessions: int = 0
    imported_blocks: int = 0
    imports_refused: int = 0
    restores_failed: int = 0  # cached blocks the runner could not restore (the turn recomputed)
    prefill_s: float = 0.0
    recent_prefill_tps: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=16))


def _generator(seed: int | None) -> torch.Generator | None:
    """A sampling generator from a 64-bit seed: hashed first, so high bits matter too."""
    if seed is None:
        return None
    mixed = xxhash.xxh64_intdigest(seed.to_bytes(8, "little", signed=True))
    return torch.Generator().manual_seed(mixed & ((1 << 63) - 1))


def _pick_device(want: str) -> torch.device:
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def _pick_dtype(want: str, device: torch.device) -> torch.dtype:
    if want == "auto":
        # fp32 is faster than bf16 on these CPUs (machine-facts); bf16 on GPUs.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, want)


class Engine:
    """N slots over one block pool; a torch model (tiny preset or a local checkpoint), a GGUF model
    in llama.cpp (node.engine.llamacpp) or the sim cost model underneath."""

    def __init__(self, cfg: EngineConfig, *, model_cfg: ModelConfig | None = None):
        self.cfg = cfg
        # kind "torch": a Hugging Face checkpoint directory; its config carries the
        # checkpoint digest, so the fingerprint below names these exact weights.
        self.checkpoint: Checkpoint | None = None
        self.tokenizer: Tokenizer
        if cfg.kind == "torch":
            self.checkpoint = open_checkpoint(cfg.model, max_context=cfg.max_context)
            self.tokenizer = HFTokenizer.from_dir(self.checkpoint.path, extra_eos_ids=self.checkpoint.config.eos_ids)
        elif cfg.kind != "llamacpp":  # llama.cpp's tokenizer comes with its model, below
            self.tokenizer = ByteTokenizer()
        self.block_size = cfg.block_size
        self.model_name = cfg.served_model
        self.device = _pick_device(cfg.device)
        llama: LlamaRunner | None = None
        if cfg.kind == "llamacpp":
            llama = self._open_llamacpp(cfg)
            block_shape: tuple[int, ...] = (llama.block_bytes,)
        elif cfg.kind == "sim":
            self.dtype = torch.uint8
            self.model_cfg = model_cfg or preset("tiny", max_context=cfg.sim.max_context)
            self.kv_bytes_per_token = cfg.sim.scaled_kv_bytes_per_token()
            block_shape = (self.kv_bytes_per_token * self.block_size,)
            self.device = torch.device("cpu")
            fp_cfg = ModelConfig(name=f"sim-{self.kv_bytes_per_token}", max_context=cfg.sim.max_context)
        if cfg.kind not in ("sim", "llamacpp"):
            self.dtype = _pick_dtype(cfg.dtype, self.device)
            if self.checkpoint is not None:
                self.model_cfg = model_cfg or self.checkpoint.config
            else:
                self.model_cfg = model_cfg or preset(cfg.kind, max_context=cfg.max_context)
            self.kv_bytes_per_token = self.model_cfg.kv_bytes_per_token(self.dtype)
            m = self.model_cfg
            block_shape = (m.n_layers, 2, m.n_kv_heads, self.block_size, m.head_dim)
            fp_cfg = self.model_cfg
        self.max_context = self.model_cfg.max_context
        if llama is None:
            self.fingerprint = fingerprint(fp_cfg, self.dtype, self.block_size)
            self.block_bytes = self.kv_bytes_per_token * self.block_size
        self.seed_hash = chain_seed(self.fingerprint)
        num_blocks = max(4, cfg.cache_bytes // self.block_bytes)
        self.pool = BlockPool(num_blocks, block_shape, self.dtype, self.device)
        self.blocks = BlockManager(num_blocks, self.block_size)
        self.runner: Runner = self._make_runner(cfg, llama)
        self.slots = SlotScheduler(cfg.slots, cfg.queue_max, cfg.queue_timeout_s)
        self.sessions: collections.OrderedDict[str, Sequence] = collections.OrderedDict()  # LRU first
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        # The byte tokenizer masks what a random-weight model may emit; a real model is not masked.
        mask = self.tokenizer.generation_mask()
        self._allowed = None if mask is None else torch.from_numpy(mask)
        self._stop_ids = frozenset(self.tokenizer.eos_ids) | frozenset(self.model_cfg.eos_ids)
        self.counters = EngineCounters()
        # Called with the session id whenever a resident cache is dropped.
        self.on_evict: Callable[[str], None] | None = None

    def _make_runner(self, cfg: EngineConfig, llama: LlamaRunner | None) -> Runner:
        """The back end under the bookkeeping, once the pool exists (runners write into it)."""
        if llama is not None:
            llama.attach(self.pool)
            return llama
        if cfg.kind == "sim":
            sim = SimRunner(self.pool, SimCost(cfg.sim.prefill_tps, cfg.sim.decode_tps), self.tokenizer.vocab_size,
                            seed=self.seed_hash, block_size=self.block_size, slots=cfg.slots)
            if cfg.sim.scripted_reply is None:
                return sim
            # Test only (node.engine.scripted): the real sim runner with its logits replaced by a fixed reply.
            return ScriptedRunner(sim, self.tokenizer.encode(cfg.sim.scripted_reply), self.tokenizer.eos_id)
        weights = load_decoder(self.checkpoint, self.dtype, self.device) if self.checkpoint is not None else None
        return TorchRunner(self.model_cfg, self.pool, cfg.slots, prefill_chunk=cfg.prefill_chunk,
                           first_chunk=cfg.first_chunk, model=weights)

    def _open_llamacpp(self, cfg: EngineConfig) -> LlamaRunner:
        """Load the GGUF model and its context; sets what the other kinds derive from a ModelConfig.

        A block's bytes are llama.cpp's per-sequence state of its positions (node.engine.llamacpp):
        the pool holds raw bytes, block_bytes is the state size of a full block."""
        model = LlamaModel.open(cfg.model, cfg.llamacpp)
        try:
            runner = LlamaRunner(model, cfg.llamacpp, slots=cfg.slots, max_context=cfg.max_context, block_size=self.block_size)
        except BaseException:
            model.close()
            raise
        self.tokenizer = model.tokenizer
        self.dtype, self.device = torch.uint8, torch.device("cpu")
        self.model_cfg = ModelConfig(name=model.path.stem, vocab_size=model.n_vocab, max_context=cfg.max_context)
        self.block_bytes = runner.block_bytes
        self.kv_bytes_per_token = -(-runner.block_bytes // self.block_size)
        self.fingerprint = llama_fingerprint(model, cfg.llamacpp, runner.layout, self.block_size)
        return runner

    # ---- what the engine holds ------------------------------------------------

    def _match(self, session: str, tokens: np.ndarray) -> Match:
        """Longest resident prefix of `tokens`: whole blocks by hash chain (any session's),
        then the session's own last block token by token. No side effects."""
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
        full = len(ids)
        n = full * bs
        # Same prefix as the session's own sequence up to here (the chain hash says so):
        # the session's next block may still match part-way (its unhashed tail, or a
        # full block the prompt only partly repeats).
        same_prefix = seq is not None and (full == 0 or (full <= len(seq.hashes) and seq.hashes[full - 1] == hashes[full - 1]))
        if seq is not None and same_prefix and full < len(seq.block_ids) and n < len(tokens):
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
        seq = self.sessions.get(session)
        return seq.num_tokens if seq else 0

    def block_hash(self, session: str, i: int) -> bytes | None:
        """The chain hash of the session's i-th full block, if the engine holds that block."""
        seq = self.sessions.get(session)
        return seq.hashes[i] if seq is not None and 0 <= i < len(seq.hashes) else None

    def session_tokens(self, session: str) -> np.ndarray | None:
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
        seq = self.sessions.pop(session)
        self.blocks.release(seq.block_ids)
        if self.on_evict is not None:
            self.on_evict(session)

    def evict(self, session: str) -> bool:
        """Drop a session's resident cache (its blocks stay addressable until reused)."""
        seq = self.sessions.get(session)
        if seq is None or seq.busy:
            return False
        self._drop(session)
        self.counters.evicted_sessions += 1
        return True

    def evict_all(self) -> int:
        """Drop every idle session and forget every unreferenced block: a cold cache."""
        n = 0
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
            raise ContextLengthExceeded(
                f"the prompt is {len(tokens)} tokens; this model's context is {self.max_context} tokens",
                param="messages",
            )
        if req.max_tokens < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        return tokens

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TurnBegin | TextDelta | TurnDone]:
        """Run one turn: wait for a slot, reuse what is cached, prefill the rest, decode."""
        tokens = self.validate(req)
        t0 = time.monotonic()
        slot = await self.slots.acquire()
        # One turn per session at a time; the lock lives while anyone holds or awaits it.
        lock, users = self._locks.get(req.session, (asyncio.Lock(), 0))
        self._locks[req.session] = (lock, users + 1)
        try:
            async with lock:
                if req.prepare is not None:
                    await req.prepare()
                async for ev in self._turn(slot, req, tokens, t0):
                    yield ev
        finally:
            self.slots.release(slot)
            lock, users = self._locks[req.session]
            if users == 1:
                del self._locks[req.session]
            else:
                self._locks[req.session] = (lock, users - 1)

    async def _turn(self, slot: int, req: GenerateRequest, tokens: np.ndarray, t0: float) -> AsyncIterator[TurnBegin | TextDelta | TurnDone]:
        bs = self.block_size
        stats = TurnStats(req.session, prompt_tokens=len(tokens), cached_tokens=0, queue_s=time.monotonic() - t0)
        match = self._match(req.session, tokens)
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
            await self.runner.load(slot, load_ids, tokens[:reuse])
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
        logits = await self.runner.forward(slot, tokens[reuse:], reuse)
        stats.prefill_s = time.monotonic() - t2
        self._count_prefill(len(tokens) - reuse, stats.prefill_s, reuse)
        return logits, reuse

    async def _decode(self, slot: int, req: GenerateRequest, pos: int, logits: torch.Tensor, out_ids: list[int],
                      stats: TurnStats, t0: float) -> AsyncGenerator[TextDelta, None]:
        """Sample from `logits` on, one token per step from position `pos`, until a stop or a limit.

        Appends every sampled token to `out_ids` and sets the stats' TTFT and finish reason.
        Text is held back by the longest stop string's length less one, so a stop string
        split across tokens is never streamed."""
        gen = _generator(req.seed)
        decoder = self.tokenizer.incremental_decoder()
        text, emitted = "", 0
        hold = max((len(s) for s in req.stop), default=1) - 1
        while True:
            tok = sample(logits, req.temperature, req.top_p, gen, self._allowed)
            if not out_ids:
                stats.ttft_s = time.monotonic() - t0
            if tok in self._stop_ids:
                stats.finish_reason = "stop"
                break
            out_ids.append(tok)
            text += decoder.decode(self.tokenizer.token_bytes(tok))
            cut = min((i for i in (text.find(s, max(0, emitted - len(s))) for s in req.stop) if i >= 0), default=-1)
            if cut >= 0:
                text = text[:cut]
                stats.finish_reason = "stop"
                break
            if len(text) - hold > emitted:
                yield TextDelta(text[emitted : len(text) - hold])
                emitted = len(text) - hold
            if len(out_ids) >= req.max_tokens or pos + 1 >= self.max_context:
                stats.finish_reason = "length"
                break
            logits = await self.runner.forward(slot, np.array([tok], dtype=np.int32), pos)
            pos += 1
        text += decoder.decode(b"", final=True) if stats.finish_reason == "length" else ""
        if len(text) > emitted:
            yield TextDelta(text[emitted:])

    def _count_prefill(self, n: int, secs: float, reused: int) -> None:
        c = self.counters
        c.prefill_tokens += n
        c.cached_tokens += reused
        c.prefill_s += secs
        if n >= 256 and secs > 0:
            c.recent_prefill_tps.append(n / secs)

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


class ImportTxn:
    """A replica import in progress: blocks reserved, bytes landing, hashes advertised on commit."""

    def __init__(self, engine: Engine, session: str, tokens: np.ndarray, hashes: list[bytes]):
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
