"""Structured output across the mesh: a turn forwarded to the session's home carries its constraint there."""

from __future__ import annotations

import json
from typing import Any

import anthropic
from pydantic import BaseModel
from support.conversation import Conversation

from .helpers import MODEL, Mesh


class Person(BaseModel):
    name: str
    age: int


def test_a_forwarded_turn_is_decoded_under_its_constraint_in_every_dialect(make_mesh) -> None:  # type: ignore[no-untyped-def]
    """Entering at the other node, chat parse() (whole and streamed json_object), Responses parse() and Anthropic
    tool_choice any all run on the home and come back in the shape asked for."""
    m: Mesh = make_mesh(slots=2)
    conv = Conversation("fwd-constraint", seed=3)
    home = m.turn(conv, "a").host
    m.settle(conv)
    entry = next(n for n in m.names if n != home)
    c, h = m.client(entry), {"X-Session-Id": conv.session}
    raw = c.chat.completions.with_raw_response.parse(model=MODEL, messages=conv.messages, response_format=Person,
                                                     max_tokens=2000, temperature=0, extra_headers=h)
    assert raw.headers["x-kvmesh-host"] == home
    assert isinstance(raw.parse().choices[0].message.parsed, Person)
    stream = c.chat.completions.create(model=MODEL, messages=conv.messages, max_tokens=2000, temperature=0, stream=True,
                                       response_format={"type": "json_object"}, extra_headers=h)
    assert isinstance(json.loads("".join(x.choices[0].delta.content or "" for x in stream if x.choices)), dict)
    rr = c.responses.with_raw_response.parse(model=MODEL, input=conv.messages[-1]["content"], text_format=Person,
                                             max_output_tokens=2000, temperature=0, extra_headers=h)
    assert rr.headers["x-kvmesh-host"] == home and isinstance(rr.parse().output_parsed, Person)
    a = anthropic.Anthropic(base_url=m.api(entry), api_key="x", max_retries=0)
    tools: Any = [{"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}]
    ar = a.messages.with_raw_response.create(model=MODEL, max_tokens=2000, tools=tools, tool_choice={"type": "any"},
                                             messages=[{"role": "user", "content": conv.messages[-1]["content"]}],
                                             extra_headers=h)
    msg = ar.parse()
    assert ar.headers["x-kvmesh-host"] == home and msg.stop_reason == "tool_use", msg
    calls = [b for b in msg.content if b.type == "tool_use"]
    assert calls and all(b.name == "get_weather" and isinstance(b.input.get("city"), str) for b in calls), msg.content  # type: ignore[union-attr]
