"""The exactness gate's vLLM row: a turn on vLLM host A, the next on host B from A's replica (kv_share's push,
in memory), against the same next turn on A; each host a vLLM pinned to its own core (node.engine.vllm).

vLLM hands out log probabilities, not logits: the row compares each step's top-20 log probabilities (a
logit difference shifted by one log-normaliser per step) and the greedy tokens, over `--steps` tokens
past end-of-turn, with the gate's threshold.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from kvmesh.node.config import EngineConfig, VllmConfig
from kvmesh.node.engine.boundary import GenerateRequest, TextDelta, TokenLogprob, TurnDone, TurnStats
from kvmesh.node.engine.vllm.engine import VllmEngine
from kvmesh.node.lab.workload import text

TOP = 20


def _engine(name: str, core: str) -> VllmEngine:
    return VllmEngine(EngineConfig(kind="vllm", model="smollm2", slots=1, max_context=4096, cache_tokens=8192,
                                   vllm=VllmConfig(cpu_cores=core)), name=name)


def greedy_logprobs(engine: VllmEngine, prompt: list[int], steps: int, session: str = "gate") -> tuple[list[TokenLogprob], TurnStats]:
    """A greedy turn of exactly `steps` tokens: each token's log probability and its top alternatives."""
    lps: list[TokenLogprob] = []
    done: list[TurnStats] = []

    async def go() -> None:
        req = GenerateRequest(session, prompt, max_tokens=steps, temperature=0.0, ignore_eos=True, top_logprobs=TOP)
        async for ev in engine.generate(req):
            if isinstance(ev, TextDelta):
                lps.extend(ev.logprobs or [])
            elif isinstance(ev, TurnDone):
                done.append(ev.stats)

    asyncio.run(go())
    return lps, done[0]


def gate_vllm(steps: int, max_diff: float, move_replica: Callable[[VllmEngine, VllmEngine], object]) -> dict[str, object]:
    """The row; `move_replica` carries A's blocks to B as the other rows' do (kv_share's push, in memory)."""
    home = _engine("gate-a", "0")
    try:
        away = _engine("gate-b", "1")
    except BaseException:
        home.close()
        raise
    try:
        rng = random.Random(3)
        msgs = [{"role": "user", "content": "Read this:\n" + text(rng, 9000) + "\nWhat is it about?"}]
        greedy_logprobs(home, list(home.tokenizer.apply_chat_template(msgs)), 16)
        move_replica(home, away)
        held = home.session_tokens("gate")
        assert held is not None
        p2 = [int(t) for t in held] + home.tokenizer.encode(" And in one word?")
        on_b, done_b = greedy_logprobs(away, p2, steps)
        on_a, _ = greedy_logprobs(home, p2, steps)
        same = next((i for i, (a, b) in enumerate(zip(on_a, on_b)) if a.token != b.token), min(len(on_a), len(on_b)))
        diff = 0.0
        for a, b in zip(on_a[:same], on_b[:same]):
            theirs = dict(b.top)
            diff = max([diff, abs(a.logprob - b.logprob), *(abs(v - theirs[t]) for t, v in a.top if t in theirs)])
        return {"kind": "vllm", "model": home.model_name, "tokens_identical": same, "steps": len(on_a),
                "max_logit_diff": round(diff, 6), "compared": f"top-{TOP} logprobs", "reused_on_b": done_b.cached_tokens,
                "prompt_tokens": len(p2), "snapshot_pos": 0, "dtype": str(home.dtype).removeprefix("torch."),
                "passed": same == len(on_a) == steps and diff <= max_diff}
    finally:
        home.close()
        away.close()
