"""The vLLM engine: two real vLLM processes (one core each) sharing blocks through kvmesh's connector.

A turn on A stores its blocks into A's shared pool; the blocks copied into B's pool (as kv_share lands
them) are loaded by B's vLLM on the next turn (its own metrics say so), and B's greedy answer equals A's.
A block whose bytes were corrupted is refused and recomputed; the same corruption with a digest that
matches it is loaded and changes the answer (so loads are really used).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvmesh.node.config import EngineConfig, VllmConfig
from kvmesh.node.engine.boundary import EngineAPI, GenerateRequest, TextDelta, TurnDone, TurnStats
from kvmesh.node.engine.vllm.engine import VllmEngine
from kvmesh.node.engine.vllm.layout import SEALED

VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
needs_vllm = pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="vLLM's venv is absent: run `make vllm` (make test does)")
pytestmark = [needs_vllm, pytest.mark.timeout(900)]

QUESTION = [{"role": "user", "content": "Tell me about the history of Rome, its emperors and its roads. " * 40}]


def vllm_cfg(core: str) -> EngineConfig:
    return EngineConfig(kind="vllm", model="smollm2", slots=2, max_context=4096, cache_tokens=16384,
                        vllm=VllmConfig(cpu_cores=core, kvcache_gib=1))


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[VllmEngine, VllmEngine]]:
    a = VllmEngine(vllm_cfg("0"), name="test-a")
    try:
        b = VllmEngine(vllm_cfg("1"), name="test-b")
    except BaseException:
        a.close()
        raise
    try:
        yield a, b
    finally:
        a.close()
        b.close()


async def _turn(e: VllmEngine, session: str, prompt: list[int], n: int) -> tuple[str, list[float], TurnStats]:
    deltas: list[TextDelta] = []
    stats = None
    async for ev in e.generate(GenerateRequest(session, prompt, max_tokens=n, temperature=0.0, top_logprobs=0)):
        if isinstance(ev, TextDelta):
            deltas.append(ev)
        elif isinstance(ev, TurnDone):
            stats = ev.stats
    assert stats is not None
    return "".join(d.text for d in deltas), [lp.logprob for d in deltas for lp in d.logprobs or []], stats


def turn(e: VllmEngine, session: str, prompt: list[int], n: int = 32) -> tuple[str, list[float], TurnStats]:
    return asyncio.run(_turn(e, session, prompt, n))


def ship(src: VllmEngine, dst: VllmEngine, session: str, as_session: str) -> int:
    """The session's whole blocks from src's pool into dst's, as kv_share lands a replica."""
    with src.export(session) as blocks:
        tokens = src.session_tokens(session)
        assert tokens is not None
        return dst.import_blocks(as_session, src.fingerprint, tokens[: len(blocks) * src.block_size],
                                 [b.hash for b in blocks], [b.data for b in blocks])


def metric(e: VllmEngine, name: str) -> float:
    text = httpx.get(f"{e.server.url}/metrics", timeout=10).text
    return sum(float(m) for m in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M))


def test_vllm_serves_smollm2_and_its_connector_stores_blocks(engines: tuple[VllmEngine, VllmEngine]) -> None:
    """A vLLM process serves SmolLM2 (converted from the packaged GGUF); the turn's full blocks land in the pool, sealed."""
    a, b = engines
    assert isinstance(a, EngineAPI)  # what kv_share, the mesh and the API program against
    assert a.fingerprint == b.fingerprint  # same model, dtype, vLLM version and KV layout
    prompt = a.tokenizer.apply_chat_template(QUESTION)
    text, logprobs, stats = turn(a, "rome", prompt)
    assert text.strip() and len(logprobs) == stats.completion_tokens > 0
    seq = a.table.get("rome")
    assert seq is not None and len(seq.hashes) == (len(prompt) + stats.completion_tokens - 1) // a.block_size >= 2
    assert all(int(a.pool.file.states[bid]) == SEALED for bid in seq.block_ids)
    assert a.pool.file.check(seq.block_ids[0])


def test_a_replica_moved_to_another_vllm_is_loaded_and_answers_exactly(engines: tuple[VllmEngine, VllmEngine]) -> None:
    """B's vLLM loads A's blocks from its own pool (external prefix-cache hits) and B's greedy answer equals A's."""
    a, b = engines
    prompt = a.tokenizer.apply_chat_template(QUESTION)
    first, _, _ = turn(a, "move", prompt)
    follow = a.tokenizer.apply_chat_template(QUESTION + [{"role": "assistant", "content": first},
                                                         {"role": "user", "content": "And Greece?"}])
    landed = ship(a, b, "move", "move")
    assert landed >= 2 * a.block_size
    hits = metric(b, "vllm:external_prefix_cache_hits_total")
    there, lp_there, st_there = turn(b, "move", follow, 48)
    assert metric(b, "vllm:external_prefix_cache_hits_total") - hits == landed
    assert st_there.cached_tokens == landed and b.counters.restores_failed == 0
    here, lp_here, _ = turn(a, "move", follow, 48)
    assert there == here
    assert max(abs(x - y) for x, y in zip(lp_there, lp_here)) <= 0.05


def test_a_corrupted_block_is_refused_and_recomputed(engines: tuple[VllmEngine, VllmEngine]) -> None:
    """Negative control: a block whose bytes no longer match its digest is not loaded; vLLM recomputes it, the
    answer is unchanged and the node stops advertising the block. Sealed over the bad bytes, it is loaded and
    the answer changes: the loads are what B's vLLM uses."""
    a, b = engines
    prompt = a.tokenizer.apply_chat_template(QUESTION)
    want, _, _ = turn(a, "control", prompt, 24)
    b.evict_all()
    ship(a, b, "control", "bad")
    asyncio.run(b.pool.seals(list(range(b.pool.num_blocks))))
    seq = b.table.get("bad")
    assert seq is not None
    bid = seq.block_ids[0]
    b.pool.file.blocks[bid][:] = 0
    failed = b.counters.restores_failed
    got, _, stats = turn(b, "bad", prompt, 24)
    assert got == want
    assert b.counters.restores_failed == failed + 1 and stats.cached_tokens == 0
    assert b.blocks.blocks[bid].hash is None  # forgotten: no longer matched by its hash
    # The positive control: the same zeroed bytes, sealed as if they were right, are loaded and used.
    b.evict_all()
    ship(a, b, "control", "zeroed")
    asyncio.run(b.pool.seals(list(range(b.pool.num_blocks))))
    seq = b.table.get("zeroed")
    assert seq is not None
    b.pool.file.blocks[seq.block_ids[0]][:] = 0
    b.pool.file.seal(seq.block_ids[0])
    garbled, _, _ = turn(b, "zeroed", prompt, 24)
    assert garbled != want


def test_a_vllm_that_died_is_started_again_and_its_sessions_stay_warm(engines: tuple[VllmEngine, VllmEngine]) -> None:
    """vLLM killed under the node: the next turn starts it again, and the session's blocks, still in the shared
    pool, are loaded by the new process (warm, though vLLM's own prefix cache died with the old one)."""
    a, _ = engines
    prompt = a.tokenizer.apply_chat_template(QUESTION)
    want, _, _ = turn(a, "crash", prompt, 8)
    proc = a.server.proc
    assert proc is not None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    got, _, stats = turn(a, "crash", prompt, 8)
    assert got == want and a.restarts == 1 and a.server.alive()
    assert stats.cached_tokens == (len(prompt) - 1) // a.block_size * a.block_size
