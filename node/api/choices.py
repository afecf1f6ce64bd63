"""Several choices for one chat request (`n` > 1), from one prefill.

Each choice is a turn of the request's conversation, run one after another on the one turn path
(node.api.serving): the first prefills the prompt, and every later one finds that prompt in the
conversation's cache (the engine reuses all of it but the last token, whose logits each choice
samples from anew), so `n` choices cost one prefill and `n` decodes. Each choice is placed like
any turn, so it runs where the cache is, here or on a peer, and a peer runs it as a one-choice
turn. A sampled choice gets its own seed: the client's seed plus its index, or the entry's.
Usage counts the prompt once (its cached tokens: what the first choice reused) and every
choice's completion tokens; a stream sends each choice's chunks in turn, by index.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi.responses import JSONResponse, Response

from kvmesh.node.api.answer import collect
from kvmesh.node.api.chat_format import Ident, chat_choice, choice_chunks, sse_error, usage, usage_chunk
from kvmesh.node.api.schema import ChatCompletionRequest
from kvmesh.node.api.serving import chat_hop, open_answer, parser_factory, sse_response
from kvmesh.node.api.sessionid import SessionName
from kvmesh.node.engine.boundary import GenerateRequest
from kvmesh.node.errors import KVMeshError
from kvmesh.node.mesh.answer import Answer, Finish
from kvmesh.node.node import Node


def total(fins: list[Finish]) -> Finish:
    """The request's usage: the prompt once (as the first choice saw it), every choice's completion."""
    first = fins[0]
    return dataclasses.replace(first, completion_tokens=sum(f.completion_tokens for f in fins), logprobs=())


def _choice_request(greq: GenerateRequest, index: int) -> GenerateRequest:
    """The choice's own copy: the turn path names its conversation in the request it runs."""
    seed = None if greq.seed is None else (greq.seed + index) % 2**63
    return dataclasses.replace(greq, seed=seed)


async def _open(node: Node, body: ChatCompletionRequest, greq: GenerateRequest, session: SessionName,
                headers: Mapping[str, str], index: int, stream: bool) -> Answer:
    one = body.model_copy(update={"n": 1})  # the hop runs one choice
    return await open_answer(node, _choice_request(greq, index), session, headers, chat_hop(node, one, stream),
                             stream=stream, new_parser=parser_factory(one))


async def several(node: Node, body: ChatCompletionRequest, greq: GenerateRequest, session: SessionName,
                  headers: Mapping[str, str], ident: Ident) -> Response:
    """The answer to a chat request with n > 1, whole or streamed."""
    first = await _open(node, body, greq, session, headers, 0, body.stream)  # errors before any byte are raised
    out_headers = dict(first.headers)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_stream(node, body, greq, session, headers, ident, first, include_usage), out_headers)
    choices: list[dict[str, Any]] = []
    fins: list[Finish] = []
    opened = first
    for i in range(body.n):
        if i:
            opened = await _open(node, body, greq, session, headers, i, False)
        events, fin = await collect(opened.events)
        choices.append(chat_choice(events, fin, i))
        fins.append(fin)
    cid, created, model = ident
    return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model,
                         "choices": choices, "usage": usage(total(fins))}, headers=out_headers)


async def _stream(node: Node, body: ChatCompletionRequest, greq: GenerateRequest, session: SessionName,
                  headers: Mapping[str, str], ident: Ident, first: Answer, include_usage: bool) -> AsyncIterator[bytes]:
    fins: list[Finish] = []
    opened = first
    for i in range(body.n):
        if i:
            try:
                opened = await _open(node, body, greq, session, headers, i, True)
            except KVMeshError as e:  # past the first byte, said in-band
                yield sse_error(str(e), e.type, e.code)
                break
        async for chunk in choice_chunks(opened.events, ident, i, fins, scored=body.logprobs):
            yield chunk
        if len(fins) <= i:  # the choice broke off (said in-band): the rest would only repeat it
            break
    if include_usage and len(fins) == body.n:
        yield usage_chunk(ident, total(fins))
    yield b"data: [DONE]\n\n"
