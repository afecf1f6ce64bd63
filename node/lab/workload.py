"""Deterministic synthetic conversations: a coding agent's system prompt, tool output, replies."""

from __future__ import annotations

import random

WORDS = (
    "def class return import self async await yield lambda None True False for while if else elif try except "
    "finally with as raise assert pass break continue global nonlocal del from in is not and or test file "
    "path line error value result config node engine block cache token session replica mesh host slot"
).split()


def text(rng: random.Random, n_chars: int) -> str:
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = rng.choice(WORDS)
        sep = "\n" if rng.random() < 0.08 else " "
        out.append(w + sep)
        size += len(w) + 1
    return "".join(out)[:n_chars]


def system_prompt(rng: random.Random, n_chars: int = 3000) -> str:
    return "You are a coding agent. Follow the spec exactly.\n" + text(rng, n_chars)


def grow_conversation(rng: random.Random, target_tokens: int, *, tool_chars: tuple[int, int] = (800, 4000)) -> list[dict[str, str]]:
    """A conversation whose chat template is ~target_tokens long (byte tokenizer: 1 char ~ 1 token)."""
    msgs = [{"role": "system", "content": system_prompt(rng)}, {"role": "user", "content": "Build the to-do app from the spec."}]
    size = sum(len(m["content"]) + 2 for m in msgs)
    while size < target_tokens:
        reply = text(rng, rng.randint(60, 200))
        tool = text(rng, min(rng.randint(*tool_chars), max(1, target_tokens - size)))
        msgs += [{"role": "assistant", "content": reply}, {"role": "tool", "content": tool}]
        size += len(reply) + len(tool) + 4
    return msgs
