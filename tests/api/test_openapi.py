"""The node's /openapi.json says what the node does (issue 47, node.api.openapi).

First the document itself: no 422s, every operation's security schemes, errors in the route's
dialect, streams declared, /metrics as the Prometheus text it serves. Then the document against a
real sim node (in-process on port 0, with an API key and an admin token, no mesh secret) with
schemathesis: for every operation, schema-valid and schema-violating requests (derandomized,
bounded) sent with the right key, again with a wrong one, and the turn routes again with the
served model so they answer 200 and stream; every answer must be no 5xx, a declared status, a
declared content type and headers, and a body (each event, for a stream) that fits the declared
schema. The operations that change the node (drain, undrain, adopt, migrate, replicate, admin and
peer, and every PUT and DELETE) run after all the others, so a drain cannot change what an earlier answer was.
"""

from __future__ import annotations

import datetime
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi.routing import APIRoute
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from kvmesh.node.api.admin_routes import admin_only
from kvmesh.node.api.app import create_app
from kvmesh.node.api.clientauth import check_client_key
from kvmesh.node.api.openapi import SECURITY, route_of
from kvmesh.node.api.peer_routes import peer_only
from kvmesh.node.config import ApiConfig, EngineConfig, NodeConfig, SimConfig
from kvmesh.node.lab.inprocess import ThreadedServer, serve_in_thread

KEY = "openapi-client-key-0123456789"
ADMIN = "openapi-admin-token-0123456789"
EXAMPLES = 8  # per operation and generation mode: the whole run stays well under a minute on two cores
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]
TURNS = ("/chat/completions", "/completions", "/messages", "/messages/count_tokens", "/responses")
MUTATING = ("/drain", "/undrain", "/adopt", "/migrate", "/replicate")
STREAMING = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/v1/responses",
             "/responses", "/v1/messages")


def _config() -> NodeConfig:
    # Fast and bounded: a schema-valid max_tokens can be a million, the context (2048) cuts it short.
    sim = SimConfig(kv_scale=0.01, prefill_tps=1e7, decode_tps=1e5, max_context=2048)
    return NodeConfig(name="api-openapi", api=ApiConfig(keys=[KEY]), admin_token=ADMIN,  # type: ignore[arg-type]
                      engine=EngineConfig(kind="sim", cache_bytes=16 << 20, slots=2, queue_max=8, queue_timeout_s=20.0,
                                          sim=sim))


@pytest.fixture(scope="module")
def srv(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[ThreadedServer]:
    """A sim node with one client key and an admin token (no mesh secret: loopback only, peer routes open)."""
    server = serve_in_thread(_config())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    """Keys from the environment would change which requests are let in: none may leak in from the runner."""
    mp = pytest.MonkeyPatch()
    for var in ("KVMESH_API_KEY", "KVMESH_ADMIN_TOKEN", "KVMESH_MESH_SECRET"):
        mp.delenv(var, raising=False)
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def doc(srv: ThreadedServer) -> dict[str, Any]:
    r = httpx.get(srv.url + "/openapi.json", timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _operations(doc: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, item in doc["paths"].items():
        for method, op in item.items():
            yield method, path, op


def test_no_422_anywhere(doc: dict[str, Any]) -> None:
    """No operation declares 422 (a bad request is a 400 here), and the validation-error schemas are gone."""
    assert [(m, p) for m, p, op in _operations(doc) if "422" in op["responses"]] == []
    assert "422" not in str(doc["paths"])
    assert not {"HTTPValidationError", "ValidationError"} & set(doc["components"]["schemas"])


def test_security_schemes_are_declared(doc: dict[str, Any]) -> None:
    """The client key (bearer or x-api-key), the admin token and the peer token are schemes, used where they guard."""
    schemes = doc["components"]["securitySchemes"]
    assert schemes["ClientBearer"] == {**schemes["ClientBearer"], "type": "http", "scheme": "bearer"}
    assert schemes["ClientApiKey"] == {**schemes["ClientApiKey"], "type": "apiKey", "in": "header", "name": "x-api-key"}
    assert schemes["AdminToken"] == {**schemes["AdminToken"], "type": "http", "scheme": "bearer"}
    assert schemes["PeerToken"] == {**schemes["PeerToken"], "type": "apiKey", "in": "header",
                                    "name": "X-Kvmesh-Peer-Auth"}
    security = {(m, p): op["security"] for m, p, op in _operations(doc)}
    either = [{"ClientBearer": []}, {"ClientApiKey": []}, {"PeerToken": []}]
    for path in ("/v1/chat/completions", "/v1/models", "/v1/cluster", "/v1/stats"):
        assert security[("get" if path in ("/v1/models", "/v1/cluster", "/v1/stats") else "post", path)] == either
    for path in ("/health", "/ready", "/metrics"):
        assert security[("get", path)] == []
    assert security[("post", "/v1/admin/hosts/{host}/drain")] == [{"AdminToken": []}]
    assert security[("get", "/v1/peer/status")] == [{"PeerToken": []}]


def _guard(route: APIRoute) -> str:
    """Which token the route's own dependencies ask for (the audience node.api.openapi must name for it)."""
    calls, todo = set(), [route.dependant]
    while todo:
        dep = todo.pop()
        calls.add(dep.call)
        todo.extend(dep.dependencies)
    if admin_only in calls:
        return "admin"
    if peer_only in calls:
        return "peer"
    return "client" if check_client_key in calls else "open"


def _api_routes(routes: list[Any]) -> Iterator[APIRoute]:
    """Every APIRoute, through included routers (FastAPI >= 0.160 keeps an included router whole, as `original_router`)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        elif hasattr(route, "original_router"):
            yield from _api_routes(route.original_router.routes)


def test_every_route_is_declared_with_the_guard_it_has(srv: ThreadedServer, doc: dict[str, Any]) -> None:
    """Each HTTP route the app serves is in the document, listing the schemes its dependencies really check."""
    app = create_app(srv.node)
    seen = set()
    for route in _api_routes(app.routes):
        for method in route.methods:
            m = method.lower()
            guard = _guard(route)
            declared = route_of(m, route.path_format)
            assert declared is not None, f"{method} {route.path_format} is not in node.api.openapi.ROUTES"
            assert declared.audience == guard, (method, route.path_format)
            assert doc["paths"][route.path_format][m]["security"] == SECURITY[guard], (method, route.path_format)  # type: ignore[index]
            seen.add((m, route.path_format))
    assert seen == {(m, p) for m, p, _ in _operations(doc)}
    assert [(m, p) for m, p, op in _operations(doc) if op.get("x-kvmesh-undeclared")] == []


def test_metrics_is_declared_as_the_prometheus_text_it_serves(srv: ThreadedServer, doc: dict[str, Any]) -> None:
    """/metrics declares exactly the content type it answers with (Prometheus text), not JSON."""
    declared = list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"])
    served = httpx.get(srv.url + "/metrics", timeout=30).headers["content-type"]
    assert declared == [served]
    assert served.startswith("text/plain; version=")


def test_errors_are_in_the_dialect_of_the_route(doc: dict[str, Any]) -> None:
    """Anthropic's error body under /v1/messages (529 on overload), OpenAI's elsewhere (429), Retry-After on both."""
    for method, path, op in _operations(doc):
        shape = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
        for status, resp in op["responses"].items():
            if status.startswith("2") or (path == "/ready" and status == "503"):
                continue
            assert resp["content"]["application/json"]["schema"]["$ref"].endswith("/" + shape), (method, path, status)
            if status in ("429", "529"):
                assert "Retry-After" in resp["headers"], (method, path)
    messages = doc["paths"]["/v1/messages"]["post"]["responses"]
    chat = doc["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "529" in messages and "429" not in messages
    assert "429" in chat and "529" not in chat
    for responses in (messages, chat):
        assert {"400", "401", "404", "413"} <= set(responses)


def test_dialect_routes_declare_their_bodies_and_streams(doc: dict[str, Any]) -> None:
    """Each turn route answers JSON of its dialect's schema, or an event stream; the rest name their bodies too."""
    for path in STREAMING:
        content = doc["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}, path
    bodies = {("get", "/v1/models"): "ModelList", ("post", "/v1/messages/count_tokens"): "TokenCount",
              ("post", "/v1/chat/completions"): "ChatCompletion", ("post", "/v1/completions"): "TextCompletion",
              ("post", "/v1/responses"): "Response", ("post", "/v1/messages"): "AnthropicMessage",
              ("get", "/v1/cluster"): "ClusterView", ("get", "/health"): "Health", ("get", "/ready"): "Ready",
              ("get", "/v1/responses/{response_id}"): "Response"}
    for (method, path), name in bodies.items():
        schema = doc["paths"][path][method]["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": f"#/components/schemas/{name}"}, path
        assert name in doc["components"]["schemas"]


def _operation(srv: ThreadedServer, method: str, path: str) -> Any:
    return schemathesis.openapi.from_url(srv.url + "/openapi.json")[path][method]


def _fails(case: Any, status: int, ctype: str, body: bytes) -> bool:
    """Whether schemathesis finds this answer at odds with the document."""
    resp = httpx.Response(status, headers={"content-type": ctype}, content=body,
                          request=httpx.Request(case.method, "http://node" + case.formatted_path))
    resp.elapsed = datetime.timedelta(0)  # what schemathesis reads of a response it did not time itself
    try:
        case.validate_response(resp, checks=CHECKS)
    except (AssertionError, FailureGroup):
        return True
    return False


def test_the_checks_see_a_body_or_stream_the_document_does_not_allow(srv: ThreadedServer) -> None:
    """The conformance run can fail: a chat answer or stream chunk missing fields, an error in the wrong shape, fail."""
    chat = _operation(srv, "POST", "/v1/chat/completions").Case(body={"model": "m", "messages": []})
    good_chunk = (b'{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,'
                  b'"delta":{"content":"x"},"finish_reason":null,"logprobs":null}]}')
    assert not _fails(chat, 200, "text/event-stream", b"data: " + good_chunk + b"\n\ndata: [DONE]\n\n")
    assert _fails(chat, 200, "text/event-stream", b'data: {"id":"c","object":"chat.completion.chunk"}\n\n')
    assert _fails(chat, 200, "application/json", b'{"id":"c","object":"chat.completion"}')
    assert _fails(chat, 200, "text/html", b"<html></html>")
    assert _fails(chat, 422, "application/json", b'{"detail":[]}')
    assert _fails(chat, 400, "application/json", b'{"type":"error","error":{"type":"x","message":"m"}}')
    messages = _operation(srv, "POST", "/v1/messages").Case(body={"model": "m", "messages": [], "max_tokens": 1})
    assert not _fails(messages, 400, "application/json",
                      b'{"type":"error","error":{"type":"invalid_request_error","message":"m"}}')
    assert _fails(messages, 400, "application/json", b'{"error":{"message":"m","type":"t","param":null,"code":null}}')
    assert _fails(messages, 200, "text/event-stream", b'event: nonsense\ndata: {"type":"nonsense"}\n\n')


def _operations_in_order(srv: ThreadedServer) -> list[Any]:
    """The document's operations as schemathesis reads them, the ones that change the node last."""
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    ops, errors = [], []
    for r in schema.get_all_operations():
        (ops if isinstance(r, Ok) else errors).append(r.ok() if isinstance(r, Ok) else r.err())
    assert not errors, errors
    return sorted(ops, key=lambda op: op.method.upper() in ("PUT", "DELETE") or op.path.endswith(MUTATING))


def _valid_bodies(path: str, model: str) -> list[dict[str, Any]]:
    """Hand-written requests each turn route answers 200 to, whole and streamed, with the options that change the
    body's shape (usage chunks, log probabilities, several choices): generated bodies rarely get that far."""
    hi = [{"role": "user", "content": "hi"}]
    bodies: dict[str, list[dict[str, Any]]] = {
        "/chat/completions": [{"messages": hi, "max_tokens": 8}, {"messages": hi, "max_tokens": 8, "stream": True},
                              {"messages": hi, "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True},
                               "logprobs": True, "top_logprobs": 2},
                              {"messages": hi, "max_tokens": 4, "logprobs": True, "top_logprobs": 2, "n": 2},
                              {"messages": hi, "max_tokens": 4, "n": 2, "stream": True}],
        "/completions": [{"prompt": "hi", "max_tokens": 8}, {"prompt": "hi", "max_tokens": 8, "logprobs": 2},
                         {"prompt": "hi", "max_tokens": 8, "stream": True, "logprobs": 2,
                          "stream_options": {"include_usage": True}}],
        "/messages": [{"messages": hi, "max_tokens": 8}, {"messages": hi, "max_tokens": 8, "stream": True}],
        "/messages/count_tokens": [{"messages": hi}],
        "/responses": [{"input": hi, "max_output_tokens": 8}, {"input": hi, "max_output_tokens": 8, "stream": True},
                       {"input": hi, "max_output_tokens": 8, "include": ["message.output_text.logprobs"],
                        "top_logprobs": 2}],
    }
    return [{"model": model, **b} for b in bodies.get(path.removeprefix("/v1"), [])]


def _auth(path: str) -> dict[str, str]:
    if path.startswith("/v1/admin/"):
        return {"Authorization": f"Bearer {ADMIN}"}
    return {} if path.startswith("/v1/peer/") else {"Authorization": f"Bearer {KEY}"}


def test_a_stored_response_is_read_listed_and_deleted_as_declared(srv: ThreadedServer) -> None:
    """A stored Responses answer: its GET, its input_items and its DELETE answer 200 with the declared bodies, then 404."""
    schema = schemathesis.openapi.from_url(srv.url + "/openapi.json")
    if "/v1/responses/{response_id}/input_items" not in schema:
        pytest.skip("this build keeps no responses")
    run = Conformance(srv.model)
    made = httpx.post(srv.url + "/v1/responses", headers=_auth("/v1/responses"), timeout=30,
                      json={"model": srv.model, "input": [{"role": "user", "content": "hi"}], "max_output_tokens": 4})
    assert made.status_code == 200, made.text
    ids = {"response_id": made.json()["id"]}
    for method, path in (("GET", "/v1/responses/{response_id}"), ("GET", "/v1/responses/{response_id}/input_items"),
                         ("DELETE", "/v1/responses/{response_id}"), ("GET", "/v1/responses/{response_id}")):
        run.send(schema[path][method].Case(path_parameters=ids), f"{method} {path}", _auth(path))
    assert not run.failures, "\n\n".join(run.failures)
    assert [s for (_, s), n in run.statuses.items() for _ in range(n)] == [200, 200, 200, 404], run.statuses


class Conformance:
    """Sends cases to the node and keeps what schemathesis found at odds with the document, and every status seen."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.statuses: Counter[tuple[str, int]] = Counter()
        self.failures: list[str] = []

    def send(self, case: Any, what: str, headers: dict[str, str]) -> None:
        resp = case.call(headers=headers, timeout=30)
        self.statuses[(what, resp.status_code)] += 1
        try:
            case.validate_response(resp, checks=CHECKS, headers=headers)
        except (AssertionError, FailureGroup) as e:
            self.failures.append(f"{what}: {e}\n{case.as_curl_command(headers=headers)}"[:3000])

    def operation(self, op: Any) -> None:
        """Hand-written valid requests (POST turn routes), then generated ones, positive and negative."""
        label = f"{op.method.upper()} {op.path}"
        if op.method.upper() == "POST":
            for body in _valid_bodies(op.path, self.model):
                self.send(op.Case(body=body, media_type="application/json"), f"{label} [valid]", _auth(op.path))
        has_inputs = any(len(part) for part in (op.path_parameters, op.headers, op.query, op.body))
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_inputs else (GenerationMode.POSITIVE,):
            try:
                self.generated(op, label, mode)
            except Unsatisfiable:
                # Only strings fit some operations' inputs: nothing violates their schema.
                if mode is GenerationMode.POSITIVE:
                    raise

    def generated(self, op: Any, label: str, mode: GenerationMode) -> None:
        is_turn = op.method.upper() == "POST" and op.path.removeprefix("/v1") in TURNS
        guarded = not op.path.startswith("/v1/peer/") and op.path not in ("/health", "/ready", "/metrics")

        @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case: Any) -> None:
            self.send(case, f"{label} [{mode.value}]", _auth(op.path))
            if guarded:
                self.send(case, f"{label} [{mode.value}, wrong key]", {"Authorization": "Bearer not-the-key"})
            if is_turn and isinstance(case.body, dict):
                # Again with the served model, so the turn reaches the engine and answers 200 (or streams).
                case.body = {**case.body, "model": self.model}
                self.send(case, f"{label} [{mode.value}, served model]", _auth(op.path))

        run()


def test_a_sim_node_answers_as_its_document_says(srv: ThreadedServer) -> None:
    """schemathesis on every operation: no 5xx, only declared statuses, content types and headers, bodies that fit."""
    started = time.monotonic()
    run = Conformance(srv.model)
    for op in _operations_in_order(srv):
        run.operation(op)
    statuses = run.statuses
    print(f"{time.monotonic() - started:.1f}s", sorted(statuses.items()))
    assert not run.failures, "\n\n".join(run.failures[:20]) + f"\n\n({len(run.failures)} failures)"
    # The run reached past validation: turns ran and streamed, and the wrong key was refused.
    ran = {what for (what, status) in statuses if status == 200}
    assert {f"POST {p} [valid]" for p in STREAMING} <= ran, statuses
    assert any(status == 200 and "served model" in what for (what, status) in statuses), statuses
    # (a body that is not JSON is refused before the key is looked at: a negative case may get its 400 first)
    assert all(status == 401 for (what, status) in statuses if "positive, wrong key" in what), statuses
