"""The replica store keeps a session's state snapshot beside its blocks (manifest format 2): across a restart, through
deltas that keep the blocks before it, never past a write that changes them; a corrupt one drops the replica, and a
store of the format before snapshots is dropped with a message that says so."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from kvmesh.node.engine.hashing import payload_digest
from kvmesh.node.kvshare.store.manifest import MANIFEST
from kvmesh.node.kvshare.store.segment import StoreError
from kvmesh.node.kvshare.store import ReplicaStore
from kvmesh.node.protocol import session_key

from .helpers import Replica, grow, make_replica

BUDGET = 64 << 20
BS = 8


def _write(store: ReplicaStore, session: str, rep: Replica, first: int, snapshot: tuple[int, np.ndarray] | None) -> None:
    w = store.begin_write(session, fingerprint=rep.fingerprint, block_size=rep.block_size, block_bytes=rep.block_bytes,
                          tokens=rep.tokens, hashes=rep.hashes, first_block=first, generation=1)
    with w:
        for i in range(first, rep.n_blocks):
            w.write_block(i, rep.payloads[i], rep.digests[i])
        if snapshot is not None:
            w.set_snapshot(snapshot[0], snapshot[1], payload_digest(snapshot[1]))
        w.commit()


def _blob(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, 500, dtype=np.uint8)


def test_a_snapshot_written_with_the_blocks_is_read_back_after_a_restart(tmp_path: Path) -> None:
    """The store names the snapshot in the manifest, counts its bytes, and reads it back (the tokens it follows and
    its payload) from a store opened afresh on the same root."""
    rep, blob = make_replica(4, block_size=BS), _blob(1)
    store = ReplicaStore(tmp_path, BUDGET, fsync="never")
    _write(store, "s", rep, 0, (3 * BS, blob))
    before = store.usage_bytes()
    again = ReplicaStore(tmp_path, BUDGET, fsync="never")
    m = again.manifest("s")
    assert m is not None and m.snapshot is not None and m.snapshot.pos == 3 * BS and m.snapshot.nbytes == blob.nbytes
    got = again.read_snapshot("s")
    assert got is not None
    tokens, data = got
    assert np.array_equal(tokens, rep.tokens[: 3 * BS]) and np.array_equal(data, blob)
    assert again.usage_bytes() == before >= rep.n_blocks * rep.block_bytes + blob.nbytes


def test_a_delta_keeps_the_held_snapshot_and_a_divergent_write_drops_it(tmp_path: Path) -> None:
    """A delta without a snapshot keeps the held one (the blocks before it are unchanged); a newer one replaces it
    (its old file deleted); a write from block 0 (the tokens may differ) keeps none."""
    rep = make_replica(3, block_size=BS)
    store = ReplicaStore(tmp_path, BUDGET, fsync="never")
    _write(store, "s", rep, 0, (2 * BS, _blob(1)))
    longer = grow(rep, 2, seed=5)
    _write(store, "s", longer, 3, None)
    m = store.manifest("s")
    assert m is not None and m.n_blocks == 5 and m.snapshot is not None and m.snapshot.pos == 2 * BS
    first_file = m.snapshot.file
    _write(store, "s", grow(longer, 1, seed=6), 5, (6 * BS, _blob(2)))
    m = store.manifest("s")
    assert m is not None and m.snapshot is not None and m.snapshot.pos == 6 * BS
    assert not (tmp_path / session_key("s") / first_file).exists()
    _write(store, "s", make_replica(2, block_size=BS, seed=7), 0, None)
    m = store.manifest("s")
    assert m is not None and m.snapshot is None and store.read_snapshot("s") is None
    assert not any(p.name.startswith("snap-") for p in (tmp_path / session_key("s")).iterdir())


def test_a_corrupt_snapshot_drops_the_replica_when_read(tmp_path: Path) -> None:
    """A snapshot file whose bytes no longer match its digest is refused ('digest') and the replica dropped: nothing
    of it is ever restored."""
    rep = make_replica(2, block_size=BS)
    store = ReplicaStore(tmp_path, BUDGET, fsync="never")
    _write(store, "s", rep, 0, (2 * BS, _blob(1)))
    m = store.manifest("s")
    assert m is not None and m.snapshot is not None
    path = tmp_path / session_key("s") / m.snapshot.file
    raw = bytearray(path.read_bytes())
    raw[7] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(StoreError) as e:
        store.read_snapshot("s")
    assert e.value.reason == "digest" and store.manifest("s") is None and store.dropped == 1


def test_a_snapshot_file_of_the_wrong_size_is_dropped_at_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """At start a snapshot file missing or cut short drops the session's replica, saying which file."""
    rep = make_replica(2, block_size=BS)
    _write(ReplicaStore(tmp_path, BUDGET, fsync="never"), "s", rep, 0, (BS, _blob(1)))
    snap = next((tmp_path / session_key("s")).glob("snap-*.bin"))
    snap.write_bytes(snap.read_bytes()[:-1])
    with caplog.at_level(logging.WARNING, logger="kvmesh.kvshare.store"):
        again = ReplicaStore(tmp_path, BUDGET, fsync="never")
    assert again.sessions() == [] and any(snap.name in r.getMessage() for r in caplog.records)


def test_a_store_of_the_format_before_snapshots_is_dropped_saying_so(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A manifest of format 1 (before snapshots) is not read: the session is dropped (its next turn recomputes), the
    log names the format, and nothing crashes."""
    rep = make_replica(2, block_size=BS)
    _write(ReplicaStore(tmp_path, BUDGET, fsync="never"), "old", rep, 0, None)
    _write(ReplicaStore(tmp_path, BUDGET, fsync="never"), "new", rep, 0, None)
    path = tmp_path / session_key("old") / MANIFEST
    doc = json.loads(path.read_bytes())
    doc["format"] = 1
    del doc["snapshot"]
    path.write_text(json.dumps(doc))
    with caplog.at_level(logging.WARNING, logger="kvmesh.kvshare.store"):
        again = ReplicaStore(tmp_path, BUDGET, fsync="never")
    assert again.sessions() == ["new"]
    assert any("format 1" in r.getMessage() and "format 2" in r.getMessage() for r in caplog.records)


def test_a_snapshot_off_the_written_blocks_is_refused(tmp_path: Path) -> None:
    """set_snapshot refuses a position past the blocks or off a boundary ('shape') and a payload that does not match
    its digest ('digest')."""
    rep = make_replica(2, block_size=BS)
    store = ReplicaStore(tmp_path, BUDGET, fsync="never")
    w = store.begin_write("s", fingerprint=rep.fingerprint, block_size=BS, block_bytes=rep.block_bytes,
                          tokens=rep.tokens, hashes=rep.hashes, first_block=0, generation=1)
    blob = _blob(1)
    with w:
        for pos, digest, reason in [(3 * BS, payload_digest(blob), "shape"), (BS + 1, payload_digest(blob), "shape"),
                                    (BS, bytes(16), "digest")]:
            with pytest.raises(StoreError) as e:
                w.set_snapshot(pos, blob, digest)
            assert e.value.reason == reason
