"""An incremental JSON syntax check, one character at a time, for the tool-call parser.

`JsonScanner` reads one JSON object and says at the first character that cannot continue it;
its states are public because the parser (node.api.toolcalls) reads where a top-level value
begins and ends from them.
"""

from __future__ import annotations

import json
import re

WS = " \t\r\n"  # JSON's whitespace


class JsonSyntaxError(ValueError):
    """The character does not continue valid JSON."""


(VALUE, OBJ_FIRST, OBJ_KEY, COLON, OBJ_NEXT, ARR_FIRST, ARR_NEXT,
 STR, ESC, HEX, NUM, LIT, DONE) = range(13)
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
        self.state = VALUE
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
        return self.state == DONE

    def push(self, ch: str) -> None:
        st = self.state
        if st == NUM:
            if ch in _NUM_CHARS:
                self._text.append(ch)
                return
            if not _NUM_RE.match("".join(self._text)):
                raise JsonSyntaxError("not a number")
            self._after_value()
            st = self.state
        if st in (STR, ESC, HEX):
            self._string(ch)
        elif st == LIT:
            if not self._lit or ch != self._lit[0]:
                raise JsonSyntaxError("not a literal")
            self._lit = self._lit[1:]
            if not self._lit:
                self._after_value()
        elif ch in WS and st != DONE:
            return
        else:
            self._structure(st, ch)

    def _structure(self, st: int, ch: str) -> None:
        if st in (VALUE, ARR_FIRST):
            if st == ARR_FIRST and ch == "]":
                self._close()
            else:
                self._begin_value(ch)
        elif st in (OBJ_FIRST, OBJ_KEY) and ch == '"':
            self.state, self._is_key, self._text = STR, True, []
        elif st == OBJ_FIRST and ch == "}":
            self._close()
        elif st == COLON and ch == ":":
            self.state = VALUE
        elif st == OBJ_NEXT and ch == ",":
            self.state = OBJ_KEY
        elif st == ARR_NEXT and ch == ",":
            self.state = VALUE
        elif (st == OBJ_NEXT and ch == "}") or (st == ARR_NEXT and ch == "]"):
            self._close()
        else:
            raise JsonSyntaxError(f"unexpected {ch!r}")

    def _begin_value(self, ch: str) -> None:
        if not self.stack and ch != "{":
            raise JsonSyntaxError("not an object")
        if ch == "{":
            self.stack.append("o")
            self.state = OBJ_FIRST
        elif ch == "[":
            self.stack.append("a")
            self.state = ARR_FIRST
        elif ch == '"':
            self.state, self._is_key = STR, False
        elif ch == "-" or ch.isdigit() and ch.isascii():
            self.state, self._text = NUM, [ch]
        elif ch in _LITERALS:
            self.state, self._lit = LIT, _LITERALS[ch]
        else:
            raise JsonSyntaxError(f"unexpected {ch!r}")

    def _string(self, ch: str) -> None:
        if self._is_key:
            self._text.append(ch)
        if self.state == ESC:
            if ch == "u":
                self.state, self._hex = HEX, 4
            elif ch in '"\\/bfnrt':
                self.state = STR
            else:
                raise JsonSyntaxError("bad escape")
        elif self.state == HEX:
            if ch not in _HEXDIGITS:
                raise JsonSyntaxError("bad \\u escape")
            self._hex -= 1
            if not self._hex:
                self.state = STR
        elif ch == "\\":
            self.state = ESC
        elif ch == '"':
            if self._is_key:
                self.last_key = json.loads('"' + "".join(self._text))
                self.state = COLON
            else:
                self._after_value()
        elif ch < " ":
            raise JsonSyntaxError("control character in a string")

    def _close(self) -> None:
        self.stack.pop()
        self._after_value()

    def _after_value(self) -> None:
        if not self.stack:
            self.state = DONE
        else:
            self.state = OBJ_NEXT if self.stack[-1] == "o" else ARR_NEXT

