"""Hostile bodies, per dialect: never a 5xx, every refusal in the dialect's shape naming what was wrong,
streams that are JSON, and a node that stays healthy with a conversation still warm after.

Hypothesis mutates one valid request per dialect (a field replaced by a hostile value, an unknown
field, the body broken, nested, or oversized), posts it with the node's API key, streamed and not,
and checks the answer. KVMESH_FUZZ_EXAMPLES raises the examples per test (the issue's 20,000-request
run); the suite runs a bounded, derandomized number.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread

from .helpers import MODEL, anthropic_error, openai_error, sim_config

KEY = "fuzz-key-0123456789"
EXAMPLES = int(os.environ.get("KVMESH_FUZZ_EXAMPLES", "60"))
BIG = "__kvmesh_big_number__"  # stands for 1e999 in a value, written as that literal once serialized

# Each dialect's route and one valid, short request; hostile values replace a field of it.
DIALECTS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 4}),
    "completions": ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4}),
    "responses": ("/v1/responses", {"model": MODEL, "input": [{"role": "user", "content": "hi"}],
                                    "max_output_tokens": 4, "text": {"format": {"type": "text"}}}),
    "messages": ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
    "count_tokens": ("/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
}
# Fields a client may add, each with a value of the right shape that hostile values go inside.
EXTRA_FIELDS: dict[str, Any] = {
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "number", "maximum": 1}}}}}],
    "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}},
    "stop": ["x"], "temperature": 0.5, "top_p": 0.9, "seed": 1, "metadata": {"user_id": "u"}, "user": "u",
    "tool_choice": "auto", "logprobs": True, "top_logprobs": 2, "n": 1, "system": "be brief", "instructions": "x",
}

_deep = st.integers(min_value=60, max_value=3000).map(lambda d: json.loads("[" * d + "]" * d) if d < 900 else
                                                       {"__raw__": "[" * d + "]" * d})
HOSTILE = st.one_of(
    st.sampled_from([float("nan"), float("inf"), float("-inf"), BIG, 10**60, -(10**60), -1, 0, 2**63, "", None, True,
                     [], {}, "\ud800", "a\udfffb", "x" * 300_000, "\x00", "\u202e", ["\ud83d"], {"\udc00": 1}]),
    st.text(max_size=40),
    st.floats(allow_nan=True, allow_infinity=True),
    st.recursive(st.none() | st.booleans() | st.floats() | st.text(max_size=8),
                 lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
                 max_leaves=12),
    _deep,
)


def serialize(obj: Any) -> bytes:
    """JSON as a careless or hostile client writes it: NaN, Infinity, 1e999, lone surrogates escaped."""
    text = json.dumps(obj, allow_nan=True)
    return text.replace(json.dumps(BIG), "1e999").encode()


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _replace(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    out = dict(obj) if isinstance(obj, dict) else list(obj)
    out[path[0]] = _replace(obj[path[0]], path[1:], value)
    return out


@st.composite
def hostile_body(draw: st.DrawFn, dialect: str) -> tuple[bytes, str | None]:
    """A request body and the top-level field it broke (None: the body as a whole)."""
    _, base = DIALECTS[dialect]
    kind = draw(st.sampled_from(["replace", "replace", "extra", "whole"]))
    if kind == "whole":
        raw = draw(st.sampled_from([b"", b"{", b"[]", b"null", b"\"x\"", b"{\"model\": NaN}", b"\xff\xfe{}",
                                    b"{\"a\":1}" * 3, serialize(base)[:-3], b"[" * 5000 + b"]" * 5000]))
        return raw, None
    body = dict(base)
    if kind == "extra":
        name = draw(st.sampled_from(sorted(EXTRA_FIELDS)))
        body[name] = EXTRA_FIELDS[name]
        paths = [p for p in _paths(body[name], (name,))]
    else:
        paths = [p for p in _paths(body) if p]
    path = draw(st.sampled_from(paths))
    value = draw(HOSTILE)
    if isinstance(value, dict) and "__raw__" in value:  # nesting past the parser's own recursion limit
        text = serialize(_replace(body, path, "__raw__")).replace(b'"__raw__"', value["__raw__"].encode())
        return text, str(path[0])
    body["stream"] = draw(st.booleans()) if dialect != "count_tokens" else False
    return serialize(_replace(body, path, value)), str(path[0])


def _strict_json(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise AssertionError(f"{name} in a response: not JSON")
    return json.loads(text, parse_constant=refuse)


def check_answer(dialect: str, resp: httpx.Response, field: str | None) -> None:
    """The answer to one hostile request: no 5xx; errors in the dialect's shape; 200 bodies and stream events are JSON."""
    assert resp.status_code < 500, (resp.status_code, resp.text[:500])
    text = resp.text
    assert "Traceback" not in text, text[:500]
    if resp.status_code == 200:
        if resp.headers["content-type"].startswith("text/event-stream"):
            for line in text.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    _strict_json(line[6:])
        else:
            _strict_json(text)
        return
    _strict_json(text)
    if dialect in ("messages", "count_tokens"):
        message, param = anthropic_error(resp)["message"], None
    else:
        err = openai_error(resp)
        message, param = err["message"], err.get("param")
    if resp.status_code == 400 and field is not None:
        # The refusal names the field it is about (the param, or the field's name in the message); a prompt
        # past the context is about the whole prompt, which every field of it makes up.
        named = (param or "").split(".")[0].split("[")[0] == field or field in message or \
            message.startswith("the prompt is ")
        assert named, (field, text[:500])


@pytest.fixture(scope="module")
def keyed() -> Iterator[ThreadedServer]:
    """A sim node with an API key, and a canary conversation warm on it before any fuzzing."""
    srv = serve_in_thread(sim_config("dialect-fuzz", api={"keys": [KEY], "max_body_bytes": 1 << 20},
                                     ))
    try:
        yield srv
    finally:
        srv.stop()


CANARY = [{"role": "system", "content": "You review code. " * 80}, {"role": "user", "content": "Start."}]


def _canary_turn(client: httpx.Client, messages: list[dict[str, Any]]) -> dict[str, Any]:
    r = client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8,
                                                  "temperature": 0}, headers={"X-Session-Id": "fuzz-canary"})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def client(keyed: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=keyed.url, timeout=60.0, headers={"Authorization": f"Bearer {KEY}"}) as c:
        first = _canary_turn(c, CANARY)
        assert first["usage"]["prompt_tokens"] > 512
        yield c


@pytest.mark.parametrize("dialect", sorted(DIALECTS))
def test_hostile_bodies_never_reach_a_5xx(dialect: str, keyed: ThreadedServer, client: httpx.Client,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """Mutated bodies of each dialect get a 2xx or a 4xx in its shape naming the field, and the node logs no traceback."""
    route, _ = DIALECTS[dialect]
    caplog.set_level(logging.ERROR)
    statuses: Counter[int] = Counter()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                     HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(case=hostile_body(dialect))
    def one(case: tuple[bytes, str | None]) -> None:
        raw, field = case
        resp = client.post(route, content=raw, headers={"Content-Type": "application/json"})
        statuses[resp.status_code] += 1
        check_answer(dialect, resp, field)

    one()
    print(f"{dialect}: {sum(statuses.values())} requests, statuses {dict(sorted(statuses.items()))}")
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert not tracebacks, [r.getMessage() for r in tracebacks]


def test_the_issue_s_three_reproductions_are_400s_naming_the_field(client: httpx.Client) -> None:
    """A lone surrogate in a completions prompt or a count_tokens message, and NaN in a Responses text.format, are 400s."""
    cases = [("/v1/completions", {"model": MODEL, "prompt": "\ud800"}, "prompt"),
             ("/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]},
              "messages"),
             ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4, "text": {"format": {
                 "type": "json_schema", "name": "s", "schema": {"type": "number", "maximum": float("nan")}}}}, "text"),
             ("/v1/responses", {"model": MODEL, "input": "hi", "stream": True, "max_output_tokens": 4,
                                "tools": [{"type": "function", "name": "f", "parameters": {
                                    "type": "object", "properties": {"x": {"type": "number",
                                                                          "minimum": float("-inf")}}}}]}, "tools")]
    for route, body, field in cases:
        resp = client.post(route, content=serialize(body), headers={"Content-Type": "application/json"})
        assert resp.status_code == 400, (route, resp.text)
        check_answer("messages" if "messages" in route else "chat", resp, field)


def test_a_body_over_the_limit_is_413_before_it_is_read(client: httpx.Client, keyed: ThreadedServer) -> None:
    """A body past api.max_body_bytes is a 413 in the dialect's shape, declared length or streamed in chunks."""
    limit = keyed.node.cfg.api.max_body_bytes
    big = b'{"model": "x", "prompt": "' + b"a" * limit + b'"}'
    resp = client.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert resp.status_code == 413, resp.text
    resp = client.post("/v1/messages", content=iter([big[:limit // 2], big[limit // 2:]]),
                       headers={"Content-Type": "application/json"})
    assert resp.status_code == 413 and resp.json()["type"] == "error", resp.text


def test_after_the_fuzzing_the_node_is_healthy_and_the_canary_still_warm(client: httpx.Client) -> None:
    """Once every dialect was fuzzed, /health is ok and the canary's next turn reuses its whole cached prefix."""
    health = client.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok", health.text
    first = _canary_turn(client, CANARY)
    follow = _canary_turn(client, [*CANARY, first["choices"][0]["message"], {"role": "user", "content": "Go on."}])
    cached = follow["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] * 0.9, (cached, first["usage"])
