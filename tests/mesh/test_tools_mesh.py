"""Tool calls across the mesh: a forwarded request with tools, and a tool-call stream resumed on a survivor.

The nodes' sim engines set the test-only `scripted_reply` (two Hermes tool calls), so every
host answers the same text and a resumed turn repeats it exactly.
"""

from __future__ import annotations

import json
from typing import Any

from support.conversation import Conversation

from .helpers import MODEL, Mesh

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
         for n in ("get_weather", "read_file")]
SCRIPT = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2, 3]}}\n</tool_call>\n'
          '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/kvmesh/node/engine/chat.py"}}\n</tool_call>')
WANT = [("get_weather", {"city": "Paris", "days": [1, 2, 3]}), ("read_file", {"path": "src/kvmesh/node/engine/chat.py"})]


def _metric(m: Mesh, node: str, name: str) -> float:
    text = m.http.get(m.api(node) + "/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


def _read_and_kill(m: Mesh, stream: Any, home: str) -> tuple[dict[int, dict[str, Any]], list[str], set[str]]:
    """Read the stream as a client does, killing `home` once the first call's arguments have begun."""
    calls: dict[int, dict[str, Any]] = {}
    finishes, ids, killed = [], set(), False
    for chunk in stream.parse():
        ids.add(chunk.id)
        for ch in chunk.choices:
            finishes += [ch.finish_reason] if ch.finish_reason else []
            assert not ch.delta.content, ch.delta.content
            for tc in ch.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"ids": [], "name": "", "args": ""})
                call["ids"] += [tc.id] if tc.id else []
                call["name"] += tc.function.name or ""
                call["args"] += tc.function.arguments or ""
        if not killed and len(calls.get(0, {}).get("args", "")) >= 6:
            assert not finishes, "the answer ended before the kill"
            m.nodes[home].kill()
            killed = True
    assert killed
    return calls, finishes, ids


def test_tool_calls_are_forwarded_and_a_resumed_stream_calls_each_tool_once(make_mesh) -> None:  # type: ignore[no-untyped-def]
    """Forwarded to the home: tool calls come back whole; when the home dies mid-call the stream goes on from a
    survivor with each call started once (one id), its arguments whole, and finish_reason tool_calls."""
    m: Mesh = make_mesh(slots=2, sim={"decode_tps": 25.0, "scripted_reply": SCRIPT})  # 40 ms a token
    conv = Conversation("tools-mesh", seed=31)
    home = m.turn(conv, "a").host
    m.settle(conv)
    entry = next(n for n in m.names if n != home)
    kw: dict[str, Any] = dict(model=MODEL, messages=conv.messages, tools=TOOLS, max_tokens=400, temperature=0,
                              extra_headers={"X-Session-Id": conv.session})
    whole = m.client(entry).chat.completions.with_raw_response.create(**kw)
    assert whole.headers["x-kvmesh-host"] == home
    msg = whole.parse().choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == WANT

    stream = m.client(entry).chat.completions.with_raw_response.create(**kw, stream=True)
    assert stream.headers["x-kvmesh-host"] == home
    calls, finishes, ids = _read_and_kill(m, stream, home)
    assert finishes == ["tool_calls"] and len(ids) == 1
    assert [(calls[i]["name"], json.loads(calls[i]["args"])) for i in sorted(calls)] == WANT
    assert all(len(c["ids"]) == 1 for c in calls.values()), calls
    assert _metric(m, entry, "kvmesh_streams_resumed_total") == 1
