"""JSON schemas written as llguidance Lark rules, so numbers can be bounded (node.engine.constraint's JSON).

llguidance compiles a JSON schema itself (`%json {...}` in Lark), but its numbers have no bound on
their digits and it has no option for one (node.engine.constraint_numbers says what the bound is and
why). So the parts of a schema that hold numbers are written here as Lark: objects, arrays, anyOf,
`$ref`, type lists, strings, booleans, null, and numbers as the bounded terminal. Whatever else a
schema says (enum, const, a string's pattern or format, oneOf, allOf, an object's pattern or
additional properties, `not`, ...) stays an llguidance `%json` leaf with the same options
(JSON_STYLE, lenient or not), so its meaning, and the error where it cannot be enforced, are
llguidance's own. The text is llguidance's too: properties in the schema's order, ", " and ": ",
no other whitespace; an integer is llguidance's with its open sides bounded at 2**53 (exact_integers).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvmesh.node.engine.constraint_numbers import EXACT_INT, finite_number, number_regex, range_regexes

JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
# Keywords that say nothing of a value's text (x-guidance: the options are this module's, JSON_STYLE).
_NOTES = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
                    "$schema", "x-guidance", "$defs", "definitions"})
_KEYWORDS = {  # what a structured rule of each type honours; any other keyword makes the subschema a %json leaf
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "minItems", "maxItems"},
    "number": {"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"},
    "string": {"type"}, "boolean": {"type"}, "null": {"type"},
}
_STRING = r'/"(\\([\"\\\/bfnrt]|u[a-fA-F0-9]{4})|[^\"\\\x00-\x1F\x7F])*"/'  # llguidance's JSON string
_MAX_REPEAT = 256  # minItems/maxItems written out as a Lark repeat up to this; beyond it a %json leaf


def map_schema(schema: Any, fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """`fn` applied to every subschema (children first), through every keyword that holds schemas."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for k in SCHEMA_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: map_schema(sub, fn) for name, sub in out[k].items()}
    for k in SCHEMA_LISTS:
        if isinstance(out.get(k), list):
            out[k] = [map_schema(sub, fn) for sub in out[k]]
    for k in SCHEMA_ONE:
        if isinstance(out.get(k), dict):
            out[k] = map_schema(out[k], fn)
    return fn(out)


def _exact_integer(s: dict[str, Any]) -> dict[str, Any]:
    if s.get("type") != "integer":
        return s
    out = dict(s)
    low, high = s.get("minimum", s.get("exclusiveMinimum")), s.get("maximum", s.get("exclusiveMaximum"))
    # A side the schema bounds beyond 2**53 keeps the other open: closing it would make the schema unsatisfiable.
    if low is None and not (finite_number(high) and high < -EXACT_INT):
        out["minimum"] = -EXACT_INT
    if high is None and not (finite_number(low) and low > EXACT_INT):
        out["maximum"] = EXACT_INT
    return out


def exact_integers(schema: Any) -> Any:
    """The schema with every integer's open side bounded at 2**53 (node.engine.constraint_numbers)."""
    return map_schema(schema, _exact_integer)


def _lit(text: str) -> str:
    """A Lark string literal of `text` (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def _is_local_ref(ref: Any) -> bool:
    return isinstance(ref, str) and (ref.startswith("#/$defs/") or ref.startswith("#/definitions/"))


def _refs(schema: Any) -> list[Any]:
    """Every `$ref` value in the schema."""
    if isinstance(schema, dict):
        return ([schema["$ref"]] if "$ref" in schema else []) + [r for v in schema.values() for r in _refs(v)]
    if isinstance(schema, list):
        return [r for v in schema for r in _refs(v)]
    return []


class LarkJson:
    """The JSON rules of one grammar: each root schema (a response format, a tool's parameters) written as
    Lark rules named `<prefix>N`, the number and string terminals shared."""

    def __init__(self, prefix: str = "json") -> None:
        self.prefix = prefix
        self.rules: list[str] = []
        self.terminals: dict[str, str] = {}
        self._n = 0

    def root(self, schema: Any, *, lenient: bool) -> str:
        """The rule of one JSON value following `schema` (None: any JSON object), its `$defs` its own."""
        schema = {"type": "object"} if schema is None else exact_integers(schema)
        return _Root(self, schema, lenient).value(schema)

    def text(self) -> str:
        """The rules and terminals, as Lark lines."""
        return "".join(f"{r}\n" for r in self.rules) + "".join(f"{n}: {t}\n" for n, t in self.terminals.items())

    def add_rule(self, body: str) -> str:
        """A rule of the caller's (a tool call around its arguments' rule), named as these are."""
        name = self.new_rule()
        self.rules.append(f"{name}: {body}")
        return name

    def new_rule(self) -> str:
        self._n += 1
        return f"{self.prefix}{self._n}"

    def terminal(self, name: str, body: str) -> str:
        self.terminals.setdefault(name, body)
        return name


class _Root:
    """One root schema being written: its `$defs` (a `$ref` becomes the rule of its definition) and options."""

    def __init__(self, out: LarkJson, root: Any, lenient: bool) -> None:
        self.out, self.root, self.lenient = out, root, lenient
        self.defs: dict[str, str] = {}
        self.any_rules: tuple[str, str] | None = None  # (any value, any object), written once
        # A `$ref` that is not to the root's own definitions (a JSON pointer elsewhere, a remote one) is
        # llguidance's to resolve: the whole root stays one leaf, as before this module.
        self.whole_leaf = any(not _is_local_ref(r) for r in _refs(root))

    def rule(self, body: str) -> str:
        return self.out.add_rule(body)

    def leaf(self, schema: Any) -> str:
        """llguidance's own rule for `schema`, with this root's options and the definitions its `$ref`s name."""
        if not isinstance(schema, dict):
            return self.rule(f"%json {json.dumps(schema)}")
        leaf = dict(schema)
        if schema is not self.root and _refs(schema) and isinstance(self.root, dict):
            for k in ("$defs", "definitions"):
                if k in self.root:
                    leaf[k] = self.root[k]
        leaf["x-guidance"] = {**JSON_STYLE, "lenient": self.lenient}
        return self.rule(f"%json {json.dumps(leaf, ensure_ascii=False)}")

    def value(self, s: Any) -> str:
        """A Lark expression for one value following `s`."""
        if self.whole_leaf:
            return self.leaf(s)
        if s is True or (isinstance(s, dict) and not set(s) - _NOTES):
            return self.any()
        if not isinstance(s, dict):
            return self.leaf(s)
        if "$ref" in s and not set(s) - _NOTES - {"$ref"}:
            return self.ref(s["$ref"])
        if "anyOf" in s and not set(s) - _NOTES - {"anyOf"} and isinstance(s["anyOf"], list) and s["anyOf"]:
            return self.rule(" | ".join(self.value(sub) for sub in s["anyOf"]))
        kind = s.get("type")
        if isinstance(kind, list) and kind and all(isinstance(k, str) for k in kind):
            return self.rule(" | ".join(self.value(_exact_integer({**s, "type": k})) for k in dict.fromkeys(kind)))
        if not isinstance(kind, str) or kind not in _KEYWORDS or set(s) - _NOTES - _KEYWORDS[kind]:
            return self.leaf(s)  # integer, enum, const, and every keyword not written here
        return self.typed(kind, s)

    def typed(self, kind: str, s: dict[str, Any]) -> str:
        if kind == "null":
            return '"null"'
        if kind == "boolean":
            return self.rule('"true" | "false"')
        if kind == "string":
            return self.out.terminal("JSON_STRING", _STRING)
        if kind == "number":
            return self.number(s)
        if kind == "array":
            return self.array(s)
        return self.object(s)

    def number(self, s: dict[str, Any]) -> str:
        ranges = range_regexes(s)
        if ranges is None:
            return self.leaf(s)
        plain = f"/{number_regex()}/"
        if not ranges:
            return self.out.terminal("JSON_NUMBER", plain)
        return self.out.terminal(f"JSON_NUMBER_{len(self.out.terminals)}", " & ".join([plain, *(f"/{r}/" for r in ranges)]))

    def array(self, s: dict[str, Any]) -> str:
        low, high = s.get("minItems", 0), s.get("maxItems")
        counts_ok = isinstance(low, int) and (high is None or isinstance(high, int) and high >= low)
        if not counts_ok or max(low, high or 0) > _MAX_REPEAT:
            return self.leaf(s)  # llguidance's, or its error for an empty range
        items = s.get("items", True)
        if not isinstance(items, dict | bool):
            return self.leaf(s)  # draft 4's list of items: llguidance's to read (or refuse)
        if high == 0:
            return '"[]"'
        item = self.value(items)
        more = "*" if high is None and low <= 1 else f"{{{max(low - 1, 0)},{'' if high is None else high - 1}}}"
        inner = f'{item} (", " {item}){more}'
        return self.rule(f'"[" {inner} "]"' if low > 0 else f'"[" ({inner})? "]"')

    def object(self, s: dict[str, Any]) -> str:
        props, required, extra = s.get("properties") or {}, s.get("required") or [], s.get("additionalProperties", True)
        if not isinstance(props, dict) or not isinstance(required, list) or set(required) - set(props):
            return self.leaf(s)
        if extra is not False:
            # An open object naming no properties is any object; one that names some (closed() closes those
            # unless the schema says otherwise) is llguidance's, which keeps the named keys from repeating.
            return self.any_object() if not props else self.leaf(s)
        items: list[tuple[str, bool]] = []
        for name, sub in props.items():
            if sub is False:  # a property that cannot appear
                if name in required:
                    return self.leaf(s)
                continue
            items.append((f"{_lit(json.dumps(name, ensure_ascii=False) + ': ')} {self.value(sub)}", name in required))
        return self.rule(self.members(items))

    def members(self, items: list[tuple[str, bool]]) -> str:
        """`{...}` of the properties in order, each optional one written or not, ", " between those written."""
        if not items:
            return '"{}"'
        # tail[i]: properties i.. once one is written before them; one rule each, so the size stays linear.
        tail = [""] * (len(items) + 1)
        for i in range(len(items) - 1, 0, -1):  # tail[0] never follows a written property
            member, req = items[i]
            piece = f'", " {member}' if req else f'(", " {member})?'
            tail[i] = self.rule(f"{piece} {tail[i + 1]}".rstrip())
        firsts = []
        for i, (member, req) in enumerate(items):  # the first property written: any optional one, up to a required one
            firsts.append("(" + " ".join(x for x in (member, tail[i + 1]) if x) + ")")
            if req:
                break
        empty = not any(req for _, req in items)
        return f'"{{" ({" | ".join(firsts)}){"?" if empty else ""} "}}"'

    def ref(self, ref: str) -> str:
        name = self.defs.get(ref)
        if name is not None:
            return name
        key, _, def_name = ref[2:].partition("/")
        table = self.root.get(key) if isinstance(self.root, dict) else None
        if not isinstance(table, dict) or def_name not in table:
            return self.leaf({"$ref": ref})  # llguidance resolves what is here, or names what is missing
        name = self.defs[ref] = self.out.new_rule()  # named before it is written: a definition may refer to itself
        self.out.rules.append(f"{name}: {self.value(table[def_name])}")
        return name

    def any(self) -> str:
        """Any JSON value, its numbers bounded too."""
        if self.any_rules is None:
            value, obj, arr = self.out.new_rule(), self.out.new_rule(), self.out.new_rule()
            self.any_rules = value, obj
            string, number = self.typed("string", {}), self.typed("number", {})
            member = f'{string} ": " {value}'
            self.out.rules += [f'{value}: {obj} | {arr} | {string} | {number} | "true" | "false" | "null"',
                               f'{obj}: "{{" ({member} (", " {member})*)? "}}"',
                               f'{arr}: "[" ({value} (", " {value})*)? "]"']
        return self.any_rules[0]

    def any_object(self) -> str:
        self.any()
        assert self.any_rules is not None
        return self.any_rules[1]
