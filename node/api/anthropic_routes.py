"""Anthropic Messages: `POST /v1/messages` and `POST /v1/messages/count_tokens` (what Claude Code speaks).

The request becomes the internal one (node.api.anthropic_schema), runs on the one turn path
(node.api.serving) and its answer events are rendered here: one `message` object, or Anthropic's
event stream (message_start, ping, content_block_start / _delta / _stop per text or tool_use
block, message_delta with the stop reason and usage, message_stop; an `error` event if the turn
breaks off). Usage follows llama.cpp's reading of Anthropic's: `input_tokens` are the prompt
tokens computed this turn, `cache_read_input_tokens` the reused prefix, and
`cache_creation_input_tokens` 0 (writing the cache costs nothing extra here).
`anthropic-version` and `anthropic-beta` headers are tolerated, whatever they say.
"""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvmesh.node.api.answer import collect, rendered
from kvmesh.node.api.anthropic_schema import CountTokensRequest, MessagesRequest
from kvmesh.node.api.clientauth import ClientKey
from kvmesh.node.api.deps import NodeDep
from kvmesh.node.api.errors import anthropic_error
from kvmesh.node.api.jsonbody import StrictJSONRoute, dumps
from kvmesh.node.api.serving import chat_hop, chat_prompt, open_answer, parser_factory, prompt_request, sse_response
from kvmesh.node.api.sessionid import Named, name_session
from kvmesh.node.api.structured import constrained
from kvmesh.node.api.toolevents import assemble
from kvmesh.node.mesh.answer import AnswerEvent, ContentDelta, Failed, Finish, ToolCallArgs, ToolCallEnd, ToolCallStart, ToolEvent

router = APIRouter(route_class=StrictJSONRoute)


def stop_reason(fin: Finish) -> str:
    if fin.finish_reason == "tool_calls":
        return "tool_use"
    if fin.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if fin.stop_sequence is not None else "end_turn"


def _usage(prompt: int, cached: int, output: int) -> dict[str, int]:
    return {"input_tokens": max(0, prompt - cached), "output_tokens": output,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _finite(text: str) -> float | str:
    """A JSON number as a float, or as its text where a double cannot hold it (1e999 is valid JSON, not a float)."""
    f = float(text)
    return f if math.isfinite(f) else text


def _message(mid: str, model: str, events: list[ToolEvent], fin: Finish) -> dict[str, Any]:
    reply = assemble(events)
    content: list[dict[str, Any]] = [{"type": "text", "text": reply.content}] if reply.content else []
    for c in reply.calls:
        try:
            # A model may write NaN or 1e999 in its arguments: kept as their text, so the answer stays JSON.
            args = json.loads(c.arguments or "{}", parse_float=_finite, parse_constant=str)
        except ValueError:
            args = {}
        content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": args})
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(fin), "stop_sequence": fin.stop_sequence,
            "usage": _usage(fin.prompt_tokens, fin.cached_tokens, fin.completion_tokens)}


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: ".encode() + dumps({"type": kind, **data}) + b"\n\n"


class StreamRenderer:
    """Answer events in, Anthropic stream events out (sans-I/O): text and tool_use blocks in order,
    each opened before its deltas and closed before the next opens."""

    def __init__(self, mid: str, model: str, prompt: int, cached: int) -> None:
        self.mid, self.model, self.prompt, self.cached = mid, model, prompt, cached
        self.index = -1
        self.open: str | None = None  # "text" | "tool_use"

    def start(self) -> list[bytes]:
        msg: dict[str, Any] = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": _usage(self.prompt, self.cached, 0)}
        return [_event("message_start", {"message": msg}), _event("ping", {})]

    def feed(self, ev: AnswerEvent) -> list[bytes]:
        if isinstance(ev, ContentDelta):
            out = self._open("text", {"type": "text", "text": ""}) if self.open != "text" else []
            return out + [_event("content_block_delta", {"index": self.index,
                                                         "delta": {"type": "text_delta", "text": ev.text}})]
        if isinstance(ev, ToolCallStart):
            return self._open("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
        if isinstance(ev, ToolCallArgs):
            return [_event("content_block_delta", {"index": self.index,
                                                   "delta": {"type": "input_json_delta", "partial_json": ev.text}})]
        if isinstance(ev, ToolCallEnd):
            return self._close()
        if isinstance(ev, Finish):
            usage = _usage(ev.prompt_tokens or self.prompt, ev.cached_tokens or self.cached, ev.completion_tokens)
            return [*self._close(), _event("message_delta", {"delta": {"stop_reason": stop_reason(ev),
                                                                       "stop_sequence": ev.stop_sequence},
                                                             "usage": usage}), _event("message_stop", {})]
        assert isinstance(ev, Failed)
        err = anthropic_error(ev.status, ev.message)
        return [*self._close(), _event("error", {"error": err["error"]})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = kind
        return out + [_event("content_block_start", {"index": self.index, "content_block": block})]

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event("content_block_stop", {"index": self.index})]


@router.post("/v1/messages", response_model=None, dependencies=[ClientKey])
async def messages(body: MessagesRequest, request: Request, node: NodeDep) -> Response:
    chat = body.chat()
    named = Named(metadata_user_id=body.metadata.user_id if body.metadata else None)
    session = name_session(request.headers, named, chat.messages_as_dicts())
    greq = constrained(prompt_request(node, chat, session), chat)  # response_format, tool_choice
    opened = await open_answer(node, greq, session, request.headers, chat_hop(node, chat, body.stream),
                               stream=body.stream, new_parser=parser_factory(chat))
    headers = dict(opened.headers)
    if body.thinking is not None and body.thinking.type != "disabled":
        headers["X-Kvmesh-Ignored"] = "thinking"
    mid = "msg_" + uuid.uuid4().hex[:24]
    if body.stream:
        r = StreamRenderer(mid, body.model, opened.prompt_tokens, opened.cached_tokens)
        return sse_response(rendered(r.start(), r.feed, opened.events), headers)
    events, fin = await collect(opened.events)
    return JSONResponse(_message(mid, body.model, events, fin), headers=headers)


@router.post("/v1/messages/count_tokens", dependencies=[ClientKey])
async def count_tokens(body: CountTokensRequest, node: NodeDep) -> dict[str, int]:
    """The prompt's tokens as this node's template renders it (what /v1/messages would prefill)."""
    return {"input_tokens": len(chat_prompt(node, body.to_chat()))}
