"""Chat messages a template cannot render faithfully are a 400 saying which message, before any turn runs."""

from __future__ import annotations

from typing import Any

import pytest

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
BAD: list[tuple[str, list[dict[str, Any]], str]] = [
    ("two assistants", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                        {"role": "assistant", "content": "c"}], "two assistant messages"),
    ("empty assistant", [{"role": "user", "content": "a"}, {"role": "assistant", "content": None},
                         {"role": "user", "content": "c"}], "needs content or tool_calls"),
    ("orphan tool", [{"role": "user", "content": "a"}, {"role": "tool", "tool_call_id": "x", "content": "r"}],
     "must follow an assistant message"),
    ("unknown call id", [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [CALL]},
                         {"role": "tool", "tool_call_id": "call_2", "content": "r"}], "names no call"),
    ("image part", [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}],
     "image input is not supported"),
]
GOOD = [
    [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "tool", "content": "out"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [CALL]},
     {"role": "tool", "tool_call_id": "call_1", "content": "r"}, {"role": "assistant", "content": "done"},
     {"role": "user", "content": "ok"}],
]


@pytest.mark.parametrize(("name", "messages", "says"), BAD, ids=[b[0] for b in BAD])
def test_malformed_sequences_are_400(check_error, sim, http_sim, name: str, messages: list[dict[str, Any]],
                                     says: str) -> None:  # type: ignore[no-untyped-def]
    """Each malformed sequence is refused with param messages and a message naming the problem."""
    r = http_sim.post("/v1/chat/completions", json={"model": sim.model, "messages": messages, "max_tokens": 2})
    err = check_error(r, 400, param="messages")
    assert says in err["message"], err


@pytest.mark.parametrize("messages", GOOD)
def test_well_formed_sequences_are_served(sim, http_sim, messages: list[dict[str, Any]]) -> None:  # type: ignore[no-untyped-def]
    """Two user messages in a row, a tool output after a plain reply, and a tool round trip, are served."""
    r = http_sim.post("/v1/chat/completions", json={"model": sim.model, "messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
