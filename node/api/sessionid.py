"""Which session a turn belongs to, from what the client sent, in one documented order.

Coding agents name their conversations in different places; the first of these that is
present names the session, and the place it came from (its *source*) is kept with the
session, shown in /v1/cluster and the console:

1. `X-Session-Id` header (kvmesh's own)
2. `X-Claude-Code-Session-Id` header (Claude Code, every request)
3. Anthropic `metadata.user_id`, its session part: the JSON form's `session_id`
   (Claude Code >= 2.1.78) or the `..._session_<uuid>` tail of the older form; a user id
   with no session part names a user, not a conversation, and is passed over
4. `session_id` header (Codex CLI), then `conversation_id` header
5. `prompt_cache_key` (Codex CLI, OpenHands: the conversation id)
6. `x-litellm-session-id` header (OpenHands via LiteLLM), then `x-session-affinity`
7. the request's `user` field (OpenAI)
8. else `digest`: a hash of the first system and user message, stable across a conversation's turns

Each conversation under a session (a subagent's, a side request's) is told apart by its
*opening*: its system prompt and first user message (`opening_of`, node.mesh.threads).

A value that is present but not a session id (empty, over-long, a control character) is a
400 naming where it came from, never passed over: a client that sends one expects it used.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvmesh.node.errors import InvalidRequest
from kvmesh.node.mesh.threads import OPENING_CHARS, Opening
from kvmesh.node.protocol import session_from_header, session_id_problem

# The headers that name a session, by their place in the order (looked up case-insensitively).
HEADER_SOURCES = ("X-Session-Id", "X-Claude-Code-Session-Id")
LATE_HEADER_SOURCES = ("session_id", "conversation_id")
LAST_HEADER_SOURCES = ("x-litellm-session-id", "x-session-affinity")
SOURCES = (*HEADER_SOURCES, "metadata.user_id", *LATE_HEADER_SOURCES, "prompt_cache_key",
           *LAST_HEADER_SOURCES, "user", "digest")


@dataclass(frozen=True)
class SessionName:
    """A turn's session id, the source that named it (one of SOURCES) and how its conversation opened
    (None for a raw prompt, which has no conversation to tell apart)."""

    id: str
    source: str
    opening: Opening | None = None


@dataclass(frozen=True)
class Named:
    """What a request body offers toward its session's name (each dialect fills what it has)."""

    metadata_user_id: str | None = None
    prompt_cache_key: str | None = None
    user: str | None = None


def claude_session_part(user_id: str) -> str | None:
    """The session part of an Anthropic metadata.user_id, or None when it names only a user."""
    if user_id.startswith("{"):
        try:
            obj = json.loads(user_id)
        except ValueError:
            return None
        sid = obj.get("session_id") if isinstance(obj, dict) else None
        return sid if isinstance(sid, str) and sid else None
    head, sep, tail = user_id.rpartition("_session_")
    return tail if sep and head and tail else None


def name_session(headers: Mapping[str, str], named: Named, first_messages: list[dict[str, Any]], *,
                 conversation: bool = True) -> SessionName:
    """The session this request belongs to (see the module docstring for the order); with `conversation`,
    the opening that tells its conversations apart."""
    opening = opening_of(first_messages) if conversation else None
    return dataclasses.replace(_named(headers, named, first_messages), opening=opening)


def _named(headers: Mapping[str, str], named: Named, first_messages: list[dict[str, Any]]) -> SessionName:
    for source in HEADER_SOURCES:
        if (got := _header(headers, source)) is not None:
            return got
    if named.metadata_user_id:
        part = claude_session_part(named.metadata_user_id)
        if part is not None:
            return _checked(part, "metadata.user_id")
    for source in LATE_HEADER_SOURCES:
        if (got := _header(headers, source)) is not None:
            return got
    if named.prompt_cache_key:
        return _checked(named.prompt_cache_key, "prompt_cache_key")
    for source in LAST_HEADER_SOURCES:
        if (got := _header(headers, source)) is not None:
            return got
    if named.user:  # an empty `user` counts as none (clients send "" for "no user")
        return _checked(named.user, "user")
    return SessionName(digest_session(first_messages), "digest")


def opening_of(messages: list[dict[str, Any]]) -> Opening:
    """How a conversation opened: a digest of its first system (or developer) message, and its first user
    message's text (text parts joined, so a message that grows by parts keeps its start)."""
    system = next((m.get("content") for m in messages if m.get("role") in ("system", "developer")), None)
    user = next((m.get("content") for m in messages if m.get("role") == "user"), None)
    head = hashlib.sha256(repr(system).encode()).hexdigest()[:16] if system is not None else ""
    return Opening(head, _text(user)[:OPENING_CHARS])


def _text(content: Any) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) and isinstance(p.get("text"), str) else repr(p)
                       for p in content)
    return repr(content)


def digest_session(messages: list[dict[str, Any]]) -> str:
    """A conversation's id from its opening: the first system (or developer) and first user message."""
    first = [m for m in messages if m.get("role") in ("system", "developer")][:1]
    first += [m for m in messages if m.get("role") == "user"][:1]
    blob = repr([(m.get("role"), m.get("content")) for m in first]).encode()
    return "conv-" + hashlib.sha256(blob).hexdigest()[:20]


def _header(headers: Mapping[str, str], name: str) -> SessionName | None:
    value = headers.get(name)
    return None if value is None else _checked(session_from_header(value), name)


def _checked(value: str, source: str) -> SessionName:
    problem = session_id_problem(value)
    if problem is not None:
        raise InvalidRequest(f"{source}: the session id {problem}", param=source)
    return SessionName(value, source)
