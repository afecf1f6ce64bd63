"""OpenAI-compatible routes: chat completions (SSE and not) and models.

The routes parse requests and format answers; where a turn runs, and how it gets
there, is node.mesh.turn's business (`Node.turns.serve`). With `tools` (and tool_choice
not "none"), the reply's text goes through api.toolcalls' parser: tool calls come back as
`message.tool_calls` (content null when there is no other text), or in a stream as OpenAI
tool-call deltas (the id, type and name first, then argument fragments), with
finish_reason "tool_calls" when the model stopped after calling.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvmesh.node.api.deps import NodeDep
from kvmesh.node.api.schema import ChatCompletionRequest
from kvmesh.node.api.toolcalls import ToolCallParser
from kvmesh.node.api.toolevents import (
    ContentDelta,
    ToolCallArgs,
    ToolCallStart,
    ToolEvent,
    assemble,
)
from kvmesh.node.engine.chat import tools_for_prompt
from kvmesh.node.engine.engine import GenerateRequest, TextDelta, TurnStats
from kvmesh.node.errors import InvalidRequest, KVMeshError, ModelNotFound
from kvmesh.node.mesh.forward import sse_error
from kvmesh.node.mesh.turn import HostTurn, PeerAnswer, PeerStream
from kvmesh.node.node import Node, derive_session_id
from kvmesh.node.protocol import session_header

DEFAULT_MAX_TOKENS = 256

# Makes a fresh tool-call parser for one answer; None when the request has no tools to call.
ParserFactory = Callable[[], ToolCallParser | None]


def _usage(stats: TurnStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def _chunk(ident: tuple[str, int, str], delta: dict[str, Any], finish: str | None = None,
           usage: dict[str, Any] | None = None) -> bytes:
    cid, created, model = ident
    obj: dict[str, Any] = {
        "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}] if usage is None else [],
    }
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


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


def _finish_reason(stats: TurnStats, calls: int) -> str:
    """"tool_calls" when the model stopped after calling (a cut-off answer stays "length", as OpenAI's)."""
    return "tool_calls" if calls and stats.finish_reason == "stop" else stats.finish_reason


async def _sse(run: HostTurn, cid: str, created: int, model: str, include_usage: bool,
               new_parser: ParserFactory) -> AsyncIterator[bytes]:
    """A turn running here, as OpenAI stream chunks."""
    ident = (cid, created, model)
    events = run.stream()
    parser = new_parser()
    yield _chunk(ident, {"role": "assistant", "content": ""})
    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                for te in parser.feed(ev.text) if parser is not None else [ContentDelta(ev.text)]:
                    if (delta := _delta(te)) is not None:
                        yield _chunk(ident, delta)
                continue
            for te in parser.finish() if parser is not None else []:
                if (delta := _delta(te)) is not None:
                    yield _chunk(ident, delta)
            yield _chunk(ident, {}, _finish_reason(ev.stats, parser.calls if parser is not None else 0))
            if include_usage:
                yield _chunk(ident, {}, usage=_usage(ev.stats))
    except KVMeshError as e:
        yield sse_error(str(e), e.type, e.code)
    finally:
        await events.aclose()
    yield b"data: [DONE]\n\n"


router = APIRouter()


@router.get("/v1/models")
async def models(node: NodeDep) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [{"id": node.engine.model_name, "object": "model", "created": int(node.started), "owned_by": "kvmesh"}],
    }


@router.get("/health")
async def health(node: NodeDep) -> dict[str, object]:
    return node.health()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request, node: NodeDep,
                           x_session_id: Annotated[str | None, Header()] = None) -> Response:
    greq = _generate_request(node, body, x_session_id)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    model = node.engine.model_name
    new_parser = _parser_factory(body)

    def render(run: HostTurn) -> AsyncIterator[bytes]:
        # A stream resumed on this host: the splice gives its chunks the first stream's id.
        return _sse(run, "chatcmpl-resumed", int(time.time()), model, include_usage, new_parser)

    served = await node.turns.serve(greq, request.headers, await request.body(), stream=body.stream, render=render)
    if isinstance(served, PeerAnswer):
        return served.response
    if isinstance(served, PeerStream):
        return StreamingResponse(served.chunks, status_code=200, headers=served.headers)
    return await _answer(served, model, body.stream, include_usage, new_parser)


def _parser_factory(body: ChatCompletionRequest) -> ParserFactory:
    """Tool calls are looked for in the reply only where the prompt showed tools (not with tool_choice "none")."""
    shown = tools_for_prompt(body.tools_as_dicts(), body.tool_choice_value())
    names = tuple(t["function"]["name"] for t in shown)
    if not names:
        return lambda: None
    return lambda: ToolCallParser(names, parallel=body.parallel_tool_calls)


def _generate_request(node: Node, body: ChatCompletionRequest, x_session_id: str | None) -> GenerateRequest:
    """The engine's request for this body; errors (unknown model, bad session id, too long) raised here."""
    if body.model != node.engine.model_name:
        raise ModelNotFound(f"model {body.model!r} is not served here; GET /v1/models lists {node.engine.model_name!r}")
    body.check_tools()
    messages = body.messages_as_dicts()
    session = derive_session_id(x_session_id, body.user, messages)
    try:
        prompt = node.engine.tokenizer.apply_chat_template(messages, tools=body.tools_as_dicts(),
                                                           tool_choice=body.tool_choice_value(),
                                                           parallel_tool_calls=body.parallel_tool_calls)
    except UnicodeEncodeError:
        raise InvalidRequest("message content is not valid Unicode (an unpaired surrogate?)", param="messages") from None
    greq = GenerateRequest(
        session=session,
        prompt=prompt,
        max_tokens=body.token_budget(DEFAULT_MAX_TOKENS),
        temperature=body.temperature,
        top_p=body.top_p,
        seed=body.seed,
        stop=body.stop_list(),
    )
    node.engine.validate(greq)
    return greq


async def _answer(run: HostTurn, model: str, stream: bool, include_usage: bool, new_parser: ParserFactory) -> Response:
    """A turn running here, as an SSE stream or one JSON completion."""
    turn_headers = {"X-Kvmesh-Host": run.path.name, "X-Session-Id": session_header(run.req.session),
                    "X-Kvmesh-Handoff": run.handoff_class or "none",
                    "X-Kvmesh-Cached-Tokens": str(run.begin.cached_tokens if run.begin else 0)}
    cid = "chatcmpl-" + uuid.uuid4().hex[:24]
    created = int(time.time())
    if stream:
        headers = turn_headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(_sse(run, cid, created, model, include_usage, new_parser),
                                 media_type="text/event-stream", headers=headers)
    text, stats = [], None
    async for ev in run.stream():
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        else:
            stats = ev.stats
    assert stats is not None
    message, finish = _message("".join(text), stats, new_parser())
    return JSONResponse(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": _usage(stats),
        },
        headers=turn_headers,
    )


def _message(text: str, stats: TurnStats, parser: ToolCallParser | None) -> tuple[dict[str, Any], str]:
    """The assistant message of a whole answer and its finish reason."""
    if parser is None:
        return {"role": "assistant", "content": text}, stats.finish_reason
    reply = assemble([*parser.feed(text), *parser.finish()])
    if not reply.calls:
        return {"role": "assistant", "content": reply.content}, stats.finish_reason
    message = {"role": "assistant", "content": reply.content or None, "tool_calls": [c.openai() for c in reply.calls]}
    return message, _finish_reason(stats, len(reply.calls))
