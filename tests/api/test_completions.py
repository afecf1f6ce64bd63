"""Legacy completions (`POST /v1/completions`, `/completions`) on the sim engine, through the official `openai` client.

The sim's byte tokenizer makes one character one token, and a raw prompt gets BOS in front,
so a prompt of N characters is N + 1 prompt tokens. Its logits are seeded by the context, so
temperature 0 gives the same text for the same prompt tokens, however they were sent.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from kvmesh.node.engine.tokenizer import BOS

LONG = "The quick brown fox jumps over the lazy dog, then naps in the sun. " * 11  # 737 chars


def _complete(client: openai.OpenAI, model: str, prompt: Any, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 16)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=model, prompt=prompt, **kw)


def test_string_prompt(sim, sim_client):
    """A string prompt: a text_completion with text, a finish reason and usage (prompt = characters + BOS)."""
    prompt = "Once upon a time (string)"
    r = _complete(sim_client, sim.model, prompt)
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.model == sim.model
    assert len(r.choices) == 1
    ch = r.choices[0]
    assert ch.index == 0 and isinstance(ch.text, str) and ch.text
    assert ch.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens == len(prompt) + 1
    assert 1 <= u.completion_tokens <= 16 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    if ch.finish_reason == "length":
        assert u.completion_tokens == 16 and len(ch.text) == 16
    assert u.prompt_tokens_details.cached_tokens == 0


def test_token_id_prompt(sim, sim_client):
    """A list of token ids is the prompt as given (BOS added once): same tokens and same text as the string."""
    text = "Once upon a time (ids)"
    ids = list(text.encode())
    by_text = _complete(sim_client, sim.model, text)
    by_ids = _complete(sim_client, sim.model, ids)
    with_bos = _complete(sim_client, sim.model, [BOS, *ids])
    assert by_ids.usage.prompt_tokens == with_bos.usage.prompt_tokens == len(ids) + 1
    assert by_ids.choices[0].text == with_bos.choices[0].text == by_text.choices[0].text
    one_batch = _complete(sim_client, sim.model, [ids])  # a batch of one
    assert one_batch.choices[0].text == by_text.choices[0].text


def test_streaming_chunks_join_to_the_whole_text(sim, sim_client):
    """Streamed: text_completion chunks of one id whose texts join to the non-streamed text (temperature 0)."""
    prompt = "In a galaxy far away (stream)"  # at temperature 0 the sim writes all 24 tokens for it
    whole = _complete(sim_client, sim.model, prompt, max_tokens=24)
    chunks = list(_complete(sim_client, sim.model, prompt, max_tokens=24, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].text]
    assert len(texts) == whole.usage.completion_tokens == 24  # one chunk per token: streamed as decoded
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].choices[0].finish_reason is not None
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked for


def test_stream_options_include_usage(sim, sim_client):
    """stream_options include_usage: a last chunk with no choices and the usage, as the non-streamed call reports."""
    prompt = "Once upon a time (usage)"
    whole = _complete(sim_client, sim.model, prompt, extra_headers={"X-Session-Id": "cmpl-usage-a"})
    chunks = list(_complete(sim_client, sim.model, prompt, stream=True, stream_options={"include_usage": True},
                            extra_headers={"X-Session-Id": "cmpl-usage-b"}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert [c for c in chunks if c.usage is not None] == [last]
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens == len(prompt) + 1
    assert last.usage.completion_tokens == whole.usage.completion_tokens
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text


def test_same_prefix_and_session_reuses_the_cache(sim, sim_client):
    """A second call in the same X-Session-Id whose prompt extends the first reads the first prompt from the cache."""
    hdr = {"X-Session-Id": "cmpl-cache-1"}
    prompt = "[cache] " + LONG
    a = _complete(sim_client, sim.model, prompt, max_tokens=8, extra_headers=hdr)
    b = _complete(sim_client, sim.model, prompt + " And then the dog woke up.", max_tokens=8, extra_headers=hdr)
    p1 = a.usage.prompt_tokens
    assert p1 == len(prompt) + 1 > 600
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    cached = b.usage.prompt_tokens_details.cached_tokens
    assert cached > 0
    assert p1 - 1 <= cached < b.usage.prompt_tokens
    # Another session shares only whole 256-token blocks of that prefix.
    c = _complete(sim_client, sim.model, prompt + " Or did it?", max_tokens=8, extra_headers={"X-Session-Id": "cmpl-cache-2"})
    assert c.usage.prompt_tokens_details.cached_tokens == p1 // 256 * 256


REFUSED: dict[str, tuple[dict[str, Any], str]] = {
    "echo": ({"echo": True}, "echo"),
    "logprobs-21": ({"logprobs": 21}, "logprobs"),
    "suffix": ({"suffix": " the end."}, "suffix"),
    "n": ({"n": 2}, "n"),
    "best_of": ({"best_of": 2}, "best_of"),
    "batch": ({"prompt": ["first prompt", "second prompt"]}, "prompt"),
    "batch-ids": ({"prompt": [[72, 105], [72, 111]]}, "prompt"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_fields_are_400_naming_the_field(sim, sim_client, case):
    """echo, logprobs past 20, suffix, n=2, best_of=2 and a batch of prompts: openai.BadRequestError naming the field."""
    extra, field = REFUSED[case]
    kw: dict[str, Any] = {"prompt": "hi", "max_tokens": 4, **extra}
    with pytest.raises(openai.BadRequestError) as ei:
        sim_client.completions.create(model=sim.model, **kw)
    assert ei.value.status_code == 400
    assert ei.value.body["param"] == field and field in ei.value.body["message"]


def test_empty_prompt_is_400(sim, http_sim, check_error):
    """An empty prompt (string or list) is a 400 naming prompt."""
    for prompt in ("", []):
        check_error(http_sim.post("/v1/completions", json={"model": sim.model, "prompt": prompt}), 400,
                    param="prompt", says="empty")


def test_empty_prompt_in_a_batch_of_one_is_400(sim, http_sim, check_error):
    """A batch of one empty prompt ([""] or [[]]) is refused like "" and [] are."""
    for prompt in ([""], [[]]):
        check_error(http_sim.post("/v1/completions", json={"model": sim.model, "prompt": prompt}), 400,
                    param="prompt", says="empty")


def test_unprefixed_route_works(sim):
    """POST /completions (no /v1) serves the same completion: a client whose base URL has no /v1 works."""
    prompt = "Once upon a time (unprefixed)"
    with openai.OpenAI(base_url=sim.url, api_key="x", max_retries=0, timeout=60.0) as bare, \
            openai.OpenAI(base_url=sim.v1, api_key="x", max_retries=0, timeout=60.0) as v1:
        a = _complete(bare, sim.model, prompt)
        b = _complete(v1, sim.model, prompt)
    assert a.object == "text_completion" and a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == len(prompt) + 1


def test_unknown_model_is_404(sim_client):
    """An unknown model: openai.NotFoundError (404, code model_not_found) naming it."""
    with pytest.raises(openai.NotFoundError) as ei:
        sim_client.completions.create(model="gpt-3.5-turbo-instruct", prompt="hi", max_tokens=4)
    assert ei.value.status_code == 404
    assert ei.value.body["code"] == "model_not_found" and "gpt-3.5-turbo-instruct" in ei.value.body["message"]
