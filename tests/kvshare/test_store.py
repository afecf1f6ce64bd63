"""ReplicaStore: atomic writes, restarts, corruption, budget, deltas, imports into an engine."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest

from kvmesh.node.engine.engine import Engine
from kvmesh.node.engine.hashing import payload_digest
from kvmesh.node.errors import ImportRefused
from kvmesh.node.kvshare.store import write as store_module
from kvmesh.node.kvshare.store.manifest import Manifest
from kvmesh.node.kvshare.store.segment import SegmentWriter, StoreError
from kvmesh.node.kvshare.store import ReplicaStore
from kvmesh.node.kvshare.store.write import MAX_SEGMENTS
from kvmesh.node.kvshare.wire import InvalidSessionId
from kvmesh.node.protocol import session_key

from .helpers import (
    FP,
    Replica,
    grow,
    make_replica,
    prefix,
    prompt_tokens,
    run_turn,
    sim_engine,
)

BUDGET = 1 << 30


def write(store: ReplicaStore, session: str, rep: Replica, first_block: int = 0, generation: int = 1) -> Manifest:
    with store.begin_write(
        session, fingerprint=rep.fingerprint, block_size=rep.block_size, block_bytes=rep.block_bytes,
        tokens=rep.tokens, hashes=rep.hashes, first_block=first_block, generation=generation,
    ) as w:  # fmt: skip
        for i in range(w.next_index, rep.n_blocks):
            w.write_block(i, rep.payloads[i], rep.digests[i])
        return w.commit()


def begin(store: ReplicaStore, session: str, rep: Replica, first_block: int = 0) -> SegmentWriter:
    return store.begin_write(
        session, fingerprint=rep.fingerprint, block_size=rep.block_size, block_bytes=rep.block_bytes,
        tokens=rep.tokens, hashes=rep.hashes, first_block=first_block, generation=1,
    )  # fmt: skip


def listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def temp_files(root: Path) -> list[str]:
    return [p for p in listing(root) if any(part.startswith("~") for part in Path(p).parts)]


def assert_holds(store: ReplicaStore, session: str, rep: Replica) -> None:
    m = store.manifest(session)
    assert m is not None
    assert m.n_blocks == rep.n_blocks and m.hashes == rep.hashes and m.digests == rep.digests
    assert np.array_equal(m.tokens, rep.tokens)
    assert [bytes(store.block_view(session, i)) for i in range(rep.n_blocks)] == rep.payloads


# ---- writing and reading ---------------------------------------------------------------


def test_write_commit_read_round_trip(tmp_path: Path) -> None:
    """A committed replica reads back: manifest fields, tokens, hashes, digests and every payload."""
    store = ReplicaStore(tmp_path, BUDGET)
    rep = make_replica(5)
    m = write(store, "s1", rep, generation=7)
    assert (m.fingerprint, m.block_size, m.block_bytes, m.generation) == (FP, 8, 256, 7)
    assert (m.n_blocks, m.num_tokens, m.nbytes) == (5, 40, 5 * 256)
    assert store.sessions() == ["s1"]
    assert_holds(store, "s1", rep)
    assert store.block_view("s1", 0).readonly
    assert temp_files(tmp_path) == []
    assert {p.split("/")[-1].split("-")[0] for p in listing(tmp_path / session_key("s1"))} == {"manifest.json", "seg", "tokens"}
    assert store.usage_bytes() >= m.nbytes


def test_fsync_never_round_trip(tmp_path: Path) -> None:
    """With fsync='never' the replica is written and read back the same way."""
    store = ReplicaStore(tmp_path, BUDGET, fsync="never")
    rep = make_replica(3)
    write(store, "s1", rep)
    assert_holds(ReplicaStore(tmp_path, BUDGET, fsync="never"), "s1", rep)


def test_exception_inside_the_writer_leaves_no_files(tmp_path: Path) -> None:
    """An exception while writing a first replica aborts it: the store directory is left empty."""
    store = ReplicaStore(tmp_path, BUDGET)
    rep = make_replica(4)
    with pytest.raises(RuntimeError), begin(store, "s1", rep) as w:
        w.write_block(0, rep.payloads[0], rep.digests[0])
        raise RuntimeError("connection dropped")
    assert listing(tmp_path) == []
    assert store.manifest("s1") is None and store.sessions() == []


def test_aborted_delta_leaves_the_previous_replica_intact(tmp_path: Path) -> None:
    """Aborting a delta midway (a torn transfer) is invisible: the old replica and its files are unchanged."""
    store = ReplicaStore(tmp_path, BUDGET)
    rep = make_replica(3)
    write(store, "s1", rep)
    before = listing(tmp_path)
    bigger = grow(rep, 3, seed=1)
    w = begin(store, "s1", bigger, first_block=3)
    w.write_block(3, bigger.payloads[3], bigger.digests[3])
    assert temp_files(tmp_path) != []  # the delta is on disk, under a temp name
    w.abort()
    assert listing(tmp_path) == before
    assert_holds(store, "s1", rep)


def test_bad_digest_and_order_are_refused_by_the_writer(tmp_path: Path) -> None:
    """write_block refuses a payload that does not match its digest, and any index but the next one."""
    store = ReplicaStore(tmp_path, BUDGET)
    rep = make_replica(3)
    with begin(store, "s1", rep) as w:
        with pytest.raises(StoreError) as e:
            w.write_block(0, rep.payloads[1], rep.digests[0])
        assert e.value.reason == "digest"
        with pytest.raises(StoreError) as e:
            w.write_block(1, rep.payloads[1], rep.digests[1])
        assert e.value.reason == "order"
    assert listing(tmp_path) == []


def test_commit_with_blocks_missing_is_refused(tmp_path: Path) -> None:
    """commit() before every block is written is refused 'incomplete'; nothing becomes visible."""
    store = ReplicaStore(tmp_path, BUDGET)
    rep = make_replica(3)
    with begin(store, "s1", rep) as w:
        w.write_block(0, rep.payloads[0], rep.digests[0])
        with pytest.raises(StoreError) as e:
            w.commit()
        assert e.value.reason == "incomplete"
    assert store.manifest("s1") is None and listing(tmp_path) == []


def test_tokens_that_do_not_match_the_hashes_are_refused(tmp_path: Path) -> None:
    """begin_write checks the hash chain of the tokens: a mismatch is refused before anything is written."""
    store = ReplicaStore(tmp_path, BUDGET)
    rep = make_replica(2)
    rep.tokens = rep.tokens.copy()
    rep.tokens[3] += 1
    with pytest.raises(StoreError) as e:
        begin(store, "s1", rep)
    assert e.value.reason == "hash_chain"
    assert listing(tmp_path) == []


# ---- restart --------------------------------------------------------------------------------


def test_restart_indexes_sessions_and_deletes_temp_leftovers(tmp_path: Path) -> None:
    """A new store on the same root finds every committed session and deletes temp files of unfinished writes."""
    store = ReplicaStore(tmp_path, BUDGET)
    a, b = make_replica(3, seed=1), make_replica(2, seed=2)
    write(store, "a", a)
    write(store, "b", b)
    crashed = begin(store, "a", grow(a, 2, seed=3), first_block=3)  # never committed nor aborted: a crash
    crashed.write_block(3, grow(a, 2, seed=3).payloads[3], grow(a, 2, seed=3).digests[3])
    (tmp_path / "~trash.deadbeef.tmp").mkdir()
    assert temp_files(tmp_path) != []
    usage = store.usage_bytes()

    again = ReplicaStore(tmp_path, BUDGET)
    assert sorted(again.sessions()) == ["a", "b"]
    assert temp_files(tmp_path) == []
    assert_holds(again, "a", a)
    assert_holds(again, "b", b)
    assert again.usage_bytes() == usage


def test_unparseable_manifest_drops_the_session(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A manifest that does not parse drops that session at start, and the log says why."""
    store = ReplicaStore(tmp_path, BUDGET)
    write(store, "good", make_replica(2, seed=1))
    write(store, "bad", make_replica(2, seed=2))
    (tmp_path / session_key("bad") / "manifest.json").write_text('{"format": 1, "session": "bad"')
    with caplog.at_level(logging.WARNING, logger="kvmesh.kvshare.store"):
        again = ReplicaStore(tmp_path, BUDGET)
    assert again.sessions() == ["good"]
    assert not (tmp_path / session_key("bad")).exists()
    assert any(session_key("bad") in r.getMessage() and "manifest.json does not parse" in r.getMessage() for r in caplog.records)


def test_segment_of_the_wrong_size_drops_the_session(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A segment file whose size is not its blocks' bytes (a torn file) drops that session at start."""
    store = ReplicaStore(tmp_path, BUDGET)
    write(store, "s1", make_replica(3))
    [seg] = (tmp_path / session_key("s1")).glob("seg-*.kv")
    with open(seg, "r+b") as f:
        f.truncate(256 * 2 + 100)
    with caplog.at_level(logging.WARNING, logger="kvmesh.kvshare.store"):
        again = ReplicaStore(tmp_path, BUDGET)
    assert again.sessions() == [] and again.dropped == 1
    assert any("is 612 bytes, not 768" in r.getMessage() for r in caplog.records)


def test_manifest_with_a_broken_hash_chain_drops_the_session(tmp_path: Path) -> None:
    """A manifest whose hashes do not match its tokens is not trusted at start."""
    store = ReplicaStore(tmp_path, BUDGET)
    write(store, "s1", make_replica(2))
    path = tmp_path / session_key("s1") / "manifest.json"
    doc = json.loads(path.read_text())
    doc["hashes"][1] = "00" * 16
    path.write_text(json.dumps(doc))
    assert ReplicaStore(tmp_path, BUDGET).sessions() == []


def test_files_no_manifest_names_are_removed_at_start(tmp_path: Path) -> None:
    """A segment renamed into place by a commit that crashed before its manifest is deleted at start; the replica stays."""
    rep = make_replica(2)
    write(ReplicaStore(tmp_path, BUDGET), "s1", rep)
    (tmp_path / session_key("s1") / "seg-00000009.kv").write_bytes(b"x" * 256)
    (tmp_path / session_key("s1") / "tokens-00000009.bin").write_bytes(b"")
    store = ReplicaStore(tmp_path, BUDGET)
    assert_holds(store, "s1", rep)
    assert not (tmp_path / session_key("s1") / "seg-00000009.kv").exists() and not (tmp_path / session_key("s1") / "tokens-00000009.bin").exists()


def test_directory_without_a_manifest_is_removed_at_start(tmp_path: Path) -> None:
    """A session directory from a first write that never committed is removed at start."""
    (tmp_path / session_key("half")).mkdir()
    (tmp_path / session_key("half") / "seg-00000001.kv").write_bytes(b"x" * 10)
    assert ReplicaStore(tmp_path, BUDGET).sessions() == []
    assert listing(tmp_path) == []


# ---- corruption at import ---------------------------------------------------------------------


def engine_replica(engine: Engine, session: str, n_tokens: int, seed: int = 0) -> tuple[np.ndarray, list[bytes], list[bytes]]:
    """Run a turn, then export the session's whole blocks: tokens, hashes, payloads."""
    run_turn(engine, session, prompt_tokens(n_tokens, seed))
    with engine.export(session) as blocks:
        tokens = np.concatenate([b.tokens for b in blocks])
        return tokens, [b.hash for b in blocks], [bytes(b.data) for b in blocks]


def store_from_engine(store: ReplicaStore, engine: Engine, session: str, *, generation: int = 1) -> int:
    """What a host does after a turn: append the blocks the store lacks; returns how many it held before."""
    seq = engine.sessions[session]
    held = store.held_prefix_blocks(session, engine.fingerprint, seq.hashes)
    tokens = seq.tokens[: len(seq.hashes) * engine.block_size]
    with engine.export(session, from_block=held) as blocks, store.begin_write(
        session, fingerprint=engine.fingerprint, block_size=engine.block_size, block_bytes=engine.block_bytes,
        tokens=tokens, hashes=seq.hashes, first_block=held, generation=generation,
    ) as w:  # fmt: skip
        for b in blocks:
            w.write_block(b.index, b.data, payload_digest(b.data))
        w.commit()
    return held


def test_corrupt_segment_is_refused_at_import(tmp_path: Path, engine: Engine) -> None:
    """A segment corrupted on disk (same size) is caught by its digest at import: refused, the engine gets nothing."""
    store = ReplicaStore(tmp_path, BUDGET)
    run_turn(engine, "s1", prompt_tokens(64 * 4 + 10))
    store_from_engine(store, engine, "s1")
    m = store.manifest("s1")
    assert m is not None and m.n_blocks == 4
    [seg] = (tmp_path / session_key("s1")).glob("seg-*.kv")
    with open(seg, "r+b") as f:
        f.seek(2 * m.block_bytes + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))

    fresh = sim_engine()
    again = ReplicaStore(tmp_path, BUDGET)  # after a restart nothing is verified yet
    with pytest.raises(ImportRefused) as e:
        again.import_into(fresh, "s1")
    assert e.value.reason == "digest"
    assert fresh.cached_prefix("s1", m.tokens) == 0
    assert fresh.blocks.num_free == fresh.pool.num_blocks  # every reserved block went back
    assert again.sessions() == [] and not (tmp_path / session_key("s1")).exists()


def test_verified_block_view_catches_corruption(tmp_path: Path) -> None:
    """block_view(verify=True) checks a block's digest after a restart: a corrupt one raises StoreError('digest')."""
    rep = make_replica(2)
    write(ReplicaStore(tmp_path, BUDGET), "s1", rep)
    [seg] = (tmp_path / session_key("s1")).glob("seg-*.kv")
    data = bytearray(seg.read_bytes())
    data[300] ^= 0xFF  # block 1
    seg.write_bytes(bytes(data))
    store = ReplicaStore(tmp_path, BUDGET)
    assert bytes(store.block_view("s1", 0, verify=True)) == rep.payloads[0]
    with pytest.raises(StoreError) as e:
        store.block_view("s1", 1, verify=True)
    assert e.value.reason == "digest"
    assert store.sessions() == [] and store.dropped == 1


# ---- budget ------------------------------------------------------------------------------------


def test_budget_evicts_the_least_recently_used_session(tmp_path: Path) -> None:
    """Over budget, whole sessions are evicted least recently used first; touch() counts as use."""
    rep = make_replica(4)
    probe = ReplicaStore(tmp_path / "probe", BUDGET)
    one = write(probe, "x", rep) and probe.usage_bytes()
    store = ReplicaStore(tmp_path / "root", budget_bytes=2 * one + one // 2)
    write(store, "a", make_replica(4, seed=1))
    write(store, "b", make_replica(4, seed=2))
    store.touch("a")
    write(store, "c", make_replica(4, seed=3))
    assert sorted(store.sessions()) == ["a", "c"]
    assert store.evictions == 1
    assert store.usage_bytes() <= store.budget_bytes
    assert not (tmp_path / "root" / session_key("b")).exists()


def test_over_budget_received_replicas_go_before_own_sessions(tmp_path: Path) -> None:
    """An own session (persist_own) outlives a more recently used received replica; once no replica is
    left, own sessions go least recently used first; a received replica of it makes it a replica again."""
    rep = make_replica(4)
    probe = ReplicaStore(tmp_path / "probe", BUDGET)
    one = write(probe, "x", rep) and probe.usage_bytes()
    store = ReplicaStore(tmp_path / "root", budget_bytes=2 * one + one // 2)
    write(store, "own-old", make_replica(4, seed=1))
    store.mark_own("own-old", True)
    write(store, "replica", make_replica(4, seed=2))
    write(store, "own-new", make_replica(4, seed=3))
    store.mark_own("own-new", True)
    assert sorted(store.sessions()) == ["own-new", "own-old"]
    write(store, "own-3", make_replica(4, seed=4))
    store.mark_own("own-3", True)
    assert sorted(store.sessions()) == ["own-3", "own-new"]  # only own sessions left: the oldest went
    store.mark_own("own-new", False)  # a sender's replica replaced it
    write(store, "own-4", make_replica(4, seed=5))
    assert sorted(store.sessions()) == ["own-3", "own-4"]


def test_replica_larger_than_the_budget_is_refused(tmp_path: Path) -> None:
    """A replica that alone exceeds the budget is refused 'no_room' before anything is written or evicted."""
    store = ReplicaStore(tmp_path, budget_bytes=4000)
    write(store, "small", make_replica(1))
    with pytest.raises(StoreError) as e:
        begin(store, "big", make_replica(20))
    assert e.value.reason == "no_room"
    assert store.sessions() == ["small"]


def test_lowered_budget_evicts_at_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Restarting with a smaller budget evicts down to it, least recently updated first."""
    store = ReplicaStore(tmp_path, BUDGET)
    clock = iter([2000.0, 1000.0])  # "new" is written first but carries the later update time
    monkeypatch.setattr(store_module, "_wall_clock", lambda: next(clock))
    write(store, "new", make_replica(4, seed=2))
    write(store, "old", make_replica(4, seed=1))
    monkeypatch.undo()
    again = ReplicaStore(tmp_path, budget_bytes=store.usage_bytes() - 1)
    assert again.sessions() == ["new"]


def test_evict_removes_the_session(tmp_path: Path) -> None:
    """evict() deletes the replica's directory and counts it."""
    store = ReplicaStore(tmp_path, BUDGET)
    write(store, "s1", make_replica(2))
    store.evict("s1")
    store.evict("never-held")
    assert store.sessions() == [] and store.evictions == 1 and listing(tmp_path) == []


# ---- deltas ---------------------------------------------------------------------------------------


def test_delta_append_over_growing_turns(tmp_path: Path, engine: Engine) -> None:
    """Each turn appends only the new blocks as one more segment; the whole replica reads back and imports."""
    store = ReplicaStore(tmp_path, BUDGET)
    prompt = prompt_tokens(64 * 2 + 5, seed=1)
    helds = []
    for turn in range(3):
        run_turn(engine, "s1", prompt)
        helds.append(store_from_engine(store, engine, "s1", generation=turn + 1))
        prompt = np.concatenate([engine.session_tokens("s1"), prompt_tokens(64 * 2, seed=10 + turn)])
    seq = engine.sessions["s1"]
    m = store.manifest("s1")
    assert m is not None
    assert helds == [0, 2, 4]
    assert len(m.segments) == 3 and m.generation == 3
    assert m.hashes == seq.hashes
    with engine.export("s1") as blocks:
        assert [bytes(store.block_view("s1", b.index)) for b in blocks] == [bytes(b.data) for b in blocks]

    fresh = sim_engine()
    assert store.import_into(fresh, "s1") == m.num_tokens
    assert fresh.cached_prefix("s1", m.tokens) == m.num_tokens


def test_diverging_prefix_keeps_the_common_blocks_and_drops_the_rest(tmp_path: Path) -> None:
    """A replica that differs from block k on is written from k: blocks before k kept, the old tail gone."""
    store = ReplicaStore(tmp_path, BUDGET)
    old = make_replica(6, seed=1)
    write(store, "s1", old)
    new = grow(prefix(old, 3), 4, seed=9)
    assert store.held_prefix_blocks("s1", FP, new.hashes) == 3
    write(store, "s1", new, first_block=3)
    assert_holds(store, "s1", new)
    assert len(list((tmp_path / session_key("s1")).glob("seg-*.kv"))) == 1  # the cut segment was rewritten, the old one deleted
    assert temp_files(tmp_path) == []
    assert_holds(ReplicaStore(tmp_path, BUDGET), "s1", new)


def test_first_block_past_the_common_prefix_is_refused(tmp_path: Path) -> None:
    """Blocks before first_block must be held under the same hashes, else the write is refused 'prefix'."""
    store = ReplicaStore(tmp_path, BUDGET)
    write(store, "s1", make_replica(4, seed=1))
    other = make_replica(6, seed=2)
    with pytest.raises(StoreError) as e:
        begin(store, "s1", other, first_block=2)
    assert e.value.reason == "prefix"
    with pytest.raises(StoreError) as e:
        begin(store, "nobody", other, first_block=1)
    assert e.value.reason == "prefix"


def test_many_deltas_are_compacted(tmp_path: Path) -> None:
    """After many one-block deltas the segments are compacted; every block still reads back."""
    store = ReplicaStore(tmp_path, BUDGET)
    rep = make_replica(1)
    write(store, "s1", rep)
    for k in range(MAX_SEGMENTS + 4):
        bigger = grow(rep, 1, seed=100 + k)
        write(store, "s1", bigger, first_block=rep.n_blocks)
        rep = bigger
    m = store.manifest("s1")
    assert m is not None and len(m.segments) <= MAX_SEGMENTS
    assert_holds(store, "s1", rep)
    assert len(list((tmp_path / session_key("s1")).glob("seg-*.kv"))) == len(m.segments)
    assert len(list((tmp_path / session_key("s1")).glob("tokens-*.bin"))) == 1


def test_writer_conflict_is_refused(tmp_path: Path) -> None:
    """Two writers from the same base: the second commit is refused 'conflict' and leaves the first intact."""
    store = ReplicaStore(tmp_path, BUDGET)
    rep = make_replica(2)
    write(store, "s1", rep)
    bigger = grow(rep, 1, seed=5)
    w1, w2 = begin(store, "s1", bigger, first_block=2), begin(store, "s1", bigger, first_block=2)
    for w in (w1, w2):
        w.write_block(2, bigger.payloads[2], bigger.digests[2])
    w1.commit()
    with pytest.raises(StoreError) as e:
        w2.commit()
    assert e.value.reason == "conflict"
    assert_holds(store, "s1", bigger)
    assert temp_files(tmp_path) == []


# ---- import into an engine -------------------------------------------------------------------------


def test_import_into_an_engine(tmp_path: Path, engine: Engine) -> None:
    """A replica of another engine's session imports whole: cached_prefix equals its whole-block token count."""
    store = ReplicaStore(tmp_path, BUDGET)
    run_turn(engine, "s1", prompt_tokens(64 * 5 + 17))
    store_from_engine(store, engine, "s1")
    m = store.manifest("s1")
    assert m is not None and m.n_blocks == 5

    fresh = sim_engine()
    assert fresh.cached_prefix("s1", m.tokens) == 0
    assert ReplicaStore(tmp_path, BUDGET).import_into(fresh, "s1") == 5 * 64  # after a restart: lazily re-verified
    assert fresh.cached_prefix("s1", m.tokens) == 5 * 64
    with engine.export("s1") as theirs, fresh.export("s1") as ours:
        assert [bytes(b.data) for b in ours] == [bytes(b.data) for b in theirs]


def test_import_part_of_a_replica(tmp_path: Path, engine: Engine) -> None:
    """upto_blocks imports only the leading blocks asked for."""
    store = ReplicaStore(tmp_path, BUDGET)
    run_turn(engine, "s1", prompt_tokens(64 * 4 + 1))
    store_from_engine(store, engine, "s1")
    fresh = sim_engine()
    assert store.import_into(fresh, "s1", upto_blocks=2) == 2 * 64
    m = store.manifest("s1")
    assert m is not None and fresh.cached_prefix("s1", m.tokens) == 2 * 64


def test_import_of_a_replica_from_another_model_is_refused(tmp_path: Path, engine: Engine) -> None:
    """A replica whose fingerprint is not the engine's is refused by the engine; nothing is imported."""
    store = ReplicaStore(tmp_path, BUDGET)
    write(store, "s1", make_replica(2, block_size=64, block_bytes=engine.block_bytes))
    with pytest.raises(ImportRefused) as e:
        store.import_into(engine, "s1")
    assert e.value.reason == "fingerprint"


def test_missing_replica_import_is_a_store_error(tmp_path: Path, engine: Engine) -> None:
    """Importing a session the store does not hold raises StoreError('missing')."""
    with pytest.raises(StoreError) as e:
        ReplicaStore(tmp_path, BUDGET).import_into(engine, "nobody")
    assert e.value.reason == "missing"


# ---- open mappings ----------------------------------------------------------------------------------


def mapped_segments(root: Path) -> tuple[int, int]:
    """(open fds, mappings) of this process on segment files under `root` (deleted ones too)."""
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
        except OSError:
            continue
        if target.startswith(str(root)) and target.endswith(".kv"):
            fds += 1
    with open("/proc/self/maps") as f:
        lines = [line.rstrip().removesuffix(" (deleted)") for line in f if str(root) in line]
        maps = {line.split()[0] for line in lines if line.endswith(".kv")}  # address ranges
    return fds, len(maps)


def test_open_mappings_are_capped_across_the_store(tmp_path: Path) -> None:
    """Reading every block of more sessions (and segments) than max_open_maps keeps open segment fds and mappings <= the cap."""
    store = ReplicaStore(tmp_path, BUDGET, max_open_maps=3)
    reps = {f"s{k}": make_replica(4, seed=k) for k in range(8)}
    for session, rep in reps.items():
        write(store, session, rep)
    write(store, "s0", grow(reps["s0"], 2, seed=99), first_block=4)  # a second segment
    reps["s0"] = grow(reps["s0"], 2, seed=99)
    for _ in range(2):
        for session, rep in reps.items():
            assert_holds(store, session, rep)
            assert store.open_maps() <= 3
            fds, maps = mapped_segments(tmp_path)
            assert fds <= 3 and maps <= 3
    assert store.open_maps() == 3
    store.close()
    assert store.open_maps() == 0 and mapped_segments(tmp_path) == (0, 0)


def test_reads_stay_correct_after_a_mapping_is_evicted_and_reopened(tmp_path: Path, engine: Engine) -> None:
    """With one mapping allowed, alternating reads of two sessions close and reopen segments and every byte stays right."""
    store = ReplicaStore(tmp_path, BUDGET, max_open_maps=1)
    a, b = make_replica(6, seed=1), make_replica(6, seed=2)
    write(store, "a", a)
    write(store, "b", b)
    for i in range(6):
        assert bytes(store.block_view("a", i, verify=True)) == a.payloads[i]
        assert bytes(store.block_view("b", i, verify=True)) == b.payloads[i]
        assert store.open_maps() == 1
    run_turn(engine, "e", prompt_tokens(64 * 3 + 5))
    store_from_engine(store, engine, "e")
    assert bytes(store.block_view("a", 0)) == a.payloads[0]  # "e"'s mapping is closed
    fresh = sim_engine()
    try:
        assert store.import_into(fresh, "e") == 3 * 64
        with engine.export("e") as theirs, fresh.export("e") as ours:
            assert [bytes(x.data) for x in ours] == [bytes(x.data) for x in theirs]
    finally:
        fresh.close()
    assert store.maps_deferred == 0


def test_a_view_held_across_an_eviction_stays_valid(tmp_path: Path) -> None:
    """A view held while its mapping is evicted, its session evicted and the store closed still reads right (no BufferError);
    the mapping and its fd go when the view goes."""
    store = ReplicaStore(tmp_path, BUDGET, max_open_maps=1)
    a, b = make_replica(3, seed=1), make_replica(3, seed=2)
    write(store, "a", a)
    write(store, "b", b)
    held = store.block_view("a", 2)
    assert bytes(store.block_view("b", 0)) == b.payloads[0]  # evicts "a"'s mapping under the view
    assert store.maps_deferred == 1 and store.open_maps() == 1
    assert bytes(held) == a.payloads[2]
    again = store.block_view("a", 1)  # reopened: a second mapping of the same file
    store.evict("a")
    store.close()
    assert bytes(held) == a.payloads[2] and bytes(again) == a.payloads[1]
    assert store.open_maps() == 0 and mapped_segments(tmp_path) == (2, 2)
    del held, again
    assert mapped_segments(tmp_path) == (0, 0)


def test_a_replica_written_again_after_eviction_never_reads_the_old_mapping(tmp_path: Path) -> None:
    """After evict and a new write (the same file names), reads get the new bytes, a view of the old replica keeps the
    old ones, and a read through the evicted replica's index entry is refused instead of mapping the new file."""
    store = ReplicaStore(tmp_path, BUDGET)
    old, new = make_replica(3, seed=1), make_replica(3, seed=2)
    write(store, "a", old)
    held = store.block_view("a", 0, verify=True)
    stale = store._entries["a"]
    store.evict("a")
    write(store, "a", new)
    assert [bytes(store.block_view("a", i, verify=True)) for i in range(3)] == new.payloads
    assert bytes(held) == old.payloads[0]
    with pytest.raises(StoreError) as e, store._lock:
        store._view(stale, 1)
    assert e.value.reason == "missing"


def test_trimmed_mappings_read_right(tmp_path: Path) -> None:
    """Dropping mapped pages (trim_bytes reached, after an import) never changes what a view reads, held or new."""
    store = ReplicaStore(tmp_path, BUDGET, trim_bytes=256)  # a trim at every block read
    rep = make_replica(5, seed=3)
    write(store, "s", rep)
    views = [store.block_view("s", i) for i in range(5)]
    assert [bytes(v) for v in views] == rep.payloads
    assert_holds(store, "s", rep)


def resident_segment_kib(root: Path) -> int:
    """RSS (KiB) of this process's mappings of segment files under `root` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's header line
                inside = str(root) in line and line.rstrip().removesuffix(" (deleted)").endswith(".kv")
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


def test_pages_read_by_an_import_or_a_rewrite_leave_rss(tmp_path: Path, engine: Engine) -> None:
    """Mapped pages an import or a rewrite read stop counting in RSS once done (the mappings stay open)."""
    store = ReplicaStore(tmp_path, BUDGET, trim_bytes=0)  # no trims by volume: only those after an import or a rewrite
    run_turn(engine, "s1", prompt_tokens(64 * 6 + 3))
    store_from_engine(store, engine, "s1")
    m = store.manifest("s1")
    assert m is not None
    assert [len(bytes(store.block_view("s1", i))) for i in range(m.n_blocks)] == [m.block_bytes] * m.n_blocks
    assert resident_segment_kib(tmp_path) > 0
    fresh = sim_engine()
    try:
        assert store.import_into(fresh, "s1") == m.n_blocks * 64
    finally:
        fresh.close()
    assert resident_segment_kib(tmp_path) == 0 and store.open_maps() == 1
    old = make_replica(6, seed=1)
    write(store, "r", old)
    w = begin(store, "r", grow(prefix(old, 3), 4, seed=9), first_block=3)  # blocks 0-2 of the cut segment are read back
    try:
        assert w.next_index == 3 and resident_segment_kib(tmp_path) == 0
    finally:
        w.abort()


def test_concurrent_reads_with_a_small_cap(tmp_path: Path) -> None:
    """Threads reading many sessions through two mappings get the right bytes, no errors, and the cap holds."""
    import threading

    store = ReplicaStore(tmp_path, BUDGET, max_open_maps=2, trim_bytes=4096)
    reps = {f"s{k}": make_replica(4, seed=k) for k in range(6)}
    for session, rep in reps.items():
        write(store, session, rep)
    errors: list[BaseException] = []

    def reader(k: int) -> None:
        try:
            for r in range(50):
                session = f"s{(k + r) % 6}"
                views = [store.block_view(session, i) for i in range(4)]
                assert [bytes(v) for v in views] == reps[session].payloads
                assert store.open_maps() <= 2
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert store.open_maps() <= 2


# ---- session ids ----------------------------------------------------------------------------------


@pytest.mark.parametrize("session", ["a\x00b", "x" * 257, "", "line\nbreak", "\u202eevil"])
def test_non_session_ids_are_refused_before_touching_disk(tmp_path: Path, engine: Engine, session: str) -> None:
    """Empty, over-long (257 bytes) or control-character ids are refused by every entry point, and nothing is written."""
    store = ReplicaStore(tmp_path / "root", BUDGET)
    rep = make_replica(1)
    calls = [
        lambda: begin(store, session, rep),
        lambda: store.manifest(session),
        lambda: store.block_view(session, 0),
        lambda: store.import_into(engine, session),
        lambda: store.evict(session),
        lambda: store.touch(session),
    ]
    for call in calls:
        with pytest.raises(InvalidSessionId):
            call()
    assert listing(tmp_path) == ["root"]


PATH_LIKE = ["../x", "a/b", ".", "..", "/abs", "proj/feature-x", "b64:ab+/cd==", "user+tag@example.com", "s\u00e9ssion",
             "\u4e2d\u6587 \U0001f600", "~tilde", "y" * 256]


def test_any_printable_id_is_stored_under_its_key_and_survives_a_restart(tmp_path: Path) -> None:
    """Path-like, base64, email and non-ASCII ids: one directory each, named by session_key, none escaping the root."""
    store = ReplicaStore(tmp_path / "root", BUDGET)
    reps = {sid: make_replica(2, seed=i) for i, sid in enumerate(PATH_LIKE)}
    for sid, rep in reps.items():
        write(store, sid, rep)
    store.close()
    names = sorted(p.name for p in (tmp_path / "root").iterdir())
    assert names == sorted(session_key(sid) for sid in PATH_LIKE)
    assert all(len(n) == 32 and set(n) <= set("0123456789abcdef") for n in names)
    assert [p.name for p in tmp_path.iterdir()] == ["root"]
    assert all(p.resolve().is_relative_to((tmp_path / "root").resolve()) for p in (tmp_path / "root").rglob("*"))
    again = ReplicaStore(tmp_path / "root", BUDGET)
    assert sorted(again.sessions()) == sorted(PATH_LIKE)
    for sid, rep in reps.items():
        assert_holds(again, sid, rep)


def test_a_directory_named_by_the_id_itself_is_renamed_to_its_key(tmp_path: Path) -> None:
    """A replica written before session keys (root/<id>/) is renamed to root/<key>/ at start and still read."""
    rep = make_replica(2)
    write(ReplicaStore(tmp_path, BUDGET), "old-id", rep)
    os.rename(tmp_path / session_key("old-id"), tmp_path / "old-id")  # the layout an older store left
    store = ReplicaStore(tmp_path, BUDGET)
    assert store.sessions() == ["old-id"]
    assert_holds(store, "old-id", rep)
    assert sorted(p.name for p in tmp_path.iterdir()) == [session_key("old-id")]
