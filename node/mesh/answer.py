"""One answer, wherever its turn ran: the events a turn's reply is made of.

`TurnPath.serve` (node.mesh.turn) hands back an `Answer`: the turn's headers and one stream of
these events, whether the turn runs here (`local_events`: the engine's text through the
tool-call parser) or on a peer (node.mesh.forward reads the hop's answer into them, and splices a
stream resumed on another host from them). The events are the tool-call parser's
(`ContentDelta`, `ToolCallStart`, `ToolCallArgs`, `ToolCallEnd`; `Logprobs` after the text they
score, when asked for), then `Finish` with the usage, or `Failed` when the turn broke off after
its first byte. Every dialect (node.api) renders these events once; the mesh never renders.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from kvmesh.node.engine.boundary import TokenLogprob
from kvmesh.node.engine.engine import TextDelta, TurnDone
from kvmesh.node.errors import KVMeshError


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    broken: str | None = None  # the call's raw text when its JSON never completed


ToolEvent = ContentDelta | ToolCallStart | ToolCallArgs | ToolCallEnd


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


class TextParser(Protocol):
    """What finds tool calls in the model's text as it streams (node.api.toolcalls.ToolCallParser)."""

    calls: int

    def feed(self, text: str) -> list[ToolEvent]: ...

    def finish(self) -> list[ToolEvent]: ...


# Makes a fresh tool-call parser for one answer; None when the request has no tools to call.
ParserFactory = Callable[[], TextParser | None]


def no_parser() -> TextParser | None:
    """A request without tools to call: its text is all content."""
    return None


@dataclass
class Answer:
    """A turn under way: what the client is told about it (headers), the prompt's token counts known
    so far, and its events. Errors before its first byte were raised by `TurnPath.serve`."""

    headers: dict[str, str]
    prompt_tokens: int
    cached_tokens: int
    events: AsyncIterator[AnswerEvent]


def finish_reason(engine_reason: str, calls: int) -> str:
    """"tool_calls" when the model stopped after calling (a cut-off answer stays "length", as OpenAI's)."""
    return "tool_calls" if calls and engine_reason == "stop" else engine_reason


async def local_events(stream: AsyncGenerator[TextDelta | TurnDone, None], new_parser: ParserFactory) -> AsyncIterator[AnswerEvent]:
    """A turn running here (`HostTurn.stream()`): its text through the tool-call parser, then Finish (or Failed)."""
    parser = new_parser()
    try:
        async for ev in stream:
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
        await stream.aclose()


async def listed(events: list[AnswerEvent]) -> AsyncIterator[AnswerEvent]:
    """A whole answer's events as a stream."""
    for ev in events:
        yield ev
