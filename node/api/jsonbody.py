"""JSON in and out of every route: one strict parser for request bodies, one renderer for answers.

Every route's body is parsed here (`StrictJSONRoute` hands FastAPI a request whose `json()` is
`parse_body`), before any model sees it, so what no dialect can use is refused once, for all of
them, with a 400 that names where in the body it was:
- `NaN`, `Infinity`, `-Infinity` and numbers a double cannot hold (`1e999`): Python's json module
  takes them, JSON does not, and echoing one back (a Responses `text.format`, a tool's schema)
  would write a body no client can parse;
- strings with an unpaired UTF-16 surrogate (`"\\ud800"`): valid JSON escapes, but no UTF-8
  text, so a tokenizer or a log line would fail on them later;
- integers of more than `MAX_INT_DIGITS` digits, and nesting deeper than `MAX_DEPTH`.
`dumps` is the one renderer for what the node writes itself (stream events, forwarded bodies):
compact, and never a bare NaN.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import HTTPException, Request
from fastapi.routing import APIRoute
from starlette.responses import Response

MAX_DEPTH = 128  # real tool schemas nest a dozen levels; the C scanner recurses, so bound it well below its limit
MAX_INT_DIGITS = 40  # past any int64 or token id; Python's own limit (4,300) would cost a quadratic parse first


class BodyRefused(HTTPException):
    """A body no dialect accepts: a 400 naming where (`param`: the JSON path, e.g. `messages[0].content`)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(400, message)
        self.param = param


def _path(parts: list[str | int]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else p)
    return out


def _refuse_constant(name: str) -> float:
    raise BodyRefused(f"the body holds {name}, which is not a JSON number (send a finite number or null)", None)


def _finite_float(text: str) -> float:
    f = float(text)
    if not math.isfinite(f):
        raise BodyRefused(f"the number {text[:40]} is too large for a double", None)
    return f


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise BodyRefused(f"an integer of {len(text)} digits is too long (at most {MAX_INT_DIGITS})", None)
    return int(text)


def _check_text(s: str, where: list[str | int]) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        at = _path(where) or "body"
        raise BodyRefused(f"{at}: the text holds an unpaired UTF-16 surrogate (\\u{ord(s[e.start]):04x} at "
                          f"character {e.start}), which is not valid Unicode", _path(where[:1]) or None) from None


def check_tree(doc: Any) -> None:
    """Refuse a parsed body deeper than MAX_DEPTH or with text that is not valid Unicode (walked without recursion)."""
    stack: list[tuple[Any, list[str | int]]] = [(doc, [])]
    while stack:
        node, where = stack.pop()
        if len(where) > MAX_DEPTH:
            raise BodyRefused(f"the body nests deeper than {MAX_DEPTH} levels (at {_path(where[:4])}...)",
                              _path(where[:1]) or None)
        if isinstance(node, str):
            _check_text(node, where)
        elif isinstance(node, dict):
            for k, v in node.items():
                _check_text(k, where)
                stack.append((v, [*where, k]))
        elif isinstance(node, list):
            stack.extend((v, [*where, i]) for i, v in enumerate(node))


def parse_body(raw: bytes) -> Any:
    """The body as JSON, strictly (see the module's docstring); json.JSONDecodeError for text that is not JSON."""
    try:
        doc = json.loads(raw, parse_constant=_refuse_constant, parse_float=_finite_float, parse_int=_bounded_int)
    except RecursionError:
        where = _deep_field(raw)
        raise BodyRefused(f"{where + ': ' if where else ''}the body nests deeper than {MAX_DEPTH} levels", where) from None
    except UnicodeDecodeError:
        raise BodyRefused("the body is not JSON in UTF-8 (it holds bytes that are not UTF-8)", None) from None
    except BodyRefused as e:
        # The number hooks see only the number's text; name the field by finding the first bad value.
        where = _first_bad_number(raw)
        raise BodyRefused(f"{where}: {e.detail}" if where else str(e.detail), where) from None
    check_tree(doc)
    return doc


def _deep_field(raw: bytes) -> str | None:
    """The top-level field whose value nests past MAX_DEPTH (a scan of the text: the parser itself gave up)."""
    depth, key, in_str, escaped, start = 0, None, False, False, 0
    for i, c in enumerate(raw):
        if in_str:
            if escaped:
                escaped = False
            elif c == 0x5C:  # backslash
                escaped = True
            elif c == 0x22:  # the closing quote
                in_str = False
                if depth == 1:
                    key = raw[start:i].decode("utf-8", "replace")
        elif c == 0x22:
            in_str, start = True, i + 1
        elif c in b"[{":
            depth += 1
            if depth > MAX_DEPTH:
                return key
        elif c in b"]}":
            depth -= 1
    return None


class _LongInt(str):
    """An integer the strict parse refused, kept as its text by the lenient one."""


def _first_bad_number(raw: bytes) -> str | None:
    """Where the first number the strict parse refused sits, from a lenient parse of the same text."""
    try:
        doc = json.loads(raw, parse_int=lambda t: _LongInt(t) if len(t.lstrip("-")) > MAX_INT_DIGITS else 0)
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[Any, list[str | int]]] = [(doc, [])]
    while stack:
        node, where = stack.pop(0)
        if isinstance(node, _LongInt) or isinstance(node, float) and not math.isfinite(node):
            return _path(where) or None
        if isinstance(node, dict):
            stack.extend((v, [*where, k]) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, [*where, i]) for i, v in enumerate(node))
    return None


def dumps(obj: Any) -> bytes:
    """What the node writes itself, compact; ValueError rather than a bare NaN no client can parse."""
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


class StrictRequest(Request):
    """A request whose JSON body is parsed by `parse_body` (FastAPI reads bodies through `json()`)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_body(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """Every route of the node is one of these (a house test keeps it so): its body goes through `parse_body`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict(request: Request) -> Response:
            return await handler(StrictRequest(request.scope, request.receive))

        return strict
