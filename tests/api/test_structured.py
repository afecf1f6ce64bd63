"""Structured output through the official SDKs on a real sim node: response_format, text.format, output_config.

The sim engine's logits are pseudo-random (seeded by the KV bytes it holds), so an unconstrained
reply is never JSON: a reply that parses into the schema's model shows the constraint at work.
What stays refused, or cannot be compiled, is a 400 in each dialect's shape naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import anthropic
import httpx
import openai
import pytest
from pydantic import BaseModel

from kvmesh.node.config import EngineConfig, NodeConfig, SimConfig
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread

HI = [{"role": "user", "content": "Describe a person as JSON."}]
CHAT = "/v1/chat/completions"


class Person(BaseModel):
    name: str
    age: int
    role: Literal["admin", "user"]


class Verdict(BaseModel):
    ok: bool
    score: float


@pytest.fixture(scope="module")
def srv() -> Iterator[ThreadedServer]:
    """A fast sim node (random logits) that answers to claude-* too."""
    sim = SimConfig(kv_scale=0.01, decode_tps=5000, prefill_tps=1e6)
    server = serve_in_thread(NodeConfig(name="api-structured", engine=EngineConfig(
        kind="sim", cache_bytes=64 << 20, slots=2, queue_max=2, sim=sim, served_names=["claude-*"])))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def oai(srv: ThreadedServer) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=60.0)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(srv: ThreadedServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=60.0) as c:
        yield c


def test_chat_parse_with_a_pydantic_model_round_trips(srv, oai):
    """client.chat.completions.parse(response_format=Person): the reply is that JSON, parsed into a Person."""
    for session in ("st-parse-1", "st-parse-2"):
        r = oai.chat.completions.parse(model=srv.model, messages=HI, response_format=Person, max_tokens=2000,
                                       temperature=0, extra_headers={"X-Session-Id": session})
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "stop", msg.content
        assert isinstance(msg.parsed, Person) and msg.parsed.role in ("admin", "user")
        assert json.loads(msg.content or "") == msg.parsed.model_dump()


def test_unconstrained_sim_reply_is_not_json(srv, oai):
    """The same request without response_format is not a JSON object (what makes the tests above meaningful)."""
    r = oai.chat.completions.create(model=srv.model, messages=HI, max_tokens=60, temperature=0)
    try:
        obj = json.loads(r.choices[0].message.content or "")
    except ValueError:
        obj = None
    assert not isinstance(obj, dict), obj


def test_json_object_streams_one_json_object(srv, oai):
    """response_format json_object, streamed: the deltas join into one JSON object."""
    chunks = oai.chat.completions.create(model=srv.model, messages=HI, max_tokens=3000, temperature=0, stream=True,
                                         response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict), text


def test_llama_cpp_schema_beside_json_object_is_honoured(srv, http):
    """llama.cpp's extension {"type": "json_object", "schema": ...} and a json_schema without a name are enforced."""
    for fmt, want in (({"type": "json_object", "schema": {"const": "42"}}, "42"),
                      ({"type": "json_schema", "json_schema": {"schema": {"const": "foooooo"}}}, "foooooo")):
        r = http.post(CHAT, json={"model": srv.model, "messages": HI, "max_tokens": 10, "response_format": fmt})
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["choices"][0]["message"]["content"]) == want


def test_llama_cpp_top_level_json_schema_is_honoured(srv, http, check_error):
    """llama.cpp's top-level json_schema constrains the reply (test_completion_with_json_schema); with a
    response_format too, or not an object, it is a 400 naming json_schema."""
    r = http.post(CHAT, json={"model": srv.model, "messages": HI, "max_tokens": 6, "json_schema": {"const": "42"}})
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["choices"][0]["message"]["content"]) == "42"
    both = {"model": srv.model, "messages": HI, "json_schema": {}, "response_format": {"type": "json_object"}}
    check_error(http.post(CHAT, json=both), 400, param="json_schema", says="not both")
    check_error(http.post(CHAT, json={"model": srv.model, "messages": HI, "json_schema": "x"}), 400, param="json_schema")


@pytest.mark.parametrize("field", ["grammar", "continue_final_message"])
def test_llama_cpp_and_vllm_fields_kvmesh_cannot_honour_are_400s(srv, http, check_error, field):
    """A GBNF grammar or continue_final_message is refused by name, never silently dropped."""
    body = {"model": srv.model, "messages": HI, field: 'root ::= "a"' if field == "grammar" else True}
    check_error(http.post(CHAT, json=body), 400, param=field)


def test_responses_parse_with_text_format_round_trips(srv, oai):
    """client.responses.parse(text_format=Verdict): output_text is that JSON, output_parsed a Verdict."""
    r = oai.responses.parse(model=srv.model, input="Is it ok?", text_format=Verdict, max_output_tokens=2000,
                            temperature=0)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Verdict)
    assert json.loads(r.output_text) == r.output_parsed.model_dump()


def test_anthropic_parse_with_output_format_round_trips(srv):
    """anthropic messages.parse(output_format=Person): the text block is that JSON, parsed_output a Person."""
    with anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60.0) as c:
        m = c.messages.parse(model="claude-sonnet-4-5", max_tokens=2000, messages=HI, output_format=Person)
    assert m.stop_reason == "end_turn"
    assert isinstance(m.parsed_output, Person)


BAD_SCHEMAS: dict[str, tuple[dict[str, Any], str]] = {
    "lookaround": ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}}}}, "look-around"),
    "strict-unknown-format": ({"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "weird"}}}}}, "weird"),
    "bad-type": ({"type": "json_object", "schema": {"type": "hiccup"}}, "hiccup"),
    "schema-not-object": ({"type": "json_object", "schema": 123}, "json object"),
    "unknown-type": ({"type": "sound"}, "sound"),
    "json-schema-without-body": ({"type": "json_schema"}, "json_schema"),
}


@pytest.mark.parametrize("case", sorted(BAD_SCHEMAS))
def test_a_schema_that_cannot_be_enforced_is_a_400_naming_it(srv, http, check_error, case):
    """A response_format llguidance cannot compile, or of a wrong shape, is a 400 on response_format naming the part."""
    fmt, says = BAD_SCHEMAS[case]
    r = http.post(CHAT, json={"model": srv.model, "messages": HI, "max_tokens": 8, "response_format": fmt})
    check_error(r, 400, param="response_format", says=says)


def test_non_strict_schema_ignores_what_it_cannot_enforce(srv, http):
    """Without strict, an unknown format is ignored (OpenAI's non-strict promise): the reply still follows the rest."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "format": "weird"}}, "required": ["a"]}}}
    r = http.post(CHAT, json={"model": srv.model, "messages": HI, "max_tokens": 2000, "temperature": 0,
                              "response_format": fmt})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["a"], str)


def test_ignore_eos_with_a_constraint_is_a_400(srv, http, check_error):
    """ignore_eos beside response_format is refused: the grammar decides where the reply ends."""
    r = http.post(CHAT, json={"model": srv.model, "messages": HI, "max_tokens": 8, "ignore_eos": True,
                              "response_format": {"type": "json_object"}})
    check_error(r, 400, param="ignore_eos", says="ignore_eos")


def test_responses_and_anthropic_refuse_what_cannot_be_enforced_in_their_shapes(srv, oai):
    """A Responses text.format and an Anthropic output_config.format that cannot compile are 400s in each shape."""
    bad = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}}
    with pytest.raises(openai.BadRequestError) as ei:
        oai.responses.create(model=srv.model, input="hi", text={"format": {"type": "json_schema", "name": "x",
                                                                           "schema": bad}})
    assert "look-around" in ei.value.body["message"]
    with anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0, timeout=60.0) as c:
        with pytest.raises(anthropic.BadRequestError) as ai:
            c.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=HI,
                              output_config={"format": {"type": "json_schema", "schema": bad}})
        assert ai.value.body["error"]["type"] == "invalid_request_error"
        assert "look-around" in ai.value.body["error"]["message"]
        with pytest.raises(anthropic.BadRequestError) as ai:
            c.messages.create(model="claude-sonnet-4-5", max_tokens=8, messages=HI,
                              output_config={"format": {"type": "text"}})  # type: ignore[typeddict-item]
        assert "output_config.format" in ai.value.body["error"]["message"]
