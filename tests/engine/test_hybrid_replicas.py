"""GGUFs with recurrent state move between hosts exactly: a hybrid (generated, LFM2's layout: convolution layers with
recurrent state between attention layers) as blocks of its attention cache and its recurrent state in snapshots, a
recurrent-only one (Mamba's) as blocks holding no cell and the snapshot (node.engine.snapshots).

A recurrent state exists only where its sequence ends, so the runner snapshots it at the prompt's last block
boundary and at each block boundary a reply crosses; a turn resumes at the newest snapshot its prompt extends."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_exactness import MAX_LOGIT_DIFF, STEPS, _turn
from test_llamacpp import prompt

from kvmesh.node.config import EngineConfig, LlamaCppConfig
from kvmesh.node.engine import llamastate
from kvmesh.node.engine.engine import Engine
from kvmesh.node.engine.llamacpp import LlamaRunner
from kvmesh.node.lab import testmodels
from kvmesh.node.lab.bench.exactness import move_replica


@pytest.fixture(scope="module", params=["hybrid-tiny", "mamba-tiny"])
def gguf(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return testmodels.write_gguf(tmp_path_factory.mktemp("rec") / f"{request.param}.gguf", testmodels.spec_for(request.param))


def _engine(path: Path) -> Engine:
    return Engine(EngineConfig(model=str(path), slots=1, block_size=64, max_context=2048, cache_tokens=2048,
                               llamacpp=LlamaCppConfig(threads=2, n_batch=256)))


def test_a_moved_session_continues_exactly(gguf: Path) -> None:
    """A turn on A, its blocks and newest snapshot on B: B's next turn reuses up to the snapshot and its 64 greedy
    tokens and logits equal A's own next turn, which resumes at the same snapshot from its own slot (no block restored)."""
    home, away = _engine(gguf), _engine(gguf)
    try:
        _turn(home, prompt(700), 20, session="gate")
        tokens, pos = move_replica(home, away, "gate")
        assert pos == len(tokens) > 640  # the reply crossed a block boundary: a snapshot there
        held = home.session_tokens("gate")
        assert held is not None
        p2 = [int(t) for t in held] + prompt(50, seed=2)[1:]
        assert isinstance(home.runner, LlamaRunner)
        restored_before = home.runner.restored_blocks
        on_b, logits_b, _, done_b = _turn(away, p2, STEPS, session="gate")
        on_a, logits_a, _, done_a = _turn(home, p2, STEPS, session="gate")
        assert done_b.stats.cached_tokens == done_a.stats.cached_tokens == pos
        assert home.runner.restored_blocks == restored_before  # the home kept its own attention cache
        assert away.snapshots is not None and away.snapshots.restored == 1
        assert on_a == on_b and len(on_a) == STEPS
        assert max(float((a - b).abs().max()) for a, b in zip(logits_a, logits_b)) <= MAX_LOGIT_DIFF
    finally:
        home.close()
        away.close()


def test_blocks_carry_no_recurrent_state_and_an_edit_resumes_at_the_snapshot_before_it(gguf: Path) -> None:
    """Every block ends in the layout's empty recurrent section, and one with a state in it is refused; a prompt that
    edits a token after the 640-token snapshot resumes there (a live cache recomputed everything), one that edits
    token 10 recomputes; a snapshot claiming another position is refused."""
    e = _engine(gguf)
    try:
        assert isinstance(e.runner, LlamaRunner)
        lay = e.runner.layout
        assert lay.bare and lay.recurrent > 0 and len(lay.tail) > 8
        p1 = prompt(700)
        _turn(e, p1, 4, session="s")
        with e.export("s") as blocks:
            assert all(bytes(b.data[-len(lay.tail):]) == lay.tail for b in blocks)
            assert all(llamastate.check(b.data, lay, b.index * 64, 64) is None for b in blocks)
            bad = bytearray(blocks[0].data)
            bad[-1] ^= 0xFF
            assert "carries the first cache only" in (llamastate.check(bytes(bad), lay, 0, 64) or "")
            tokens = np.concatenate([b.tokens for b in blocks])
        edited = [*p1[:680], p1[680] + 1, *p1[681:]]
        _, _, _, done = _turn(e, edited, 4, session="s")
        assert done.stats.cached_tokens == 640
        early = [*p1[:10], p1[10] + 1, *p1[11:]]
        _, _, _, done = _turn(e, early, 4, session="s")
        assert done.stats.cached_tokens == 0
        assert e.snapshots is not None
        w = e.snapshots.newest(tokens)
        assert w is not None
        why = e.snapshots.put(tokens[: w.pos - 64], w.blob)
        assert why is not None and "not" in why and str(w.pos - 65) in why
    finally:
        e.close()
