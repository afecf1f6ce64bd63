"""HostTier: the host-memory tier's staging, lookups by chain hash, pins and LRU reuse, and restores from it
into an engine (kv_share's store import taking each block it holds from memory, the rest from disk)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvmesh.node.engine.engine import Engine
from kvmesh.node.engine.hashing import block_hashes, payload_digest
from kvmesh.node.errors import ImportRefused
from kvmesh.node.kvshare.hosttier import HostTier
from kvmesh.node.kvshare.store import ReplicaStore

from .helpers import prompt_tokens, run_turn

BB = 64  # block bytes of the synthetic tiers


def blocks(n: int, seed: int = 0) -> tuple[list[bytes], list[np.ndarray]]:
    """n distinct (hash, tokens) pairs of 4-token blocks."""
    rng = np.random.default_rng(seed)
    toks = [rng.integers(0, 1000, 4, dtype=np.int32) for _ in range(n)]
    return [bytes([seed, i]) * 8 for i in range(n)], toks


def touched(n: int) -> HostTier:
    t = HostTier(n, BB)
    t.pretouch()
    return t


def fill(t: HostTier, hashes: list[bytes], toks: list[np.ndarray]) -> list[int]:
    """Stage the blocks, write each one's bytes (its index), mark them whole and let go of them."""
    st = t.stage(hashes, toks)
    assert st is not None
    for k, bid in enumerate(st.ids):
        if st.copy[k]:
            t.view(bid)[:] = k
    t.staged_whole(st)
    t.unpin(st.ids)
    return st.ids


def test_a_staged_block_is_found_by_its_hash_and_tokens_only_once_whole() -> None:
    """A block being staged is not readable; once whole it is found by hash, and only with its own tokens."""
    t = touched(4)
    hashes, toks = blocks(2)
    st = t.stage(hashes, toks)
    assert st is not None and st.copy == [True, True]
    assert not t.holds(hashes[0], toks[0])  # still being copied in
    t.staged_whole(st)
    assert t.holds(hashes[0], toks[0]) and t.holds(hashes[1], toks[1])
    assert not t.holds(hashes[0], toks[1])  # a hash collision is ruled out by the tokens


def test_staging_a_held_block_again_copies_nothing() -> None:
    """A block the tier holds already is pinned again, not copied a second time."""
    t = touched(4)
    hashes, toks = blocks(2)
    fill(t, hashes, toks)
    st = t.stage(hashes, toks)
    assert st is not None and st.copy == [False, False]
    t.unpin(st.ids)


def test_unpinned_blocks_are_reused_least_recently_used_first_and_pinned_ones_never() -> None:
    """A full tier gives up its least recently used unpinned block; a pinned block is never given up."""
    t = touched(3)
    a, ta = blocks(1, seed=1)
    b, tb = blocks(1, seed=2)
    c, tc = blocks(1, seed=3)
    fill(t, a, ta)
    fill(t, b, tb)
    fill(t, c, tc)
    pinned = t.pin(a[0], ta[0])  # a: used last, and pinned
    assert pinned is not None
    d, td = blocks(1, seed=4)
    fill(t, d, td)
    assert t.holds(a[0], ta[0]) and not t.holds(b[0], tb[0]) and t.holds(c[0], tc[0])
    e, te = blocks(3, seed=5)
    st = t.stage(e, te)  # room for two: c and d go; a is pinned
    assert st is not None and len(st.ids) == 2
    assert t.holds(a[0], ta[0]) and not t.holds(c[0], tc[0]) and not t.holds(d[0], td[0])
    t.unpin(st.ids + [pinned])


def test_stage_reserves_the_leading_blocks_there_is_room_for() -> None:
    """Without room for every block, staging reserves the leading ones that fit; none fit: None."""
    t = touched(2)
    hashes, toks = blocks(3)
    st = t.stage(hashes, toks)
    assert st is not None and len(st.ids) == 2
    assert t.stage(*blocks(1, seed=9)) is None  # both pinned
    t.unpin(st.ids)  # never made whole: nothing of it is kept
    assert not t.holds(hashes[0], toks[0])


def test_blocks_are_handed_out_only_once_touched() -> None:
    """Before pretouch, the tier has no block to stage into (a fresh page is never faulted in by a stage)."""
    t = HostTier(2, BB)
    assert t.stage(*blocks(1)) is None
    t.pretouch()
    assert t.stage(*blocks(1)) is not None


def test_unpinning_more_than_pinned_raises() -> None:
    """A pin count below zero is a bug, not a silent free."""
    t = touched(1)
    ids = fill(t, *blocks(1))
    with pytest.raises(RuntimeError):
        t.unpin(ids)


# ---- restores into an engine ------------------------------------------------------------------------


def tier_of(engine: Engine, session: str, which: range | list[int] | None = None) -> HostTier:
    """A tier holding the session's whole blocks (those of `which`, default all), copied from the engine's
    pool as a write-behind stages them."""
    t = HostTier(engine.pool.num_blocks, engine.block_bytes)
    t.pretouch()
    pinned = engine.pin(session)
    assert pinned is not None
    bs = engine.block_size
    idx = list(range(len(pinned.hashes)) if which is None else which)
    st = t.stage([pinned.hashes[i] for i in idx], [pinned.tokens[i * bs : (i + 1) * bs] for i in idx])
    assert st is not None and len(st.ids) == len(idx)
    for bid, i in zip(st.ids, idx, strict=True):
        np.copyto(t.view(bid), np.frombuffer(pinned.read(pinned.ids[i]), dtype=np.uint8))
    t.staged_whole(st)
    t.unpin(st.ids)
    pinned.release()
    return t


def test_a_restore_takes_the_tier_blocks_with_no_stored_replica(engine: Engine, tmp_path: Path) -> None:
    """An evicted session the store never held comes back whole from the tier, byte for byte."""
    prompt = prompt_tokens(6 * engine.block_size + 10)
    run_turn(engine, "s", prompt)
    with engine.export("s") as exported:
        want = [bytes(b.data) for b in exported]
    tier = tier_of(engine, "s")
    engine.evict_all()
    store = ReplicaStore(tmp_path, 1 << 30, fsync="never")
    hashes = block_hashes(engine.seed_hash, prompt, engine.block_size)
    imp = store.begin_restore(engine, "s", tier, tokens=prompt, hashes=hashes)
    imp.copy()
    assert imp.txn.commit() == len(hashes) * engine.block_size
    with engine.export("s") as exported:
        assert [bytes(b.data) for b in exported] == want
    assert tier.hits == len(hashes)
    assert tier.stats()["pinned_blocks"] == 0


def test_a_restore_takes_the_store_for_blocks_the_tier_lacks(engine: Engine, tmp_path: Path) -> None:
    """The stored blocks come from disk (digest checked), the tier's from memory, in one import."""
    bs = engine.block_size
    prompt = prompt_tokens(6 * bs + 10)
    run_turn(engine, "s", prompt)
    store = ReplicaStore(tmp_path, 1 << 30, fsync="never")
    with engine.export("s") as exported:
        want = [bytes(b.data) for b in exported]
        with store.begin_write("s", fingerprint=engine.fingerprint, block_size=bs, block_bytes=engine.block_bytes,
                               tokens=prompt[: 3 * bs], hashes=[b.hash for b in exported[:3]], first_block=0,
                               generation=1) as w:
            for b in exported[:3]:
                w.write_block(b.index, b.data, payload_digest(b.data))
            w.commit()
    tier = tier_of(engine, "s", range(3, 6))  # the store holds the first three, the tier the rest
    engine.evict_all()
    hashes = block_hashes(engine.seed_hash, prompt, bs)
    imp = store.begin_restore(engine, "s", tier, tokens=prompt, hashes=hashes)
    assert sorted(imp.from_tier) == list(range(3, len(hashes)))
    imp.copy()
    imp.txn.commit()
    with engine.export("s") as exported:
        assert [bytes(b.data) for b in exported] == want


def test_a_restore_stops_at_the_first_block_neither_tier_nor_store_holds(engine: Engine, tmp_path: Path) -> None:
    """The tier lacks block 3 and nothing is stored: the restore brings blocks 0-2 back, nothing after the gap."""
    bs = engine.block_size
    prompt = prompt_tokens(6 * bs)
    run_turn(engine, "s", prompt)
    tier = tier_of(engine, "s", [0, 1, 2, 4, 5])
    engine.evict_all()
    store = ReplicaStore(tmp_path, 1 << 30, fsync="never")
    hashes = block_hashes(engine.seed_hash, prompt, bs)
    imp = store.begin_restore(engine, "s", tier, tokens=prompt, hashes=hashes)
    imp.copy()
    assert imp.txn.commit() == 3 * bs
    assert tier.stats()["pinned_blocks"] == 0


def test_a_restore_nothing_holds_is_refused_and_reserves_nothing(engine: Engine, tmp_path: Path) -> None:
    """Neither the tier nor the store holds the first block: refused, the engine's pool untouched."""
    prompt = prompt_tokens(4 * engine.block_size)
    run_turn(engine, "s", prompt)
    engine.evict_all()
    free = engine.blocks.num_free
    store = ReplicaStore(tmp_path, 1 << 30, fsync="never")
    tier = HostTier(4, engine.block_bytes)
    hashes = block_hashes(engine.seed_hash, prompt, engine.block_size)
    with pytest.raises(ImportRefused):
        store.begin_restore(engine, "s", tier, tokens=prompt, hashes=hashes)
    assert engine.blocks.num_free == free and "s" not in engine.sessions
