"""Every dialect on a real-process mesh: an agent session through Anthropic Messages, OpenAI Responses and
chat, driven by the official SDKs, with tool calls the test executes, forwarded between hosts and moved warm.

The nodes' sim engines answer every turn with one scripted tool call (`sim.scripted_reply`), so each
turn of each dialect is a tool round trip; a tool result of a few hundred characters grows the prompt.
"""

from __future__ import annotations

import json
import random
import uuid
from dataclasses import dataclass
from typing import Any

import anthropic
import openai
import pytest

from kvmesh.node.lab.launcher import wait_for
from kvmesh.node.lab.workload import text

from .helpers import MODEL, Mesh, whole_blocks

SCRIPT = 'Reading it. <tool_call>\n{"name": "read_file", "arguments": {"path": "src/app.py"}}\n</tool_call>'
CALL = ("read_file", {"path": "src/app.py"})


@dataclass
class Seen:
    """One turn as the client saw it."""

    host: str
    handoff: str
    prompt: int  # the whole prompt, in tokens
    cached: int  # what the dialect's usage says was reused
    call: tuple[str, dict[str, Any]]
    call_id: str


class AnthropicAgent:
    """Claude Code's shape: system blocks with a volatile billing header, metadata.user_id, its session header."""

    source = "X-Claude-Code-Session-Id"

    def __init__(self, rng: random.Random) -> None:
        self.session = str(uuid.uuid4())
        self.system = text(rng, 8000)
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": "fix the bug in src/app.py"}]
        self.rng = rng

    def turn(self, m: Mesh, entry: str, stream: bool) -> Seen:
        client = anthropic.Anthropic(base_url=m.api(entry), api_key="unused", max_retries=0, timeout=60)
        system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.80; cch={uuid.uuid4().hex[:8]};"},
                  {"type": "text", "text": self.system, "cache_control": {"type": "ephemeral"}}]
        kw: dict[str, Any] = dict(model="claude-sonnet-4-5", max_tokens=400, system=system, messages=self.messages,
                                  tools=[{"name": "read_file", "description": "read a file",
                                          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}],
                                  metadata={"user_id": json.dumps({"session_id": self.session})},
                                  extra_headers={"X-Claude-Code-Session-Id": self.session, "anthropic-beta": "x"})
        if stream:
            with client.messages.stream(**kw) as s:
                headers = s.response.headers
                msg = s.get_final_message()
        else:
            raw = client.messages.with_raw_response.create(**kw)
            headers, msg = raw.headers, raw.parse()
        assert msg.stop_reason == "tool_use", msg
        use = next(b for b in msg.content if b.type == "tool_use")
        u = msg.usage
        self.messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                        "content": text(self.rng, 300)}]}]
        return Seen(headers["x-kvmesh-host"], headers["x-kvmesh-handoff"], u.input_tokens + (u.cache_read_input_tokens or 0),
                    u.cache_read_input_tokens or 0, (use.name, dict(use.input)), use.id)  # type: ignore[arg-type]


class ResponsesAgent:
    """Codex CLI's shape: store=false, the whole input each turn, prompt_cache_key and its session_id header."""

    source = "session_id"

    def __init__(self, rng: random.Random) -> None:
        self.session = "codex-" + uuid.uuid4().hex[:12]
        self.instructions = text(rng, 8000)
        self.input: list[dict[str, Any]] = [{"type": "message", "role": "user",
                                             "content": [{"type": "input_text", "text": "fix the bug"}]}]
        self.rng = rng

    def turn(self, m: Mesh, entry: str, stream: bool) -> Seen:
        client = openai.OpenAI(base_url=m.api(entry) + "/v1", api_key="unused", max_retries=0, timeout=60)
        kw: dict[str, Any] = dict(model="gpt-5-codex", instructions=self.instructions, input=self.input, store=False,
                                  prompt_cache_key=self.session, max_output_tokens=400,
                                  tools=[{"type": "function", "name": "read_file", "parameters": {
                                      "type": "object", "properties": {"path": {"type": "string"}}}}],
                                  extra_headers={"session_id": self.session})
        if stream:
            events = client.responses.create(**kw, stream=True)
            headers = events.response.headers
            resp = next(e.response for e in events if e.type == "response.completed")
            events.close()
        else:
            raw = client.responses.with_raw_response.create(**kw)
            headers, resp = raw.headers, raw.parse()
        call = next(o for o in resp.output if o.type == "function_call")
        u = resp.usage
        assert u is not None
        self.input += [{"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
                       {"type": "function_call_output", "call_id": call.call_id, "output": text(self.rng, 300)}]
        return Seen(headers["x-kvmesh-host"], headers["x-kvmesh-handoff"], u.input_tokens,
                    u.input_tokens_details.cached_tokens, (call.name, json.loads(call.arguments)), call.call_id)


class ChatAgent:
    """aider / opencode's shape: chat completions with tools and X-Session-Id."""

    source = "X-Session-Id"

    def __init__(self, rng: random.Random) -> None:
        self.session = "chat-" + uuid.uuid4().hex[:12]
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": text(rng, 8000)},
                                               {"role": "user", "content": "fix the bug"}]
        self.rng = rng

    def turn(self, m: Mesh, entry: str, stream: bool) -> Seen:
        tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
            "type": "object", "properties": {"path": {"type": "string"}}}}}]
        raw = m.client(entry).chat.completions.with_raw_response.create(
            model=MODEL, messages=self.messages, tools=tools, max_tokens=400,  # type: ignore[arg-type]
            extra_headers={"X-Session-Id": self.session})
        c = raw.parse()
        call = c.choices[0].message.tool_calls[0]  # type: ignore[index]
        u = c.usage
        assert u is not None and u.prompt_tokens_details is not None
        self.messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                          {"role": "tool", "tool_call_id": call.id, "content": text(self.rng, 300)}]
        return Seen(raw.headers["x-kvmesh-host"], raw.headers["x-kvmesh-handoff"], u.prompt_tokens,
                    u.prompt_tokens_details.cached_tokens or 0, (call.function.name, json.loads(call.function.arguments)),
                    call.id)


@pytest.mark.parametrize("make_agent", [AnthropicAgent, ResponsesAgent, ChatAgent], ids=["messages", "responses", "chat"])
def test_each_dialect_runs_forwarded_and_moves_warm(make_mesh, make_agent) -> None:  # type: ignore[no-untyped-def]
    """A first turn, a turn forwarded from another entry to the home that reuses the cache, then with the home busy
    a turn that moves to the replica holder warm; tool calls round-trip and the dialect's usage counts the reuse."""
    # A pool that holds the session and the hog's 120k-token turn: no eviction decides what stays warm here.
    m: Mesh = make_mesh(slots=1, cache_bytes=512 << 20, sim={"scripted_reply": SCRIPT},
                        engine={"served_names": ["claude-*", "gpt-*"]})
    agent = make_agent(random.Random(7))
    first = agent.turn(m, "a", stream=False)
    home = first.host
    assert first.call == CALL
    entry = next(n for n in m.names if n != home)
    # The entry places the next turn on what it has heard: the home, its turn over and its slot free.
    wait_for(lambda: (m.session_info(entry, agent.session) or {}).get("home") == home
             and m.host_info(entry, home)["busy"] == 0, f"{entry} to see {home} home and idle")
    second = agent.turn(m, entry, stream=True)  # forwarded to the home
    assert second.host == home and second.call == CALL and second.call_id != first.call_id
    assert second.cached >= whole_blocks(first.prompt), (second, first)
    holder = m.wait_replica(agent.session, home, whole_blocks(second.prompt), timeout=30)
    with m.hold_slot(f"hog-{agent.session}", home):
        moved = agent.turn(m, entry, stream=False)
    assert moved.host == holder and moved.handoff == "warm", moved
    assert moved.cached >= whole_blocks(second.prompt) and moved.call == CALL
    info = wait_for(lambda: (s := m.session_info("a", agent.session)) and s["turns"] == 3 and s,
                    "a to count the three turns")
    assert info["id_source"] == agent.source, info
    counters = wait_for(lambda: (c := m.cluster("a")["counters"])["warm"] >= 1 and c, "the warm handoff counted")
    assert counters["cold"] == 0 and counters["partial"] == 0
