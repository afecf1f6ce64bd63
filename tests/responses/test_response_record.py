"""node.responses.record and node.responses.ids: a conversation's stored responses as a set that merges, the
whole input each response saw, deletions that win, collection of what nothing needs, and what an id carries."""

from __future__ import annotations

from typing import Any

from kvmesh.node.responses.ids import PEER_SCOPE, new_id, scope_of, session_of
from kvmesh.node.responses.record import Record, StoredEntry, StoredRecord

NOW = 1_000_000.0
TTL = 100.0


def _msg(role: str, text: str) -> dict[str, Any]:
    return {"type": "message", "id": f"msg_{role}_{text}", "role": role, "content": [{"type": "input_text", "text": text}]}


def _entry(rid: str, parent: str | None, said: str, *, scope: str = "", created: float = NOW) -> StoredEntry:
    return StoredEntry(id=rid, scope=scope, group="g", created=created, expires=created + TTL, parent=parent,
                       items=[_msg("user", said)], response={"id": rid, "output": [_msg("assistant", "re " + said)]})


def _chain() -> Record:
    rec = Record("conv")
    rec.merge([_entry("r1", None, "one"), _entry("r2", "r1", "two"), _entry("r3", "r2", "three")])
    return rec


def test_a_response_input_is_its_ancestors_conversation_then_its_own_items() -> None:
    """The whole input of the third turn is turn 1's input and output, turn 2's, then its own item."""
    texts = [i["content"][0]["text"] for i in _chain().input_items("r3") or []]
    assert texts == ["one", "re one", "two", "re two", "three"]
    conv = _chain().conversation("r3") or []
    assert [i["content"][0]["text"] for i in conv][-1] == "re three"


def test_find_sees_only_the_scope_and_the_living() -> None:
    """Another scope, an expired entry and a deleted one are all not found."""
    rec = _chain()
    assert rec.find("r2", "", NOW) is not None
    assert rec.find("r2", "other-key", NOW) is None
    assert rec.find("r2", "", NOW + TTL + 1) is None
    rec.delete("r2")
    assert rec.find("r2", "", NOW) is None


def test_a_deletion_wins_every_later_merge() -> None:
    """A copy that still has a deleted response does not bring it back."""
    rec = _chain()
    older = rec.dump()
    rec.delete("r2")
    assert not rec.merge(older.entries)
    assert rec.entries["r2"].deleted


def test_a_deleted_parent_stays_while_a_descendant_needs_it() -> None:
    """Deleting the middle response keeps its content for the later one's input; deleting that too leaves tombstones."""
    rec = _chain()
    rec.delete("r2")
    rec.collect(NOW)
    assert rec.find("r3", "", NOW) is not None and len(rec.input_items("r3") or []) == 5
    rec.delete("r3")
    rec.delete("r1")
    rec.collect(NOW)
    assert all(e.deleted and e.response is None and not e.items for e in rec.entries.values())
    rec.collect(NOW + TTL + 1)
    assert rec.empty()


def test_expired_entries_are_collected_but_not_while_needed() -> None:
    """An expired ancestor of a live response stays (its input needs it); once nothing needs it, it goes."""
    rec = Record("conv")
    rec.merge([_entry("r1", None, "one", created=NOW - 2 * TTL), _entry("r2", "r1", "two")])
    assert rec.find("r1", "", NOW) is None and rec.find("r2", "", NOW) is not None
    rec.collect(NOW)
    assert set(rec.entries) == {"r1", "r2"}
    rec.collect(NOW + 2 * TTL)
    assert rec.empty()


def test_merging_is_a_union_and_counts_versions() -> None:
    """Two copies that each gained a branch merge into both; merging the same again changes nothing."""
    a, b = _chain(), _chain()
    a.merge([_entry("x", "r3", "branch a")])
    b.merge([_entry("y", "r3", "branch b")])
    v = a.version
    assert a.merge(b.dump().entries) and a.version == v + 1
    assert {"x", "y"} <= set(a.entries)
    assert not a.merge(b.dump().entries)


def test_a_broken_chain_is_not_found() -> None:
    """A response whose parent is not in the record cannot be continued, so it is not found (nor loops forever)."""
    rec = Record("conv")
    rec.merge([_entry("r2", "r1", "two")])
    assert rec.find("r2", "", NOW) is None
    rec.merge([_entry("a", "b", "loop"), _entry("b", "a", "loop")])
    assert rec.input_items("a") is None


def test_a_record_round_trips_as_json() -> None:
    """What goes to disk and to a peer reads back as the same record."""
    rec = _chain()
    back = StoredRecord.model_validate_json(rec.dump().model_dump_json())
    again = Record(back.session)
    again.merge(back.entries)
    assert again.input_items("r3") == rec.input_items("r3")


def test_an_id_names_its_conversation_and_nothing_else_reads_as_one() -> None:
    """The id carries the conversation key (any printable id, '/' and non-ASCII too); edited or foreign ids are None."""
    for session in ("codex-1", "user@example.com/agent#0a1b2c3d", "sess\u00e9 \u6f22", "x" * 256):
        rid = new_id(session)
        assert rid.startswith("resp_") and session_of(rid) == session
        assert "/" not in rid and "+" not in rid and "=" not in rid
    assert new_id("s") != new_id("s")
    for bad in ("resp_nothing", "resp_0123456789abcdef", "msg_" + new_id("s")[5:], new_id("s")[:37],
                "resp_" + "g" * 32 + "cw", new_id("s") + "!"):
        assert session_of(bad) is None, bad


def test_a_scope_is_a_digest_of_the_key() -> None:
    """No keys: one shared scope; keys: a digest per key, never the key; a keyless peer call its own scope."""
    assert scope_of("sk-a", keyed=False) == scope_of(None, keyed=False) == ""
    a, b = scope_of("sk-key-a", keyed=True), scope_of("sk-key-b", keyed=True)
    assert a != b and "sk-key-a" not in a and len(a) == 32
    assert scope_of(None, keyed=True) == PEER_SCOPE
