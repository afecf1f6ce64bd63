"""The tool-call parser (node/api/toolcalls.py) on text: both forms, streamed at every split point."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import pytest

from kvmesh.node.api.toolcalls import ToolCallParser
from kvmesh.node.api.toolevents import (
    ContentDelta,
    Reply,
    ToolCall,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    ToolEvent,
    assemble,
    coalesce,
)

NAMES = ("get_weather", "read_file")


def ids() -> Callable[[], str]:
    c = itertools.count()
    return lambda: f"call_{next(c)}"


def parse(pieces: list[str], *, names: tuple[str, ...] | None = NAMES, parallel: bool = True) -> list[ToolEvent]:
    p = ToolCallParser(names, parallel=parallel, new_id=ids())
    out: list[ToolEvent] = []
    for piece in pieces:
        out += p.feed(piece)
    out += p.finish()
    return out


HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "units": ["c", "f"]}}\n'
          '</tool_call>\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a<b>.txt", "n": -1.5e2}}\n</tool_call>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Zürich", "q": "say \\"hi\\"\\u00e9"}}'
LLAMA_TWO = '{"name": "get_weather", "parameters": {"city": "A"}}; {"name": "read_file", "parameters": {}}'
CASES: dict[str, tuple[str, Reply]] = {
    "hermes-parallel": (HERMES, Reply("Let me look.\n", [
        ToolCall("call_0", "get_weather", '{"city": "Paris", "units": ["c", "f"]}'),
        ToolCall("call_1", "read_file", '{"path": "a<b>.txt", "n": -1.5e2}')])),
    "llama-python-tag": (LLAMA, Reply("", [
        ToolCall("call_0", "get_weather", '{"city": "Zürich", "q": "say \\"hi\\"\\u00e9"}')])),
    "llama-two": (LLAMA_TWO, Reply("", [ToolCall("call_0", "get_weather", '{"city": "A"}'),
                                        ToolCall("call_1", "read_file", "{}")])),
    "plain-with-angles": ("if a < b and c <tool or <tool_call  x> then <b>ok</b> <", Reply(
        "if a < b and c <tool or <tool_call  x> then <b>ok</b> <", [])),
    "json-reply-not-a-call": ('{"name": "Bob", "age": 3}', Reply('{"name": "Bob", "age": 3}', [])),
    "json-other-keys": ('{"answer": {"name": "get_weather"}}', Reply('{"answer": {"name": "get_weather"}}', [])),
    "malformed-before-start": ('<tool_call>{"name": get_weather}</tool_call> done',
                               Reply('<tool_call>{"name": get_weather}</tool_call> done', [])),
    "malformed-mid-arguments": ('<tool_call>{"name": "read_file", "arguments": {"path": tru}}</tool_call>!',
                                Reply('<tool_call>{"name": "read_file", "arguments": {"path": tru}}</tool_call>!', [])),
    "truncated": ('<tool_call>{"name": "read_file", "arguments": {"path": "x',
                  Reply('<tool_call>{"name": "read_file", "arguments": {"path": "x', [])),
    "undeclared-name": ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                        Reply('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', [])),
    "string-arguments": ('<tool_call>{"arguments": "{\\"path\\": \\"p\\"}", "name": "read_file"}</tool_call>',
                         Reply("", [ToolCall("call_0", "read_file", '{"path": "p"}')])),
    "no-close-tag-then-text": ('<tool_call>{"name": "read_file", "arguments": {}} and more',
                               Reply(" and more", [ToolCall("call_0", "read_file", "{}")])),
    "whitespace-only": ("  \n", Reply("  \n", [])),
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_split_point_gives_the_same_answer(name: str) -> None:
    """Fed whole, one character at a time, or split in two at every point, a text parses to the same events and reply."""
    text, want = CASES[name]
    whole = coalesce(parse([text]))
    assert assemble(whole) == want
    assert coalesce(parse(list(text))) == whole
    for i in range(1, len(text)):
        assert coalesce(parse([text[:i], text[i:]])) == whole, i


def test_arguments_stream_before_the_call_is_whole() -> None:
    """A call's start comes as soon as its name and the opening of its arguments are read; the arguments follow in fragments."""
    text = '<tool_call>{"name": "read_file", "arguments": {"path": "src/main.py", "lines": [1, 20]}}</tool_call>'
    p = ToolCallParser(NAMES, new_id=ids())
    seen: list[tuple[int, list[ToolEvent]]] = [(i, p.feed(ch)) for i, ch in enumerate(text)]
    start_at = next(i for i, evs in seen if any(isinstance(e, ToolCallStart) for e in evs))
    assert text[: start_at + 1].endswith('"arguments": {')
    frags = [e.text for _, evs in seen for e in evs if isinstance(e, ToolCallArgs)]
    assert len(frags) > 10 and "".join(frags) == '{"path": "src/main.py", "lines": [1, 20]}'
    end_at = next(i for i, evs in seen if any(isinstance(e, ToolCallEnd) for e in evs))
    assert end_at == text.index("}}</tool_call>") + 1  # the object closes the call; the tag is not waited for
    assert p.finish() == []


def test_text_that_looks_like_a_tag_is_held_only_until_it_is_decided() -> None:
    """'<' and '<tool_c' are held back; the next character that rules the tag out releases them."""
    p = ToolCallParser(NAMES, new_id=ids())
    assert p.feed("Hello ") == [ContentDelta("Hello ")]
    assert p.feed("<tool_c") == []
    assert p.feed("ar") == [ContentDelta("<tool_car")]
    assert p.feed(" <") == [ContentDelta(" ")]
    assert p.feed("b") == [ContentDelta("<b")]
    assert p.finish() == []


def test_leading_brace_is_held_only_as_long_as_it_may_be_a_call() -> None:
    """A reply opening with '{' is released as soon as a key shows it is not a Llama 3 call."""
    p = ToolCallParser(NAMES, new_id=ids())
    assert p.feed('{"answe') == []
    assert p.feed('r":') == [ContentDelta('{"answer":')]
    assert p.feed(' 1}') == [ContentDelta(" 1}")]


def test_broken_call_streams_then_ends_broken() -> None:
    """A call whose arguments break after it started ends with its raw text; what follows is content."""
    text = '<tool_call>{"name": "read_file", "arguments": {"path": @}}</tool_call>'
    evs = coalesce(parse([text]))
    assert evs == [ToolCallStart(0, "call_0", "read_file"), ToolCallArgs(0, '{"path": '),
                   ToolCallEnd(0, broken='<tool_call>{"name": "read_file", "arguments": {"path": '),
                   ContentDelta("@}}</tool_call>")]


def test_parallel_false_keeps_the_first_call_only() -> None:
    """parallel=False: the reply ends with its first call; later calls and text are dropped."""
    reply = assemble(parse([HERMES + " trailing"], parallel=False))
    assert [c.name for c in reply.calls] == ["get_weather"] and reply.content == "Let me look.\n"


def test_any_name_without_a_declared_list() -> None:
    """With no declared names (None) any function name is a call."""
    reply = assemble(parse(['<tool_call>{"name": "anything", "arguments": {"x": 1}}</tool_call>'], names=None))
    assert reply.calls == [ToolCall("call_0", "anything", '{"x": 1}')]


def test_arguments_are_valid_json_for_every_complete_call() -> None:
    """Every complete call's arguments parse as a JSON object."""
    for text, _ in CASES.values():
        for call in assemble(parse([text])).calls:
            assert isinstance(json.loads(call.arguments), dict), (text, call)
