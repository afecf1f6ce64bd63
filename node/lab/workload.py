"""Deterministic synthetic conversations: a coding agent's system prompt, tool output, replies."""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORDS = (
    "def class return import self async await yield lambda None True False for while if else elif try except "
    "finally with as raise assert pass break continue global nonlocal del from in is not and or test file "
    "path line error value result config node engine block cache token session replica mesh host slot"
).split()


def text(rng: random.Random, n_chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(WORDS)
        sep = "\n" if rng.random() < 0.08 else " "
        out.append(w + sep)
        size += len(w) + 1
    return "".join(out)[:n_chars]


def system_prompt(rng: random.Random, n_chars: int = 3000) -> str:
    return "You are a coding agent. Follow the spec exactly.\n" + text(rng, n_chars)


def grow_conversation(rng: random.Random, target_tokens: int, *, tool_chars: tuple[int, int] = (800, 4000)) -> list[dict[str, str]]:
    """A conversation whose chat template is ~target_tokens long (byte tokenizer: 1 char ~ 1 token)."""
    msgs = [{"role": "system", "content": system_prompt(rng)}, {"role": "user", "content": "Build the to-do app from the spec."}]
    size = sum(len(m["content"]) + 2 for m in msgs)
    while size < target_tokens:
        reply = text(rng, rng.randint(60, 200))
        tool = text(rng, min(rng.randint(*tool_chars), max(1, target_tokens - size)))
        msgs += [{"role": "assistant", "content": reply}, {"role": "tool", "content": tool}]
        size += len(reply) + len(tool) + 4
    return msgs


# ---- traces: requests as token blocks (the Mooncake format; `kvmesh sim`) -----------------------

TRACE_BLOCK_TOKENS = 512  # Mooncake's hash_ids cover 512 tokens each
# Traces shipped with kvmesh, by name (node/lab/traces/README.md says where each is from).
TRACES = {"mooncake": Path(__file__).resolve().parent / "traces" / "mooncake_synthetic.jsonl.gz"}


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, in the Mooncake trace's terms, joined to its conversation."""

    t: float  # earliest send time, seconds from the start
    session: str
    turn: int  # 0: the conversation's first request
    input_length: int
    output_length: int
    blocks: tuple[int, ...]  # the prompt's 512-token blocks; equal leading ids mean an equal prefix
    shared: int = 0  # tokens of prompt prefix shared with the conversation's previous request
    think_s: float = 0.0  # sent at least this long after the client's previous reply (closed loop)
    client: str = ""  # who sends it: one request at a time per client ("": the session is the client)


def _chain(blocks: tuple[int, ...] | list[int]) -> list[int]:
    """The prefix keys of `blocks`: key k stands for blocks[:k + 1] (O(1) each, not a k-tuple)."""
    out, key = [], 0
    for b in blocks:
        key = hash((key, b))
        out.append(key)
    return out


def read_mooncake(path: str | Path, *, min_shared: float = 0.5) -> list[TraceRequest]:
    """A Mooncake-format JSONL trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).

    A request whose blocks extend an earlier request's, or share at least `min_shared` of its blocks
    as a prefix with one (the same conversation resent with an edited tail), continues that
    conversation; any other starts one. `path` may be gzipped, or a name in TRACES. Raises
    ValueError naming the line and field that is wrong."""
    path = TRACES.get(str(path), path)
    prefixes: dict[int, str] = {}  # prefix key -> the conversation that last sent that prefix
    turns: dict[str, int] = {}
    out: list[TraceRequest] = []
    with (gzip.open(path, "rt", encoding="utf-8") if str(path).endswith(".gz") else open(path, encoding="utf-8")) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = _trace_line(line, n, path)
            keys = _chain(r["hash_ids"])
            k = 0
            while k < len(keys) and keys[k] in prefixes:
                k += 1
            conv = prefixes[keys[k - 1]] if k and (k == len(keys) or k >= min_shared * len(keys)) else None
            if conv is None:
                conv = f"conv-{len(turns)}"
                k = 0
            turns[conv] = turns.get(conv, -1) + 1
            for key in keys:
                prefixes[key] = conv
            out.append(TraceRequest(t=r["timestamp"] / 1000.0, session=conv, turn=turns[conv],
                                    input_length=r["input_length"], output_length=r["output_length"],
                                    blocks=tuple(r["hash_ids"]),
                                    shared=min(k * TRACE_BLOCK_TOKENS, r["input_length"])))
    out.sort(key=lambda q: q.t)
    return out


def _trace_line(line: str, n: int, path: str | Path) -> dict[str, Any]:
    where = f"{path}:{n}"
    try:
        r = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(r, dict):
        raise ValueError(f"{where}: a request is a JSON object")
    for k in ("timestamp", "input_length", "output_length"):
        if not isinstance(r.get(k), int | float) or isinstance(r.get(k), bool) or r[k] < 0:
            raise ValueError(f"{where}: {k} must be a number >= 0, got {r.get(k)!r}")
    ids = r.get("hash_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(b, int) and not isinstance(b, bool) for b in ids):
        raise ValueError(f"{where}: hash_ids must be a non-empty list of integers")
    if r["input_length"] > len(ids) * TRACE_BLOCK_TOKENS or r["input_length"] <= (len(ids) - 1) * TRACE_BLOCK_TOKENS:
        raise ValueError(f"{where}: input_length {r['input_length']} does not fit {len(ids)} blocks of "
                         f"{TRACE_BLOCK_TOKENS} tokens")
    return r


def agent_trace(*, agents: int, duration_s: float, seed: int = 1, system_tokens: tuple[int, int] = (2500, 4000),
                tool_tokens: tuple[int, int] = (300, 4000), reply_tokens: int = 64, target_tokens: int = 50_000,
                think_s: tuple[float, float] = (0.5, 2.0)) -> list[TraceRequest]:
    """`kvmesh load`'s coding agents as a trace: each agent (a client) runs conversations back to back
    (a system prompt, then turns appending a tool output and a reply, until `target_tokens`),
    thinking `think_s` after each reply; every conversation's blocks are its own. Closed loop: only
    each agent's first request has a time; the list holds more turns than `duration_s` can take
    (a replay stops sending at `duration_s`)."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    next_block = 0
    per_agent = int(duration_s / think_s[0]) + 1  # no agent can send more turns than this
    for a in range(agents):
        sent, conv, first = 0, 0, rng.uniform(0, think_s[1])
        while sent < per_agent:
            session, size, turn, prev = f"agent-{a}-{conv}", rng.randint(*system_tokens), 0, 0
            blocks: list[int] = []
            while size < target_tokens and sent < per_agent:
                while len(blocks) * TRACE_BLOCK_TOKENS < size:
                    blocks.append(next_block)
                    next_block += 1
                out.append(TraceRequest(t=first if sent == 0 else 0.0, session=session, turn=turn, input_length=size,
                                        output_length=reply_tokens, blocks=tuple(blocks), shared=prev,
                                        think_s=0.0 if sent == 0 else rng.uniform(*think_s), client=f"agent-{a}"))
                prev, size, turn, sent = size, size + reply_tokens + rng.randint(*tool_tokens), turn + 1, sent + 1
            conv += 1
    return out
