"""A session id names an affinity group; each conversation in it gets its own key (node.mesh.threads)."""

from __future__ import annotations

from kvmesh.node.api.sessionid import opening_of
from kvmesh.node.mesh.threads import MAX_KEY_BYTES, KnownThreads, Opening, Threads, thread_key

MAIN = Opening("sys-main", "Fix the failing test.")


def test_the_first_conversation_is_keyed_by_the_session_id_itself() -> None:
    """The main conversation keeps the client's id; its later turns (same opening) keep it too."""
    t = Threads()
    assert t.key("cc-1", MAIN) == "cc-1"
    assert t.key("cc-1", MAIN) == "cc-1"


def test_other_conversations_get_deterministic_keys_of_their_opening() -> None:
    """A subagent's conversation is `<id>#<8 hex>` of its opening, the same on every entry that saw the main one."""
    a, b = Threads(), Threads()
    explore, plan = Opening("sys-explore", "find the bug"), Opening("sys-plan", "plan the fix")
    for t in (a, b):
        t.key("cc-1", MAIN)
    sub = a.key("cc-1", explore)
    assert sub.startswith("cc-1#") and len(sub) == len("cc-1#") + 8
    assert sub == b.key("cc-1", explore) != a.key("cc-1", plan)
    assert a.key("cc-1", Opening("sys-explore", "find the other bug")) not in (sub, "cc-1")  # same prompt, other task
    assert a.threads_of("cc-1")[0] == "cc-1"


def test_a_first_message_that_grows_stays_one_conversation() -> None:
    """A client sending the whole history as one growing user message keeps its key turn after turn."""
    t = Threads()
    t.key("s", Opening("", "turn one"))
    assert t.key("s", Opening("", "turn one, reply, turn two")) == "s"
    assert t.key("s", Opening("", "turn")) != "s"  # shorter than it opened with: another conversation


def test_no_opening_keeps_the_session_key() -> None:
    """A raw prompt (no conversation structure) is the session's one conversation."""
    t = Threads()
    t.key("s", MAIN)
    assert t.key("s", None) == "s"


def test_past_the_bound_the_least_recently_used_thread_is_forgotten_never_the_main() -> None:
    """A session holds at most max_threads conversations; the oldest other one is handed to on_forget."""
    forgot: list[str] = []
    t = Threads(max_threads=3, on_forget=forgot.append)
    ops = [Opening(f"sys{i}", "task") for i in range(5)]
    t.key("s", ops[0])  # main
    k1, k2 = t.key("s", ops[1]), t.key("s", ops[2])
    t.key("s", ops[0])  # the main used again: now the most recent
    t.key("s", ops[3])
    assert forgot == [k1]
    t.key("s", ops[4])
    assert forgot == [k1, k2]
    assert "s" in t.threads_of("s")


def test_a_key_of_a_long_id_stays_a_valid_session_id() -> None:
    """The key travels as X-Session-Id on the hop: it never passes 256 bytes nor cuts a character."""
    key = thread_key("é" * 200, MAIN)
    assert len(key.encode()) <= MAX_KEY_BYTES
    key.encode().decode()  # whole characters only


def test_the_opening_of_messages_is_the_system_prompt_and_first_user_text() -> None:
    """Text parts are joined (a message growing by parts keeps its start); a later user message changes nothing."""
    one = opening_of([{"role": "system", "content": "S"}, {"role": "user", "content": [{"type": "text", "text": "a"}]}])
    two = opening_of([{"role": "system", "content": "S"},
                      {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                      {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}])
    assert one.head == two.head and one.first == "a" and two.first.startswith(one.first)
    assert opening_of([{"role": "system", "content": "T"}, {"role": "user", "content": "a"}]).head != one.head


def test_an_entry_new_to_a_session_is_seeded_with_the_main_conversation_the_mesh_knows() -> None:
    """Another entry saw the session open: its main conversation keeps the id here too, a subagent does not."""
    a, b = Threads(), Threads()
    a.key("cc-1", MAIN)
    sub = Opening("sys-explore", "find the bug")
    assert b.key("cc-1", sub, known={"cc-1": a.signature("cc-1", "cc-1")}) == a.key("cc-1", sub) != "cc-1"
    assert b.key("cc-1", Opening(MAIN.head, MAIN.first + " and more")) == "cc-1"
    assert Threads().key("cc-1", sub, known={"cc-1": "garbage"}) == "cc-1"  # an unreadable signature seeds nothing


def test_a_growing_conversation_opened_at_another_entry_keeps_its_key_here() -> None:
    """A one-message client's rewritten history (a compaction) keyed at entry a: its later, longer turns arriving
    at entry b, which knows the session but never saw that conversation open, get a's key, not one of their own."""
    a, b, heard = Threads(), Threads(), KnownThreads()
    first = Opening("", "turn one")
    for t in (a, b):
        t.key("s", first)
    compacted = a.key("s", Opening("", "summary of it all"))
    assert compacted != "s"
    heard.heard("s", "s", a.signature("s", "s"))
    heard.heard("s", compacted, a.signature("s", compacted))
    later = Opening("", "summary of it all, then turn two, then turn three")
    assert thread_key("s", later) != compacted  # what b would mint alone
    assert b.key("s", later, known=heard.of("s")) == compacted
    assert b.key("s", Opening("", "turn one, reply, turn two"), known=heard.of("s")) == "s"
    assert b.key("s", Opening("", "something else"), known=heard.of("s")) not in ("s", compacted)


def test_the_heard_conversations_are_bounded_per_session_and_in_sessions() -> None:
    """The index keeps the latest signatures: at most per_session conversations of a session, cap_sessions sessions."""
    heard = KnownThreads(cap_sessions=2, per_session=2)
    for k in ("s", "s#1", "s#2"):
        heard.heard("s", k, "1:0:")
    heard.heard("s", "s#3", "")  # tells nothing
    assert list(heard.of("s")) == ["s#1", "s#2"]
    heard.heard("t", "t", "1:0:")
    heard.heard("u", "u", "1:0:")
    assert not heard.of("s") and list(heard.of("u")) == ["u"]
