"""Anthropic Messages (`POST /v1/messages`, `/v1/messages/count_tokens`) through the official `anthropic` client.

The server is the sim engine with a test-only `scripted_reply`: every answer is SCRIPT (some
text, then one Hermes tool call), decoded token by token through the real turn path. With
tools declared the API turns the call into a `tool_use` block; without them (or with
tool_choice none) the whole script is text. It serves the names "claude-*" and "gpt-*", as a
node configured for Claude Code does. Raw SSE and error bodies are checked with httpx.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import pytest

from kvmesh.node.config import EngineConfig, NodeConfig, SimConfig
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread

MODEL = "claude-sonnet-4-5"
TEXT = "Let me check. "
SCRIPT = TEXT + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"name": "get_weather", "description": "The weather in a city now",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
READ = {"name": "read_file", "description": "Read a file",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
USAGE_KEYS = {"input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"}
BLOCK = 256  # the sim engine's KV block, in tokens


def _run_tool(name: str, args: dict[str, Any]) -> str:
    """The client side of a tool call: what the agent would run."""
    assert name == "get_weather", name
    return f"Sunny, 21 C in {args['city']}"


@pytest.fixture(scope="module")
def srv() -> Iterator[ThreadedServer]:
    """A sim server whose every reply is SCRIPT, answering to claude-* and gpt-*."""
    sim = SimConfig(kv_scale=0.01, decode_tps=2000, prefill_tps=1e6, scripted_reply=SCRIPT)
    server = serve_in_thread(NodeConfig(name="api-anthropic", engine=EngineConfig(
        kind="sim", cache_bytes=64 << 20, slots=2, queue_max=2, queue_timeout_s=20.0, sim=sim,
        served_names=["claude-*", "gpt-*"])))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(srv: ThreadedServer) -> Iterator[anthropic.Anthropic]:
    c = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60.0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(srv: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=60.0) as h:
        yield h


def _ask(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def _create(client: anthropic.Anthropic, messages: list[dict[str, Any]], session: str | None = None,
            **kw: Any) -> Any:
    kw.setdefault("max_tokens", 400)
    if session is not None:
        kw["extra_headers"] = {"X-Session-Id": session, **kw.get("extra_headers", {})}
    return client.messages.create(model=MODEL, messages=messages, **kw)


def _sse(text: str) -> list[dict[str, Any]]:
    """Anthropic SSE as its data objects; each event's `event:` line names its data's type."""
    out = []
    for frame in text.split("\n\n"):
        if not frame.strip():
            continue
        lines = frame.split("\n")
        kinds = [ln.removeprefix("event: ") for ln in lines if ln.startswith("event: ")]
        datas = [ln.removeprefix("data: ") for ln in lines if ln.startswith("data: ")]
        assert len(kinds) == 1 and len(datas) == 1, frame
        obj = json.loads(datas[0])
        assert obj["type"] == kinds[0], frame
        out.append(obj)
    return out


def _shape(events: list[dict[str, Any]]) -> list[tuple[str, int | None]]:
    """The event sequence with runs of deltas of one block collapsed to one entry."""
    out: list[tuple[str, int | None]] = []
    for e in events:
        item = (e["type"], e.get("index"))
        if not (item[0] == "content_block_delta" and out and out[-1] == item):
            out.append(item)
    return out


def _blocks(content: list[Any]) -> list[tuple[Any, ...]]:
    """Content blocks without their (random) tool_use ids, for comparing two answers."""
    return [(b.type, b.text) if b.type == "text" else (b.type, b.name, b.input) for b in content]


def _count(client: anthropic.Anthropic, messages: list[dict[str, Any]], **kw: Any) -> int:
    return client.messages.count_tokens(model=MODEL, messages=messages, **kw).input_tokens


# ---- whole messages --------------------------------------------------------------------------

def test_whole_message_with_a_tool_call(client):
    """With tools: a message of a text block then a tool_use block (id, name, input object), stop_reason tool_use."""
    m = _create(client, _ask("Weather in Paris? (whole)"), "a-whole", tools=[WEATHER])
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.id.startswith("msg_") and len(m.id) > 10
    assert [b.type for b in m.content] == ["text", "tool_use"]
    assert m.content[0].text == TEXT
    call = m.content[1]
    assert call.name == "get_weather" and call.input == {"city": "Paris"} and call.id
    assert m.stop_reason == "tool_use" and m.stop_sequence is None
    u = m.usage
    assert u.output_tokens == len(SCRIPT)
    assert u.cache_creation_input_tokens == 0
    assert u.input_tokens > 0 and u.cache_read_input_tokens >= 0
    # The prompt is what count_tokens says: computed this turn plus read from the cache.
    assert u.input_tokens + u.cache_read_input_tokens == _count(client, _ask("Weather in Paris? (whole)"), tools=[WEATHER])


def test_text_only_answer_ends_with_end_turn(client, http):
    """Without tools the whole reply is one text block, stop_reason end_turn; usage has exactly Anthropic's four fields."""
    m = _create(client, _ask("Just talk."), "a-text")
    assert _blocks(m.content) == [("text", SCRIPT)]
    assert m.stop_reason == "end_turn" and m.stop_sequence is None
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 400, "messages": _ask("Just talk.")},
                  headers={"X-Session-Id": "a-text"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body["usage"]) == USAGE_KEYS and all(isinstance(v, int) for v in body["usage"].values())
    assert body["content"] == [{"type": "text", "text": SCRIPT}]


def test_max_tokens_cuts_the_answer(client):
    """max_tokens reached: the text so far, stop_reason max_tokens, output_tokens == max_tokens."""
    m = _create(client, _ask("Cut me short."), "a-cut", max_tokens=5)
    assert _blocks(m.content) == [("text", SCRIPT[:5])]
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 5


def test_stop_sequence_is_named(client, http):
    """A stop sequence ends the text before it, stop_reason stop_sequence and stop_sequence naming the one that hit."""
    m = _create(client, _ask("Stop early."), "a-stop", stop_sequences=["zebra", "check"])
    assert _blocks(m.content) == [("text", "Let me ")]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "check"
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 400, "messages": _ask("Stop early."),
                                        "stop_sequences": ["zebra", "check"], "stream": True})
    delta = [e for e in _sse(r.text) if e["type"] == "message_delta"]
    assert [d["delta"] for d in delta] == [{"stop_reason": "stop_sequence", "stop_sequence": "check"}]


def test_second_request_reads_the_cache(client):
    """The same request again in one session: nearly all of its prompt is cache_read_input_tokens, the total unchanged."""
    msgs = _ask("Repeat after me, please. " * 4)
    m1 = _create(client, msgs, "a-again")
    m2 = _create(client, msgs, "a-again")
    p1 = m1.usage.input_tokens + m1.usage.cache_read_input_tokens
    assert m2.usage.input_tokens + m2.usage.cache_read_input_tokens == p1
    assert m2.usage.cache_read_input_tokens >= p1 - 1 and m2.usage.input_tokens >= 1
    assert m2.usage.cache_creation_input_tokens == 0


# ---- streaming -------------------------------------------------------------------------------

def test_stream_event_order(srv, http):
    """Raw SSE: message_start, ping, start/deltas/stop per block with indices 0, 1, message_delta, message_stop."""
    body = {"model": MODEL, "max_tokens": 400, "stream": True, "tools": [WEATHER], "messages": _ask("Stream it.")}
    r = http.post("/v1/messages", json=body, headers={"X-Session-Id": "a-stream"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r.text)
    assert _shape(events) == [("message_start", None), ("ping", None),
                              ("content_block_start", 0), ("content_block_delta", 0), ("content_block_stop", 0),
                              ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
                              ("message_delta", None), ("message_stop", None)]
    start = events[0]["message"]
    assert start["id"].startswith("msg_") and start["role"] == "assistant" and start["model"] == MODEL
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert set(start["usage"]) == USAGE_KEYS
    opened = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert opened[0] == {"type": "text", "text": ""}
    assert opened[1]["type"] == "tool_use" and opened[1]["name"] == "get_weather" and opened[1]["input"] == {}
    assert opened[1]["id"]
    deltas = [e for e in events if e["type"] == "content_block_delta"]
    assert {d["delta"]["type"] for d in deltas if d["index"] == 0} == {"text_delta"}
    assert {d["delta"]["type"] for d in deltas if d["index"] == 1} == {"input_json_delta"}
    assert "".join(d["delta"]["text"] for d in deltas if d["index"] == 0) == TEXT
    args = "".join(d["delta"]["partial_json"] for d in deltas if d["index"] == 1)
    assert json.loads(args) == {"city": "Paris"}
    end = events[-2]
    assert end["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert set(end["usage"]) == USAGE_KEYS and end["usage"]["output_tokens"] == len(SCRIPT)
    assert end["usage"]["input_tokens"] + end["usage"]["cache_read_input_tokens"] == \
        start["usage"]["input_tokens"] + start["usage"]["cache_read_input_tokens"]


def test_stream_of_text_only_has_one_block(http):
    """Without tools the stream has one text block (index 0) and ends with end_turn."""
    body = {"model": MODEL, "max_tokens": 400, "stream": True, "messages": _ask("Stream text.")}
    events = _sse(http.post("/v1/messages", json=body).text)
    assert _shape(events) == [("message_start", None), ("ping", None), ("content_block_start", 0),
                              ("content_block_delta", 0), ("content_block_stop", 0), ("message_delta", None),
                              ("message_stop", None)]
    assert "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta") == SCRIPT
    assert events[-2]["delta"]["stop_reason"] == "end_turn"


def test_sdk_stream_final_message_equals_the_whole_answer(client):
    """messages.stream(...).get_final_message() has the same blocks, stop reason and output tokens as a non-streamed call."""
    msgs = _ask("Same either way?")
    whole = _create(client, msgs, "a-sdk-stream", tools=[WEATHER])
    with client.messages.stream(model=MODEL, max_tokens=400, messages=msgs, tools=[WEATHER],
                                extra_headers={"X-Session-Id": "a-sdk-stream"}) as s:
        texts = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(texts) == TEXT
    assert _blocks(final.content) == _blocks(whole.content) == [("text", TEXT), ("tool_use", "get_weather", {"city": "Paris"})]
    assert final.stop_reason == whole.stop_reason == "tool_use"
    assert final.usage.output_tokens == whole.usage.output_tokens == len(SCRIPT)
    assert (final.usage.input_tokens + final.usage.cache_read_input_tokens
            == whole.usage.input_tokens + whole.usage.cache_read_input_tokens)
    assert final.content[1].id and final.content[1].id != whole.content[1].id


# ---- tools ----------------------------------------------------------------------------------

def _round_trip(client: anthropic.Anthropic, ask: str, result: dict[str, Any], **session: Any) -> tuple[Any, Any, list]:
    """Turn 1 asks; the test runs the tool it calls and sends the tool_result (shaped by `result`) in turn 2."""
    msgs = _ask(ask)
    m1 = client.messages.create(model=MODEL, max_tokens=400, messages=msgs, tools=[WEATHER], **session)
    assert m1.stop_reason == "tool_use"
    call = next(b for b in m1.content if b.type == "tool_use")
    output = _run_tool(call.name, call.input)
    block: dict[str, Any] = {"type": "tool_result", "tool_use_id": call.id, **result}
    block["content"] = output if result.get("content") == "string" else [{"type": "text", "text": output}]
    turn2 = [*msgs, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m1.content]},
             {"role": "user", "content": [block]}]
    m2 = client.messages.create(model=MODEL, max_tokens=400, messages=turn2, tools=[WEATHER], **session)
    return m1, m2, turn2


@pytest.mark.parametrize("how", ["header", "metadata"])
def test_tool_result_round_trip_reuses_the_cache(client, how):
    """Turn 2 sends the tool_use back with its tool_result: 200, and it reads all of turn 1's prompt from the cache."""
    sid = f"a-round-{how}"
    session = ({"extra_headers": {"X-Session-Id": sid}} if how == "header"
               else {"metadata": {"user_id": json.dumps({"device_id": "dev", "session_id": sid})}})
    m1, m2, _ = _round_trip(client, f"Weather in Paris? ({how})", {"content": "string"}, **session)
    p1 = m1.usage.input_tokens + m1.usage.cache_read_input_tokens
    assert m2.stop_reason == "tool_use"
    assert m2.usage.cache_read_input_tokens > 0
    assert m2.usage.cache_read_input_tokens >= p1  # turn 1's prompt and the start of its reply


def test_tool_result_forms_reach_the_prompt(client):
    """A tool_result as a string or as text blocks renders the same; is_error adds the "Error: " prefix; all are 200."""
    _, m_str, conv = _round_trip(client, "Weather? (forms)", {"content": "string"},
                                 extra_headers={"X-Session-Id": "a-forms"})
    _, m_blocks, conv_blocks = _round_trip(client, "Weather? (forms)", {"content": "blocks"},
                                           extra_headers={"X-Session-Id": "a-forms"})
    _, m_err, conv_err = _round_trip(client, "Weather? (forms)", {"content": "blocks", "is_error": True},
                                     extra_headers={"X-Session-Id": "a-forms"})
    assert m_str.stop_reason == m_blocks.stop_reason == m_err.stop_reason == "tool_use"
    assert all(m.usage.cache_read_input_tokens > 0 for m in (m_str, m_blocks, m_err))
    n_str, n_blocks, n_err = (_count(client, c, tools=[WEATHER]) for c in (conv, conv_blocks, conv_err))
    assert n_str == n_blocks
    assert n_err == n_str + len("Error: ")
    assert m_err.usage.input_tokens + m_err.usage.cache_read_input_tokens == n_err


def test_tool_choice_mapping_shows_in_behaviour(client):
    """tool_choice auto -> the script's text and call; any/tool -> the reply is constrained to one call of
    the tool (the script's text ruled out, tool naming the other tool gets that tool); none -> the script as text."""
    msgs = _ask("Which tool? (choice)")
    tools = [WEATHER, READ]

    def ask(choice: dict[str, Any] | None) -> Any:
        # Room for what the constraint writes where the script does not fit it (a uniform choice: strings end by chance).
        kw: dict[str, Any] = {"tools": tools, "max_tokens": 4000} if choice is None else {"tools": tools, "tool_choice": choice,
                                                                                       "max_tokens": 4000}
        return _create(client, msgs, "a-choice", **kw)

    m = ask({"type": "auto"})
    assert [b.type for b in m.content] == ["text", "tool_use"] and m.stop_reason == "tool_use"
    for choice, names, key in (({"type": "any", "disable_parallel_tool_use": True}, ("get_weather", "read_file"), None),
                               ({"type": "tool", "name": "get_weather"}, ("get_weather",), "city"),
                               ({"type": "tool", "name": "read_file"}, ("read_file",), None)):
        m = ask(choice)
        assert m.content and {b.type for b in m.content} == {"tool_use"} and m.stop_reason == "tool_use", (choice, m.content)
        assert len(m.content) == 1 or not choice.get("disable_parallel_tool_use"), m.content
        for call in m.content:
            assert call.name in names and isinstance(call.input, dict), choice
            assert key is None or isinstance(call.input[key], str), call.input  # required by the tool's schema
    m = ask({"type": "none"})
    assert _blocks(m.content) == [("text", SCRIPT)] and m.stop_reason == "end_turn"
    # What each choice put in the prompt: the same tools whatever the choice (so a conversation's prefix survives a
    # change of choice between turns); the grammar enforces any/tool/disable_parallel_tool_use, only "none" adds a note.
    auto = _count(client, msgs, tools=tools)
    assert _count(client, msgs, tools=tools, tool_choice={"type": "any"}) == auto
    assert _count(client, msgs, tools=tools, tool_choice={"type": "tool", "name": "read_file"}) == auto
    assert _count(client, msgs, tools=tools, tool_choice={"type": "none"}) > auto > _count(client, msgs)
    assert _count(client, msgs, tools=tools, tool_choice={"type": "auto", "disable_parallel_tool_use": True}) == auto


# ---- the Claude Code billing header ------------------------------------------------------------

def _billing(cch: str) -> str:
    return f"x-anthropic-billing-header: cc_version=2.1.0; cc_entrypoint=cli; cch={cch};"


def test_billing_header_does_not_break_the_cached_prefix(client, srv):
    """Two requests whose billing block's cch differs, one session: the second reads the first prompt from the cache."""
    system_text = "You are Claude Code, a coding agent. Follow the house rules. " * 12  # ~730 tokens
    msgs = _ask("List the files. (billing)")

    def ask(cch: str, **kw: Any) -> Any:
        system = [{"type": "text", "text": _billing(cch)},
                  {"type": "text", "text": system_text, "cache_control": {"type": "ephemeral"}}]
        return client.messages.with_raw_response.create(model=MODEL, max_tokens=400, system=system, messages=msgs, **kw)

    hdr = {"extra_headers": {"X-Session-Id": "a-billing"}}
    m1, m2 = ask("a1b2c", **hdr).parse(), ask("f9e8d", **hdr).parse()
    assert m1.usage.input_tokens > 2 * BLOCK
    assert m2.usage.cache_read_input_tokens > 0
    assert m2.usage.cache_read_input_tokens >= m1.usage.input_tokens - BLOCK
    # The block is dropped from the prompt: the count is the same as with no billing block at all.
    counts = {_count(client, msgs, system=[{"type": "text", "text": _billing(c)}, {"type": "text", "text": system_text}])
              for c in ("1", "22222")}
    assert counts == {_count(client, msgs, system=system_text)}
    # And from the derived session id: without a session header, both land in one session.
    assert ask("aaaa").headers["x-session-id"] == ask("bbbb").headers["x-session-id"]


# ---- count_tokens ---------------------------------------------------------------------------

def test_count_tokens_matches_the_message(client, http):
    """count_tokens answers only input_tokens (> 0), the message's input_tokens + cache_read for the same request."""
    body = {"model": MODEL, "system": "You count.", "tools": [WEATHER], "messages": _ask("How many tokens? (count)")}
    r = http.post("/v1/messages/count_tokens", json=body)
    assert r.status_code == 200, r.text
    assert set(r.json()) == {"input_tokens"}
    n = r.json()["input_tokens"]
    assert n > 0
    assert client.messages.count_tokens(**body).input_tokens == n
    m = client.messages.create(max_tokens=400, **body)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == n
    assert _count(client, body["messages"]) < n  # the system prompt and tools count


# ---- errors ---------------------------------------------------------------------------------

def test_unknown_model_is_the_sdks_not_found_error(client):
    """An unknown model: anthropic.NotFoundError whose body is Anthropic's error object, not_found_error."""
    for call in (lambda: client.messages.create(model="llama-nope", max_tokens=5, messages=_ask("hi")),
                 lambda: client.messages.count_tokens(model="llama-nope", messages=_ask("hi"))):
        with pytest.raises(anthropic.NotFoundError) as ei:
            call()
        body = ei.value.body
        assert ei.value.status_code == 404
        assert body["type"] == "error" and set(body) == {"type", "error"}
        assert body["error"]["type"] == "not_found_error" and "llama-nope" in body["error"]["message"]


BAD: dict[str, tuple[dict[str, Any], str]] = {
    "no-max_tokens": ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    "bad-role": ({"max_tokens": 5, "messages": [{"role": "system", "content": "hi"}]}, "role"),
    "image": ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}]},
        "image input is not supported"),
    "server-tool": ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
                     "tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 3}]},
                    "web_search_20250305"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_invalid_requests_are_the_sdks_bad_request_error(client, case):
    """Missing max_tokens, a bad role, an image block, a server tool: anthropic.BadRequestError, invalid_request_error."""
    extra, says = BAD[case]
    with pytest.raises(anthropic.BadRequestError) as ei:
        # The client's own post: the typed create() would refuse a missing max_tokens before sending.
        client.post("/v1/messages", body={"model": MODEL, **extra}, cast_to=anthropic.types.Message)
    body = ei.value.body
    assert ei.value.status_code == 400
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert says in body["error"]["message"], body
    assert "Traceback" not in json.dumps(body)


def test_image_block_via_the_typed_call(client):
    """The typed messages.create with an image block raises BadRequestError saying image input is not supported."""
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]
    with pytest.raises(anthropic.BadRequestError, match="image input is not supported"):
        client.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": content}])


# ---- accepted fields and headers ------------------------------------------------------------

def test_thinking_is_accepted_and_said_ignored(client):
    """thinking enabled: 200 with X-Kvmesh-Ignored: thinking (streamed too); thinking disabled: no such header."""
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=400, messages=_ask("Think. (thinking)"),
                                                   thinking={"type": "enabled", "budget_tokens": 1024})
    assert raw.status_code == 200 and raw.headers["x-kvmesh-ignored"] == "thinking"
    assert _blocks(raw.parse().content) == [("text", SCRIPT)]
    with client.messages.with_streaming_response.create(model=MODEL, max_tokens=400, messages=_ask("Think."),
                                                        thinking={"type": "enabled", "budget_tokens": 1024},
                                                        stream=True) as s:
        assert s.headers["x-kvmesh-ignored"] == "thinking"
    off = client.messages.with_raw_response.create(model=MODEL, max_tokens=5, messages=_ask("Think."),
                                                   thinking={"type": "disabled"})
    assert off.status_code == 200 and "x-kvmesh-ignored" not in off.headers


def test_sampling_fields_are_accepted(client, http):
    """temperature, top_p and top_k are accepted (200); temperature above Anthropic's 1.0 is a 400."""
    # This client version has no typed sampling parameters; they go in the body as older clients send them.
    m = _create(client, _ask("Sample. (sampling)"), extra_body={"temperature": 0.7, "top_p": 0.9, "top_k": 40})
    assert _blocks(m.content) == [("text", SCRIPT)]
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": _ask("hi"), "temperature": 1.5})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_anthropic_version_and_beta_headers_are_tolerated(srv, http):
    """Any anthropic-version and anthropic-beta headers (and an x-api-key) are accepted: 200."""
    headers = {"anthropic-version": "2099-12-31", "x-api-key": "anything",
               "anthropic-beta": "prompt-caching-2024-07-31,interleaved-thinking-2025-05-14,fine-grained-tool-streaming"}
    r = http.post("/v1/messages", json={"model": MODEL, "max_tokens": 5, "messages": _ask("hi")}, headers=headers)
    assert r.status_code == 200, r.text
    with anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0,
                             default_headers={"anthropic-beta": "context-1m-2025-08-07"}) as c:
        assert c.messages.create(model=MODEL, max_tokens=5, messages=_ask("hi")).stop_reason == "max_tokens"


def _cluster_source(http: httpx.Client, session: str) -> str | None:
    found = [s for s in http.get("/v1/cluster").json()["sessions"] if s["session"] == session]
    return found[0]["id_source"] if found else None


def test_metadata_user_id_names_the_session(client, http):
    """metadata.user_id's JSON form names the session by its session_id: the X-Session-Id answer and /v1/cluster say so."""
    sid = "3f1c2a9e-claude-json-session"
    user_id = json.dumps({"device_id": "d" * 64, "account_uuid": "acc-1", "session_id": sid})
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=5, messages=_ask("hi (meta)"),
                                                   metadata={"user_id": user_id})
    assert raw.headers["x-session-id"] == sid
    assert _cluster_source(http, sid) == "metadata.user_id"
    # The older form: user_<hash>_account_<uuid>_session_<uuid>.
    old = "user_abc123_account_acc-2_session_7d0e5b1c-old-form"
    raw = client.messages.with_raw_response.create(model=MODEL, max_tokens=5, messages=_ask("hi (meta old)"),
                                                   metadata={"user_id": old})
    assert raw.headers["x-session-id"] == "7d0e5b1c-old-form"
    assert _cluster_source(http, "7d0e5b1c-old-form") == "metadata.user_id"
