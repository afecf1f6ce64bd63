"""Legacy completions' logprobs through the official OpenAI client on a real sim node, whole and streamed."""

from __future__ import annotations

import math

PROMPT = "Once upon a time"


def _check(lp, text: str, k: int) -> None:  # type: ignore[no-untyped-def]
    """Tokens join into the text, offsets point at each, greedy picks the likeliest of its k alternatives."""
    assert lp.tokens and "".join(lp.tokens) == text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    for tok, v, top, off in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True):
        assert v <= 0 and text[off: off + len(tok)] == tok
        assert len(top) == k and math.isclose(max(top.values()), v) and top[tok] == max(top.values())


def test_legacy_logprobs_whole_answer(sim, sim_client):
    """logprobs 3: one entry per token in the legacy shape (tokens, token_logprobs, top_logprobs, text_offset)."""
    r = sim_client.completions.create(model=sim.model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=3)
    ch = r.choices[0]
    _check(ch.logprobs, ch.text, 3)
    assert len(ch.logprobs.tokens) == r.usage.completion_tokens


def test_legacy_logprobs_streamed(sim, sim_client):
    """Streamed, each chunk carries its text's tokens; joined they are the whole answer's, offsets running on."""
    whole = sim_client.completions.create(model=sim.model, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2)
    chunks = list(sim_client.completions.create(model=sim.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                                logprobs=2, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert text == whole.choices[0].text
    assert [t for lp in lps for t in lp.tokens] == whole.choices[0].logprobs.tokens
    assert [o for lp in lps for o in lp.text_offset] == whole.choices[0].logprobs.text_offset
    assert [v for lp in lps for v in lp.token_logprobs] == whole.choices[0].logprobs.token_logprobs


def test_no_legacy_logprobs_unless_asked(sim, sim_client):
    """Without logprobs the choice's logprobs is null."""
    r = sim_client.completions.create(model=sim.model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].logprobs is None
