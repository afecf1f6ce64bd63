"""Early overload refusal on a real node, in every dialect, through the official SDKs.

One node (a mesh of one), the sim engine with one slot and slow decode, a patient slot queue (so
any refusal here is the mesh's admission, not a full queue), `mesh.admit_new_wait_s` 0.5 s and
`mesh.admit_wait_s` 60 s: while a stream holds the slot a new session's first turn is refused at
once (OpenAI dialects: 429 + Retry-After; Anthropic's: 529 overloaded_error), and a turn of a
session the node already serves is queued and answered.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from kvmesh.node.config import EngineConfig, MeshConfig, NodeConfig, SimConfig
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread

SLOW = SimConfig(kv_scale=0.01, decode_tps=40, prefill_tps=1e6)  # the holder's ~110 tokens take seconds
HOLD = [{"role": "user", "content": "hold"}]


@pytest.fixture()
def node() -> Iterator[ThreadedServer]:
    """A one-slot sim node refusing new sessions past a 0.5 s expected wait."""
    cfg = NodeConfig(name="admit", engine=EngineConfig(kind="sim", slots=1, queue_max=8, queue_timeout_s=60.0,
                                                        cache_bytes=64 << 20, sim=SLOW, served_names=["claude-*"]),
                     mesh=MeshConfig(admit_wait_s=60.0, admit_new_wait_s=0.5))
    srv = serve_in_thread(cfg)
    try:
        yield srv
    finally:
        srv.stop()


@contextlib.contextmanager
def holding(srv: ThreadedServer) -> Iterator[Iterator[str]]:
    """A streamed turn that holds the only slot once its first chunk is read; yields its other lines."""
    body = {"model": srv.model, "messages": HOLD, "temperature": 0, "max_tokens": 400, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": "holder"}) as resp:
            assert resp.status_code == 200, resp.read()
            lines = resp.iter_lines()
            assert next(lines).startswith("data: {")
            assert c.get("/health").json()["busy"] == 1
            yield lines


def _openai(srv: ThreadedServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=60)


def _anthropic(srv: ThreadedServer, retries: int = 0) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=retries, timeout=60)


def _assert_overloaded(e: Any, status: int) -> None:
    assert e.status_code == status, e
    retry = e.response.headers.get("retry-after", "")
    assert retry.isdigit() and int(retry) >= 1, e.response.headers
    assert "overloaded" in e.message and "new session" in e.message, e.message


def test_a_new_session_is_refused_early_in_every_openai_dialect(node: ThreadedServer) -> None:
    """Chat completions, Responses and legacy completions: a new session gets RateLimitError (429, Retry-After)."""
    client = _openai(node)
    sid = {"X-Session-Id": "newcomer"}  # each dialect's its own: a refused session's bound grows with its wait
    with holding(node):
        with pytest.raises(openai.RateLimitError) as chat:
            client.chat.completions.create(model=node.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           extra_headers=sid)
        _assert_overloaded(chat.value, 429)
        assert chat.value.code == "overloaded"
        with pytest.raises(openai.RateLimitError) as resp:
            client.responses.create(model=node.model, input="hi", max_output_tokens=4,
                                    extra_headers={"X-Session-Id": "newcomer-2"})
        _assert_overloaded(resp.value, 429)
        with pytest.raises(openai.RateLimitError) as legacy:
            client.completions.create(model=node.model, prompt="hi", max_tokens=4,
                                      extra_headers={"X-Session-Id": "newcomer-3"})
        _assert_overloaded(legacy.value, 429)
    stats = httpx.get(node.url + "/v1/stats").json()["admission"]
    assert stats["enabled"] and stats["refused"].get("new", 0) >= 3, stats


def test_a_new_session_is_refused_with_anthropics_overloaded_error(node: ThreadedServer) -> None:
    """Messages (streamed or not): 529 overloaded_error with Retry-After, which the SDK raises as OverloadedError."""
    client = _anthropic(node)
    msgs: Any = [{"role": "user", "content": "hi"}]
    with holding(node):
        with pytest.raises(anthropic.OverloadedError) as ei:
            client.messages.create(model="claude-sonnet-4-5", max_tokens=4, messages=msgs,
                                   extra_headers={"X-Claude-Code-Session-Id": "cc-new"})
        _assert_overloaded(ei.value, 529)
        assert ei.value.body["error"]["type"] == "overloaded_error", ei.value.body  # type: ignore[index]
        with httpx.Client(base_url=node.url, timeout=60) as c:
            r = c.post("/v1/messages", json={"model": "claude-sonnet-4-5", "max_tokens": 4, "messages": msgs,
                                             "stream": True}, headers={"X-Claude-Code-Session-Id": "cc-new-2"})
        assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error", r.text


def test_a_running_session_is_queued_while_a_new_one_is_refused(node: ThreadedServer) -> None:
    """A session the node already served waits for the slot and is answered; a new one at that moment is refused."""
    client = _openai(node)
    msgs: Any = HOLD
    # A turn as long as the holder's, so the node's recent turn time predicts a wait past 0.5 s.
    first = client.chat.completions.create(model=node.model, messages=msgs, max_tokens=400, temperature=0,
                                           extra_headers={"X-Session-Id": "regular"})
    assert first.choices[0].message.content is not None
    with holding(node) as lines, concurrent.futures.ThreadPoolExecutor(1) as ex:
        again = ex.submit(client.chat.completions.create, model=node.model, max_tokens=2,
                          messages=[*msgs, {"role": "assistant", "content": first.choices[0].message.content},
                                    {"role": "user", "content": "y"}],
                          extra_headers={"X-Session-Id": "regular"})
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=node.model, messages=msgs, max_tokens=2,
                                           extra_headers={"X-Session-Id": "stranger"})
        for _ in lines:  # the holder runs to its end; then the queued turn gets the slot
            pass
        assert again.result(timeout=60).choices[0].message.content is not None


def test_a_subagents_first_turn_is_queued_as_its_running_sessions(node: ThreadedServer) -> None:
    """A new conversation under a session already served (a subagent's) waits like the session's own turns."""
    client = _anthropic(node)
    # A turn as long as the holder's, so the node's recent turn time predicts a wait past 0.5 s.
    first = client.messages.create(model="claude-sonnet-4-5", max_tokens=400, messages=HOLD,  # type: ignore[arg-type]
                                   extra_body={"temperature": 0}, extra_headers={"X-Claude-Code-Session-Id": "cc-parent"})
    assert first.usage.output_tokens >= 40, first.usage
    with holding(node) as lines, concurrent.futures.ThreadPoolExecutor(1) as ex:
        sub = ex.submit(client.messages.with_raw_response.create, model="claude-sonnet-4-5", max_tokens=2,
                        system="You are the Explore subagent.", messages=[{"role": "user", "content": "find it"}],
                        extra_headers={"X-Claude-Code-Session-Id": "cc-parent"})
        with pytest.raises(anthropic.OverloadedError) as refused:
            client.messages.create(model="claude-sonnet-4-5", max_tokens=2, messages=HOLD,  # type: ignore[arg-type]
                                   extra_headers={"X-Claude-Code-Session-Id": "cc-stranger"})
        assert refused.value.status_code == 529
        for _ in lines:
            pass
        raw = sub.result(timeout=60)
    assert raw.headers["x-session-id"].startswith("cc-parent#") and raw.parse().content


def test_the_anthropic_sdk_retries_after_retry_after_and_is_served(node: ThreadedServer) -> None:
    """With retries on (as Claude Code has them), a refused new session's turn is served once the slot frees."""
    client = _anthropic(node, retries=30)
    with holding(node) as lines, concurrent.futures.ThreadPoolExecutor(1) as ex:
        # Greedy: a sampled 4-token reply may end at once, with no text to check.
        later = ex.submit(client.messages.create, model="claude-sonnet-4-5", max_tokens=4,
                          messages=[{"role": "user", "content": "hi"}], extra_body={"temperature": 0},
                          extra_headers={"X-Claude-Code-Session-Id": "cc-patient"})
        for _ in lines:
            pass
        reply = later.result(timeout=120)
    assert reply.content and reply.usage.output_tokens >= 1
    assert httpx.get(node.url + "/v1/stats").json()["admission"]["refused"].get("new", 0) >= 1
