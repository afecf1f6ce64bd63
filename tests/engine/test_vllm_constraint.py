"""The vLLM engine's constrained turns and its pool files, on one real vLLM process (SmolLM2, one core).

A JSON-schema turn (response_format) and a forced tool call reach vLLM's structured outputs (llguidance, as
the node's own engines) and come back valid; the same prompt unconstrained is free prose. A constraint
vLLM cannot be given is refused, naming it. Starting the engine removes the pool files of dead owners
(no such process, or a PID reused by a later one) and keeps a live owner's and an unnamed owner's.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvmesh.node.config import EngineConfig, VllmConfig
from kvmesh.node.engine import constraint
from kvmesh.node.engine.boundary import GenerateRequest, TextDelta, TurnDone, TurnStats
from kvmesh.node.engine.vllm.engine import VllmEngine
from kvmesh.node.engine.vllm.pool import pool_path, remove_stale_pools
from kvmesh.node.engine.vllm.stream import vllm_grammar
from kvmesh.node.errors import InvalidRequest

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="vLLM's venv is absent: run `make vllm` (make test does)")

SCHEMA: dict[str, Any] = {"type": "object", "properties": {"age": {"type": "integer"},
                                                            "color": {"type": "string", "enum": ["red", "green", "blue"]}},
                          "required": ["age", "color"]}
QUESTION = [{"role": "user", "content": "Tell me about the history of Rome in two sentences."}]


def dead_pid() -> tuple[int, int]:
    """A PID and its start time (centiseconds) whose process has exited."""
    p = subprocess.Popen(["sleep", "30"])
    started = round(psutil.Process(p.pid).create_time() * 100)
    p.kill()
    p.wait()
    return p.pid, started


def owned(base: Path, tag: str, pid: int, started: int) -> Path:
    path = base / f"kvmesh-{tag}-000000000000.p{pid}-{started}.pool"
    path.write_bytes(b"\0" * 64)
    return path


@pytest.fixture(scope="module")
def stale() -> Iterator[dict[str, Path]]:
    """Pool files left in /dev/shm as a killed node leaves them, beside a live owner's and an unnamed one."""
    base = pool_path("x").parent
    me = os.getpid()
    files = {"dead": owned(base, "test-dead", *dead_pid()),
             "reused": owned(base, "test-reused", me, round(psutil.Process(me).create_time() * 100) - 10_000),
             "live": owned(base, "test-live", me, round(psutil.Process(me).create_time() * 100)),
             "unnamed": base / "kvmesh-test-unnamed-000000000000.pool"}
    files["unnamed"].write_bytes(b"\0" * 64)
    try:
        yield files
    finally:
        for p in files.values():
            p.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def engine(stale: dict[str, Path]) -> Iterator[VllmEngine]:
    e = VllmEngine(EngineConfig(kind="vllm", model="smollm2", slots=1, max_context=2048, cache_tokens=4096,
                                vllm=VllmConfig(cpu_cores="0", kvcache_gib=1)), name="test-constraint")
    try:
        yield e
    finally:
        e.close()


async def _turn(e: VllmEngine, session: str, grammar: str | None, n: int) -> tuple[str, TurnStats]:
    prompt = e.tokenizer.apply_chat_template(QUESTION)
    text, stats = "", None
    async for ev in e.generate(GenerateRequest(session, prompt, max_tokens=n, temperature=0.0, constraint=grammar)):
        if isinstance(ev, TextDelta):
            text += ev.text
        elif isinstance(ev, TurnDone):
            stats = ev.stats
    assert stats is not None
    return text, stats


def turn(e: VllmEngine, session: str, grammar: str | None, n: int = 48) -> tuple[str, TurnStats]:
    return asyncio.run(_turn(e, session, grammar, n))


def valid(obj: Any, schema: dict[str, Any]) -> bool:
    """SCHEMA's rules by hand (no jsonschema here): the required keys only, an int, a string of the enum."""
    props = schema["properties"]
    return (isinstance(obj, dict) and set(obj) == set(schema["required"]) and type(obj["age"]) is int
            and obj["color"] in props["color"]["enum"])


@needs_vllm
@pytest.mark.timeout(600)
def test_a_json_schema_turn_answers_json_that_follows_the_schema(engine: VllmEngine) -> None:
    """A response_format grammar reaches vLLM: the answer parses as JSON, follows the schema, and ends there."""
    text, stats = turn(engine, "json", constraint.json_grammar(SCHEMA, strict=True))
    assert valid(json.loads(text), SCHEMA), text
    assert stats.finish_reason == "stop"


@needs_vllm
@pytest.mark.timeout(600)
def test_an_unconstrained_turn_is_not_forced(engine: VllmEngine) -> None:
    """The same prompt with no constraint is free prose, not JSON (the constraint does not leak between turns)."""
    text, _ = turn(engine, "free", None)
    assert text.strip() and not text.lstrip().startswith("{"), text


@needs_vllm
@pytest.mark.timeout(600)
def test_a_forced_tool_call_is_a_valid_call(engine: VllmEngine) -> None:
    """tool_choice required's grammar reaches vLLM: the answer is one <tool_call> whose arguments follow the tool's schema."""
    grammar = constraint.tool_grammar([constraint.ToolShape("describe", SCHEMA, strict=True)], forced=True, parallel=False)
    text, _ = turn(engine, "tool", grammar, n=64)
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
    call = json.loads(text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
    assert call["name"] == "describe" and valid(call["arguments"], SCHEMA)


@needs_vllm
@pytest.mark.timeout(600)
def test_starting_removes_only_dead_owners_pools(engine: VllmEngine, stale: dict[str, Path]) -> None:
    """A starting engine removed the pools of a dead PID and of a reused PID; a live owner's, an unnamed one and its own stay."""
    assert not stale["dead"].exists() and not stale["reused"].exists()
    assert stale["live"].exists() and stale["unnamed"].exists()
    assert engine.pool.path.exists() and f".p{os.getpid()}-" in engine.pool.path.name


def test_remove_stale_pools_judges_each_owner(tmp_path: Path) -> None:
    """Without vLLM: a dead owner's pool goes, a live one's and one without an owner in its name stay."""
    me = os.getpid()
    dead = owned(tmp_path, "a", *dead_pid())
    live = owned(tmp_path, "b", me, round(psutil.Process(me).create_time() * 100))
    unnamed = tmp_path / "kvmesh-c-000000000000.pool"
    unnamed.write_bytes(b"")
    assert remove_stale_pools(tmp_path) == [dead]
    assert live.exists() and unnamed.exists()


def test_json_form_grammars_become_lark_for_vllm() -> None:
    """A grammar in llguidance's JSON form is sent as `start: %json <schema>`; Lark (what json_grammar and
    tool_grammar build, since their numbers are bounded in Lark) passes as is."""
    lark = vllm_grammar('{"grammars": [{"json_schema": ' + json.dumps(SCHEMA) + '}]}')
    assert lark.startswith("%llguidance {}\nstart: %json {")
    constraint.check(lark, "response_format")  # llguidance compiles what vLLM will be given
    for grammar in (constraint.json_grammar(SCHEMA, strict=True),
                    constraint.tool_grammar([constraint.ToolShape("f", None)], forced=True, parallel=False)):
        assert vllm_grammar(grammar) == grammar


@pytest.mark.parametrize("grammar", ['{"grammars": [{"lark_grammar": "start: a"}, {"json_schema": {}}]}',
                                     '{"grammars": [{"json_schema": {}}], "max_tokens": 5}', "{not json"])
def test_a_constraint_vllm_cannot_take_is_refused_by_name(grammar: str) -> None:
    """A constraint with no Lark spelling is a 400 naming why, never sent unconstrained."""
    with pytest.raises(InvalidRequest, match="cannot pass this constraint to vLLM"):
        vllm_grammar(grammar)
