"""Window snapshots (node.engine.snapshots): keyed by the exact tokens they follow, checked, bounded (their wire
form, a frame of kv_share's push: tests/kvshare/test_snapshot_frames.py)."""

from __future__ import annotations

import numpy as np

from kvmesh.node.engine.snapshots import Snapshots, boundary_keys, snapshot_key


def _store(budget: int = 1 << 20) -> Snapshots:
    # A stand-in check: a blob is "sound" when its first byte says its position in blocks (the real one parses cells).
    return Snapshots(budget, lambda blob, pos: None if blob[0] == pos // 256 else f"blob for {blob[0]}, not {pos}",
                     block_size=256)


def _blob(pos: int, size: int = 100) -> np.ndarray:
    b = np.zeros(size, dtype=np.uint8)
    b[0] = pos // 256
    return b


def test_newest_is_the_furthest_snapshot_the_prompt_extends_exactly() -> None:
    """Of snapshots at 256 and 512, a prompt extending both gets 512; one that differs at token 300 gets 256; one
    that differs at token 0 gets none; a limit below 512 gets 256."""
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 1000, 900).astype(np.int32)
    w = _store()
    assert w.put(toks[:256], _blob(256)) is None and w.put(toks[:512], _blob(512)) is None
    newest = w.newest(toks)
    assert newest is not None and newest.pos == 512
    forked = toks.copy()
    forked[300] += 1
    got = w.newest(forked)
    assert got is not None and got.pos == 256
    other = toks.copy()
    other[0] += 1
    assert w.newest(other) is None
    capped = w.newest(toks, 511)
    assert capped is not None and capped.pos == 256
    assert w.usable(toks, 768) == 512 and w.usable(other, 768) == 0


def test_a_blob_that_does_not_check_is_refused_and_not_kept() -> None:
    """put returns the check's reason, keeps nothing, and counts the refusal."""
    toks = np.arange(256, dtype=np.int32)
    w = _store()
    why = w.put(toks, _blob(512))
    assert why is not None and "not 256" in why
    assert w.put(toks[:200], _blob(0)) == "position 200 is not a multiple of the block size 256"
    assert len(w) == 0 and w.refused == 2 and w.newest(toks) is None


def test_the_budget_drops_the_least_recently_used_first() -> None:
    """Past the byte budget the least recently used snapshot goes; one just used by newest stays."""
    w = _store(budget=250)
    seqs = [np.full(256 * (i + 1), i, dtype=np.int32) for i in range(3)]
    assert w.put(seqs[0], _blob(256)) is None and w.put(seqs[1], _blob(512)) is None
    assert w.newest(seqs[0]) is not None  # seqs[0] is now the most recently used
    assert w.put(seqs[2], _blob(768)) is None
    assert w.bytes == 200 and w.newest(seqs[1]) is None and w.newest(seqs[0]) is not None and w.newest(seqs[2]) is not None


def test_boundary_keys_are_the_one_shot_keys_of_each_block_prefix() -> None:
    """The streaming pass gives, at every block boundary up to the limit, the key of exactly that prefix."""
    toks = np.random.default_rng(2).integers(0, 50000, 1000).astype(np.int32)
    keys = boundary_keys(toks, 256, 900)
    assert [p for p, _ in keys] == [256, 512, 768]
    assert all(k == snapshot_key(toks[:p]) for p, k in keys)
    assert boundary_keys(toks, 256, 255) == []
