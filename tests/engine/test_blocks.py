"""BlockPool bytes and BlockManager bookkeeping (hash map, ref counts, LRU free list)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmesh.node.engine.blocks import BlockManager, BlockPool

SHAPE = (2, 2, 2, 4, 8)  # [layers, 2, kv_heads, block, head_dim]
BS = 4


def _pool(n: int = 4) -> BlockPool:
    return BlockPool(n, SHAPE, torch.float32, torch.device("cpu"))


def _toks(*vals: int) -> np.ndarray:
    return np.array(vals, dtype=np.int32)


# ---- BlockPool ---------------------------------------------------------------------


def test_pool_geometry_and_zero_fill() -> None:
    """The pool is one zeroed byte buffer viewed as [num_blocks, *block_shape] typed blocks."""
    p = _pool(3)
    assert p.block_bytes == int(np.prod(SHAPE)) * 4
    assert p.raw.numel() == 3 * p.block_bytes
    assert p.kv.shape == (3, *SHAPE)
    assert p.kv.dtype == torch.float32
    assert int(p.raw.count_nonzero()) == 0
    assert p.kv.data_ptr() == p.raw.data_ptr()  # a view, not a copy


def test_pool_write_then_read_round_trip() -> None:
    """write_bytes lands exactly in one block; read_bytes returns those bytes; neighbours untouched."""
    p = _pool(3)
    payload = np.random.default_rng(0).integers(0, 256, size=p.block_bytes, dtype=np.uint8)
    p.write_bytes(1, payload.tobytes())
    assert bytes(p.read_bytes(1)) == payload.tobytes()
    assert int(p.raw[: p.block_bytes].count_nonzero()) == 0
    assert int(p.raw[2 * p.block_bytes :].count_nonzero()) == 0
    # ndarray and memoryview sources work too.
    p.write_bytes(2, payload)
    p.write_bytes(0, memoryview(payload))
    assert bytes(p.read_bytes(0)) == bytes(p.read_bytes(2)) == payload.tobytes()


def test_pool_typed_and_byte_views_alias() -> None:
    """Bytes written through bytes_view show up in the typed kv view of the same block."""
    p = _pool(2)
    want = torch.arange(int(np.prod(SHAPE)), dtype=torch.float32).view(SHAPE)
    view = p.bytes_view(1)
    assert len(view) == p.block_bytes
    view[:] = want.numpy().tobytes()
    assert torch.equal(p.kv[1], want)
    assert int(p.kv[0].count_nonzero()) == 0


def test_pool_read_bytes_is_zero_copy_on_cpu() -> None:
    """On CPU read_bytes is a live view: a later write is visible through it."""
    p = _pool(2)
    view = p.read_bytes(0)
    p.kv[0].fill_(1.0)
    assert np.frombuffer(view, dtype=np.float32)[0] == 1.0


# ---- BlockManager ------------------------------------------------------------------


def test_allocate_takes_free_blocks_with_one_ref() -> None:
    """allocate(n) returns n distinct blocks at ref 1 and shrinks the free list by n."""
    bm = BlockManager(4, BS)
    ids = bm.allocate(3)
    assert len(set(ids)) == 3
    assert all(bm.blocks[i].ref == 1 for i in ids)
    assert bm.num_free == 1
    assert bm.can_allocate(1) and not bm.can_allocate(2)


def test_allocate_beyond_free_raises() -> None:
    """Asking for more blocks than are free raises and changes nothing."""
    bm = BlockManager(2, BS)
    with pytest.raises(RuntimeError):
        bm.allocate(3)
    assert bm.num_free == 2


def test_released_hashed_block_stays_addressable() -> None:
    """A registered block whose ref drops to 0 is free yet still found by lookup."""
    bm = BlockManager(2, BS)
    (b,) = bm.allocate(1)
    t = _toks(1, 2, 3, 4)
    bm.register(b, b"h" * 16, t)
    bm.release([b])
    assert bm.num_free == 2
    assert bm.lookup(b"h" * 16, t) == b


def test_lookup_compares_tokens() -> None:
    """A hash hit with different tokens is a miss (rules out a collision)."""
    bm = BlockManager(2, BS)
    (b,) = bm.allocate(1)
    bm.register(b, b"h" * 16, _toks(1, 2, 3, 4))
    assert bm.lookup(b"h" * 16, _toks(1, 2, 3, 5)) is None
    assert bm.lookup(b"x" * 16, _toks(1, 2, 3, 4)) is None
    assert bm.lookup(b"h" * 16, _toks(1, 2, 3, 4)) == b


def test_register_copies_tokens() -> None:
    """Mutating the caller's token array after register does not change what the block holds."""
    bm = BlockManager(1, BS)
    (b,) = bm.allocate(1)
    t = _toks(1, 2, 3, 4)
    bm.register(b, b"h" * 16, t)
    t[0] = 99
    assert bm.lookup(b"h" * 16, _toks(1, 2, 3, 4)) == b


def test_unhashed_block_is_reused_before_cached_ones() -> None:
    """A freed block with no hash goes to the front of the free list; a hashed one to the back."""
    bm = BlockManager(3, BS)
    a, b, c = bm.allocate(3)
    bm.register(a, b"a" * 16, _toks(1, 1, 1, 1))
    bm.release([a])  # cached: keep as long as possible
    bm.release([b])  # nothing to keep: reuse first
    assert bm.allocate(1) == [b]
    assert bm.lookup(b"a" * 16, _toks(1, 1, 1, 1)) == a


def test_lru_cached_block_is_evicted_first_and_forgotten() -> None:
    """Among freed cached blocks the least recently freed is handed out first; its hash is forgotten."""
    bm = BlockManager(2, BS)
    a, b = bm.allocate(2)
    bm.register(a, b"a" * 16, _toks(1, 1, 1, 1))
    bm.register(b, b"b" * 16, _toks(2, 2, 2, 2))
    bm.release([a])
    bm.release([b])
    assert bm.allocate(1) == [a]
    assert bm.lookup(b"a" * 16, _toks(1, 1, 1, 1)) is None
    assert b"a" * 16 not in bm.by_hash
    assert bm.blocks[a].hash is None and bm.blocks[a].tokens is None
    assert bm.lookup(b"b" * 16, _toks(2, 2, 2, 2)) == b


def test_acquire_pulls_cached_block_off_free_list() -> None:
    """Acquiring a free cached block removes it from the free list so allocate cannot take it."""
    bm = BlockManager(2, BS)
    a, b = bm.allocate(2)
    bm.register(a, b"a" * 16, _toks(1, 1, 1, 1))
    bm.release([a, b])
    bm.acquire(a)
    assert bm.num_free == 1
    assert bm.allocate(1) == [b]
    assert not bm.can_allocate(1)
    bm.acquire(a)
    assert bm.blocks[a].ref == 2
    bm.release([a])
    assert bm.num_free == 0  # still referenced once
    bm.release([a])
    assert bm.num_free == 1


def test_release_more_than_acquired_raises() -> None:
    """Releasing a block with no reference is an error, not a silent negative count."""
    bm = BlockManager(1, BS)
    (a,) = bm.allocate(1)
    bm.release([a])
    with pytest.raises(RuntimeError):
        bm.release([a])


def test_register_keeps_first_block_for_duplicate_hash() -> None:
    """Registering a second block under an existing hash leaves the map pointing at the first."""
    bm = BlockManager(2, BS)
    a, b = bm.allocate(2)
    t = _toks(1, 2, 3, 4)
    bm.register(a, b"h" * 16, t)
    bm.register(b, b"h" * 16, t)
    assert bm.lookup(b"h" * 16, t) == a
    # Reusing the duplicate must not drop the original's entry.
    bm.release([b])
    assert bm.allocate(1) == [b]
    assert bm.lookup(b"h" * 16, t) == a


def test_forget_all_drops_only_unreferenced_hashes() -> None:
    """forget_all clears hashes of free blocks and keeps those of referenced ones."""
    bm = BlockManager(2, BS)
    a, b = bm.allocate(2)
    bm.register(a, b"a" * 16, _toks(1, 1, 1, 1))
    bm.register(b, b"b" * 16, _toks(2, 2, 2, 2))
    bm.release([a])
    bm.forget_all()
    assert bm.lookup(b"a" * 16, _toks(1, 1, 1, 1)) is None
    assert bm.lookup(b"b" * 16, _toks(2, 2, 2, 2)) == b
    assert bm.num_free == 1
