"""One answer, whatever dialect asked for it: gathering and rendering a turn's answer events.

The events (node.mesh.answer) come from `TurnPath.serve` whether the turn ran here or on a peer:
the tool-call parser's (`ContentDelta`, `ToolCallStart`, `ToolCallArgs`, `ToolCallEnd`;
`Logprobs` after the text they score, when asked for), then `Finish` with the usage, or `Failed`
when the turn broke off after its first byte. A streamed answer is `rendered` by its dialect's
sans-I/O renderer; a whole one is `collect`ed from the same events.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable

from kvmesh.node.engine.boundary import TokenLogprob
from kvmesh.node.mesh.answer import AnswerError, AnswerEvent, Failed, Finish, Logprobs, ToolEvent


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


async def rendered(start: list[bytes], feed: Callable[[AnswerEvent], list[bytes]],
                   events: AsyncIterator[AnswerEvent]) -> AsyncIterator[bytes]:
    """A dialect's stream: its opening events, then what its sans-I/O renderer makes of each answer event."""
    for b in start:
        yield b
    async for ev in events:
        for b in feed(ev):
            yield b
