"""The Agents SDK's tool_choice switch on a real node: turn 2 reads turn 1's whole prompt and reply from the cache.

The OpenAI Agents SDK sends tool_choice "required" on one turn and "auto" on the next (issue 48). A sim node
whose reply is a scripted tool call runs both turns in one session, through the chat completions API; the
cached tokens it reports on turn 2 are computed here from the real prompt ids: the common prefix of what
turn 1 left in the KV cache (its prompt, and its reply but the last token) and turn 2's prompt, in whole
blocks where the engine reuses whole blocks only (`reuse_tail` false), else token by token.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from kvmesh.node.config import EngineConfig, NodeConfig, SimConfig
from kvmesh.node.engine.tokenizer import ByteTokenizer
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# What the forced grammar lets through, and what chat.py renders the call back as on turn 2.
SCRIPT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
MSGS: list[dict[str, Any]] = [{"role": "system", "content": "You are a weather agent. Use the tools."},
                              {"role": "user", "content": "What is the weather in Paris?"}]
BLOCK = 16


@pytest.fixture(scope="module", params=[False, True], ids=["whole-blocks", "tail-reused"])
def node(request: pytest.FixtureRequest) -> Iterator[ThreadedServer]:
    """A sim node (16-token blocks) whose every reply is SCRIPT; whole blocks only, or its own tail token by token."""
    sim = SimConfig(kv_scale=0.01, decode_tps=2000, prefill_tps=1e6, scripted_reply=SCRIPT)
    cfg = EngineConfig(kind="sim", cache_bytes=64 << 20, block_size=BLOCK, slots=2, queue_max=2, sim=sim,
                       reuse_tail=request.param)
    srv = serve_in_thread(NodeConfig(name="api-tool-choice", engine=cfg))
    try:
        yield srv
    finally:
        srv.stop()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_required_then_auto_reuses_all_of_turn_one(node: ThreadedServer) -> None:
    """Turn 1 with tool_choice required, turn 2 (the call and its result) with auto: turn 2's cached tokens are
    the common prefix of turn 1's KV and turn 2's prompt (block-aligned where only whole blocks are reused),
    and that covers all of turn 1's prompt."""
    client = openai.OpenAI(base_url=node.v1, api_key="x", max_retries=0, timeout=60.0)
    session = {"X-Session-Id": "agents-sdk-1"}
    r1 = client.chat.completions.create(model=node.model, messages=MSGS, tools=[WEATHER], tool_choice="required",
                                        max_tokens=200, temperature=0, extra_headers=session)
    msg = r1.choices[0].message
    assert msg.tool_calls and msg.tool_calls[0].function.name == "get_weather"
    turn2 = [*MSGS, msg.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "Sunny, 18C"}]
    r2 = client.chat.completions.create(model=node.model, messages=turn2, tools=[WEATHER], tool_choice="auto",
                                        max_tokens=200, temperature=0, extra_headers=session)
    client.close()

    tok = ByteTokenizer()
    p1 = tok.apply_chat_template(MSGS, tools=[WEATHER], tool_choice="required")
    p2 = tok.apply_chat_template(turn2, tools=[WEATHER], tool_choice="auto")
    assert (r1.usage.prompt_tokens, r2.usage.prompt_tokens) == (len(p1), len(p2))
    reply = tok.encode(SCRIPT)
    assert r1.usage.completion_tokens == len(reply)  # the grammar ends the turn where the call ends
    held = p1 + reply[:-1]  # the last token sampled never ran through the model
    shared = common_prefix(held, p2)
    assert shared >= len(p1)  # all of turn 1's prompt, tools included
    expected = shared if node.node.cfg.engine.reuse_tail else shared // BLOCK * BLOCK
    assert r2.usage.prompt_tokens_details is not None
    assert r2.usage.prompt_tokens_details.cached_tokens == expected
