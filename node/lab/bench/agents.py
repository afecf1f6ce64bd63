"""`kvmesh bench agents`: one scripted agent session per API dialect on a two-node mesh.

Each session speaks its dialect as its agent does (Anthropic Messages as Claude Code, with the
volatile billing header and metadata.user_id; Responses as Codex CLI, store=false with the whole
input and prompt_cache_key; chat completions as aider; legacy completions as a raw prompt),
alternates entry nodes, executes the tool call each reply makes (or, without one, answers with
a tool-output-sized user message), and every `--move-every` turns drains its home so the next
turn moves (the replica of the last turn has landed first, as a drain leaves time for). Per
dialect: turns, handoffs by class, reuse p5 (the 5th percentile over follow-up turns of cached
tokens / the previous turn's prompt + completion tokens, from the dialect's own usage), errors.
The exit status is non-zero when any turn failed.
"""

from __future__ import annotations

import argparse
import json
import random
import secrets
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from kvmesh.node.lab.bench.common import emit, start_mesh
from kvmesh.node.lab.launcher import NodeProcess, wait_for, wait_peers
from kvmesh.node.lab.workload import text

SCRIPT = 'Reading it. <tool_call>\n{"name": "read_file", "arguments": {"path": "src/app.py"}}\n</tool_call>'
TOOL = {"name": "read_file", "description": "read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}


class Agent:
    """One conversation in one dialect: builds each request, reads each answer, grows the history."""

    def __init__(self, dialect: str, model: str, rng: random.Random, system_chars: int, tool_chars: int) -> None:
        self.dialect, self.model, self.rng, self.tool_chars = dialect, model, rng, tool_chars
        self.session = f"{dialect}-{uuid.uuid4().hex[:10]}"
        self.system = text(rng, system_chars)
        self.history: list[dict[str, Any]] = []  # this dialect's own items
        self.prompt_text = self.system + "\n\nTask: fix the bug in src/app.py\n"
        self._user("fix the bug in src/app.py")

    def _user(self, content: str) -> None:
        if self.dialect == "responses":
            self.history.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": content}]})
        elif self.dialect != "completions":
            self.history.append({"role": "user", "content": content})

    def request(self, max_tokens: int) -> tuple[str, dict[str, Any], dict[str, str]]:
        d, m = self.dialect, self.model
        if d == "messages":
            system = [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.80; cch={secrets.token_hex(4)};"},
                      {"type": "text", "text": self.system}]
            body = {"model": m, "max_tokens": max_tokens, "system": system, "messages": self.history,
                    "tools": [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}],
                    "metadata": {"user_id": json.dumps({"session_id": self.session})}, "temperature": 0}
            return "/v1/messages", body, {"X-Claude-Code-Session-Id": self.session}
        if d == "responses":
            body = {"model": m, "instructions": self.system, "input": self.history, "store": False,
                    "prompt_cache_key": self.session, "max_output_tokens": max_tokens,
                    "tools": [{"type": "function", **TOOL}], "temperature": 0}
            return "/v1/responses", body, {"session_id": self.session}
        if d == "chat":
            body = {"model": m, "messages": [{"role": "system", "content": self.system}, *self.history],
                    "max_tokens": max_tokens, "tools": [{"type": "function", "function": TOOL}], "temperature": 0}
            return "/v1/chat/completions", body, {"X-Session-Id": self.session}
        return "/v1/completions", {"model": m, "prompt": self.prompt_text, "max_tokens": max_tokens,
                                   "temperature": 0}, {"X-Session-Id": self.session}

    def answered(self, obj: dict[str, Any]) -> tuple[int, int, int]:
        """Read the answer into the history; (prompt, cached, completion) tokens from the dialect's usage."""
        result = text(self.rng, self.tool_chars)
        d = self.dialect
        if d == "messages":
            u = obj["usage"]
            self.history.append({"role": "assistant", "content": obj["content"] or [{"type": "text", "text": ""}]})
            use = next((b for b in obj["content"] if b["type"] == "tool_use"), None)
            if use is not None:
                self.history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                                  "content": result}]})
            else:
                self._user(result)
            return u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"], u["output_tokens"]
        if d == "responses":
            u = obj["usage"]
            for item in obj["output"]:
                if item["type"] == "function_call":
                    self.history += [{k: item[k] for k in ("type", "call_id", "name", "arguments")},
                                     {"type": "function_call_output", "call_id": item["call_id"], "output": result}]
                else:
                    said = "".join(p["text"] for p in item["content"])
                    self.history.append({"type": "message", "role": "assistant",
                                         "content": [{"type": "output_text", "text": said}]})
            if not any(i["type"] == "function_call" for i in obj["output"]):
                self._user(result)
            return u["input_tokens"], u["input_tokens_details"]["cached_tokens"], u["output_tokens"]
        u = obj["usage"]
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if d == "chat":
            msg = obj["choices"][0]["message"]
            self.history.append({k: v for k, v in msg.items() if k in ("role", "content", "tool_calls")})
            calls = msg.get("tool_calls") or []
            if calls:
                self.history += [{"role": "tool", "tool_call_id": c["id"], "content": result} for c in calls]
            else:
                self._user(result)
        else:
            self.prompt_text += obj["choices"][0]["text"] + "\n\nOutput:\n" + result + "\n"
        return u["prompt_tokens"], cached, u["completion_tokens"]


def _p5(xs: list[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return round(s[max(0, int(0.05 * (len(s) - 1)))], 4)


def _run_agent(agent: Agent, nodes: list[NodeProcess], http: httpx.Client, admin: dict[str, str], args: argparse.Namespace,
               key: dict[str, str]) -> dict[str, Any]:
    handoffs: Counter[str] = Counter()
    reuse: list[float] = []
    errors: list[str] = []
    prev: tuple[int, int] | None = None
    home = None
    for i in range(args.turns):
        entry = nodes[i % len(nodes)]
        drained = None
        if home is not None and i % args.move_every == 0:
            drained = next(n for n in nodes if n.api == home)
            r = http.post(f"{entry.api}/v1/admin/hosts/{drained.name}/drain", headers=admin)
            if r.status_code != 200:
                errors.append(f"drain: {r.status_code} {r.text[:120]}")
            _wait(lambda name=drained.name: all(next(h for h in http.get(f"{n.api}/v1/cluster").json()["hosts"]
                                                     if h["name"] == name)["draining"] for n in nodes), "the drain")
        path, body, headers = agent.request(args.max_tokens)
        try:
            r = http.post(entry.api + path, json=body, headers=headers | key)
            if r.status_code != 200:
                raise RuntimeError(f"{path}: {r.status_code} {r.text[:200]}")
            prompt, cached, completion = agent.answered(r.json())
            handoffs[r.headers.get("x-kvmesh-handoff", "none")] += 1
            served = r.headers["x-kvmesh-host"]
            home = next(n.api for n in nodes if n.name == served)
            if prev is not None:
                reuse.append(cached / max(1, sum(prev)))
            prev = (prompt, completion)
        except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as e:
            errors.append(f"turn {i}: {type(e).__name__}: {e}"[:300])
        if drained is not None:
            http.post(f"{entry.api}/v1/admin/hosts/{drained.name}/undrain", headers=admin)
        if home is not None and (i + 1) % args.move_every == 0 and i + 1 < args.turns:  # a drain comes next
            _wait_replica(http, nodes, agent.session, prev[0] if prev else 0)
    return {"turns": args.turns - len(errors), "warm": handoffs["warm"], "partial": handoffs["partial"],
            "cold": handoffs["cold"], "reuse_p5": _p5(reuse), "errors": len(errors), "error_samples": errors[:3]}


def _wait_replica(http: httpx.Client, nodes: list[NodeProcess], session: str, tokens: int) -> None:
    """Before a drain: the last turn's replica has landed on the other host (its whole blocks)."""
    block = int(http.get(f"{nodes[0].api}/v1/stats").json()["block_size"])

    def landed() -> bool:
        s = next((s for s in http.get(f"{nodes[0].api}/v1/cluster").json()["sessions"] if s["session"] == session), None)
        return bool(s and s["replica_host"] and s["replica_tokens"] >= tokens // block * block)
    _wait(landed, f"the replica of {session}")


def _wait(pred: Callable[[], bool], what: str) -> None:
    """Wait up to 30 s; a condition that never comes is measured (a partial or cold move), not hidden."""
    try:
        wait_for(pred, what, timeout=30)
    except Exception:  # noqa: BLE001
        print(f"kvmesh bench agents: {what} did not come within 30 s", file=sys.stderr)


def run_agents(args: argparse.Namespace) -> int:
    admin_token = "adm-" + secrets.token_hex(12)
    api_key = "sk-bench-" + secrets.token_hex(12)
    engine: dict[str, Any] = {"kind": "sim", "sim": {"kv_scale": 0.02, "scripted_reply": SCRIPT, "decode_tps": 400.0},
                              "served_names": ["claude-*", "gpt-*"]}
    if args.model:
        engine = {"kind": "llamacpp", "model": str(args.model), "max_context": 8192, "llamacpp": {"threads": 1},
                  "served_names": ["claude-*", "gpt-*"]}
    with tempfile.TemporaryDirectory(prefix="kvmesh-agents-") as tmp:
        nodes = start_mesh(Path(tmp), ["node-a", "node-b"], slots=2, kv_scale=0.02, cache_bytes=1 << 30, engine=engine,
                           extra={"admin_token": admin_token, "api": {"keys": [api_key]},
                                  "kvshare": {"replicate_min_tokens": 1024}})
        t0 = time.monotonic()
        try:
            wait_peers(nodes)
            # The mesh has a client key: its cluster view and stats want it as the turns do.
            with httpx.Client(timeout=600, headers={"x-api-key": api_key}) as http:
                admin = {"Authorization": f"Bearer {admin_token}"}
                per = {d: _run_agent(Agent(d, "claude-sonnet-4-5" if d == "messages" else "gpt-5-codex",
                                           random.Random(args.seed + i), args.system_chars, args.tool_chars),
                                     nodes, http, admin, args, {"x-api-key": api_key})
                       for i, d in enumerate(args.dialects)}
        finally:
            for n in nodes:
                n.stop()
    result: dict[str, Any] = {"engine": engine["kind"], "model": str(args.model or "sim"), "dialects": per,
                              "turns": sum(p["turns"] for p in per.values()),
                              "warm": sum(p["warm"] for p in per.values()),
                              "partial": sum(p["partial"] for p in per.values()),
                              "cold": sum(p["cold"] for p in per.values()),
                              "errors": sum(p["errors"] for p in per.values()),
                              "error_samples": [s for p in per.values() for s in p["error_samples"]][:3],
                              "elapsed_s": round(time.monotonic() - t0, 1)}
    return emit(result, args)
