"""A load's turns sent through the official Anthropic SDK, retries and all: what an agent behind it lives.

`kvmesh load --sdk anthropic` and `bench policies --sdk anthropic` send each turn as `AsyncAnthropic
.messages.stream(...)` with the SDK's own retry loop (`max_retries` = the client model's retries, its
default 2; its own backoff, its own reading of Retry-After) and `timeout` = the client model's. The
SDK hides its attempts, so httpx event hooks on its transport count them: every request it sends (the
last one's send time is where the served attempt's TTFT starts) and every refusal (429/529) it read.
What the SDK raises in the end says how the turn failed: a refusal it stopped retrying, a timeout, or
an error.
"""

from __future__ import annotations

import importlib
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from kvmesh.node.lab.clientmodel import ClientModel
from kvmesh.node.lab.streamclient import StreamedTurn

# The refusals an overloaded mesh answers (node.mesh.admission; Anthropic's dialect says 529).
OVERLOAD_STATUSES = (429, 529)


@dataclass
class Attempts:
    """One turn's attempts as the SDK's transport saw them."""

    sent: list[float] = field(default_factory=list)  # monotonic send time of each attempt
    refused: int = 0


@dataclass
class SdkOutcome:
    """A turn's end: `turn` when served, else `failure` is "refused", "timeout" or "error" (with `error`)."""

    attempts: Attempts
    turn: StreamedTurn | None = None
    failure: str | None = None
    error: str = ""
    status: int = 0


_current: ContextVar[Attempts | None] = ContextVar("kvmesh_sdk_attempts", default=None)


def _sdk_http(sdk: Any) -> Any:
    """The HTTP package the SDK is built on (httpx, or httpx2 in its later releases): its objects are the ones it takes."""
    return importlib.import_module(sdk.DefaultAsyncHttpxClient.__mro__[1].__module__.partition(".")[0])


async def _on_request(request: Any) -> None:
    a = _current.get()
    if a is not None:
        a.sent.append(time.monotonic())


async def _on_response(response: Any) -> None:
    a = _current.get()
    if a is not None and response.status_code in OVERLOAD_STATUSES:
        a.refused += 1


def anthropic_messages(messages: list[dict[str, str]]) -> tuple[str | None, list[dict[str, str]]]:
    """The load's chat messages as Anthropic's: system messages become `system`, a tool's output a user turn."""
    system = "\n\n".join(m["content"] for m in messages if m["role"] == "system") or None
    out = [{"role": "assistant" if m["role"] == "assistant" else "user", "content": m["content"]}
           for m in messages if m["role"] != "system"]
    return system, out


class AnthropicSender:
    """One AsyncAnthropic per entry node, all over one httpx client whose hooks count each turn's attempts."""

    def __init__(self, client: ClientModel, headers: dict[str, str], max_connections: int) -> None:
        import anthropic  # the test extra's; imported here so the rest of the lab never needs it

        self._anthropic = anthropic
        self._client = client
        # The SDK's own transport (its HTTP package, its keep-alive options), with the hooks that count attempts.
        self._httppkg = _sdk_http(anthropic)
        # Not a line per request (its HTTP package) or per retry (the SDK's own) on stderr: the load counts them.
        for name in (self._httppkg.__name__, anthropic.__name__):
            logging.getLogger(name).setLevel(logging.WARNING)
        self._http = anthropic.DefaultAsyncHttpxClient(
            limits=self._httppkg.Limits(max_connections=max_connections),
            event_hooks={"request": [_on_request], "response": [_on_response]})
        self._key = headers.get("x-api-key") or "kvmesh-load"  # a node without client keys ignores it
        self._sdks: dict[str, Any] = {}

    def _sdk(self, entry: str) -> Any:
        if entry not in self._sdks:
            self._sdks[entry] = self._anthropic.AsyncAnthropic(
                api_key=self._key, base_url=entry, max_retries=self._client.retries,
                timeout=self._httppkg.Timeout(self._client.timeout_s, connect=5), http_client=self._http)
        return self._sdks[entry]

    async def turn(self, entry: str, model: str, session: str, messages: list[dict[str, str]],
                   max_tokens: int) -> SdkOutcome:
        """One streamed Messages turn at `entry`, retried by the SDK."""
        ant = self._anthropic
        attempts = Attempts()
        token = _current.set(attempts)
        out = StreamedTurn()
        system, msgs = anthropic_messages(messages)
        extra: dict[str, Any] = {"system": system} if system else {}
        try:
            async with self._sdk(entry).messages.stream(
                    model=model, max_tokens=max_tokens, messages=msgs,
                    extra_headers={"X-Session-Id": session}, **extra) as stream:
                out.status, out.headers = stream.response.status_code, dict(stream.response.headers)
                async for piece in stream.text_stream:
                    out.content(piece)
                final = await stream.get_final_message()
        except ant.APIStatusError as e:
            refused = e.status_code in OVERLOAD_STATUSES
            return SdkOutcome(attempts, failure="refused" if refused else "error", status=e.status_code,
                              error=f"HTTP {e.status_code}: {str(e)[:300]}")
        except ant.APITimeoutError as e:
            return SdkOutcome(attempts, failure="timeout", error=f"timed out: {e}")
        except (ant.APIError, self._httppkg.HTTPError) as e:  # a stream broken after its headers
            return SdkOutcome(attempts, failure="error", error=f"{type(e).__name__}: {str(e)[:300]}")
        finally:
            _current.reset(token)
        out.finish(attempts.sent[-1] if attempts.sent else time.monotonic())
        usage = final.usage
        out.cached_tokens = int(getattr(usage, "cache_read_input_tokens", 0) or 0)
        out.prompt_tokens = int(usage.input_tokens) + out.cached_tokens  # input_tokens: those computed
        out.completion_tokens = int(usage.output_tokens)
        return SdkOutcome(attempts, turn=out)

    async def aclose(self) -> None:
        await self._http.aclose()
