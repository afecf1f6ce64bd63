"""Deterministic synthetic conversations: a coding agent's system prompt, tool output, replies."""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import random
from collections import defaultdict
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
    conversation: str = ""  # its prefix thread within the session ("": the session is the one thread)
    # False when `t` counts from its session's own start, which the trace does not record (Claude Code's)
    start_known: bool = True

    @property
    def thread(self) -> str:
        """The conversation the request continues: what a host's cache and replica of it are kept by."""
        return self.conversation or self.session


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


CLAUDE_CODE_BLOCK_TOKENS = 64  # a Claude Code trace's hash_ids cover 64 tokens each


def read_trace(path: str | Path) -> list[TraceRequest]:
    """Either trace format `kvmesh sim --trace` reads: Claude Code's (a directory of trace_*.json[.gz],
    or one such file) or Mooncake's (JSONL, or a name in TRACES)."""
    p = Path(TRACES.get(str(path), path))
    if p.is_dir() or p.name.endswith((".json", ".json.gz")):
        return read_claude_code(p)
    return read_mooncake(p)


def read_claude_code(path: str | Path) -> list[TraceRequest]:
    """Claude Code traces (kv-cache-tester's format, one JSON object per conversation, maybe gzipped):
    a file, or a directory of `trace_*.json.gz` / `trace_*.json`.

    Each file is one session; its main requests are one conversation (one client, closed loop: a
    request goes at its recorded `t`, and never sooner than its `think_time` after the previous
    reply); each `subagent` entry is a conversation of its own in the same session, started at the
    parent's `t` plus its own requests' times, sent by a client of its own (it runs beside the parent).
    The 64-token `hash_ids` become the sim's 512-token blocks: a block is equal where all eight of
    its hash ids and every one before them are; the tail past the last whole block is the request's
    own. Ids are local to a file, so no block is shared across files. Raises ValueError naming the
    file and request that is wrong."""
    p = Path(path)
    files = sorted([*p.glob("trace_*.json.gz"), *p.glob("trace_*.json")]) if p.is_dir() else [p]
    if not files:
        raise ValueError(f"{p}: no trace_*.json.gz files in it")
    blocks: dict[tuple[int, int], int] = {}  # (file, key of a prefix of hash ids) -> the block id
    out: list[TraceRequest] = []
    for i, f in enumerate(files):
        try:
            with gzip.open(f, "rt", encoding="utf-8") if f.name.endswith(".gz") else open(f, encoding="utf-8") as fh:
                d = json.load(fh)
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: not JSON ({e.msg})") from None
        if not isinstance(d, dict) or not isinstance(d.get("requests"), list):
            raise ValueError(f"{f}: a Claude Code trace is a JSON object with a list of requests")
        session = str(d.get("id") or f.name.split(".")[0])
        _claude_conversation(out, d["requests"], f"{f}", i, blocks, t0=0.0, session=session, conv=session)
    out.sort(key=lambda q: q.t)
    return out


def _claude_conversation(out: list[TraceRequest], requests: list[Any], where: str, file: int,
                         blocks: dict[tuple[int, int], int], *, t0: float, session: str, conv: str) -> None:
    per = TRACE_BLOCK_TOKENS // CLAUDE_CODE_BLOCK_TOKENS
    prev: tuple[int, ...] = ()
    turn = 0
    for n, r in enumerate(requests):
        at = f"{where}: {conv} request {n}"
        if not isinstance(r, dict) or not isinstance(r.get("t"), int | float) or isinstance(r.get("t"), bool):
            raise ValueError(f"{at}: a request is an object with a number `t`")
        if r.get("type") == "subagent":
            if not isinstance(r.get("requests"), list):
                raise ValueError(f"{at}: a subagent has a list of requests")
            sub = f"{conv}/{r.get('agent_id') or n}"
            _claude_conversation(out, r["requests"], where, file, blocks, t0=t0 + r["t"], session=session, conv=sub)
            continue
        ids = r.get("hash_ids")
        for k in ("in", "out"):
            if not isinstance(r.get(k), int) or isinstance(r.get(k), bool) or r[k] < 0:
                raise ValueError(f"{at}: {k} must be an integer >= 0, got {r.get(k)!r}")
        if not isinstance(ids, list) or not all(isinstance(b, int) and not isinstance(b, bool) for b in ids):
            raise ValueError(f"{at}: hash_ids must be a list of integers")
        if r["in"] < 1 or r["in"] < len(ids) * CLAUDE_CODE_BLOCK_TOKENS:
            raise ValueError(f"{at}: in ({r['in']}) is under its {len(ids)} hash ids' {CLAUDE_CODE_BLOCK_TOKENS} tokens each")
        keys = _chain(ids)
        mine = [blocks.setdefault((file, keys[j + per - 1]), len(blocks)) for j in range(0, len(ids) - per + 1, per)]
        while len(mine) * TRACE_BLOCK_TOKENS < r["in"]:  # the tail: this request's own text
            mine.append(blocks.setdefault((file, -1 - len(blocks)), len(blocks)))
        shared = 0
        while shared < min(len(prev), len(mine)) and prev[shared] == mine[shared]:
            shared += 1
        think = r.get("think_time") or 0.0
        out.append(TraceRequest(t=t0 + r["t"], session=session, turn=turn, input_length=r["in"], output_length=max(1, r["out"]),
                                blocks=tuple(mine), shared=min(shared * TRACE_BLOCK_TOKENS, r["in"]),
                                think_s=float(think) if turn else 0.0, client=conv, conversation=conv,
                                start_known=False))
        prev, turn = tuple(mine), turn + 1


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


def scale_trace(requests: list[TraceRequest], factor: float, span_s: float, rng: random.Random) -> list[TraceRequest]:
    """The trace's sessions `factor` times over: whole copies (each session shifted by its own random
    offset within the span, wrapping round, a session's conversations together; copies after the first
    with their own ids and blocks), then a random share of the sessions for the fraction left (below 1:
    a random share of the trace itself). A session whose start the trace records keeps it in the first
    copy; one whose times count from its own start (Claude Code's) is shifted there too: starting them
    all at 0 would be a burst of every session at once that the trace never recorded."""
    top = 1 + max(b for r in requests for b in r.blocks)
    by_session: dict[str, list[TraceRequest]] = defaultdict(list)  # a session's clients (its subagents) move together
    for r in requests:
        by_session[r.session].append(r)
    out: list[TraceRequest] = []
    for c in range(max(1, math.ceil(factor))):
        keep = min(1.0, factor - c)
        for reqs in by_session.values():
            if keep < 1.0 and rng.random() >= keep:
                continue
            if c == 0 and reqs[0].start_known:
                out += reqs
                continue
            shift = rng.uniform(0, span_s)
            if reqs[0].t + shift >= span_s:
                shift -= span_s
            tag = f"#{c}" if c else ""  # the first copy keeps its ids and blocks
            out += [dataclasses.replace(r, t=max(0.0, r.t + shift), session=f"{r.session}{tag}",
                                        client=f"{r.client}{tag}" if r.client else "",
                                        conversation=f"{r.conversation}{tag}" if r.conversation else "",
                                        blocks=tuple(b + c * top for b in r.blocks)) for r in reqs]
    return sorted(out, key=lambda r: r.t)


class TracePrompts:
    """A trace request's prompt text: per 512-token block, `block_chars` characters seeded by the block's id
    (equal ids, equal text: the trace's shared prefixes are shared here), cut to `input_length` blocks' worth.

    A conversation's next request in a trace often replaces the previous one's last blocks with new ids
    (the last, which that one held only in part; in Mooncake's trace up to eight). Seeded apart, the new
    prompt would not extend the previous one, so a client sending it would look like a new conversation
    each turn (node.mesh.threads keys a conversation by how its first message begins). A real client's
    history only grows: each such new block's text starts with what the previous prompt held at its place,
    and only its rest is seeded by its own id. A longer replaced tail is a rewritten history (Claude Code's
    compaction): its text is new."""

    MAX_REPLACED = 8  # blocks

    def __init__(self, block_chars: int):
        self.block_chars = block_chars
        self._texts: dict[int, str] = {}
        self._last: dict[str, tuple[tuple[int, ...], str]] = {}  # conversation -> its previous (blocks, prompt)

    def prompt(self, r: TraceRequest) -> str:
        bc, texts = self.block_chars, self._texts
        prev = self._last.get(r.thread)
        if prev is not None and len(r.blocks) >= len(prev[0]):
            j = next((i for i, (a, b) in enumerate(zip(prev[0], r.blocks)) if a != b), len(prev[0]))
            if len(prev[0]) - j <= self.MAX_REPLACED:
                for i in range(j, len(prev[0])):
                    if r.blocks[i] not in texts:
                        held = prev[1][i * bc:(i + 1) * bc]
                        texts[r.blocks[i]] = held + text(random.Random(r.blocks[i]), bc)[len(held):]
        for b in r.blocks:
            if b not in texts:
                texts[b] = text(random.Random(b), bc)
        out = "".join(texts[b] for b in r.blocks)[: r.input_length * bc // TRACE_BLOCK_TOKENS]
        self._last[r.thread] = (r.blocks, out)
        return out
