"""What a whole answer makes of the tool-call parser's events (sans-I/O).

`ToolCallParser` (node.api.toolcalls) turns the model's text into these events (they are answer
events, defined in node.mesh.answer, so a peer's answer reads back into them); a streamed answer
sends them as deltas, a whole one `assemble`s them into a `Reply`.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvmesh.node.mesh.answer import ContentDelta, ToolCallArgs, ToolCallEnd, ToolCallStart, ToolEvent

__all__ = ["ContentDelta", "Reply", "ToolCall", "ToolCallArgs", "ToolCallEnd", "ToolCallStart", "ToolEvent", "assemble",
           "coalesce", "merge", "new_call_id"]


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return "call_" + secrets.token_hex(12)


def merge(out: list[ToolEvent], ev: ToolEvent) -> None:
    """Append, joining a content or arguments fragment to the one before it."""
    last = out[-1] if out else None
    if isinstance(ev, ContentDelta):
        if not ev.text:
            return
        if isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + ev.text)
            return
    elif isinstance(ev, ToolCallArgs):
        if not ev.text:
            return
        if isinstance(last, ToolCallArgs) and last.index == ev.index:
            out[-1] = ToolCallArgs(ev.index, last.text + ev.text)
            return
    out.append(ev)


def coalesce(events: Iterable[ToolEvent]) -> list[ToolEvent]:
    """The same events with adjacent content / same-call argument fragments joined."""
    out: list[ToolEvent] = []
    for ev in events:
        merge(out, ev)
    return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, object]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Reply:
    """A whole answer: its content and its complete tool calls (broken calls are content)."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def assemble(events: Iterable[ToolEvent]) -> Reply:
    reply = Reply()
    open_calls: dict[int, ToolCall] = {}
    for ev in events:
        if isinstance(ev, ContentDelta):
            reply.content += ev.text
        elif isinstance(ev, ToolCallStart):
            open_calls[ev.index] = ToolCall(ev.id, ev.name, "")
        elif isinstance(ev, ToolCallArgs):
            open_calls[ev.index].arguments += ev.text
        else:
            call = open_calls.pop(ev.index)
            if ev.broken is None:
                reply.calls.append(call)
            else:
                reply.content += ev.broken
    return reply
