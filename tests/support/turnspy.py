"""What an in-process engine ran, turn by turn: each prompt's ids beside what its session held before it.

A test's probe on a real engine: it wraps the engine's `run` (once per admitted turn) and reads the session's
resident tokens as the turn starts, so a test can say what reuse the turn could have had at most, token by
token, whatever client sent it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvmesh.node.kvshare.store.manifest import common_prefix


@dataclass
class SpiedTurn:
    session: str
    prompt: list[int]
    held: list[int]  # the session's tokens in the KV cache as the turn started (prompts and replies before it)

    @property
    def max_reuse(self) -> int:
        """The token-level common prefix of what was held and this prompt (one token is always computed)."""
        return min(common_prefix(self.held, self.prompt), len(self.prompt) - 1)


class TurnSpy:
    def __init__(self, engine: Any) -> None:
        self.turns: list[SpiedTurn] = []
        prefix = engine.prefix
        inner = engine.run

        async def run(adm: Any) -> AsyncIterator[Any]:
            held = prefix.tokens(adm.req.session)
            self.turns.append(SpiedTurn(adm.req.session, [int(t) for t in adm.tokens],
                                        [] if held is None else [int(t) for t in held]))
            async for ev in inner(adm):
                yield ev

        engine.run = run
