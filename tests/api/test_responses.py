"""OpenAI Responses (`POST /v1/responses`, `/responses`) through the official `openai` client.

The server is the sim engine with a test-only `scripted_reply`: every answer is SCRIPT (some
text, then one Hermes tool call). With function tools declared the API turns the call into a
`function_call` output item; without them the whole script is output text. The path tested
here is Codex CLI's: store=false, the whole conversation in `input` each turn, prompt_cache_key
naming the session (stored responses and previous_response_id: test_responses_stored.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvmesh.node.api.responses_routes import ResponseBuilder
from kvmesh.node.api.responses_schema import ResponsesRequest
from kvmesh.node.config import EngineConfig, NodeConfig, SimConfig
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread
from kvmesh.node.mesh.answer import Finish

MODEL = "gpt-5-codex"
TEXT = "Let me check. "
SCRIPT = TEXT + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
INSTRUCTIONS = "You are Codex, a coding agent. Work in the repository."

TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
               "response.output_text.delta", "response.output_text.done", "response.content_part.done",
               "response.output_item.done"]
CALL_EVENTS = ["response.output_item.added", "response.function_call_arguments.delta",
               "response.function_call_arguments.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def srv() -> Iterator[ThreadedServer]:
    """A sim server whose every reply is SCRIPT, answering to claude-* and gpt-*."""
    sim = SimConfig(kv_scale=0.01, decode_tps=2000, prefill_tps=1e6, scripted_reply=SCRIPT)
    server = serve_in_thread(NodeConfig(name="api-responses", engine=EngineConfig(
        kind="sim", cache_bytes=64 << 20, slots=2, queue_max=2, queue_timeout_s=20.0, sim=sim,
        served_names=["claude-*", "gpt-*"])))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(srv: ThreadedServer) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=60.0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(srv: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=60.0) as h:
        yield h


def _create(client: openai.OpenAI, input_: Any, **kw: Any) -> Any:
    kw.setdefault("max_output_tokens", 400)
    return client.responses.create(model=MODEL, input=input_, **kw)


def _collapsed(types: list[str]) -> list[str]:
    """Event types with runs of one delta type collapsed to one entry."""
    out: list[str] = []
    for t in types:
        if not (t.endswith(".delta") and out and out[-1] == t):
            out.append(t)
    return out


def _cluster_source(http: httpx.Client, session: str) -> str | None:
    found = [s for s in http.get("/v1/cluster").json()["sessions"] if s["session"] == session]
    return found[0]["id_source"] if found else None


def test_whole_response(client):
    """Not streamed: a resp_ id, one completed message item (msg_ id) whose output_text is the reply, usage with cached_tokens."""
    r = _create(client, "Hello there (whole)")
    assert r.id.startswith("resp_") and r.object == "response" and r.status == "completed" and r.model == MODEL
    assert r.error is None and r.incomplete_details is None
    assert len(r.output) == 1
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert msg.id.startswith("msg_")
    assert [p.type for p in msg.content] == ["output_text"]
    assert r.output_text == msg.content[0].text == SCRIPT
    u = r.usage
    assert isinstance(u.input_tokens_details.cached_tokens, int) and 0 <= u.input_tokens_details.cached_tokens < u.input_tokens
    assert u.output_tokens == len(SCRIPT) and u.total_tokens == u.input_tokens + u.output_tokens


def test_streamed_text_events_in_order(client):
    """Streamed: created, in_progress, item added, part added, text deltas, text done, part done, item done, completed."""
    events = list(_create(client, "Hello there (stream)", stream=True))
    types = [e.type for e in events]
    assert _collapsed(types) == [*TEXT_EVENTS, "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    created, done = events[0].response, events[-1].response
    assert created.status == "in_progress" and done.status == "completed" and created.id == done.id
    assert done.id.startswith("resp_")
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 5
    joined = "".join(d.delta for d in deltas)
    assert joined == done.output_text == SCRIPT
    text_done = next(e for e in events if e.type == "response.output_text.done")
    assert text_done.text == joined
    added = next(e for e in events if e.type == "response.output_item.added")
    item_ids = {added.item.id, done.output[0].id,
                *(e.item_id for e in events if e.type.startswith(("response.output_text", "response.content_part"))),
                next(e for e in events if e.type == "response.output_item.done").item.id}
    assert len(item_ids) == 1 and added.item.id.startswith("msg_")
    assert {e.output_index for e in events if hasattr(e, "output_index")} == {0}
    assert done.usage.output_tokens == len(SCRIPT)


def test_function_call_item(client):
    """With tools: a message item with the text, then a function_call item (call_id, name, arguments JSON)."""
    r = _create(client, "Weather in Paris? (fc)", tools=[WEATHER])
    assert r.status == "completed"
    assert [o.type for o in r.output] == ["message", "function_call"]
    assert r.output_text == TEXT
    fc = r.output[1]
    assert fc.name == "get_weather" and json.loads(fc.arguments) == {"city": "Paris"}
    assert fc.call_id and fc.id and fc.id != fc.call_id and fc.status == "completed"


def test_function_call_streams_its_arguments(client):
    """Streamed with tools: the call's item is added, its arguments come as deltas, then .done and item done."""
    events = list(_create(client, "Weather in Paris? (fc stream)", tools=[WEATHER], stream=True))
    assert _collapsed([e.type for e in events]) == [*TEXT_EVENTS, *CALL_EVENTS, "response.completed"]
    added = [e for e in events if e.type == "response.output_item.added"]
    assert [a.item.type for a in added] == ["message", "function_call"]
    call = added[1].item
    assert call.name == "get_weather" and call.call_id and call.arguments == ""
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) > 5 and {d.item_id for d in deltas} == {call.id} == {done.item_id}
    assert {d.output_index for d in deltas} == {1}
    assert "".join(d.delta for d in deltas) == done.arguments
    assert json.loads(done.arguments) == {"city": "Paris"}
    final = events[-1].response
    assert [o.type for o in final.output] == ["message", "function_call"]
    assert final.output[1].id == call.id and final.output[1].arguments == done.arguments


def test_function_call_round_trip_reuses_the_cache(client, http):
    """Turn 2 (store=false, whole input with function_call + function_call_output, same prompt_cache_key) reads turn 1 cached."""
    key = "codex-round-trip-1"
    turn1 = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris? (round)"}]}]
    kw: dict[str, Any] = {"instructions": INSTRUCTIONS, "tools": [WEATHER], "store": False, "prompt_cache_key": key}
    r1 = _create(client, turn1, **kw)
    fc = next(o for o in r1.output if o.type == "function_call")
    result = f"Sunny, 21 C in {json.loads(fc.arguments)['city']}"
    turn2 = [*turn1, *(o.model_dump(exclude_none=True) for o in r1.output),
             {"type": "function_call_output", "call_id": fc.call_id, "output": result}]
    raw = client.responses.with_raw_response.create(model=MODEL, input=turn2, max_output_tokens=400, **kw)
    r2 = raw.parse()
    assert raw.headers["x-session-id"] == key
    assert r2.status == "completed"
    cached = r2.usage.input_tokens_details.cached_tokens
    assert cached > 0
    assert cached >= r1.usage.input_tokens  # turn 1's whole prompt (and the start of its reply)
    assert r2.usage.input_tokens > r1.usage.input_tokens + len(result)
    assert _cluster_source(http, key) == "prompt_cache_key"


def test_an_unknown_previous_response_id_is_a_404_naming_it(client):
    """previous_response_id of no stored response: openai.NotFoundError naming it (previous_response_not_found)."""
    with pytest.raises(openai.NotFoundError) as ei:
        _create(client, "hi", previous_response_id="resp_0123456789abcdef")
    assert ei.value.status_code == 404
    assert ei.value.body["param"] == "previous_response_id"
    assert ei.value.body["code"] == "previous_response_not_found"


def test_text_format_of_no_known_type_is_refused(client):
    """text.format that is not an object, or of no known type, is a 400; text.format text is accepted."""
    with pytest.raises(openai.BadRequestError) as ei:
        _create(client, "hi", text={"format": "json"})
    assert ei.value.body["param"] == "text" and "text.format" in ei.value.body["message"]
    with pytest.raises(openai.BadRequestError) as ei:
        _create(client, "hi", text={"format": {"type": "yaml"}})
    assert "yaml" in ei.value.body["message"]
    assert _create(client, "hi (format text)", text={"format": {"type": "text"}}).status == "completed"


def test_max_output_tokens_makes_it_incomplete(client):
    """max_output_tokens reached: status incomplete, reason max_output_tokens (streamed: a response.incomplete event)."""
    r = _create(client, "Cut me short.", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == SCRIPT[:5] and r.usage.output_tokens == 5
    events = list(_create(client, "Cut me short.", max_output_tokens=5, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert "response.completed" not in [e.type for e in events]


def test_only_stored_responses_are_found(client, http):
    """GET /v1/responses/{id}: the response answered with store=true (the default); a 404 for store=false's."""
    kept = _create(client, "Store me?", max_output_tokens=5)
    assert client.responses.retrieve(kept.id).output_text == kept.output_text
    r = _create(client, "Forget me.", max_output_tokens=5, store=False)
    with pytest.raises(openai.NotFoundError) as ei:
        client.responses.retrieve(r.id)
    assert ei.value.status_code == 404 and r.id in ei.value.body["message"]
    assert http.get("/responses/resp_nothing").status_code == 404


def test_unprefixed_route_works(srv):
    """POST /responses (no /v1) serves the same: a client whose base URL has no /v1 works."""
    with openai.OpenAI(base_url=srv.url, api_key="x", max_retries=0, timeout=60.0) as c:
        r = c.responses.create(model=MODEL, input="Hello (unprefixed)", max_output_tokens=400)
    assert r.id.startswith("resp_") and r.status == "completed" and r.output_text == SCRIPT


def test_prompt_cache_key_names_the_session(client, http):
    """prompt_cache_key is the session id: echoed in X-Session-Id, id_source prompt_cache_key in /v1/cluster."""
    key = "019a-codex-conversation-key"
    raw = client.responses.with_raw_response.create(model=MODEL, input="hi (key)", max_output_tokens=5,
                                                    prompt_cache_key=key)
    assert raw.headers["x-session-id"] == key
    assert _cluster_source(http, key) == "prompt_cache_key"
    # An X-Session-Id header comes first in the order.
    raw = client.responses.with_raw_response.create(model=MODEL, input="hi (key)", max_output_tokens=5,
                                                    prompt_cache_key=key, extra_headers={"X-Session-Id": "hdr-wins"})
    assert raw.headers["x-session-id"] == "hdr-wins"


def test_reasoning_is_accepted_and_said_ignored(client):
    """reasoning is accepted (200) and named in X-Kvmesh-Ignored; without it there is no such header."""
    raw = client.responses.with_raw_response.create(model=MODEL, input="Think (reasoning)", max_output_tokens=400,
                                                    reasoning={"effort": "high", "summary": "auto"})
    assert raw.status_code == 200 and "reasoning" in raw.headers["x-kvmesh-ignored"].split(",")
    assert raw.parse().output_text == SCRIPT
    with client.responses.with_streaming_response.create(model=MODEL, input="Think", max_output_tokens=5,
                                                         reasoning={"effort": "low"}, stream=True) as s:
        assert "reasoning" in s.headers["x-kvmesh-ignored"]
    plain = client.responses.with_raw_response.create(model=MODEL, input="Think", max_output_tokens=5)
    assert "x-kvmesh-ignored" not in plain.headers


def _history(reasoning: dict[str, Any] | None) -> list[dict[str, Any]]:
    """A Codex-style turn-2 input: user, (an earlier turn's reasoning item), assistant message, user."""
    items: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "input_text", "text": "Plan it. (reasoning item)"}]}]
    if reasoning is not None:
        items.append(reasoning)
    return [*items, {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Planned."}]},
            {"role": "user", "content": [{"type": "input_text", "text": "Go on."}]}]


def test_reasoning_items_of_earlier_turns_are_dropped(client):
    """A reasoning item (summary, encrypted_content) in input is accepted and leaves the prompt as without it."""
    item = {"type": "reasoning", "id": "rs_0123", "summary": [{"type": "summary_text", "text": "Thought about it."}],
            "encrypted_content": "gAAAAABo-opaque"}
    without = _create(client, _history(None), max_output_tokens=5, include=["reasoning.encrypted_content"])
    with_item = _create(client, _history(item), max_output_tokens=5, include=["reasoning.encrypted_content"])
    assert with_item.status == without.status == "incomplete"
    assert with_item.usage.input_tokens == without.usage.input_tokens


def test_reasoning_item_with_reasoning_text_content_is_dropped(client):
    """A reasoning item whose content holds reasoning_text parts (as open-weight providers' Codex turns carry) is dropped too."""
    item = {"type": "reasoning", "id": "rs_0456", "summary": [],
            "content": [{"type": "reasoning_text", "text": "First I will look at the files."}]}
    without = _create(client, _history(None), max_output_tokens=5)
    with_item = _create(client, _history(item), max_output_tokens=5)
    assert with_item.usage.input_tokens == without.usage.input_tokens


def test_an_empty_answer_is_one_empty_message():
    """An answer whose first token ended it is one empty output_text message, whole and streamed, never no output."""
    b = ResponseBuilder(ResponsesRequest(model=MODEL, input="hi", stream=True))
    frames = b.start() + b.feed(Finish("stop", prompt_tokens=3))
    types = [json.loads(f.split(b"data: ", 1)[1])["type"] for f in frames]
    assert types == [*TEXT_EVENTS[:4], *TEXT_EVENTS[5:], "response.completed"]
    (item,) = b.response()["output"]
    assert item["type"] == "message" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]
