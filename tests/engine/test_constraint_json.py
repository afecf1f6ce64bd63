"""Constrained JSON written as Lark (node.engine.constraint_json), driven through llguidance's matcher byte by byte.

A number under a response_format cannot run past its bound (the matcher refuses the next digit), ordinary
JSON still passes, and the Lark grammar accepts exactly what llguidance's own JSON schema grammar accepts
for values within the bound (hypothesis, several schemas). Tool calls get the same numbers, and a tool's
`$ref`s resolve against its own `$defs`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from typing import Any

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.node.engine.constraint import (
    JSON_STYLE,
    Grammars,
    TokenMask,
    ToolShape,
    answer_schema,
    check,
    closed,
    json_grammar,
    tool_grammar,
)
from kvmesh.node.engine.tokenizer import END, ByteTokenizer
from kvmesh.node.errors import InvalidRequest

BYTES = Grammars(ByteTokenizer(), [END])  # one token per byte: the matcher sees every character
SCORE: dict[str, Any] = {"type": "object", "properties": {"score": {"type": "number"}, "n": {"type": "integer"}},
                         "required": ["score"]}


def matcher(grammar: str) -> TokenMask:
    check(grammar, "response_format")
    return asyncio.run(BYTES.mask(grammar))


def fed(mask: TokenMask, text: str) -> int:
    """How many bytes of `text` the matcher takes before it refuses one."""
    for i, b in enumerate(text.encode()):
        if not mask.allowed(256)[b]:
            return i
        mask.consume(b)
    return len(text.encode())


@functools.cache
def _compiled(grammar: str) -> TokenMask:
    return matcher(grammar)


def accepts(grammar: str, text: str) -> bool:
    mask = _compiled(grammar)
    mask.matcher.reset()
    return fed(mask, text) == len(text.encode()) and bool(mask.matcher.is_accepting())


def test_a_number_stops_at_its_17th_digit() -> None:
    """A response_format number: 17 digits pass, the 18th is refused, and the number can then only end."""
    mask = matcher(json_grammar(SCORE, strict=True))
    head = '{"score": '
    assert fed(mask, head + "1" * 40) == len(head) + 17
    allowed = mask.allowed(256)
    assert not any(allowed[ord(c)] for c in "0123456789.") and allowed[ord("}")] and allowed[ord(",")]
    assert fed(mask, "}") == 1 and mask.matcher.is_accepting()


def test_a_fraction_and_an_integer_stop_too() -> None:
    """A fraction ends at 17 significant digits; an integer at 2**53 (its 16th digit, where that passes 2**53)."""
    mask = matcher(json_grammar(SCORE, strict=True))
    assert fed(mask, '{"score": 0.000' + "3" * 40) == len('{"score": 0.000') + 17
    mask = matcher(json_grammar(SCORE, strict=True))
    head = '{"score": 1, "n": '
    assert fed(mask, head + "9" * 40) == len(head) + 15  # 999999999999999 (15 digits) < 2**53 < 9999999999999999
    assert accepts(json_grammar(SCORE, strict=True), '{"score": 1, "n": 9007199254740992}')
    assert not accepts(json_grammar(SCORE, strict=True), '{"score": 1, "n": 9007199254740993}')


@pytest.mark.parametrize("text", ['{"score": 0}', '{"score": -3.25, "n": 42}', '{"score": 1e-05}', '{"score": 6.02e23}',
                                  '{"score": 0.30000000000000004, "n": -9007199254740992}', '{"score": 12345678901234567}'])
def test_ordinary_numbers_pass(text: str) -> None:
    """Numbers as clients and Python write them (up to 17 digits, exponents with one leading zero) are accepted."""
    assert accepts(json_grammar(SCORE, strict=True), text)


def test_a_bounded_number_keeps_its_range_and_its_bound() -> None:
    """minimum/maximum hold, and a fraction inside the range still stops at 17 digits."""
    g = json_grammar({"type": "object", "properties": {"t": {"type": "number", "minimum": 0, "exclusiveMaximum": 1}},
                      "required": ["t"]}, strict=True)
    assert accepts(g, '{"t": 0}') and accepts(g, '{"t": 0.75}') and not accepts(g, '{"t": 1}')
    assert not accepts(g, '{"t": -0.5}') and not accepts(g, '{"t": 1.5}')
    mask = matcher(g)
    assert fed(mask, '{"t": 0.' + "3" * 40) == len('{"t": 0.') + 17


def test_tool_call_arguments_are_bounded_and_their_refs_resolve() -> None:
    """A forced call's numeric argument stops at its bound; `$ref` to the tool's own `$defs` compiles and holds."""
    params = {"type": "object", "properties": {"at": {"$ref": "#/$defs/Point"}}, "required": ["at"],
              "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                  "required": ["x", "y"]}}}
    g = tool_grammar([ToolShape("move", params, strict=True), ToolShape("stop", None)], forced=True, parallel=True)
    check(g, "tools")
    call = '<tool_call>\n{"name": "move", "arguments": {"at": {"x": 1.5, "y": -2}}}\n</tool_call>'
    assert accepts(g, call) and accepts(g, '<tool_call>\n{"name": "stop", "arguments": {}}\n</tool_call>')
    head = '<tool_call>\n{"name": "move", "arguments": {"at": {"x": '
    assert fed(matcher(g), head + "7" * 30) == len(head) + 17


def test_an_answer_beside_tools_is_bounded_too() -> None:
    """response_format beside tools (tool_choice auto): the JSON answer alternative has the bounded numbers."""
    g = tool_grammar([ToolShape("stop", None)], forced=False, parallel=False, answer=answer_schema(SCORE, strict=True))
    assert accepts(g, '{"score": 2.5}')
    assert fed(matcher(g), '{"score": ' + "4" * 30) == len('{"score": ') + 17


def test_what_llguidance_cannot_enforce_is_still_its_error() -> None:
    """A keyword the Lark rules do not write stays llguidance's: strict refuses what it cannot enforce, lenient does not."""
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "no-such-format"}}}
    with pytest.raises(InvalidRequest, match="cannot be enforced"):
        check(json_grammar(schema, strict=True), "response_format")
    check(json_grammar(schema, strict=False), "response_format")
    with pytest.raises(InvalidRequest, match="not a JSON object"):
        json_grammar(["not", "a", "schema"], strict=False)


# ---- the Lark rules accept what llguidance's own JSON grammar accepts ------------------------------

SCHEMAS: list[dict[str, Any]] = [
    SCORE,
    {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"},
                                                                           "minItems": 1, "maxItems": 3},
                                      "kind": {"enum": ["a", "b"]}, "maybe": {"type": ["number", "null"]},
                                      "ok": {"type": "boolean"}}, "required": ["name", "ok"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string"}, {"type": "array"}]},
                                      "w": {"type": "number", "minimum": -1.5, "maximum": 10}}},
    {"$defs": {"tree": {"type": "object", "properties": {"n": {"type": "number"},
                                                         "kids": {"type": "array", "items": {"$ref": "#/$defs/tree"}}},
                        "required": ["n"]}}, "$ref": "#/$defs/tree"},
    {"type": "object"},
    {"type": "array", "items": {"type": "number"}},
]
KEYS = ["score", "n", "name", "tags", "kind", "maybe", "ok", "v", "w", "kids", "x"]
# Negative zero left out: in a range llguidance refuses "-0.0" (a value inside it), the Lark rules take it.
NUMBERS = st.one_of(st.integers(-(2**53), 2**53), st.floats(allow_nan=False, allow_infinity=False).filter(
    lambda x: (x == 0 and math.copysign(1, x) > 0) or 1e-307 <= abs(x) < 1e308))
VALUES = st.recursive(st.none() | st.booleans() | NUMBERS | st.sampled_from(["a", "b", "", "x y", 'q"uote']),
                      lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4),
                      max_leaves=12)


def following(schema: Any, defs: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values that follow one of SCHEMAS (the keywords they use, no more), properties in the schema's order;
    a `$ref` is followed 3 deep, then its arrays are empty."""
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[1]]
        return following(target if depth < 3 else {**target, "properties": {
            k: ({"type": "array", "maxItems": 0} if v.get("type") == "array" else v) for k, v in target["properties"].items()}},
            defs, depth + 1)
    if "anyOf" in schema:
        return st.one_of([following(sub, defs, depth) for sub in schema["anyOf"]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([following({**schema, "type": k}, defs, depth) for k in kind])
    if kind == "object" and "properties" in schema:
        props, required = schema["properties"], set(schema.get("required", []))

        def build(picked: list[bool], values: list[Any]) -> dict[str, Any]:
            return {k: v for (k, v), keep in zip(zip(props, values), picked) if keep or k in required}
        return st.builds(build, st.lists(st.booleans(), min_size=len(props), max_size=len(props)),
                         st.tuples(*(following(sub, defs, depth) for sub in props.values())).map(list))
    if kind == "array":
        return st.lists(following(schema.get("items", {}), defs, depth), min_size=schema.get("minItems", 0),
                        max_size=min(schema.get("maxItems", 4), 4))
    if kind == "number" and ("minimum" in schema or "maximum" in schema):
        return st.floats(schema.get("minimum"), schema.get("maximum")).filter(
            lambda x: (x == 0 and math.copysign(1, x) > 0) or abs(x) >= 1e-307)
    simple = {"number": NUMBERS, "integer": st.integers(-(2**53), 2**53), "string": st.text(max_size=8),
              "boolean": st.booleans(), "null": st.none(), "object": st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=3)}
    return simple.get(kind, VALUES) if isinstance(kind, str) else VALUES


def _reference(schema: dict[str, Any]) -> str:
    """llguidance's own grammar for the schema, with the same options (what json_grammar built before Lark)."""
    return str(llguidance.LLMatcher.grammar_from_json_schema(closed(schema), overrides={**JSON_STYLE, "lenient": False}))


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
@settings(max_examples=200, deadline=None, database=None)
@given(data=st.data())
def test_the_lark_rules_accept_what_llguidance_json_accepts(index: int, data: st.DataObject) -> None:
    """Within the number bound, a JSON text (one following the schema, or any) passes the Lark grammar exactly
    when it passes llguidance's own."""
    schema = SCHEMAS[index]
    value = data.draw(st.one_of(following(schema, schema.get("$defs", {})), VALUES))
    text = json.dumps(value, ensure_ascii=False)
    assert accepts(json_grammar(schema, strict=True), text) == accepts(_reference(schema), text), (schema, text)
