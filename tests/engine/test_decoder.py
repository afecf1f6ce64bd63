"""The decoder: chunked prefill == one-shot (lower-right mask), the is_causal trap, determinism."""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

import kvmesh.node.engine.decoder as model_mod
from kvmesh.node.engine.decoder import Decoder, ModelConfig, apply_rope, fingerprint, preset, rope_tables

CPU = torch.device("cpu")
# fp32 on CPU: chunking only reorders float sums, so results agree far below these.
LOGITS_ATOL = 1e-4
KV_ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny() -> Decoder:
    return Decoder.seeded(preset("tiny", max_context=512), torch.float32, CPU)


@pytest.fixture(scope="module")
def tiny_gqa() -> Decoder:
    return Decoder.seeded(preset("tiny", n_kv_heads=2, max_context=512), torch.float32, CPU)


def _ws(m: Decoder) -> torch.Tensor:
    c = m.cfg
    return torch.zeros(c.n_layers, 2, c.n_kv_heads, c.max_context, c.head_dim)


def _tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _prefill(m: Decoder, toks: torch.Tensor, bounds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill toks in chunks [bounds[i], bounds[i+1]); returns (last logits, workspace)."""
    ws = _ws(m)
    logits = None
    for lo, hi in zip(bounds, bounds[1:]):
        logits = m(toks[lo:hi], ws, lo)
    assert logits is not None
    return logits, ws


N = 300
CHUNKINGS = {
    "two": [0, 128, N],
    "uneven": [0, 100, 101, 229, N],  # includes a one-token chunk mid-prefill
    "many": [0, 17, 64, 65, 190, 250, 299, N],
}


@pytest.mark.parametrize("which", ["tiny", "tiny_gqa"])
@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_chunked_prefill_equals_one_shot(request: pytest.FixtureRequest, which: str, chunking: str) -> None:
    """Prefill in chunks (lower-right mask after the first) gives the one-shot logits and KV (fp32, atol 1e-4/1e-5)."""
    m: Decoder = request.getfixturevalue(which)
    toks = _tokens(N)
    ref_logits, ref_ws = _prefill(m, toks, [0, N])
    logits, ws = _prefill(m, toks, CHUNKINGS[chunking])
    assert logits.shape == (m.cfg.vocab_size,) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref_logits, atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(ws[:, :, :, :N], ref_ws[:, :, :, :N], atol=KV_ATOL, rtol=0)
    assert int(ws[:, :, :, N:].count_nonzero()) == 0  # nothing written past the prompt


def test_decode_steps_equal_prefill(tiny: Decoder) -> None:
    """Prefill then one-token decode steps reproduce the one-shot logits of the longer sequence."""
    toks = _tokens(80, seed=1)
    ref, _ = _prefill(tiny, toks, [0, 80])
    ws = _ws(tiny)
    tiny(toks[:75], ws, 0)
    for pos in range(75, 80):
        logits = tiny(toks[pos : pos + 1], ws, pos)
    torch.testing.assert_close(logits, ref, atol=LOGITS_ATOL, rtol=0)


def test_is_causal_is_wrong_for_a_later_chunk() -> None:
    """For a chunk at start>0, is_causal=True (top-left) differs from true attention; the lower-right mask matches it."""
    g = torch.Generator().manual_seed(0)
    heads, d, start, q_len = 2, 16, 40, 8
    end = start + q_len
    q = torch.randn(1, heads, q_len, d, generator=g)
    k = torch.randn(1, heads, end, d, generator=g)
    v = torch.randn(1, heads, end, d, generator=g)
    # Reference: query i sits at absolute position start+i and attends to keys 0..start+i.
    ref = torch.empty_like(q)
    for i in range(q_len):
        s = (q[:, :, i : i + 1] @ k[:, :, : start + i + 1].transpose(-1, -2)) / math.sqrt(d)
        ref[:, :, i] = (s.softmax(-1) @ v[:, :, : start + i + 1])[:, :, 0]
    # The mask the model builds for a later chunk.
    mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
    good = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(good, ref, atol=1e-5, rtol=0)
    # The trap: is_causal aligns the triangle top-left, so query 0 sees only key 0.
    wrong = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (wrong - ref).abs().max() > 1e-2
    torch.testing.assert_close(wrong[:, :, 0], v[:, :, 0], atol=1e-6, rtol=0)


def test_is_causal_in_the_model_breaks_chunked_prefill(tiny: Decoder, monkeypatch: pytest.MonkeyPatch) -> None:
    """Swapping the later-chunk mask for is_causal=True makes chunked logits diverge from one-shot."""
    toks = _tokens(N)
    ref, _ = _prefill(tiny, toks, [0, N])
    real = F.scaled_dot_product_attention

    def is_causal_everywhere(q, k, v, attn_mask=None, is_causal=False, enable_gqa=False):  # type: ignore[no-untyped-def]
        if attn_mask is not None:
            return real(q, k, v, is_causal=True, enable_gqa=enable_gqa)
        return real(q, k, v, is_causal=is_causal, enable_gqa=enable_gqa)

    monkeypatch.setattr(model_mod, "F", types.SimpleNamespace(scaled_dot_product_attention=is_causal_everywhere, silu=F.silu))
    monkeypatch.setattr(model_mod, "_flash_cpu", None)  # take the explicit-mask path
    bad, _ = _prefill(tiny, toks, [0, 128, N])
    assert (bad - ref).abs().max() > 1e-2


def test_seeded_weights_are_deterministic() -> None:
    """Two models seeded from the same config have identical weights and identical logits."""
    cfg = preset("tiny", max_context=128)
    a = Decoder.seeded(cfg, torch.float32, CPU)
    b = Decoder.seeded(cfg, torch.float32, CPU)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
    toks = _tokens(50)
    assert torch.equal(a(toks, _ws(a), 0), b(toks, _ws(b), 0))
    c = Decoder.seeded(preset("tiny", max_context=128, seed=99), torch.float32, CPU)
    assert not torch.equal(a.lm_head.weight, c.lm_head.weight)


def test_fingerprint_names_what_makes_caches_interchangeable() -> None:
    """The fingerprint is stable and changes with dtype, block size, seed and geometry."""
    cfg = preset("tiny")
    fp = fingerprint(cfg, torch.float32, 256)
    assert fp == fingerprint(preset("tiny"), torch.float32, 256)
    others = {
        fingerprint(cfg, torch.bfloat16, 256),
        fingerprint(cfg, torch.float32, 64),
        fingerprint(preset("tiny", seed=1), torch.float32, 256),
        fingerprint(preset("tiny", n_kv_heads=2), torch.float32, 256),
    }
    assert fp not in others and len(others) == 4


def test_presets_and_kv_size() -> None:
    """tiny is 4 layers x d_model 256 (~4 KiB KV/token in bf16); an unknown preset is a KeyError."""
    cfg = preset("tiny")
    assert (cfg.n_layers, cfg.d_model) == (4, 256)
    assert cfg.kv_bytes_per_token(torch.bfloat16) == 4096
    assert cfg.kv_bytes_per_token(torch.float32) == 8192
    assert preset("tiny", max_context=100).max_context == 100
    with pytest.raises(KeyError):
        preset("huge")


def test_rope_is_a_relative_rotation() -> None:
    """RoPE preserves norms and makes q.k depend only on the position offset."""
    cfg = ModelConfig(head_dim=16, max_context=64)
    cos, sin = rope_tables(cfg, CPU)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, 16, generator=g)
    k = torch.randn(1, 1, 1, 16, generator=g)

    def at(x: torch.Tensor, p: int) -> torch.Tensor:
        return apply_rope(x, cos[p : p + 1], sin[p : p + 1])

    torch.testing.assert_close(at(q, 7).norm(), q.norm())
    d1 = (at(q, 10) * at(k, 3)).sum()
    d2 = (at(q, 40) * at(k, 33)).sum()
    torch.testing.assert_close(d1, d2, atol=1e-4, rtol=0)
    assert not torch.allclose((at(q, 10) * at(k, 3)).sum(), (at(q, 10) * at(k, 5)).sum())
