"""Gemma 3 270M (window 512) in window mode: bare blocks plus a window snapshot move a session exactly.

llama.cpp keeps the window layers' last window only (`llamacpp.swa = "window"`); a block holds the full-attention
layers, and the window layers' cells travel as a snapshot taken at the prompt's last block boundary. The exactness
gate: the next turn on B from A's blocks and snapshot is the next turn on A (64 greedy tokens, logits within 0.05).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from test_exactness import MAX_LOGIT_DIFF, STEPS, _turn
from test_swa import _engine

from kvmesh.node.engine import llamastate
from kvmesh.node.engine.engine import Engine
from kvmesh.node.engine.llamacpp import LlamaRunner
from kvmesh.node.lab.bench.exactness import move_replica
from kvmesh.node.lab.workload import text


@pytest.fixture(scope="module")
def gemma() -> tuple[Engine, Engine]:
    home, away = _engine("window"), _engine("window")
    yield home, away
    home.close()
    away.close()


def _prompt(e: Engine, seed: int, chars: int = 9000) -> list[int]:
    rng = random.Random(seed)
    return list(e.tokenizer.apply_chat_template([{"role": "user", "content": "Read this:\n" + text(rng, chars) + "\nWhat is it about?"}]))


def test_window_mode_blocks_hold_the_full_attention_cache_only() -> None:
    """A window-mode block is the 3 full-attention layers' cells plus an empty window section: under a fifth of a
    swa-full block's bytes; the two modes' fingerprints differ, so their blocks never mix."""
    full, window = _engine("full"), _engine("window")
    try:
        assert isinstance(window.runner, LlamaRunner) and window.runner.layout.bare and not full.runner.layout.bare  # type: ignore[attr-defined]
        assert window.block_bytes < full.block_bytes / 5, (window.block_bytes, full.block_bytes)
        assert window.fingerprint != full.fingerprint
        assert full.snapshots is None and window.snapshots is not None
    finally:
        full.close()
        window.close()


def test_a_moved_session_continues_exactly_from_blocks_and_its_window_snapshot(gemma: tuple[Engine, Engine]) -> None:
    """A ~1.8k-token turn on A (over three windows), then its blocks and snapshot on B: B's next turn reuses up to the
    snapshot and its 64 greedy tokens and logits equal A's own next turn (which also resumes at its snapshot)."""
    home, away = gemma
    p1 = _prompt(home, 3)
    out1, _, _, _ = _turn(home, p1, 20, session="gate")
    _, pos = move_replica(home, away, "gate")
    assert pos == len(p1) // home.block_size * home.block_size and pos >= 3 * 512
    p2 = p1 + out1 + home.tokenizer.encode(" And in one word?")
    on_b, logits_b, _, done_b = _turn(away, p2, STEPS, session="gate")
    on_a, logits_a, _, done_a = _turn(home, p2, STEPS, session="gate")
    assert done_b.stats.cached_tokens == pos and done_a.stats.cached_tokens >= pos
    assert away.snapshots is not None and away.snapshots.restored == 1
    assert on_b == on_a and len(on_b) == STEPS
    diffs = [float((a - b).abs().max()) for a, b in zip(logits_a, logits_b)]
    assert max(diffs) <= MAX_LOGIT_DIFF, diffs


def test_blocks_without_a_snapshot_resume_nothing_and_a_wrong_snapshot_is_refused(gemma: tuple[Engine, Engine]) -> None:
    """Blocks alone reuse 0 tokens (the window layers would attend to nothing); a snapshot offered at another
    position, or cut short, is refused with the reason, never kept."""
    home, away = gemma
    p1 = _prompt(home, 5, 4000)
    _turn(home, p1, 4, session="alone")
    with home.export("alone") as blocks:
        tokens = np.concatenate([b.tokens for b in blocks])
        away.import_blocks("alone", home.fingerprint, tokens, [b.hash for b in blocks], [bytes(b.data) for b in blocks])
    assert away.cached_prefix("alone", p1 + [1, 2, 3]) == 0
    assert home.snapshots is not None and away.snapshots is not None
    w = home.snapshots.newest(tokens)
    assert w is not None
    moved = away.snapshots.put(tokens[: w.pos - 256], w.blob, received=True)  # its cells are 256 positions on
    assert moved is not None and "positions" in moved, moved
    assert away.snapshots.put(tokens[: w.pos], w.blob[:-16], received=True) is not None
    assert away.cached_prefix("alone", p1 + [1, 2, 3]) == 0
    assert llamastate.check_snapshot(w.blob.data, home.runner.layout, w.pos, 512) is None  # type: ignore[attr-defined]
