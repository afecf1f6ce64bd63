"""Legacy OpenAI completions: `POST /v1/completions` (and `/completions`), a raw prompt in, text out.

The prompt is one string or one list of token ids (a batch of several is refused), tokenized as
given with the model's BOS in front (as llama.cpp does) unless it is already there. Streaming
sends `text_completion` chunks, then [DONE]. There is no chat template, so no tool calls. A
forwarded turn travels as legacy completions too (node.mesh.forward reads `choices[0].text` back
into answer events, which are rendered here wherever the turn ran).
`logprobs: k` gives each token's log probability and its k likeliest alternatives in the legacy
shape (tokens, token_logprobs, top_logprobs, text_offset: offsets into the completion's text),
streamed beside the text they score.
Refused with a 400 naming the field: `echo`, `suffix`, `best_of` > 1, `n` > 1.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmesh.node.api.answer import collect
from kvmesh.node.api.chat_format import sse_error, usage
from kvmesh.node.api.clientauth import ClientKey
from kvmesh.node.api.deps import NodeDep
from kvmesh.node.api.jsonbody import StrictJSONRoute, dumps
from kvmesh.node.api.schema import MAX_STOPS, StreamOptions, refuse_unhonoured
from kvmesh.node.api.serving import check_model, open_answer, sse_response
from kvmesh.node.api.sessionid import Named, SessionName, name_session
from kvmesh.node.engine.boundary import TokenLogprob
from kvmesh.node.engine.engine import GenerateRequest
from kvmesh.node.errors import InvalidRequest
from kvmesh.node.mesh.answer import AnswerEvent, ContentDelta, Failed, Finish, Logprobs
from kvmesh.node.node import Node

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for legacy completions
_REFUSED = {"echo": "echoing the prompt is not supported",
            "suffix": "insertion (suffix) is not supported", "logit_bias": "kvmesh does not bias logits",
            "frequency_penalty": "kvmesh does not apply repetition penalties",
            "presence_penalty": "kvmesh does not apply repetition penalties"}


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1_000_000)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    logprobs: int | None = Field(None, ge=0, le=20)  # each token's log probability and its k likeliest alternatives
    best_of: int = Field(1, ge=1, le=1)
    user: str | None = Field(None, max_length=512)

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, v: Any) -> Any:
        return refuse_unhonoured(v, _REFUSED)

    def one_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and not isinstance(p[0], int):
            if len(p) != 1:
                raise InvalidRequest("prompt: one prompt per request (a batch of several is not supported)",
                                     param="prompt")
            p = p[0]  # type: ignore[assignment]
        if not p:
            raise InvalidRequest("prompt: the prompt is empty", param="prompt")
        return p  # type: ignore[return-value]

    def stop_list(self) -> tuple[str, ...]:
        items = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(items) > MAX_STOPS or any(not s or len(s) > 256 for s in items):
            raise InvalidRequest(f"stop: at most {MAX_STOPS} stop sequences of 1-256 characters", param="stop")
        return tuple(items)


def _request(node: Node, body: CompletionRequest, request: Request) -> tuple[GenerateRequest, SessionName]:
    check_model(node.cfg.engine, body.model)
    prompt = body.one_prompt()
    tok = node.engine.tokenizer
    if isinstance(prompt, str):
        ids = tok.encode(prompt)
        opening = prompt[:1024]
    else:
        if any(not 0 <= t < tok.vocab_size for t in prompt):
            raise InvalidRequest(f"prompt: token ids must be in 0..{tok.vocab_size - 1}", param="prompt")
        ids, opening = list(prompt), repr(prompt[:256])
    if tok.bos_id is not None and ids[:1] != [tok.bos_id]:
        ids = [tok.bos_id, *ids]
    # A raw prompt has no conversation structure to tell threads apart by: the session is one conversation.
    session = name_session(request.headers, Named(user=body.user), [{"role": "user", "content": opening}],
                           conversation=False)
    greq = GenerateRequest(session=session.id, prompt=ids, max_tokens=body.max_tokens, temperature=body.temperature,
                           top_p=body.top_p, top_k=body.top_k, seed=body.seed, stop=body.stop_list(),
                           ignore_eos=body.ignore_eos, top_logprobs=body.logprobs)
    return greq, session


def legacy_logprobs(entries: tuple[TokenLogprob, ...] | list[TokenLogprob], offset: int) -> dict[str, Any]:
    """The legacy shape of these tokens' log probabilities; `offset`: where the first one's text starts."""
    tokens = [e.token.decode("utf-8", "replace") for e in entries]
    offsets = list(itertools.accumulate((len(t) for t in tokens), initial=offset))[:-1]
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{t.decode("utf-8", "replace"): v for t, v in e.top} for e in entries],
            "text_offset": offsets}


def _chunk(ident: tuple[str, int, str], text: str, fin: Finish | None = None, *, with_usage: bool = False,
           logprobs: dict[str, Any] | None = None) -> bytes:
    cid, created, model = ident
    obj: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created, "model": model}
    if with_usage and fin is not None:
        obj |= {"choices": [], "usage": usage(fin)}
    else:
        obj["choices"] = [{"index": 0, "text": text, "logprobs": logprobs,
                           "finish_reason": fin.finish_reason if fin else None}]
    return b"data: " + dumps(obj) + b"\n\n"


async def _sse(events: AsyncIterator[AnswerEvent], ident: tuple[str, int, str], include_usage: bool) -> AsyncIterator[bytes]:
    """The answer as text_completion chunks; a delta's text waits for its tokens' log probabilities (when
    asked for, they come right after it) so both go in one chunk, as OpenAI's do."""
    pending: str | None = None
    offset = 0
    async for ev in events:
        if isinstance(ev, Logprobs):
            yield _chunk(ident, pending or "", logprobs=legacy_logprobs(ev.entries, offset))
            offset += len(pending or "")
            pending = None
            continue
        if pending is not None:
            yield _chunk(ident, pending)
            offset += len(pending)
            pending = None
        if isinstance(ev, ContentDelta):
            pending = ev.text
        elif isinstance(ev, Finish):
            yield _chunk(ident, "", ev)
            if include_usage:
                yield _chunk(ident, "", ev, with_usage=True)
        elif isinstance(ev, Failed):
            yield sse_error(ev.message, ev.type, ev.code)
    if pending is not None:
        yield _chunk(ident, pending)
    yield b"data: [DONE]\n\n"


async def completions(body: CompletionRequest, request: Request, node: NodeDep) -> Response:
    greq, session = _request(node, body, request)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    raw = await request.body()  # a peer runs the client's own request
    answer = await open_answer(node, greq, session, request.headers, lambda: raw, stream=body.stream,
                               path="/v1/completions")
    ident = ("cmpl-" + uuid.uuid4().hex[:24], int(time.time()), body.model)
    headers = answer.headers
    if body.stream:
        return sse_response(_sse(answer.events, ident, include_usage), headers)
    events, fin = await collect(answer.events)
    text = "".join(ev.text for ev in events if isinstance(ev, ContentDelta))
    cid, created, model = ident
    return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                         "choices": [{"index": 0, "text": text, "finish_reason": fin.finish_reason,
                                      "logprobs": legacy_logprobs(fin.logprobs, 0) if body.logprobs is not None else None}],
                         "usage": usage(fin)}, headers=headers)


router = APIRouter(route_class=StrictJSONRoute)
for _path in ("/v1/completions", "/completions"):
    router.add_api_route(_path, completions, methods=["POST"], response_model=None, dependencies=[ClientKey])
