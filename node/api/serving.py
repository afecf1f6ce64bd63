"""The one turn path every dialect takes, between its parsing and its formatting.

A dialect adapter turns its request into the internal one (a `ChatCompletionRequest`) and names
the session; from there `prompt_request` checks the model and templates the prompt, and
`open_answer` runs the turn where the mesh places it and hands back answer events, whether it
ran here or on a peer. A peer is sent the internal request as chat completions (the hop format),
so placement, kv_share, handoff classification, tool-call parsing, stream splicing and errors
are the same for every dialect.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi.responses import Response, StreamingResponse

from kvmesh.node.api.answer import AnswerError, AnswerEvent, ParserFactory, chunk_events, completion_events, local_events
from kvmesh.node.api.chat_format import chat_sse
from kvmesh.node.api.schema import ChatCompletionRequest, StreamOptions
from kvmesh.node.api.sessionid import SessionName
from kvmesh.node.api.toolcalls import ToolCallParser
from kvmesh.node.config import EngineConfig
from kvmesh.node.engine.chat import tools_for_prompt
from kvmesh.node.engine.engine import GenerateRequest
from kvmesh.node.errors import InvalidRequest, ModelNotFound
from kvmesh.node.mesh.turn import HostTurn, PeerAnswer, PeerStream
from kvmesh.node.node import Node
from kvmesh.node.protocol import session_header

DEFAULT_MAX_TOKENS = 256


def check_model(cfg: EngineConfig, name: str) -> None:
    """A 404 naming what is served, unless `name` is the served model, one of its names, or any name is taken."""
    if not cfg.accepts_model(name):
        names = ", ".join(repr(n) for n in (cfg.served_model, *cfg.served_names))
        raise ModelNotFound(f"model {name!r} is not served here; this node serves {names} (GET /v1/models)")


def parser_factory(body: ChatCompletionRequest) -> ParserFactory:
    """Tool calls are looked for in the reply only where the prompt showed tools (not with tool_choice "none")."""
    shown = tools_for_prompt(body.tools_as_dicts(), body.tool_choice_value())
    names = tuple(t["function"]["name"] for t in shown)
    if not names:
        return lambda: None
    return lambda: ToolCallParser(names, parallel=body.parallel_tool_calls)


def prompt_request(node: Node, body: ChatCompletionRequest, session: SessionName) -> GenerateRequest:
    """The engine's request for this body; errors (unknown model, bad tools, too long) raised here."""
    check_model(node.cfg.engine, body.model)
    body.check_tools()
    try:
        prompt = node.engine.tokenizer.apply_chat_template(body.messages_as_dicts(), tools=body.tools_as_dicts(),
                                                           tool_choice=body.tool_choice_value(),
                                                           parallel_tool_calls=body.parallel_tool_calls)
    except UnicodeEncodeError:
        raise InvalidRequest("message content is not valid Unicode (an unpaired surrogate?)", param="messages") from None
    greq = GenerateRequest(session=session.id, prompt=prompt, max_tokens=body.token_budget(DEFAULT_MAX_TOKENS),
                           temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                           stop=body.stop_list(), ignore_eos=body.ignore_eos)
    node.engine.validate(greq)
    return greq


def sse_response(chunks: AsyncIterator[bytes], headers: Mapping[str, str]) -> StreamingResponse:
    """A streamed answer from this host, in any dialect: SSE, never cached or buffered by a proxy."""
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def relayed(served: PeerAnswer | PeerStream) -> Response:
    """A peer's answer in the hop's own dialect (chat or legacy completions), passed on as it came."""
    if isinstance(served, PeerAnswer):
        return served.response
    return StreamingResponse(served.chunks, status_code=200, headers=served.headers)


def turn_headers(run: HostTurn) -> dict[str, str]:
    """What a turn run here tells the client about itself (peers pass these back through the entry)."""
    begin = run.begin
    return {"X-Kvmesh-Host": run.path.name, "X-Session-Id": session_header(run.req.session),
            "X-Kvmesh-Handoff": run.handoff_class or "none",
            "X-Kvmesh-Prompt-Tokens": str(begin.prompt_tokens if begin else 0),
            "X-Kvmesh-Cached-Tokens": str(begin.cached_tokens if begin else 0)}


@dataclass
class Opened:
    """A turn under way: its headers, the prompt's token counts known so far, and its events."""

    headers: dict[str, str]
    prompt_tokens: int
    cached_tokens: int
    events: AsyncIterator[AnswerEvent]


def hop_body(node: Node, body: ChatCompletionRequest, stream: bool) -> bytes:
    """The internal request as a peer runs it: chat completions for the served model, usage included."""
    hop = body.model_copy(update={"model": node.engine.model_name, "stream": stream,
                                  "stream_options": StreamOptions(include_usage=True) if stream else None})
    return json.dumps(hop.model_dump(exclude_none=True), separators=(",", ":")).encode()


async def open_answer(node: Node, body: ChatCompletionRequest, greq: GenerateRequest, session: SessionName,
                      headers: Mapping[str, str], *, stream: bool) -> Opened:
    """Run the turn where the mesh places it; errors before its first byte are raised (AnswerError for a peer's)."""
    new_parser = parser_factory(body)

    def render(run: HostTurn) -> AsyncIterator[bytes]:
        # A stream resumed on this host: the splice gives its chunks the first stream's id.
        return chat_sse(run, ("chatcmpl-resumed", int(time.time()), node.engine.model_name), True, new_parser)

    served = await node.turns.serve(greq, headers, lambda: hop_body(node, body, stream), stream=stream, render=render,
                                    source=session.source, opening=session.opening)
    if isinstance(served, HostTurn):
        b = served.begin
        return Opened(turn_headers(served), b.prompt_tokens if b else 0, b.cached_tokens if b else 0,
                      local_events(served, new_parser))
    passed = {k: v for k, v in (served.headers if isinstance(served, PeerStream) else served.response.headers).items()
              if k.lower().startswith("x-kvmesh-") or k.lower() == "x-session-id"}
    prompt, cached = _int(passed, "x-kvmesh-prompt-tokens"), _int(passed, "x-kvmesh-cached-tokens")
    if isinstance(served, PeerStream):
        return Opened(passed, prompt, cached, chunk_events(served.chunks))
    resp = served.response
    try:
        obj = json.loads(bytes(resp.body))
    except ValueError:
        obj = {}
    if resp.status_code != 200 or not isinstance(obj, dict) or "choices" not in obj:
        got = obj.get("error") if isinstance(obj, dict) else None
        err: dict[str, Any] = got if isinstance(got, dict) else {}
        raise AnswerError(resp.status_code if resp.status_code != 200 else 502,
                        str(err.get("message") or f"the peer answered {resp.status_code}"),
                        str(err.get("type") or "server_error"), err.get("code"), err.get("param"))
    return Opened(passed, prompt, cached, _listed(completion_events(obj)))


def _int(headers: Mapping[str, str], name: str) -> int:
    value = next((v for k, v in headers.items() if k.lower() == name), "")
    return int(value) if value.isdigit() else 0


async def _listed(events: list[AnswerEvent]) -> AsyncIterator[AnswerEvent]:
    for ev in events:
        yield ev
