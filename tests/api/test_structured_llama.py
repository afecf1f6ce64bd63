"""Structured output and forced tool calls on a real model: SmolLM2 in llama.cpp, through the official SDKs.

SmolLM2-135M left to itself wraps JSON in prose and markdown fences, and answers a tool request in
prose; under the constraint its reply is the JSON asked for, or a call whose arguments validate.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field

from kvmesh.node.config import EngineConfig, LlamaCppConfig, NodeConfig
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread


class Person(BaseModel):
    name: str
    age: int


# Strings bounded, as an agent's tool schema may bound them: greedy SmolLM2 can loop inside a string (on some CPUs'
# kernels it writes "data.txt.json.json..." until the token limit), and the bound makes the grammar end it, so these
# tests check the call's shape whatever path the model takes.
class Weather(BaseModel):
    city: str = Field(max_length=40)
    unit: str = Field(max_length=40)


class ReadFile(BaseModel):
    path: str = Field(max_length=40)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": Weather.model_json_schema()}},
         {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                           "parameters": ReadFile.model_json_schema()}}]
ASK = [{"role": "user", "content": "What is the weather in Paris? And read notes.txt."}]
# Greedy, SmolLM2 repeats a call once it has made one (llama-server's grammar lets it too): the tests that need
# the reply to end send parallel_tool_calls false, as an agent running one tool at a time does.


@pytest.fixture(scope="module")
def smol() -> Iterator[ThreadedServer]:
    """SmolLM2 behind a real node (1 slot), answering to claude-* too."""
    srv = serve_in_thread(NodeConfig(name="api-structured-smol", engine=EngineConfig(
        model="smollm2", slots=1, cache_tokens=8192, llamacpp=LlamaCppConfig(threads=2), served_names=["claude-*"])))
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def oai(smol: ThreadedServer) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=smol.v1, api_key="x", max_retries=0, timeout=120.0)
    yield c
    c.close()


def _check(call: object) -> None:
    fn = call.function  # type: ignore[attr-defined]
    (Weather if fn.name == "get_weather" else ReadFile).model_validate_json(fn.arguments)


def test_chat_parse_on_smollm2(smol, oai):
    """chat.completions.parse(response_format=Person) on SmolLM2: a Person, with no fence or prose around it."""
    r = oai.chat.completions.parse(model=smol.model, messages=[{"role": "user", "content": "Invent a person."}],
                                   response_format=Person, max_tokens=200, temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Person), msg.content
    assert (msg.content or "").startswith("{")


def test_responses_parse_on_smollm2(smol, oai):
    """responses.parse(text_format=Person) on SmolLM2: output_parsed is a Person."""
    r = oai.responses.parse(model=smol.model, input="Invent a person.", text_format=Person, max_output_tokens=200,
                            temperature=0)
    assert r.status == "completed" and isinstance(r.output_parsed, Person), r.output_text


def test_tool_choice_required_is_a_call_whose_arguments_validate(smol, oai):
    """tool_choice required: the reply is a tool call only, its arguments valid for its tool's schema."""
    r = oai.chat.completions.create(model=smol.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                    max_tokens=300, temperature=0, parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.tool_calls, ch.message
    assert not (ch.message.content or "").strip()
    for call in ch.message.tool_calls:
        _check(call)


def test_named_tool_choice_and_no_parallel_calls_give_one_call_of_that_tool(smol, oai):
    """A named tool_choice with parallel_tool_calls false: exactly one call, of that tool, its arguments valid."""
    r = oai.chat.completions.create(model=smol.model, messages=ASK, tools=TOOLS, max_tokens=300, temperature=0,
                                    tool_choice={"type": "function", "function": {"name": "read_file"}},
                                    parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls or []
    assert [c.function.name for c in calls] == ["read_file"], r.choices[0].message
    _check(calls[0])


def test_required_streams_the_call_as_deltas(smol, oai):
    """Streamed, tool_choice required: the call's deltas join into arguments that validate."""
    chunks = list(oai.chat.completions.create(model=smol.model, messages=ASK, tools=TOOLS, tool_choice="required",
                                              max_tokens=300, temperature=0, stream=True, parallel_tool_calls=False))
    name, args = "", ""
    for c in chunks:
        for tc in (c.choices[0].delta.tool_calls or []) if c.choices else []:
            name += tc.function.name or "" if tc.function else ""
            args += tc.function.arguments or "" if tc.function else ""
    assert name in ("get_weather", "read_file"), chunks
    (Weather if name == "get_weather" else ReadFile).model_validate(json.loads(args))


def test_anthropic_tool_choice_any_and_tool_on_smollm2(smol):
    """Anthropic tool_choice any / tool: the reply is tool_use blocks whose input validates."""
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]
    with anthropic.Anthropic(base_url=smol.url, api_key="x", max_retries=0, timeout=120.0) as c:
        for choice in ({"type": "any", "disable_parallel_tool_use": True},
                       {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}):
            m = c.messages.create(model="claude-sonnet-4-5", max_tokens=300, messages=ASK, tools=tools,  # type: ignore[arg-type]
                                  tool_choice=choice, extra_body={"temperature": 0})  # type: ignore[arg-type]
            uses = [b for b in m.content if b.type == "tool_use"]
            assert m.stop_reason == "tool_use" and uses, m.content
            for b in uses:
                (Weather if b.name == "get_weather" else ReadFile).model_validate(b.input)
            assert choice["type"] != "tool" or {b.name for b in uses} == {"get_weather"}
