"""Claude Code's subagents on a real mesh: concurrent conversations under one session id, through the
Anthropic SDK, each keeps its own cache, and the main conversation comes back warm after them."""

from __future__ import annotations

import concurrent.futures
import random
import uuid
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx

from kvmesh.node.lab.launcher import wait_for
from kvmesh.node.lab.workload import text

from .helpers import MODEL, Mesh


@dataclass
class Agent:
    """One conversation of a Claude Code session: its own system prompt and history, the session's id."""

    session: str
    system: str
    messages: list[dict[str, Any]] = field(default_factory=list)

    def turn(self, m: Mesh, entry: str, ask: str) -> tuple[str, int, int]:
        """(the key it ran under, prompt tokens, tokens reused) of one turn."""
        client = anthropic.Anthropic(base_url=m.api(entry), api_key="unused", max_retries=0, timeout=60)
        self.messages.append({"role": "user", "content": ask})
        raw = client.messages.with_raw_response.create(
            model=MODEL, max_tokens=16, system=self.system, messages=self.messages,  # type: ignore[arg-type]
            extra_headers={"X-Claude-Code-Session-Id": self.session})
        msg = raw.parse()
        self.messages.append({"role": "assistant", "content": "".join(b.text for b in msg.content if b.type == "text")})
        u = msg.usage
        cached = u.cache_read_input_tokens or 0
        return raw.headers["x-session-id"], u.input_tokens + cached, cached


def test_concurrent_subagents_under_one_session_each_keep_their_own_cache(shared_mesh: Mesh) -> None:
    """Three subagents at once under the main's session id run as three conversations (own keys, own caches,
    their next turns warm), the main's next turn reuses >= 90% of its prompt, and /v1/cluster groups all four."""
    m, rng = shared_mesh, random.Random(31)
    session = "cc-" + uuid.uuid4().hex[:10]
    main = Agent(session, "You are Claude Code. " + text(rng, 12000))
    key, _, _ = main.turn(m, "a", "Look at the failing test and fix it.")
    assert key == session  # the first conversation is the session itself
    subs = [Agent(session, f"You are the {kind} subagent. " + text(rng, 9000)) for kind in ("Explore", "Plan", "Review")]

    def run(sub: Agent) -> list[tuple[str, int, int]]:
        return [sub.turn(m, "a", f"task {i}: " + text(rng, 300)) for i in range(2)]

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(run, subs))
    keys = {r[0][0] for r in results}
    assert len(keys) == 3 and all(k.startswith(session + "#") for k in keys), keys
    for (k1, _, _), (k2, prompt, cached) in results:
        assert k1 == k2  # a conversation keeps its key turn after turn
        assert cached >= 0.9 * prompt, (k2, cached, prompt)  # and its own cache
    key, prompt, cached = main.turn(m, "a", "Now run the tests.")
    assert key == session
    assert cached >= 0.9 * prompt, (cached, prompt)
    infos = [s for s in httpx.get(m.api("a") + "/v1/cluster?scope=mesh", timeout=10).json()["sessions"]
             if s.get("group") == session]
    assert {s["session"] for s in infos} == keys | {session}


def test_every_entry_names_a_sessions_conversations_alike(shared_mesh: Mesh) -> None:
    """A subagent entering at another node than its main is still a conversation of its own there, and the main's
    next turn through a third node keeps the session's own key and its cache."""
    m, rng = shared_mesh, random.Random(32)
    session = "cc-" + uuid.uuid4().hex[:10]
    main = Agent(session, "You are Claude Code. " + text(rng, 12000))
    assert main.turn(m, "a", "Look at the failing test and fix it.")[0] == session
    sub = Agent(session, "You are the Explore subagent. " + text(rng, 9000))
    key, _, _ = sub.turn(m, "b", "find where the bug is")
    assert key.startswith(session + "#")
    key2, prompt, cached = main.turn(m, "c", "Now run the tests.")
    assert key2 == session
    assert cached >= 0.9 * prompt, (cached, prompt)


def test_a_one_message_client_keeps_its_rewritten_conversation_through_every_entry(shared_mesh: Mesh) -> None:
    """A client sending its whole history as one growing message, after a compaction keyed at entry a, goes on
    through b and c under the same key, its cache reused: an entry that never saw that conversation open
    matches the signature the mesh pushed, instead of taking each longer turn for a new conversation."""
    m, rng = shared_mesh, random.Random(33)
    session = "one-msg-" + uuid.uuid4().hex[:10]

    def turn(entry: str, prompt: str) -> tuple[str, int, int]:
        raw = m.client(entry).chat.completions.with_raw_response.create(
            model=MODEL, max_tokens=8, messages=[{"role": "user", "content": prompt}],
            extra_headers={"X-Session-Id": session})
        usage = raw.parse().usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return raw.headers["x-session-id"], usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0

    history = "You are an agent. " + text(rng, 6000)
    assert turn("a", history)[0] == session
    summary = "Summary of the work so far. " + text(rng, 6000)  # the history rewritten: another conversation
    key, _, _ = turn("a", summary)
    assert key.startswith(session + "#")
    # Its home's own record of it, which carries its signature: a replica landing on b lists it there sooner.
    wait_for(lambda: all((i := m.session_info(e, key)) and i["home"] for e in ("b", "c")),
             "b and c to hear its home's record of the rewritten conversation")
    for entry in ("b", "c", "a"):
        summary += " " + text(rng, 400)
        got, prompt, cached = turn(entry, summary)
        assert got == key, (entry, got, key)
        assert cached >= 0.9 * prompt, (entry, cached, prompt)
