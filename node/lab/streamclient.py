"""One streamed chat-completions turn as the lab's clients see it: text, timings and token counts.

Works against any OpenAI-compatible server: a kvmesh node, llama.cpp's `llama-server`, or a
proxy in front of either. Token counts come from the final usage chunk (`stream_options.
include_usage`); the reused prefix from `usage.prompt_tokens_details.cached_tokens`, else from
llama-server's `timings.cache_n`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


class TurnFailed(RuntimeError):
    """A turn that did not complete: a non-200 answer (`status`), an error in the stream, or a broken stream."""

    def __init__(self, message: str, status: int = 0, retry_after_s: float = 0.0, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s  # the answer's Retry-After (an overload refusal's), 0 if none
        self.timed_out = timed_out  # no byte within the client's timeout (as an SDK's attempt times out)


@dataclass
class StreamedTurn:
    text: str = ""
    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    ttft_s: float = 0.0  # request sent -> first content
    total_s: float = 0.0
    first_at: float = 0.0  # monotonic clock of the first and last content chunks
    last_at: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    stamps: list[float] = field(default_factory=list)  # monotonic arrival of every content chunk
    parts: list[str] = field(default_factory=list, repr=False)

    def content(self, piece: str) -> None:
        """A content chunk arrived now."""
        now = time.monotonic()
        self.first_at = self.first_at or now
        self.last_at = now
        self.stamps.append(now)
        self.parts.append(piece)

    def finish(self, sent_at: float) -> None:
        """The turn ended now; `sent_at`: when its (served) request was sent."""
        done = time.monotonic()
        self.total_s = done - sent_at
        self.ttft_s = (self.first_at or done) - sent_at
        self.text = "".join(self.parts)

    @property
    def recomputed_tokens(self) -> int:
        return max(0, self.prompt_tokens - self.cached_tokens)


async def stream_chat(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                      headers: dict[str, str] | None = None) -> StreamedTurn:
    """POST `body` (stream forced on, usage asked for) to `url`; TurnFailed unless it completes."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    out = StreamedTurn()
    t0 = time.monotonic()
    try:
        async with client.stream("POST", url, json=body, headers=headers or {}) as r:
            out.status, out.headers = r.status_code, dict(r.headers)
            if r.status_code != 200:
                detail = (await r.aread())[:300].decode(errors="replace")
                retry = r.headers.get("retry-after", "")
                raise TurnFailed(f"HTTP {r.status_code}: {detail}", r.status_code,
                                 float(retry) if retry.replace(".", "", 1).isdigit() else 0.0)
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                obj = json.loads(line[6:])
                if "error" in obj:
                    err = obj["error"]
                    raise TurnFailed(err.get("message", "error in stream") if isinstance(err, dict) else str(err))
                for ch in obj.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        out.content(piece)
                _usage(out, obj)
            if not done:
                raise TurnFailed("the stream ended without [DONE]")
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        raise TurnFailed(f"{type(e).__name__}: {e}", timed_out=isinstance(e, httpx.TimeoutException)) from e
    out.finish(t0)
    return out


def _usage(out: StreamedTurn, obj: dict[str, Any]) -> None:
    u = obj.get("usage")
    if isinstance(u, dict):
        out.prompt_tokens = int(u.get("prompt_tokens") or 0)
        out.completion_tokens = int(u.get("completion_tokens") or 0)
        cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
        if cached is not None:
            out.cached_tokens = int(cached)
    t = obj.get("timings")  # llama-server's own: cache_n tokens reused, prompt_n computed
    if isinstance(t, dict) and "cache_n" in t and not out.cached_tokens:
        out.cached_tokens = int(t["cache_n"])
