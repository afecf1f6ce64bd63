"""A conversation driven through a node's OpenAI API turn by turn, and what one turn reported.

Two openings: a coding agent's (`node.lab.workload.grow_conversation`, about `tokens` tokens of
system prompt, tool outputs and replies), or, with `chars`, one system prompt of that many characters
tagged with the session (so no two sessions share a block) and a "go". Either way the chat template only
grows at the end: each turn appends the reply and a tool output, so every turn's prompt extends the last.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmesh.node.lab.workload import grow_conversation, text
from kvmesh.node.engine.tokenizer import ByteTokenizer

AGENT_TOKENS = 8000  # a "long" agent opening (byte tokenizer: ~1 token per character)
TOOL_CHARS = 300  # a tool output appended per turn: well under 10% of a long prompt
TOKENIZER = ByteTokenizer()


@dataclass
class Turn:
    """One turn as the client saw it: the kvmesh response headers and the OpenAI usage."""

    host: str  # X-Kvmesh-Host: where the turn ran
    handoff: str  # X-Kvmesh-Handoff: warm, partial, cold or none
    cached: int  # X-Kvmesh-Cached-Tokens
    prompt_tokens: int
    reply: str
    session: str
    status: int = 200
    cached_usage: int = 0  # usage.prompt_tokens_details.cached_tokens

    @classmethod
    def answered(cls, headers: Mapping[str, str], *, prompt_tokens: int, reply: str, session: str, status: int = 200,
                 cached_usage: int = 0) -> Turn:
        """The turn a response answered, from its kvmesh headers (names in lower case or as sent)."""
        h = {k.lower(): v for k, v in headers.items()}
        return cls(host=h["x-kvmesh-host"], handoff=h["x-kvmesh-handoff"], cached=int(h["x-kvmesh-cached-tokens"]),
                   prompt_tokens=prompt_tokens, reply=reply, session=session, status=status, cached_usage=cached_usage)

    @property
    def reused(self) -> float:
        """The fraction of the prompt served from cache."""
        return self.cached / max(1, self.prompt_tokens)


class Conversation:
    """A session's messages, grown at the end only, and the turns run so far."""

    def __init__(self, session: str, *, chars: int | None = None, seed: int | str | None = None,
                 tokens: int = AGENT_TOKENS) -> None:
        """An agent's opening of ~`tokens` tokens, or with `chars` a tagged system prompt; texts from `seed`
        (default: the session id)."""
        self.session = session
        self.rng = random.Random(seed if seed is not None else session)
        self.turns: list[Turn] = []
        self.messages: list[dict[str, Any]]  # openai's message types are TypedDicts: Any lets them through
        if chars is None:
            self.messages = grow_conversation(self.rng, tokens)
        else:
            self.messages = [{"role": "system", "content": f"[{session}] " + text(self.rng, chars)},
                             {"role": "user", "content": "go"}]

    def twin(self, session: str) -> Conversation:
        """Another session with the same messages (the same tokens, so the same chain hashes)."""
        c = Conversation(session, chars=0)
        c.messages = [dict(m) for m in self.messages]
        return c

    def tokens(self) -> np.ndarray:
        """The prompt's token ids (the chat template of every message)."""
        return np.asarray(TOKENIZER.apply_chat_template(self.messages), dtype=np.int32)

    def prompt_len(self) -> int:
        return len(TOKENIZER.apply_chat_template(self.messages))

    def grow(self, reply: str, tool_chars: int = TOOL_CHARS) -> None:
        """Append the reply and a tool output of `tool_chars` characters."""
        self.messages.append({"role": "assistant", "content": reply})
        self.messages.append({"role": "tool", "content": text(self.rng, tool_chars)})

    def grow_to(self, reply: str, prompt_tokens: int) -> None:
        """Append the reply and a tool output sized so the next prompt is exactly `prompt_tokens` tokens."""
        self.grow(reply, 0)
        room = prompt_tokens - self.prompt_len()
        assert room >= 0, f"the conversation is already {self.prompt_len()} tokens"
        self.messages[-1]["content"] = text(self.rng, room)
        assert self.prompt_len() == prompt_tokens
