"""The OpenAI Agents SDK driving a node as an agent does: a function tool, tool_choice required then auto, turn
after turn; with the Responses model each turn continues the last by previous_response_id (stored on the mesh),
with the chat model it resends the whole history. Run in the Agents SDK's own venv (.venv-clients/agents) by
tests/api/test_real_clients.py; prints one JSON object: each turn's usage and the tool calls the SDK ran.

usage: agents_session.py BASE_URL MODEL responses|chat TURNS SESSION
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

calls: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city now."""
    calls.append(city)
    return f"Sunny in {city}, 18C"


async def main(base_url: str, model: str, api: str, turns: int, session: str) -> dict[str, Any]:
    set_tracing_disabled(True)  # no trace export (it would go to OpenAI)
    client = AsyncOpenAI(base_url=base_url, api_key="kvmesh-test", max_retries=0, timeout=120.0)
    m = OpenAIResponsesModel(model, client) if api == "responses" else OpenAIChatCompletionsModel(model, client)
    out: list[dict[str, Any]] = []
    history: list[Any] = []
    pending: list[Any] = []  # the last turn's tool outputs, not yet sent
    prev: str | None = None
    for i in range(turns):
        # The SDK's own pattern: tool_choice required, then auto once a tool has run.
        settings = ModelSettings(tool_choice="required" if i % 2 == 0 else "auto", temperature=0,
                                 extra_headers={"X-Session-Id": session})
        agent = Agent(name="weather", instructions="You are a weather agent. Use the tools.", model=m,
                      tools=[get_weather], tool_use_behavior="stop_on_first_tool", model_settings=settings)
        user = {"role": "user", "content": f"What is the weather in city number {i}?"}
        if api == "responses":
            r = await Runner.run(agent, [*pending, user], previous_response_id=prev)
            prev = r.last_response_id
            pending = [it.to_input_item() for it in r.new_items if it.type == "tool_call_output_item"]
        else:
            r = await Runner.run(agent, [*history, user])
            history = r.to_input_list()
        for raw in r.raw_responses:
            u = raw.usage
            out.append({"input_tokens": u.input_tokens, "cached_tokens": u.input_tokens_details.cached_tokens,
                        "response_id": raw.response_id, "final_output": str(r.final_output)})
    await client.close()
    return {"turns": out, "calls": calls}


if __name__ == "__main__":
    base, model, api, n, session = sys.argv[1:6]
    print(json.dumps(asyncio.run(main(base, model, api, int(n), session))))
