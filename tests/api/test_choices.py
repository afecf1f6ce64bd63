"""Chat's n > 1 through the official OpenAI client on a real sim node: n choices from one prefill, whole and streamed."""

from __future__ import annotations

import random

import httpx

from kvmesh.node.lab.workload import text


def _prefilled(url: str) -> int:
    return int(httpx.get(url + "/v1/stats", timeout=10).json()["engine"]["prefill_tokens"])


def _messages(seed: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": text(random.Random(seed), 6000)}, {"role": "user", "content": "Go on."}]


def test_n_choices_cost_one_prefill(sim, sim_client):
    """n=4: four choices indexed 0-3, the prompt prefilled once (each later choice recomputes one token)."""
    before = _prefilled(sim.url)
    r = sim_client.chat.completions.create(model=sim.model, messages=_messages(1), max_tokens=8, n=4,  # type: ignore[arg-type]
                                           temperature=1.0, extra_headers={"X-Session-Id": "n-choices-1"})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.message.content for c in r.choices)
    prompt = r.usage.prompt_tokens
    assert r.usage.completion_tokens >= 4
    spent = _prefilled(sim.url) - before
    assert prompt <= spent <= prompt + 3 * 2, (spent, prompt)  # not 4 prefills: 4 x prompt


def test_sampled_choices_differ_and_a_seed_repeats_them(sim, sim_client):
    """With a seed, the same request gives the same choices; its choices are sampled apart from each other."""
    kw = dict(model=sim.model, messages=_messages(2), max_tokens=12, n=3, temperature=1.0, seed=7)
    a = sim_client.chat.completions.create(**kw, extra_headers={"X-Session-Id": "n-seeded-a"})  # type: ignore[call-overload]
    b = sim_client.chat.completions.create(**kw, extra_headers={"X-Session-Id": "n-seeded-b"})  # type: ignore[call-overload]
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices]
    assert len(set(texts)) > 1, texts


def test_n_choices_streamed(sim, sim_client):
    """Streamed, every choice's chunks carry its index and end with its finish_reason; usage comes once at the end."""
    chunks = list(sim_client.chat.completions.create(
        model=sim.model, messages=_messages(3), max_tokens=6, n=2, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}, extra_headers={"X-Session-Id": "n-stream"}))
    by_index: dict[int, str] = {}
    finished = set()
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] = by_index.get(ch.index, "") + (ch.delta.content or "")
            if ch.finish_reason:
                finished.add(ch.index)
    assert set(by_index) == finished == {0, 1}
    assert by_index[0] == by_index[1]  # greedy: the same answer twice
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
