"""Anthropic Messages requests, and their translation into the one internal (chat) request.

What each field becomes:
- `system` (a string or text blocks) -> one system message. The block Claude Code sends as
  `x-anthropic-billing-header: ...; cch=<changes every request>;` is dropped: it is billing
  metadata, not an instruction, and its volatile `cch=` would end the cached prefix at the very
  start of every prompt (llama.cpp #21793, vLLM #36829).
- user `text` blocks -> user text; `tool_result` blocks -> tool messages (before the user's text),
  their content a string or text blocks, `is_error` said as an "Error: " prefix on the result.
- assistant `text` -> content; `tool_use` -> tool_calls (input as JSON text); `thinking` and
  `redacted_thinking` blocks of earlier turns are dropped, as Anthropic's API does.
- `tools` (`input_schema`, `strict`) -> function tools; `tool_choice` auto/any/tool/none -> auto/
  required/named/none, `disable_parallel_tool_use` -> parallel_tool_calls false: any/tool constrain
  the reply to calls of the tools' schemas (node.api.structured), auto constrains a call once begun.
- `output_config.format` (structured outputs, what `messages.parse(output_format=...)` sends) ->
  a strict json_schema response_format: the reply is JSON of that schema.
- `max_tokens`, `stop_sequences`, `temperature`, `top_p`, `top_k` -> the engine's own.
- `metadata.user_id` names the session (node.api.sessionid); `cache_control` is accepted: every
  prefix is cached anyway. `thinking` is accepted and has no effect (no served template thinks);
  the answer says so in `X-Kvmesh-Ignored: thinking`.
Refused with a 400: image and document blocks (text-only models), server tools (web search,
bash, text editor: declare a custom tool), `mcp_servers`, `container`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvmesh.node.api.schema import MAX_STOPS, NOT_TEXT, ChatCompletionRequest, refuse_unhonoured
from kvmesh.node.errors import InvalidRequest

BILLING_HEADER = "x-anthropic-billing-header:"
_NOT_TEXT_BLOCKS = ("image", "document", "search_result", "container_upload")
_REFUSED = {"mcp_servers": "MCP connectors are not supported; run the MCP client in the agent",
            "container": "code execution containers are not supported"}


def _refuse_not_text(v: Any) -> Any:
    if isinstance(v, dict) and v.get("type") in _NOT_TEXT_BLOCKS:
        raise InvalidRequest(f"{NOT_TEXT} (a {v['type']!r} content block)", param="messages")
    return v


class _Block(BaseModel):
    model_config = ConfigDict(extra="ignore")  # cache_control, citations: nothing to do with them

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, v: Any) -> Any:
        return _refuse_not_text(v)


class TextBlock(_Block):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Block):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=256)
    input: dict[str, Any] = Field(default_factory=dict)


class ToolResultBlock(_Block):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool = False


class ThinkingBlock(_Block):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class MessageParam(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant"]
    content: str | list[Block]

    @model_validator(mode="before")
    @classmethod
    def _blocks_text_only(cls, v: Any) -> Any:
        if isinstance(v, dict) and isinstance(v.get("content"), list):
            for b in v["content"]:
                _refuse_not_text(b)
        return v


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None  # every keyword of input_schema enforced (node.api.structured)

    @model_validator(mode="before")
    @classmethod
    def _custom_only(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") not in (None, "custom"):
            raise InvalidRequest(f"tools: the server tool {v.get('type')!r} is not supported here; declare it as a "
                                 "custom tool (name, description, input_schema) and run it in the client", param="tools")
        return v


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class Metadata(BaseModel):
    model_config = ConfigDict(extra="ignore")
    user_id: str | None = Field(None, max_length=4096)


class CountTokensRequest(BaseModel):
    """POST /v1/messages/count_tokens: a Messages request without max_tokens."""

    model_config = ConfigDict(extra="ignore")  # anthropic-version-era fields come and go
    model: str = Field(min_length=1, max_length=256)
    messages: list[MessageParam] = Field(min_length=1, max_length=100_000)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=512)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, v: Any) -> Any:
        return refuse_unhonoured(v, _REFUSED)

    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        kept = [b.text for b in self.system if not b.text.lstrip().startswith(BILLING_HEADER)]
        return "\n\n".join(kept) or None

    def to_chat(self, *, max_tokens: int = 1, stream: bool = False, **sampling: Any) -> ChatCompletionRequest:
        """The internal request (the Anthropic parts it has no field for are said in the docstring above)."""
        messages: list[dict[str, Any]] = []
        if (system := self.system_text()) is not None:
            messages.append({"role": "system", "content": system})
        for m in self.messages:
            for out in _converted(m):
                last = messages[-1] if messages else None
                if last is not None and last["role"] == out["role"] == "assistant":
                    _merge(last, out)  # Anthropic joins consecutive turns of one role
                else:
                    messages.append(out)
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "stream": stream,
                                **{k: v for k, v in sampling.items() if v is not None}}
        if self.tools:
            body["tools"] = [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                                                **({"description": t.description} if t.description else {}),
                                                                **({"strict": t.strict} if t.strict is not None else {})}}
                             for t in self.tools]
        if self.tool_choice is not None:
            c = self.tool_choice
            if c.type == "tool" and not c.name:
                raise InvalidRequest('tool_choice {"type": "tool"} needs a name', param="tool_choice")
            body["tool_choice"] = ({"type": "function", "function": {"name": c.name}} if c.type == "tool"
                                   else {"auto": "auto", "any": "required", "none": "none"}[c.type])
            body["parallel_tool_calls"] = not c.disable_parallel_tool_use
        return validated_chat(body)


class MessagesRequest(CountTokensRequest):
    """POST /v1/messages."""

    max_tokens: int = Field(ge=1, le=1_000_000)
    stop_sequences: list[str] | None = Field(None, max_length=MAX_STOPS)
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None
    output_config: dict[str, Any] | None = None  # its `format` (structured outputs) is honoured; `effort` does nothing

    @model_validator(mode="after")
    def _stops(self) -> MessagesRequest:
        if any(not s or len(s) > 256 for s in self.stop_sequences or []):
            raise InvalidRequest("stop_sequences: each is 1-256 characters", param="stop_sequences")
        return self

    def response_format(self) -> dict[str, Any] | None:
        """`output_config.format` ({"type": "json_schema", "schema": ...}) as chat's response_format, strict
        as Anthropic's structured outputs are."""
        fmt = (self.output_config or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise InvalidRequest('output_config.format must be {"type": "json_schema", "schema": {...}}',
                                 param="output_config")
        return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True}}

    def chat(self) -> ChatCompletionRequest:
        return self.to_chat(max_tokens=self.max_tokens, stream=self.stream, temperature=self.temperature,
                            top_p=self.top_p, top_k=self.top_k, stop=self.stop_sequences or None,
                            response_format=self.response_format())


def validated_chat(body: dict[str, Any]) -> ChatCompletionRequest:
    """The internal request, or a 400 saying what in it is wrong (never a validation traceback)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidRequest(f"invalid request: {where}: {first.get('msg')}", param=where.split(".")[0] or None) from None


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text for b in content)


def _converted(m: MessageParam) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results first, then the text."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts = [b.text for b in m.content if isinstance(b, TextBlock)]
    if m.role == "assistant":
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(
            b.input, ensure_ascii=False)}} for b in m.content if isinstance(b, ToolUseBlock)]
        if not texts and not calls:
            return []  # thinking only: dropped, as Anthropic drops earlier turns' thinking
        out: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            out["tool_calls"] = calls
        return [out]
    results = [{"role": "tool", "tool_call_id": b.tool_use_id,
                "content": ("Error: " if b.is_error else "") + _text(b.content)}
               for b in m.content if isinstance(b, ToolResultBlock)]
    if any(isinstance(b, ToolUseBlock) for b in m.content):
        raise InvalidRequest("messages: tool_use blocks belong in assistant messages", param="messages")
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _merge(into: dict[str, Any], more: dict[str, Any]) -> None:
    into["content"] = (into.get("content") or "") + (more.get("content") or "")
    if more.get("tool_calls"):
        into["tool_calls"] = [*(into.get("tool_calls") or []), *more["tool_calls"]]
