"""Byte tokenizer and chat template: round trips, role markers, the prefix property."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmesh.node.engine.tokenizer import ASSISTANT, BOS, END, SYSTEM, TOOL, USER, VOCAB_SIZE, ByteTokenizer

tok = ByteTokenizer()


def test_ids_and_vocab() -> None:
    """Bytes are ids 0-255, the specials follow, END is the EOS id."""
    assert tok.vocab_size == VOCAB_SIZE == 262
    assert sorted({BOS, END, SYSTEM, USER, ASSISTANT, TOOL}) == list(range(256, 262))
    assert tok.eos_id == END
    assert tok.encode("Az") == [65, 122]


@settings(max_examples=50, deadline=None, database=None)
@given(st.text(max_size=60))
def test_encode_decode_round_trip(text: str) -> None:
    """decode(encode(text)) == text for any Unicode text (UTF-8 bytes)."""
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_decode_skips_specials() -> None:
    """Special ids carry no text."""
    assert tok.decode([BOS, USER, *tok.encode("hé"), END, ASSISTANT]) == "hé"
    assert tok.token_bytes(END) == b""
    assert tok.token_bytes(65) == b"A"


def test_incremental_decoder_joins_split_utf8() -> None:
    """Multi-byte characters fed one byte at a time decode once complete."""
    d = tok.incremental_decoder()
    out = "".join(d.decode(tok.token_bytes(i)) for i in tok.encode("é€"))
    assert out == "é€"


def test_chat_template_layout() -> None:
    """<bos> (<role> content <end>)* <assistant>, with content as UTF-8 bytes."""
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    ids = tok.apply_chat_template(msgs)
    want = [BOS, SYSTEM, *b"be brief", END, USER, *"héllo".encode(), END, ASSISTANT]
    assert ids == want
    # Content round-trips through decode; role markers sit where messages start.
    assert tok.decode(ids) == "be briefhéllo"
    starts = tok.message_starts(np.array(ids))
    assert starts.tolist() == [1, 1 + 1 + len("be brief") + 1, len(ids) - 1]


def test_role_markers() -> None:
    """Each role has its marker; developer shares system's; an unknown role is refused."""
    for role, marker in [("system", SYSTEM), ("developer", SYSTEM), ("user", USER), ("assistant", ASSISTANT), ("tool", TOOL)]:
        assert tok.apply_chat_template([{"role": role, "content": "x"}])[1] == marker
    with pytest.raises(KeyError):
        tok.apply_chat_template([{"role": "narrator", "content": "x"}])


def test_content_parts_and_none() -> None:
    """List content keeps only text parts; None content is empty."""
    parts = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}, {"type": "text", "text": "b"}]
    assert tok.apply_chat_template([{"role": "user", "content": parts}]) == [BOS, USER, 97, 98, END, ASSISTANT]
    assert tok.apply_chat_template([{"role": "assistant", "content": None}]) == [BOS, ASSISTANT, END, ASSISTANT]


@settings(max_examples=40, deadline=None, database=None)
@given(
    history=st.lists(
        st.tuples(st.sampled_from(["system", "user", "assistant", "tool"]), st.text(max_size=20)), max_size=5
    ),
    reply=st.text(max_size=20),
    follow=st.text(max_size=20),
)
def test_next_turn_template_strictly_extends_previous(history: list[tuple[str, str]], reply: str, follow: str) -> None:
    """Appending the assistant's reply and a new user message only adds tokens at the end."""
    msgs = [{"role": r, "content": c} for r, c in history]
    before = tok.apply_chat_template(msgs)
    after = tok.apply_chat_template([*msgs, {"role": "assistant", "content": reply}, {"role": "user", "content": follow}])
    assert len(after) > len(before)
    assert after[: len(before)] == before
    # What the model generated (reply bytes) sits right after the old prompt's <assistant>.
    assert after[len(before) : len(before) + len(reply.encode())] == tok.encode(reply)


def test_generation_mask_is_round_trippable_text() -> None:
    """The mask allows printable ASCII, newline and END only."""
    m = tok.generation_mask()
    assert m.shape == (VOCAB_SIZE,) and m.dtype == bool
    allowed = set(np.flatnonzero(m).tolist())
    assert allowed == set(range(32, 127)) | {10, END}
