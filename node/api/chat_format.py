"""OpenAI chat-completion answers: a turn's events as SSE chunks, or as one JSON completion.

Chat SSE is also the mesh's own hop format: a peer that runs a forwarded turn answers in it,
whatever dialect the client spoke at the entry, and the entry reads it back into answer events
(node.mesh.forward) and renders those in the client's dialect.
Tool calls come back as `message.tool_calls` (content null when there is no other text), or in a
stream as OpenAI tool-call deltas (the id, type and name first, then argument fragments), with
finish_reason "tool_calls" when the model stopped after calling. A stop string that ended the
answer is named in the choice's `stop_reason` (vLLM's extension; Anthropic's stop_sequence needs it).
Asked for (`logprobs`, `top_logprobs`), each content token's log probability is in `choice.logprobs`
(OpenAI's shape), streamed in the chunk of the text they score (a tool call's tokens: in one of their own).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from kvmesh.node.api.jsonbody import dumps
from kvmesh.node.api.toolevents import assemble
from kvmesh.node.engine.boundary import TokenLogprob
from kvmesh.node.mesh.answer import AnswerEvent, ContentDelta, Failed, Finish, Logprobs, ToolCallArgs, ToolCallStart, ToolEvent

Ident = tuple[str, int, str]  # the completion's id, created time and model, on every chunk


def sse_error(message: str, type_: str, code: str | None) -> bytes:
    """An OpenAI-style in-band error event: how a stream that already began reports a failure."""
    return b"data: " + dumps({"error": {"message": message, "type": type_, "code": code}}) + b"\n\n"


def usage(fin: Finish) -> dict[str, Any]:
    return {
        "prompt_tokens": fin.prompt_tokens,
        "completion_tokens": fin.completion_tokens,
        "total_tokens": fin.prompt_tokens + fin.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": fin.cached_tokens},
    }


def logprobs_content(entries: tuple[TokenLogprob, ...]) -> list[dict[str, Any]]:
    """OpenAI's choice.logprobs.content: token text, log probability, UTF-8 bytes, and the top alternatives."""
    def one(tok: bytes, lp: float) -> dict[str, Any]:
        return {"token": tok.decode("utf-8", "replace"), "logprob": lp, "bytes": list(tok)}
    return [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries]


def _chunk(ident: Ident, delta: dict[str, Any], finish: Finish | None = None,
           with_usage: dict[str, Any] | None = None, logprobs: Logprobs | None = None, index: int = 0) -> bytes:
    cid, created, model = ident
    choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish.finish_reason if finish else None,
                              "logprobs": None if logprobs is None else {"content": logprobs_content(logprobs.entries),
                                                                         "refusal": None}}
    if finish is not None and finish.stop_sequence is not None:
        choice["stop_reason"] = finish.stop_sequence
    obj: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "choices": [choice] if with_usage is None else []}
    if with_usage is not None:
        obj["usage"] = with_usage
    return b"data: " + dumps(obj) + b"\n\n"


def _delta(ev: ToolEvent) -> dict[str, Any] | None:
    """A parser event as an OpenAI stream delta (a call's end says nothing by itself)."""
    if isinstance(ev, ContentDelta):
        return {"content": ev.text}
    if isinstance(ev, ToolCallStart):
        return {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                "function": {"name": ev.name, "arguments": ""}}]}
    if isinstance(ev, ToolCallArgs):
        return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.text}}]}
    return None


async def chat_sse(events: AsyncIterator[AnswerEvent], ident: Ident, include_usage: bool, *,
                   scored: bool) -> AsyncIterator[bytes]:
    """An answer as OpenAI stream chunks ending in [DONE] (an error after the first byte goes in-band)."""
    fins: list[Finish] = []
    async for chunk in choice_chunks(events, ident, 0, fins, scored=scored):
        yield chunk
    if include_usage and fins:
        yield usage_chunk(ident, fins[0])
    yield b"data: [DONE]\n\n"


async def choice_chunks(events: AsyncIterator[AnswerEvent], ident: Ident, index: int,
                        fins: list[Finish], *, scored: bool = False) -> AsyncIterator[bytes]:
    """One choice's answer events as stream chunks (its Finish appended to `fins`); no usage, no [DONE].
    `scored` (log probabilities asked for): a content delta waits for those that follow it, to go in one chunk."""
    yield _chunk(ident, {"role": "assistant", "content": ""}, index=index)
    pending: dict[str, Any] | None = None
    async for ev in events:
        if isinstance(ev, Logprobs):
            yield _chunk(ident, pending or {}, logprobs=ev, index=index)
            pending = None
            continue
        if pending is not None:
            yield _chunk(ident, pending, index=index)
            pending = None
        if isinstance(ev, Finish):
            fins.append(ev)
            yield _chunk(ident, {}, ev, index=index)
        elif isinstance(ev, ContentDelta) and scored:
            pending = _delta(ev)
        elif isinstance(ev, ContentDelta):
            yield _chunk(ident, {"content": ev.text}, index=index)
        elif isinstance(ev, (ToolCallStart, ToolCallArgs)):
            if (delta := _delta(ev)) is not None:
                yield _chunk(ident, delta, index=index)
        elif isinstance(ev, Failed):
            yield sse_error(ev.message, ev.type, ev.code)
    if pending is not None:
        yield _chunk(ident, pending, index=index)


def usage_chunk(ident: Ident, fin: Finish) -> bytes:
    """stream_options.include_usage's last chunk: no choices, the usage."""
    return _chunk(ident, {}, with_usage=usage(fin))


def chat_completion(ident: Ident, events: list[ToolEvent], fin: Finish) -> dict[str, Any]:
    """A whole answer as one chat.completion object."""
    cid, created, model = ident
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [chat_choice(events, fin, 0)], "usage": usage(fin)}


def chat_choice(events: list[ToolEvent], fin: Finish, index: int) -> dict[str, Any]:
    """One choice of a whole answer."""
    reply = assemble(events)
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.calls:
        message = {"role": "assistant", "content": reply.content or None, "tool_calls": [c.openai() for c in reply.calls]}
    choice: dict[str, Any] = {"index": index, "message": message, "finish_reason": fin.finish_reason,
                              "logprobs": {"content": logprobs_content(fin.logprobs), "refusal": None} if fin.logprobs else None}
    if fin.stop_sequence is not None:
        choice["stop_reason"] = fin.stop_sequence
    return choice
