"""OpenAI-compatible routes: chat completions (SSE and not) and models."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from node.api.schema import ChatCompletionRequest
from node.engine.engine import GenerateRequest, TextDelta, TurnDone, TurnStats
from node.errors import KVMeshError, ModelNotFound
from node.node import Node, derive_session_id

DEFAULT_MAX_TOKENS = 256


def _usage(stats: TurnStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def _turn_headers(node: Node, session: str, stats: TurnStats | None) -> dict[str, str]:
    h = {"X-Kvmesh-Host": node.name, "X-Session-Id": session}
    if stats is not None:
        h["X-Kvmesh-Cached-Tokens"] = str(stats.cached_tokens)
    return h


def router(node: Node) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [{"id": node.engine.model_name, "object": "model", "created": int(node.started), "owned_by": "kvmesh"}],
        }

    @r.get("/health")
    async def health() -> dict[str, object]:
        return node.health()

    @r.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        body: ChatCompletionRequest,
        request: Request,
        x_session_id: str | None = Header(None),
    ) -> JSONResponse | StreamingResponse:
        if body.model != node.engine.model_name:
            raise ModelNotFound(f"model {body.model!r} is not served here; GET /v1/models lists {node.engine.model_name!r}")
        messages = body.messages_as_dicts()
        session = derive_session_id(x_session_id, body.user, messages)
        prompt = node.engine.tokenizer.apply_chat_template(messages)
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
        cid = "chatcmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = node.engine.model_name
        events = node.engine.generate(greq)
        if not body.stream:
            text, stats = [], None
            async for ev in events:
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
                headers=_turn_headers(node, session, stats),
            )
        # Wait for the first event before answering, so a full queue is still a 429
        # and not an error in the middle of a 200 stream.
        first = await anext(events)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(delta: dict[str, Any], finish: str | None = None, usage: dict[str, Any] | None = None) -> bytes:
            obj: dict[str, Any] = {
                "id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}] if usage is None else [],
            }
            if usage is not None:
                obj["usage"] = usage
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

        async def sse() -> AsyncIterator[bytes]:
            yield chunk({"role": "assistant", "content": ""})
            try:
                ev: TextDelta | TurnDone | None = first
                while ev is not None:
                    if isinstance(ev, TextDelta):
                        yield chunk({"content": ev.text})
                    else:
                        yield chunk({}, ev.stats.finish_reason)
                        if include_usage:
                            yield chunk({}, usage=_usage(ev.stats))
                    ev = await anext(events, None)
            except KVMeshError as e:
                err = {"error": {"message": str(e), "type": e.type, "code": e.code}}
                yield b"data: " + json.dumps(err).encode() + b"\n\n"
            finally:
                await events.aclose()
            yield b"data: [DONE]\n\n"

        headers = _turn_headers(node, session, None)
        headers["Cache-Control"] = "no-cache"
        headers["X-Accel-Buffering"] = "no"
        return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)

    return r
