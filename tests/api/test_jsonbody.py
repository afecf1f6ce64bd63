"""The one strict JSON path: what every route's body parser refuses, where it says it was, and the renderer."""

from __future__ import annotations

import json
import math

import pytest
from fastapi.routing import APIRoute

from kvmesh.node.api.app import create_app
from kvmesh.node.api.jsonbody import MAX_DEPTH, BodyRefused, StrictJSONRoute, dumps, parse_body
from kvmesh.node.config import EngineConfig, NodeConfig, SimConfig
from kvmesh.node.engine.boundary import LOGPROB_FLOOR, TokenLogprob
from kvmesh.node.node import Node


def refused(raw: bytes | str) -> BodyRefused:
    with pytest.raises(BodyRefused) as ei:
        parse_body(raw.encode() if isinstance(raw, str) else raw)
    assert ei.value.status_code == 400
    return ei.value


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999", "-1e400"])
def test_a_number_json_cannot_hold_is_refused_naming_where(number: str) -> None:
    """NaN, Infinity and numbers past a double are refused, with the JSON path of the value."""
    e = refused('{"text": {"format": {"schema": {"maximum": ' + number + "}}}}")
    assert e.param == "text.format.schema.maximum", e.param
    assert str(e.detail).startswith("text.format.schema.maximum: ")


def test_an_unpaired_surrogate_is_refused_naming_the_field() -> None:
    """A lone surrogate anywhere (a value, a key, a list item) is refused, the top-level field as param."""
    e = refused('{"messages": [{"role": "user", "content": "ok \\ud800"}]}')
    assert e.param == "messages" and "messages[0].content" in str(e.detail) and "d800" in str(e.detail)
    assert refused('{"metadata": {"\\udc00": 1}}').param == "metadata"
    assert refused('{"prompt": ["a", "\\udfff"]}').param == "prompt"


def test_a_surrogate_pair_is_text_and_passes() -> None:
    """An escaped surrogate pair is one valid character (an emoji), not a lone surrogate."""
    assert parse_body(b'{"content": "\\ud83d\\ude00"}') == {"content": "\U0001F600"}


def test_nesting_past_the_bound_is_refused_naming_the_field() -> None:
    """Nesting past MAX_DEPTH is refused, also past the C parser's own recursion limit, naming the top-level field."""
    for depth in (MAX_DEPTH + 2, 50_000):
        e = refused('{"model": "m", "tools": ' + "[" * depth + "]" * depth + "}")
        assert e.param == "tools", (depth, e.detail)
    assert parse_body(("[" * (MAX_DEPTH - 1) + "]" * (MAX_DEPTH - 1)).encode())


def test_an_over_long_integer_is_refused_and_int64_passes() -> None:
    """An integer of hundreds of digits is refused naming its field; the int64 range parses exactly."""
    assert refused('{"seed": ' + "9" * 500 + "}").param == "seed"
    assert parse_body(b'{"seed": -9223372036854775808}') == {"seed": -(2**63)}


def test_bytes_that_are_not_utf8_are_refused_and_bad_syntax_is_a_decode_error() -> None:
    """Non-UTF-8 bytes are a BodyRefused; malformed JSON stays a JSONDecodeError (FastAPI's json_invalid)."""
    refused(b'{"a": "\xff"}')
    with pytest.raises(json.JSONDecodeError):
        parse_body(b'{"a": ')


def test_the_renderer_never_writes_a_bare_nan() -> None:
    """dumps is compact and raises on NaN instead of writing text no client parses."""
    assert dumps({"a": [1, "x"]}) == b'{"a":[1,"x"]}'
    with pytest.raises(ValueError):
        dumps({"a": math.nan})


def test_a_log_probability_of_minus_infinity_is_floored() -> None:
    """A token the model gives no chance (-inf, or NaN) carries LOGPROB_FLOOR, and so do its alternatives."""
    lp = TokenLogprob(b"x", -math.inf, ((b"y", math.nan), (b"z", -1.5)))
    assert lp.logprob == LOGPROB_FLOOR and lp.top == ((b"y", LOGPROB_FLOOR), (b"z", -1.5))
    assert json.loads(dumps([lp.logprob, [v for _, v in lp.top]])) == [LOGPROB_FLOOR, [LOGPROB_FLOOR, -1.5]]


def test_every_route_of_the_node_parses_its_body_strictly() -> None:
    """Every API route in the app is a StrictJSONRoute, so no route can take a body past parse_body."""
    node = Node(NodeConfig(name="routes", engine=EngineConfig(kind="sim", cache_bytes=16 << 20, sim=SimConfig())))
    routes: list[APIRoute] = []
    todo = list(create_app(node).routes)
    while todo:  # FastAPI >= 0.160 keeps an included router whole (its original_router), older ones copy its routes
        r = todo.pop()
        if isinstance(r, APIRoute):
            routes.append(r)
        todo.extend(getattr(getattr(r, "original_router", None), "routes", []))
    assert len(routes) > 10, routes
    loose = [r.path for r in routes if not isinstance(r, StrictJSONRoute)]
    assert not loose, loose
