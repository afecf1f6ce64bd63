"""The node's `/openapi.json`, made true to what the node does (issue 47): client generators and
gateways read it, so it must say what the node answers, not what FastAPI assumes.

FastAPI's generated document is post-processed once (`install_openapi` overrides `app.openapi`
with a cached build): its 422s are removed (validation errors are 400s: node.api.errors); every
operation declares the statuses it really answers, each with its error body in its dialect
(Anthropic's under /v1/messages, OpenAI's elsewhere) and Retry-After on an overload; the
dialect routes get their success bodies (node.api.openapi_bodies) and, where they stream,
`text/event-stream` beside JSON; `/metrics` is Prometheus text; and each operation lists the
security schemes that guard it. `ROUTES` says, for every operation, who may call it and what it
answers besides what is derived (400 where FastAPI validates its input, 401 where a token guards
it, 413 on every POST: the body limit). An operation it does not name is marked
`x-kvmesh-undeclared` rather than guessed at, and the tests fail on it: a new route is a decision. The websocket routes (/v1/events, /v1/peer/state) cannot be said
in OpenAPI; the README describes them.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Literal

from fastapi import FastAPI
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kvmesh.node.api.errors import is_anthropic
from kvmesh.node.api.openapi_bodies import BODIES, REF, STREAMS, Schema, ref, stream_events
from kvmesh.node.mesh.auth import PEER_HEADER
from kvmesh.node.protocol import ClusterView, DirectoryEntry, PeerStatus, SessionHolding

Audience = Literal["client", "open", "peer", "admin"]

SECURITY_SCHEMES: dict[str, Schema] = {
    "ClientBearer": {"type": "http", "scheme": "bearer", "description":
                     "A client API key (api.keys, KVMESH_API_KEY) as `Authorization: Bearer <key>`, as OpenAI SDKs send "
                     "it. With no key configured the client routes are open."},
    "ClientApiKey": {"type": "apiKey", "in": "header", "name": "x-api-key", "description":
                     "A client API key as `x-api-key: <key>`, as Anthropic SDKs send it; either header will do."},
    "AdminToken": {"type": "http", "scheme": "bearer", "description":
                   "The admin token (admin_token, KVMESH_ADMIN_TOKEN) as `Authorization: Bearer <token>`. With none "
                   "configured every admin route answers 401."},
    "PeerToken": {"type": "apiKey", "in": "header", "name": PEER_HEADER, "description":
                  "The mesh's peer token (an HMAC of the mesh secret, current or previous). With no mesh secret the "
                  "mesh is loopback-only and peer routes are open. On a client route it stands in for the client's "
                  "key: a turn a peer forwarded."},
}

SECURITY: dict[Audience, list[dict[str, list[str]]]] = {
    "client": [{"ClientBearer": []}, {"ClientApiKey": []}, {"PeerToken": []}],
    "open": [],
    "peer": [{"PeerToken": []}],
    "admin": [{"AdminToken": []}],
}

UNAUTHORIZED: dict[Audience, str] = {
    "client": "No API key, or one not accepted (only where the node has keys configured)",
    "peer": "No peer token, or a wrong one (only where the mesh has a secret)",
    "admin": "No admin token, a wrong one, or none configured on this node",
}

ERRORS = {
    400: "The request is not valid: its body is not JSON or not an object, or a field or parameter is wrong "
         "(the error names it)",
    413: "The request body is larger than api.max_body_bytes",
    502: "The peer the turn ran on broke off before the answer was whole",
    503: "The engine is not answering (a vLLM engine down), or a peer running the turn said so",
}
OVERLOADED = ("Overloaded: every slot is busy and the wait queue is full, or no slot freed within the queue "
              "timeout. Retry after Retry-After seconds")
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before trying again (at least 1)",
                               "schema": {"type": "integer", "minimum": 1}}}
MODEL_404 = "The model is not served here (GET /v1/models lists what is)"
TURN = {404: MODEL_404, 429: OVERLOADED, 502: ERRORS[502], 503: ERRORS[503]}

# The pydantic models some routes send as raw JSON (json_response), which FastAPI cannot see.
RAW_MODELS: dict[str, type[BaseModel]] = {
    "/v1/cluster": ClusterView, "/v1/peer/status": PeerStatus, "/v1/peer/directory/{session}": DirectoryEntry,
    "/v1/peer/sessions/{session}": SessionHolding,
}


@dataclass(frozen=True)
class Route:
    """What one operation is, beyond what the generated document says: who may call it, the statuses
    it answers besides the derived ones (with why), and its success body (a component name)."""

    audience: Audience
    statuses: dict[int, str]
    body: str | None = None
    stream: str | None = None  # the kind of stream it sends when asked to (openapi_bodies.STREAMS)
    plain: dict[int, str] = field(default_factory=dict)  # non-2xx statuses answered with the success body


def _client(body: str | None, statuses: dict[int, str] | None = None, stream: str | None = None) -> Route:
    return Route("client", statuses or {}, body, stream)


_UNSTORED = "No such stored response for this API key (never stored, store=false, expired, or deleted)"
_HOST = {404: "No such host in this mesh", 409: "The host the action was relayed to refused it or did not answer"}
_SESSION = {400: "The session id is not a valid one (node.sessionids)"}

# Every operation, by method and path ("/v1" left off the OpenAI routes served with and without it).
ROUTES: dict[tuple[str, str], Route] = {
    ("post", "/v1/chat/completions"): _client("ChatCompletion", TURN, "chat"),
    ("post", "/v1/completions"): _client("TextCompletion", TURN, "completions"),
    ("post", "/v1/responses"): _client("Response", {**TURN, 404: f"{MODEL_404}; or previous_response_id names no "
                                                             f"response: {_UNSTORED}"}, "responses"),
    ("get", "/v1/responses/{response_id}"): _client("Response", {404: _UNSTORED}),
    ("delete", "/v1/responses/{response_id}"): _client("ResponseDeleted", {404: _UNSTORED}),
    ("get", "/v1/responses/{response_id}/input_items"): _client("ResponseInputItems", {
        404: f"{_UNSTORED}; or `after` names no input item of it"}),
    ("post", "/v1/messages"): _client("AnthropicMessage", {404: MODEL_404, 529: OVERLOADED, 502: ERRORS[502],
                                                            503: ERRORS[503]}, "messages"),
    ("post", "/v1/messages/count_tokens"): _client("TokenCount", {404: MODEL_404}),
    ("get", "/v1/models"): _client("ModelList"),
    # Observers: behind the client key where one is set (issue 47), like the client routes.
    ("get", "/v1/cluster"): _client(None),
    ("get", "/v1/stats"): _client(None),
    ("get", "/health"): Route("open", {}, "Health"),
    ("get", "/ready"): Route("open", {}, "Ready", plain={503: "Not taking clients: the node is draining or stopping"}),
    ("get", "/metrics"): Route("open", {}),
    ("get", "/v1/peer/status"): Route("peer", {}),
    ("get", "/v1/peer/directory/{session}"): Route("peer", _SESSION),
    ("post", "/v1/peer/hello"): Route("peer", {409: "This node has no mesh secret: it cannot prove membership"}),
    ("get", "/v1/peer/sessions/{session}"): Route("peer", _SESSION),
    ("post", "/v1/peer/drain"): Route("peer", {}),
    ("post", "/v1/peer/undrain"): Route("peer", {}),
    ("post", "/v1/peer/sessions/{session}/adopt"): Route("peer", _SESSION),
    ("post", "/v1/peer/sessions/{session}/migrate"): Route("peer", _SESSION),
    ("post", "/v1/peer/sessions/{session}/replicate"): Route("peer", _SESSION),
    ("get", "/v1/peer/responses/{session}"): Route("peer", {**_SESSION, 404: "No stored responses of it here"}),
    ("put", "/v1/peer/responses/{session}"): Route("peer", {}),
    ("post", "/v1/admin/hosts/{host}/drain"): Route("admin", _HOST),
    ("post", "/v1/admin/hosts/{host}/undrain"): Route("admin", _HOST),
    ("post", "/v1/admin/sessions/{session}/migrate"): Route("admin", {
        **_SESSION, 404: "The target is no host of this mesh", 409: "No target host was named"}),
    ("post", "/v1/admin/sessions/{session}/replicate"): Route("admin", _SESSION),
}

_UNPREFIXED = ("/chat/completions", "/completions", "/responses", "/models")


def route_of(method: str, path: str) -> Route | None:
    """The operation's entry in ROUTES; None for one it does not name (a new route: add it there)."""
    if path.startswith(_UNPREFIXED):
        path = "/v1" + path
    return ROUTES.get((method, path))


def _error(status: int, description: str, path: str) -> Schema:
    out: Schema = {"description": description, "content": {
        "application/json": {"schema": ref("AnthropicError" if is_anthropic(path) else "OpenAIError")}}}
    if status in (429, 529):
        out["headers"] = copy.deepcopy(RETRY_AFTER)
    return out


def _checks_input(op: Schema) -> bool:
    """Whether FastAPI refuses some requests: it takes a body, or a parameter that may be missing or that not every
    string fits (a route that checks a plain string itself, a session id, lists its own 400)."""
    def constrained(p: Schema) -> bool:
        plain = {k: v for k, v in p.get("schema", {}).items() if k != "title"} == {"type": "string"}
        return not plain or (p.get("required", False) and p.get("in") != "path")
    return bool(op.get("requestBody")) or any(constrained(p) for p in op.get("parameters", []))


def _statuses(method: str, op: Schema, route: Route) -> dict[int, str]:
    """Every error status the operation answers, with why: the derived ones, then the route's own."""
    out: dict[int, str] = {}
    if _checks_input(op):
        out[400] = ERRORS[400]
    if route.audience != "open":
        out[401] = UNAUTHORIZED[route.audience]
    if method in ("post", "put", "patch"):
        out[413] = ERRORS[413]
    out.update(route.statuses)
    return out


def _success(path: str, op: Schema, route: Route) -> None:
    """The 200's content: the route's body (and its stream), Prometheus text, or a raw route's model."""
    ok = op["responses"].setdefault("200", {"description": "Successful Response"})
    if route.body is not None:
        content: Schema = {"application/json": {"schema": ref(route.body)}}
        if route.stream is not None:
            words = STREAMS[route.stream]
            content["text/event-stream"] = {"schema": {**stream_events()[route.stream], "description": words}}
            ok["description"] = f"The whole answer as JSON; with `stream: true`, a server-sent event stream: {words}"
        ok["content"] = content
    elif path == "/metrics":
        ok["description"] = "Prometheus text exposition"
        ok["content"] = {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}
    elif path in RAW_MODELS:
        ok["content"] = {"application/json": {"schema": ref(RAW_MODELS[path].__name__)}}


def _operation(method: str, path: str, op: Schema) -> None:
    route = route_of(method, path)
    responses: dict[str, Schema] = op.setdefault("responses", {})
    responses.pop("422", None)
    if route is None:
        # Serving the document matters more than its being whole: an unnamed route is flagged, not a 500.
        op["x-kvmesh-undeclared"] = True
        return
    # The admin token is its security scheme; OpenAPI ignores an Authorization header parameter anyway.
    params = [p for p in op.get("parameters", []) if not (p.get("in") == "header" and p.get("name", "").lower()
                                                          == "authorization")]
    if params:
        op["parameters"] = params
    else:
        op.pop("parameters", None)
    _success(path, op, route)
    for status, why in sorted(_statuses(method, op, route).items()):
        responses[str(status)] = _error(status, why, path)
    for status, why in route.plain.items():
        responses[str(status)] = {"description": why, "content": copy.deepcopy(responses["200"]["content"])}
    op["responses"] = dict(sorted(responses.items()))
    op["security"] = copy.deepcopy(SECURITY[route.audience])


def _add_components(doc: Schema) -> None:
    schemas: Schema = doc.setdefault("components", {}).setdefault("schemas", {})
    _, defs = models_json_schema([(m, "serialization") for m in RAW_MODELS.values()],
                                 ref_template=REF + "{model}")
    for name, schema in defs.get("$defs", {}).items():
        schemas.setdefault(name, schema)  # a model FastAPI named already is the same model
    for name, schema in BODIES.items():
        if schemas.get(name, schema) != schema:
            # Two schemas under one name: the routes' refs would point at the wrong one.
            raise RuntimeError(f"the OpenAPI schema name {name!r} is taken by a request model; rename one")
        schemas[name] = copy.deepcopy(schema)
    doc["components"]["securitySchemes"] = copy.deepcopy(SECURITY_SCHEMES)


def _drop_unused(doc: Schema) -> None:
    """Drop the validation-error schemas the 422s referred to, once nothing refers to them."""
    schemas: Schema = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        rest = {k: v for k, v in schemas.items() if k != name}
        if name in schemas and f'"{REF}{name}"' not in json.dumps({**doc, "components": {"schemas": rest}}):
            del schemas[name]


def true_document(generated: Schema) -> Schema:
    """FastAPI's document, made to say what the node does (a new dict; `generated` is not changed)."""
    doc = copy.deepcopy(generated)
    _add_components(doc)
    for path, item in doc.get("paths", {}).items():
        for method, op in item.items():
            _operation(method, path, op)
    _drop_unused(doc)
    doc.setdefault("info", {})["description"] = (
        "A kvmesh node: OpenAI chat, completions and Responses; Anthropic Messages; health, observer, peer and "
        "admin routes. Errors are 400 for a bad request (never 422), in the shape of the route's dialect. The "
        "websocket routes (/v1/events, the observers' event stream; /v1/peer/state, a peer's state feed) are "
        "not described here: see the README.")
    return doc


def install_openapi(app: FastAPI) -> None:
    """Serve `true_document` of the app's generated document as its /openapi.json, built once, when first asked."""
    generate = app.openapi  # FastAPI's own generator
    built: list[Schema] = []

    def document() -> Schema:
        if not built:
            built.append(true_document(generate()))
            app.openapi_schema = built[0]  # what FastAPI's own /docs pages read
        return built[0]

    app.openapi = document  # type: ignore[method-assign]
