"""A session id names an affinity group; each conversation in it gets its own key (node.mesh.threads)."""

from __future__ import annotations

from kvmesh.node.mesh.threads import MAX_KEY_BYTES, Threads, thread_key


def test_the_first_conversation_is_keyed_by_the_session_id_itself() -> None:
    """The main conversation keeps the client's id; its later turns (same opening) keep it too."""
    t = Threads()
    assert t.key("cc-1", "aaaa" * 16) == "cc-1"
    assert t.key("cc-1", "aaaa" * 16) == "cc-1"


def test_other_conversations_get_deterministic_keys_of_their_opening() -> None:
    """A subagent's conversation is `<id>#<8 hex>` of its opening, the same on every entry that saw the main one."""
    a, b = Threads(), Threads()
    for t in (a, b):
        t.key("cc-1", "aaaa" * 16)
    sub = a.key("cc-1", "bbbb" * 16)
    assert sub == "cc-1#bbbbbbbb" == b.key("cc-1", "bbbb" * 16)
    assert a.key("cc-1", "cccc" * 16) == "cc-1#cccccccc"
    assert a.threads_of("cc-1") == ["cc-1", "cc-1#bbbbbbbb", "cc-1#cccccccc"]


def test_no_opening_keeps_the_session_key() -> None:
    """A raw prompt (no conversation structure) is the session's one conversation."""
    t = Threads()
    t.key("s", "aaaa" * 16)
    assert t.key("s", "") == "s"


def test_past_the_bound_the_least_recently_used_thread_is_forgotten_never_the_main() -> None:
    """A session holds at most max_threads conversations; the oldest other one is handed to on_forget."""
    forgot: list[str] = []
    t = Threads(max_threads=3, on_forget=forgot.append)
    t.key("s", "0" * 64)  # main
    t.key("s", "1" * 64)
    t.key("s", "2" * 64)
    t.key("s", "0" * 64)  # the main used again: it is now the most recent
    t.key("s", "3" * 64)
    assert forgot == ["s#11111111"]
    t.key("s", "4" * 64)
    assert forgot == ["s#11111111", "s#22222222"]
    assert "s" in t.threads_of("s")


def test_a_key_of_a_long_id_stays_a_valid_session_id() -> None:
    """The key travels as X-Session-Id on the hop: it never passes 256 bytes nor cuts a character."""
    key = thread_key("é" * 200, "f" * 64)
    assert len(key.encode()) <= MAX_KEY_BYTES
    assert key.endswith("#ffffffff")
    key.encode().decode()  # whole characters only
