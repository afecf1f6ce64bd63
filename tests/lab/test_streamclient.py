"""The lab's streamed-turn client: usage and cached tokens from kvmesh's and llama-server's shapes, failures."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from kvmesh.node.lab.streamclient import TurnFailed, stream_chat


def _sse(*objs: object, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(o)}\n\n" for o in objs] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


def _run(handler) -> object:  # type: ignore[no-untyped-def]
    """One stream_chat against an in-memory transport (the parsing is what is tested, not a server)."""
    async def go() -> object:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
            return await stream_chat(c, "http://x/v1/chat/completions", {"model": "m", "messages": []})
    return asyncio.run(go())


def test_usage_and_cached_tokens_from_prompt_tokens_details() -> None:
    """kvmesh's (and OpenAI's) shape: text joined, counts from the usage chunk, usage was asked for."""
    seen: dict[str, object] = {}

    def handler(req: httpx.Request) -> httpx.Response:
        seen.update(json.loads(req.content))
        return httpx.Response(200, content=_sse(
            {"choices": [{"delta": {"content": "he"}}]}, {"choices": [{"delta": {"content": "llo"}}]},
            {"choices": [], "usage": {"prompt_tokens": 100, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 64}}}))

    t = _run(handler)
    assert seen["stream"] is True and seen["stream_options"] == {"include_usage": True}
    assert t.text == "hello" and len(t.stamps) == 2 and t.prompt_tokens == 100  # type: ignore[attr-defined]
    assert t.cached_tokens == 64 and t.recomputed_tokens == 36  # type: ignore[attr-defined]


def test_cached_tokens_from_llama_server_timings() -> None:
    """llama-server's shape: no prompt_tokens_details, the reuse in timings.cache_n."""
    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse(
            {"choices": [{"delta": {"content": "x"}}]},
            {"choices": [], "usage": {"prompt_tokens": 50, "completion_tokens": 1}, "timings": {"cache_n": 40, "prompt_n": 10}}))

    t = _run(handler)
    assert t.cached_tokens == 40 and t.recomputed_tokens == 10  # type: ignore[attr-defined]


@pytest.mark.parametrize(("response", "needle"), [
    (httpx.Response(503, text="busy"), "HTTP 503"),
    (httpx.Response(200, content=_sse({"error": {"message": "engine failed"}})), "engine failed"),
    (httpx.Response(200, content=_sse({"choices": [{"delta": {"content": "x"}}]}, done=False)), "without [DONE]"),
])
def test_failures_raise_turn_failed(response: httpx.Response, needle: str) -> None:
    """A non-200, an error event and a stream cut before [DONE] each fail the turn, saying which."""
    with pytest.raises(TurnFailed, match=needle.replace("[", r"\[").replace("]", r"\]")) as e:
        _run(lambda req: response)
    assert e.value.status == (503 if "503" in needle else 0)
