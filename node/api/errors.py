"""Error bodies for every failure, in the shape of the dialect the client spoke, and the request-size limit.

Routes under /v1/messages answer in Anthropic's shape (`{"type": "error", "error": {"type",
"message"}}`, its error types by status); every other route in OpenAI's (`{"error": {"message",
"type", "param", "code"}}`). No response ever carries a traceback: known errors say what was
wrong; anything unexpected is logged here and answered with a plain 500 message.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvmesh.node.api.schema import ErrorBody, ErrorDetail
from kvmesh.node.errors import KVMeshError, Overloaded

log = logging.getLogger("kvmesh.api")


# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    return path.startswith(("/v1/messages", "/messages"))


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error object (also the payload of a stream's `error` event)."""
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": message}}


def error_json(status: int, message: str, type_: str, code: str | None = None, param: str | None = None,
               headers: dict[str, str] | None = None, *, path: str = "") -> JSONResponse:
    """The error in the shape of the route's dialect (`path`: the request's)."""
    if is_anthropic(path):
        return JSONResponse(anthropic_error(status, message), status_code=status, headers=headers)
    body = ErrorBody(error=ErrorDetail(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def error_status(exc: KVMeshError, path: str) -> int:
    """The HTTP status of `exc` in the route's dialect: Anthropic's API answers overload with 529
    (`overloaded_error`, which its SDKs and Claude Code retry), keeping 429 for a client's own rate limit."""
    return 529 if isinstance(exc, Overloaded) and is_anthropic(path) else exc.status


# The internal request is chat completions' (node.api.schema); an error about one of its fields names the
# field the client sent in its own dialect.
_RESPONSES_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}
_DIALECT_PARAMS = {"/v1/responses": _RESPONSES_PARAMS, "/responses": _RESPONSES_PARAMS,
                   "/v1/completions": {"messages": "prompt"}, "/completions": {"messages": "prompt"}}


def dialect_param(param: str | None, path: str) -> str | None:
    """`param` as the route at `path` calls it."""
    return _DIALECT_PARAMS.get(path.rstrip("/"), {}).get(param or "", param)


def kvmesh_error_response(exc: KVMeshError, path: str = "") -> JSONResponse:
    headers = None
    if isinstance(exc, Overloaded):
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s)))}
    return error_json(error_status(exc, path), str(exc), exc.type, exc.code,
                      dialect_param(getattr(exc, "param", None), path), headers, path=path)


def _describe_validation(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    parts, param = [], None
    for e in errors[:5]:
        loc = [str(p) for p in e.get("loc", ()) if p != "body"]
        where = ".".join(loc)
        if e.get("type") == "json_invalid":
            return "the request body is not valid JSON: " + str(e.get("ctx", {}).get("error", e.get("msg"))), None
        if not loc and e.get("type") in ("dict_type", "model_attributes_type", "model_type"):
            return "the request body must be a JSON object (send it with Content-Type: application/json)", None
        param = param or (loc[0] if loc else None)
        parts.append(f"{where or 'body'}: {e.get('msg')}")
    return "invalid request: " + "; ".join(parts), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KVMeshError)
    async def _kvmesh(request: Request, exc: KVMeshError) -> JSONResponse:
        return kvmesh_error_response(exc, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(list(exc.errors()))
        return error_json(400, message, "invalid_request_error", "invalid_value", param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        elif exc.status_code == 400 and str(exc.detail) == "There was an error parsing the body":
            message = "the request body could not be parsed as JSON (is it UTF-8?)"
        else:
            message = str(exc.detail)
        code = {400: "invalid_value", 413: "request_too_large"}.get(exc.status_code, str(exc.status_code))
        return error_json(exc.status_code, message, "invalid_request_error", code, getattr(exc, "param", None),
                          headers=dict(exc.headers or {}), path=request.url.path)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error serving %s %s", request.method, request.url.path)
        return error_json(500, "internal error; the node logged the details", "server_error", "internal_error",
                          path=request.url.path)


class BodyLimit:
    """ASGI middleware: refuse request bodies over `max_bytes` with 413 before reading them whole."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.max_bytes:
                    # An HTTPException so FastAPI's body reader passes it through to our handler.
                    raise HTTPException(413, self._message())
            return msg

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"request body larger than {self.max_bytes} bytes"

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        resp = error_json(413, self._message(), "invalid_request_error", "request_too_large", path=scope.get("path", ""))
        await resp(scope, receive, send)
