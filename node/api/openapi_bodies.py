"""JSON schemas of what the node's routes answer, for its OpenAPI document (node.api.openapi).

Written by hand from the renderers, since those build plain dicts: chat_format.py and choices.py
(chat.completion), completions_routes.py (text_completion), responses_routes.py (the Responses
`response` object), anthropic_routes.py (the Anthropic `message`, count_tokens), responses_stored.py (a stored
response's deletion and input items), openai_routes.py (the model list), health_routes.py, and errors.py (both dialects' error bodies). A field a renderer
always writes is required; a field that echoes what the client sent is left as open as the
request model lets it be. Extra fields are not forbidden: clients are told to ignore what they do
not know, and the node may add facts of its own (the model list's `kvmesh`).
"""

from __future__ import annotations

from typing import Any

from kvmesh.node.api.errors import ANTHROPIC_TYPES

Schema = dict[str, Any]

REF = "#/components/schemas/"


def ref(name: str) -> Schema:
    return {"$ref": REF + name}


def obj(props: dict[str, Schema], *, optional: tuple[str, ...] = (), title: str = "") -> Schema:
    """An object whose every property but `optional` ones is always written."""
    out: Schema = {"type": "object", "properties": props, "required": [k for k in props if k not in optional]}
    if title:
        out["title"] = title
    return out


def nullable(schema: Schema) -> Schema:
    return {"anyOf": [schema, {"type": "null"}]}


def array(items: Schema) -> Schema:
    return {"type": "array", "items": items}


def const(value: str) -> Schema:
    return {"type": "string", "enum": [value]}


STR: Schema = {"type": "string"}
INT: Schema = {"type": "integer"}
NUM: Schema = {"type": "number"}
BOOL: Schema = {"type": "boolean"}
ANY: Schema = {}


def _openai_error() -> Schema:
    detail = obj({"message": STR, "type": STR, "param": nullable(STR), "code": nullable(STR)})
    return obj({"error": detail}, title="OpenAIError")


def _anthropic_error() -> Schema:
    types = sorted({*ANTHROPIC_TYPES.values(), "api_error"})
    detail = obj({"type": {"type": "string", "enum": types}, "message": STR})
    return obj({"type": const("error"), "error": detail}, title="AnthropicError")


def _token_logprobs() -> Schema:
    """chat_format.logprobs_content: one token, its log probability, its bytes and its likeliest alternatives."""
    one = {"token": STR, "logprob": NUM, "bytes": array(INT)}
    return obj({**one, "top_logprobs": array(obj(one))}, title="TokenLogprob")


def _chat_usage() -> Schema:
    return obj({"prompt_tokens": INT, "completion_tokens": INT, "total_tokens": INT,
                "prompt_tokens_details": obj({"cached_tokens": INT})}, title="ChatUsage")


def _chat_completion() -> Schema:
    tool_call = obj({"id": STR, "type": const("function"), "function": obj({"name": STR, "arguments": STR})})
    message = obj({"role": const("assistant"), "content": nullable(STR), "tool_calls": array(tool_call)},
                  optional=("tool_calls",))
    logprobs = obj({"content": array(ref("TokenLogprob")), "refusal": {"type": "null"}})
    choice = obj({"index": INT, "message": message, "finish_reason": STR, "logprobs": nullable(logprobs),
                  "stop_reason": STR}, optional=("stop_reason",))
    return obj({"id": STR, "object": const("chat.completion"), "created": INT, "model": STR,
                "choices": array(choice), "usage": ref("ChatUsage")}, title="ChatCompletion")


def _text_completion() -> Schema:
    logprobs = obj({"tokens": array(STR), "token_logprobs": array(NUM),
                    "top_logprobs": array({"type": "object", "additionalProperties": NUM}), "text_offset": array(INT)})
    choice = obj({"index": INT, "text": STR, "finish_reason": STR, "logprobs": nullable(logprobs)})
    return obj({"id": STR, "object": const("text_completion"), "created": INT, "model": STR,
                "choices": array(choice), "usage": ref("ChatUsage")}, title="TextCompletion")


def _response() -> Schema:
    """responses_routes.ResponseBuilder.response(), as a whole answer ends it ("completed" or "incomplete")."""
    text = obj({"type": const("output_text"), "text": STR, "annotations": array(ANY),
                "logprobs": array(ref("TokenLogprob"))})
    message = obj({"type": const("message"), "id": STR, "status": STR, "role": const("assistant"),
                   "content": array(text)})
    call = obj({"type": const("function_call"), "id": STR, "call_id": STR, "name": STR, "arguments": STR,
                "status": STR})
    usage = obj({"input_tokens": INT, "input_tokens_details": obj({"cached_tokens": INT}), "output_tokens": INT,
                 "output_tokens_details": obj({"reasoning_tokens": INT}), "total_tokens": INT})
    return obj({
        "id": STR, "object": const("response"), "created_at": INT,
        "status": {"type": "string", "enum": ["completed", "incomplete", "in_progress", "failed"]},
        "model": STR, "output": array({"oneOf": [message, call]}), "usage": nullable(usage),
        "error": nullable(obj({"code": STR, "message": STR})),
        "incomplete_details": nullable(obj({"reason": STR})), "instructions": nullable(STR),
        "tools": array({"type": "object"}), "tool_choice": {"anyOf": [STR, {"type": "object"}]},
        "parallel_tool_calls": BOOL, "temperature": nullable(NUM), "top_p": nullable(NUM),
        "max_output_tokens": nullable(INT), "previous_response_id": nullable(STR), "store": BOOL,
        "metadata": {"type": "object"}, "text": obj({"format": ANY}), "truncation": STR, "reasoning": {"type": "null"},
    }, title="Response")


def _stored() -> list[Schema]:
    """node.api.responses_stored: a deleted response's answer, and a response's input items (OpenAI's list page)."""
    deleted = obj({"id": STR, "object": const("response"), "deleted": {"type": "boolean", "enum": [True]}},
                  title="ResponseDeleted")
    items = obj({"object": const("list"), "data": array({"type": "object"}), "first_id": nullable(STR),
                 "last_id": nullable(STR), "has_more": BOOL}, title="ResponseInputItems")
    return [deleted, items]


def _anthropic_message() -> Schema:
    text = obj({"type": const("text"), "text": STR})
    tool_use = obj({"type": const("tool_use"), "id": STR, "name": STR, "input": ANY})
    usage = obj({"input_tokens": INT, "output_tokens": INT, "cache_read_input_tokens": INT,
                 "cache_creation_input_tokens": INT})
    return obj({"id": STR, "type": const("message"), "role": const("assistant"), "model": STR,
                "content": array({"oneOf": [text, tool_use]}),
                "stop_reason": {"type": "string", "enum": ["end_turn", "max_tokens", "stop_sequence", "tool_use"]},
                "stop_sequence": nullable(STR), "usage": usage}, title="AnthropicMessage")


def _model_list() -> Schema:
    facts = obj({"replicas": BOOL, "no_replicas_reason": nullable(STR), "max_context": INT, "block_size": INT,
                 "swa": nullable(STR)})
    model = obj({"id": STR, "object": const("model"), "created": INT, "owned_by": STR, "kvmesh": facts})
    return obj({"object": const("list"), "data": array(model)}, title="ModelList")


def _health() -> Schema:
    status = {"type": "string", "enum": ["ok", "draining", "stopping"]}
    return obj({"status": status, "node": STR, "model": STR, "slots": INT, "busy": INT, "queued": INT,
                "uptime_s": NUM}, title="Health")


def _ready() -> Schema:
    return obj({"ready": BOOL, "status": STR, "node": STR}, title="Ready")


# Every schema above by its component name (each one's title).
BODIES: dict[str, Schema] = {s["title"]: s for s in (
    _openai_error(), _anthropic_error(), _token_logprobs(), _chat_usage(), _chat_completion(), _text_completion(),
    _response(), _anthropic_message(), obj({"input_tokens": INT}, title="TokenCount"), _model_list(), _health(),
    _ready(), *_stored())}

# What a streamed answer's events are, in words, where its text/event-stream content is declared.
STREAMS = {
    "chat": "OpenAI chat.completion.chunk objects as `data:` lines, ending `data: [DONE]`; an error after the "
            "first byte is a `data: {\"error\": ...}` line",
    "completions": "text_completion chunks as `data:` lines, ending `data: [DONE]`; an error after the first byte "
                   "is a `data: {\"error\": ...}` line",
    "responses": "Responses events (`event:` + `data:`): response.created, response.in_progress, output items and "
                 "their deltas, then response.completed, response.incomplete or response.failed",
    "messages": "Anthropic events (`event:` + `data:`): message_start, ping, content_block_start/_delta/_stop, "
                "message_delta, message_stop; an `error` event if the turn breaks off",
}

ANTHROPIC_EVENTS = ["message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
                    "message_delta", "message_stop", "error"]
RESPONSES_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
                    "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                    "response.content_part.done", "response.function_call_arguments.delta",
                    "response.function_call_arguments.done", "response.output_item.done", "response.completed",
                    "response.incomplete", "response.failed"]


def _json_data(schema: Schema) -> Schema:
    """An event's `data`: JSON text of `schema` (JSON Schema's content keywords)."""
    return {"type": "string", "contentMediaType": "application/json", "contentSchema": schema}


def _stream_error() -> Schema:
    """chat_format.sse_error: an OpenAI stream's in-band error (no `param`)."""
    return obj({"error": obj({"message": STR, "type": STR, "code": nullable(STR)})})


def _chat_chunk() -> Schema:
    call = obj({"index": INT, "id": STR, "type": const("function"),
                "function": obj({"name": STR, "arguments": STR}, optional=("name",))}, optional=("id", "type"))
    delta = obj({"role": const("assistant"), "content": STR, "tool_calls": array(call)},
                optional=("role", "content", "tool_calls"))
    logprobs = obj({"content": array(ref("TokenLogprob")), "refusal": {"type": "null"}})
    choice = obj({"index": INT, "delta": delta, "finish_reason": nullable(STR), "logprobs": nullable(logprobs),
                  "stop_reason": STR}, optional=("stop_reason",))
    return obj({"id": STR, "object": const("chat.completion.chunk"), "created": INT, "model": STR,
                "choices": array(choice), "usage": ref("ChatUsage")}, optional=("usage",))


def _completion_chunk() -> Schema:
    choice = obj({"index": INT, "text": STR, "logprobs": ANY, "finish_reason": nullable(STR)})
    return obj({"id": STR, "object": const("text_completion"), "created": INT, "model": STR,
                "choices": array(choice), "usage": ref("ChatUsage")}, optional=("usage",))


def _openai_event(chunk: Schema) -> Schema:
    """One event of an OpenAI stream: no event name, a chunk or an in-band error as JSON, or the closing [DONE]."""
    return obj({"event": const("message"), "data": {"anyOf": [const("[DONE]"), _json_data(
        {"anyOf": [chunk, _stream_error()]})]}}, optional=("event",))


def _named_event(names: list[str], data: Schema) -> Schema:
    """One event of a named stream (Anthropic's, Responses'): `event:` names it, and `data` says its `type` again."""
    return obj({"event": {"type": "string", "enum": names}, "data": _json_data(data)})


def stream_events() -> dict[str, Schema]:
    """Each stream's event schema: what a text/event-stream `schema` describes for OpenAPI before 3.2 (one event,
    read as {event, data, id, retry}; 3.2 calls it itemSchema)."""
    anthropic = obj({"type": {"type": "string", "enum": ANTHROPIC_EVENTS}})
    responses = obj({"type": {"type": "string", "enum": RESPONSES_EVENTS}, "sequence_number": INT})
    return {"chat": _openai_event(_chat_chunk()), "completions": _openai_event(_completion_chunk()),
            "messages": _named_event(ANTHROPIC_EVENTS, anthropic), "responses": _named_event(RESPONSES_EVENTS, responses)}
