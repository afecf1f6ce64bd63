"""Tool calling end to end: the official OpenAI client against real servers on loopback.

The sim engine does not call tools by itself, so these servers set its test-only
`scripted_reply`: every reply is a fixed text, decoded token by token through the real
turn path (slots, prefix reuse, the API's tool-call parser and formatting). What is
checked is what the API makes of that text, and that the request's tools reach the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvmesh.node.config import EngineConfig, NodeConfig, SimConfig
from kvmesh.node.engine.tokenizer import ByteTokenizer
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread

CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
READ = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
TOOLS = [WEATHER, READ]
# Written exactly as chat.py renders an assistant's tool calls back, so turn 2 reuses turn 1's reply.
SCRIPT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "read_file", "arguments": {"path": "notes/a b.txt"}}\n</tool_call>')
# Invalid JSON where the call's arguments begin: what a model left unconstrained might write.
BROKEN = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
MSGS = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Weather in Paris? Read notes/a b.txt."}]


def _server(name: str, reply: str) -> Iterator[ThreadedServer]:
    sim = SimConfig(kv_scale=0.01, decode_tps=2000, prefill_tps=1e6, scripted_reply=reply)
    srv = serve_in_thread(NodeConfig(name=name, engine=EngineConfig(kind="sim", cache_bytes=64 << 20, slots=2,
                                                                    queue_max=2, sim=sim)))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def scripted() -> Iterator[ThreadedServer]:
    """A sim server whose every reply is SCRIPT (two Hermes tool calls)."""
    yield from _server("api-tools", SCRIPT)


@pytest.fixture(scope="module")
def broken() -> Iterator[ThreadedServer]:
    """A sim server whose every reply is BROKEN (a tool call with invalid JSON)."""
    yield from _server("api-tools-broken", BROKEN)


@pytest.fixture(scope="module")
def client(scripted: ThreadedServer) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=scripted.v1, api_key="x", max_retries=0, timeout=60.0)
    yield c
    c.close()


def _create(client: openai.OpenAI, model: str, session: str, **kw: Any) -> Any:
    kw.setdefault("messages", MSGS)
    return client.chat.completions.create(model=model, max_tokens=400, temperature=0,
                                          extra_headers={"X-Session-Id": session}, **kw)


def test_tool_calls_come_back_as_message_tool_calls(scripted, client):
    """Without streaming: two tool calls with call_ ids and JSON arguments, content null, finish_reason tool_calls."""
    r = _create(client, scripted.model, "tools-whole", tools=TOOLS)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    calls = ch.message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather", "read_file"]
    assert [json.loads(c.function.arguments) for c in calls] == [{"city": "Paris"}, {"path": "notes/a b.txt"}]
    assert all(c.type == "function" and c.id.startswith("call_") and len(c.id) > 10 for c in calls)
    assert calls[0].id != calls[1].id
    assert r.usage.completion_tokens == len(SCRIPT)


def test_tool_calls_stream_as_openai_deltas(scripted, client):
    """Streaming: each call's first delta has index, id, type and name; its arguments follow in fragments; finish_reason tool_calls."""
    chunks = list(_create(client, scripted.model, "tools-stream", tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == ""
    calls: dict[int, dict[str, Any]] = {}
    for d in deltas:
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "frags": [tc.function.arguments or ""]}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["frags"].append(tc.function.arguments)
    assert [calls[i]["name"] for i in sorted(calls)] == ["get_weather", "read_file"]
    assert "".join(calls[0]["frags"]) == '{"city": "Paris"}' and "".join(calls[1]["frags"]) == '{"path": "notes/a b.txt"}'
    assert len(calls[0]["frags"]) > 5, "arguments are streamed as the model writes them"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["tool_calls"]


def test_without_tools_or_with_tool_choice_none_the_text_is_content(scripted, client):
    """No tools, or tool_choice "none": the reply is plain content (not parsed) and finish_reason stop."""
    for kw in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        r = _create(client, scripted.model, "tools-none", **kw)
        assert r.choices[0].message.content == SCRIPT and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"


def test_tools_reach_the_prompt(scripted, client):
    """The tools are rendered into the prompt: prompt_tokens is the byte template's length with them, the text names them."""
    with_tools = _create(client, scripted.model, "tools-prompt-a", tools=TOOLS).usage.prompt_tokens
    without = _create(client, scripted.model, "tools-prompt-b").usage.prompt_tokens
    none = _create(client, scripted.model, "tools-prompt-c", tools=TOOLS, tool_choice="none").usage.prompt_tokens
    tok = ByteTokenizer()
    prompt = tok.apply_chat_template(MSGS, tools=TOOLS)
    assert with_tools == len(prompt) and without == len(tok.apply_chat_template(MSGS))
    # "none" shows the tools too (the prompt's head stays the same whatever the choice) and adds its note at the end.
    assert none == len(tok.apply_chat_template(MSGS, tools=TOOLS, tool_choice="none")) > with_tools
    assert with_tools > without + len(json.dumps(TOOLS))
    text = tok.decode(prompt)
    assert "get_weather" in text and "The weather in a city now" in text and "<tool_call>" in text


def test_a_tool_round_trip_reuses_the_cache(scripted, client):
    """Turn 2 sends back the calls and their results: 200, and its prompt reuses all of turn 1's prompt and reply."""
    r1 = _create(client, scripted.model, "tools-round", tools=TOOLS)
    msg = r1.choices[0].message
    turn2 = [*MSGS, msg.model_dump(exclude_none=True),
             *({"role": "tool", "tool_call_id": c.id, "content": f"result of {c.function.name}"} for c in msg.tool_calls)]
    r2 = _create(client, scripted.model, "tools-round", tools=TOOLS, messages=turn2)
    assert r2.choices[0].finish_reason == "tool_calls"
    # The KV of turn 1's prompt and every reply token but the last is held, and turn 2's prompt repeats it.
    assert r2.usage.prompt_tokens_details.cached_tokens == r1.usage.prompt_tokens + r1.usage.completion_tokens - 1


def test_parallel_tool_calls_false_returns_the_first_call(scripted, client):
    """parallel_tool_calls false: only the first call comes back."""
    r = _create(client, scripted.model, "tools-one", tools=TOOLS, parallel_tool_calls=False)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]


def test_a_call_the_model_would_break_is_kept_valid_by_the_constraint(broken):
    """The model (its script) starts a call and writes invalid JSON: under tool_choice auto the call, once begun,
    follows the tool's schema, so the answer is its text and a call whose arguments parse; streamed too."""
    with openai.OpenAI(base_url=broken.v1, api_key="x", max_retries=0, timeout=60.0) as c:
        r = _create(c, broken.model, "tools-broken", tools=TOOLS)
        msg = r.choices[0].message
        assert (msg.content or "").strip() == "Checking." and r.choices[0].finish_reason == "tool_calls", msg
        assert [tc.function.name for tc in msg.tool_calls or []] == ["get_weather"]
        assert isinstance(json.loads(msg.tool_calls[0].function.arguments)["city"], str)  # type: ignore[index]
        chunks = list(_create(c, broken.model, "tools-broken-s", tools=TOOLS, stream=True))
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["tool_calls"]
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices).strip() == "Checking."


BAD_TOOLS: dict[str, tuple[dict[str, Any], str, str]] = {
    "type": ({"tools": [{"type": "retrieval"}]}, "tools", "function"),
    "name": ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools", "pattern"),
    "parameters": ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
                   "tools", "JSON Schema"),
    "duplicate": ({"tools": [WEATHER, WEATHER]}, "tools", "declared twice"),
    "choice": ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    "named-unknown": ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                      "tool_choice", "not in tools"),
    "required-without-tools": ({"tool_choice": "required"}, "tool_choice", "needs tools"),
}


@pytest.mark.parametrize("case", list(BAD_TOOLS))
def test_invalid_tools_are_400_naming_the_field(scripted, check_error, case):
    """An invalid tool definition or tool_choice is a 400 OpenAI error naming the parameter and the reason."""
    extra, param, says = BAD_TOOLS[case]
    with httpx.Client(base_url=scripted.url, timeout=30) as h:
        check_error(h.post(CHAT, json={"model": scripted.model, "messages": MSGS, **extra}), 400, param=param, says=says)
