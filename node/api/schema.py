"""OpenAI-compatible request and response models for /v1/chat/completions."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    # Unknown OpenAI fields (logprobs, tools, ...) are accepted and ignored, as
    # most OpenAI-compatible servers do; the ones we honour are validated.
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
    n: int = Field(1, ge=1, le=1)
    user: str | None = Field(None, max_length=512)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if len(items) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s or len(s) > 256 for s in items):
            raise ValueError("stop sequences must be 1-256 characters")
        return v

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def token_budget(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def messages_as_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump() for m in self.messages]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail
