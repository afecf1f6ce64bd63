"""OpenAI Responses requests, and their translation into the one internal (chat) request.

Both ways a client keeps a conversation are served. Codex CLI's: `store=false` and the whole conversation in
`input` every turn (a string, or items: `message` with input_text / output_text parts, `function_call`,
`function_call_output`; `reasoning` items of earlier turns are dropped, as thinking is). And the stored one
(OpenAI's default, the Agents SDK's): `store=true` keeps the response and its conversation with the session
(node.responses), and `previous_response_id` continues it: the stored conversation (that response's whole
input, then its output) comes first, this request's `input` after it. `instructions` become the system
message; as OpenAI's, only this request's count (a previous response's are not carried over).
Function `tools`, `tool_choice`, `parallel_tool_calls`, `max_output_tokens`, `temperature`, `top_p` map to
their chat fields. `prompt_cache_key` (and Codex's `session_id` header) names the session; a follow-up runs
in its chain's session, whatever it names.

`reasoning` and `include` are accepted and have no effect (no served template reasons); the
answer says so in `X-Kvmesh-Ignored`, except `include` asking for `message.output_text.logprobs`,
which is honoured (with `top_logprobs`): each output_text part and delta carries its tokens' log
probabilities. `text.format` (json_schema, json_object) is honoured: it
becomes chat's response_format (node.api.structured constrains the reply). Refused with a 400
naming the field: non-function tools (web_search, file_search, local_shell, custom), image and
file input, `background`, `conversation` (OpenAI's Conversations API is not served).
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvmesh.node.api.anthropic_schema import validated_chat
from kvmesh.node.api.schema import NOT_TEXT, ChatCompletionRequest, refuse_unhonoured
from kvmesh.node.errors import InvalidRequest

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_REFUSED = {
    "background": "background responses are not supported",
    "conversation": "the Conversations API is not served here; chain responses with previous_response_id, or send "
                    "the whole conversation in input",
}
_ITEM_ID = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


class Part(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str = ""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") in ("input_image", "input_file", "input_audio"):
            raise InvalidRequest(f"{NOT_TEXT} (an {v['type']!r} part)", param="input")
        if isinstance(v, dict) and v.get("type") == "refusal":
            return {"type": "refusal", "text": v.get("refusal", "")}
        return v


class Item(BaseModel):
    """One input item; which fields matter depends on its type."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    id: str | None = Field(None, max_length=256)
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[Part] | None = None
    call_id: str | None = Field(None, max_length=256)
    name: str | None = Field(None, max_length=256)
    arguments: str | None = None
    output: str | list[Part] | None = None

    @model_validator(mode="before")
    @classmethod
    def _reasoning_dropped(cls, v: Any) -> Any:
        # An earlier turn's reasoning is dropped whole: its content parts (reasoning_text) are not read.
        if isinstance(v, dict) and v.get("type") == "reasoning":
            return {"type": "reasoning"}
        return v

    @model_validator(mode="after")
    def _complete(self) -> Item:
        need = {"message": ("role",), "function_call": ("call_id", "name"), "function_call_output": ("call_id",)}
        missing = [f for f in need.get(self.type, ()) if getattr(self, f) is None]
        if missing:
            raise ValueError(f"a {self.type} item needs {', '.join(missing)}")
        return self

    def stored(self) -> dict[str, Any] | None:
        """The item as a stored response lists it (input_items: Responses' item shape, with an id); None for
        reasoning, which is dropped."""
        rid = self.id or _ITEM_ID.get(self.type, "item_") + uuid.uuid4().hex[:24]
        if self.type == "message":
            return {"type": "message", "id": rid, "role": self.role, "status": "completed",
                    "content": _parts(self.content, self.role == "assistant")}
        if self.type == "function_call":
            return {"type": "function_call", "id": rid, "call_id": self.call_id, "name": self.name,
                    "arguments": self.arguments or "{}", "status": "completed"}
        if self.type == "function_call_output":
            return {"type": "function_call_output", "id": rid, "call_id": self.call_id, "output": _text(self.output),
                    "status": "completed"}
        return None


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _functions_only(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "function":
            raise InvalidRequest(f"tools: the {v.get('type')!r} tool is not supported here; declare a function tool "
                                 "and run it in the client", param="tools")
        return v


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # metadata, service_tier, truncation, safety_identifier: no effect to give

    model: str = Field(min_length=1, max_length=256)
    input: str | list[Item] = Field(min_length=1)
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=512)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, min_length=1, max_length=1024)
    prompt_cache_key: str | None = Field(None, max_length=1024)
    user: str | None = Field(None, max_length=512)
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)  # with include's logprobs: the likeliest alternatives
    text: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, v: Any) -> Any:
        return refuse_unhonoured(v, _REFUSED)

    @model_validator(mode="after")
    def _top_logprobs_needs_include(self) -> ResponsesRequest:
        if self.top_logprobs and not self.logprobs:  # as chat's top_logprobs without logprobs: never ignored
            raise InvalidRequest(f"top_logprobs needs include {[LOGPROBS_INCLUDE]}", param="top_logprobs")
        return self

    @property
    def logprobs(self) -> bool:
        """Whether the client asked for the output text's log probabilities."""
        return LOGPROBS_INCLUDE in (self.include or [])

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's response_format (json_schema's name, schema and strict sit in it flat here)."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise InvalidRequest("text.format must be an object", param="text")
        if fmt.get("type") == "json_schema":
            return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
        return fmt

    def ignored(self) -> list[str]:
        """Fields accepted with no effect, to say so in X-Kvmesh-Ignored."""
        # Other `include` items (Codex sends reasoning.encrypted_content) have nothing to return here.
        unused = [i for i in self.include or [] if i != LOGPROBS_INCLUDE]
        return [n for n, v in (("reasoning", self.reasoning), ("include", unused)) if v]

    def items(self) -> list[Item]:
        """`input` as items (a string is one user message)."""
        return [Item(role="user", content=self.input)] if isinstance(self.input, str) else self.input

    def stored_items(self) -> list[dict[str, Any]]:
        """This request's input as a stored response keeps it (node.responses.record)."""
        return [d for it in self.items() if (d := it.stored()) is not None]

    def chat(self, history: list[Item] | None = None) -> ChatCompletionRequest:
        """The internal request: the instructions, then `history` (a stored conversation this continues), then
        `input`."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        for it in [*(history or []), *self.items()]:
            _add(messages, it)
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream,
                                "parallel_tool_calls": self.parallel_tool_calls, "user": self.user,
                                "response_format": self.response_format()}
        body |= {k: v for k, v in (("max_tokens", self.max_output_tokens), ("temperature", self.temperature),
                                   ("top_p", self.top_p)) if v is not None}
        if self.logprobs:
            body |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if self.tool_choice is not None:
            c = self.tool_choice
            body["tool_choice"] = ({"type": "function", "function": {"name": c.get("name")}}
                                   if isinstance(c, dict) else c)
        return validated_chat(body)


def _text(content: str | list[Part] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(p.text for p in content)


def _parts(content: str | list[Part] | None, assistant: bool) -> list[dict[str, Any]]:
    kind = "output_text" if assistant else "input_text"
    if content is None or isinstance(content, str):
        content = [Part(type="input_text", text=content or "")]
    out: list[dict[str, Any]] = []
    for p in content:
        if p.type == "refusal":
            out.append({"type": "refusal", "refusal": p.text})
        elif kind == "output_text":
            out.append({"type": kind, "text": p.text, "annotations": []})
        else:
            out.append({"type": kind, "text": p.text})
    return out


def _add(messages: list[dict[str, Any]], it: Item) -> None:
    """Append one item: a function call joins the assistant message before it (one turn's calls are one message)."""
    last = messages[-1] if messages else None
    if it.type == "message":
        messages.append({"role": it.role, "content": _text(it.content)})
    elif it.type == "function_call":
        call = {"id": it.call_id, "type": "function", "function": {"name": it.name, "arguments": it.arguments or "{}"}}
        if last is not None and last["role"] == "assistant":
            last["tool_calls"] = [*(last.get("tool_calls") or []), call]
        else:
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif it.type == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": it.call_id, "content": _text(it.output)})
