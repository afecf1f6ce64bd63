"""Tool calls in a model's text, found as the text streams (sans-I/O: text in, events out).

`ToolCallParser.feed(text)` takes each text delta the engine emits and returns events:
`ContentDelta` (text for the client), `ToolCallStart` (index, id, name), `ToolCallArgs`
(a fragment of the call's arguments JSON) and `ToolCallEnd`; `finish()` flushes what is
held. The same events make a streamed answer (OpenAI deltas) and, assembled, a whole one.

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
import re
import secrets
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field

from kvmesh.node.engine.chat import TOOL_CALL_CLOSE, TOOL_CALL_OPEN

PYTHON_TAG = "<|python_tag|>"
ARGS_KEYS = ("arguments", "parameters")
# Keys a bare (Llama 3) call object may have; any other makes it an ordinary JSON reply.
_LLAMA_KEYS = frozenset({"name", "type", "id", *ARGS_KEYS})
_WS = " \t\r\n"


def new_call_id() -> str:
    """An OpenAI-style tool call id."""
    return "call_" + secrets.token_hex(12)


# ---- events ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgs:
    index: int
    text: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    broken: str | None = None  # the call's raw text when its JSON never completed


ToolEvent = ContentDelta | ToolCallStart | ToolCallArgs | ToolCallEnd


def _merge(out: list[ToolEvent], ev: ToolEvent) -> None:
    """Append, joining a content or arguments fragment to the one before it."""
    last = out[-1] if out else None
    if isinstance(ev, ContentDelta):
        if not ev.text:
            return
        if isinstance(last, ContentDelta):
            out[-1] = ContentDelta(last.text + ev.text)
            return
    elif isinstance(ev, ToolCallArgs):
        if not ev.text:
            return
        if isinstance(last, ToolCallArgs) and last.index == ev.index:
            out[-1] = ToolCallArgs(ev.index, last.text + ev.text)
            return
    out.append(ev)


def coalesce(events: Iterable[ToolEvent]) -> list[ToolEvent]:
    """The same events with adjacent content / same-call argument fragments joined."""
    out: list[ToolEvent] = []
    for ev in events:
        _merge(out, ev)
    return out


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, object]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Reply:
    """A whole answer: its content and its complete tool calls (broken calls are content)."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def assemble(events: Iterable[ToolEvent]) -> Reply:
    reply = Reply()
    open_calls: dict[int, ToolCall] = {}
    for ev in events:
        if isinstance(ev, ContentDelta):
            reply.content += ev.text
        elif isinstance(ev, ToolCallStart):
            open_calls[ev.index] = ToolCall(ev.id, ev.name, "")
        elif isinstance(ev, ToolCallArgs):
            open_calls[ev.index].arguments += ev.text
        else:
            call = open_calls.pop(ev.index)
            if ev.broken is None:
                reply.calls.append(call)
            else:
                reply.content += ev.broken
    return reply


# ---- an incremental JSON syntax check ----------------------------------------------------

class JsonSyntaxError(ValueError):
    """The character does not continue valid JSON."""


(_VALUE, _OBJ_FIRST, _OBJ_KEY, _COLON, _OBJ_NEXT, _ARR_FIRST, _ARR_NEXT,
 _STR, _ESC, _HEX, _NUM, _LIT, _DONE) = range(13)
_NUM_CHARS = frozenset("0123456789+-.eE")
_NUM_RE = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?\Z")
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_HEXDIGITS = frozenset("0123456789abcdefABCDEF")


class JsonScanner:
    """Reads one JSON object a character at a time; `push` raises JsonSyntaxError at the first
    character that cannot continue it, `done` once it is whole. `depth` is the number of open
    containers and `last_key` the object key read last (what the call parser needs)."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.state = _VALUE
        self.last_key: str | None = None
        self._is_key = False
        self._text: list[str] = []  # the key or number being read
        self._lit = ""
        self._hex = 0

    @property
    def depth(self) -> int:
        return len(self.stack)

    @property
    def done(self) -> bool:
        return self.state == _DONE

    def push(self, ch: str) -> None:
        st = self.state
        if st == _NUM:
            if ch in _NUM_CHARS:
                self._text.append(ch)
                return
            if not _NUM_RE.match("".join(self._text)):
                raise JsonSyntaxError("not a number")
            self._after_value()
            st = self.state
        if st in (_STR, _ESC, _HEX):
            self._string(ch)
        elif st == _LIT:
            if not self._lit or ch != self._lit[0]:
                raise JsonSyntaxError("not a literal")
            self._lit = self._lit[1:]
            if not self._lit:
                self._after_value()
        elif ch in _WS and st != _DONE:
            return
        else:
            self._structure(st, ch)

    def _structure(self, st: int, ch: str) -> None:
        if st in (_VALUE, _ARR_FIRST):
            if st == _ARR_FIRST and ch == "]":
                self._close()
            else:
                self._begin_value(ch)
        elif st in (_OBJ_FIRST, _OBJ_KEY) and ch == '"':
            self.state, self._is_key, self._text = _STR, True, []
        elif st == _OBJ_FIRST and ch == "}":
            self._close()
        elif st == _COLON and ch == ":":
            self.state = _VALUE
        elif st == _OBJ_NEXT and ch == ",":
            self.state = _OBJ_KEY
        elif st == _ARR_NEXT and ch == ",":
            self.state = _VALUE
        elif (st == _OBJ_NEXT and ch == "}") or (st == _ARR_NEXT and ch == "]"):
            self._close()
        else:
            raise JsonSyntaxError(f"unexpected {ch!r}")

    def _begin_value(self, ch: str) -> None:
        if not self.stack and ch != "{":
            raise JsonSyntaxError("not an object")
        if ch == "{":
            self.stack.append("o")
            self.state = _OBJ_FIRST
        elif ch == "[":
            self.stack.append("a")
            self.state = _ARR_FIRST
        elif ch == '"':
            self.state, self._is_key = _STR, False
        elif ch == "-" or ch.isdigit() and ch.isascii():
            self.state, self._text = _NUM, [ch]
        elif ch in _LITERALS:
            self.state, self._lit = _LIT, _LITERALS[ch]
        else:
            raise JsonSyntaxError(f"unexpected {ch!r}")

    def _string(self, ch: str) -> None:
        if self._is_key:
            self._text.append(ch)
        if self.state == _ESC:
            if ch == "u":
                self.state, self._hex = _HEX, 4
            elif ch in '"\\/bfnrt':
                self.state = _STR
            else:
                raise JsonSyntaxError("bad escape")
        elif self.state == _HEX:
            if ch not in _HEXDIGITS:
                raise JsonSyntaxError("bad \\u escape")
            self._hex -= 1
            if not self._hex:
                self.state = _STR
        elif ch == "\\":
            self.state = _ESC
        elif ch == '"':
            if self._is_key:
                self.last_key = json.loads('"' + "".join(self._text))
                self.state = _COLON
            else:
                self._after_value()
        elif ch < " ":
            raise JsonSyntaxError("control character in a string")

    def _close(self) -> None:
        self.stack.pop()
        self._after_value()

    def _after_value(self) -> None:
        if not self.stack:
            self.state = _DONE
        else:
            self.state = _OBJ_NEXT if self.stack[-1] == "o" else _ARR_NEXT


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
            _merge(out, ContentDelta(buf[:j]))
            self._buf, self._blank = buf[j:], True
            return True
        keep = 0 if final else _partial_suffix(buf, TOOL_CALL_OPEN)
        _merge(out, ContentDelta(buf[: len(buf) - keep]))
        self._buf = buf[len(buf) - keep:]
        return False

    def _blank_text(self, out: list[ToolEvent], final: bool) -> bool:
        """Only whitespace since the start or the last call: a call may open here."""
        buf = self._buf
        body = buf.lstrip(_WS)
        lead = buf[: len(buf) - len(body)]
        if not body:
            if final:
                self._buf = ""
                if not self.calls:
                    _merge(out, ContentDelta(lead))
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
        body = self._buf.lstrip(_WS)
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
                _merge(out, ToolCallStart(call.index, self._new_id(), call.name))
            if call.started and call.args:
                _merge(out, ToolCallArgs(call.index, "".join(call.args)))
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
        if prev_depth == 1 and prev_state == _VALUE and sc.state != _VALUE:  # a top-level value begins
            call.vkey, call.vstart = sc.last_key, len(call.raw) - 1
            if call.vkey == "name" and ch != '"':
                return False
            if call.vkey in ARGS_KEYS:
                if call.args_state or ch not in '{"':
                    return False
                call.args_state = 1 if ch == "{" else 2
        elif prev_depth == 1 and prev_state == _STR and sc.state == _COLON:  # a top-level key was read
            if not call.hermes and sc.last_key not in _LLAMA_KEYS:
                return False  # an ordinary JSON reply, not a call
        if call.args_state == 1 and call.vkey in ARGS_KEYS and call.vstart >= 0:
            call.args.append(ch)
        if call.vstart >= 0 and sc.depth == 1 and sc.state == _OBJ_NEXT:  # that value ended
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
        _merge(out, ToolCallEnd(call.index))
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
            _merge(out, ToolCallEnd(call.index, broken=call.raw))
            self._index += 1
        else:
            _merge(out, ContentDelta(call.raw))
        self._call = None
        self._mode, self._blank, self._json_ok = _TEXT, False, False
