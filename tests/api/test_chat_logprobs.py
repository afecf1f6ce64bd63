"""Chat logprobs / top_logprobs through the official OpenAI client on a real sim node, whole and streamed."""

from __future__ import annotations

import math

import openai
import pytest

HI = [{"role": "user", "content": "Say something."}]


def _check(entries, content: str, k: int) -> None:  # type: ignore[no-untyped-def]
    assert entries and "".join(e.token for e in entries) == content
    for e in entries:
        assert e.logprob <= 0 and bytes(e.bytes or []).decode("utf-8", "replace") == e.token
        alts = [a.logprob for a in e.top_logprobs]
        assert len(alts) == k and alts == sorted(alts, reverse=True)
        assert math.isclose(e.logprob, alts[0]) and e.top_logprobs[0].token == e.token  # greedy: the likeliest


def test_chat_logprobs_whole_answer(sim, sim_client):
    """logprobs with top_logprobs 3: one entry per content token, joined they are the content, greedy picks the top."""
    r = sim_client.chat.completions.create(model=sim.model, messages=HI, max_tokens=16, temperature=0, logprobs=True,
                                           top_logprobs=3)
    ch = r.choices[0]
    _check(ch.logprobs.content, ch.message.content, 3)
    assert len(ch.logprobs.content) == r.usage.completion_tokens


def test_chat_logprobs_streamed(sim, sim_client):
    """Streamed, the chunks' logprobs join into the same entries as the whole answer's."""
    whole = sim_client.chat.completions.create(model=sim.model, messages=HI, max_tokens=16, temperature=0,
                                               logprobs=True, top_logprobs=2)
    chunks = list(sim_client.chat.completions.create(model=sim.model, messages=HI, max_tokens=16, temperature=0,
                                                     logprobs=True, top_logprobs=2, stream=True))
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    _check(entries, content, 2)
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]


def test_no_logprobs_unless_asked(sim, sim_client):
    """Without logprobs the choice's logprobs is null."""
    r = sim_client.chat.completions.create(model=sim.model, messages=HI, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None


@pytest.mark.parametrize("kw, param", [({"top_logprobs": 2}, "top_logprobs"),
                                       ({"logprobs": True, "top_logprobs": 21}, "top_logprobs")])
def test_bad_logprobs_requests_are_400(sim, sim_client, kw, param):
    """top_logprobs without logprobs, or above 20, is a 400 naming top_logprobs."""
    with pytest.raises(openai.BadRequestError) as ei:
        sim_client.chat.completions.create(model=sim.model, messages=HI, max_tokens=4, **kw)
    assert param in str(ei.value.body)


def test_streamed_logprobs_ride_with_the_text_they_score(sim, sim_client):
    """Streamed, every chunk with content carries that content's tokens (OpenAI's shape; llama.cpp's test_logprobs_stream)."""
    chunks = list(sim_client.chat.completions.create(model=sim.model, messages=HI, max_tokens=16, temperature=0,
                                                     logprobs=True, stream=True))
    texts = [c.choices[0] for c in chunks if c.choices and c.choices[0].delta.content]
    assert texts and all(ch.logprobs and "".join(e.token for e in ch.logprobs.content or []) == ch.delta.content
                         for ch in texts)
