"""Tokenizers: the byte-level one of the tiny preset, and Hugging Face checkpoints'.

ByteTokenizer: ids 0-255 are bytes; the specials follow. The template is
`<bos> (<role> content <end>)* <assistant>`, so a conversation's tokens only
ever grow at the end between turns, which is what makes prefix reuse work.

HFTokenizer: a checkpoint's `tokenizer.json` (the `tokenizers` package) and the
chat template of its `tokenizer_config.json` (or `chat_template.jinja`), rendered
with jinja2 the way `transformers` renders it (node.engine.chat, which also renders
`tools`). Both have one interface (`Tokenizer`).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvmesh.node.engine.chat import ChatTemplate, ToolChoice, plain_messages

BOS, END, SYSTEM, USER, ASSISTANT, TOOL = range(256, 262)
VOCAB_SIZE = 262
ROLE_TOKENS = {"system": SYSTEM, "developer": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
ROLE_NAMES = {SYSTEM: "system", USER: "user", ASSISTANT: "assistant", TOOL: "tool"}


class Tokenizer(Protocol):
    """What the engine and the API need from a tokenizer."""

    vocab_size: int
    eos_id: int  # the end-of-turn id (-1: none)
    eos_ids: tuple[int, ...]  # every id that ends a turn
    bos_id: int | None  # what a raw prompt starts with (legacy completions); None: nothing

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def incremental_decoder(self) -> codecs.IncrementalDecoder: ...
    def token_bytes(self, token_id: int) -> bytes: ...
    def apply_chat_template(self, messages: Iterable[Mapping[str, Any]], *,
                            tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: ToolChoice = "auto",
                            parallel_tool_calls: bool = True) -> list[int]: ...
    def message_starts(self, ids: np.ndarray) -> np.ndarray: ...
    def generation_mask(self) -> np.ndarray | None: ...


class ByteTokenizer:
    """Bytes in, ids out; special ids for roles, BOS and END."""

    vocab_size = VOCAB_SIZE
    eos_id = END
    eos_ids: tuple[int, ...] = (END,)
    bos_id: int | None = BOS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def incremental_decoder(self) -> codecs.IncrementalDecoder:
        return codecs.getincrementaldecoder("utf-8")(errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else b""

    def apply_chat_template(self, messages: Iterable[Mapping[str, Any]], *,
                            tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: ToolChoice = "auto",
                            parallel_tool_calls: bool = True) -> list[int]:
        """The byte template; tools go into the system message in the generic form (node.engine.chat),
        tool results keep the tool role and an assistant's tool calls follow its text. `parallel_tool_calls`
        is the turn grammar's to enforce, not the prompt's (node.engine.chat)."""
        ids = [BOS]
        for m in plain_messages(messages, tools, tool_choice=tool_choice, tool_role=True):
            ids.append(ROLE_TOKENS[m["role"]])
            ids.extend(self.encode(m["content"]))
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


# ---- Hugging Face tokenizers ------------------------------------------------------

# Used when a checkpoint has no chat template: role markers in plain text, each
# message closed by the EOS token, so turns still only grow at the end.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, which byte-level BPE vocabularies are written in."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1)) + list(range(ord("\xae"), ord("\xff") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _token_text(v: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or an AddedToken dict."""
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return v["content"]
    return None


class HFTokenizer:
    """A Hugging Face tokenizer (`tokenizers`) with the checkpoint's chat template (jinja2).

    Same interface as ByteTokenizer. A real model's output is not masked:
    `generation_mask()` is None.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
        unk_token: str | None = None,
        extra_eos_ids: Iterable[int] = (),
        decoder_kind: str = "bytelevel",
    ) -> None:
        self._tok = tokenizer
        self.vocab_size = int(tokenizer.get_vocab_size(with_added_tokens=True))
        self.bos_token, self.eos_token, self.pad_token, self.unk_token = bos_token, eos_token, pad_token, unk_token
        self._decoder_kind = decoder_kind  # "bytelevel", "sentencepiece" or "decode"
        added = tokenizer.get_added_tokens_decoder()
        self._special = {i for i, t in added.items() if t.special}
        self._added_text = {i: t.content for i, t in added.items() if not t.special}
        self._bytes_cache: dict[int, bytes] = {}
        eos_ids: list[int] = []
        if eos_token is not None and (i := tokenizer.token_to_id(eos_token)) is not None:
            eos_ids.append(i)
        eos_ids += [int(i) for i in extra_eos_ids if int(i) not in eos_ids]
        self.eos_ids: tuple[int, ...] = tuple(eos_ids)
        self.eos_id: int = eos_ids[0] if eos_ids else -1
        self.bos_id: int | None = tokenizer.token_to_id(bos_token) if bos_token else None
        self.has_chat_template = chat_template is not None
        self.chat_template = chat_template if chat_template is not None else FALLBACK_CHAT_TEMPLATE
        self._template = ChatTemplate(self.chat_template)
        self._markers = self._find_message_markers()

    @classmethod
    def from_dir(cls, path: str | Path, *, extra_eos_ids: Iterable[int] = ()) -> HFTokenizer:
        """tokenizer.json (required), tokenizer_config.json, chat_template.jinja and
        generation_config.json (optional) of a checkpoint directory."""
        from tokenizers import Tokenizer as _Tok

        from kvmesh.node.engine.hf import read_json as _read_json
        from kvmesh.node.errors import CheckpointError

        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise CheckpointError(f"{tj} does not exist: the checkpoint needs a tokenizer.json (tokenizers format)", path=str(tj))
        spec = _read_json(tj)
        try:
            tok = _Tok.from_str(json.dumps(spec))
        except Exception as e:  # the tokenizers package raises its own exception types
            raise CheckpointError(f"{tj} is not a tokenizers file: {e}", path=str(tj)) from None
        tc_path = d / "tokenizer_config.json"
        tc = _read_json(tc_path) if tc_path.is_file() else {}
        template = tc.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        if not isinstance(template, str) and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        if not isinstance(template, str) and (d / "chat_template.json").is_file():
            template = _read_json(d / "chat_template.json").get("chat_template")
        # Stop ids: the tokenizer's EOS, the config's and generation_config's eos_token_id.
        extra = list(extra_eos_ids)
        gc_path = d / "generation_config.json"
        if gc_path.is_file():
            g = _read_json(gc_path).get("eos_token_id")
            extra += [g] if isinstance(g, int) else [i for i in (g or []) if isinstance(i, int)]
        dec = spec.get("decoder") or {}
        kinds = {dec.get("type")} | {x.get("type") for x in dec.get("decoders") or [] if isinstance(x, Mapping)}
        kind = "bytelevel" if "ByteLevel" in kinds else "sentencepiece" if kinds & {"Metaspace", "ByteFallback", "Replace"} else "decode"
        try:
            return cls(
                tok,
                chat_template=template if isinstance(template, str) else None,
                bos_token=_token_text(tc.get("bos_token")),
                eos_token=_token_text(tc.get("eos_token")),
                pad_token=_token_text(tc.get("pad_token")),
                unk_token=_token_text(tc.get("unk_token")),
                extra_eos_ids=extra,
                decoder_kind=kind,
            )
        except Exception as e:  # a template that does not compile or cannot render a probe
            from jinja2 import TemplateError

            if isinstance(e, TemplateError):
                raise CheckpointError(f"the chat template of {d} does not compile: {e}", path=str(tc_path)) from None
            raise

    # ---- text <-> ids ----------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        # No BOS/EOS added here: the chat template writes them itself (as transformers does).
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def incremental_decoder(self) -> codecs.IncrementalDecoder:
        return codecs.getincrementaldecoder("utf-8")(errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id contributes to the text: b"" for special tokens and for ids past
        the tokenizer's vocabulary (a model's embedding is often padded beyond it)."""
        b = self._bytes_cache.get(token_id)
        if b is None:
            b = self._compute_bytes(token_id)
            self._bytes_cache[token_id] = b
        return b

    def _compute_bytes(self, token_id: int) -> bytes:
        if token_id in self._special:
            return b""
        if token_id in self._added_text:
            return self._added_text[token_id].encode("utf-8")
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return b""
        if self._decoder_kind == "bytelevel":
            try:
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
            except KeyError:
                return piece.encode("utf-8")
        if self._decoder_kind == "sentencepiece":
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                return bytes([int(piece[3:5], 16)])  # byte fallback
            return piece.replace("\u2581", " ").encode("utf-8")
        return self._tok.decode([token_id], skip_special_tokens=True).encode("utf-8")

    # ---- chat ------------------------------------------------------------------

    def render(self, messages: Iterable[Mapping[str, Any]], *, tools: Sequence[Mapping[str, Any]] | None = None,
               tool_choice: ToolChoice = "auto", parallel_tool_calls: bool = True,
               add_generation_prompt: bool = True) -> str:
        """The chat template's text for these messages and tools (node.engine.chat decides native or generic)."""
        return self._template.render(
            messages,
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            pad_token=self.pad_token or "",
            unk_token=self.unk_token or "",
        )

    def apply_chat_template(self, messages: Iterable[Mapping[str, Any]], *,
                            tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: ToolChoice = "auto",
                            parallel_tool_calls: bool = True) -> list[int]:
        from jinja2 import TemplateError

        from kvmesh.node.errors import InvalidRequest

        try:
            text = self.render(messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls)
        except TemplateError as e:  # e.g. a template that demands alternating roles
            raise InvalidRequest(f"the model's chat template refused these messages: {e}", param="messages") from None
        return self.encode(text)

    def _find_message_markers(self) -> frozenset[int]:
        """Special ids that open a message in this template (<|im_start|>, <|start_header_id|>, ...).

        Found by rendering a probe conversation and the prefixes of it: the first id of
        each later message, where it is a special token, is a marker."""
        probe = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
        try:
            full = self.encode(self.render(probe, add_generation_prompt=False))
            marks: set[int] = set()
            for k in range(1, len(probe)):
                head = self.encode(self.render(probe[:k], add_generation_prompt=False))
                if len(head) < len(full) and full[: len(head)] == head and full[len(head)] in self._special:
                    marks.add(full[len(head)])
            return frozenset(marks)
        except Exception:  # a template that refuses the probe: no markers, messages not located
            return frozenset()

    def message_starts(self, ids: np.ndarray) -> np.ndarray:
        """Token index where each message begins (0 alone where the template has no markers)."""
        if not self._markers:
            return np.zeros(1, dtype=np.int64)
        return np.flatnonzero(np.isin(ids, list(self._markers)))

    def generation_mask(self) -> None:
        """A real model is not masked: every id may be sampled."""
        return None

