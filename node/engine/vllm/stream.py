"""One turn's completion from the vLLM server: the request body, and its streamed answer as text,
token ids and log probabilities (OpenAI's completions stream, with vLLM's `return_token_ids`)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvmesh.node.engine.boundary import GenerateRequest, TokenLogprob
from kvmesh.node.errors import InvalidRequest, KVMeshError


class EngineDown(KVMeshError):
    """vLLM is not answering (it exited, or a turn's request failed on the way)."""

    status = 503


@dataclass
class Piece:
    """What one streamed chunk adds."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: str | None = None
    cached_tokens: int | None = None  # from the final usage chunk: prompt tokens vLLM did not compute


def request_body(model: str, req: GenerateRequest, prompt: list[int], kv: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "prompt": prompt, "max_tokens": req.max_tokens, "temperature": req.temperature,
        "top_p": req.top_p, "top_k": req.top_k if req.top_k > 0 else -1, "stream": True, "return_token_ids": True,
        "stream_options": {"include_usage": True}, "ignore_eos": req.ignore_eos, "skip_special_tokens": True,
        "kv_transfer_params": {"kvmesh": kv},
    }
    if req.seed is not None:
        body["seed"] = req.seed
    if req.stop:
        body["stop"] = list(req.stop)
    if req.top_logprobs is not None:
        body["logprobs"] = req.top_logprobs
        body["return_tokens_as_token_ids"] = True
    if req.constraint is not None:
        body["structured_outputs"] = {"grammar": vllm_grammar(req.constraint)}
    return body


def vllm_grammar(constraint: str) -> str:
    """The turn's llguidance grammar as vLLM's `structured_outputs.grammar` takes it: Lark text.

    vLLM hands a grammar to llguidance as Lark or GBNF (the server runs with the guidance backend, see
    node.engine.vllm.server), never as llguidance's JSON form. node.engine.constraint builds Lark (its JSON
    numbers bounded in Lark rules), which passes as it is; a grammar in the JSON form becomes the one-rule
    Lark grammar `start: %json <schema>`, the schema keeping its x-guidance (separators, leniency). A JSON
    form that is not a single grammar has no Lark spelling here: refused, naming it, rather than sent and
    misread."""
    if not constraint.lstrip().startswith("{"):
        return constraint  # Lark already (tool_grammar)
    try:
        top = json.loads(constraint)
        grammars = top["grammars"]
    except (ValueError, KeyError, TypeError):
        raise InvalidRequest("the vLLM engine cannot pass this constraint to vLLM: it is neither Lark text nor "
                             "llguidance's JSON grammar form", param="response_format") from None
    if len(grammars) == 1 and top.get("max_tokens") is None:
        g = grammars[0]
        if g.get("json_schema") is not None and g.get("lark_grammar") is None:
            return "%llguidance {}\nstart: %json " + json.dumps(g["json_schema"]) + "\n"
        if g.get("lark_grammar") is not None and g.get("json_schema") is None:
            return str(g["lark_grammar"])
    raise InvalidRequest("the vLLM engine cannot pass this constraint to vLLM: an llguidance JSON grammar with "
                         f"{len(grammars)} grammars or a token limit has no Lark form", param="response_format")


def _token_id(s: str) -> int:
    return int(s.removeprefix("token_id:"))


def _logprobs(lp: dict[str, Any] | None, token_bytes: Callable[[int], bytes]) -> list[TokenLogprob] | None:
    if lp is None:
        return None
    out = []
    for tok, val, top in zip(lp.get("tokens") or [], lp.get("token_logprobs") or [], lp.get("top_logprobs") or []):
        alts = tuple((token_bytes(_token_id(t)), float(v)) for t, v in sorted((top or {}).items(), key=lambda kv: -kv[1]))
        out.append(TokenLogprob(token_bytes(_token_id(tok)), float(val), alts))
    return out


async def stream(client: httpx.AsyncClient, body: dict[str, Any], token_bytes: Callable[[int], bytes]) -> AsyncIterator[Piece]:
    """The answer, chunk by chunk; vLLM's errors as the API's (a 400 stays a 400, the rest are 503s)."""
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:500]
                if resp.status_code == 400:
                    raise InvalidRequest(f"vLLM refused the request: {detail}")
                raise EngineDown(f"vLLM answered {resp.status_code}: {detail}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise EngineDown(f"vLLM failed the turn: {chunk['error']}")
                piece = Piece()
                if (usage := chunk.get("usage")) is not None:
                    piece.cached_tokens = int(((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0)
                for ch in chunk.get("choices") or []:
                    piece.text += ch.get("text") or ""
                    piece.token_ids += ch.get("token_ids") or []
                    piece.logprobs = _logprobs(ch.get("logprobs"), token_bytes)
                    piece.finish_reason = ch.get("finish_reason") or piece.finish_reason
                    sr = ch.get("stop_reason")
                    piece.stop_reason = sr if isinstance(sr, str) else piece.stop_reason
                yield piece
    except httpx.HTTPError as e:
        raise EngineDown(f"vLLM is not answering: {e!r}") from e
