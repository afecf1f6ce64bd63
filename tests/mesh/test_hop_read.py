"""The hop's answer read into answer events (node/mesh/forward.py), and rendered again as the client sees it:
each dialect's bytes from a peer's answer are those it would render for a turn run at the entry."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from kvmesh.node.api.answer import collect
from kvmesh.node.api.chat_format import chat_completion, chat_sse
from kvmesh.node.api.completions_routes import _sse as legacy_sse
from kvmesh.node.engine.boundary import TokenLogprob
from kvmesh.node.mesh.answer import (
    AnswerEvent,
    ContentDelta,
    Failed,
    Finish,
    Logprobs,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    listed,
)
from kvmesh.node.mesh.forward import HopChunks, whole_events

IDENT = ("chatcmpl-x", 7, "m")
LP = Logprobs((TokenLogprob(b"Hi", -0.25, ((b"Hi", -0.25), (b"\xe2\x82", -3.0))),))
FIN = Finish("tool_calls", 12, 4, 9, None)


def answer() -> list[AnswerEvent]:
    return [ContentDelta("Hi"), LP, ContentDelta(""), LP, ContentDelta(" there"), ToolCallStart(0, "call_A", "f"),
            ToolCallArgs(0, '{"a"'), ToolCallArgs(0, ": 1}"), ToolCallEnd(0), ToolCallStart(1, "call_B", "g"),
            ToolCallArgs(1, "{}"), ToolCallEnd(1), FIN]


def joined(chunks: AsyncIterator[bytes]) -> bytes:
    async def go() -> bytes:
        return b"".join([c async for c in chunks])
    return asyncio.run(go())


def collected(events: list[AnswerEvent]) -> tuple[list, Finish]:  # type: ignore[type-arg]
    return asyncio.run(collect(listed(events)))


def read(raw: bytes, step: int = 7) -> list[AnswerEvent]:
    hop = HopChunks()
    return [e for i in range(0, len(raw), step) for e in hop.feed(raw[i:i + step])] + hop.end()


def test_a_peers_chat_stream_renders_to_the_same_bytes() -> None:
    """A chat stream read back into events and rendered again is byte for byte what the peer sent, scored or not."""
    for scored in (True, False):
        for usage in (True, False):
            sent = joined(chat_sse(listed(answer()), IDENT, usage, scored=scored))
            again = joined(chat_sse(listed(read(sent)), IDENT, usage, scored=scored))
            assert again == sent


def test_a_peers_legacy_stream_renders_to_the_same_bytes() -> None:
    """A legacy completions stream (text with its log probabilities) read back and rendered again is what was sent."""
    events = [ContentDelta("Hi"), LP, LP, ContentDelta(" there"), ContentDelta(""), Finish("length", 3, 1, 4)]
    for usage in (True, False):
        sent = joined(legacy_sse(listed(events), ("cmpl-x", 7, "m"), usage))
        again = joined(legacy_sse(listed(read(sent)), ("cmpl-x", 7, "m"), usage))
        assert again == sent


def test_a_peers_whole_chat_answer_renders_to_the_same_object() -> None:
    """A whole chat.completion (tool calls, log probabilities) read back and collected renders the same object."""
    events, fin = collected(answer())
    sent = chat_completion(IDENT, events, fin)
    events2, fin2 = collected(whole_events(200, json.dumps(sent).encode()))
    assert chat_completion(IDENT, events2, fin2) == sent


def test_an_in_band_error_and_a_lost_trailer() -> None:
    """An in-band error is Failed; a stream cut after its finish_reason is whole; one cut before it is Failed."""
    err = b'data: {"error": {"message": "boom", "type": "server_error", "code": "peer_lost"}}\n\n'
    assert read(err) == [Failed("boom", "server_error", "peer_lost")]
    hop = HopChunks()
    hop.feed(b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n')
    assert hop.finished and hop.end() == [Finish("stop")]
    assert read(b'data: {"choices":[{"index":0,"delta":{"content":"x"},"finish_reason":null}]}\n\n')[-1].code == "peer_lost"  # type: ignore[union-attr]


ENTRY = {"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": [{"token": "Hi", "logprob": -0.25,
                                                                                  "bytes": [72, 105]}]}


def test_a_peers_chat_answer_brings_its_logprobs_back() -> None:
    """A peer's streamed chunk and whole completion with choice.logprobs become Logprobs events after their text."""
    chunk = (b'data: {"choices":[{"index":0,"delta":{"content":"Hi"},"logprobs":{"content":[' +
             str(ENTRY).replace("'", '"').encode() + b']},"finish_reason":null}]}\n\n')
    evs = HopChunks().feed(chunk)
    assert isinstance(evs[-1], Logprobs) and evs[-1].entries[0].token == b"Hi" and evs[-1].entries[0].logprob == -0.25
    whole = whole_events(200, json.dumps({"choices": [{"message": {"content": "Hi"}, "finish_reason": "stop",
                                                       "logprobs": {"content": [ENTRY]}}]}).encode())
    assert isinstance(whole[1], Logprobs) and whole[1].entries[0].top == ((b"Hi", -0.25),)
    broken = whole_events(200, json.dumps({"choices": [{"message": {"content": "Hi"},
                                                        "logprobs": {"content": [{"x": 1}]}}]}).encode())
    assert not any(isinstance(e, Logprobs) for e in broken)  # a malformed peer answer loses them, never the turn
