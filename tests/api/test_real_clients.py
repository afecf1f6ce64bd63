"""Real agent clients against a real node: the OpenAI Agents SDK and aider, every turn's reuse the token-level maximum.

Each client runs as itself, in its own venv (`make clients`, part of `make test`: their pins clash with each
other's and with kvmesh's), as a subprocess driving an in-process sim node through its API. The node's replies
are scripted (a tool call for the Agents SDK, prose for aider); everything else is the node's real path. A probe
on the engine (tests/support/turnspy.py) records each prompt's ids and what its session held as it began, so
the cached tokens the client was told can be checked against the most a turn could reuse, token by token.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.turnspy import TurnSpy

from kvmesh.node.config import EngineConfig, NodeConfig, SimConfig
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = ROOT / ".venv-clients"
SCRIPTS = Path(__file__).resolve().parent / "clients"
TOOL_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PROSE = "It appends the item to ITEMS; a list is fine here, and a test of add() is worth writing."


def _python(client: str) -> Path:
    py = CLIENTS / client / "bin" / "python"
    if not py.exists():
        pytest.fail(f"{py} is missing: `make clients` builds the real clients' venvs (`make test` does)")
    return py


def _node(name: str, reply: str) -> tuple[ThreadedServer, TurnSpy]:
    sim = SimConfig(kv_scale=0.01, decode_tps=2000, prefill_tps=1e6, scripted_reply=reply)
    srv = serve_in_thread(NodeConfig(name=name, engine=EngineConfig(
        kind="sim", cache_bytes=64 << 20, block_size=16, slots=2, queue_max=4, sim=sim, served_names=["gpt-*"])))
    return srv, TurnSpy(srv.node.engine)


@pytest.fixture
def agents_node() -> Iterator[tuple[ThreadedServer, TurnSpy]]:
    srv, spy = _node("api-agents-sdk", TOOL_CALL)
    try:
        yield srv, spy
    finally:
        srv.stop()


def _run(client: str, *args: str) -> dict[str, Any]:
    r = subprocess.run([str(_python(client)), *args], capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "OPENAI_AGENTS_DISABLE_TRACING": "1",
                            "AIDER_ANALYTICS": "false", "AIDER_CHECK_UPDATE": "false"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def _assert_reuse_is_the_most(spy: TurnSpy, cached: list[int]) -> None:
    """The client was told, turn by turn, exactly what the engine reused, and that was the token-level common
    prefix of what its session held and its prompt."""
    turns = spy.turns
    assert len(turns) == len(cached), (len(turns), cached)
    assert cached == [t.max_reuse for t in turns], ([t.max_reuse for t in turns], cached)
    assert all(t.max_reuse > 0 for t in turns[1:])


@pytest.mark.parametrize("api", ["responses", "chat"])
def test_the_agents_sdk_keeps_every_token_it_can(agents_node: tuple[ThreadedServer, TurnSpy], api: str) -> None:
    """Five Agents SDK turns, tool_choice required then auto, chained by previous_response_id (Responses) or the
    whole history (chat): every turn served, every tool call parsed and run, and each turn after the first
    reuses the token-level common prefix, which covers the whole previous prompt."""
    srv, spy = agents_node
    out = _run("agents", str(SCRIPTS / "agents_session.py"), srv.v1, "gpt-4.1", api, "5", f"agents-{api}")
    assert out["calls"] == ["Paris"] * 5, out
    assert len(out["turns"]) == 5  # one model call per run: the tool's output ends it
    if api == "responses":
        assert len({t["response_id"] for t in out["turns"]}) == 5  # each turn a stored response the next continues
    _assert_reuse_is_the_most(spy, [t["cached_tokens"] for t in out["turns"]])
    # Prompt stability: nothing before the history changed between turns, so each prompt extends the last one's.
    for prev, cur in zip(spy.turns, spy.turns[1:]):
        assert cur.max_reuse >= len(prev.prompt), (len(prev.prompt), cur.max_reuse)


def test_aider_keeps_every_token_it_can(tmp_path: Path) -> None:
    """Three aider turns on one file through its Python API (no session header): each answered, no error shown,
    and each turn after the first reuses the token-level common prefix with what its conversation held."""
    srv, spy = _node("api-aider", PROSE)
    try:
        out = _run("aider", str(SCRIPTS / "aider_session.py"), srv.v1, "gpt-4.1", str(tmp_path), "3")
    finally:
        srv.stop()
    assert out["errors"] == [] and len(out["usages"]) == 3, out
    assert [u["prompt_tokens"] for u in out["usages"]] == [len(t.prompt) for t in spy.turns]
    _assert_reuse_is_the_most(spy, [u["cached_tokens"] for u in out["usages"]])
