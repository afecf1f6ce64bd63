"""What a turn takes and yields: the request `Engine.generate` runs, the events it streams
(`TurnBegin`, `TextDelta`, `TurnDone`) and the turn's stats; and the engine's running counters.

Plain data, no engine in it: the API, the mesh and kv_share build and read these without
the engine's machinery (they are importable from `node.engine.engine` too).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import numpy as np


@dataclass
class GenerateRequest:
    session: str
    prompt: list[int] | np.ndarray
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False  # decode past end-of-turn tokens, to max_tokens (benchmarks: fixed lengths)
    constraint: str | None = None  # an llguidance grammar every token follows (node.engine.constraint); None: free
    top_logprobs: int | None = None  # None: no log probabilities; k: each token's and its k likeliest alternatives'


@dataclass
class TurnStats:
    session: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int = 0
    finish_reason: str = "length"
    stop_sequence: str | None = None  # the stop string that ended the answer, if one did
    queue_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0
    ttft_s: float = 0.0
    total_s: float = 0.0


@dataclass
class TurnBegin:
    """First event of every turn: the slot is held and the reused prefix is known."""

    stats: TurnStats


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log probability (the model's own log-softmax) and its likeliest alternatives."""

    token: bytes
    logprob: float
    top: tuple[tuple[bytes, float], ...] = ()


@dataclass
class TextDelta:
    text: str
    logprobs: list[TokenLogprob] | None = None  # the tokens whose text is out with this delta (asked for only)


@dataclass
class TurnDone:
    stats: TurnStats


@dataclass
class EngineCounters:
    turns: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0
    evicted_sessions: int = 0
    imported_blocks: int = 0
    imports_refused: int = 0
    restores_failed: int = 0  # cached blocks the runner could not restore (the turn recomputed)
    prefill_s: float = 0.0
    recent_prefill_tps: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=16))
