"""Execution: the torch model runner and the sim runner, behind one interface.

A runner computes KV for a slot and moves it between the slot's workspace and
the block pool. The engine owns all bookkeeping; runners only touch tensors.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvmesh.node.engine.blocks import BlockPool
from kvmesh.node.engine.model import Decoder, ModelConfig


class Runner(Protocol):
    """What the engine needs from an executor of the model."""

    async def load(self, slot: int, block_ids: list[int], n_tokens: int) -> None:
        """Copy the first n_tokens of these pool blocks into the slot's workspace."""

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
        # Pending decode steps: (slot, token, position, future, loop). Guarded by the lock:
        # the event loop adds, the compute thread takes.
        self._steps: list[tuple[int, int, int, asyncio.Future[torch.Tensor], asyncio.AbstractEventLoop]] = []
        self._steps_lock = threading.Lock()
        self._drain_queued = False
        self.decode_batches = 0  # counters: batches run and steps in them
        self.decode_steps = 0
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

    async def load(self, slot: int, block_ids: list[int], n_tokens: int) -> None:
        if n_tokens:
            await self._run(self._load, slot, block_ids, n_tokens)

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
            return await self._decode_step(slot, int(tokens[0]), start)
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

    async def _decode_step(self, slot: int, token: int, pos: int) -> torch.Tensor:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[torch.Tensor] = loop.create_future()
        with self._steps_lock:
            self._steps.append((slot, token, pos, fut, loop))
            queue = not self._drain_queued
            self._drain_queued = True
        if queue:
            self._exec.submit(self._drain)
        return await fut

    def _drain(self) -> None:
        """Compute thread: run every pending decode step as one batch."""
        with self._steps_lock:
            steps, self._steps = self._steps, []
            self._drain_queued = False
        # A step whose turn was cancelled before the batch started is dropped; one cancelled
        # later only writes its own slot's workspace past what any later turn reads.
        steps = [st for st in steps if not st[3].cancelled()]
        if not steps:
            return
        try:
            toks = torch.tensor([st[1] for st in steps], dtype=torch.int64, device=self.pool.device)
            logits = self.model.decode(toks, [self.ws[st[0]] for st in steps], [st[2] for st in steps]).cpu()
            self.decode_batches += 1
            self.decode_steps += len(steps)
            for i, (_, _, _, fut, loop) in enumerate(steps):
                loop.call_soon_threadsafe(_resolve, fut, logits[i], None)
        except BaseException as e:  # every waiter hears of it; none hangs
            for _, _, _, fut, loop in steps:
                loop.call_soon_threadsafe(_resolve, fut, None, e)

    async def store(self, slot: int, block_id: int, block_index: int, block_hash: bytes | None) -> None:
        await self._run(self._store, slot, block_id, block_index)

    def _store(self, slot: int, block_id: int, block_index: int) -> None:
        bs = self.block_size
        self.pool.kv[block_id].copy_(self.ws[slot][:, :, :, block_index * bs : (block_index + 1) * bs])

    def close(self) -> None:
        self._exec.shutdown(wait=False, cancel_futures=True)
        with self._steps_lock:  # steps whose batch will never run: their turns end as cancelled
            steps, self._steps = self._steps, []
        for _, _, _, fut, loop in steps:
            loop.call_soon_threadsafe(fut.cancel)


def _resolve(fut: asyncio.Future[torch.Tensor], value: torch.Tensor | None, exc: BaseException | None) -> None:
    if fut.done():  # cancelled meanwhile
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        assert value is not None
        fut.set_result(value)


@dataclass(frozen=True)
class SimCost:
    """The sim engine's cost model (rates of the host it pretends to be)."""

    prefill_tps: float = 20000.0
    decode_tps: float = 60.0


class SimRunner:
    """Same interface, a cost model instead of matmuls; KV bytes are real and
    deterministic from the block hash, so transfers, hashes and imports downstream
    do real work on real bytes."""

    def __init__(self, pool: BlockPool, cost: SimCost, vocab_size: int):
        self.pool = pool
        self.cost = cost
        self.vocab_size = vocab_size

    async def load(self, slot: int, block_ids: list[int], n_tokens: int) -> None:
        return None

    async def forward(self, slot: int, tokens: np.ndarray, start: int) -> torch.Tensor:
        n = len(tokens)
        rate = self.cost.prefill_tps if n > 1 else self.cost.decode_tps
        await asyncio.sleep(n / rate)
        # Deterministic pseudo-logits from the position and the last token.
        gen = torch.Generator().manual_seed((start + n) * 1_000_003 + int(tokens[-1]) if n else start)
        return torch.randn(self.vocab_size, generator=gen)

    async def store(self, slot: int, block_id: int, block_index: int, block_hash: bytes | None) -> None:
        fill_from_hash(self.pool.bytes_view(block_id), block_hash or block_index.to_bytes(16, "little"))

    def close(self) -> None:
        return None


def fill_from_hash(buf: memoryview, h: bytes) -> None:
    """Fill a block's bytes with its 16-byte hash repeated (memset speed, deterministic)."""
    words = np.frombuffer(buf, dtype="<u8")
    words.reshape(-1, 2)[:] = np.frombuffer(h[:16], dtype="<u8")


def blocks_for(n_tokens: int, block_size: int) -> int:
    return math.ceil(n_tokens / block_size)
