"""OpenAI-compatible routes: chat completions (SSE and not) and models.

The routes parse requests and format answers; where a turn runs, and how it gets
there, is node.mesh.turn's business (`Node.turns.serve`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvmesh.node.api.deps import NodeDep
from kvmesh.node.api.schema import ChatCompletionRequest
from kvmesh.node.engine.engine import GenerateRequest, TextDelta, TurnStats
from kvmesh.node.errors import InvalidRequest, KVMeshError, ModelNotFound
from kvmesh.node.mesh.forward import sse_error
from kvmesh.node.mesh.turn import HostTurn, PeerAnswer, PeerStream
from kvmesh.node.node import Node, derive_session_id
from kvmesh.node.protocol import session_header

DEFAULT_MAX_TOKENS = 256


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


async def _sse(run: HostTurn, cid: str, created: int, model: str, include_usage: bool) -> AsyncIterator[bytes]:
    """A turn running here, as OpenAI stream chunks."""
    ident = (cid, created, model)
    events = run.stream()
    yield _chunk(ident, {"role": "assistant", "content": ""})
    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                yield _chunk(ident, {"content": ev.text})
            else:
                yield _chunk(ident, {}, ev.stats.finish_reason)
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

    def render(run: HostTurn) -> AsyncIterator[bytes]:
        # A stream resumed on this host: the splice gives its chunks the first stream's id.
        return _sse(run, "chatcmpl-resumed", int(time.time()), model, include_usage)

    served = await node.turns.serve(greq, request.headers, await request.body(), stream=body.stream, render=render)
    if isinstance(served, PeerAnswer):
        return served.response
    if isinstance(served, PeerStream):
        return StreamingResponse(served.chunks, status_code=200, headers=served.headers)
    return await _answer(served, model, body.stream, include_usage)


def _generate_request(node: Node, body: ChatCompletionRequest, x_session_id: str | None) -> GenerateRequest:
    """The engine's request for this body; errors (unknown model, bad session id, too long) raised here."""
    if body.model != node.engine.model_name:
        raise ModelNotFound(f"model {body.model!r} is not served here; GET /v1/models lists {node.engine.model_name!r}")
    messages = body.messages_as_dicts()
    session = derive_session_id(x_session_id, body.user, messages)
    try:
        prompt = node.engine.tokenizer.apply_chat_template(messages)
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


async def _answer(run: HostTurn, model: str, stream: bool, include_usage: bool) -> Response:
    """A turn running here, as an SSE stream or one JSON completion."""
    turn_headers = {"X-Kvmesh-Host": run.path.name, "X-Session-Id": session_header(run.req.session),
                    "X-Kvmesh-Handoff": run.handoff_class or "none",
                    "X-Kvmesh-Cached-Tokens": str(run.begin.cached_tokens if run.begin else 0)}
    cid = "chatcmpl-" + uuid.uuid4().hex[:24]
    created = int(time.time())
    if stream:
        headers = turn_headers | {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(_sse(run, cid, created, model, include_usage), media_type="text/event-stream",
                                 headers=headers)
    text, stats = [], None
    async for ev in run.stream():
        if isinstance(ev, TextDelta):
            text.append(ev.text)
        else:
            stats = ev.stats
    assert stats is not None
    return JSONResponse(
        {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": "".join(text)},
                    "finish_reason": stats.finish_reason,
                    "logprobs": None,
                }
            ],
            "usage": _usage(stats),
        },
        headers=turn_headers,
    )
