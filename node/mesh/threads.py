"""Which conversation of its session a turn belongs to: a session is an affinity group, a
conversation a prefix thread within it.

Claude Code runs subagents beside the main conversation under one session id, each with its
own system prompt and history; Codex CLI and OpenHands send side requests (titles, summaries)
under theirs. Keyed by the session id alone, those conversations would take each other's
cache, replica and stored copy, and run one at a time. So every conversation is a session of
its own inside kvmesh (engine cache, replica, store, handoffs and placement all key on it):

- a conversation is told by its `Opening`: what precedes its first user message (the system
  prompt) and that first message's text. A later turn of the same conversation repeats both,
  or extends the first message (a client that sends the whole history as one growing message);
- the first conversation an entry sees under a session id is its main one, keyed by the id
  itself, so a client with one conversation per id sees exactly its id everywhere;
- any other is keyed `<id>#<8 hex>` of the opening it first came with.

Sans-I/O, LRU-capped. Every entry must name a conversation alike, so the host that runs a
turn keeps its conversation's `signature` in its session record, pushed to its peers like the
rest of its state, and `KnownThreads` indexes what a node has heard of them by session id.
A turn whose opening no conversation of this entry owns is matched against those first
(`known`): the entry meeting a session id it has not seen takes the mesh's main conversation
as its own, and a conversation opened at another entry keeps the key it got there. That is
what keeps a client that sends its history as one growing message on one key: the opening of
its fifth turn hashes to another key than its first, but the first's signature owns it. Only a
conversation nobody knows is keyed here. A session keeps at most `max_threads` conversations;
past that its least recently used one (never the main) is handed to `on_forget`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import xxhash

MAX_KEY_BYTES = 256  # node.sessionids' bound: a key travels as X-Session-Id on the hop
OPENING_CHARS = 65536  # of a first message, enough to tell conversations apart; hashing more is waste


@dataclass(frozen=True)
class Opening:
    """How a request's conversation began: a digest of what precedes its first user message, and that
    message's text (at most OPENING_CHARS of it)."""

    head: str
    first: str


@dataclass(frozen=True)
class _Thread:
    key: str
    head: str
    chars: int  # how much of its first message the thread was opened with...
    digest: int  # ...and that text's digest: a turn whose first message starts with it is this thread's

    @property
    def signature(self) -> str:
        return f"{self.chars}:{self.digest:x}:{self.head}"

    @classmethod
    def parse(cls, key: str, signature: str) -> _Thread | None:
        chars, _, rest = signature.partition(":")
        digest, _, head = rest.partition(":")
        try:
            return cls(key, head, int(chars), int(digest, 16))
        except ValueError:
            return None

    def owns(self, op: Opening) -> bool:
        return (op.head == self.head and len(op.first) >= self.chars
                and _digest(op.first[: self.chars]) == self.digest)


def _digest(text: str) -> int:
    return xxhash.xxh64_intdigest(text.encode("utf-8", "surrogatepass"))


def _adopted(session: str, op: Opening, known: Mapping[str, str]) -> _Thread | None:
    """The conversation of `session` the mesh knows that owns `op`: the one opened with most of it."""
    owners = [t for k, sig in known.items() if (t := _Thread.parse(k, sig)) is not None and t.owns(op)]
    return max(owners, key=lambda t: t.chars, default=None)


def thread_key(group: str, op: Opening) -> str:
    """The key of a conversation of `group` other than its main one."""
    suffix = "#" + f"{_digest(op.head + chr(0) + op.first):016x}"[:8]
    head = group.encode()[: MAX_KEY_BYTES - len(suffix)].decode(errors="ignore")  # never cut a character in two
    return head + suffix


@dataclass
class _Group:
    threads: collections.OrderedDict[str, _Thread] = field(default_factory=collections.OrderedDict)  # LRU first


class Threads:
    """The conversations of each session this entry has placed turns for."""

    def __init__(self, *, max_threads: int = 16, cap_sessions: int = 100_000,
                 on_forget: Callable[[str], object] | None = None):
        self.max_threads = max_threads
        self.cap_sessions = cap_sessions
        self.on_forget = on_forget
        self._groups: collections.OrderedDict[str, _Group] = collections.OrderedDict()

    def knows(self, session: str) -> bool:
        return session in self._groups

    def key(self, session: str, op: Opening | None, known: Mapping[str, str] | None = None) -> str:
        """The conversation key for a turn of `session` that opened with `op` (None: a request with no
        conversation structure, such as a raw prompt, keeps the session's own key); `known` maps the keys
        of the session's conversations the mesh knows to their signatures (KnownThreads.of)."""
        if op is None:
            return session
        known = known or {}
        g = self._groups.get(session)
        if g is None:
            g = self._groups[session] = _Group()
            if (sig := known.get(session)) and (main := _Thread.parse(session, sig)) is not None:
                g.threads[session] = main  # the main conversation is the mesh's, whether or not this turn is of it
            while len(self._groups) > self.cap_sessions:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(session)
        t = next((t for t in reversed(g.threads.values()) if t.owns(op)), None)
        if t is None:
            t = _adopted(session, op, known)
        if t is None:
            key = session if not g.threads else thread_key(session, op)
            first = op.first[:OPENING_CHARS]
            t = _Thread(key, op.head, len(first), _digest(first))
            g.threads.pop(key, None)
        g.threads[t.key] = t
        g.threads.move_to_end(t.key)
        self._bound(session, g)
        return t.key

    def _bound(self, session: str, g: _Group) -> None:
        while len(g.threads) > self.max_threads:
            old = next(k for k in g.threads if k != session)  # the main conversation is never the one forgotten
            del g.threads[old]
            if self.on_forget is not None:
                self.on_forget(old)

    def signature(self, session: str, key: str) -> str:
        """What tells conversation `key` of `session` apart, for the host running it to keep ("": unknown)."""
        g = self._groups.get(session)
        t = g.threads.get(key) if g is not None else None
        return t.signature if t is not None else ""

    def threads_of(self, session: str) -> list[str]:
        """The conversation keys this entry knows under `session`, least recently used first."""
        g = self._groups.get(session)
        return list(g.threads) if g is not None else []


class KnownThreads:
    """The conversations of each session id this node has heard of, from its own turns and its peers'
    pushed state: session id -> {conversation key: signature}, LRU-capped both ways. A signature may
    be stale (the conversation forgotten since); matching it names the conversation as it was named."""

    def __init__(self, cap_sessions: int = 100_000, per_session: int = 64):
        self.cap_sessions, self.per_session = cap_sessions, per_session
        self._groups: collections.OrderedDict[str, collections.OrderedDict[str, str]] = collections.OrderedDict()

    def heard(self, group: str, key: str, signature: str) -> None:
        """Conversation `key` of session id `group` opened as `signature` says ("" tells nothing)."""
        if not signature:
            return
        g = self._groups.get(group)
        if g is None:
            g = self._groups[group] = collections.OrderedDict()
            while len(self._groups) > self.cap_sessions:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(group)
        g[key] = signature
        g.move_to_end(key)
        while len(g) > self.per_session:
            g.popitem(last=False)

    def of(self, group: str) -> Mapping[str, str]:
        return self._groups.get(group, {})
