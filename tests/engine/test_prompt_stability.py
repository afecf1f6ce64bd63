"""A conversation's next prompt repeats this one token for token when only per-turn settings change (issue 48).

The OpenAI Agents SDK sends tool_choice "required" on one turn and "auto" on the next. Each template kind
node.engine.chat supports renders both turns here through a real tokenizer: the byte template (tiny/sim),
SmolLM2's and Qwen2's ChatML (generic path, system role), Phi-3's (no system role), Gemma 3 270M's (no
template of its own: kvmesh's fallback) and Gemma 4's (native tools). The second prompt's ids start with
the whole of the first conversation's history, as its own rendering tokenizes it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest

from kvmesh.node.engine.chat import NO_CALL_NOTE, ToolChoice
from kvmesh.node.engine.modelfiles import resolve
from kvmesh.node.engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from kvmesh.node.engine.vocab import vocab_path

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TURN1: list[dict[str, Any]] = [{"role": "system", "content": "You are a weather agent."},
                               {"role": "user", "content": "What is the weather in Paris?"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TURN2 = TURN1 + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 18C"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
KINDS = ["byte", "smollm2", "qwen2", "phi-3", "gemma3-270m", "gemma-4"]


def _gguf(path: Path) -> HFTokenizer:
    """A GGUF's tokenizer and chat template through llama.cpp, its vocabulary only (no weights loaded)."""
    lib = pytest.importorskip("llama_cpp")
    from kvmesh.node.engine.llamatok import LlamaTokenizer

    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.vocab_only = True
    handle = lib.llama_model_load_from_file(str(path).encode(), params)
    assert handle, path
    template = lib.llama_model_chat_template(handle, None)
    return LlamaTokenizer(lib, lib.llama_model_get_vocab(handle), chat_template=template.decode() if template else None)


@functools.cache
def tokenizer(kind: str) -> Tokenizer:
    if kind == "byte":
        return ByteTokenizer()
    return _gguf(resolve(kind) if kind in ("smollm2", "gemma3-270m") else vocab_path(kind))


def history(tok: Tokenizer, messages: list[dict[str, Any]], choice: ToolChoice = "auto") -> list[int]:
    """The ids of `messages` rendered as a finished history (no generation prompt)."""
    if isinstance(tok, HFTokenizer):
        return tok.encode(tok.render(messages, tools=[WEATHER], tool_choice=choice, add_generation_prompt=False))
    return tok.apply_chat_template(messages, tools=[WEATHER], tool_choice=choice)[:-1]  # the byte template's <assistant>


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("first", "second"), [("required", "auto"), ("auto", "required"), (NAMED, "auto"),
                                               ("required", NAMED)], ids=["required-auto", "auto-required",
                                                                          "named-auto", "required-named"])
def test_a_changed_tool_choice_keeps_the_whole_history(kind: str, first: ToolChoice, second: ToolChoice) -> None:
    """Turn 2 (the call and its result added, another tool_choice) starts with all of turn 1's history and prompt."""
    tok = tokenizer(kind)
    p1 = tok.apply_chat_template(TURN1, tools=[WEATHER], tool_choice=first)
    p2 = tok.apply_chat_template(TURN2, tools=[WEATHER], tool_choice=second)
    shared = history(tok, TURN1, first)
    assert p1[: len(shared)] == shared  # the history as turn 1's prompt holds it
    reused = common_prefix(p1, p2)
    assert reused >= len(shared), (kind, reused, len(shared), len(p1))
    if kind != "gemma-4":  # a template whose generation prompt opens the assistant's message: all of turn 1 is reused
        assert reused == len(p1), (kind, reused, len(p1))


@pytest.mark.parametrize("kind", KINDS)
def test_none_notes_the_choice_after_the_history(kind: str) -> None:
    """tool_choice "none" keeps the tools; its note ends the last message, so the next turn differs only from there."""
    tok = tokenizer(kind)
    p1 = tok.apply_chat_template(TURN1, tools=[WEATHER], tool_choice="none")
    p2 = tok.apply_chat_template(TURN2, tools=[WEATHER])
    assert NO_CALL_NOTE in tok.decode(p1) and NO_CALL_NOTE not in tok.decode(p2)
    # Everything before the last message's text, and that text, is shared; its end marker follows the note in turn 1.
    before_last = history(tok, TURN1[:-1] + [{"role": "user", "content": ""}])
    shared = common_prefix(before_last, history(tok, TURN1))  # up to where the last message's text begins
    last_text = len(tok.encode(TURN1[-1]["content"]))
    assert common_prefix(p1, p2) >= shared + last_text - 1, kind  # -1: the text's last token may merge with the note
