"""Byte-level tokenizer with role markers and the chat template.

Ids 0-255 are bytes; the specials follow. The template is
`<bos> (<role> content <end>)* <assistant>`, so a conversation's tokens only
ever grow at the end between turns, which is what makes prefix reuse work.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

BOS, END, SYSTEM, USER, ASSISTANT, TOOL = range(256, 262)
VOCAB_SIZE = 262
ROLE_TOKENS = {"system": SYSTEM, "developer": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
ROLE_NAMES = {SYSTEM: "system", USER: "user", ASSISTANT: "assistant", TOOL: "tool"}


def _content_text(content: Any) -> str:
    """OpenAI content is a string or a list of parts; only text parts are kept."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, Mapping) and p.get("type") == "text")


class ByteTokenizer:
    """Bytes in, ids out; special ids for roles, BOS and END."""

    vocab_size = VOCAB_SIZE
    eos_id = END

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def incremental_decoder(self) -> codecs.IncrementalDecoder:
        return codecs.getincrementaldecoder("utf-8")(errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""

    def apply_chat_template(self, messages: Iterable[Mapping[str, Any]]) -> list[int]:
        ids = [BOS]
        for m in messages:
            ids.append(ROLE_TOKENS[m["role"]])
            ids.extend(self.encode(_content_text(m.get("content"))))
            ids.append(END)
        ids.append(ASSISTANT)
        return ids

    def message_starts(self, ids: np.ndarray) -> np.ndarray:
        """Token index where each message begins (for 'where did the prompt stop matching')."""
        return np.flatnonzero(np.isin(ids, list(ROLE_NAMES)))

    def generation_mask(self) -> np.ndarray:
        """Ids a random-weight model may emit: printable ASCII, newline, END.

        Keeps generated text round-trippable through a client that sends it back,
        so the next turn's prompt matches the cached tokens exactly.
        """
        mask = np.zeros(VOCAB_SIZE, dtype=bool)
        mask[32:127] = True
        mask[10] = True
        mask[END] = True
        return mask
