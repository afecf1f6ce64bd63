"""One answer, whatever dialect asked for it: the events a turn's reply is made of.

Every dialect renders the same events: the tool-call parser's (`ContentDelta`, `ToolCallStart`,
`ToolCallArgs`, `ToolCallEnd`; `Logprobs` after the text they score, when asked for), then `Finish`
with the usage, or `Failed` when the turn broke off
after its first byte. They come from a turn running here (`local_events`), from a peer's chat SSE
answer (`ChatChunks`, sans-I/O: bytes in, events out) or from a peer's whole chat completion
(`completion_events`): a turn that enters as Messages or Responses runs on any host.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvmesh.node.api.toolcalls import ToolCallParser
from kvmesh.node.api.toolevents import ContentDelta, ToolCallArgs, ToolCallEnd, ToolCallStart, ToolEvent
from kvmesh.node.engine.engine import TextDelta
from kvmesh.node.engine.turns import TokenLogprob
from kvmesh.node.errors import KVMeshError
from kvmesh.node.mesh.turn import HostTurn

# Makes a fresh tool-call parser for one answer; None when the request has no tools to call.
ParserFactory = Callable[[], ToolCallParser | None]


@dataclass(frozen=True)
class Finish:
    """The answer's end: why it stopped ("stop", "length", "tool_calls") and the turn's token counts."""

    finish_reason: str
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    stop_sequence: str | None = None  # the stop string that ended it
    logprobs: tuple[TokenLogprob, ...] = ()  # a whole answer's (collect gathers them), when asked for


@dataclass(frozen=True)
class Logprobs:
    """Log probabilities of the tokens whose text the events before it carried (chat's logprobs)."""

    entries: tuple[TokenLogprob, ...]


@dataclass(frozen=True)
class Failed:
    """The turn broke off after the client was sent its first byte (said in-band)."""

    message: str
    type: str = "server_error"
    code: str | None = None
    status: int = 500


AnswerEvent = ToolEvent | Logprobs | Finish | Failed


class AnswerError(KVMeshError):
    """A turn that failed elsewhere (a peer refused it, or it broke off), to say in the client's dialect."""

    def __init__(self, status: int, message: str, type_: str = "server_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type_, code or str(status), param


async def collect(events: AsyncIterator[AnswerEvent]) -> tuple[list[ToolEvent], Finish]:
    """A whole answer: its events and its end (a failure raised as the error it was). The events are read to
    their end, so a turn run here lets go of its slot and session now, not when its generator is collected."""
    out: list[ToolEvent] = []
    logprobs: list[TokenLogprob] = []
    async for ev in events:
        if isinstance(ev, Failed):
            raise AnswerError(ev.status, ev.message, ev.type, ev.code)
        if isinstance(ev, Finish):
            async for _ in events:
                pass
            return out, dataclasses.replace(ev, logprobs=tuple(logprobs)) if logprobs else ev
        if isinstance(ev, Logprobs):
            logprobs.extend(ev.entries)
        else:
            out.append(ev)
    raise AnswerError(502, "the turn's answer ended before it finished", "server_error", "peer_lost")


def finish_reason(engine_reason: str, calls: int) -> str:
    """"tool_calls" when the model stopped after calling (a cut-off answer stays "length", as OpenAI's)."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


async def local_events(run: HostTurn, new_parser: ParserFactory) -> AsyncIterator[AnswerEvent]:
    """A turn running here: its text through the tool-call parser, then Finish (or Failed)."""
    parser = new_parser()
    events = run.stream()
    try:
        async for ev in events:
            if isinstance(ev, TextDelta):
                for te in parser.feed(ev.text) if parser is not None else [ContentDelta(ev.text)]:
                    yield te
                if ev.logprobs:
                    yield Logprobs(tuple(ev.logprobs))
                continue
            for te in parser.finish() if parser is not None else []:
                yield te
            s = ev.stats
            yield Finish(finish_reason(s.finish_reason, parser.calls if parser is not None else 0), s.prompt_tokens,
                         s.cached_tokens, s.completion_tokens, s.stop_sequence)
    except KVMeshError as e:
        yield Failed(str(e), e.type, e.code, e.status)
    finally:
        await events.aclose()


def peer_logprobs(choice: dict[str, Any]) -> Logprobs | None:
    """A peer's chat choice.logprobs (OpenAI's shape) back as the tokens' log probabilities, if it has any."""
    content = (choice.get("logprobs") or {}).get("content") if isinstance(choice.get("logprobs"), dict) else None
    if not isinstance(content, list) or not content:
        return None

    def tok(e: dict[str, Any]) -> bytes:
        b = e.get("bytes")
        return bytes(b) if isinstance(b, list) else str(e.get("token", "")).encode()

    try:
        return Logprobs(tuple(TokenLogprob(tok(e), float(e["logprob"]),
                                           tuple((tok(t), float(t["logprob"])) for t in e.get("top_logprobs") or []))
                              for e in content))
    except (KeyError, TypeError, ValueError):
        return None  # a malformed peer answer loses its log probabilities, never the turn


def _usage_of(obj: dict[str, Any]) -> tuple[int, int, int]:
    u = obj.get("usage") or {}
    cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return int(u.get("prompt_tokens") or 0), int(cached), int(u.get("completion_tokens") or 0)


class ChatChunks:
    """A chat SSE answer (a peer's, already spliced) as answer events: feed(bytes) -> events."""

    def __init__(self) -> None:
        self._buf = b""
        self._open: list[int] = []  # tool calls started and not yet ended, by index
        self._finish: tuple[str, str | None] | None = None
        self.done = False

    def feed(self, data: bytes) -> list[AnswerEvent]:
        self._buf += data
        out: list[AnswerEvent] = []
        while not self.done and (end := self._buf.find(b"\n\n")) >= 0:
            event, self._buf = self._buf[:end].strip(), self._buf[end + 2:]
            if event.startswith(b"data:"):
                out.extend(self._data(event[5:].strip()))
        return out

    def end(self) -> list[AnswerEvent]:
        """The stream closed: what is owed if it closed without its [DONE]."""
        if self.done:
            return []
        self.done = True
        if self._finish is None:
            return [Failed("the serving host's answer ended before it was whole", "server_error", "peer_lost")]
        return [*self._close_calls(), Finish(self._finish[0], stop_sequence=self._finish[1])]

    def _data(self, data: bytes) -> list[AnswerEvent]:
        if data == b"[DONE]":
            return self.end()
        try:
            obj = json.loads(data)
        except ValueError:
            return []
        if not isinstance(obj, dict):
            return []
        if "error" in obj:
            self.done = True
            err = obj["error"] if isinstance(obj["error"], dict) else {}
            return [Failed(str(err.get("message", "the serving host failed")), str(err.get("type", "server_error")),
                           err.get("code"))]
        choices = obj.get("choices") or []
        if not choices:
            if obj.get("usage") and self._finish is not None:  # the usage chunk, after the finish
                self.done = True
                return [*self._close_calls(), Finish(self._finish[0], *_usage_of(obj), stop_sequence=self._finish[1])]
            return []
        choice = choices[0]
        out = self._delta(choice.get("delta") or {})
        if scored := peer_logprobs(choice):
            out.append(scored)
        if choice.get("finish_reason"):
            self._finish = (str(choice["finish_reason"]), choice.get("stop_reason"))
        return out

    def _delta(self, delta: dict[str, Any]) -> list[AnswerEvent]:
        out: list[AnswerEvent] = []
        if isinstance(delta.get("content"), str) and delta["content"]:
            out.append(ContentDelta(delta["content"]))
        for tc in delta.get("tool_calls") or []:
            i, fn = int(tc.get("index", 0)), tc.get("function") or {}
            if fn.get("name"):
                out += self._close_calls()  # calls come one after another
                self._open.append(i)
                out.append(ToolCallStart(i, str(tc.get("id") or ""), str(fn["name"])))
            if fn.get("arguments"):
                out.append(ToolCallArgs(i, str(fn["arguments"])))
        return out

    def _close_calls(self) -> list[AnswerEvent]:
        out: list[AnswerEvent] = [ToolCallEnd(i) for i in self._open]
        self._open.clear()
        return out


async def rendered(start: list[bytes], feed: Callable[[AnswerEvent], list[bytes]],
                   events: AsyncIterator[AnswerEvent]) -> AsyncIterator[bytes]:
    """A dialect's stream: its opening events, then what its sans-I/O renderer makes of each answer event."""
    for b in start:
        yield b
    async for ev in events:
        for b in feed(ev):
            yield b


async def chunk_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[AnswerEvent]:
    """A peer's relayed chat SSE answer as answer events."""
    parse = ChatChunks()
    async for chunk in chunks:
        for ev in parse.feed(chunk):
            yield ev
    for ev in parse.end():
        yield ev


def completion_events(obj: dict[str, Any]) -> list[AnswerEvent]:
    """A peer's whole chat.completion as answer events."""
    choice = (obj.get("choices") or [{}])[0]
    msg = choice.get("message") or {}
    out: list[AnswerEvent] = [ContentDelta(msg["content"])] if msg.get("content") else []
    if msg.get("content") and (scored := peer_logprobs(choice)):
        out.append(scored)
    for i, tc in enumerate(msg.get("tool_calls") or []):
        fn = tc.get("function") or {}
        out += [ToolCallStart(i, str(tc.get("id") or ""), str(fn.get("name") or "")),
                ToolCallArgs(i, str(fn.get("arguments") or "")), ToolCallEnd(i)]
    out.append(Finish(str(choice.get("finish_reason") or "stop"), *_usage_of(obj),
                      stop_sequence=choice.get("stop_reason")))
    return out
