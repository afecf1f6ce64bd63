"""Execution: the torch model runner and the sim runner, behind one interface.

A runner computes KV for a slot and moves it between the slot's workspace and
the block pool. The engine owns all bookkeeping; runners only touch tensors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import xxhash

from kvmesh.node.engine.batcher import DecodeBatcher, DecodeStep
from kvmesh.node.engine.blocks import BlockPool
from kvmesh.node.engine.decoder import Decoder, ModelConfig
from kvmesh.node.engine.hashing import TOKEN_DTYPE, block_hashes
from kvmesh.node.engine.simkv import fill_block, kv_words, update_digest


class Runner(Protocol):
    """What the engine needs from an executor of the model."""

    async def load(self, slot: int, block_ids: list[int], tokens: np.ndarray) -> int | None:
        """Start the slot's turn from these pool blocks, which hold the KV of `tokens` (reused). Returns the
        tokens the slot then holds where that can be fewer (a window-mode llama.cpp model), else None."""

    async def forward(self, slot: int, tokens: np.ndarray, start: int) -> torch.Tensor:
        """Compute KV for tokens at start.. and return the last position's logits: [vocab]."""

    async def store(self, slot: int, block_id: int, block_index: int, block_hash: bytes | None) -> None:
        """Write block `block_index` of the slot's workspace into pool block `block_id`."""

    def close(self) -> None: ...


class TorchRunner:
    """Runs the decoder on one compute thread; the event loop stays free for I/O.

    Decode steps of different slots are batched: a one-token forward joins a pending
    list, and one compute job takes every step pending when it starts and runs them
    as one `Decoder.decode` (the weights are read once per batch, not once per slot).
    Steps that arrive while a batch runs form the next batch, so nobody waits for a
    batch to fill."""

    def __init__(self, cfg: ModelConfig, pool: BlockPool, slots: int, *, prefill_chunk: int, first_chunk: int,
                 model: Decoder | None = None):
        self.cfg = cfg
        self.pool = pool
        self.prefill_chunk = prefill_chunk
        self.first_chunk = first_chunk
        # A checkpoint's weights (node.engine.hf) or, for a preset, seeded ones.
        self.model = model if model is not None else Decoder.seeded(cfg, pool.dtype, pool.device)
        _, _, kv_heads, block, head_dim = pool.block_shape
        self.block_size = block
        # Per-slot workspaces: [layers, 2, kv_heads, max_ctx, head_dim], allocated
        # and touched once; a turn gathers its cached blocks in, computes, stores out.
        self.ws = [
            torch.zeros(cfg.n_layers, 2, kv_heads, cfg.max_context, head_dim, dtype=pool.dtype, device=pool.device)
            for _ in range(slots)
        ]
        self._exec = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvmesh-compute")
        self.decoder = DecodeBatcher(self._exec, self._decode_batch)
        self._warmup()

    def _warmup(self) -> None:
        """One short prefill and one cached chunk at start, so the first turn does not pay
        torch's one-time kernel and allocator set-up."""
        toks = np.arange(32, dtype=np.int64) % self.cfg.vocab_size
        self._forward(0, toks[:16], 0)
        self._forward(0, toks[16:], 16)
        self._forward(0, toks[:1], 32)

    async def _run(self, fn, *args):  # type: ignore[no-untyped-def]
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    async def load(self, slot: int, block_ids: list[int], tokens: np.ndarray) -> None:
        if len(tokens):
            await self._run(self._load, slot, block_ids, len(tokens))

    def _load(self, slot: int, block_ids: list[int], n_tokens: int) -> None:
        bs = self.block_size
        ws = self.ws[slot]
        idx = torch.tensor(block_ids, device=self.pool.device)
        # src: [n, layers, 2, kv_heads, bs, head_dim] -> [layers, 2, kv_heads, n*bs, head_dim]
        src = self.pool.kv.index_select(0, idx).permute(1, 2, 3, 0, 4, 5)
        L, two, H, n, _, D = src.shape
        ws[:, :, :, : n * bs].view(L, two, H, n, bs, D).copy_(src)
        # Tokens past n_tokens in the last block are stale; they are overwritten before use.

    async def forward(self, slot: int, tokens: np.ndarray, start: int) -> torch.Tensor:
        if len(tokens) == 1 and start > 0:
            return await self.decoder.step(slot, int(tokens[0]), start)
        logits = None
        pos = start
        first = True
        while pos < start + len(tokens) or first:
            limit = self.first_chunk if pos == 0 else self.prefill_chunk
            chunk = tokens[pos - start : pos - start + limit]
            logits = await self._run(self._forward, slot, chunk, pos)
            pos += len(chunk)
            first = False
        assert logits is not None
        return logits

    def _forward(self, slot: int, chunk: np.ndarray, start: int) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(chunk, dtype=np.int64)).to(self.pool.device)
        return self.model(t, self.ws[slot], start).cpu()

    def _decode_batch(self, steps: list[DecodeStep]) -> torch.Tensor:
        toks = torch.tensor([st.token for st in steps], dtype=torch.int64, device=self.pool.device)
        return self.model.decode(toks, [self.ws[st.slot] for st in steps], [st.pos for st in steps]).cpu()

    async def store(self, slot: int, block_id: int, block_index: int, block_hash: bytes | None) -> None:
        await self._run(self._store, slot, block_id, block_index)

    def _store(self, slot: int, block_id: int, block_index: int) -> None:
        bs = self.block_size
        self.pool.kv[block_id].copy_(self.ws[slot][:, :, :, block_index * bs : (block_index + 1) * bs])

    def close(self) -> None:
        self._exec.shutdown(wait=False, cancel_futures=True)
        self.decoder.cancel_pending()


@dataclass(frozen=True)
class SimCost:
    """The sim engine's cost model (rates of the host it pretends to be)."""

    prefill_tps: float = 20000.0
    decode_tps: float = 60.0


# Byte work below this size runs on the event loop: a thread hop costs more than the work.
_INLINE_BYTES = 256 << 10


class _SimContext:
    """What one slot's attention reads this turn: its tokens and a digest of their KV bytes.

    Full blocks are digested once each, as they are loaded or completed; the partial last
    block keeps a running digest, so a decode step digests one token's bytes."""

    def __init__(self, seed: bytes, block_size: int):
        self.seed = seed
        self.block_size = block_size
        self._tokens = np.empty(1024, dtype=TOKEN_DTYPE)
        self.n = 0
        self.chain: list[bytes] = []  # chain hash of each full block
        self.full = xxhash.xxh3_128()  # running digest over the full blocks' digests, in order
        self.tail = xxhash.xxh3_128()  # running digest of the partial block's bytes so far

    @property
    def tokens(self) -> np.ndarray:
        return self._tokens[: self.n]

    def append_tokens(self, tokens: np.ndarray) -> None:
        need = self.n + len(tokens)
        if need > len(self._tokens):
            grown = np.empty(max(need, 2 * len(self._tokens)), dtype=TOKEN_DTYPE)
            grown[: self.n] = self._tokens[: self.n]
            self._tokens = grown
        self._tokens[self.n : need] = tokens
        self.n = need

    def prev(self, j: int) -> bytes:
        """The chain hash before block j (the seed for block 0)."""
        return self.chain[j - 1] if j else self.seed

    def block_done(self, j: int) -> None:
        """Block j just filled: fold its digest in, hash it into the chain, start a new tail."""
        bs = self.block_size
        self.full.update(self.tail.digest())
        self.chain += block_hashes(self.seed, self.tokens[: (j + 1) * bs], bs, start=j, prev=self.prev(j))
        self.tail = xxhash.xxh3_128()

    def logits_seed(self) -> int:
        """A 63-bit seed from the digest of every KV byte in the context."""
        return xxhash.xxh3_64_intdigest(self.full.digest() + self.tail.digest()) & ((1 << 63) - 1)


class SimRunner:
    """Same interface, a cost model instead of matmuls. KV bytes are real (`simkv`): bf16-like,
    deterministic from the hash chain, so transfers, hashes and imports downstream do real
    work on real bytes. Logits are seeded by a digest of the KV bytes the turn attends: the
    cached blocks as they are in the pool when the turn loads them, and the bytes of every
    token it computes. A wrong, stale or corrupt block in the pool changes the reply."""

    def __init__(self, pool: BlockPool, cost: SimCost, vocab_size: int, *, seed: bytes, block_size: int, slots: int):
        self.pool = pool
        self.cost = cost
        self.vocab_size = vocab_size
        self.seed = seed  # the chain seed (the model fingerprint's)
        self.block_size = block_size
        self.kv_bytes_per_token = pool.block_bytes // block_size
        self._ctx: dict[int, _SimContext] = {}
        self._exec = concurrent.futures.ThreadPoolExecutor(max(1, min(slots, 4)), thread_name_prefix="kvmesh-sim")

    async def _work(self, nbytes: int, fn: Callable[[], None]) -> None:
        """Run byte work off the event loop unless it is small."""
        if nbytes < _INLINE_BYTES:
            fn()
        else:
            await asyncio.get_running_loop().run_in_executor(self._exec, fn)

    async def load(self, slot: int, block_ids: list[int], tokens: np.ndarray) -> None:
        ctx = _SimContext(self.seed, self.block_size)
        self._ctx[slot] = ctx
        await self._work(len(tokens) * self.kv_bytes_per_token, lambda: self._load(ctx, block_ids, tokens))

    def _load(self, ctx: _SimContext, block_ids: list[int], tokens: np.ndarray) -> None:
        bs, kvpt = self.block_size, self.kv_bytes_per_token
        n = len(tokens)
        if len(block_ids) != blocks_for(n, bs):
            raise ValueError(f"{len(block_ids)} blocks for {n} tokens of blocks of {bs}")
        ctx.append_tokens(tokens)
        ctx.chain = block_hashes(self.seed, tokens, bs)
        for j, bid in enumerate(block_ids):
            used = min(bs, n - j * bs)
            # Read from the pool as it is now: a byte changed behind the engine's back is seen.
            view = self.pool.read_bytes(bid)[: used * kvpt]
            if used == bs:
                h = xxhash.xxh3_128()
                update_digest(h, view)
                ctx.full.update(h.digest())
            else:
                update_digest(ctx.tail, view)

    async def forward(self, slot: int, tokens: np.ndarray, start: int) -> torch.Tensor:
        n = len(tokens)
        t0 = time.monotonic()
        ctx = self._ctx.get(slot)
        if start == 0 or ctx is None:
            ctx = self._ctx[slot] = _SimContext(self.seed, self.block_size)
        if start != ctx.n:
            raise RuntimeError(f"slot {slot} holds {ctx.n} tokens of context; a forward at {start} does not follow them")
        toks = np.ascontiguousarray(tokens, dtype=TOKEN_DTYPE)
        await self._work(n * self.kv_bytes_per_token, lambda: self._extend(ctx, toks))
        rate = self.cost.prefill_tps if n > 1 else self.cost.decode_tps
        # The cost model's time includes the real byte work just done.
        await asyncio.sleep(max(0.0, n / rate - (time.monotonic() - t0)))
        return torch.randn(self.vocab_size, generator=torch.Generator().manual_seed(ctx.logits_seed()))

    def _extend(self, ctx: _SimContext, tokens: np.ndarray) -> None:
        """Compute the KV bytes of `tokens` after the context and fold them into its digest."""
        bs, kvpt = self.block_size, self.kv_bytes_per_token
        pos = ctx.n
        ctx.append_tokens(tokens)
        while pos < ctx.n:
            j = pos // bs
            end = min((j + 1) * bs, ctx.n)
            words = kv_words(ctx.prev(j), ctx.tokens[j * bs : end], kvpt, bs, first=pos - j * bs)
            update_digest(ctx.tail, words)
            if end == (j + 1) * bs:
                ctx.block_done(j)
            pos = end

    async def store(self, slot: int, block_id: int, block_index: int, block_hash: bytes | None) -> None:
        ctx = self._ctx[slot]
        bs = self.block_size
        j = block_index
        if block_hash is not None and (j >= len(ctx.chain) or ctx.chain[j] != block_hash):
            raise RuntimeError(f"slot {slot}'s block {j} does not hash to the engine's hash for it")
        toks = ctx.tokens[j * bs : min((j + 1) * bs, ctx.n)]
        if len(toks) == 0:
            raise RuntimeError(f"slot {slot} holds no token of block {j}")
        dst = self.pool.bytes_view(block_id)
        await self._work(len(toks) * self.kv_bytes_per_token,
                         lambda: fill_block(dst, ctx.prev(j), toks, self.kv_bytes_per_token, bs))

    def close(self) -> None:
        self._exec.shutdown(wait=False, cancel_futures=True)


def blocks_for(n_tokens: int, block_size: int) -> int:
    return math.ceil(n_tokens / block_size)
