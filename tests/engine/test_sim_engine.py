"""The sim engine: same interface, cost model, real KV bytes from the hash chain, replies that depend on them."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from kvmesh.node.config import SimConfig
from kvmesh.node.engine.engine import Engine
from kvmesh.node.engine.simkv import block_bytes
from kvmesh.node.errors import ContextLengthExceeded, ImportRefused

PROMPT_LEN = 200


def _prompt(engine: Engine, text: str = "a sim conversation about warm caches " * 8) -> list[int]:
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text[: PROMPT_LEN - 4]}])


def test_sim_geometry_follows_config(make_engine, sim_cfg) -> None:  # type: ignore[no-untyped-def]
    """KV bytes per token are kv_bytes_per_token * kv_scale in 16-byte words; the pool fills cache_bytes."""
    e = make_engine(cfg=sim_cfg())
    assert e.kv_bytes_per_token == 16
    assert e.block_bytes == 16 * e.block_size
    assert e.pool.num_blocks == (1 << 20) // e.block_bytes
    assert e.max_context == 131072
    big = make_engine(cfg=sim_cfg(sim=SimConfig(kv_scale=1 / 640, decode_tps=1e6, prefill_tps=1e7)))
    assert big.kv_bytes_per_token == 32
    assert big.fingerprint != e.fingerprint


def test_sim_kv_bytes_follow_the_hash_chain(make_engine, sim_cfg, turn) -> None:  # type: ignore[no-untyped-def]
    """Every stored full block holds simkv's bytes for (previous hash, its tokens), so two sim engines agree byte for byte."""
    a, b = make_engine(cfg=sim_cfg()), make_engine(cfg=sim_cfg())
    p = _prompt(a)
    ra, rb = turn(a, "s", p, max_tokens=10), turn(b, "s", p, max_tokens=10)
    assert ra.text == rb.text and ra.stats.completion_tokens == 10
    assert a.fingerprint == b.fingerprint
    with a.export("s") as xa, b.export("s") as xb:
        assert len(xa) == a.resident_tokens("s") // a.block_size >= 10
        prev = a.seed_hash
        for ba, bb in zip(xa, xb):
            assert ba.hash == bb.hash
            assert bytes(ba.data) == block_bytes(prev, ba.tokens, a.kv_bytes_per_token, a.block_size)
            assert bytes(ba.data) == bytes(bb.data)
            prev = ba.hash


def test_sim_reply_changes_when_a_pooled_block_changes(make_engine, sim_cfg, turn, chat) -> None:  # type: ignore[no-untyped-def]
    """One byte flipped in a pooled block behind the engine's back changes the next reply; unflipped, it is unchanged."""
    clean, flipped = make_engine(cfg=sim_cfg()), make_engine(cfg=sim_cfg())
    msgs = [{"role": "user", "content": "a sim conversation about warm caches " * 5}]
    p1 = chat(clean, msgs)
    r1 = turn(clean, "s", p1, max_tokens=8)
    assert turn(flipped, "s", p1, max_tokens=8).text == r1.text
    p2 = chat(clean, msgs + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "go on"}])
    seq = flipped.sessions["s"]
    bid = seq.block_ids[len(seq.hashes) // 2]  # a full block in the middle of the session
    flipped.pool.raw[bid * flipped.block_bytes + 5] ^= 0x40
    r_clean, r_flipped = turn(clean, "s", p2, max_tokens=8), turn(flipped, "s", p2, max_tokens=8)
    assert r_clean.stats.cached_tokens == r_flipped.stats.cached_tokens > (len(seq.hashes) // 2 + 1) * clean.block_size
    assert r_clean.text != r_flipped.text


def test_sim_reply_is_the_same_prefilled_or_imported_and_differs_on_a_corrupt_import(make_engine, sim_cfg, turn, chat) -> None:  # type: ignore[no-untyped-def]
    """The next reply is the same whether the KV was prefilled (partial last block included) or imported; a corrupt import changes it."""
    a, b, bad, cold = (make_engine(cfg=sim_cfg()) for _ in range(4))
    msgs = [{"role": "user", "content": "a sim conversation about warm caches " * 5}]
    p1 = chat(a, msgs)
    r1 = turn(a, "s", p1, max_tokens=8)
    assert a.resident_tokens("s") % a.block_size, "the test needs a partial last block on the prefilling engine"
    with a.export("s") as blocks:
        tokens = np.concatenate([x.tokens for x in blocks])
        hashes = [x.hash for x in blocks]
        data = [bytes(x.data) for x in blocks]
    b.import_blocks("s", a.fingerprint, tokens, hashes, data)
    corrupt = list(data)
    corrupt[1] = corrupt[1][:9] + bytes([corrupt[1][9] ^ 0x01]) + corrupt[1][10:]
    bad.import_blocks("s", a.fingerprint, tokens, hashes, corrupt)
    p2 = chat(a, msgs + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "go on"}])
    ra, rb, rbad, rcold = (turn(e, "s", p2, max_tokens=8) for e in (a, b, bad, cold))
    assert ra.stats.cached_tokens > len(tokens) == rb.stats.cached_tokens == rbad.stats.cached_tokens
    assert rcold.stats.cached_tokens == 0
    assert ra.text == rb.text == rcold.text
    assert rbad.text != ra.text


def test_sim_kv_blocks_compress_like_real_kv(make_engine, sim_cfg, turn) -> None:  # type: ignore[no-untyped-def]
    """Exported sim blocks at the chaos drill's scale shrink 1.05-1.5x under zlib, like lossless bf16 KV, not to nothing."""
    e = make_engine(cfg=sim_cfg(block_size=256, cache_bytes=16 << 20, sim=SimConfig(kv_scale=0.02, prefill_tps=1e7, decode_tps=1e6)))
    assert e.kv_bytes_per_token == 400
    turn(e, "s", [65 + i % 26 for i in range(3 * 256 + 10)], max_tokens=2)
    with e.export("s") as blocks:
        assert len(blocks) == 3
        for x in blocks:
            raw = bytes(x.data)
            assert 1.05 <= len(raw) / len(zlib.compress(raw, 6)) <= 1.5


def test_sim_export_import_round_trip(make_engine, sim_cfg, turn, check_refs) -> None:  # type: ignore[no-untyped-def]
    """A sim replica imports into another sim engine and makes its next turn warm with the same output."""
    a, b = make_engine(cfg=sim_cfg()), make_engine(cfg=sim_cfg())
    msgs = [{"role": "user", "content": "a sim conversation about warm caches " * 5}]
    p1 = a.tokenizer.apply_chat_template(msgs)
    r1 = turn(a, "s", p1, max_tokens=8)
    msgs += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "go on"}]
    p2 = a.tokenizer.apply_chat_template(msgs)
    assert p2[: len(p1)] == p1
    with a.export("s") as blocks:
        tokens = np.concatenate([x.tokens for x in blocks])
        n = b.import_blocks("s", a.fingerprint, tokens, [x.hash for x in blocks], [x.data for x in blocks])
    assert n == len(tokens) and n >= (len(p1) // a.block_size) * a.block_size
    assert b.cached_prefix("s", p2) == n
    ra, rb = turn(a, "s", p2, max_tokens=8), turn(b, "s", p2, max_tokens=8)
    assert rb.stats.cached_tokens == n
    assert ra.text == rb.text
    check_refs(a)
    check_refs(b)


def test_sim_and_tiny_caches_never_mix(make_engine, sim_cfg, turn) -> None:  # type: ignore[no-untyped-def]
    """A sim replica offered to a torch engine is refused on fingerprint."""
    a = make_engine(cfg=sim_cfg())
    t = make_engine(block_size=16)
    turn(a, "s", _prompt(a), max_tokens=2)
    with a.export("s") as blocks:
        tokens = np.concatenate([x.tokens for x in blocks])
        with pytest.raises(ImportRefused) as ei:
            t.import_blocks("s", a.fingerprint, tokens, [x.hash for x in blocks], [x.data for x in blocks])
    assert ei.value.reason == "fingerprint"
    assert t.blocks.num_free == t.pool.num_blocks


def test_sim_context_limit_comes_from_sim_config(make_engine, sim_cfg, turn) -> None:  # type: ignore[no-untyped-def]
    """The sim engine's context limit is sim.max_context."""
    e = make_engine(cfg=sim_cfg(sim=SimConfig(kv_scale=1 / 1280, decode_tps=1e6, prefill_tps=1e7, max_context=64)))
    with pytest.raises(ContextLengthExceeded):
        turn(e, "s", [65] * 64, max_tokens=2)
    st = turn(e, "s", [65] * 63, max_tokens=2).stats
    assert (st.finish_reason, st.completion_tokens) in {("length", 1), ("stop", 0)}


def test_prefill_backlog_counts_a_prompt_while_it_prefills(make_engine, sim_cfg, run_turn) -> None:  # type: ignore[no-untyped-def]
    """While a 20k-token prompt prefills (1 s at the sim's 20k tokens/s), prefill_backlog() says so; after, 0."""
    import asyncio

    e = make_engine(cfg=sim_cfg(sim=SimConfig(prefill_tps=20_000.0, decode_tps=1000.0), max_context=32768))
    prompt = e.tokenizer.apply_chat_template([{"role": "user", "content": "x" * 20_000}])

    async def go() -> list[int]:
        seen: list[int] = []
        task = asyncio.create_task(run_turn(e, "s", prompt, max_tokens=2))
        while not task.done():
            seen.append(e.prefill_backlog())
            await asyncio.sleep(0.05)
        await task
        return seen

    seen = asyncio.run(go())
    assert max(seen) >= 19_000 and e.prefill_backlog() == 0, seen[:5]
