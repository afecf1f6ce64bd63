"""OpenAI-compatible routes: chat completions (SSE and not) and models.

The route parses the request and renders the answer's events (node.api.chat_format); the turn's
path is node.api.serving's and the mesh's, the same wherever the turn runs. Chat is the mesh's
hop format, so a peer is sent the client's own body. Every OpenAI route is served with and
without the /v1 prefix, as llama.cpp does: clients configured either way work.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvmesh.node.api.answer import collect
from kvmesh.node.api.chat_format import chat_completion, chat_sse
from kvmesh.node.api.choices import several
from kvmesh.node.api.clientauth import ClientKey
from kvmesh.node.api.deps import NodeDep
from kvmesh.node.api.jsonbody import StrictJSONRoute
from kvmesh.node.api.schema import ChatCompletionRequest
from kvmesh.node.api.serving import open_answer, parser_factory, prompt_request, sse_response
from kvmesh.node.api.sessionid import Named, name_session
from kvmesh.node.api.structured import constrained

router = APIRouter(route_class=StrictJSONRoute)


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


async def chat_completions(body: ChatCompletionRequest, request: Request, node: NodeDep) -> Response:
    session = name_session(request.headers, Named(user=body.user), body.messages_as_dicts())
    greq = constrained(prompt_request(node, body, session), body)  # response_format, tool_choice
    if body.n > 1:
        return await several(node, body, greq, session, request.headers,
                             ("chatcmpl-" + uuid.uuid4().hex[:24], int(time.time()), body.model))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    raw = await request.body()  # a peer runs the client's own request
    answer = await open_answer(node, greq, session, request.headers, lambda: raw, stream=body.stream,
                               new_parser=parser_factory(body))
    ident = ("chatcmpl-" + uuid.uuid4().hex[:24], int(time.time()), body.model)
    if body.stream:
        return sse_response(chat_sse(answer.events, ident, include_usage, scored=greq.top_logprobs is not None),
                            answer.headers)
    events, fin = await collect(answer.events)
    return JSONResponse(chat_completion(ident, events, fin), headers=answer.headers)


for _path in _both("/v1/chat/completions"):
    router.add_api_route(_path, chat_completions, methods=["POST"], response_model=None, dependencies=[ClientKey])
