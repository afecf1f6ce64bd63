"""Runners: TorchRunner chunking and workspace <-> pool moves; SimRunner determinism and KV bytes."""

from __future__ import annotations

import asyncio
import zlib

import numpy as np
import pytest
import torch
import xxhash

from kvmesh.node.engine.blocks import BlockPool
from kvmesh.node.engine.hashing import block_hashes
from kvmesh.node.engine.decoder import preset
from kvmesh.node.engine.runner import SimCost, SimRunner, TorchRunner, blocks_for
from kvmesh.node.engine.simkv import block_bytes, kv_words

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
            await r.load(1, ids, toks)
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


SEED = bytes(range(16))
KVPT = 32  # sim KV bytes per token in these runner tests


def _sim_runner(blocks: int = 8) -> SimRunner:
    pool = BlockPool(blocks, (BS * KVPT,), torch.uint8, CPU)
    return SimRunner(pool, SimCost(prefill_tps=1e9, decode_tps=1e9), 262, seed=SEED, block_size=BS, slots=2)


def test_sim_kv_bytes_of_a_token_depend_on_its_prefix_only() -> None:
    """A token's sim KV bytes change with the previous block's hash and any token up to it, never with later ones."""
    toks = _toks(BS)
    full = kv_words(SEED, toks, KVPT, BS)
    assert full.shape == (BS, KVPT // 8)
    assert np.array_equal(kv_words(SEED, toks[:5], KVPT, BS), full[:5])  # a partial block is the full one's front
    assert np.array_equal(kv_words(SEED, toks[:9], KVPT, BS, first=5), full[5:9])
    later = toks.copy()
    later[7] ^= 1
    other = kv_words(SEED, later, KVPT, BS)
    assert np.array_equal(other[:7], full[:7])
    assert all(not np.array_equal(other[t], full[t]) for t in range(7, BS))
    moved = kv_words(bytes(16), toks, KVPT, BS)
    assert all(not np.array_equal(moved[t], full[t]) for t in range(BS))


@pytest.mark.parametrize(("kvpt", "bs"), [(400, 256), (20480, 16)])
def test_sim_kv_bytes_compress_like_bf16_kv(kvpt: int, bs: int) -> None:
    """Sim blocks are bf16 values with exponents in a narrow band; zlib shrinks them 1.05-1.5x, not to nothing."""
    words = kv_words(xxhash.xxh3_128_digest(b"block"), _toks(bs), kvpt, bs)
    raw = words.tobytes()
    ratio = len(raw) / len(zlib.compress(raw, 6))
    assert 1.05 <= ratio <= 1.5, ratio
    exps = (words.view("<u2") >> 7) & 0xFF
    assert int(exps.min()) == 120 and int(exps.max()) == 127


def test_sim_runner_logits_follow_the_kv_in_the_pool() -> None:
    """Logits after loading stored blocks equal a full prefill's; one flipped pool byte changes them."""
    r = _sim_runner()
    toks = _toks(3 * BS + 5)  # 3 full blocks and a partial one
    ids = [6, 1, 4, 2]

    async def go() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        cold = await r.forward(0, toks, 0)
        for j, bid in enumerate(ids):
            await r.store(0, bid, j, r._ctx[0].chain[j] if j < 3 else None)
        await r.load(1, ids, toks[: 3 * BS + 2])  # the partial block's first two tokens come from the pool too
        warm = await r.forward(1, toks[3 * BS + 2 :], 3 * BS + 2)
        r.pool.raw[ids[1] * r.pool.block_bytes + 77] ^= 0x01  # behind the engine's back
        await r.load(1, ids, toks[: 3 * BS + 2])
        flipped = await r.forward(1, toks[3 * BS + 2 :], 3 * BS + 2)
        step = await r.forward(1, toks[:1], len(toks))
        return cold, warm, flipped, step

    try:
        cold, warm, flipped, step = asyncio.run(go())
    finally:
        r.close()
    assert cold.shape == (262,)
    assert torch.equal(cold, warm)
    assert not torch.equal(cold, flipped)
    assert not torch.equal(flipped, step)


def test_sim_runner_store_writes_sim_kv_bytes() -> None:
    """Store writes each block's sim KV bytes (partial blocks: their tokens' bytes) and refuses a wrong hash."""
    r = _sim_runner()
    toks = _toks(BS + 3)
    try:
        asyncio.run(r.forward(0, toks, 0))
        chain = r._ctx[0].chain
        assert chain == block_hashes(SEED, toks, BS)
        asyncio.run(r.store(0, 5, 0, chain[0]))
        asyncio.run(r.store(0, 2, 1, None))
        with pytest.raises(RuntimeError):
            asyncio.run(r.store(0, 3, 0, bytes(16)))
    finally:
        r.close()
    assert bytes(r.pool.read_bytes(5)) == block_bytes(SEED, toks[:BS], KVPT, BS)
    assert bytes(r.pool.read_bytes(2))[: 3 * KVPT] == block_bytes(chain[0], toks[BS:], KVPT, BS)
    assert int(r.pool.raw[3 * r.pool.block_bytes : 4 * r.pool.block_bytes].count_nonzero()) == 0


def test_sim_runner_refuses_a_forward_that_skips_context() -> None:
    """A forward must start where the slot's context ends: the digest covers every token once."""
    r = _sim_runner()
    try:
        with pytest.raises(RuntimeError):
            asyncio.run(r.forward(0, _toks(3), 10))
    finally:
        r.close()


@pytest.mark.parametrize(("n", "want"), [(0, 0), (1, 1), (16, 1), (17, 2), (48, 3)])
def test_blocks_for_rounds_up(n: int, want: int) -> None:
    """blocks_for is ceil(n / block_size)."""
    assert blocks_for(n, BS) == want
