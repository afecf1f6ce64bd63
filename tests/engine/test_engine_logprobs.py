"""Log probabilities: each token's, from the logits the engine sampled it from, and handed out with its text."""

from __future__ import annotations

import numpy as np
import torch

from kvmesh.node.engine.boundary import TextDelta


def _capturing(engine):  # type: ignore[no-untyped-def]
    """Wrap the runner's forward: every row of logits it returns, in order."""
    rows: list[torch.Tensor] = []
    inner = engine.runner.forward

    async def forward(slot: int, tokens: np.ndarray, start: int) -> torch.Tensor:
        out = await inner(slot, tokens, start)
        rows.append(out.clone())
        return out

    engine.runner.forward = forward
    return rows


def test_greedy_logprobs_are_the_engines_own_log_softmax(make_engine, sim_cfg, turn, chat):
    """Greedy with top_logprobs 3: each token's logprob is log_softmax of the logits it came from (over the ids
    the model may emit), its top 3 the
    three largest, the chosen token first; the tokens' bytes join into the reply's text."""
    e = make_engine(cfg=sim_cfg())
    rows = _capturing(e)
    r = turn(e, "lp", chat(e, [{"role": "user", "content": "hello there"}]), max_tokens=24, temperature=0.0,
             top_logprobs=3)
    got = [lp for ev in r.events if isinstance(ev, TextDelta) for lp in ev.logprobs or []]
    assert len(got) == r.stats.completion_tokens and got
    assert b"".join(g.token for g in got).decode() == r.text
    for g, row in zip(got, rows):
        if e.decode.allowed is not None:  # the byte model's own mask: what it may emit at all
            row = row.masked_fill(~e.decode.allowed, float("-inf"))
        want = torch.log_softmax(row.float(), dim=-1)
        top = torch.topk(want, 3)
        assert g.logprob == float(want.max())  # greedy: the chosen token is the likeliest
        assert [v for _, v in g.top] == [float(v) for v in top.values]
        assert g.top[0][0] == g.token


def test_no_logprobs_unless_asked(make_engine, sim_cfg, turn, chat):
    """Without top_logprobs the text deltas carry none."""
    e = make_engine(cfg=sim_cfg())
    r = turn(e, "nolp", chat(e, [{"role": "user", "content": "hi"}]), max_tokens=8, temperature=0.0)
    assert all(ev.logprobs is None for ev in r.events if isinstance(ev, TextDelta))


def test_a_stop_string_cuts_the_logprobs_with_the_text(make_engine, sim_cfg, turn, chat):
    """Tokens whose text a stop string cut are not scored in the answer: the scored tokens' bytes are its text."""
    e = make_engine(cfg=sim_cfg())
    prompt = chat(e, [{"role": "user", "content": "hello there"}])
    full = turn(e, "stop-a", prompt, max_tokens=24, temperature=0.0).text
    stop = full[5:7]
    r = turn(e, "stop-b", prompt, max_tokens=24, temperature=0.0, top_logprobs=0, stop=(stop,))
    got = [lp for ev in r.events if isinstance(ev, TextDelta) for lp in ev.logprobs or []]
    assert r.text == full[: full.find(stop)]
    assert b"".join(g.token for g in got).decode() == r.text
