"""Which session a turn belongs to: the documented order of client headers and fields, and its errors."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest

from kvmesh.node.api.sessionid import SOURCES, Named, claude_session_part, name_session
from kvmesh.node.errors import InvalidRequest

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
EVERY = {"X-Session-Id": "kv", "X-Claude-Code-Session-Id": "cc", "session_id": "codex", "conversation_id": "conv",
         "x-litellm-session-id": "litellm", "x-session-affinity": "aff"}
EVERY_BODY = Named(metadata_user_id=json.dumps({"session_id": "meta"}), prompt_cache_key="pck", user="u")


def test_each_source_wins_over_the_ones_after_it() -> None:
    """Taking the sources away one by one walks the documented order, down to the digest."""
    headers, named = dict(EVERY), EVERY_BODY
    seen = []
    for _ in SOURCES:
        got = name_session(httpx.Headers(headers), named, MSGS)
        seen.append(got.source)
        if got.source in headers:
            del headers[got.source]
        elif got.source == "metadata.user_id":
            named = Named(prompt_cache_key=named.prompt_cache_key, user=named.user)
        elif got.source == "prompt_cache_key":
            named = Named(user=named.user)
        elif got.source == "user":
            named = Named()
    assert tuple(seen) == SOURCES


def test_headers_are_read_case_insensitively_and_values_kept() -> None:
    """x-claude-code-session-id in lower case names the session with its value as sent."""
    got = name_session(httpx.Headers({"x-claude-code-session-id": "a/b c"}), Named(), MSGS)
    assert (got.id, got.source) == ("a/b c", "X-Claude-Code-Session-Id")


def test_claude_code_user_id_forms() -> None:
    """metadata.user_id: the JSON form's session_id, the older _session_ tail; a plain user id has no session part."""
    sid = str(uuid.uuid4())
    assert claude_session_part(json.dumps({"device_id": "d", "account_uuid": "a", "session_id": sid})) == sid
    assert claude_session_part(f"user_{'ab' * 32}_account_{uuid.uuid4()}_session_{sid}") == sid
    assert claude_session_part("test_user_123") is None
    assert claude_session_part("{not json") is None
    got = name_session(httpx.Headers({}), Named(metadata_user_id="test_user_123", user="u1"), MSGS)
    assert (got.id, got.source) == ("u1", "user")


def test_digest_is_stable_across_a_conversations_turns() -> None:
    """Without any id, later turns of one conversation (same opening) name the same session; another opening differs."""
    a = name_session(httpx.Headers({}), Named(), MSGS)
    b = name_session(httpx.Headers({}), Named(), [*MSGS, {"role": "assistant", "content": "yo"},
                                                 {"role": "user", "content": "more"}])
    c = name_session(httpx.Headers({}), Named(), [{"role": "user", "content": "other"}])
    assert a == b and a.source == "digest" and c.id != a.id


@pytest.mark.parametrize("source", ["X-Claude-Code-Session-Id", "session_id", "prompt_cache_key"])
def test_a_bad_id_is_a_400_naming_its_source(source: str) -> None:
    """An id with a control character is refused, naming where it came from, never passed over."""
    bad = "a\x01b"
    headers = httpx.Headers({source: bad}) if source != "prompt_cache_key" else httpx.Headers({})
    named = Named(prompt_cache_key=bad) if source == "prompt_cache_key" else Named()
    with pytest.raises(InvalidRequest) as ei:
        name_session(headers, named, MSGS)
    assert ei.value.param == source and source in str(ei.value)


def test_cluster_view_shows_what_named_each_session(sim_url: str, sim) -> None:  # type: ignore[no-untyped-def]
    """A chat turn named by X-Claude-Code-Session-Id, another by user: /v1/cluster says which source named which."""
    cc, user = f"cc-{uuid.uuid4().hex[:8]}", f"u-{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=sim_url, timeout=30) as h:
        for headers, extra in (({"X-Claude-Code-Session-Id": cc}, {}), ({}, {"user": user})):
            r = h.post("/v1/chat/completions", headers=headers, json={"model": sim.model, "max_tokens": 2, **extra,
                                                                      "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
        sessions = {s["session"]: s for s in h.get("/v1/cluster").json()["sessions"]}
    assert sessions[cc]["id_source"] == "X-Claude-Code-Session-Id"
    assert sessions[user]["id_source"] == "user"
