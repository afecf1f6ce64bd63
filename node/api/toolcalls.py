"""Tool calls in a model's text, found as the text streams (sans-I/O: text in, events out).

`ToolCallParser.feed(text)` takes each text delta the engine emits and returns events:
`ContentDelta` (text for the client), `ToolCallStart` (index, id, name), `ToolCallArgs`
(a fragment of the call's arguments JSON) and `ToolCallEnd`; `finish()` flushes what is
held. The same events make a streamed answer (OpenAI deltas) and, assembled, a whole one.
The events and their assembly live in `toolevents`, the JSON syntax check in `tooljson`.

Two forms are recognised:
- Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, anywhere in
  the reply, any number of them (the closing tag may be missing);
- Llama 3: the reply itself is `{"name": ..., "parameters"|"arguments": {...}}`, optionally
  after `<|python_tag|>`; several such objects may follow each other (`;` between is allowed).

Rules:
- Text that could still become a tag (a trailing "<tool_c") is held only until the next
  character decides; whitespace before a call or between calls is dropped.
- A call starts (ToolCallStart) once its name is read and known (one of `tool_names`, when
  given) and its arguments object has begun; from then on the arguments stream as the model
  writes them, each fragment checked by an incremental JSON syntax check.
- A call whose JSON breaks before it started is returned as content, byte for byte. One that
  breaks after (the model wrote bad JSON mid-arguments, or stopped there) ends with
  `ToolCallEnd.broken` holding its raw text: a whole answer turns it back into content; a
  stream cannot take back what it sent, so its arguments stop where the model stopped, as
  OpenAI's do at finish_reason "length". The text after the break is content.
- `arguments` given as a JSON string (some models do) is decoded and sent whole.
- `parallel=False`: the first call ends the reply; later text is dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from kvmesh.node.api.toolevents import (
    ContentDelta,
    ToolCallArgs,
    ToolCallEnd,
    ToolCallStart,
    ToolEvent,
    merge,
    new_call_id,
)
from kvmesh.node.api.tooljson import COLON, OBJ_NEXT, STR, VALUE, WS, JsonScanner, JsonSyntaxError
from kvmesh.node.engine.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

PYTHON_TAG = "<|python_tag|>"
ARGS_KEYS = ("arguments", "parameters")
# Keys a bare (Llama 3) call object may have; any other makes it an ordinary JSON reply.
_LLAMA_KEYS = frozenset({"name", "type", "id", *ARGS_KEYS})


# ---- the parser --------------------------------------------------------------------------

@dataclass
class _Call:
    index: int
    hermes: bool
    raw: str  # the call's text so far: held whitespace, tag, JSON
    scanner: JsonScanner = field(default_factory=JsonScanner)
    name: str | None = None
    args: list[str] = field(default_factory=list)  # arguments text not yet emitted
    args_state: int = 0  # 0 none yet, 1 reading an object, 2 reading a string, 3 read
    vkey: str | None = None  # key of the top-level value being read
    vstart: int = -1  # where in raw that value began
    started: bool = False


_TEXT, _CALL, _CLOSE = range(3)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolCallParser:
    """Feed text deltas, get ToolEvents; `finish()` at the end of the reply.

    `tool_names`: the declared functions (a call naming another is text); None accepts any
    name. `new_id` makes call ids (tests pass a counter)."""

    def __init__(self, tool_names: Collection[str] | None = None, *, parallel: bool = True,
                 new_id: Callable[[], str] = new_call_id) -> None:
        self._names = None if tool_names is None else frozenset(tool_names)
        self._parallel = parallel
        self._new_id = new_id
        self._buf = ""
        self._mode = _TEXT
        self._blank = True  # nothing but whitespace since the start or the last call
        self._json_ok = True  # a bare JSON object here may be a (Llama 3) call
        self._call: _Call | None = None
        self._index = 0
        self.calls = 0  # complete calls so far
        self._finished = False

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        out: list[ToolEvent] = []
        self._run(out, final=False)
        return out

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        if not self._finished:
            self._finished = True
            self._run(out, final=True)
        return out

    def _run(self, out: list[ToolEvent], final: bool) -> None:
        while True:
            if self._mode == _CALL:
                more = self._in_call(out, final)
            elif self._mode == _CLOSE:
                more = self._close(final)
            else:
                more = self._text(out, final)
            if not more:
                return

    # ---- text --------------------------------------------------------------------------

    def _text(self, out: list[ToolEvent], final: bool) -> bool:
        buf = self._buf
        if not buf:
            return False
        if not self._parallel and self.calls:
            self._buf = ""  # one call was asked for: the rest of the reply is not the client's
            return False
        if self._blank:
            return self._blank_text(out, final)
        j = buf.find(TOOL_CALL_OPEN)
        if j >= 0:
            merge(out, ContentDelta(buf[:j]))
            self._buf, self._blank = buf[j:], True
            return True
        keep = 0 if final else _partial_suffix(buf, TOOL_CALL_OPEN)
        merge(out, ContentDelta(buf[: len(buf) - keep]))
        self._buf = buf[len(buf) - keep:]
        return False

    def _blank_text(self, out: list[ToolEvent], final: bool) -> bool:
        """Only whitespace since the start or the last call: a call may open here."""
        buf = self._buf
        body = buf.lstrip(WS)
        lead = buf[: len(buf) - len(body)]
        if not body:
            if final:
                self._buf = ""
                if not self.calls:
                    merge(out, ContentDelta(lead))
            return False
        if self._json_ok and self.calls and body[0] == ";":
            self._buf = body[1:]  # Llama 3 separates calls with ';'
            return True
        if self._json_ok and body[0] == "{":
            return self._open(lead, len(lead), hermes=False)
        if self._json_ok and body.startswith(PYTHON_TAG):
            return self._open(lead + PYTHON_TAG, len(lead) + len(PYTHON_TAG), hermes=False)
        if body.startswith(TOOL_CALL_OPEN):
            return self._open(lead + TOOL_CALL_OPEN, len(lead) + len(TOOL_CALL_OPEN), hermes=True)
        if not final and (TOOL_CALL_OPEN.startswith(body) or (self._json_ok and PYTHON_TAG.startswith(body))):
            return False  # could still become a tag
        self._blank = self._json_ok = False
        return True

    def _open(self, raw: str, consumed: int, *, hermes: bool) -> bool:
        self._call = _Call(self._index, hermes, raw)
        self._buf = self._buf[consumed:]
        self._mode = _CALL
        return True

    def _close(self, final: bool) -> bool:
        """After a Hermes call's object: its closing tag (whitespace before it is dropped)."""
        body = self._buf.lstrip(WS)
        if body.startswith(TOOL_CALL_CLOSE):
            self._buf = body[len(TOOL_CALL_CLOSE):]
        elif not final and TOOL_CALL_CLOSE.startswith(body):
            return False
        self._mode, self._blank, self._json_ok = _TEXT, True, False
        return True

    # ---- a call ------------------------------------------------------------------------

    def _in_call(self, out: list[ToolEvent], final: bool) -> bool:
        call = self._call
        assert call is not None
        for pos, ch in enumerate(self._buf):
            try:
                ok = self._step(call, ch)
            except JsonSyntaxError:
                self._buf = self._buf[pos:]  # the character is read again as text
                self._abandon(out)
                return True
            if ok and not call.started and call.name is not None and call.args_state in (1, 3):
                call.started = True
                merge(out, ToolCallStart(call.index, self._new_id(), call.name))
            if call.started and call.args:
                merge(out, ToolCallArgs(call.index, "".join(call.args)))
                call.args.clear()
            if not ok or call.scanner.done:
                self._buf = self._buf[pos + 1:]
                self._complete(out) if ok else self._abandon(out)
                return True
        self._buf = ""
        if final:
            self._abandon(out)  # the reply stopped inside the call
            return True
        return False

    def _step(self, call: _Call, ch: str) -> bool:
        """One character of a call's JSON; False when it cannot be a call (read as text)."""
        sc = call.scanner
        prev_state, prev_depth = sc.state, sc.depth
        sc.push(ch)
        call.raw += ch
        if prev_depth == 1 and prev_state == VALUE and sc.state != VALUE:  # a top-level value begins
            call.vkey, call.vstart = sc.last_key, len(call.raw) - 1
            if call.vkey == "name" and ch != '"':
                return False
            if call.vkey in ARGS_KEYS:
                if call.args_state or ch not in '{"':
                    return False
                call.args_state = 1 if ch == "{" else 2
        elif prev_depth == 1 and prev_state == STR and sc.state == COLON:  # a top-level key was read
            if not call.hermes and sc.last_key not in _LLAMA_KEYS:
                return False  # an ordinary JSON reply, not a call
        if call.args_state == 1 and call.vkey in ARGS_KEYS and call.vstart >= 0:
            call.args.append(ch)
        if call.vstart >= 0 and sc.depth == 1 and sc.state == OBJ_NEXT:  # that value ended
            return self._value_read(call, call.raw[call.vstart:])
        if sc.done:
            return self._object_read(call)
        return True

    def _value_read(self, call: _Call, text: str) -> bool:
        key, call.vstart = call.vkey, -1
        if key == "name":
            name = json.loads(text)
            if call.name is not None or (self._names is not None and name not in self._names):
                return False
            call.name = name
        elif key in ARGS_KEYS:
            if call.args_state == 2:
                call.args = [json.loads(text)]
            call.args_state = 3
        return True

    def _object_read(self, call: _Call) -> bool:
        if call.name is None or (call.args_state == 0 and not call.hermes):
            return False
        if call.args_state == 0:
            call.args, call.args_state = ["{}"], 3  # a Hermes call without arguments
        return True

    def _complete(self, out: list[ToolEvent]) -> None:
        call = self._call
        assert call is not None and call.started
        merge(out, ToolCallEnd(call.index))
        self._index += 1
        self.calls += 1
        self._call = None
        self._mode = _CLOSE if call.hermes else _TEXT
        self._blank, self._json_ok = True, not call.hermes

    def _abandon(self, out: list[ToolEvent]) -> None:
        """The text is not a (whole) call: before its start it is content, after it the call ends broken."""
        call = self._call
        assert call is not None
        if call.started:
            merge(out, ToolCallEnd(call.index, broken=call.raw))
            self._index += 1
        else:
            merge(out, ContentDelta(call.raw))
        self._call = None
        self._mode, self._blank, self._json_ok = _TEXT, False, False
