"""Errors: the status, the OpenAI error body (error.message/type/code), never a traceback, never a 500.

Each case is checked with the official client's exception types and with raw
httpx for the exact shape. Most run on the fast sim engine; the context limit
needs the tiny engine (4096 tokens).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


def _ok(model: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": HI, "max_tokens": 4, **kw}


# ---- unknown model -------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_model_is_404_model_not_found(check_error, sim, sim_client, http_sim, stream):
    """An unknown model is 404 with code model_not_found, streaming or not."""
    with pytest.raises(openai.NotFoundError) as ei:
        sim_client.chat.completions.create(model="gpt-nope", messages=HI, max_tokens=4, stream=stream)
    assert ei.value.status_code == 404
    assert ei.value.code == "model_not_found"
    assert ei.value.type == "invalid_request_error"
    err = check_error(http_sim.post(CHAT, json={**_ok("gpt-nope"), "stream": stream}), 404, code="model_not_found")
    assert "gpt-nope" in err["message"]
    assert sim.model in err["message"]  # says what is served


# ---- request validation ----------------------------------------------------------


def test_empty_messages_is_400(check_error, sim, sim_client, http_sim):
    """An empty messages list is 400 naming messages."""
    with pytest.raises(openai.BadRequestError) as ei:
        sim_client.chat.completions.create(model=sim.model, messages=[], max_tokens=4)
    assert ei.value.status_code == 400
    assert ei.value.param == "messages"
    check_error(http_sim.post(CHAT, json=_ok(sim.model, messages=[])), 400, param="messages", says="messages")


BAD_PARAMS = [
    ("temperature", 2.5),
    ("temperature", -0.1),
    ("top_p", 0),
    ("top_p", 1.5),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("max_tokens", "lots"),
    ("max_tokens", 1.5),
    ("max_completion_tokens", 0),
    ("n", 17),  # up to 16 choices (node.api.choices)
    ("n", 0),
    ("seed", 2**64),
    ("stop", ""),
    ("stop", [f"s{i}" for i in range(17)]),  # kvmesh takes 16 (OpenAI 4, Anthropic clients more)
    ("messages", "hi"),
    ("messages", [{"role": "wizard", "content": "hi"}]),
    ("model", ""),
]


@pytest.mark.parametrize(("param", "value"), BAD_PARAMS, ids=[f"{p}={v!r}"[:40] for p, v in BAD_PARAMS])
def test_bad_parameter_is_400_naming_it(check_error, sim, sim_client, http_sim, param, value):
    """An out-of-range or mistyped parameter is 400 with error.param and the message naming it."""
    body = {**_ok(sim.model), param: value}
    with pytest.raises(openai.BadRequestError) as ei:
        sim_client.chat.completions.create(**body)
    assert ei.value.status_code == 400
    assert ei.value.param == param
    check_error(http_sim.post(CHAT, json=body), 400, param=param, says=param)


def test_unknown_fields_are_tolerated_but_unhonoured_ones_are_refused(check_error, sim, sim_client, http_sim):
    """A vendor field kvmesh knows nothing of is tolerated; a field whose effect it cannot give is a 400 naming it."""
    r = sim_client.chat.completions.create(model=sim.model, messages=HI, max_tokens=4, presence_penalty=0,
                                           response_format={"type": "text"}, extra_body={"some_vendor_field": {"x": 1}})
    assert r.choices[0].message.content is not None
    for field, value in (("top_logprobs", 2), ("presence_penalty", 0.5), ("frequency_penalty", 0.1),
                         ("logit_bias", {"1": 5}), ("response_format", {"type": "sound"})):
        err = check_error(http_sim.post(CHAT, json={**_ok(sim.model), field: value}), 400, param=field)
        assert field in err["message"]


def test_malformed_json_is_400_saying_json(check_error, sim, http_sim):
    """A body that is not valid JSON (sent as application/json) is 400 with a message saying JSON."""
    r = http_sim.post(CHAT, content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    check_error(r, 400, says="JSON")


@pytest.mark.parametrize(("content", "ctype"), [
    (b'{"model": "x", "messages": [', "application/x-www-form-urlencoded"),
    (b'{"model": "x", "messages": [', None),
    (b'{"model": "\xff\xfe"}', "application/json"),
], ids=["form-ctype", "no-ctype", "bad-utf8"])
def test_unparsable_body_says_json_whatever_the_content_type(check_error, sim, content, ctype):
    """A body that cannot be read as JSON is 400 with a message saying JSON, whatever its Content-Type."""
    headers = {"content-type": ctype} if ctype else {}
    with httpx.Client(base_url=sim.url, timeout=30) as c:  # a raw request: no default content-type
        req = c.build_request("POST", CHAT, content=content, headers=headers)
        if ctype is None:
            req.headers.pop("content-type", None)
        r = c.send(req)
    check_error(r, 400, says="JSON")


def test_json_that_is_not_an_object_is_400(check_error, sim, http_sim):
    """A JSON array, string or empty body is 400, not 422 or 500."""
    for content in (b"[1, 2]", b'"hello"', b""):
        r = http_sim.post(CHAT, content=content, headers={"content-type": "application/json"})
        check_error(r, 400)


def test_prompt_longer_than_context_is_400_context_length_exceeded(check_error, tiny, tiny_client, http_tiny):
    """A prompt that does not fit the model's context is 400 with code context_length_exceeded."""
    msgs = [{"role": "user", "content": "x" * 5000}]  # 5004 tokens > 4096
    with pytest.raises(openai.BadRequestError) as ei:
        tiny_client.chat.completions.create(model=tiny.model, messages=msgs, max_tokens=4)
    assert ei.value.code == "context_length_exceeded"
    assert ei.value.param == "messages"
    for stream in (False, True):
        err = check_error(
            http_tiny.post(CHAT, json={"model": tiny.model, "messages": msgs, "max_tokens": 4, "stream": stream}),
            400, code="context_length_exceeded", param="messages",
        )
        assert "4096" in err["message"]
    # The node still serves after refusing it.
    assert tiny_client.chat.completions.create(model=tiny.model, messages=HI, max_tokens=2).choices


def test_prompt_just_inside_context_is_served(tiny, tiny_client):
    """A prompt one token short of the context is served (finish 'length': no room left to generate)."""
    # <bos><user> content <end><assistant>: 4 + len(content) tokens = 4095.
    msgs = [{"role": "user", "content": "y" * 4091}]
    r = tiny_client.chat.completions.create(model=tiny.model, messages=msgs, max_tokens=50, temperature=0)
    assert r.usage.prompt_tokens == 4095
    assert r.usage.completion_tokens <= 1  # the context ends after one generated token
    assert r.choices[0].finish_reason == ("length" if r.usage.completion_tokens else "stop")


# ---- body size -------------------------------------------------------------------


def test_body_over_limit_is_413(check_error, small_body):
    """A body over api.max_body_bytes is 413 request_too_large, declared or chunked."""
    big = {"model": small_body.model, "messages": [{"role": "user", "content": "x" * 5000}]}
    with httpx.Client(base_url=small_body.url, timeout=30) as c:
        err = check_error(c.post(CHAT, json=big), 413, code="request_too_large")
        assert "4096" in err["message"]

        def chunked():  # no Content-Length: the limit is enforced while reading
            yield b'{"model": "%s", "messages": [{"role": "user", "content": "' % small_body.model.encode()
            for _ in range(10):
                yield b"x" * 1000
            yield b'"}]}'

        check_error(c.post(CHAT, content=chunked(), headers={"content-type": "application/json"}),
                            413, code="request_too_large")
        # Under the limit is fine on the same server.
        assert c.post(CHAT, json={**big, "messages": HI, "max_tokens": 2}).status_code == 200
    client = openai.OpenAI(base_url=small_body.v1, api_key="x", max_retries=0)
    with pytest.raises(openai.APIStatusError) as ei:
        client.chat.completions.create(model=small_body.model, messages=[{"role": "user", "content": "x" * 5000}])
    assert ei.value.status_code == 413
    assert ei.value.code == "request_too_large"


def test_body_over_default_8mib_is_413(check_error, sim, http_sim):
    """The default limit (8 MiB) refuses a larger body with 413."""
    big = {"model": sim.model, "messages": [{"role": "user", "content": "x" * (8 << 20)}]}
    check_error(http_sim.post(CHAT, json=big), 413, code="request_too_large")


# ---- X-Session-Id ----------------------------------------------------------------

BAD_SESSION_IDS = ["x" * 257, "", "a\tb"]


@pytest.mark.parametrize("sid", BAD_SESSION_IDS, ids=[repr(s)[:20] for s in BAD_SESSION_IDS])
def test_invalid_session_id_is_400_naming_header(check_error, sim, sim_client, http_sim, sid):
    """An X-Session-Id that is not an id (over 256 bytes, empty, a control character) is 400 naming X-Session-Id."""
    with pytest.raises(openai.BadRequestError) as ei:
        sim_client.chat.completions.create(model=sim.model, messages=HI, max_tokens=4,
                                           extra_headers={"X-Session-Id": sid})
    assert ei.value.param == "X-Session-Id"
    for stream in (False, True):
        err = check_error(http_sim.post(CHAT, json=_ok(sim.model, stream=stream), headers={"X-Session-Id": sid}),
                                  400, param="X-Session-Id")
        assert "X-Session-Id" in err["message"]


def test_session_id_limits_are_accepted(sim, http_sim):
    """The longest (256 bytes) and path-like, email, base64 and spaced ids are accepted as X-Session-Id."""
    for sid in ("s" * 256, "A-z_0.9:@x", "../etc", "a/b", "a b", "sess;rm -rf", "\\windows\\path", "b64:ab+/cd=="):
        r = http_sim.post(CHAT, json=_ok(sim.model), headers={"X-Session-Id": sid})
        assert r.status_code == 200, r.text
        assert r.headers["x-session-id"] == sid


# ---- routes ----------------------------------------------------------------------


def test_unknown_route_is_404_json(check_error, sim, http_sim):
    """An unknown route is a 404 OpenAI-shaped JSON error."""
    for method, path in (("GET", "/v2/nothing"), ("POST", "/v1/embeddings"), ("GET", "/v1/chat")):
        err = check_error(http_sim.request(method, path), 404)
        assert path in err["message"]


def test_wrong_method_is_405_json(check_error, sim, http_sim):
    """A known route with the wrong method is 405 with an OpenAI-shaped JSON error."""
    check_error(http_sim.get(CHAT), 405)
    check_error(http_sim.post("/v1/models"), 405)


# ---- no 500s ---------------------------------------------------------------------


def test_no_error_is_a_500_or_a_traceback(check_error, sim, http_sim):
    """A sweep of malformed requests: every answer is a 4xx OpenAI error, none a 500 or a traceback."""
    m = sim.model
    cases: list[dict[str, Any]] = [
        {"content": b"", "headers": {"content-type": "application/json"}},
        {"content": b"null", "headers": {"content-type": "application/json"}},
        {"content": b"[" * 5000 + b"]" * 5000, "headers": {"content-type": "application/json"}},
        {"json": {"model": m}},
        {"json": {"messages": HI}},
        {"json": {"model": m, "messages": [{}]}},
        {"json": {"model": m, "messages": [{"role": "user", "content": 5}]}},
        {"json": {"model": m, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}},
        {"json": {"model": m, "messages": HI, "stream": "yes please"}},
        {"json": {"model": m, "messages": HI, "stream_options": {"include_usage": "maybe"}}},
        {"json": {"model": m, "messages": HI, "user": "u" * 600}},
        {"json": {"model": m, "messages": HI, "stop": ["x" * 300]}},
        {"json": {"model": [m], "messages": HI}},
        {"content": json.dumps({"model": m, "messages": HI}).replace('"hi"', "NaN").encode(),
         "headers": {"content-type": "application/json"}},
        {"content": b'{"model":"%s","messages":[{"role":"user","content":"hi"}],"temperature":NaN}' % m.encode(),
         "headers": {"content-type": "application/json"}},
        {"content": b'{"model":"%s","messages":[{"role":"user","content":"hi"}],"max_tokens":Infinity}' % m.encode(),
         "headers": {"content-type": "application/json"}},
    ]
    for kw in cases:
        with httpx.Client(base_url=sim.url, timeout=30) as c:  # fresh connection each: a 500 closes it
            r = c.post(CHAT, **kw)
        assert 400 <= r.status_code < 500, (kw, r.status_code, r.text)
        check_error(r, r.status_code)


@pytest.mark.parametrize("stream", [False, True])
def test_tiny_positive_temperature_is_not_a_500(sim, stream):
    """temperature=1e-300 (allowed: 0..2) is served like greedy, not answered with a 500."""
    with httpx.Client(base_url=sim.url, timeout=30) as c:
        r = c.post(CHAT, json=_ok(sim.model, temperature=1e-300, stream=stream))
    assert r.status_code == 200, r.text
