"""Which constraint a request's decoding follows: its structured output and its tool choice, as one grammar.

Every dialect has become the one internal request by now (chat `response_format`, Responses
`text.format`, Anthropic `output_format` / `tool_choice` mapped onto it), so this is decided once,
on the host that runs the turn: a forwarded turn's peer reads the same fields from the hop's body
and builds the same grammar. In order:
- tools shown and tool_choice `required` or named: the reply is tool calls, each call's arguments
  following its tool's schema (`parallel_tool_calls` false: exactly one call);
- tools shown, tool_choice `auto`: free text until the model writes `<tool_call>`, then the call
  is constrained (lazy); with a JSON `response_format` too, the reply is either calls or that JSON;
- `response_format` `json_object` (llama.cpp's `schema` beside it honoured) or `json_schema`: one
  JSON value following the schema (`strict` true: every keyword enforced, or a 400 naming the one
  that cannot be; otherwise keywords llguidance does not implement are ignored, as OpenAI's
  non-strict mode promises no more);
- otherwise nothing: the reply is free.
A grammar that does not compile is a 400 (node.engine.constraint.check), before the turn runs.
"""

from __future__ import annotations

from typing import Any

from kvmesh.node.api.schema import ChatCompletionRequest, NamedToolChoice
from kvmesh.node.engine import constraint
from kvmesh.node.engine.boundary import GenerateRequest
from kvmesh.node.engine.chat import tools_for_prompt
from kvmesh.node.errors import InvalidRequest


def answer_format(body: ChatCompletionRequest) -> tuple[Any, bool] | None:
    """(schema or None for any object, strict) of a JSON response_format; None for text."""
    fmt = body.response_format
    if fmt is None or fmt.get("type", "text") == "text":
        return None
    if fmt["type"] == "json_object":
        return fmt.get("schema"), False
    js = fmt.get("json_schema") or {}
    return js.get("schema"), js.get("strict") is True


def grammar_for(body: ChatCompletionRequest) -> str | None:
    """The llguidance grammar of this request's reply (module docstring), checked; None when free."""
    answer = answer_format(body)
    shown = tools_for_prompt(body.tools_as_dicts(), body.tool_choice_value())
    forced = body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)
    if shown:
        tools = [constraint.ToolShape(t["function"]["name"], t["function"].get("parameters"),
                                      t["function"].get("strict") is True) for t in shown]
        inline = None if answer is None or forced else constraint.answer_schema(answer[0], strict=answer[1])
        grammar = constraint.tool_grammar(tools, forced=forced, parallel=body.parallel_tool_calls, answer=inline)
        constraint.check(grammar, "tools")
        return grammar
    if answer is None:
        return None
    grammar = constraint.json_grammar(answer[0], strict=answer[1])
    constraint.check(grammar, "response_format")
    return grammar


def constrained(greq: GenerateRequest, body: ChatCompletionRequest) -> GenerateRequest:
    """The engine's request with its constraint set (a 400 where it cannot be enforced), and the log
    probabilities it asks for (chat's logprobs / top_logprobs)."""
    greq.constraint = grammar_for(body)
    greq.top_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if greq.constraint is not None and greq.ignore_eos:
        raise InvalidRequest("ignore_eos cannot be combined with a constrained reply (response_format, or tools with "
                             "tool_choice): the grammar decides where the reply ends", param="ignore_eos")
    return greq
