"""`kvmesh load`: drive a mesh through its OpenAI API like a fleet of coding agents.

N concurrent sessions, each a system prompt of a few thousand tokens, then
turns that append tool output and a short assistant reply, with think time
between turns; a conversation that reaches `target_tokens` ends and a new one
starts. Deterministic from the seed (texts, sizes, think times; not which host
answers). Turns go to the entry nodes round-robin. A JSONL trace (one line per
turn: session, time offset, appended messages) can be recorded and replayed,
and a Mooncake-format trace (the reader `kvmesh sim` uses) replayed as chat turns.
The client is node.lab.clientmodel's, as in `kvmesh sim`: a refused turn (429/529) is retried after its
Retry-After (or a backoff) until its retries run out, an attempt with no byte for the client's timeout
fails its turn, and a failed turn is counted, not retried: the conversation goes on with its next turn.
With `sdk="anthropic"` the turns go through the official Anthropic SDK instead, which retries them itself
(node.lab.sdkclient). With `turns` every turn's outcome is written as one JSON line (when it was sent, its
session, where it entered and ran, its handoff, tokens and TTFTs; a failed turn's reason): what makes a tail.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import httpx

from kvmesh.node.lab.clientmodel import SDKS, ClientModel
from kvmesh.node.lab.launcher import client_key_headers
from kvmesh.node.lab.sdkclient import OVERLOAD_STATUSES, AnthropicSender
from kvmesh.node.lab.streamclient import StreamedTurn, TurnFailed, stream_chat
from kvmesh.node.lab.workload import TRACE_BLOCK_TOKENS, TracePrompts, TraceRequest, system_prompt, text


@dataclass
class LoadShape:
    sessions: int = 16
    target_tokens: int = 50_000
    tool_tokens: tuple[int, int] = (300, 4000)
    system_tokens: tuple[int, int] = (2500, 4000)  # a conversation's opening system prompt
    max_tokens: int = 64
    think_s: tuple[float, float] = (0.5, 2.0)
    seed: int = 1


@dataclass
class LoadStats:
    turns: int = 0
    errors: int = 0
    status: Counter[str] = field(default_factory=Counter)
    handoffs: Counter[str] = field(default_factory=Counter)
    hosts: Counter[str] = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    conversations: int = 0
    prompt_tokens: int = 0
    recomputed_tokens: int = 0  # prompt tokens not served from a cache
    error_samples: list[str] = field(default_factory=list)
    refused: int = 0  # attempts refused as overloaded (429/529)
    turns_refused: int = 0  # turns refused at least once
    failed_refused: int = 0  # turns whose client ran out of retries
    failed_timeout: int = 0  # turns whose attempt had no answer within the client's timeout
    ttft_with_retries_s: list[float] = field(default_factory=list)  # a served turn's, from its first attempt
    elapsed_s: float = 0.0
    slo_s: float = 2.0

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float | None:
            v = sorted(xs)
            return round(v[min(len(v) - 1, int(q * len(v)))], 4) if v else None

        failed = self.failed_refused + self.failed_timeout
        tried = self.turns + failed  # every turn a client sent (and did not leave to the run's end)
        return {
            "turns": self.turns, "errors": self.errors, "conversations": self.conversations,
            "status": dict(self.status), "handoffs": dict(self.handoffs), "hosts": dict(self.hosts),
            "ttft_p50_s": pct(self.ttft_s, 0.5), "ttft_p95_s": pct(self.ttft_s, 0.95), "ttft_p99_s": pct(self.ttft_s, 0.99),
            "latency_p50_s": pct(self.latency_s, 0.5), "latency_p99_s": pct(self.latency_s, 0.99),
            "prompt_tokens": self.prompt_tokens, "prompt_tokens_recomputed": self.recomputed_tokens,
            "refused": self.refused,
            # What the clients lived: turns that failed in their face, turns refused at least once, refusals per turn,
            # and a served turn's TTFT from its first attempt.
            "failed_turns": failed, "failed_refused": self.failed_refused, "failed_timeout": self.failed_timeout,
            "failed_pct": round(100.0 * failed / tried, 2) if tried else 0.0,
            "turns_refused_once_pct": round(100.0 * self.turns_refused / tried, 2) if tried else 0.0,
            "refusals_per_turn": round(self.refused / tried, 4) if tried else 0.0,
            "ttft_with_retries_p50_s": pct(self.ttft_with_retries_s, 0.5),
            "ttft_with_retries_p99_s": pct(self.ttft_with_retries_s, 0.99),
            # Turns whose first token came within the SLO, per second (a refused attempt is not a served turn).
            "goodput_per_s": round(sum(1 for x in self.ttft_s if x <= self.slo_s) / self.elapsed_s, 4)
            if self.elapsed_s else None, "slo_s": self.slo_s, "elapsed_s": round(self.elapsed_s, 1),
            "error_samples": self.error_samples[:5],
        }


class LoadRunner:
    def __init__(self, nodes: list[str], shape: LoadShape, *, model: str | None = None, record: TextIO | None = None,
                 time_scale: float = 1.0, client: ClientModel | None = None, sdk: str | None = None,
                 turns: TextIO | None = None):
        if sdk is not None and sdk not in SDKS:
            raise ValueError(f"unknown SDK {sdk!r} (one of {', '.join(SDKS)})")
        self.nodes = nodes
        self.sdk = sdk  # None: our own streaming client, retrying as `client` says; else that SDK, retrying itself
        self._sender: AnthropicSender | None = None
        self.client = client or ClientModel()
        self._jitter = random.Random(shape.seed * 7919 + 1)  # the clients' backoff
        self.shape = shape
        self.model = model
        self.record = record
        self.turns = turns  # one JSON line per turn's outcome
        self.time_scale = time_scale  # think times are multiplied by this (time compression)
        self.stats = LoadStats()
        self._rr = 0
        self._t0 = 0.0
        self._stop = asyncio.Event()

    def _entry(self) -> str:
        self._rr += 1
        return self.nodes[self._rr % len(self.nodes)]

    async def turn(self, client: httpx.AsyncClient, session: str, messages: list[dict[str, str]], *,
                   max_tokens: int | None = None) -> str | None:
        """One streamed turn, retried as the client model does; returns the reply text, or None when it failed."""
        if self._sender is not None:
            return await self._sdk_turn(self._sender, session, messages, max_tokens or self.shape.max_tokens)
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens or self.shape.max_tokens,
                "temperature": 0}
        st = self.stats
        first = time.monotonic()
        retries = 0
        while True:
            sent, entry = time.monotonic(), self._entry()
            try:
                r = await stream_chat(client, f"{entry}/v1/chat/completions", body, {"X-Session-Id": session})
                break
            except TurnFailed as e:
                if e.status in OVERLOAD_STATUSES:
                    st.refused += 1
                    st.turns_refused += retries == 0
                    if self._stop.is_set():
                        return None  # refused as the run ended: not sent again, and no error
                    delay = self.client.retry_delay(retries, e.retry_after_s or None, self._jitter)
                    if delay is None:
                        self._failed(session, entry, first, "refused", retries + 1)
                        return None
                    retries += 1
                    await self._sleep(delay)
                    continue
                if not e.timed_out:
                    self._error(session, str(e), e.status)
                self._failed(session, entry, first, "timeout" if e.timed_out else "error", retries)
                return None
        self._served(r, session, entry, first, sent - first, retries)
        return r.text

    async def _sdk_turn(self, sender: AnthropicSender, session: str, messages: list[dict[str, str]],
                        max_tokens: int) -> str | None:
        """One turn through the official SDK, which retries it itself (node.lab.sdkclient counts its attempts)."""
        st = self.stats
        entry, first = self._entry(), time.monotonic()
        o = await sender.turn(entry, self.model or "", session, messages, max_tokens)
        st.refused += o.attempts.refused
        st.turns_refused += o.attempts.refused > 0
        sent = o.attempts.sent
        if sent:
            first = sent[0]
        if o.turn is not None:
            self._served(o.turn, session, entry, first, sent[-1] - sent[0] if sent else 0.0, o.attempts.refused)
            return o.turn.text
        failure = o.failure if o.failure in ("refused", "timeout") else "error"
        if failure == "error":
            self._error(session, o.error, o.status)
        self._failed(session, entry, first, failure, o.attempts.refused)
        return None

    def _served(self, r: StreamedTurn, session: str, entry: str, first: float, waited_s: float, refused: int) -> None:
        """Count a served turn, first sent at `first` (monotonic) to `entry`; `waited_s`: from its first attempt's
        send to the served attempt's, after `refused` refusals."""
        self._outcome(session, entry, first, served=r, waited_s=waited_s, refused=refused)
        st = self.stats
        st.ttft_with_retries_s.append(waited_s + r.ttft_s)
        st.status[str(r.status)] += 1
        st.handoffs[r.headers.get("x-kvmesh-handoff", "none")] += 1
        st.hosts[r.headers.get("x-kvmesh-host", "?")] += 1
        st.turns += 1
        st.ttft_s.append(r.ttft_s)
        st.latency_s.append(r.total_s)
        st.prompt_tokens += r.prompt_tokens
        st.recomputed_tokens += r.recomputed_tokens

    def _failed(self, session: str, entry: str, first: float, why: str, refused: int) -> None:
        """Count a turn that failed in its client's face: `why` is refused (its retries ran out), timeout, or error
        (already counted by `_error`)."""
        if why == "refused":
            self.stats.failed_refused += 1
        elif why == "timeout":
            self.stats.failed_timeout += 1
        self._outcome(session, entry, first, failed=why, refused=refused)

    def _outcome(self, session: str, entry: str, first: float, *, served: StreamedTurn | None = None,
                 waited_s: float = 0.0, refused: int = 0, failed: str = "") -> None:
        """One line of `turns`: the turn first sent at `first` (monotonic), served or `failed` (refused,
        timeout, error) after `refused` refusals; a served turn's line says where it ran and what it reused."""
        if self.turns is None:
            return
        line: dict[str, Any] = {"t": round(first - self._t0, 3), "session": session, "entry": entry, "refused": refused}
        if served is None:
            line["failed"] = failed
        else:
            h = served.headers
            line.update(host=h.get("x-kvmesh-host", "?"), handoff=h.get("x-kvmesh-handoff", "none"),
                        prompt_tokens=served.prompt_tokens, cached_tokens=served.cached_tokens,
                        ttft_s=round(served.ttft_s, 4), ttft_with_retries_s=round(waited_s + served.ttft_s, 4),
                        total_s=round(served.total_s, 4))
        self.turns.write(json.dumps(line) + "\n")

    def _error(self, session: str, message: str, status: int) -> None:
        st = self.stats
        st.errors += 1
        if status:
            st.status[str(status)] += 1
        if len(st.error_samples) < 20:
            st.error_samples.append(f"{session}: {message}")

    def _log(self, session: str, appended: list[dict[str, str]]) -> None:
        if self.record is not None:
            self.record.write(json.dumps({"session": session, "t": round(time.monotonic() - self._t0, 3),
                                          "messages": appended}) + "\n")
            self.record.flush()

    async def _agent(self, client: httpx.AsyncClient, slot: int) -> None:
        sh = self.shape
        rng = random.Random(sh.seed * 1_000_003 + slot)
        conv = 0
        while not self._stop.is_set():
            conv += 1
            self.stats.conversations += 1
            session = f"agent{slot:02d}-c{conv}"
            msgs = [{"role": "system", "content": system_prompt(rng, rng.randint(*sh.system_tokens))},
                    {"role": "user", "content": "Build the to-do app described in the spec. " + text(rng, 300)}]
            appended = list(msgs)
            size = sum(len(m["content"]) for m in msgs)
            while size < sh.target_tokens and not self._stop.is_set():
                self._log(session, appended)
                reply = await self.turn(client, session, msgs)
                if reply is None:
                    # The turn failed in the user's face: after a think the user asks again (same messages, a new turn).
                    await self._sleep(rng.uniform(*sh.think_s) * self.time_scale)
                    continue
                tool = text(rng, rng.randint(*sh.tool_tokens))
                appended = [{"role": "assistant", "content": reply}, {"role": "tool", "content": tool}]
                msgs += appended
                size += len(reply) + len(tool)
                await self._sleep(rng.uniform(*sh.think_s) * self.time_scale)

    async def _sleep(self, s: float) -> None:
        try:
            async with asyncio.timeout(s):  # not wait_for: see node.mesh.statestream
                await self._stop.wait()
        except TimeoutError:
            pass

    @asynccontextmanager
    async def _clients(self, connections: int) -> AsyncIterator[httpx.AsyncClient]:
        """The run's HTTP client, and with `sdk` the SDK's sender beside it (closed with it)."""
        # A mesh with client keys (kvmesh init writes one) wants it: KVMESH_API_KEY, as the node reads it.
        headers = client_key_headers()
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.client.timeout_s, connect=5), headers=headers,
                                     limits=httpx.Limits(max_connections=connections)) as client:
            if self.sdk == "anthropic":
                self._sender = AnthropicSender(self.client, headers, connections)
            try:
                yield client
            finally:
                if self._sender is not None:
                    await self._sender.aclose()
                    self._sender = None

    async def _ready(self, client: httpx.AsyncClient) -> None:
        """Learn the model, then start the run's clock: a schedule timed from before the clients were ready (an SDK's
        import takes seconds on a busy box) sends its first seconds' requests as one burst the trace never had."""
        if self.model is None:
            r = await client.get(f"{self.nodes[0]}/v1/models")
            self.model = r.json()["data"][0]["id"]
        self._t0 = time.monotonic()

    async def run(self, duration_s: float, *, until: Callable[[], Awaitable[bool]] | None = None,
                  max_s: float = 0.0) -> LoadStats:
        """Agents for `duration_s`, then, with `until`, on until it holds or `max_s` in all (checked every 5 s)."""
        async with self._clients(self.shape.sessions * 2 + 8) as client:
            await self._ready(client)
            agents = [asyncio.create_task(self._agent(client, i)) for i in range(self.shape.sessions)]
            await self._sleep(duration_s)
            while until is not None and time.monotonic() - self._t0 < max_s and not await until():
                await self._sleep(min(5.0, max_s - (time.monotonic() - self._t0)))
            self._stop.set()
            # Let turns in flight finish: a turn is never abandoned half-way.
            await asyncio.gather(*agents, return_exceptions=True)
        self.stats.elapsed_s = time.monotonic() - self._t0
        return self.stats

    async def replay(self, trace: Path) -> LoadStats:
        """Send the recorded turns at their recorded offsets (scaled by time_scale)."""
        lines = [json.loads(line) for line in trace.read_text().splitlines() if line.strip()]
        convs: dict[str, list[dict[str, str]]] = {}
        by_session: dict[str, list[dict[str, Any]]] = {}
        for rec in lines:
            by_session.setdefault(rec["session"], []).append(rec)
        async with self._clients(len(by_session) + 8) as client:
            await self._ready(client)

            async def one(session: str, recs: list[dict[str, Any]]) -> None:
                msgs = convs.setdefault(session, [])
                for rec in recs:
                    delay = rec["t"] * self.time_scale - (time.monotonic() - self._t0)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    msgs += rec["messages"]
                    await self.turn(client, session, msgs)

            await asyncio.gather(*(one(s, r) for s, r in by_session.items()))
        self.stats.elapsed_s = time.monotonic() - self._t0
        return self.stats

    async def replay_requests(self, requests: list[TraceRequest], *, block_chars: int = TRACE_BLOCK_TOKENS,
                              until_s: float | None = None, one_session_id: bool = False) -> LoadStats:
        """Send a Mooncake-format trace's requests (node.lab.workload.read_mooncake) as chat turns.

        Each prompt is one user message, `TracePrompts`' text (a conversation's prompt grows as a real
        client's history does, and equal block ids are equal text); max_tokens is the request's `output_length`, capped by the
        shape's max_tokens; the session id is its conversation's (a Claude Code trace's subagents get their
        own, as a client naming each conversation by `prompt_cache_key` does), or with `one_session_id` its
        session's (subagents under the parent's id, as Claude Code sends them: node.mesh.threads tells
        them apart), each one closed loop. A client sends its next request at its trace time
        (scaled by time_scale), never before its previous reply, and none after `until_s` (turns in flight
        finish)."""
        prompts = TracePrompts(block_chars)

        by_client: dict[str, list[TraceRequest]] = {}
        for r in requests:
            by_client.setdefault(r.client or r.session, []).append(r)
        async with self._clients(len(by_client) + 8) as client:
            await self._ready(client)

            async def one(reqs: list[TraceRequest]) -> None:
                for r in reqs:
                    delay = r.t * self.time_scale - (time.monotonic() - self._t0)
                    if delay > 0:
                        await self._sleep(delay)
                    if self._stop.is_set():
                        return
                    self.stats.conversations += r.turn == 0
                    await self.turn(client, r.session if one_session_id else r.thread,
                                    [{"role": "user", "content": prompts.prompt(r)}],
                                    max_tokens=max(1, min(r.output_length, self.shape.max_tokens)))

            async def stop_at(s: float) -> None:
                await asyncio.sleep(s)
                self._stop.set()

            stopper = asyncio.create_task(stop_at(until_s)) if until_s is not None else None
            await asyncio.gather(*(one(reqs) for reqs in by_client.values()))
            if stopper is not None:
                stopper.cancel()
        self.stats.elapsed_s = time.monotonic() - self._t0
        return self.stats
