"""`kvmesh bench tools`: forced tool calls on real models, constrained against unconstrained.

For each model (SmolLM2, Gemma 3 270M by default) an engine runs N chat requests with
`tool_choice: "required"` (`parallel_tool_calls` false: one call, as an agent running one tool at
a time asks) over a set of five tools, each request asking for one of them, greedy. Each runs
twice: with the constraint the API builds for it (node.api.structured), and without any (what
kvmesh did before: the prompt asks, nothing enforces). A reply counts as valid when the API's own
tool-call parser finds exactly one call in it, of a declared tool, whose arguments validate against
that tool's schema (its pydantic model, extra fields forbidden); a reply cut at max_tokens is not
(greedy, a 135M model repeats inside a string: `finished_share` and `valid_of_finished` say how
much of the gap that is). Beside the shares: each arm's decode rate (tokens after the first over
the time after the first, median over its requests) and their ratio, the constraint's cost per
token (goal >= 0.9); the arms alternate request by request, so a host's other load weighs on both.
The exit status fails a finished constrained reply that is not a valid call, and a ratio under the
goal.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvmesh.node.api.schema import ChatCompletionRequest
from kvmesh.node.api.structured import grammar_for
from kvmesh.node.api.toolcalls import ToolCallParser
from kvmesh.node.api.toolevents import assemble
from kvmesh.node.config import EngineConfig, LlamaCppConfig
from kvmesh.node.engine.engine import Engine, GenerateRequest, TextDelta, TurnDone
from kvmesh.node.lab.bench.common import emit

RATIO_GOAL = 0.9


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid")


class GetWeather(_Args):
    city: str
    unit: Literal["celsius", "fahrenheit"]


class ReadFile(_Args):
    path: str
    max_lines: int = Field(ge=1)


class RunCommand(_Args):
    command: str
    timeout_s: int = Field(ge=1, le=600)


class SearchWeb(_Args):
    query: str
    max_results: int = Field(ge=1, le=20)


class CreateEvent(_Args):
    title: str
    date: str
    attendees: list[str]


TOOLS: dict[str, tuple[type[BaseModel], str]] = {
    "get_weather": (GetWeather, "The current weather in a city"),
    "read_file": (ReadFile, "Read the first lines of a file"),
    "run_command": (RunCommand, "Run a shell command"),
    "search_web": (SearchWeb, "Search the web"),
    "create_event": (CreateEvent, "Put an event in the calendar"),
}
ASKS = [
    "What's the weather like in Paris right now?", "Show me the start of README.md.", "List the files in /tmp.",
    "Find recent news about the Rust programming language.", "Book a team lunch with Ana and Bo on 2026-05-04.",
    "Is it cold in Oslo today? Use fahrenheit.", "Read the first 20 lines of src/main.py.", "Run the test suite with pytest.",
    "Search for the best pizza in Naples.", "Schedule a dentist appointment on 2026-06-01.",
]


def tool_defs() -> list[dict[str, Any]]:
    """The tools as an OpenAI request declares them (their JSON schemas from the models)."""
    return [{"type": "function", "function": {"name": n, "description": d, "parameters": m.model_json_schema()}}
            for n, (m, d) in TOOLS.items()]


def valid_call(text: str) -> bool:
    """The reply is exactly one call, of a declared tool, with arguments its schema accepts."""
    parser = ToolCallParser(tuple(TOOLS), parallel=True)
    reply = assemble([*parser.feed(text), *parser.finish()])
    if len(reply.calls) != 1 or reply.calls[0].name not in TOOLS:
        return False
    try:
        TOOLS[reply.calls[0].name][0].model_validate_json(reply.calls[0].arguments)
    except ValidationError:
        return False
    return True


async def _one(engine: Engine, body: ChatCompletionRequest, constrained: bool, i: int,
               max_tokens: int) -> tuple[bool, bool, float]:
    """One request: (a valid call, ended before max_tokens, decode tok/s)."""
    prompt = engine.tokenizer.apply_chat_template(body.messages_as_dicts(), tools=body.tools_as_dicts(),
                                                  tool_choice=body.tool_choice_value(), parallel_tool_calls=False)
    req = GenerateRequest(session=f"tools-{constrained}-{i}", prompt=prompt, max_tokens=max_tokens, temperature=0.0,
                          constraint=grammar_for(body) if constrained else None)
    text, stats = "", None
    async for ev in engine.generate(req):
        if isinstance(ev, TextDelta):
            text += ev.text
        elif isinstance(ev, TurnDone):
            stats = ev.stats
    assert stats is not None
    decode_s = stats.total_s - stats.ttft_s
    tps = (stats.completion_tokens - 1) / decode_s if stats.completion_tokens > 1 and decode_s > 0 else 0.0
    return valid_call(text), stats.finish_reason != "length", tps


async def measure(model: str, n: int, max_tokens: int, threads: int) -> dict[str, Any]:
    """One model's row: valid shares and decode rates, constrained and not."""
    engine = Engine(EngineConfig(model=model, slots=1, cache_tokens=16384, llamacpp=LlamaCppConfig(threads=threads)))
    try:
        row: dict[str, Any] = {"model": model, "requests": n}
        bodies = [ChatCompletionRequest.model_validate({
            "model": model, "messages": [{"role": "user", "content": ASKS[i % len(ASKS)]}], "tools": tool_defs(),
            "tool_choice": "required", "parallel_tool_calls": False}) for i in range(n)]
        # The arms alternate request by request, so a load that comes and goes on the host (other processes)
        # weighs on both alike and the ratio stays the constraint's.
        runs: dict[bool, list[tuple[bool, bool, float]]] = {True: [], False: []}
        for i, b in enumerate(bodies):
            for on in (True, False):
                runs[on].append(await _one(engine, b, on, i, max_tokens))
        for arm, on in (("constrained", True), ("unconstrained", False)):
            got = runs[on]
            done = [ok for ok, ended, _ in got if ended]
            row[f"{arm}_valid_share"] = round(sum(ok for ok, _, _ in got) / n, 3)
            row[f"{arm}_finished_share"] = round(len(done) / n, 3)  # the rest ran to max_tokens (a loop, greedy)
            row[f"{arm}_valid_of_finished"] = round(sum(done) / len(done), 3) if done else None
            row[f"{arm}_decode_tps"] = round(statistics.median(t for _, _, t in got), 2)
        un = row["unconstrained_decode_tps"]
        row["decode_tps_ratio"] = round(row["constrained_decode_tps"] / un, 3) if un else None
        return row
    finally:
        engine.close()


def run_tools(args: argparse.Namespace) -> int:
    rows = [asyncio.run(measure(m, args.requests, args.max_tokens, args.threads)) for m in args.models.split(",") if m]
    # The constraint's own failure is a finished reply that is not a valid call; one cut at max_tokens is the
    # model's (a small model, greedy, repeats inside a string), reported in the shares, not counted here.
    errors = [f"{r['model']}: {r['constrained_valid_of_finished']} of the finished constrained replies are valid calls"
              for r in rows if r["constrained_valid_of_finished"] not in (None, 1.0)]
    errors += [f"{r['model']}: decode tok/s ratio {r['decode_tps_ratio']} < {RATIO_GOAL}" for r in rows
               if (r["decode_tps_ratio"] or 0) < RATIO_GOAL]
    return emit({"table": rows, "tool_choice": "required", "parallel_tool_calls": False, "ratio_goal": RATIO_GOAL,
                 "errors": len(errors), "error_samples": errors}, args)
