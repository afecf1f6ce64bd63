"""Session id derivation: X-Session-Id header, else `user`, else a hash of the first system+user message.

The id a turn ran under comes back in the X-Session-Id response header.
"""

from __future__ import annotations

from typing import Any

import httpx

from kvmesh.node.protocol import is_valid_session_id

CHAT = "/v1/chat/completions"


def _session(http: httpx.Client, model: str, messages: list[dict[str, Any]], *, header: str | None = None,
             user: str | None = None, stream: bool = False) -> str:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": 2, "stream": stream}
    if user is not None:
        body["user"] = user
    r = http.post(CHAT, json=body, headers={"X-Session-Id": header} if header is not None else {})
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]")
    return r.headers["x-session-id"]


CONV = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "What is a session?"}]


def test_header_is_echoed(sim, http_sim):
    """X-Session-Id is used as the session and echoed in the response, streaming or not."""
    assert _session(http_sim, sim.model, CONV, header="sess-echo-1") == "sess-echo-1"
    assert _session(http_sim, sim.model, CONV, header="sess-echo-2", stream=True) == "sess-echo-2"


def test_header_wins_over_user(sim, http_sim):
    """With both the header and `user`, the header names the session."""
    assert _session(http_sim, sim.model, CONV, header="sess-hdr", user="alice") == "sess-hdr"


def test_user_names_the_session(sim, sim_client):
    """Without the header, a safe `user` is the session id, as reported by the OpenAI client's raw response."""
    raw = sim_client.chat.completions.with_raw_response.create(model=sim.model, messages=CONV, max_tokens=2,
                                                               user="alice-01")
    assert raw.headers["x-session-id"] == "alice-01"
    assert raw.parse().choices


def test_any_printable_user_is_the_session_id_itself(sim, http_sim):
    """A `user` with spaces, '/' and '..' is the session id as sent: stable for the same user, distinct per user."""
    a1 = _session(http_sim, sim.model, CONV, user="Alice Smith/../x")
    a2 = _session(http_sim, sim.model, CONV, user="Alice Smith/../x")
    b = _session(http_sim, sim.model, CONV, user="Bob Smith/../x")
    assert a1 == a2 == "Alice Smith/../x"
    assert b == "Bob Smith/../x"


def test_derived_from_first_system_and_user_message(sim, http_sim):
    """Without header or user, the id is a stable hash of the first system+user message, the same on later turns."""
    turn1 = _session(http_sim, sim.model, CONV)
    again = _session(http_sim, sim.model, CONV)
    later = _session(http_sim, sim.model, CONV + [
        {"role": "assistant", "content": "A conversation."}, {"role": "user", "content": "And a turn?"},
    ])
    streamed = _session(http_sim, sim.model, CONV, stream=True)
    assert turn1 == again == later == streamed
    assert is_valid_session_id(turn1)
    other_user = _session(http_sim, sim.model, [CONV[0], {"role": "user", "content": "Something else"}])
    other_system = _session(http_sim, sim.model, [{"role": "system", "content": "Be curt."}, CONV[1]])
    no_system = _session(http_sim, sim.model, [CONV[1]])
    assert len({turn1, other_user, other_system, no_system}) == 4


def test_empty_user_falls_back_to_derived(sim, http_sim):
    """An empty `user` is ignored: the id is derived from the messages."""
    assert _session(http_sim, sim.model, CONV, user="") == _session(http_sim, sim.model, CONV)


def test_session_carries_cache_across_turns(sim, sim_client):
    """Turns of one derived session reuse its cache; the same text under another header id starts cold."""
    system = {"role": "system", "content": "Sim cache check. " * 40}  # 680 chars
    t1 = [system, {"role": "user", "content": "one"}]
    r1 = sim_client.chat.completions.create(model=sim.model, messages=t1, max_tokens=4, temperature=0)
    t2 = t1 + [{"role": "assistant", "content": r1.choices[0].message.content}, {"role": "user", "content": "two"}]
    r2 = sim_client.chat.completions.create(model=sim.model, messages=t2, max_tokens=4, temperature=0)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens
    # Another session shares only whole blocks of the common prefix (by hash), not the tail.
    r3 = sim_client.chat.completions.create(model=sim.model, messages=t2, max_tokens=4, temperature=0,
                                            extra_headers={"X-Session-Id": "sim-cache-other"})
    assert r3.usage.prompt_tokens_details.cached_tokens % 256 == 0
    assert r3.usage.prompt_tokens_details.cached_tokens < r2.usage.prompt_tokens_details.cached_tokens
