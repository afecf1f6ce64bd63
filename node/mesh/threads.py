"""Which conversation of its session a turn belongs to: a session is an affinity group, a
conversation a prefix thread within it.

Claude Code runs subagents beside the main conversation under one session id, each with its
own system prompt and history; Codex CLI and OpenHands send side requests (titles, summaries)
under theirs. Keyed by the session id alone, those conversations would take each other's
cache, replica and stored copy, and run one at a time. So every conversation is a session of
its own inside kvmesh (engine cache, replica, store, handoffs, placement all key on it):

- the first conversation an entry sees under a session id is its main one, keyed by the id
  itself, so a client with one conversation per id sees exactly its id everywhere;
- any other is keyed `<id>#<8 hex of its opening>`, the opening being its first system and
  first user message (node.api.sessionid), which its later turns repeat; that key is
  deterministic, so every entry names a subagent's conversation alike.

Sans-I/O, LRU-capped. The main opening is what this entry saw first: an entry that first hears
of a session from one of its subagents takes that one as main (the cache still follows the
key it got, only the label differs). A session keeps at most `max_threads` conversations;
past that its least recently used one is handed to `on_forget` (the node evicts its cache).
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_KEY_BYTES = 256  # protocol.session_id_problem's bound: a key travels as X-Session-Id on the hop
SUFFIX_HEX = 8


def thread_key(group: str, opening: str) -> str:
    """The key of a conversation of `group` other than its main one."""
    suffix = "#" + opening[:SUFFIX_HEX]
    room = MAX_KEY_BYTES - len(suffix)
    head = group.encode()[:room].decode(errors="ignore")  # never cut a character in two
    return head + suffix


@dataclass
class _Group:
    main: str  # the main conversation's opening digest
    threads: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)  # keys, LRU first


class Threads:
    """The conversations of each session this entry has placed turns for."""

    def __init__(self, *, max_threads: int = 16, cap_sessions: int = 100_000,
                 on_forget: Callable[[str], object] | None = None):
        self.max_threads = max_threads
        self.cap_sessions = cap_sessions
        self.on_forget = on_forget
        self._groups: collections.OrderedDict[str, _Group] = collections.OrderedDict()

    def key(self, session: str, opening: str) -> str:
        """The conversation key for a turn of `session` whose opening digest is `opening` ("": a
        request with no conversation structure, such as a raw prompt, keeps the session's own key)."""
        if not opening:
            return session
        g = self._groups.get(session)
        if g is None:
            g = self._groups[session] = _Group(main=opening)
            while len(self._groups) > self.cap_sessions:
                self._groups.popitem(last=False)
        else:
            self._groups.move_to_end(session)
        key = session if opening == g.main else thread_key(session, opening)
        g.threads[key] = None
        g.threads.move_to_end(key)
        while len(g.threads) > self.max_threads:
            old, _ = g.threads.popitem(last=False)
            if old == session:  # the main conversation is never the one forgotten
                g.threads[old] = None
                continue
            if self.on_forget is not None:
                self.on_forget(old)
        return key

    def threads_of(self, session: str) -> list[str]:
        """The conversation keys this entry knows under `session`, least recently used first."""
        g = self._groups.get(session)
        return list(g.threads) if g is not None else []
