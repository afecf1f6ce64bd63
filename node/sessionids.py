"""Session ids on the wire: what a session id may be, and how it is named where an id cannot go verbatim
(file names, URL path segments, header values). Part of the wire contract: `node.protocol` re-exports
every name here, so consumers keep importing them from there; it depends on pydantic and the stdlib only.
"""

from __future__ import annotations

import hashlib
import unicodedata
from typing import Annotated
from urllib.parse import quote

from pydantic import AfterValidator

# Session ids are what clients send (emails, base64, paths): any printable text up to this many
# UTF-8 bytes. Nothing is named by the id itself: files and store directories by `session_key`.
MAX_SESSION_ID_BYTES = 256
# Characters that steer how text is laid out rather than being text: bidi embeddings, overrides and
# isolates (an id could otherwise show as another id in a log or the console).
_BIDI_CONTROLS = frozenset({"LRE", "RLE", "LRO", "RLO", "PDF", "LRI", "RLI", "FSI", "PDI"})


def session_id_problem(value: object) -> str | None:
    """Why `value` is not a session id, or None when it is one: a non-empty string of at most
    MAX_SESSION_ID_BYTES UTF-8 bytes with no control character (C0/C1 controls, DEL, line and
    paragraph separators, bidi controls). Anything else printable is fine: '/', '+', '=', '@', spaces."""
    if not isinstance(value, str):
        return "is not a string"
    if not value:
        return "is empty"
    try:
        n = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        return "is not valid Unicode (an unpaired surrogate)"
    if n > MAX_SESSION_ID_BYTES:
        return f"is {n} bytes long; at most {MAX_SESSION_ID_BYTES} UTF-8 bytes"
    for c in value:
        if unicodedata.category(c) in ("Cc", "Zl", "Zp") or unicodedata.bidirectional(c) in _BIDI_CONTROLS:
            return f"contains the control character U+{ord(c):04X}"
    return None


def is_valid_session_id(value: object) -> bool:
    """Whether `value` is a session id (see `session_id_problem`)."""
    return session_id_problem(value) is None


def session_key(session: str) -> str:
    """The name of a session where an id cannot go verbatim (file and directory names): 32 hex
    digits of the SHA-256 of its UTF-8 bytes. Fixed length, no '/', '.' or '~', one per id."""
    return hashlib.sha256(session.encode("utf-8")).hexdigest()[:32]


def session_from_header(value: str) -> str:
    """The id a header carried. HTTP servers hand header bytes over as latin-1 text; an id sent as
    UTF-8 (the only way to send non-ASCII) is read back as that text, anything else as it came."""
    try:
        return value.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return value


def session_path(session: str) -> str:
    """`session` as one URL path segment: every byte but letters, digits, '-', '_' and '~'
    percent-encoded ('/' and '.' too, so no client or server folds '..' or splits the id)."""
    return quote(session, safe="").replace(".", "%2E")


def session_header(session: str) -> str:
    """`session` as a header value: its UTF-8 bytes as latin-1 text (what HTTP stacks put on the
    wire unchanged), so `session_from_header` reads back the same id."""
    return session.encode("utf-8").decode("latin-1")


def _checked_session_id(v: str) -> str:
    problem = session_id_problem(v)
    if problem is not None:
        raise ValueError(f"the session id {problem}")
    return v


# A session id field of a wire model: refused (naming the problem) where `session_id_problem` says so.
SessionId = Annotated[str, AfterValidator(_checked_session_id)]
