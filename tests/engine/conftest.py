"""Shared engine fixtures: small engine configs, an engine factory, a turn runner.

Helpers are exposed as fixtures (not module imports) so this conftest never
collides with another directory's conftest under pytest's default import mode.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from kvmesh.node.config import EngineConfig, SimConfig
from kvmesh.node.engine.engine import Engine, GenerateRequest, TextDelta, TurnDone, TurnStats


def _tiny_cfg(**kw: object) -> EngineConfig:
    """A torch engine small enough for a 2-core CI box; CPU + fp32 so tolerances are meaningful."""
    base: dict[str, object] = dict(
        kind="tiny",
        cache_bytes=32 << 20,
        max_context=4096,
        block_size=64,
        slots=1,
        prefill_chunk=256,
        first_chunk=1024,
        device="cpu",
        dtype="float32",
    )
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


def _sim_cfg(**kw: object) -> EngineConfig:
    """A sim engine: 16 KV bytes per token, fast cost model (tests never wait on it)."""
    sim = kw.pop("sim", None) or SimConfig(kv_scale=1 / 1280, prefill_tps=1e7, decode_tps=1e6)
    base: dict[str, object] = dict(kind="sim", cache_bytes=1 << 20, block_size=16, slots=1, sim=sim)
    base.update(kw)
    return EngineConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def tiny_cfg() -> Callable[..., EngineConfig]:
    return _tiny_cfg


@pytest.fixture
def sim_cfg() -> Callable[..., EngineConfig]:
    return _sim_cfg


@pytest.fixture
def make_engine():  # type: ignore[no-untyped-def]
    """Factory: make_engine(**tiny_overrides) or make_engine(cfg=EngineConfig); closed at teardown."""
    engines: list[Engine] = []

    def make(cfg: EngineConfig | None = None, **kw: object) -> Engine:
        e = Engine(cfg if cfg is not None else _tiny_cfg(**kw))
        engines.append(e)
        return e

    yield make
    for e in engines:
        e.close()


@dataclass
class TurnResult:
    text: str
    deltas: list[str]
    stats: TurnStats
    events: list[object]  # every event, in order (including kinds this helper does not interpret)


async def _run_turn(engine: Engine, session: str, prompt, **kw: object) -> TurnResult:  # type: ignore[no-untyped-def]
    deltas: list[str] = []
    events: list[object] = []
    stats: TurnStats | None = None
    async for ev in engine.generate(GenerateRequest(session=session, prompt=prompt, **kw)):  # type: ignore[arg-type]
        assert stats is None, "an event came after TurnDone"
        events.append(ev)
        if isinstance(ev, TextDelta):
            deltas.append(ev.text)
        elif isinstance(ev, TurnDone):
            stats = ev.stats
    assert stats is not None, "the turn ended without TurnDone"
    return TurnResult("".join(deltas), deltas, stats, events)


@pytest.fixture
def run_turn():  # type: ignore[no-untyped-def]
    """Coroutine: await run_turn(engine, session, prompt, max_tokens=..., ...) -> TurnResult."""
    return _run_turn


@pytest.fixture
def turn():  # type: ignore[no-untyped-def]
    """Sync wrapper: turn(engine, session, prompt, **req_kwargs) -> TurnResult (own event loop)."""

    def go(engine: Engine, session: str, prompt, **kw: object) -> TurnResult:  # type: ignore[no-untyped-def]
        return asyncio.run(_run_turn(engine, session, prompt, **kw))

    return go


def _check_refs(engine: Engine) -> None:
    """Idle-engine invariant: every block reference is held by exactly one session table entry."""
    expected = collections.Counter(b for seq in engine.sessions.values() for b in seq.block_ids)
    actual = {blk.block_id: blk.ref for blk in engine.blocks.blocks if blk.ref}
    assert actual == dict(expected), "block ref counts disagree with the session tables"
    assert engine.blocks.num_free == engine.pool.num_blocks - len(expected)
    for h, bid in engine.blocks.by_hash.items():
        assert engine.blocks.blocks[bid].hash == h, "by_hash points at a block that holds another hash"


@pytest.fixture
def check_refs():  # type: ignore[no-untyped-def]
    return _check_refs


@pytest.fixture
def chat():  # type: ignore[no-untyped-def]
    """chat(engine, messages) -> prompt token ids via the engine's chat template."""

    def build(engine: Engine, messages: list[dict[str, str]]) -> list[int]:
        return engine.tokenizer.apply_chat_template(messages)

    return build
