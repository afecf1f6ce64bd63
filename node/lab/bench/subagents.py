"""`kvmesh bench subagents`: Claude Code's subagents, several conversations under one session id.

Claude Code's main conversation spawns several subagents at once, all under its own session id
(`X-Claude-Code-Session-Id`), each with its own system prompt and first user message. Sharing an
id must neither queue the subagents behind one another nor cost the main conversation its cache.
The scenario, in Anthropic Messages as Claude Code speaks it: the main's first turn, then the
subagents' first turns, then the main's next turn (its previous prompt, its reply, a new user
message). Four variants: the subagents under the main's id or under ids of their own, sent at once
or one by one; each variant has fresh ids and texts. It runs on one node, then on a two-node mesh,
every request entered at the same node (`--meshes` picks). Each node's KV pool holds about 1.3 times
one variant's prompts (`--cache-tokens`), as a busy node's is full: blocks no conversation holds
any more get overwritten, so a main conversation whose cache a subagent displaced loses it (an
ample pool keeps such blocks addressable by hash and hides the loss).

Figures per mesh: `parallel_ratio`, the wall time of the concurrent subagents under the main's id
over that under their own ids (goal <= 1.2), and `main_reuse`, the cached over the prompt tokens of
the main's next turn (its usage's cache_read_input_tokens), per variant and their minimum (goal
>= 0.9). At the top: the worse mesh's ratio and the minimum reuse over both. The goals are reported
(`goals_met`); the exit status is non-zero when a request failed, not when a goal is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from kvmesh.node.lab.bench.common import chars_per_token, emit, start_mesh
from kvmesh.node.lab.launcher import NodeProcess, wait_peers
from kvmesh.node.lab.workload import text

GOALS = {"parallel_ratio": 1.2, "main_reuse": 0.9}
# (main's first prompt, each subagent's) in tokens: the sim's scale, and one an 8k-context model on 2 cores can run.
SIZES = {"sim": (22_000, 14_000), "llamacpp": (2_000, 1_500)}
POOL_SHARE = 1.3  # the pool over one variant's prompts (the main's and every subagent's)
REPLY = "I will split this up: one subagent reads the code, one the tests, one the docs. Then I report."
ASK_CHARS = 300  # each first and next user message
MODEL = "claude-sonnet-4-5"
VARIANTS = [(shared, at_once) for at_once in (True, False) for shared in (True, False)]


def _name(shared: bool, at_once: bool) -> str:
    return f"{'same_id' if shared else 'own_ids'}/{'concurrent' if at_once else 'serial'}"


async def _post(http: httpx.AsyncClient, api: str, session: str, system: str, messages: list[dict[str, Any]],
                max_tokens: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One Messages turn as Claude Code sends it: (its figures, the reply's content blocks)."""
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "messages": messages,
            "system": [{"type": "text", "text": system}], "metadata": {"user_id": json.dumps({"session_id": session})}}
    t0 = time.monotonic()
    r = await http.post(f"{api}/v1/messages", json=body, headers={"X-Claude-Code-Session-Id": session})
    if r.status_code != 200:
        raise RuntimeError(f"{session}: {r.status_code} {r.text[:200]}")
    obj = r.json()
    u = obj["usage"]
    prompt, cached = u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"]
    said = {"prompt": prompt, "cached": cached, "host": r.headers.get("x-kvmesh-host"),
            "seconds": round(time.monotonic() - t0, 3)}
    return said, obj["content"] or [{"type": "text", "text": ""}]


async def _variant(http: httpx.AsyncClient, api: str, rng: random.Random, shared: bool, at_once: bool,
                   chars: tuple[int, int], n: int, max_tokens: int) -> dict[str, Any]:
    """The scenario once: the main's first turn, n subagents (at once or one by one), the main's next turn."""
    session = f"cc-{uuid.uuid4()}"
    system, ask = text(rng, chars[0] - ASK_CHARS), [{"role": "user", "content": text(rng, ASK_CHARS)}]
    first, reply = await _post(http, api, session, system, ask, max_tokens)
    subs: list[tuple[str, str, list[dict[str, Any]]]] = [
        (session if shared else f"cc-{uuid.uuid4()}", text(rng, chars[1] - ASK_CHARS),
         [{"role": "user", "content": f"Subagent {i}: " + text(rng, ASK_CHARS)}]) for i in range(n)]
    t0 = time.monotonic()
    if at_once:
        done = await asyncio.gather(*(_post(http, api, s, sy, m, max_tokens) for s, sy, m in subs))
    else:
        done = [await _post(http, api, s, sy, m, max_tokens) for s, sy, m in subs]
    wall = time.monotonic() - t0
    history: list[dict[str, Any]] = [*ask, {"role": "assistant", "content": reply}, {"role": "user", "content": text(rng, ASK_CHARS)}]
    nxt, _ = await _post(http, api, session, system, history, max_tokens)
    return {"subagents_wall_s": round(wall, 3), "main_reuse": round(nxt["cached"] / max(1, nxt["prompt"]), 4),
            "main_first": first, "subagents": [d for d, _ in done], "main_next": nxt}


async def _mesh_run(api: str, rng: random.Random, chars: tuple[int, int], n: int, max_tokens: int) -> dict[str, Any]:
    """Every variant on one mesh, entered at `api`; its figures, and what failed."""
    out: dict[str, Any] = {"variants": {}, "errors": 0, "error_samples": []}
    async with httpx.AsyncClient(timeout=900) as http:
        for shared, at_once in VARIANTS:
            try:
                out["variants"][_name(shared, at_once)] = await _variant(http, api, rng, shared, at_once, chars, n,
                                                                         max_tokens)
            except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as e:
                out["errors"] += 1
                out["error_samples"].append(f"{_name(shared, at_once)}: {type(e).__name__}: {e}"[:300])
    v = out["variants"]
    same, own = v.get(_name(True, True)), v.get(_name(False, True))
    out["parallel_ratio"] = round(same["subagents_wall_s"] / own["subagents_wall_s"], 3) if same and own else None
    out["main_reuse"] = min((x["main_reuse"] for x in v.values()), default=None)
    return out


def _engine(args: argparse.Namespace) -> tuple[str, dict[str, Any], float]:
    """(the engine's kind, the nodes' engine config, characters per token of the workload's text)."""
    if args.engine == "sim":
        return "sim", {"kind": "sim", "sim": {"kv_scale": 0.02, "scripted_reply": REPLY, "decode_tps": 400.0},
                       "served_names": ["claude-*"]}, 1.0  # the sim's byte tokenizer
    model = str(args.model or "smollm2")
    per_token, _ = chars_per_token(model)
    return "llamacpp", {"kind": "llamacpp", "model": model, "max_context": 8192, "llamacpp": {"threads": 1},
                        "served_names": ["claude-*"]}, per_token


def run_subagents(args: argparse.Namespace) -> int:
    kind, engine, per_token = _engine(args)
    main_tokens = args.main_tokens or SIZES[kind][0]
    sub_tokens = args.subagent_tokens or SIZES[kind][1]
    chars = (int(main_tokens * per_token), int(sub_tokens * per_token))
    cache_tokens = args.cache_tokens or int(POOL_SHARE * (main_tokens + args.subagents * sub_tokens))
    engine["cache_tokens"] = cache_tokens
    rng = random.Random(args.seed)
    runs: dict[str, dict[str, Any]] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvmesh-subagents-") as tmp:
        for label in args.meshes:
            names = ["node-a"] if label == "one_node" else ["node-a", "node-b"]
            nodes: list[NodeProcess] = start_mesh(Path(tmp) / label, names, slots=args.subagents + 1, kv_scale=0.02,
                                                  cache_bytes=1 << 30, engine=engine)
            try:
                wait_peers(nodes)
                runs[label] = asyncio.run(_mesh_run(nodes[0].api, rng, chars, args.subagents, args.max_tokens))
                if runs[label]["errors"]:  # the nodes log what a 500 hides; their folder goes with the run
                    print("\n".join(f"--- {n.name} ---\n{n.tail(30)}" for n in nodes), file=sys.stderr)
            finally:
                for n in nodes:
                    n.stop()
    ratios = [r["parallel_ratio"] for r in runs.values()]
    reuses = [r["main_reuse"] for r in runs.values()]
    ratio = None if None in ratios else max(ratios)
    reuse = None if None in reuses else min(reuses)
    result: dict[str, Any] = {
        "engine": kind, "model": engine.get("model", "sim"), "parallel_ratio": ratio, "main_reuse": reuse,
        "goals": GOALS, "goals_met": {"parallel_ratio": ratio is not None and ratio <= GOALS["parallel_ratio"],
                                      "main_reuse": reuse is not None and reuse >= GOALS["main_reuse"]},
        "sizes": {"main_tokens": main_tokens, "subagent_tokens": sub_tokens, "subagents": args.subagents,
                  "max_tokens": args.max_tokens, "cache_tokens": cache_tokens},
        **runs,
        "turns": sum(len(v["subagents"]) + 2 for r in runs.values() for v in r["variants"].values()),
        "errors": sum(r["errors"] for r in runs.values()),
        "error_samples": [s for r in runs.values() for s in r["error_samples"]][:3],
        "elapsed_s": round(time.monotonic() - t0, 1),
    }
    return emit(result, args)
