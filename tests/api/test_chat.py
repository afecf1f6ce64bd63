"""Chat completions on the tiny torch engine, through the official OpenAI client.

Covers the completion shape, prefix-cache accounting across turns, streaming,
determinism, stop sequences, models/health, concurrent slots and a client that
hangs up mid-stream.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import httpx
import openai
import pytest

# A system prompt longer than two 256-token blocks (the byte tokenizer: 1 char = 1 token).
LONG_SYSTEM = "You are a careful assistant who answers in plain words. " * 12  # 672 chars
SHORT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there, tell me a story."}]


def _text(resp: Any) -> str:
    return resp.choices[0].message.content


def _stream_text(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def _greedy(client: openai.OpenAI, model: str, messages: list[dict[str, Any]], session: str, **kw: Any) -> Any:
    kw.setdefault("max_tokens", 24)
    return client.chat.completions.create(
        model=model, messages=messages, temperature=0, extra_headers={"X-Session-Id": session}, **kw
    )


def test_completion_shape(tiny, tiny_client):
    """A non-streaming completion returns text, a finish reason and full usage with cached_tokens."""
    r = _greedy(tiny_client, tiny.model, SHORT, "shape-1", max_tokens=16)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == tiny.model
    assert len(r.choices) == 1
    ch = r.choices[0]
    assert ch.index == 0
    assert ch.message.role == "assistant"
    assert isinstance(ch.message.content, str) and ch.message.content
    assert ch.finish_reason in ("stop", "length")
    u = r.usage
    assert u is not None
    # The chat template: <bos> (<role> content <end>)* <assistant>, one token per byte.
    assert u.prompt_tokens == 1 + sum(2 + len(m["content"]) for m in SHORT) + 1
    assert 1 <= u.completion_tokens <= 16
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details is not None
    assert u.prompt_tokens_details.cached_tokens == 0  # a new session on a fresh prefix
    if ch.finish_reason == "length":
        assert u.completion_tokens == 16


@pytest.mark.parametrize("how", ["user", "header"])
def test_second_turn_reports_cached_tokens(tiny, tiny_client, how):
    """The second turn of a conversation reuses the first turn's KV: cached_tokens covers the whole first prompt."""
    ident = f"cache-{how}-1"
    kw: dict[str, Any] = {"user": ident} if how == "user" else {"extra_headers": {"X-Session-Id": ident}}
    # A system prompt of its own, so no other test's blocks are reused in turn 1.
    turn1 = [{"role": "system", "content": f"[{how}] " + LONG_SYSTEM}, {"role": "user", "content": "Hi."}]
    raw1 = tiny_client.chat.completions.with_raw_response.create(
        model=tiny.model, messages=turn1, temperature=0, max_tokens=16, **kw
    )
    r1 = raw1.parse()
    assert raw1.headers["x-session-id"] == ident
    p1, c1 = r1.usage.prompt_tokens, r1.usage.completion_tokens
    assert p1 > 512
    assert r1.usage.prompt_tokens_details.cached_tokens == 0

    turn2 = turn1 + [{"role": "assistant", "content": _text(r1)}, {"role": "user", "content": "And then?"}]
    raw2 = tiny_client.chat.completions.with_raw_response.create(
        model=tiny.model, messages=turn2, temperature=0, max_tokens=16, **kw
    )
    r2 = raw2.parse()
    assert raw2.headers["x-session-id"] == ident
    p2, cached = r2.usage.prompt_tokens, r2.usage.prompt_tokens_details.cached_tokens
    assert p2 > p1 + c1
    # At least every whole block of the first prompt, in fact the whole first prompt;
    # never more than the first turn saw (prompt + reply), and at least one token computed.
    assert cached >= (p1 // 256) * 256
    assert cached >= p1
    assert cached <= p1 + c1
    assert cached < p2
    assert raw2.headers["x-kvmesh-cached-tokens"] == str(cached)


def test_warm_turn_matches_cold_recompute_on_another_node(tiny, tiny_client, tiny_cold, make_client):
    """A second turn computed on top of the cached prefix gives the same greedy text as a cold node computing it all."""
    turn1 = [{"role": "system", "content": "[warm-vs-cold] " + LONG_SYSTEM}, {"role": "user", "content": "The sea?"}]
    r1 = _greedy(tiny_client, tiny.model, turn1, "warmcold", max_tokens=24)
    turn2 = turn1 + [{"role": "assistant", "content": _text(r1)},
                     {"role": "user", "content": "And what about the mountains and the rivers?"}]
    warm = _greedy(tiny_client, tiny.model, turn2, "warmcold", max_tokens=32)
    cached = warm.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens and cached % 256 != 0  # reuse ends mid-block
    assert warm.usage.prompt_tokens - cached > 16  # a multi-token chunk computed after the cached prefix
    # A second node: same seeded weights, empty cache.
    cold = _greedy(make_client(tiny_cold), tiny_cold.model, turn2, "warmcold", max_tokens=32)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert _text(warm) == _text(cold)


def test_turn_after_a_stop_cut_reuses_the_visible_text(tiny, tiny_client):
    """After a turn cut by a stop sequence, the next turn (with the cut reply) reuses prompt + reply."""
    turn1 = [{"role": "user", "content": "Say something, then stop."}]
    ref = _text(_greedy(tiny_client, tiny.model, turn1, "stopcont-ref", max_tokens=40))
    stop = _pick_stop(ref)
    r1 = _greedy(tiny_client, tiny.model, turn1, "stopcont", max_tokens=40, stop=stop)
    assert r1.choices[0].finish_reason == "stop"
    turn2 = turn1 + [{"role": "assistant", "content": _text(r1)}, {"role": "user", "content": "Go on."}]
    r2 = _greedy(tiny_client, tiny.model, turn2, "stopcont", max_tokens=8)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached >= r1.usage.prompt_tokens + len(_text(r1))
    assert cached < r2.usage.prompt_tokens


def test_concurrent_turns_in_one_session(sim, sim_client):
    """Two turns of the same session sent at once both complete (one waits for the other)."""
    msgs = [{"role": "user", "content": "same session, twice at once"}]
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        futs = [ex.submit(sim_client.chat.completions.create, model=sim.model, messages=msgs, max_tokens=16,
                          temperature=0, extra_headers={"X-Session-Id": "twice"}) for _ in range(2)]
        rs = [f.result(timeout=60) for f in futs]
    assert _text(rs[0]) == _text(rs[1])
    assert sorted(r.usage.prompt_tokens_details.cached_tokens for r in rs)[1] > 0  # the later one ran warm


def test_other_session_reuses_shared_system_prompt_blocks(tiny, tiny_client):
    """A new session with the same long system prompt reuses its whole 256-token blocks, and only those."""
    system = {"role": "system", "content": "Shared policy text. " * 30}  # 600 chars: prefix of 604 tokens
    a = _greedy(tiny_client, tiny.model, [system, {"role": "user", "content": "first asker"}], "shared-a", max_tokens=4)
    assert a.usage.prompt_tokens_details.cached_tokens == 0
    b = _greedy(tiny_client, tiny.model, [system, {"role": "user", "content": "second asker"}], "shared-b", max_tokens=4)
    # Common prefix: <bos><system> 600 chars <end><user> "" -> 604 tokens: two whole blocks.
    assert b.usage.prompt_tokens_details.cached_tokens == 512


def test_streaming_matches_non_streaming_greedy(tiny, tiny_client):
    """Greedy streamed chunks concatenate to the non-streamed text; include_usage adds a final usage chunk."""
    ref = _greedy(tiny_client, tiny.model, SHORT, "stream-ref", max_tokens=32)
    stream = tiny_client.chat.completions.create(
        model=tiny.model, messages=SHORT, temperature=0, max_tokens=32, stream=True,
        stream_options={"include_usage": True}, extra_headers={"X-Session-Id": "stream-1"},
    )
    chunks = list(stream)
    assert _stream_text(chunks) == _text(ref)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert with_choices[-1].choices[0].finish_reason == ref.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.prompt_tokens == ref.usage.prompt_tokens
    assert last.usage.completion_tokens == ref.usage.completion_tokens
    assert last.usage.total_tokens == ref.usage.total_tokens
    assert last.usage.prompt_tokens_details.cached_tokens == 0
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_without_include_usage_has_no_usage_chunk(tiny, tiny_client):
    """Without stream_options.include_usage no chunk carries usage."""
    chunks = list(tiny_client.chat.completions.create(
        model=tiny.model, messages=SHORT, temperature=0, max_tokens=8, stream=True,
        extra_headers={"X-Session-Id": "stream-nousage"},
    ))
    assert chunks and all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_streaming_matches_non_streaming_seeded(tiny, tiny_client):
    """With temperature > 0 and the same seed, streamed text equals non-streamed text."""
    kw = dict(model=tiny.model, messages=SHORT, temperature=0.9, seed=1234, max_tokens=32)
    ref = tiny_client.chat.completions.create(**kw, extra_headers={"X-Session-Id": "seeded-ref"})
    chunks = list(tiny_client.chat.completions.create(**kw, stream=True, extra_headers={"X-Session-Id": "seeded-s"}))
    assert _stream_text(chunks) == _text(ref)


def test_greedy_is_deterministic(tiny, tiny_client):
    """Greedy decoding gives the same text cold, warm (same session, cached prefix) and in another session."""
    msgs = [{"role": "user", "content": "Describe a lighthouse."}]
    cold = tiny_client.chat.completions.create(model=tiny.model, messages=msgs, temperature=0, max_tokens=32)
    warm = tiny_client.chat.completions.create(model=tiny.model, messages=msgs, temperature=0, max_tokens=32)
    other = _greedy(tiny_client, tiny.model, msgs, "greedy-other", max_tokens=32)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0
    assert warm.usage.prompt_tokens_details.cached_tokens > 0  # same derived session: served from cache
    assert _text(cold) == _text(warm) == _text(other)
    assert cold.choices[0].finish_reason == warm.choices[0].finish_reason


def test_seeded_sampling_is_deterministic(tiny, tiny_client):
    """temperature > 0: the same seed gives the same text, a different seed a different one."""
    msgs = [{"role": "user", "content": "Name some colours."}]

    def run(seed: int, session: str) -> str:
        return _text(tiny_client.chat.completions.create(
            model=tiny.model, messages=msgs, temperature=1.0, top_p=0.95, seed=seed, max_tokens=32,
            extra_headers={"X-Session-Id": session},
        ))

    a1, a2 = run(7, "seed-a1"), run(7, "seed-a2")
    b = run(8, "seed-b")
    greedy = _text(_greedy(tiny_client, tiny.model, msgs, "seed-greedy", max_tokens=32))
    assert a1 == a2
    assert a1 != b
    assert greedy not in (a1, b)  # sampling really sampled


def test_seeds_differing_in_high_bits_sample_differently(tiny, tiny_client):
    """Two seeds that differ only in their high 32 bits give different samples."""
    msgs = [{"role": "user", "content": "Name some colours."}]

    def run(seed: int) -> str:
        return _text(tiny_client.chat.completions.create(
            model=tiny.model, messages=msgs, temperature=1.0, seed=seed, max_tokens=24,
            extra_headers={"X-Session-Id": f"seedbits-{seed & 0xFFFF}"},
        ))

    assert run(1) != run(1 + 2**32)


def _pick_stop(ref: str) -> str:
    """A 3-char substring of `ref` whose first occurrence is after some text."""
    for k in range(3, len(ref) - 3):
        s = ref[k : k + 3]
        if ref.find(s) >= 3:
            return s
    pytest.fail(f"no usable stop sequence in the reference output {ref!r}")


def test_stop_sequence_cuts_text(tiny, tiny_client):
    """A stop sequence that occurs in the greedy output cuts the text before it, finish_reason 'stop'."""
    msgs = [{"role": "system", "content": "Stop test."}, {"role": "user", "content": "Write a long line."}]
    ref = _text(_greedy(tiny_client, tiny.model, msgs, "stop-ref", max_tokens=40))
    stop = _pick_stop(ref)
    expected = ref[: ref.find(stop)]

    r = _greedy(tiny_client, tiny.model, msgs, "stop-1", max_tokens=40, stop=stop)
    assert _text(r) == expected
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 40

    # As one of several, next to one that never occurs (the model emits ASCII only).
    r2 = _greedy(tiny_client, tiny.model, msgs, "stop-2", max_tokens=40, stop=["\u2603\u2603", stop])
    assert _text(r2) == expected
    assert r2.choices[0].finish_reason == "stop"

    chunks = list(tiny_client.chat.completions.create(
        model=tiny.model, messages=msgs, temperature=0, max_tokens=40, stop=[stop], stream=True,
        extra_headers={"X-Session-Id": "stop-3"},
    ))
    assert _stream_text(chunks) == expected
    assert stop not in _stream_text(chunks)
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "stop"


def test_stop_sequence_that_never_occurs(tiny, tiny_client):
    """A stop sequence that never occurs changes nothing: full text, finish_reason 'length'."""
    msgs = [{"role": "user", "content": "Count upward."}]
    ref = _greedy(tiny_client, tiny.model, msgs, "nostop-ref", max_tokens=12)
    r = _greedy(tiny_client, tiny.model, msgs, "nostop-1", max_tokens=12, stop=["\u2603"])
    assert _text(r) == _text(ref)
    assert r.choices[0].finish_reason == ref.choices[0].finish_reason


def test_models_list(tiny, tiny_client):
    """/v1/models lists the served model."""
    models = tiny_client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [tiny.model]
    assert models.data[0].owned_by == "kvmesh"


def test_health(tiny, http_tiny):
    """GET /health says ok and names the node, model and slot counts."""
    r = http_tiny.get("/health")
    assert r.status_code == 200
    h = r.json()
    assert h["status"] == "ok"
    assert h["node"] == "api-tiny"
    assert h["model"] == tiny.model
    assert h["slots"] == 2
    assert 0 <= h["busy"] <= 2 and h["queued"] >= 0


def test_concurrent_turns_match_sequential(tiny, tiny_client):
    """Two turns running at once on two slots give the same greedy text as when run alone."""
    prompts = {
        "conc-a": [{"role": "user", "content": "Tell me about rivers."}],
        "conc-b": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about hills, please."}],
    }
    alone = {s: _text(_greedy(tiny_client, tiny.model, m, s + "-alone", max_tokens=40)) for s, m in prompts.items()}
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        futs = {s: ex.submit(_greedy, tiny_client, tiny.model, m, s + "-together", max_tokens=40) for s, m in prompts.items()}
        together = {s: _text(f.result()) for s, f in futs.items()}
    assert together == alone


def _wait_idle(http: httpx.Client, deadline_s: float = 15.0) -> dict[str, Any]:
    """Poll /health until no slot is busy (or the deadline passes); return the last health."""
    end = time.monotonic() + deadline_s
    while True:
        h = http.get("/health").json()
        if h["busy"] == 0 and h["queued"] == 0 or time.monotonic() > end:
            return h
        time.sleep(0.05)


def test_client_disconnect_mid_stream(tiny, tiny_client, http_tiny):
    """A client hanging up mid-stream frees its slot, and the next turn's output is unaffected."""
    msgs = [{"role": "user", "content": "A long tale, please."}]
    ref = _text(_greedy(tiny_client, tiny.model, msgs, "disc-ref", max_tokens=24))
    body = {"model": tiny.model, "messages": msgs, "temperature": 0, "max_tokens": 2000, "stream": True}
    with httpx.Client(base_url=tiny.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=body, headers={"X-Session-Id": "disc-1"}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert all(not ln or ln.startswith("data: ") for ln in got)
        # leaving both blocks closes the connection mid-stream
    h = _wait_idle(http_tiny)
    assert h["busy"] == 0 and h["queued"] == 0, h
    again = _greedy(tiny_client, tiny.model, msgs, "disc-after", max_tokens=24)
    assert _text(again) == ref
    # The hung-up session itself can continue.
    cont = _greedy(tiny_client, tiny.model, msgs, "disc-1", max_tokens=24)
    assert _text(cont) == ref
