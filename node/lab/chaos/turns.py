"""The drills' turns: conversations, one turn's result, the record replayed on the reference, and the load.

Every answered turn, the drill's own and the coding-agent workload's, is recorded as a `Pair` so
the runner can replay it on a reference node that never fails and compare the replies.
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Any

import httpx

from kvmesh.node.lab.load import LoadRunner, LoadShape
from kvmesh.node.lab.workload import system_prompt, text

MODEL = "kvmesh-sim"


@dataclass
class Pair:
    """One answered turn: what was sent and what came back (replayed on the reference)."""

    source: str
    session: str
    messages: list[dict[str, str]]
    max_tokens: int
    temperature: float
    seed: int | None
    reply: str
    prompt_tokens: int | None = None


@dataclass
class TurnResult:
    """One turn the drill drove: how it ended, where it ran, what it reused."""

    ok: bool = False
    status: int = 0
    text: str = ""
    host: str = ""
    handoff: str = ""
    cached: int = 0
    prompt_tokens: int = 0
    error: str = ""
    seconds: float = 0.0
    created: int | None = None  # the serving node's wall clock (the answer's `created`), in seconds

    @property
    def reused(self) -> float:
        return self.cached / max(1, self.prompt_tokens)

    def brief(self) -> dict[str, Any]:
        return {"ok": self.ok, "host": self.host, "handoff": self.handoff, "prompt_tokens": self.prompt_tokens,
                "cached_tokens": self.cached, "seconds": round(self.seconds, 2), **({"error": self.error} if self.error else {})}


class Conv:
    """A drill conversation: deterministic from its seed, grows by a reply and a tool output per turn."""

    def __init__(self, session: str, seed: int, chars: int) -> None:
        self.session = session
        self.rng = random.Random(seed)
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": system_prompt(self.rng, chars)},
            {"role": "user", "content": "Build the to-do app from the spec. " + text(self.rng, 200)},
        ]

    def grow(self, reply: str, tool_chars: int = 300) -> None:
        self.messages += [{"role": "assistant", "content": reply}, {"role": "tool", "content": text(self.rng, tool_chars)}]


class DrillLoad(LoadRunner):
    """The coding-agent workload, recording every answered turn and stoppable at a phase boundary."""

    def __init__(self, entries: list[str], shape: LoadShape, pairs: list[Pair]) -> None:
        super().__init__(entries, shape, model=MODEL)
        self.pairs = pairs

    async def turn(self, client: httpx.AsyncClient, session: str, messages: list[dict[str, str]], *,
                   max_tokens: int | None = None) -> str | None:
        sent = copy.deepcopy(messages)
        reply = await super().turn(client, session, messages, max_tokens=max_tokens)
        if reply is not None:
            self.pairs.append(Pair("load", session, sent, max_tokens or self.shape.max_tokens, 0.0, None, reply))
        return reply

    def stop(self) -> None:
        self._stop.set()  # LoadRunner ends at this event; no other way to end it at a chosen moment

