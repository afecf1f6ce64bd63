"""A sliding-window model (the real Gemma 3 270M, window 512) is served and replicated exactly with swa_full.

Its blocks hold llama.cpp's two caches (full-attention layers, then window layers), every position of both,
so a replica restores bit-identically past the window; the fingerprint names that format.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_exactness import _turn

from kvmesh.node.config import EngineConfig, LlamaCppConfig
from kvmesh.node.engine import llamastate
from kvmesh.node.engine.engine import Engine
from kvmesh.node.engine.llamacpp import LlamaRunner
from kvmesh.node.lab.workload import text


def _engine(swa: str = "full") -> Engine:
    return Engine(EngineConfig(model="gemma3-270m", slots=1, max_context=4096, cache_tokens=4096,
                               llamacpp=LlamaCppConfig(threads=2, swa=swa)))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def gemma() -> tuple[Engine, Engine]:
    home, away = _engine(), _engine()
    yield home, away
    home.close()
    away.close()


def test_gemma3_blocks_hold_both_caches(gemma: tuple[Engine, Engine]) -> None:
    """Gemma 3's state is two cache sections, 3 full-attention layers then 15 window layers, and the fingerprint says so."""
    home, _ = gemma
    assert isinstance(home.runner, LlamaRunner) and home.runner.model.n_swa == 512
    lay = home.runner.layout
    assert [sec.n_layer for sec in lay.sections] == [3, 15]
    assert home.block_bytes == lay.size(home.block_size)
    assert home.block_size == 256  # a 32k context cuts into >= 128 blocks of 256


def test_gemma3_replica_past_the_window_restores_bit_identically(gemma: tuple[Engine, Engine]) -> None:
    """A ~1.8k-token conversation (over three windows) moved to another engine as blocks continues with logits bit-identical
    to the home engine's continuation from the same whole blocks, and the same greedy tokens."""
    home, away = gemma
    rng = random.Random(3)
    msgs = [{"role": "user", "content": "Read this:\n" + text(rng, 9000) + "\nWhat is it about?"}]
    whole = home.tokenizer.apply_chat_template(msgs)
    p1 = list(whole[: len(whole) // home.block_size * home.block_size])  # whole blocks: home's slot holds just these
    assert len(p1) >= 3 * 512
    _turn(home, p1, 1)
    with home.export("gate") as blocks:
        tokens = np.concatenate([b.tokens for b in blocks])
        hashes, data = [b.hash for b in blocks], [bytes(b.data) for b in blocks]
        assert all(llamastate.check(d, home.runner.layout, i * home.block_size, home.block_size) is None  # type: ignore[attr-defined]
                   for i, d in enumerate(data))
    assert len(tokens) == len(p1) and away.import_blocks("gate", home.fingerprint, tokens, hashes, data) == len(p1)
    p2 = p1 + home.tokenizer.encode(" And in one word?")
    on_b, logits_b, _, done_b = _turn(away, p2, 16)
    assert done_b.stats.cached_tokens == len(p1)
    on_a, logits_a, _, _ = _turn(home, p2, 16)  # home continues from its own slot, where the session never moved
    assert on_b == on_a
    diffs = [float((a - b).abs().max()) for a, b in zip(logits_a, logits_b)]
    assert max(diffs) == 0.0, diffs
