"""OpenAI-compatible routes: chat completions (SSE and not), models and health.

The route parses the request and formats the answer (node.api.chat_format); the turn's path is
node.api.serving's and the mesh's. Chat is the mesh's hop format, so a peer's answer comes back
to the client as it is (or spliced, when its host died mid-stream). Every OpenAI route is served
with and without the /v1 prefix, as llama.cpp does: clients configured either way work.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvmesh.node.api.answer import collect, local_events
from kvmesh.node.api.chat_format import chat_completion, chat_sse
from kvmesh.node.api.choices import several
from kvmesh.node.api.clientauth import ClientKey
from kvmesh.node.api.deps import NodeDep
from kvmesh.node.api.schema import ChatCompletionRequest
from kvmesh.node.api.serving import parser_factory, prompt_request, relayed, sse_response, turn_headers
from kvmesh.node.api.sessionid import Named, name_session
from kvmesh.node.api.structured import constrained
from kvmesh.node.mesh.turn import HostTurn

router = APIRouter()


def _both(path: str) -> list[str]:
    return [path, path.removeprefix("/v1")]


def models_list(node: NodeDep) -> dict[str, Any]:
    """The served model, and the other exact names it answers to (globs are not model ids)."""
    cfg = node.cfg.engine
    names = [cfg.served_model, *(n for n in cfg.served_names if not any(c in n for c in "*?["))]
    e = node.engine
    # kvmesh's own facts beside OpenAI's: whether sessions of this model move warm between hosts.
    facts = {"replicas": e.inexact_reason is None, "no_replicas_reason": e.inexact_reason,
             "max_context": e.max_context, "block_size": e.block_size,
             # a sliding-window model's cache: "full" (every position) or "window" (snapshots beside the blocks)
             "swa": e.swa}
    data = [{"id": n, "object": "model", "created": int(node.started), "owned_by": "kvmesh", "kvmesh": facts}
            for n in dict.fromkeys(names)]
    return {"object": "list", "data": data}


for _path in _both("/v1/models"):
    router.add_api_route(_path, models_list, methods=["GET"], dependencies=[ClientKey])


@router.get("/health")
async def health(node: NodeDep) -> dict[str, object]:
    return node.health()


@router.get("/ready", response_model=None)
async def ready(node: NodeDep) -> Response:
    """Readiness for load balancers and Kubernetes: 200 while this node takes clients, 503 once it
    drains or stops (SIGTERM), so traffic leaves before the node does. /health stays 200 (alive)."""
    ok = node.ready()
    return JSONResponse({"ready": ok, "status": node.health()["status"], "node": node.name}, status_code=200 if ok else 503)


async def chat_completions(body: ChatCompletionRequest, request: Request, node: NodeDep) -> Response:
    session = name_session(request.headers, Named(user=body.user), body.messages_as_dicts())
    greq = constrained(prompt_request(node, body, session), body)  # response_format, tool_choice
    if body.n > 1:
        return await several(node, body, greq, session, request.headers,
                             ("chatcmpl-" + uuid.uuid4().hex[:24], int(time.time()), body.model))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    new_parser = parser_factory(body)

    def render(run: HostTurn) -> AsyncIterator[bytes]:
        # A stream resumed on this host: the splice gives its chunks the first stream's id.
        return chat_sse(run, ("chatcmpl-resumed", int(time.time()), body.model), include_usage, new_parser)

    raw = await request.body()
    served = await node.turns.serve(greq, request.headers, lambda: raw, stream=body.stream, render=render,
                                    source=session.source, opening=session.opening)
    if not isinstance(served, HostTurn):
        return relayed(served)
    ident = ("chatcmpl-" + uuid.uuid4().hex[:24], int(time.time()), body.model)
    headers = turn_headers(served)
    if body.stream:
        return sse_response(chat_sse(served, ident, include_usage, new_parser), headers)
    events, fin = await collect(local_events(served, new_parser))
    return JSONResponse(chat_completion(ident, events, fin), headers=headers)


for _path in _both("/v1/chat/completions"):
    router.add_api_route(_path, chat_completions, methods=["POST"], response_model=None, dependencies=[ClientKey])
