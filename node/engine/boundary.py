"""The engine boundary: the one small protocol kv_share, mesh and the API program against.

`EngineAPI` lists exactly what those parts use of an engine today, nothing more, so
every back end (the torch decoder, the sim cost model, llama.cpp)
satisfies it by providing these members. Block bookkeeping (pool, chained hashes,
LRU, pins) exists once, in the engine's parts (`sessiontable`, `prefix`, `export_import`); back ends differ in how they
compute a block's bytes and where those bytes live.

Grouped by who uses what (grep of node/kvshare, node/mesh, node/api, node/node.py):
- identity and geometry (kv_share, mesh, API): fingerprint, block_size, block_bytes,
  kv_bytes_per_token, model_name, tokenizer;
- what the engine holds (kv_share, mesh): sessions, cached_prefix, resident_tokens,
  session_tokens, block_hash;
- moving KV (kv_share): export (pinned block views), pin (blocks pinned for another thread
  to read), begin_import (an `ImportAPI`),
  and for the store's write-behind, `blocks` (pin by hash) and `pool` (read bytes);
- turns (mesh): admit (validation, the session's lock, a slot), then run (the turn path imports a
  stored replica in between); `Engine.generate`, both at once, is for benches and tests;
- load (mesh placement): slots, prefill_rate.
`evict` is not here: nothing outside the engine evicts a session today (the engine
evicts LRU itself and reports it through the `on_evict` hook the node sets; the node
tells kv_share, `KVShare.engine_evicted`, which names it when a handoff finds less here).

Attributes are declared as read-only properties: callers only read them, and a
plain attribute of the concrete engine satisfies a read-only protocol member.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from kvmesh.node.engine.tokenizer import Tokenizer

# ---- what a turn takes and yields (plain data: the API, the mesh and kv_share build and read these) ----


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

    def __post_init__(self) -> None:
        # A token the model gives no chance has log probability -inf, which JSON cannot carry: floored at
        # LOGPROB_FLOOR, as vLLM and OpenAI report it, wherever the figure came from (engine, vLLM, a peer).
        object.__setattr__(self, "logprob", floor_logprob(self.logprob))
        if any(not v >= LOGPROB_FLOOR for _, v in self.top):
            object.__setattr__(self, "top", tuple((t, floor_logprob(v)) for t, v in self.top))


LOGPROB_FLOOR = -9999.0


def floor_logprob(v: float) -> float:
    """`v`, or LOGPROB_FLOOR where it is below it, -inf or NaN."""
    return v if v >= LOGPROB_FLOOR else LOGPROB_FLOOR


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
    settled_tokens: int = 0  # of prefill_tokens: cells turns' ends recomputed so the next turn keeps them exactly
    prefill_s: float = 0.0
    recent_prefill_tps: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=16))


@dataclass
class Admission:
    """An admitted turn: its validated prompt, its slot, when it asked. Holds the session's lock and the
    slot until `release` (idempotent), which `Engine.run` calls when the turn ends; a caller that does not
    run it calls it."""

    req: GenerateRequest
    tokens: np.ndarray
    slot: int
    t0: float
    _release: Callable[[], None]
    _released: bool = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release()


# ---- blocks leaving an engine ----


@dataclass(frozen=True)
class ExportedBlock:
    index: int
    hash: bytes
    tokens: np.ndarray  # [block_size] int32
    data: memoryview  # the block's KV bytes (zero-copy on CPU)


@dataclass
class PinnedBlocks:
    """A session's full blocks, pinned in the pool; a thread other than the pinning one may read
    their bytes. `release` (idempotent) unpins them once no thread reads them any more."""

    ids: list[int]
    hashes: list[bytes]
    tokens: np.ndarray  # [len(ids) * block_size] the pinned blocks' token ids
    read: Callable[[int], memoryview]  # a block's bytes by id (a host copy when the pool is on an accelerator)
    _release: Callable[[list[int]], None]
    _released: bool = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._release(self.ids)


@runtime_checkable
class ImportAPI(Protocol):
    """A replica import in progress: blocks reserved, bytes landing, hashes advertised on commit."""

    @property
    def missing(self) -> list[int]:
        """Indices of the blocks the engine lacks, in order: the ones to write."""

    def buffer(self, i: int) -> memoryview:
        """Writable bytes of block i (raises RuntimeError where the pool is not in host memory)."""

    def write(self, i: int, data: memoryview | bytes | np.ndarray) -> None:
        """Copy block i's bytes in."""

    def commit(self) -> int:
        """Advertise the written blocks and make them the session's table; returns its tokens."""

    def abort(self) -> None:
        """Nothing of this import becomes visible."""


@runtime_checkable
class BlockPins(Protocol):
    """Pinning blocks by hash, so a reader on another thread keeps them while it reads."""

    def lookup(self, h: bytes, tokens: np.ndarray) -> int | None:
        """The block holding exactly these tokens under this chain hash, if the pool still has it."""

    def acquire(self, bid: int) -> None:
        """Take a reference on a block: the pool cannot reuse it until it is released."""

    def release(self, bids: list[int]) -> None:
        """Drop references taken by `acquire`."""

    @property
    def num_free(self) -> int:
        """Blocks no session holds (for the KV-in-use gauge)."""


@runtime_checkable
class PoolBytes(Protocol):
    """Reading a pinned block's KV bytes."""

    def read_bytes(self, block_id: int) -> memoryview:
        """One block's bytes: a zero-copy view in host memory, a host copy otherwise."""

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""


@runtime_checkable
class SlotLoad(Protocol):
    """How busy the engine's slots are (placement's inputs)."""

    @property
    def slots(self) -> int: ...

    @property
    def busy(self) -> int: ...

    @property
    def queued(self) -> int: ...

    @property
    def queued_tokens(self) -> int: ...

    def mean_turn_s(self) -> float: ...


@runtime_checkable
class EngineAPI(Protocol):
    """An engine as kv_share, mesh and the API see it (see the module docstring)."""

    @property
    def fingerprint(self) -> str:
        """Names the model, KV dtype/layout and block size: replicas cross only between equal fingerprints."""

    @property
    def block_size(self) -> int: ...

    @property
    def block_bytes(self) -> int: ...

    @property
    def kv_bytes_per_token(self) -> int: ...

    @property
    def model_name(self) -> str: ...

    @property
    def inexact_reason(self) -> str | None:
        """Why this model's cache cannot be cut into blocks (then it has no replicas), or None."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def sessions(self) -> Collection[str]:
        """Ids of the sessions whose caches are resident."""

    def cached_prefix(self, session: str, token_ids: list[int] | np.ndarray) -> int:
        """How many leading tokens of `token_ids` the engine holds right now (from its own state)."""

    def resident_tokens(self, session: str) -> int: ...

    def session_tokens(self, session: str) -> np.ndarray | None: ...

    def block_hash(self, session: str, i: int) -> bytes | None:
        """The chain hash of the session's i-th full block, if the engine holds that block."""

    def export(self, session: str, from_block: int = 0) -> AbstractContextManager[list[ExportedBlock]]:
        """The session's full blocks from `from_block`, pinned while the context is open."""

    def pin(self, session: str) -> PinnedBlocks | None:
        """The session's full blocks pinned for readers on other threads; None when there is none."""

    def begin_import(self, session: str, fingerprint: str, tokens: np.ndarray, hashes: list[bytes]) -> ImportAPI:
        """Check a replica's fingerprint and hash chain, then reserve blocks for what is missing."""

    @property
    def blocks(self) -> BlockPins: ...

    @property
    def pool(self) -> PoolBytes: ...

    async def admit(self, req: GenerateRequest) -> Admission:
        """Validate the turn (raising the API's errors), then wait for its session's lock and a slot."""

    def run(self, adm: Admission) -> AsyncIterator[TurnBegin | TextDelta | TurnDone]:
        """Run an admitted turn: TurnBegin, TextDeltas, then TurnDone; releases the admission at its end."""

    @property
    def slots(self) -> SlotLoad: ...

    def prefill_backlog(self) -> int:
        """Prompt tokens of running turns still to be prefilled: work a new turn's prefill shares."""

    def prefill_rate(self) -> float:
        """Measured prefill tokens/s, for placement's TTFT estimates."""
