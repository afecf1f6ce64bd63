"""Constrained decoding: a grammar the sampler follows token by token (llguidance), on every engine.

A turn's constraint is an llguidance grammar (`GenerateRequest.constraint`, plain text, so a
forwarded turn's peer builds the same one from the same request): a JSON schema
(`json_grammar`: chat `response_format`, Responses `text.format`) or a tool call
(`tool_grammar`: forced for tool_choice required / named, lazy for auto: free text until the
model writes `<tool_call>`, then the call's JSON follows the tools' schemas). `check` compiles a
grammar without any tokenizer, so a schema llguidance cannot honour is a 400 before the turn
runs, naming what it could not compile.

On the engine, `Grammars` is the engine tokenizer's vocabulary as llguidance sees it (built once,
on first use, off the event loop) and `TokenMask` one turn's matcher: the sampler asks it for the
allowed ids before each token and tells it the token chosen, on the compute thread beside the
sampler (node.engine.picker). Why llguidance, by measurement on SmolLM2's 49k vocabulary
(2 cores): its mask takes 0.02 ms a token (median), outlines-core's allowed-id list 0.43 ms and
llama.cpp's GBNF grammar sampler over the full vocabulary 8.9 ms; and only llguidance has the
lazy grammars a tool call's trigger needs (outlines-core compiles regular languages only).

JSON is written the way `json.dumps` writes it (", " and ": ", no other whitespace): what the
tool prompt shows the model and what a client sends back, so the constraint never makes the
model write JSON it has not seen, nor whitespace without end. Every grammar is Lark text whose JSON
values are node.engine.constraint_json's rules: llguidance's own JSON where it can bound what a
model writes, and a number of at most 17 digits that float() reads as a finite double where it
cannot (node.engine.constraint_numbers), so a model looping on digits meets the end of its number.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvmesh.node.engine.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from kvmesh.node.engine.constraint_json import JSON_STYLE, LarkJson, map_schema
from kvmesh.node.engine.tokenizer import Tokenizer
from kvmesh.node.errors import InvalidRequest


def _llg() -> Any:
    import llguidance  # the Rust extension loads on the first constrained request, not at every import

    return llguidance


def _close(s: dict[str, Any]) -> dict[str, Any]:
    # An empty `properties` names none: such a tool (a common way to say "any arguments") stays open.
    if s.get("properties") and "additionalProperties" not in s and "unevaluatedProperties" not in s:
        return {**s, "additionalProperties": False}
    return s


def closed(schema: Any) -> Any:
    """The schema with every object that names its properties and says nothing of others closed to others
    (additionalProperties false, as llama.cpp's converter does): left open, a small model writes on past the
    properties it was asked for (SmolLM2 copied the schema itself into the arguments)."""
    return map_schema(schema, _close)


def json_grammar(schema: Any, *, strict: bool) -> str:
    """A grammar for one JSON value following `schema` (None: any JSON object). `strict` false ignores the
    keywords llguidance does not implement (a non-strict schema promises no more); true refuses them."""
    if schema is not None and not isinstance(schema, dict | bool):
        raise InvalidRequest(f"the JSON schema is not a JSON object: {json.dumps(schema)[:200]}", param="response_format")
    rules = LarkJson()
    start = rules.root(None if schema is None else closed(schema), lenient=not strict)
    return f"%llguidance {{}}\nstart: {start}\n" + rules.text()


@dataclass(frozen=True)
class ToolShape:
    """One callable tool as its call's grammar needs it."""

    name: str
    parameters: dict[str, Any] | None  # its JSON schema (None: any object)
    strict: bool = False


def tool_grammar(tools: Sequence[ToolShape], *, forced: bool, parallel: bool, answer: str | None = None) -> str:
    """A grammar for tool calls, `<tool_call>\\n{...}\\n</tool_call>` (the generic prompt's form).

    forced (tool_choice required or named): the reply is calls, one or (parallel) several, nothing else.
    Otherwise lazy: free text, and once the model writes `<tool_call>` the call must be whole and
    valid; with `answer` (answer_schema's text: response_format beside tools) the reply is either
    calls or that JSON. A call is `{"name": <one of them>, "arguments": <its schema>}`, each tool's
    parameters a root of their own (their `$ref`s name their own `$defs`)."""
    rules = LarkJson()
    variants = []
    for t in tools:
        args = rules.root(closed(t.parameters or {"type": "object"}), lenient=not t.strict)
        head = json.dumps('{"name": ' + json.dumps(t.name, ensure_ascii=False) + ', "arguments": ', ensure_ascii=False)
        variants.append(rules.add_rule(f'{head} {args} "}}"'))
    call = f'call: {json.dumps(TOOL_CALL_OPEN + chr(10))} body {json.dumps(chr(10) + TOOL_CALL_CLOSE)}\n'
    body = f"body: {' | '.join(variants)}\n"
    calls = "calls: call (\"\\n\" call)*\n" if parallel else "calls: call\n"
    if forced:
        start = "start: calls\n"
    elif answer is not None:
        schema = json.loads(answer)
        options = schema.pop("x-guidance", {}) if isinstance(schema, dict) else {}
        start = f"start: calls | answer\nanswer: {rules.root(schema, lenient=bool(options.get('lenient', True)))}\n"
    else:  # lazy: any text until the trigger; then the call; then (parallel) text and calls again
        head = f'head[lazy]: TEXT {json.dumps(TOOL_CALL_OPEN + chr(10))}\n'
        lazy_call = f'lcall: head body {json.dumps(chr(10) + TOOL_CALL_CLOSE)}\n'
        loop = "start: lcall* TEXT\n" if parallel else "start: TEXT | lcall\n"
        return "%llguidance {}\n" + loop + head + lazy_call + body + "TEXT: /(.|\\n)*/\n" + rules.text()
    return "%llguidance {}\n" + start + calls + call + body + rules.text()


def answer_schema(schema: Any, *, strict: bool) -> str:
    """A JSON schema (closed, with its leniency) as the text tool_grammar takes for its answer alternative."""
    return json.dumps({**({"type": "object"} if schema is None else closed(schema)),
                       "x-guidance": {**JSON_STYLE, "lenient": not strict}})


def check(grammar: str, param: str) -> None:
    """A 400 naming what llguidance cannot compile in `grammar` (no tokenizer needed)."""
    llg = _llg()
    try:
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, None)
    except (ValueError, TypeError) as e:
        is_error, messages = True, [str(e)]
    if is_error:
        why = "; ".join(m.strip() for m in messages) or "it does not compile"
        raise InvalidRequest(f"{param}: the schema cannot be enforced: {why[:2000]}", param=param,
                             code="invalid_schema")


class TokenMask:
    """One turn's matcher: the ids allowed next, and the ids chosen (compute thread)."""

    def __init__(self, matcher: Any, vocab: int) -> None:
        self.matcher, self.vocab = matcher, vocab

    def allowed(self, rows: int) -> torch.Tensor:
        """A bool row of `rows` ids (a model's logits may be padded past the vocabulary)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        out = np.zeros(rows, dtype=bool)
        n = min(rows, self.vocab)
        out[:n] = bits[:n]
        return torch.from_numpy(out)

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the constraint refused token {token}: {self.matcher.get_error()}")


class Grammars:
    """An engine's vocabulary as llguidance sees it (built once, on first use) and each turn's matcher."""

    def __init__(self, tokenizer: Tokenizer, stop_ids: Collection[int]) -> None:
        self._tok = tokenizer
        self._eos = sorted(i for i in stop_ids if 0 <= i < tokenizer.vocab_size)
        self._ll: Any = None
        self._lock = asyncio.Lock()

    def _build(self) -> Any:
        tok, llg = self._tok, _llg()
        special = set(getattr(tok, "_special", ())) | set(self._eos)
        # A special id's bytes start with 0xff: llguidance's mark for a token no text spells.
        words = [b"\xff<|kvmesh-special-%d|>" % i if i in special or not tok.token_bytes(i) else tok.token_bytes(i)
                 for i in range(tok.vocab_size)]

        class _Words:
            eos_token_id = self._eos[0] if self._eos else tok.eos_id
            bos_token_id = None
            tokens = words
            special_token_ids = sorted(special)

            def __call__(self, s: str | bytes) -> list[int]:
                return tok.encode(s.decode("utf-8", "replace") if isinstance(s, bytes) else s)

        return llg.LLTokenizer(llg.TokenizerWrapper(_Words()), eos_token=self._eos or None)

    async def mask(self, grammar: str) -> TokenMask:
        """A fresh matcher for `grammar`; built on a worker thread (a large vocabulary takes a second once)."""
        async with self._lock:
            if self._ll is None:
                self._ll = await asyncio.to_thread(self._build)
        ll, llg = self._ll, _llg()
        matcher = await asyncio.to_thread(llg.LLMatcher, ll, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(f"the constraint cannot be enforced: {matcher.get_error()}", param="response_format",
                                 code="invalid_schema")
        return TokenMask(matcher, self._tok.vocab_size)
