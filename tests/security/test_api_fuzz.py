"""The HTTP API fuzzed against its own OpenAPI schema (schemathesis) on a real uvicorn server.

Every operation of `/openapi.json` (the /v1/events websocket is not in it) gets schema-valid and
schema-violating requests, generated deterministically (hypothesis `derandomize=True`, bounded
examples). Admin operations are also replayed with the right admin token so the fuzz reaches past
the auth check; the server has no mesh secret (loopback only), so peer routes are open to it.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.result import Ok

from kvmesh.node.lab.inprocess import ThreadedServer

from .conftest import FUZZ_ADMIN_TOKEN
from .helpers import MODEL, anthropic_error, openai_error

EXAMPLES_PER_MODE = 20


def _check(resp: Any, what: str, path: str) -> None:
    status = resp.status_code
    assert status < 500, f"{what}: HTTP {status}: {resp.text[:500]}"
    if 400 <= status < 500:
        headers = [(k, v) for k, vs in resp.headers.items() for v in (vs if isinstance(vs, list) else [vs])]
        r = httpx.Response(status, headers=headers, content=resp.content)
        shape, check = ("Anthropic", anthropic_error) if path.startswith("/v1/messages") else ("OpenAI", openai_error)
        try:
            check(r)
        except AssertionError as e:
            raise AssertionError(f"{what}: HTTP {status} body is not an {shape} error: {resp.text[:300]!r}") from e


def _operations(srv: ThreadedServer) -> list[Any]:
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    # The document declares its security schemes; this fuzz sends the tokens itself, so schemathesis is not to
    # make up (or, in negative cases, strip) the credential headers.
    schema.config.generation.update(with_security_parameters=False)
    ops, errors = [], []
    for r in schema.get_all_operations():
        if isinstance(r, Ok):
            ops.append(r.ok())
        else:
            errors.append(r.err())
    assert not errors, errors
    assert ops, "the schema has no operations"
    return ops


def test_every_operation_answers_without_5xx_and_with_openai_shaped_errors(fuzz_server: ThreadedServer) -> None:
    """schemathesis, positive and negative, every operation: no 5xx; every 4xx is an OpenAI error with a message."""
    statuses: Counter[tuple[str, int]] = Counter()
    no_negative: list[str] = []
    admin = {"Authorization": f"Bearer {FUZZ_ADMIN_TOKEN}"}
    for op in _operations(fuzz_server):
        if op.path == "/v1/events":  # the websocket: not an HTTP operation
            continue
        label = f"{op.method.upper()} {op.path}"
        is_admin = op.path.startswith("/v1/admin/")
        # The turn routes (with and without /v1): sent again with the served model, to reach the engine.
        is_turn = op.method.upper() == "POST" and op.path.removeprefix("/v1") in (
            "/chat/completions", "/completions", "/messages", "/messages/count_tokens", "/responses")
        has_inputs = any(len(part) for part in (op.path_parameters, op.headers, op.query, op.body))
        # An operation without inputs cannot be sent a schema-violating request.
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_inputs else (GenerationMode.POSITIVE,)
        for mode in modes:

            @settings(max_examples=EXAMPLES_PER_MODE, derandomize=True, database=None, deadline=None,
                      phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                resp = case.call(timeout=30)
                statuses[(label, resp.status_code)] += 1
                _check(resp, f"{label} [{mode}] {case.as_curl_command()}", op.path)
                if is_turn and isinstance(case.body, dict):
                    # Again with the served model and no session header, so the turn reaches the engine.
                    case.body = {**case.body, "model": MODEL}
                    case.headers = {k: v for k, v in (case.headers or {}).items() if k.lower() != "x-session-id"}
                    resp = case.call(timeout=30)
                    statuses[(label + " +model", resp.status_code)] += 1
                    _check(resp, f"{label} [{mode}, served model] {case.as_curl_command()}", op.path)
                if is_admin:
                    resp = case.call(timeout=30, headers=admin)
                    statuses[(label + " +admin", resp.status_code)] += 1
                    _check(resp, f"{label} [{mode}, admin token] {case.as_curl_command(headers=admin)}", op.path)

            try:
                run()
            except Unsatisfiable:
                # Only strings fit a path parameter and a header: for some operations nothing violates the schema.
                if mode is GenerationMode.POSITIVE:
                    raise
                no_negative.append(label)
    # The fuzz reached past validation: turns ran, and the admin token got past the auth check everywhere.
    # Chat's generated bodies are rarely a valid conversation (a tool message first, a response_format without
    # its type: rules the schema cannot state), so the engine is reached through the other dialects here and
    # through chat in test_dialect_fuzz, which mutates valid requests.
    reached = {k[0] for k, n in statuses.items() if k[0].endswith("+model") and k[1] == 200 and n}
    assert {"POST /v1/completions +model", "POST /v1/messages +model", "POST /v1/responses +model"} <= reached, statuses
    assert not [k for k in statuses if k[0].endswith("+admin") and k[1] == 401], statuses
    assert {k[0] for k in statuses if k[0].startswith("POST /v1/admin/") and k[0].endswith("+admin")}, statuses
    print(sorted(statuses.items()), "no negative cases for:", no_negative)


def _body(**kw: Any) -> bytes:
    base: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    base.update(kw)
    return json.dumps(base).encode()



# name -> (raw body, content type). JSON's own escapes (\ud800) carry lone surrogates past the decoder.
HOSTILE_BODIES: dict[str, tuple[bytes, str]] = {
    "surrogate-in-content": (_body(messages=[{"role": "user", "content": "a\ud800b"}]), "application/json"),
    "surrogate-in-text-part": (_body(messages=[{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]),
                               "application/json"),
    "surrogate-in-streamed-content": (_body(messages=[{"role": "user", "content": "\ud83d"}], stream=True), "application/json"),
    "surrogate-in-model": (_body(model="\ud800"), "application/json"),
    "surrogate-in-user": (_body(user="\ud800"), "application/json"),
    "surrogate-in-stop": (_body(stop="\ud800"), "application/json"),
    "surrogate-in-name": (_body(messages=[{"role": "user", "content": "hi", "name": "\ud800"}]), "application/json"),
    "surrogate-as-key": (_body(**{"\ud800": 1}), "application/json"),
    "nested-arrays-5000": (b'{"model":"%s","messages":%s%s}' % (MODEL.encode(), b"[" * 5000, b"]" * 5000), "application/json"),
    "nested-objects-5000": (_body()[:-1] + b',"x":' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}", "application/json"),
    "nan-temperature": (_body()[:-1] + b',"temperature":NaN}', "application/json"),
    "infinity-top-p": (_body()[:-1] + b',"top_p":Infinity}', "application/json"),
    "5000-digit-seed": (_body()[:-1] + b',"seed":' + b"9" * 5000 + b"}", "application/json"),
    "seed-2-to-the-64": (_body(seed=2**64), "application/json"),
    "max-tokens-huge": (_body(max_tokens=10**30), "application/json"),
    "invalid-utf8": (b'{"model":"\xff\xfe","messages":[{"role":"user","content":"\xc3\x28"}]}', "application/json"),
    "utf8-bom": (b"\xef\xbb\xbf" + _body(), "application/json"),
    "utf16-body": (_body().decode().encode("utf-16"), "application/json"),
    "duplicate-keys": (b'{"model":"x","model":"%s","messages":[{"role":"user","content":"hi"}],"max_tokens":2}' % MODEL.encode(),
                       "application/json"),
    "trailing-garbage": (_body() + b"}}}garbage", "application/json"),
    "empty": (b"", "application/json"),
    "null": (b"null", "application/json"),
    "array": (b"[1,2,3]", "application/json"),
    "string": (b'"hello"', "application/json"),
    "plain-text-type": (_body(), "text/plain"),
    "form-type": (b"model=x&messages=y", "application/x-www-form-urlencoded"),
    "no-type": (_body(), ""),
    "content-number": (_body(messages=[{"role": "user", "content": 12345}]), "application/json"),
    "messages-object": (_body(messages={"role": "user", "content": "hi"}), "application/json"),
    "role-unknown": (_body(messages=[{"role": "root", "content": "hi"}]), "application/json"),
    "text-part-unknown-type": (_body(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
                               "application/json"),
    "five-stops": (_body(stop=["a", "b", "c", "d", "e"]), "application/json"),
    "empty-stop": (_body(stop=[""]), "application/json"),
    "n-2": (_body(n=2), "application/json"),
    "stream-options-wrong": (_body(stream=True, stream_options="yes"), "application/json"),
}


@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
def test_hostile_json_bodies_get_4xx_openai_errors_never_5xx(fuzz_server: ThreadedServer, name: str) -> None:
    """Lone surrogates, deep nesting, NaN, huge numbers, bad encodings, wrong types and shapes: never a 5xx; errors OpenAI-shaped."""
    body, ctype = HOSTILE_BODIES[name]
    headers = {"content-type": ctype} if ctype else {}
    r = httpx.post(fuzz_server.url + "/v1/chat/completions", content=body, headers=headers, timeout=30)
    assert r.status_code < 500, (name, r.status_code, r.text[:300])
    if r.status_code >= 400:
        openai_error(r)
    else:
        assert r.status_code == 200, (name, r.status_code, r.text[:300])
