"""OpenAI-compatible routes: chat completions (SSE and not) and models."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from node.api.schema import ChatCompletionRequest
from node.engine.engine import GenerateRequest, TextDelta, TurnDone, TurnStats
from node.errors import InvalidRequest, KVMeshError, ModelNotFound
from node.mesh.auth import PEER_HEADER, check_peer_token
from node.mesh.forward import PeerUnavailable, forward_turn
from node.node import Node, derive_session_id

log = logging.getLogger("kvmesh.api")

DEFAULT_MAX_TOKENS = 256


def _usage(stats: TurnStats) -> dict[str, Any]:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


FORWARDED, PREV_HOST, PREDICTED, TURN_SEQ = (
    "X-Kvmesh-Forwarded", "X-Kvmesh-Prev-Host", "X-Kvmesh-Predicted-Reuse", "X-Kvmesh-Turn-Seq")


async def _route(node: Node, session: str, prompt_tokens: int, raw_body: bytes,
                 stream: bool) -> Response | tuple[str | None, int | None, int]:
    """Place the turn. Forward it to a peer (and return the peer's response), or return
    (previous host, predicted reuse, turn sequence) to run it here. A peer that fails before answering
    is routed around: nothing the client sent is lost."""
    mesh = node.mesh
    if not mesh.known(session):
        await mesh.refresh(session)
    unavailable: set[str] = set()
    seq = mesh.next_seq(session)
    while True:
        d = mesh.decide(session, prompt_tokens, unavailable=frozenset(unavailable))
        if d is None or d.host == node.name:
            # No peer can take it (or this host is best): run here, even while draining.
            return (d.prev_host if d else mesh.last_host(session)), (d.predicted_reused if d else None), seq
        peer = mesh.peers.peers[d.host]
        headers = {"content-type": "application/json", "X-Session-Id": session, FORWARDED: "1",
                   PREDICTED: str(d.predicted_reused), TURN_SEQ: str(seq)}
        if d.prev_host:
            headers[PREV_HOST] = d.prev_host
        if mesh.peer_token:
            headers[PEER_HEADER] = mesh.peer_token
        peer.pending += 1
        try:
            resp = await forward_turn(mesh.peers.client, d.host, peer.cfg.api, raw_body, headers, stream=stream,
                                      timeout_s=node.cfg.mesh.forward_timeout_s)
        except PeerUnavailable as e:
            log.warning("turn of %s could not go to %s (%s); placing it again", session, d.host, e.reason)
            if not e.overloaded:
                mesh.peers.mark_down(d.host, e.reason)
            unavailable.add(d.host)
            continue
        finally:
            peer.pending -= 1
        mesh.routed[session] = (d.host, seq)
        return resp


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
    ) -> Response:
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
        hdrs = request.headers
        if hdrs.get(FORWARDED) and check_peer_token(hdrs.get(PEER_HEADER), node.mesh.secrets):
            prev_host = hdrs.get(PREV_HOST) or None
            predicted = int(hdrs[PREDICTED]) if hdrs.get(PREDICTED, "").isdigit() else None
            seq = int(hdrs[TURN_SEQ]) if hdrs.get(TURN_SEQ, "").isdigit() else node.mesh.next_seq(session)
        else:
            routed = await _route(node, session, len(prompt), await request.body(), body.stream)
            if isinstance(routed, Response):
                return routed
            prev_host, predicted, seq = routed
        run = await node.prepare_turn(greq, prev_host, predicted, messages, seq)
        node.mesh.routed[session] = (node.name, seq)
        events = run.stream()
        turn_headers = {"X-Kvmesh-Host": node.name, "X-Session-Id": session,
                        "X-Kvmesh-Handoff": run.handoff_class or "none",
                        "X-Kvmesh-Cached-Tokens": str(run.begin.cached_tokens if run.begin else 0)}
        cid = "chatcmpl-" + uuid.uuid4().hex[:24]
        created = int(time.time())
        model = node.engine.model_name
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
                headers=turn_headers,
            )
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
                ev: TextDelta | TurnDone | None = await anext(events, None)
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

        headers = dict(turn_headers)
        headers["Cache-Control"] = "no-cache"
        headers["X-Accel-Buffering"] = "no"
        return StreamingResponse(sse(), media_type="text/event-stream", headers=headers)

    return r
