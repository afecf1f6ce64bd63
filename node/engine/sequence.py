"""A session's resident cache on one engine: its tokens and its block table."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sequence:
    session: str
    tokens: np.ndarray  # int32: every token whose KV is stored, in order
    block_ids: list[int]  # ceil(len(tokens) / block_size) entries; the last may be partial
    hashes: list[bytes]  # one per *full* block
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class Match:
    """What the engine holds of a prompt: `tokens` leading tokens, from these blocks."""

    tokens: int
    block_ids: list[int]  # one per block touched by the match (the last may be partly used)
    full_blocks: int  # leading blocks reused whole
    hashes: list[bytes]  # the prompt's full-block hashes (all of them, matched or not)
