"""A GGUF model's tokenizer, through llama.cpp: ids from `llama_tokenize`, bytes from `llama_token_to_piece`.

The chat template (`tokenizer.chat_template` of the GGUF) is rendered by `HFTokenizer`'s jinja
path, unchanged: `LlamaTokenizer` subclasses it and replaces only how text becomes ids and ids
become bytes, so whatever that path learns (tools, tool results) applies to GGUF models too.
`_Vocab` gives `HFTokenizer` the three things it asks of a `tokenizers` object (vocabulary size,
the special tokens, an id by its text).
"""

from __future__ import annotations

import codecs
import ctypes
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvmesh.node.engine.tokenizer import HFTokenizer


@dataclass(frozen=True)
class _Added:
    content: str
    special: bool


class _Vocab:
    """The `tokenizers.Tokenizer` methods HFTokenizer's constructor calls, answered by llama.cpp's vocabulary."""

    def __init__(self, lib: Any, vocab: Any) -> None:
        self.lib, self.vocab = lib, vocab
        self.n = int(lib.llama_vocab_n_tokens(vocab))
        self.text = [(lib.llama_vocab_get_text(vocab, i) or b"").decode("utf-8", "replace") for i in range(self.n)]
        control = lib.LLAMA_TOKEN_ATTR_CONTROL
        self.special = {i for i in range(self.n) if lib.llama_vocab_get_attr(vocab, i) & control}
        self._by_text = {t: i for i, t in enumerate(self.text)}

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self.n

    def get_added_tokens_decoder(self) -> dict[int, _Added]:
        return {i: _Added(self.text[i], True) for i in self.special}

    def token_to_id(self, text: str) -> int | None:
        return self._by_text.get(text)


class LlamaTokenizer(HFTokenizer):
    """llama.cpp's tokenizer for a loaded model, with the GGUF's chat template."""

    def __init__(self, lib: Any, vocab: Any, *, chat_template: str | None, allowed: list[int] | None = None) -> None:
        v = _Vocab(lib, vocab)
        self._lib, self._vocab = lib, vocab
        bos, eos = int(lib.llama_vocab_bos(vocab)), int(lib.llama_vocab_eos(vocab))
        eog = [i for i in range(v.n) if lib.llama_vocab_is_eog(vocab, i)]
        if 0 <= eos < v.n:  # the EOS first: it is the one a template writes after a message
            eog = [eos] + [i for i in eog if i != eos]
        super().__init__(
            v,
            chat_template=chat_template,
            bos_token=v.text[bos] if 0 <= bos < v.n else None,
            eos_token=v.text[eos] if 0 <= eos < v.n else None,
            extra_eos_ids=eog,
            decoder_kind="decode",
        )
        self._allowed = allowed

    def encode(self, text: str) -> list[int]:
        # Special tokens in the text (a rendered template's <|im_start|>, <s>) are parsed as such;
        # nothing is added: the template writes BOS itself.
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        while True:
            buf = (self._lib.llama_token * cap)()
            n = self._lib.llama_tokenize(self._vocab, raw, len(raw), buf, cap, False, True)
            if n >= 0:
                return list(buf[:n])
            cap = -n

    def decode(self, ids: Iterable[int]) -> str:
        return b"".join(self.token_bytes(int(i)) for i in ids).decode("utf-8", errors="replace")

    def incremental_decoder(self) -> codecs.IncrementalDecoder:
        return codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _compute_bytes(self, token_id: int) -> bytes:
        if not 0 <= token_id < self.vocab_size or token_id in self._special:
            return b""
        buf = ctypes.create_string_buffer(256)
        n = self._lib.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, False)
        return buf.raw[: max(0, n)]

    def generation_mask(self) -> np.ndarray | None:  # type: ignore[override]  # a generated model narrows HFTokenizer's None
        """None for a real model; a model from node.engine.gguf_gen names the ids it may emit."""
        if self._allowed is None:
            return None
        mask = np.zeros(self.vocab_size, dtype=bool)
        mask[self._allowed] = True
        return mask
