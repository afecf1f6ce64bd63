"""node.responses.store: records kept within their byte budget, written to disk by one thread, read back whole at
start; a file that does not parse is removed, never served."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from kvmesh.node.responses.record import StoredEntry, StoredRecord
from kvmesh.node.responses.store import ResponseStore
from kvmesh.node.sessionids import session_key


def _record(session: str, rid: str, text: str = "hello", *, created: float | None = None) -> StoredRecord:
    created = time.time() if created is None else created
    item: dict[str, Any] = {"type": "message", "id": "msg_1", "role": "user",
                            "content": [{"type": "input_text", "text": text}]}
    return StoredRecord(session=session, entries=[StoredEntry(id=rid, scope="", group=session, created=created,
                                                              expires=created + 60, items=[item],
                                                              response={"id": rid, "output": []})])


def _reopened(root: Path, budget: int = 1 << 20) -> ResponseStore:
    store = ResponseStore(root, budget, fsync=False)
    asyncio.run(store.load())
    return store


def test_records_survive_a_restart(tmp_path: Path) -> None:
    """What was merged is on disk once the store closes, and a new store reads it back."""
    store = _reopened(tmp_path)
    store.merge(_record("conv/a", "r1"))
    store.merge(_record("conv b", "r2"))
    assert store.delete("conv b", "r2")
    store.close()
    again = _reopened(tmp_path)
    rec = again.get("conv/a")
    assert rec is not None and rec.find("r1", "", time.time()) is not None
    b = again.get("conv b")
    assert b is None or b.find("r2", "", time.time()) is None  # the deletion was written too
    again.close()


def test_the_budget_evicts_the_least_recently_used_conversation(tmp_path: Path) -> None:
    """Past the budget the conversation used longest ago goes, from memory and disk; a recent lookup keeps one."""
    one = len(_record("c0", "r0", "x" * 1000).model_dump_json())
    store = _reopened(tmp_path, budget=3 * one)
    for i in range(3):
        store.merge(_record(f"c{i}", f"r{i}", "x" * 1000))
    store.get("c0")  # used: c1 is now the oldest
    store.merge(_record("c3", "r3", "x" * 1000))
    assert set(store.records) == {"c0", "c2", "c3"} and store.evictions == 1
    store.close()
    assert not (tmp_path / (session_key("c1") + ".json")).exists()
    assert _reopened(tmp_path).records.keys() == {"c0", "c2", "c3"}


def test_a_zero_budget_keeps_nothing(tmp_path: Path) -> None:
    """responses.budget_bytes = 0: a merge keeps nothing."""
    store = _reopened(tmp_path, budget=0)
    assert store.merge(_record("c", "r")) is None and not store.records
    store.close()


def test_expired_records_are_swept_and_unreadable_files_removed(tmp_path: Path) -> None:
    """A sweep drops an expired record; at start a torn file and a temp leftover are removed, not served."""
    store = _reopened(tmp_path)
    store.merge(_record("old", "r1", created=time.time() - 30))
    store.clock = lambda: time.time() + 60
    assert store.sweep() == 1 and not store.records
    store.close()
    (tmp_path / (session_key("torn") + ".json")).write_text('{"session": "torn", "entries": [')
    (tmp_path / "~leftover.tmp").write_text("x")
    again = _reopened(tmp_path)
    assert not again.records
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    again.close()
