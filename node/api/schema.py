"""OpenAI-compatible request and response models for /v1/chat/completions.

`ChatCompletionRequest` is also the one internal request: the Anthropic and Responses adapters
build one, and it is what a turn forwarded to a peer carries (response_format and tool_choice with
it, so the peer constrains the reply as the entry would: node.api.structured). Fields with an
effect kvmesh cannot give (penalties, logit bias, audio) are refused with a 400 naming
the field when set, never accepted and ignored; other unknown fields are tolerated, as clients
add them over time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvmesh.node.errors import InvalidRequest

TOOL_CHOICES = ("none", "auto", "required")


NOT_TEXT = "image input is not supported: kvmesh serves text-only models"
MAX_STOPS = 16  # OpenAI takes 4; Anthropic clients may send more


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") in ("image_url", "image", "input_image", "input_audio", "file"):
            raise InvalidRequest(f"{NOT_TEXT} (a content part of type {v['type']!r})", param="messages")
        return v


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=256)
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text; an object is accepted too


class AssistantToolCall(BaseModel):
    """One tool call of an earlier assistant message, as the client sends it back."""

    model_config = ConfigDict(extra="ignore")
    id: str = Field("", max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[AssistantToolCall] | None = Field(None, max_length=512)


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    # OpenAI's rule for function names, so a request that works here works there.
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _schema_object(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError('parameters must be a JSON Schema of an object ({"type": "object", "properties": ...})')
        return v


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: ChosenFunction


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


_REFUSED = {
    "logit_bias": "kvmesh does not bias logits",
    "frequency_penalty": "kvmesh does not apply repetition penalties",
    "presence_penalty": "kvmesh does not apply repetition penalties",
    "functions": "the legacy functions field is not supported; send tools",
    "function_call": "the legacy function_call field is not supported; send tool_choice",
    "audio": "kvmesh serves text only",
    "prediction": "predicted outputs are not supported",
    "grammar": "GBNF grammars are not supported; send response_format with a JSON schema",
    "continue_final_message": "continuing the final assistant message is not supported",
}


def llama_json_schema(v: Any) -> Any:
    """llama.cpp's top-level `json_schema` (a bare JSON Schema) as the response_format it means."""
    if not isinstance(v, dict) or v.get("json_schema") is None:
        return v
    if v.get("response_format") is not None:
        raise InvalidRequest("send json_schema or response_format, not both", param="json_schema")
    schema = v["json_schema"]
    if not isinstance(schema, dict):
        raise InvalidRequest("json_schema must be a JSON object (a JSON Schema)", param="json_schema")
    rest = {k: x for k, x in v.items() if k != "json_schema"}
    return rest | {"response_format": {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema,
                                                                              "strict": True}}}


def check_response_format(v: dict[str, Any]) -> dict[str, Any]:
    """A response_format's shape: a 400 saying what is wrong in it (the schema itself compiles later)."""
    kind = v.get("type")
    if kind not in ("text", "json_object", "json_schema"):
        raise InvalidRequest(f'response_format.type must be "text", "json_object" or "json_schema", not {kind!r}',
                             param="response_format")
    js = v.get("json_schema")
    if kind == "json_schema" and not isinstance(js, dict):
        raise InvalidRequest('response_format: {"type": "json_schema"} needs "json_schema": {"name": ..., '
                             '"schema": {...}, "strict": true}', param="response_format")
    schema = js.get("schema") if kind == "json_schema" and isinstance(js, dict) else v.get("schema")
    if schema is not None and not isinstance(schema, dict):
        raise InvalidRequest("response_format: the schema must be a JSON object (a JSON Schema)", param="response_format")
    if isinstance(js, dict) and js.get("strict") not in (None, True, False):
        raise InvalidRequest("response_format.json_schema.strict must be true or false", param="response_format")
    return v


def _is_set(name: str, value: Any) -> bool:
    """Whether a refused field asks for something (its default or an explicit no-op is fine)."""
    if value is None or value is False or value == 0 or value == {} or value == []:
        return False
    return True


def refuse_unhonoured(v: Any, refused: Mapping[str, str]) -> Any:
    """A before-validator's body, for every dialect: a 400 naming the first field of `refused` (field
    -> why kvmesh cannot honour it) that the request sets to something; the request as it came otherwise."""
    if isinstance(v, dict):
        for name, why in refused.items():
            if _is_set(name, v.get(name)):
                raise InvalidRequest(f"{name}: {why}", param=name, code="unsupported_parameter")
    return v


def check_role_order(messages: list[ChatMessage]) -> None:
    """A 400 for sequences no chat template renders faithfully: a tool result that follows no
    assistant message, or names a call the assistant did not make; two assistant messages in a
    row; an assistant message with no content (null) and no calls."""
    calls: set[str] = set()
    prev = ""
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role == "assistant":
            if prev == "assistant":
                raise InvalidRequest(f"{where}: two assistant messages in a row; merge them into one", param="messages")
            if m.content is None and not m.tool_calls:  # an empty reply ("") is still a reply
                raise InvalidRequest(f"{where}: an assistant message needs content or tool_calls", param="messages")
            calls = {c.id for c in m.tool_calls or [] if c.id}
        elif m.role == "tool":
            # A tool output after a plain assistant message is tolerated (agents paste outputs so).
            if prev not in ("assistant", "tool"):
                raise InvalidRequest(f"{where}: a tool message must follow an assistant message (or another tool "
                                     "message)", param="messages")
            if calls and m.tool_call_id is not None and m.tool_call_id not in calls:
                raise InvalidRequest(f"{where}: tool_call_id {m.tool_call_id!r} names no call of the assistant "
                                     "message before it", param="messages")
        prev = m.role


class ChatCompletionRequest(BaseModel):
    # Unknown fields are tolerated (clients add them over time); the ones with an effect
    # kvmesh cannot give are refused by name (_REFUSED), the ones we honour validated.
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1, max_length=100_000)
    max_tokens: int | None = Field(None, ge=1, le=1_000_000)
    max_completion_tokens: int | None = Field(None, ge=1, le=1_000_000)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = Field(0, ge=0, le=1_000_000)  # llama.cpp's and vLLM's extension; 0: off
    ignore_eos: bool = False  # llama.cpp's and vLLM's extension: generate max_tokens whatever is sampled
    n: int = Field(1, ge=1, le=16)  # choices, each from the one prefill (node.api.choices)
    user: str | None = Field(None, max_length=512)
    tools: list[ToolDef] | None = Field(None, max_length=512)
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    logprobs: bool = False  # each content token's log probability (the model's own), in choice.logprobs
    top_logprobs: int | None = Field(None, ge=0, le=20)  # and its likeliest alternatives; needs logprobs
    # {"type": "text" | "json_object" | "json_schema", ...}: kept as sent, so the hop carries it whole (node.api.structured)
    response_format: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if v is None else check_response_format(v)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice(cls, v: Any) -> Any:
        if isinstance(v, str) and v not in TOOL_CHOICES:
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if any(not s or len(s) > 256 for s in items):
            raise ValueError("stop sequences must be 1-256 characters")
        return v

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, v: Any) -> Any:
        """Fields whose effect kvmesh cannot give, refused when set (the message names the field); llama.cpp's
        json_schema taken as the response_format it means."""
        return llama_json_schema(refuse_unhonoured(v, _REFUSED))

    @model_validator(mode="after")
    def _role_order(self) -> ChatCompletionRequest:
        check_role_order(self.messages)
        if self.top_logprobs and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def token_budget(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def messages_as_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump() for m in self.messages]

    def tools_as_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as OpenAI sends them (unset fields left out, as a template expects)."""
        return None if self.tools is None else [t.model_dump(exclude_none=True) for t in self.tools]

    def tool_choice_value(self) -> str | dict[str, Any]:
        """"auto" unless set; a named choice as its OpenAI object."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return self.tool_choice.model_dump()
        return self.tool_choice or "auto"

    def check_tools(self) -> None:
        """What one field cannot say alone: unique names, and a tool_choice that names a declared tool."""
        names = [t.function.name for t in self.tools or []]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup is not None:
            raise InvalidRequest(f"tools: the function name {dup!r} is declared twice", param="tools")
        choice = self.tool_choice
        if choice == "required" and not names:
            raise InvalidRequest('tool_choice "required" needs tools', param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise InvalidRequest(f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                                 param="tool_choice")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
