"""Runners: TorchRunner chunking and workspace <-> pool moves; SimRunner determinism and KV bytes."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from kvmesh.node.engine.blocks import BlockPool
from kvmesh.node.engine.model import preset
from kvmesh.node.engine.runner import SimCost, SimRunner, TorchRunner, blocks_for, fill_from_hash

BS = 16
CPU = torch.device("cpu")


def _torch_runner(first_chunk: int, prefill_chunk: int, slots: int = 2) -> TorchRunner:
    cfg = preset("tiny", max_context=256)
    pool = BlockPool(16, (cfg.n_layers, 2, cfg.n_kv_heads, BS, cfg.head_dim), torch.float32, CPU)
    return TorchRunner(cfg, pool, slots, prefill_chunk=prefill_chunk, first_chunk=first_chunk)


def _toks(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n).astype(np.int32)


def test_torch_runner_chunks_like_one_shot() -> None:
    """A runner with tiny first/prefill chunks returns the same logits and KV as one big chunk."""
    small, big = _torch_runner(first_chunk=32, prefill_chunk=24), _torch_runner(first_chunk=256, prefill_chunk=256)
    try:
        toks = _toks(150)

        async def go() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
            a = await small.forward(0, toks, 0)
            b = await big.forward(0, toks, 0)
            # A continuation at start>0 also chunks (prefill_chunk applies there).
            more = _toks(60, seed=1)
            a2 = await small.forward(0, more, 150)
            b2 = await big.forward(0, more, 150)
            return a, b, a2, b2

        a, b, a2, b2 = asyncio.run(go())
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
        torch.testing.assert_close(a2, b2, atol=1e-4, rtol=0)
        torch.testing.assert_close(small.ws[0][:, :, :, :210], big.ws[0][:, :, :, :210], atol=1e-5, rtol=0)
    finally:
        small.close()
        big.close()


def test_torch_runner_store_then_load_restores_workspace() -> None:
    """Blocks stored from slot 0 and loaded into slot 1 reproduce the KV and the next-token logits."""
    r = _torch_runner(first_chunk=256, prefill_chunk=256)
    try:
        toks = _toks(3 * BS + 5)  # 3 full blocks and a partial one
        nxt = _toks(1, seed=2)

        async def go() -> tuple[torch.Tensor, torch.Tensor]:
            await r.forward(0, toks, 0)
            ids = [7, 2, 11, 4]
            for j, bid in enumerate(ids):
                await r.store(0, bid, j, None)
            await r.load(1, ids, len(toks))
            a = await r.forward(0, nxt, len(toks))
            b = await r.forward(1, nxt, len(toks))
            return a, b

        a, b = asyncio.run(go())
        n = len(toks)
        assert torch.equal(r.ws[1][:, :, :, :n], r.ws[0][:, :, :, :n])
        assert torch.equal(a, b)
        assert torch.equal(r.pool.kv[7], r.ws[0][:, :, :, :BS])
        assert torch.equal(r.pool.kv[2], r.ws[0][:, :, :, BS : 2 * BS])
    finally:
        r.close()


def test_sim_runner_logits_are_deterministic() -> None:
    """Sim logits depend only on (position, last token): same inputs agree, others differ."""
    pool = BlockPool(4, (BS * 16,), torch.uint8, CPU)
    r1 = SimRunner(pool, SimCost(prefill_tps=1e9, decode_tps=1e9), 262)
    r2 = SimRunner(pool, SimCost(prefill_tps=1e9, decode_tps=1e9), 262)

    async def go() -> list[torch.Tensor]:
        t = np.array([1, 2, 3], dtype=np.int32)
        return [
            await r1.forward(0, t, 10),
            await r2.forward(1, t, 10),
            await r1.forward(0, np.array([9, 3], dtype=np.int32), 11),  # same end position, same last token
            await r1.forward(0, t, 11),
        ]

    a, b, c, d = asyncio.run(go())
    assert a.shape == (262,)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(a, d)


def test_sim_runner_store_fills_block_from_hash() -> None:
    """Sim store writes the 16-byte block hash repeated across the block (or the index when unhashed)."""
    pool = BlockPool(4, (BS * 16,), torch.uint8, CPU)
    r = SimRunner(pool, SimCost(), 262)
    h = bytes(range(16))
    asyncio.run(r.store(0, 2, 0, h))
    asyncio.run(r.store(0, 3, 5, None))
    assert bytes(pool.read_bytes(2)) == h * (pool.block_bytes // 16)
    assert bytes(pool.read_bytes(3)) == (5).to_bytes(16, "little") * (pool.block_bytes // 16)
    assert int(pool.raw[: 2 * pool.block_bytes].count_nonzero()) == 0


def test_fill_from_hash_uses_first_16_bytes() -> None:
    """fill_from_hash tiles exactly the first 16 bytes of the hash over the buffer."""
    buf = bytearray(64)
    fill_from_hash(memoryview(buf), bytes(range(20)))
    assert bytes(buf) == bytes(range(16)) * 4


@pytest.mark.parametrize(("n", "want"), [(0, 0), (1, 1), (16, 1), (17, 2), (48, 3)])
def test_blocks_for_rounds_up(n: int, want: int) -> None:
    """blocks_for is ceil(n / block_size)."""
    assert blocks_for(n, BS) == want
