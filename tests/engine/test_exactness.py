"""The exactness gate on the real SmolLM2: a turn continued on host B from A's replica is the turn A would run.

Two engines in one process stand for two hosts (each its own llama.cpp context, one slot, since batch
composition moves logits). A's first turn is exported as blocks and imported into B (what kv_share's
landing does with the bytes it received); the next turn then runs greedily on B and on A, where the session
never moved. Run with f16 KV and with q8_0 KV, whose blocks are the bytes that cross the wire (q8_0 carries
about half of f16's bytes per token).

The gate is the issue's: the greedy continuations are identical for 64 tokens and the logits differ by at
most 0.05. It holds (0.0, measured) because both hosts compute the second turn from the same cells: a replica
holds whole blocks, and a llama.cpp engine's own next turn reuses whole blocks only (`engine.reuse_tail`
unset). When the home reused its partial last block as well, it computed those positions in other batch
shapes than B, and on this model llama.cpp's logits move by up to ~1.3 (of ~35) with the batch shape: B and
A then agreed for 17 tokens only.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kvmesh.node.config import EngineConfig, LlamaCppConfig
from kvmesh.node.engine.engine import Engine, TurnDone
from kvmesh.node.engine.llamamodel import weight_buffers
from kvmesh.node.lab.bench.exactness import greedy
from kvmesh.node.lab.workload import text

MAX_LOGIT_DIFF = 0.05
STEPS = 64


def _engine(kv_type: str, reuse_tail: bool | None = None) -> Engine:
    return Engine(EngineConfig(model="smollm2", slots=1, cache_tokens=4096, reuse_tail=reuse_tail,
                               llamacpp=LlamaCppConfig(threads=2, type_k=kv_type, type_v=kv_type)))  # type: ignore[arg-type]


def _turn(engine: Engine, prompt: list[int], max_tokens: int,
          session: str = "gate") -> tuple[list[int], list[torch.Tensor], str, TurnDone]:
    """A greedy turn: the tokens picked, every forward's logits (the prefill's last, then each decode step's), the text."""
    seen, done, said = greedy(engine, prompt, max_tokens, session=session, ignore_eos=False)
    return [int(x.argmax()) for x in seen], seen, said, done


def _gate(kv_type: str, reuse_tail: bool | None = None) -> tuple[int, float, int]:
    """(tokens compared, max |logit diff|, block bytes per token) of one home/away pair."""
    rng = random.Random(5)
    msgs = [{"role": "system", "content": "You are a coding agent.\n" + text(rng, 4000)},
            {"role": "user", "content": "Describe, step by step and at length, how to build this."}]
    home, away = _engine(kv_type, reuse_tail), _engine(kv_type, reuse_tail)
    try:
        assert home.fingerprint == away.fingerprint
        p1 = home.tokenizer.apply_chat_template(msgs)
        _, _, reply, _ = _turn(home, p1, 16)
        with home.export("gate") as blocks:
            tokens = np.concatenate([b.tokens for b in blocks])
            hashes, data = [b.hash for b in blocks], [bytes(b.data) for b in blocks]
        assert away.import_blocks("gate", home.fingerprint, tokens, hashes, data) == len(tokens)
        p2 = home.tokenizer.apply_chat_template([*msgs, {"role": "assistant", "content": reply},
                                                 {"role": "user", "content": "Go on, in more detail."}])
        on_b, logits_b, _, done_b = _turn(away, p2, STEPS)
        on_a, logits_a, _, _ = _turn(home, p2, STEPS)  # where the session never moved
        assert done_b.stats.cached_tokens >= len(tokens)  # B continued from the replica, not a recompute
        agreed = next((i for i, (x, y) in enumerate(zip(on_a, on_b)) if x != y), min(len(on_a), len(on_b)))
        diff = max(float((a - b).abs().max()) for a, b in zip(logits_a[: agreed + 1], logits_b[: agreed + 1]))
        return agreed, diff, home.kv_bytes_per_token
    finally:
        home.close()
        away.close()


def test_smollm2_runs_with_this_hosts_weight_buffers() -> None:
    """The default config takes this host's weight-buffer choice (plain on AMX_INT8, repacked elsewhere) and a
    real prefill and decode of SmolLM2 Q4_1 run with it: the first llama_decode is where AMX hosts crashed."""
    engine = _engine("f16")
    try:
        assert engine.weights == weight_buffers(LlamaCppConfig())
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Name three sorting algorithms."}])
        seen, done, said = greedy(engine, prompt, 8, session="weights", ignore_eos=True)
        assert len(seen) >= 2 and said and done.stats.prompt_tokens == len(prompt) and done.stats.completion_tokens == 8
    finally:
        engine.close()


@pytest.fixture(scope="module")
def f16_gate() -> tuple[int, float, int]:
    return _gate("f16")


def test_smollm2_f16_replica_continues_as_the_home_would(f16_gate: tuple[int, float, int]) -> None:
    """f16 KV: B's greedy continuation from A's replica is A's for 64 tokens, every logit within 0.05 of A's."""
    agreed, diff, _ = f16_gate
    assert agreed >= STEPS and diff <= MAX_LOGIT_DIFF, (agreed, diff)


def test_smollm2_q8_0_replica_continues_as_the_home_would_at_half_the_bytes(f16_gate: tuple[int, float, int]) -> None:
    """q8_0 KV: the same gate passes, and a block carries at most 55% of f16's bytes per token."""
    agreed, diff, per_token = _gate("q8_0")
    assert agreed >= STEPS and diff <= MAX_LOGIT_DIFF, (agreed, diff)
    assert per_token <= 0.55 * f16_gate[2], (per_token, f16_gate[2])
