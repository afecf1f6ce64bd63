"""The one turn path every dialect takes, between its parsing and its formatting.

A dialect adapter turns its request into the internal one (a `ChatCompletionRequest`; legacy
completions its own raw prompt) and names the session; from there `prompt_request` checks the
model and templates the prompt, and `open_answer`, the one call every route makes, runs the turn
where the mesh places it (node.mesh.turn) and hands back its answer events, whether it ran here
or on a peer. A peer is sent the request as chat completions (the hop format: `chat_hop`; legacy
completions for a raw prompt), so placement, kv_share, handoff classification, tool-call
parsing, stream splicing and errors are the same for every dialect, and each dialect renders
the events once. The engine validates the turn as it admits it, wherever it runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping

from fastapi.responses import StreamingResponse

from kvmesh.node.api.jsonbody import dumps
from kvmesh.node.api.schema import ChatCompletionRequest, StreamOptions
from kvmesh.node.api.sessionid import SessionName
from kvmesh.node.api.toolcalls import ToolCallParser
from kvmesh.node.config import EngineConfig
from kvmesh.node.engine.chat import tools_for_prompt
from kvmesh.node.engine.engine import GenerateRequest
from kvmesh.node.errors import ModelNotFound
from kvmesh.node.mesh.answer import Answer, ParserFactory, no_parser
from kvmesh.node.mesh.turn import CHAT_PATH
from kvmesh.node.node import Node

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


def chat_prompt(node: Node, body: ChatCompletionRequest) -> list[int]:
    """The prompt's token ids as this node's template renders it, after the model and tools are checked (what
    a turn prefills, and what Anthropic's count_tokens counts). Text arrives valid (node.api.jsonbody)."""
    check_model(node.cfg.engine, body.model)
    body.check_tools()
    return node.engine.tokenizer.apply_chat_template(body.messages_as_dicts(), tools=body.tools_as_dicts(),
                                                     tool_choice=body.tool_choice_value(),
                                                     parallel_tool_calls=body.parallel_tool_calls)


def prompt_request(node: Node, body: ChatCompletionRequest, session: SessionName) -> GenerateRequest:
    """The engine's request for this body; errors (unknown model, bad tools) raised here (the engine's own,
    a prompt too long, when it admits the turn)."""
    prompt = chat_prompt(node, body)
    greq = GenerateRequest(session=session.id, prompt=prompt, max_tokens=body.token_budget(DEFAULT_MAX_TOKENS),
                           temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
                           stop=body.stop_list(), ignore_eos=body.ignore_eos)
    return greq


def sse_response(chunks: AsyncIterator[bytes], headers: Mapping[str, str]) -> StreamingResponse:
    """A streamed answer, in any dialect: SSE, never cached or buffered by a proxy."""
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def chat_hop(node: Node, body: ChatCompletionRequest, stream: bool) -> Callable[[], bytes]:
    """The internal request as a peer runs it: chat completions for the served model, usage included."""
    def made() -> bytes:
        hop = body.model_copy(update={"model": node.engine.model_name, "stream": stream,
                                      "stream_options": StreamOptions(include_usage=True) if stream else None})
        return dumps(hop.model_dump(exclude_none=True))
    return made


async def open_answer(node: Node, greq: GenerateRequest, session: SessionName, headers: Mapping[str, str],
                      hop: Callable[[], bytes], *, stream: bool, new_parser: ParserFactory = no_parser,
                      path: str = CHAT_PATH) -> Answer:
    """Run the turn where the mesh places it and hand back its answer; errors before its first byte are
    raised (AnswerError for a peer's). `hop` makes the body a peer would be POSTed at `path`."""
    return await node.turns.serve(greq, headers, hop, stream=stream, new_parser=new_parser, source=session.source,
                                  path=path, opening=session.opening)
