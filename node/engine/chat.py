"""Chat templates: OpenAI messages and tools rendered to a prompt's text, in one place.

Every engine renders through here (HFTokenizer for the torch engine's checkpoints, the
llama.cpp engine's GGUF template, ByteTokenizer's byte-level template for tiny/sim), so a
request's `tools`, an assistant's `tool_calls` and `tool` results reach the prompt the same
way everywhere. Two paths, as llama-server's `--jinja` mode has:

- native: the template mentions `tools` (Qwen2.5, Llama 3.1, Gemma 4, ...). It gets
  `tools` and the messages as OpenAI sends them, except that an assistant tool call's
  `arguments` JSON text is passed as an object (what templates written for transformers
  expect: they `tojson` it themselves).
- generic: the template does not know tools (Qwen2's first template, the byte template).
  The tool definitions go into the system message in Hermes form, asking for
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the text Qwen2.5 was trained
  on, and what llama.cpp's generic handler asks for in spirit); an assistant's tool calls
  become that text after its content, and `tool` results become a user message of
  `<tool_response>...</tool_response>` blocks (or stay role `tool` where the template has
  one, as the byte template does). A template without a system role gets the tool text at
  the head of the first user message.

Prompt stability: a conversation's next turn must repeat this turn's prompt token for token,
or the engine recomputes everything after the first difference. Agents change per-turn
settings between turns (the OpenAI Agents SDK sends `tool_choice` "required", then "auto"), so
nothing that may change between two turns is rendered before the history: the tool
definitions (the same on every turn of a conversation) are shown whatever `tool_choice` says,
the whole list even for a named choice or "none". What a choice asks is enforced by the turn's
grammar (node.engine.constraint, built in node.api.structured): "required" and a named choice
force calls, and of that tool; `parallel_tool_calls` false allows one. A sentence saying so
would only repeat it, so none is written. "none" has no grammar (a reply may be any text), so
it alone gets a note, after the history: at the end of the last user or tool message, the one
place a later turn may render differently anyway (`turn_note`).
"""

from __future__ import annotations

import datetime
import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

ToolChoice = str | Mapping[str, Any] | None

_TOOLS_HEAD = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
_TOOLS_TAIL = (
    "</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)
# "none"'s note (turn_note): the tools stay in the prompt, and nothing else keeps a call out of the reply.
NO_CALL_NOTE = "Answer in text: do not call a function in this reply."
_PROBE = "kvmesh-system-probe"


def content_text(content: Any) -> str:
    """OpenAI content is a string or a list of parts; only text parts are kept."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")


def forced_tool(tool_choice: ToolChoice) -> str | None:
    """The function name a named tool_choice forces ({"type": "function", "function": {"name": ...}})."""
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            return str(fn["name"])
    return None


def callable_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: ToolChoice) -> list[Mapping[str, Any]]:
    """The tools a reply may call: none for "none", only the named one for a named choice.

    What the turn's grammar and its tool-call parser take; the prompt shows every tool (module docstring)."""
    if not tools or tool_choice == "none":
        return []
    name = forced_tool(tool_choice)
    if name is None:
        return list(tools)
    return [t for t in tools if (t.get("function") or {}).get("name") == name]


# The name node.api's callers know it by (structured.py, serving.py); it is the callable set, not the prompt's.
tools_for_prompt = callable_tools


def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The generic (Hermes) tool text a template without tools gets in its system message: the definitions only,
    the same for every tool_choice, so a change of choice between turns leaves the system prompt as it was."""
    lines = [_TOOLS_HEAD]
    lines += [json.dumps(t, ensure_ascii=False) for t in tools]
    return "\n".join(lines) + "\n" + _TOOLS_TAIL


def turn_note(tools: Sequence[Mapping[str, Any]] | None, tool_choice: ToolChoice) -> str | None:
    """This turn's instruction, rendered after the history (None: nothing to say).

    Only "none" has one: the tools stay in the prompt and no grammar keeps a call out of the reply.
    "required", a named choice and parallel_tool_calls false are the grammar's to enforce (module docstring)."""
    if tools and tool_choice == "none":
        return NO_CALL_NOTE
    return None


def with_turn_note(messages: list[dict[str, Any]], note: str | None) -> list[dict[str, Any]]:
    """`messages` with `note` at the end of the last one where that is a user or tool message.

    The last message is the one place a later turn renders differently anyway (it gains the reply after it),
    so every earlier token stays as the previous turn cached it. An assistant message last (a prefill to
    continue) or a system one gets nothing: text there would be the model's own or the instructions'."""
    if note is None or not messages or messages[-1].get("role") not in ("user", "tool"):
        return messages
    last = dict(messages[-1])
    text = last.get("content") or ""
    last["content"] = f"{text}\n\n{note}" if text else note
    return [*messages[:-1], last]


def _arguments(raw: Any) -> Any:
    """A tool call's arguments as an object where its JSON text is one, else as sent."""
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except ValueError:
            return raw
        return parsed if isinstance(parsed, dict) else raw
    return raw


def tool_call_text(call: Mapping[str, Any]) -> str:
    """An assistant's tool call written the way the generic prompt asks the model to write one."""
    fn = call.get("function") or {}
    body = {"name": fn.get("name", ""), "arguments": _arguments(fn.get("arguments", "{}"))}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def _with_calls(text: str, calls: Iterable[Mapping[str, Any]]) -> str:
    parts = [text] if text else []
    parts += [tool_call_text(c) for c in calls]
    return "\n".join(parts)


def plain_messages(messages: Iterable[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = (), *,
                   tool_choice: ToolChoice = "auto", tool_role: bool = False,
                   system_role: bool = True) -> list[dict[str, Any]]:
    """Messages with tool calls, tool results and tool definitions folded into text (the generic path).

    Every message comes back as {"role", "content": str}; `tool_role` keeps role "tool" for
    results (a template with such a role), else consecutive results form one user message.
    `tools` are the request's own, shown whatever `tool_choice` says; the choice adds only its
    turn note, at the end (module docstring)."""
    out: list[dict[str, Any]] = []
    merging = False  # the last message is a user message made of tool results
    for m in messages:
        text = content_text(m.get("content"))
        role = m.get("role", "user")
        if role == "tool" and not tool_role:
            block = f"<tool_response>\n{text}\n</tool_response>"
            if merging:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            merging = True
            continue
        merging = False
        if role == "assistant" and m.get("tool_calls"):
            text = _with_calls(text, m["tool_calls"])
        out.append({"role": role, "content": text})
    out = with_turn_note(out, turn_note(tools, tool_choice))
    if tools:
        prompt = tools_prompt(tools)
        if out and out[0]["role"] in ("system", "developer") and system_role:
            out[0]["content"] = (out[0]["content"] + "\n\n" if out[0]["content"] else "") + prompt
        elif system_role:
            out.insert(0, {"role": "system", "content": prompt})
        else:
            first = next((m for m in out if m["role"] == "user"), None)
            if first is None:
                out.insert(0, {"role": "user", "content": prompt})
            else:
                first["content"] = prompt + "\n\n" + first["content"]
    return out


def native_messages(messages: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that knows tools: content as text, tool-call arguments as objects."""
    out = []
    for m in messages:
        msg = {k: v for k, v in m.items() if v is not None}
        msg["content"] = content_text(m.get("content"))
        if m.get("tool_calls"):
            msg["tool_calls"] = [
                {**c, "function": {**(c.get("function") or {}), "arguments": _arguments((c.get("function") or {}).get("arguments", "{}"))}}
                for c in m["tool_calls"]
            ]
        out.append(msg)
    return out


# ---- jinja ---------------------------------------------------------------------------

def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    # transformers' tojson: no ASCII escaping, unlike jinja2's built-in.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


@functools.cache
def _environment() -> Any:
    """The settings transformers (and llama-server's --jinja) render chat templates with."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """One compiled chat template, with what it supports (tools, a system role) found once."""

    def __init__(self, source: str) -> None:
        import jinja2.meta

        env = _environment()
        self.source = source
        self._template = env.from_string(source)  # raises jinja2.TemplateSyntaxError
        # Native tools: the template reads a `tools` variable (as llama-server decides).
        self.uses_tools = "tools" in jinja2.meta.find_undeclared_variables(env.parse(source))
        self.system_role = self._has_system_role()

    def _has_system_role(self) -> bool:
        probe = [{"role": "system", "content": _PROBE}, {"role": "user", "content": "u"}]
        try:
            return _PROBE in self._template.render(messages=probe, add_generation_prompt=True, bos_token="", eos_token="")
        except Exception:  # a template that refuses a system message: it has none
            return False

    def render(self, messages: Iterable[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               tool_choice: ToolChoice = "auto", parallel_tool_calls: bool = True, bos_token: str = "",
               eos_token: str = "", add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt's text. Raises jinja2.TemplateError where the template refuses the messages.

        The request's tools are shown whatever `tool_choice` says, and only its turn note follows from the
        choice (module docstring); `parallel_tool_calls` is the grammar's alone (kept in the signature for
        the callers that pass a request's fields through)."""
        if self.uses_tools:
            msgs = with_turn_note(native_messages(messages), turn_note(tools, tool_choice))
            return str(self._template.render(messages=msgs, tools=list(tools) if tools else None,
                                             add_generation_prompt=add_generation_prompt,
                                             bos_token=bos_token, eos_token=eos_token, **extra))
        msgs = plain_messages(messages, tools, tool_choice=tool_choice, system_role=self.system_role)
        return str(self._template.render(messages=msgs, tools=None, add_generation_prompt=add_generation_prompt,
                                         bos_token=bos_token, eos_token=eos_token, **extra))


@functools.lru_cache(maxsize=16)
def chat_template(source: str) -> ChatTemplate:
    """A compiled template, cached by its text (a server renders with one or two)."""
    return ChatTemplate(source)


def render_chat(template: str, messages: Iterable[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
                tool_choice: ToolChoice = "auto", parallel_tool_calls: bool = True, bos_token: str = "",
                eos_token: str = "", add_generation_prompt: bool = True, **extra: Any) -> str:
    """Render OpenAI `messages` (and `tools`) through a chat template's source text.

    `extra` variables (pad_token, enable_thinking, ...) pass to the template as they are.
    Raises jinja2.TemplateError where the template refuses the messages."""
    return chat_template(template).render(messages, tools=tools, tool_choice=tool_choice,
                                          parallel_tool_calls=parallel_tool_calls, bos_token=bos_token,
                                          eos_token=eos_token, add_generation_prompt=add_generation_prompt, **extra)
