"""A runner whose replies follow a script: the sim's `scripted_reply` (test only).

It wraps the real runner, which still computes (the sim's cost model, its KV bytes) and
stores every block; only the logits it returns are replaced, so that sampling picks the
script's next token at each step and the end-of-turn token after it. Everything above
the runner (slots, prefix reuse, stop strings, the API's tool-call parsing, the mesh)
runs as it does for any reply.
"""

from __future__ import annotations

import numpy as np
import torch

from kvmesh.node.engine.runner import Runner


class ScriptedRunner:
    """A Runner: `inner`'s work, the script's tokens."""

    def __init__(self, inner: Runner, script: list[int], end_id: int) -> None:
        self.inner = inner
        self.script = list(script)
        self.end_id = end_id
        self._step: dict[int, int] = {}  # slot -> index of the script token its next logits pick

    async def load(self, slot: int, block_ids: list[int], tokens: np.ndarray) -> int | None:
        self._step[slot] = 0  # a turn begins: the script starts over
        return await self.inner.load(slot, block_ids, tokens)

    async def forward(self, slot: int, tokens: np.ndarray, start: int) -> torch.Tensor:
        logits = await self.inner.forward(slot, tokens, start)
        i = self._step.get(slot, 0)
        self._step[slot] = i + 1
        out = torch.full_like(logits, float("-inf"))
        out[self.script[i] if i < len(self.script) else self.end_id] = 0.0
        return out

    async def store(self, slot: int, block_id: int, block_index: int, block_hash: bytes | None) -> None:
        await self.inner.store(slot, block_id, block_index, block_hash)

    def close(self) -> None:
        self.inner.close()
