"""OpenAI Responses: `POST /v1/responses` (and `/responses`), what Codex CLI and the OpenAI Agents SDK speak.

The request becomes the internal one (node.api.responses_schema), runs on the one turn path
(node.api.serving), and its answer events are rendered here: one `response` object, or the
Responses event stream: response.created, response.in_progress, then per output item
output_item.added, (content_part.added, output_text.delta..., output_text.done,
content_part.done) or (function_call_arguments.delta..., .done), output_item.done; and at the
end response.completed (response.incomplete when max_output_tokens cut it, response.failed
when the turn broke off). Usage has input_tokens_details.cached_tokens: the reused prefix.
With `include: ["message.output_text.logprobs"]`, a text delta waits for its tokens' log
probabilities (they come right after it) and carries them; the part gathers them all.

Stored responses (node.api.responses_stored, node.responses): with `store: true` (the default) the answer is
kept with its conversation before the client sees its end (the whole object, or the stream's last event),
so a follow-up sent the moment it arrives finds it. A `previous_response_id` turn runs the stored conversation
then its own input, in the chain's session and conversation: placement sends it where that cache is, warm,
from any entry. Its id names its conversation (node.responses.ids).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from kvmesh.node.api.answer import collect
from kvmesh.node.api.chat_format import logprobs_content
from kvmesh.node.api.clientauth import ClientKey
from kvmesh.node.api.deps import NodeDep
from kvmesh.node.api.jsonbody import StrictJSONRoute, dumps
from kvmesh.node.api.responses_schema import ResponsesRequest
from kvmesh.node.api.responses_stored import caller_scope, continued, kept_record
from kvmesh.node.api.responses_stored import router as stored_router
from kvmesh.node.api.serving import chat_hop, open_answer, parser_factory, prompt_request, sse_response
from kvmesh.node.api.sessionid import Named, SessionName, name_session, opening_of
from kvmesh.node.api.structured import constrained
from kvmesh.node.mesh.answer import AnswerEvent, ContentDelta, Failed, Finish, Logprobs, ToolCallArgs, ToolCallEnd, ToolCallStart
from kvmesh.node.responses.ids import new_id

router = APIRouter(route_class=StrictJSONRoute)
log = logging.getLogger("kvmesh.api.responses")


def _id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class ResponseBuilder:
    """Answer events in, Responses stream events out (sans-I/O); `response()` is the object so far."""

    def __init__(self, body: ResponsesRequest, rid: str | None = None) -> None:
        self.body = body
        self.rid, self.created = rid or _id("resp_"), int(time.time())
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.seq = 0
        self.status = "in_progress"
        self.usage: dict[str, Any] | None = None
        self.incomplete: dict[str, str] | None = None
        self.error: dict[str, str] | None = None
        self._pending: str | None = None  # text out of the parser whose log probabilities are still to come

    def response(self) -> dict[str, Any]:
        b = self.body
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": self.status,
                "model": b.model, "output": self.output, "usage": self.usage, "error": self.error,
                "incomplete_details": self.incomplete, "instructions": b.instructions,
                "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
                "tool_choice": b.tool_choice or "auto", "parallel_tool_calls": b.parallel_tool_calls,
                "temperature": b.temperature, "top_p": b.top_p, "max_output_tokens": b.max_output_tokens,
                "previous_response_id": b.previous_response_id, "store": b.store, "metadata": {}, "text": {"format": (b.text or {}).get("format") or {"type": "text"}},
                "truncation": "disabled", "reasoning": None}

    def _ev(self, kind: str, data: dict[str, Any]) -> bytes:
        obj = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + dumps(obj) + b"\n\n"

    def start(self) -> list[bytes]:
        r = self.response()
        return [self._ev("response.created", {"response": r}), self._ev("response.in_progress", {"response": r})]

    def feed(self, ev: AnswerEvent) -> list[bytes]:
        if isinstance(ev, Logprobs):
            return self._scored(ev)
        out = self._flush()
        if isinstance(ev, ContentDelta):
            out += [] if self.open is not None and self.open["type"] == "message" else self._open_message()
            self.open["content"][0]["text"] += ev.text  # type: ignore[index]
            if self.body.logprobs:
                self._pending = (self._pending or "") + ev.text
                return out
            return out + [self._delta(ev.text, [])]
        return out + self._event(ev)

    def _delta(self, text: str, logprobs: list[dict[str, Any]]) -> bytes:
        return self._ev("response.output_text.delta", {**self._at(), "content_index": 0, "delta": text,
                                                        "logprobs": logprobs})

    def _scored(self, ev: Logprobs) -> list[bytes]:
        """The pending text's delta, with its tokens' log probabilities (those of a tool call's text are not kept)."""
        if self._pending is None or self.open is None or self.open["type"] != "message":
            return []
        entries = logprobs_content(ev.entries)
        self.open["content"][0]["logprobs"] += entries
        text, self._pending = self._pending, None
        return [self._delta(text, entries)]

    def _flush(self) -> list[bytes]:
        if self._pending is None:
            return []
        text, self._pending = self._pending, None
        return [self._delta(text, [])] if self.open is not None else []

    def _event(self, ev: AnswerEvent) -> list[bytes]:
        if isinstance(ev, ToolCallStart):
            item = {"type": "function_call", "id": _id("fc_"), "call_id": ev.id, "name": ev.name, "arguments": "",
                    "status": "in_progress"}
            return self._close() + self._add(item)
        if isinstance(ev, ToolCallArgs) and self.open is not None:
            self.open["arguments"] += ev.text
            return [self._ev("response.function_call_arguments.delta", {**self._at(), "delta": ev.text})]
        if isinstance(ev, ToolCallEnd):
            return self._close()
        if isinstance(ev, Finish):
            out = self.finish(ev)
            kind = "response.completed" if self.status == "completed" else "response.incomplete"
            return [*out, self._ev(kind, {"response": self.response()})]
        if isinstance(ev, Failed):
            out = self._close()
            self.status, self.error = "failed", {"code": ev.code or "server_error", "message": ev.message}
            return out + [self._ev("response.failed", {"response": self.response()})]
        return []

    def finish(self, fin: Finish) -> list[bytes]:
        """The answer's end: the open item closed (its events returned), the status and usage set.

        An answer with no text and no call (the model's first token ended it) is still one empty assistant message:
        clients read `output[0].content[0]`, and OpenAI's own empty answers have that shape."""
        out = self._flush() + (self._open_message() if not self.output else []) + self._close()
        self.status = "incomplete" if fin.finish_reason == "length" else "completed"
        self.incomplete = {"reason": "max_output_tokens"} if self.status == "incomplete" else None
        self.usage = {"input_tokens": fin.prompt_tokens, "input_tokens_details": {"cached_tokens": fin.cached_tokens},
                      "output_tokens": fin.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": fin.prompt_tokens + fin.completion_tokens}
        return out

    def _at(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _open_message(self) -> list[bytes]:
        item: dict[str, Any] = {"type": "message", "id": _id("msg_"), "status": "in_progress", "role": "assistant",
                                "content": []}
        out = self._close() + self._add(item)
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"] = [part]
        return out + [self._ev("response.content_part.added", {**self._at(), "content_index": 0, "part": dict(part)})]

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self.output.append(item)
        self.open = item
        return [self._ev("response.output_item.added", {"output_index": len(self.output) - 1, "item": dict(item)})]

    def _close(self) -> list[bytes]:
        item = self.open
        if item is None:
            return []
        at = self._at()
        self.open = None
        item["status"] = "completed"
        if item["type"] == "message":
            part = item["content"][0]
            out = [self._ev("response.output_text.done", {**at, "content_index": 0, "text": part["text"],
                                                           "logprobs": part["logprobs"]}),
                   self._ev("response.content_part.done", {**at, "content_index": 0, "part": part})]
        else:
            out = [self._ev("response.function_call_arguments.done", {**at, "arguments": item["arguments"]})]
        return out + [self._ev("response.output_item.done", {"output_index": at["output_index"], "item": item})]


async def responses(body: ResponsesRequest, request: Request, node: NodeDep) -> Response:
    scope = caller_scope(request, node)
    prior = await continued(node, body, scope)
    chat = body.chat(prior[1] if prior else None)
    if prior is not None:  # the chain's session, whatever this request names: one session, one conversation
        session = SessionName(prior[0].entry.group, prior[0].entry.source or "previous_response_id",
                              opening_of(chat.messages_as_dicts()))
    else:
        session = name_session(request.headers, Named(prompt_cache_key=body.prompt_cache_key, user=body.user),
                               chat.messages_as_dicts())
    greq = constrained(prompt_request(node, chat, session), chat)  # response_format, tool_choice
    opened = await open_answer(node, greq, session, request.headers, chat_hop(node, chat, body.stream),
                               stream=body.stream, new_parser=parser_factory(chat))
    headers = dict(opened.headers)
    if ignored := body.ignored():
        headers["X-Kvmesh-Ignored"] = ",".join(ignored)
    b = ResponseBuilder(body, new_id(greq.session))  # the session is the conversation's key by now

    async def keep() -> None:
        if not (body.store and node.responses.enabled):
            return
        ran_on = next((v for k, v in headers.items() if k.lower() == "x-kvmesh-host"), None)
        try:
            record = kept_record(body, b.response(), session, greq.session, scope, node.responses.ttl_s,
                                 prior[0] if prior else None)
            await node.responses.keep(record, ran_on)
        except Exception:  # the answer stands; only its keeping failed
            log.exception("response %s of %s was not stored", b.rid, greq.session)

    if body.stream:
        return sse_response(_streamed(b, opened.events, keep), headers)
    events, fin = await collect(opened.events)
    for ev in events:
        b.feed(ev)
    if fin.logprobs and b.output and all(item["type"] == "message" for item in b.output):
        # collect gathers a whole answer's log probabilities into its Finish: they are the text's
        b.output[-1]["content"][0]["logprobs"] = logprobs_content(fin.logprobs)
    b.finish(fin)
    await keep()
    return JSONResponse(b.response(), headers=headers)


async def _streamed(b: ResponseBuilder, events: AsyncIterator[AnswerEvent],
                    keep: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
    """The Responses stream; a finished answer is kept before its last events go out."""
    for chunk in b.start():
        yield chunk
    async for ev in events:
        out = b.feed(ev)
        if isinstance(ev, Finish):
            await keep()
        for chunk in out:
            yield chunk


for _prefix in ("/v1", ""):
    router.add_api_route(_prefix + "/responses", responses, methods=["POST"], response_model=None,
                         dependencies=[ClientKey])
router.include_router(stored_router)
