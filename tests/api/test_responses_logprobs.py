"""Responses' include message.output_text.logprobs through the official OpenAI client on a real sim node, whole and
streamed (a peer's answer carrying them back as answer events: tests/mesh/test_hop_read.py)."""

from __future__ import annotations

import math

import openai
import pytest

INCLUDE = ["message.output_text.logprobs"]


def _check(entries, text: str, k: int) -> None:  # type: ignore[no-untyped-def]
    assert entries and "".join(e.token for e in entries) == text
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == k
        assert math.isclose(e.logprob, e.top_logprobs[0].logprob)  # greedy: the likeliest


def test_responses_logprobs_whole_answer(sim, sim_client):
    """include logprobs with top_logprobs 2: the output_text part carries one entry per token of its text."""
    r = sim_client.responses.create(model=sim.model, input="Say something.", max_output_tokens=12, temperature=0,
                                    include=INCLUDE, top_logprobs=2, store=False)
    part = r.output[0].content[0]
    _check(part.logprobs, part.text, 2)
    assert r.usage is not None and len(part.logprobs) == r.usage.output_tokens


def test_responses_logprobs_streamed(sim, sim_client):
    """Streamed, each output_text.delta carries its own tokens; together they are the whole answer's."""
    whole = sim_client.responses.create(model=sim.model, input="Say something.", max_output_tokens=12, temperature=0,
                                        include=INCLUDE, top_logprobs=1, store=False)
    events = list(sim_client.responses.create(model=sim.model, input="Say something.", max_output_tokens=12,
                                              temperature=0, include=INCLUDE, top_logprobs=1, store=False, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == whole.output[0].content[0].text
    assert all("".join(lp.token for lp in d.logprobs) == d.delta for d in deltas)
    done = next(e for e in events if e.type == "response.output_text.done")
    assert [(lp.token, lp.logprob) for lp in done.logprobs] == [(lp.token, lp.logprob) for d in deltas for lp in d.logprobs]


def test_no_responses_logprobs_unless_included(sim, sim_client):
    """Without the include item, the part's logprobs list is empty and nothing says it was ignored."""
    raw = sim_client.responses.with_raw_response.create(model=sim.model, input="hi", max_output_tokens=4, store=False,
                                                        include=["reasoning.encrypted_content"])
    assert raw.parse().output[0].content[0].logprobs == []
    assert raw.headers["x-kvmesh-ignored"] == "include"


def test_top_logprobs_without_the_include_is_a_400(sim, sim_client):
    """top_logprobs without include's logprobs item is refused naming top_logprobs, never silently ignored."""
    with pytest.raises(openai.BadRequestError) as ei:
        sim_client.responses.create(model=sim.model, input="hi", max_output_tokens=4, top_logprobs=2, store=False)
    assert ei.value.body["param"] == "top_logprobs"
